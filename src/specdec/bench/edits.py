"""The edit benchmark (`--tasks edits`): apply a stated change to a real piece of code, with the
code as the prediction (issue 46).

Source and rule. Each task names a module of the CPython standard library; its code is the first
top-level function or class of that module, in source order, whose source (decorators included)
spans 30 to 150 lines, read unchanged from the running interpreter's own library at run time
(nothing of it is copied here). `EDIT_TASKS` records the name the rule picked on CPython 3.11.7;
a library where it picks another name is an error, so every run measures the same code.

The edit requests below were written, and committed, before any measurement. The prompt asks for
the whole updated code in one fenced block; the prediction is the original code.

Reporting. Each task's changed-line fraction is 1 - difflib's ratio between the lines of the plain
baseline's output (its fence lines dropped) and the prediction's lines; the tasks are binned by it
(<= 5%, 5-15%, 15-25%, > 25%) and each configuration's speed is given per bin (`to_markdown`).
Give --max-tokens room for the whole answer (the longest code is 150 lines, about 1,500 tokens): an
answer cut short counts the code it did not reach as changed.
"""

from __future__ import annotations

import ast
import difflib
import sysconfig
from pathlib import Path

from ..errors import InvalidRequestError

MIN_LINES, MAX_LINES = 30, 150
PYTHON = "CPython 3.11.7"  # where the names below were picked by the rule

# (module, the function or class the rule picks there, the edit request)
EDIT_TASKS: tuple[tuple[str, str, str], ...] = (
    ("bisect", "bisect_right", "Rename the parameter `x` to `item` everywhere, the docstring included."),
    ("copy", "copy", "Add type hints to the signature: `x: object` and a return type of `object`."),
    ("difflib", "get_close_matches", "Add a keyword-only parameter `key=None`: when it is given, compare "
     "`key(x)` with `word` instead of `x` itself, and document it in the docstring."),
    ("getopt", "getopt", "Rename the local variable `opts` to `options` everywhere."),
    ("glob", "_iglob", "Rename the parameter `dironly` to `dirs_only` everywhere."),
    ("gzip", "open", "Raise ValueError('compresslevel must be in 0..9') when compresslevel is not an "
     "integer from 0 to 9, before anything else is done."),
    ("heapq", "merge", "Rename the local variable `h` to `heap` everywhere (and `h_append` to `heap_append`)."),
    ("ipaddress", "ip_interface", "Add type hints: `address: str | int | bytes`, returning "
     "`IPv4Interface | IPv6Interface`."),
    ("locale", "format_string", "Rename the parameter `val` to `value` everywhere."),
    ("operator", "length_hint", "Write the three error messages as f-strings instead of % formatting."),
    ("textwrap", "dedent", "Add type hints: `text: str` returning `str`, and annotate `margin` as `str | None` "
     "where it is first assigned."),
    ("types", "prepare_class", "Add a last paragraph to the docstring: 'The kwds mapping given is never "
     "modified.'"),
    ("typing", "_type_check", "Rename the parameter `msg` to `message` everywhere."),
    ("uuid", "_find_mac_near_keyword", "Add a keyword-only parameter `default=None`, returned instead of "
     "None when no MAC address is found."),
    ("base64", "_b32encode", "Rename the local variable `leftover` to `remainder` everywhere."),
    ("ast", "literal_eval", "Add type hints to the outer function only: `node_or_string: str | AST`, "
     "returning `object`."),
    ("abc", "update_abstractmethods", "Rename the local variable `abstracts` to `abstract_names` everywhere."),
    ("filecmp", "cmp", "Add type hints: `f1: str`, `f2: str`, `shallow: bool = True`, returning `bool`."),
    ("linecache", "updatecache", "Rename the local variable `fullname` to `full_path` everywhere."),
    ("statistics", "_sum", "Rename the local variables `partials` and `partials_get` to `parts` and "
     "`parts_get` everywhere."),
    ("tabnanny", "check", "Replace every % string formatting in the function by an f-string."),
    ("warnings", "_formatwarnmsg_impl", "Rename the local variable `s` to `text` everywhere."),
    ("weakref", "WeakMethod", "Add type hints to `__new__`, `__call__`, `__eq__` and `__ne__` (use `object` "
     "where the type is not clear)."),
    ("zipfile", "_EndRecData64", "Rename the parameter `fpin` to `file` everywhere."),
    ("quopri", "encode", "Rename the inner function `write` to `write_line` and update its calls."),
    ("dis", "dis", "Rename the parameter `x` to `obj` everywhere, the docstring included."),
    ("configparser", "ParsingError", "Rename the attribute `errors` to `problems` everywhere."),
    ("contextlib", "_GeneratorContextManager", "Rename the parameter `typ` to `exc_type` everywhere."),
)

MESSAGE = ("Apply this change to the Python code below and reply with the whole updated code in one "
           "```python block, nothing else.\nChange: {request}\n\n```python\n{code}```")
BINS = ((0.0, 0.05, "<= 5%"), (0.05, 0.15, "5-15%"), (0.15, 0.25, "15-25%"), (0.25, 1.01, "> 25%"))


def task_code(module: str, name: str) -> str:
    """The code the rule picks in `module` (see the module docstring); an error naming the task
    where this Python's library picks another name or has no such module."""
    path = Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py"  # the source, even of a frozen module
    if not path.is_file():
        raise InvalidRequestError(f"edit task {module}: no {path} in this Python", "tasks")
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            if MIN_LINES <= node.end_lineno - start + 1 <= MAX_LINES:
                if node.name != name:
                    raise InvalidRequestError(f"edit task {module}: this Python's library picks {node.name!r}, "
                                              f"not {name!r} as on {PYTHON}", "tasks")
                return "".join(lines[start - 1 : node.end_lineno])
    raise InvalidRequestError(f"edit task {module}: no function or class of {MIN_LINES}-{MAX_LINES} lines", "tasks")


def edit_prompts(per_group: int, template: str, chat: bool, make_prompt) -> list:
    """The tasks as prompts (`make_prompt(id, text, chat, prediction)`), `per_group` of them spread
    over the list (all for 0); the message goes through `template` unless `chat`."""
    picked = list(enumerate(EDIT_TASKS))
    if 0 < per_group < len(picked):
        picked = [picked[(i * len(picked)) // per_group] for i in range(per_group)]
    out = []
    for i, (module, name, request) in picked:
        code = task_code(module, name)
        message = MESSAGE.format(request=request, code=code)
        out.append(make_prompt(f"edits-{i + 1}-{module}", message if chat else template.format(prompt=message),
                               chat, code))
    return out


def strip_fence(text: str) -> str:
    """The code of an answer: its lines without a ``` fence line (```python opens, ``` closes)."""
    return "".join(line for line in text.splitlines(keepends=True) if not line.strip().startswith("```"))


def changed_fraction(output: str, prediction: str) -> float:
    """1 - difflib's ratio of the answer's lines (fences dropped) and the prediction's."""
    return 1.0 - difflib.SequenceMatcher(None, strip_fence(output).splitlines(), prediction.splitlines(),
                                         autojunk=False).ratio()


def bin_of(fraction: float) -> str:
    return next(label for low, high, label in BINS if (low == 0 and fraction <= high) or low < fraction <= high)


def to_markdown(result, prompts: list, decode) -> str:
    """Per bin of changed-line fraction, each configuration's tokens per second (all its runs' new
    tokens over their seconds), its speed over its plain baseline's and how many outputs were
    identical to it. `decode(ids)`: the target's tokenizer."""
    predictions = {p.id: p.prediction for p in prompts if getattr(p, "prediction", None)}
    if not predictions:
        return ""
    runs = [r for r in result.runs if r.prompt_id in predictions]
    base_text = {}
    for r in runs:
        if r.config in result.baselines.values() and (r.prompt_id, r.repeat) not in base_text:
            base_text[(r.prompt_id, r.repeat)] = decode(r.token_ids)
    fraction = {pid: changed_fraction(base_text.get((pid, 0), ""), pred) for pid, pred in predictions.items()}
    totals: dict[tuple[str, str], list[float]] = {}  # (config, bin) -> [tokens, seconds, identical, runs]
    for r in runs:
        t = totals.setdefault((r.config, bin_of(fraction[r.prompt_id])), [0.0, 0.0, 0, 0])
        t[0] += r.new_tokens
        t[1] += r.wall_s
        t[2] += bool(r.identical) or r.config == result.baselines.get(r.config)
        t[3] += 1
    lines = ["", "### Edits: by changed-line fraction", "",
             "| configuration | bin | tasks | tokens/s | x its baseline | identical |", "|---|---|---|---|---|---|"]
    for c in result.configs:
        for _, _, label in BINS:
            t = totals.get((c.label, label))
            if not t or not t[1]:
                continue
            base = totals.get((result.baselines.get(c.label), label))
            speed = t[0] / t[1]
            ratio = speed / (base[0] / base[1]) if base and base[1] else float("nan")
            tasks = sum(1 for f in fraction.values() if bin_of(f) == label)
            lines.append(f"| {c.label} | {label} | {tasks} | {speed:.1f} | {ratio:.2f} | {t[2]}/{t[3]} |")
    return "\n".join(lines) + "\n"

"""Benchmark prompts: Spec-Bench's task groups, a built-in code-continuation set, and user files.

Spec-Bench (`../shared/spec_bench/question.jsonl`) has one JSON object a line with `category` and
`turns`; the MT-bench questions are multi-turn and only the first turn is used (there is no earlier
answer to condition the second turn on). Its six task groups are the ones Spec-Bench reports:
`mt_bench` (the eight ten-question MT-bench categories together), translation, summarization, qa,
math_reasoning and rag. A single MT-bench category (`coding`, `writing`, ...) can also be asked for
as a group of its own.

`code` is a small set of code-continuation prompts written for this benchmark: code with the
repetition real code has (the same identifiers, parallel branches, test cases of one shape), which
is where lookup drafters are expected to pay.

`edits` (`edits.py`): 28 pieces of the CPython standard library, each with a change to apply; the
original code is each prompt's `prediction`, which configurations with the `prediction` flag draft
from (issue 46's edit benchmark). Not part of `all`, which stays Spec-Bench and `code`.

Selection is deterministic: N prompts per group, evenly spaced over the group in file order, so a
small N still spans the group rather than taking its first few near-identical items.

How a question becomes text. The default model is a *base* model (no chat template), so a question
is wrapped in a plain template, by default ``Question: {prompt}\nAnswer:``, which a base model
continues with an answer rather than with more questions. The same text (and so the same token
ids) goes to every configuration, peers included. The template applies to questions (Spec-Bench
`turns`, and `turns` in a --prompts file); a --prompts `prompt` string and the built-in code
prompts are continuations already and are fed as they are.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidRequestError

SPEC_BENCH_GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
BUILTIN_GROUPS = ("code", "edits")
DEFAULT_TASKS = "spec_bench"  # the six Spec-Bench groups
DEFAULT_TEMPLATE = "Question: {prompt}\nAnswer:"
# Aliases for --tasks: a name that stands for several groups.
TASK_ALIASES = {
    "spec_bench": SPEC_BENCH_GROUPS,
    "all": SPEC_BENCH_GROUPS + ("code",),
    "none": (),
}


@dataclass(frozen=True)
class BenchPrompt:
    """One prompt: text (tokenised by the target's tokenizer) or token ids (models without one)."""

    id: str
    group: str
    text: str | None = None
    ids: tuple[int, ...] | None = None
    chat: bool = False  # text is a user message, rendered with the target's chat template
    prediction: str | None = None  # the expected output (`edits`: the code to change), for `:prediction` configs


CODE_PROMPTS: tuple[str, ...] = (
    # 1: a small Python class with parallel methods; the continuation repeats its names and shape.
    '''class Inventory:
    """Items in stock, by name, with a unit price and a quantity."""

    def __init__(self):
        self.prices: dict[str, float] = {}
        self.quantities: dict[str, int] = {}

    def add(self, name: str, price: float, quantity: int = 1) -> None:
        if quantity < 0:
            raise ValueError(f"quantity must be >= 0, got {quantity}")
        self.prices[name] = price
        self.quantities[name] = self.quantities.get(name, 0) + quantity

    def remove(self, name: str, quantity: int = 1) -> None:
        if quantity < 0:
            raise ValueError(f"quantity must be >= 0, got {quantity}")
        if self.quantities.get(name, 0) < quantity:
            raise KeyError(f"not enough {name} in stock")
        self.quantities[name] -= quantity

    def total_value(self) -> float:
''',
    # 2: unit tests of one shape: each new test reuses the previous ones' structure.
    '''import unittest

from geometry import Rectangle


class RectangleTest(unittest.TestCase):
    def test_area_of_unit_square(self):
        rect = Rectangle(width=1, height=1)
        self.assertEqual(rect.area(), 1)

    def test_area_of_wide_rectangle(self):
        rect = Rectangle(width=4, height=2)
        self.assertEqual(rect.area(), 8)

    def test_perimeter_of_unit_square(self):
        rect = Rectangle(width=1, height=1)
        self.assertEqual(rect.perimeter(), 4)

    def test_perimeter_of_wide_rectangle(self):
''',
    # 3: JavaScript request handlers with the same validation pattern.
    '''const express = require("express");
const router = express.Router();

// GET /users/:id -> the user, or 404
router.get("/users/:id", async (req, res) => {
  const id = Number(req.params.id);
  if (!Number.isInteger(id) || id <= 0) {
    return res.status(400).json({ error: "id must be a positive integer" });
  }
  const user = await db.users.findById(id);
  if (!user) {
    return res.status(404).json({ error: "user not found" });
  }
  res.json(user);
});

// GET /orders/:id -> the order, or 404
router.get("/orders/:id", async (req, res) => {
''',
    # 4: C, a linked list: the second function mirrors the first.
    '''#include <stdlib.h>

struct node {
    int value;
    struct node *next;
};

/* Insert value at the head of the list; returns the new head. */
struct node *list_push(struct node *head, int value) {
    struct node *n = malloc(sizeof *n);
    if (n == NULL) {
        return head;
    }
    n->value = value;
    n->next = head;
    return n;
}

/* Number of nodes in the list. */
size_t list_length(const struct node *head) {
    size_t count = 0;
    for (const struct node *n = head; n != NULL; n = n->next) {
        count++;
    }
    return count;
}

/* Sum of the values in the list. */
long list_sum(const struct node *head) {
''',
)


def spec_bench_path(explicit: str | None = None) -> Path | None:
    """Where Spec-Bench's question.jsonl is: --spec-bench, $SPECDEC_SPEC_BENCH, or ../shared/."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get("SPECDEC_SPEC_BENCH"):
        return Path(os.environ["SPECDEC_SPEC_BENCH"]).expanduser()
    here = Path(__file__).resolve()
    candidates = [Path.cwd() / ".." / "shared" / "spec_bench" / "question.jsonl"]
    if len(here.parents) > 3:  # src/specdec/bench/prompts.py in a checkout: <repo>/../shared
        candidates.append(here.parents[3].parent / "shared" / "spec_bench" / "question.jsonl")
    for c in candidates:
        if c.is_file():
            return c
    return None


def parse_tasks(text: str | None) -> list[str]:
    """`--tasks` -> the list of groups, aliases expanded, order kept, duplicates dropped."""
    known = SPEC_BENCH_GROUPS + MT_BENCH_CATEGORIES + BUILTIN_GROUPS
    groups: list[str] = []
    for name in (text if text is not None else DEFAULT_TASKS).split(","):
        name = name.strip().lower()
        if not name:
            continue
        expanded = TASK_ALIASES.get(name, (name,))
        for g in expanded:
            if g not in known:
                raise InvalidRequestError(
                    f"unknown task {name!r}; choose from {', '.join(known + tuple(TASK_ALIASES))}", "tasks")
            if g not in groups:
                groups.append(g)
    return groups


def spread(items: list, n: int) -> list:
    """n items evenly spaced over `items` (all of them when n <= 0 or n >= len)."""
    if n <= 0 or n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def load_spec_bench(path: Path) -> list[dict]:
    return [row for _, row in _read_jsonl(path)]


def check_template(template: str) -> str:
    """A question template must hold `{prompt}` exactly once and nothing else in braces."""
    try:
        ok = template.count("{prompt}") == 1 and template.format(prompt="") is not None
    except (KeyError, IndexError, ValueError):
        ok = False
    if not ok:
        raise InvalidRequestError(
            f"--template {template!r} must contain {{prompt}} once (and no other {{...}}); "
            "'{prompt}' feeds questions unchanged", "template")
    return template


def select_prompts(groups: list[str], per_group: int, spec_bench: Path | None,
                   extra_files: list[str] | None = None, template: str = DEFAULT_TEMPLATE,
                   chat: bool = False) -> list[BenchPrompt]:
    """The benchmark's prompts: `per_group` of each selected group, then every prompt of the files.

    Questions are wrapped in `template` (see the module doc), or with `chat` go as the user's
    first turn through the model's chat template (instruct models); other text is used as it is.
    """
    check_template(template)
    if per_group < 0:
        raise InvalidRequestError("--per-group must be >= 0 (0 = every prompt of each group)", "per_group")
    prompts: list[BenchPrompt] = []
    needs_spec = [g for g in groups if g not in BUILTIN_GROUPS]
    rows: list[dict] = []
    if needs_spec:
        if spec_bench is None or not spec_bench.is_file():
            where = f" at {spec_bench}" if spec_bench else ""
            raise InvalidRequestError(
                f"Spec-Bench questions not found{where}; pass --spec-bench FILE (question.jsonl) or "
                "--tasks code", "spec_bench")
        rows = load_spec_bench(spec_bench)
    for group in groups:
        if group == "code":
            picked = spread(list(enumerate(CODE_PROMPTS)), per_group)
            prompts += [BenchPrompt(f"code-{i + 1}", "code", text=t) for i, t in picked]
            continue
        if group == "edits":  # `edits.py`: stdlib code to change, the code as the prediction
            from .edits import edit_prompts

            prompts += edit_prompts(per_group, template, chat,
                                    lambda pid, text, as_chat, code: BenchPrompt(pid, "edits", text=text, chat=as_chat,
                                                                                 prediction=code))
            continue
        cats = MT_BENCH_CATEGORIES if group == "mt_bench" else (group,)
        members = [r for r in rows if r.get("category") in cats]
        if not members:
            raise InvalidRequestError(f"{spec_bench}: no questions of task group {group!r}", "tasks")
        for r in spread(members, per_group):
            turns = r.get("turns") or []
            if not turns or not isinstance(turns[0], str):
                raise InvalidRequestError(f"{spec_bench}: question {r.get('question_id')} has no first turn", "tasks")
            prompts.append(BenchPrompt(f"{group}-{r.get('question_id')}", group,
                                       text=turns[0] if chat else template.format(prompt=turns[0]), chat=chat))
    for f in extra_files or []:
        prompts += load_prompt_file(Path(f).expanduser(), template, chat)
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise InvalidRequestError(f"prompt id {p.id!r} occurs twice; give the prompts distinct ids", "prompts")
        seen.add(p.id)
    if not prompts:
        raise InvalidRequestError("no prompts selected: choose --tasks or give --prompts FILE.jsonl", "tasks")
    return prompts


def load_prompt_file(path: Path, template: str = DEFAULT_TEMPLATE, chat: bool = False) -> list[BenchPrompt]:
    """A user file: one JSON object a line with `prompt` (text, used as it is), `turns` (a question:
    the first turn, wrapped in `template`, or with `chat` the user's message in the chat template)
    or `prompt_ids`; optional `group` (or `category`, default: the file's name) and `id`."""
    out = []
    for n, r in _read_jsonl(path):  # n: the line number, for messages and default ids
        group = str(r.get("group") or r.get("category") or path.stem)
        pid = str(r.get("id", r.get("question_id", f"{path.stem}-{n}")))
        if "prompt_ids" in r:
            ids = r["prompt_ids"]
            if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
                raise InvalidRequestError(f"{path}:{n}: prompt_ids must be a non-empty list of token ids", "prompts")
            out.append(BenchPrompt(pid, group, ids=tuple(ids)))
            continue
        text, is_turn = r.get("prompt"), False
        if text is None and isinstance(r.get("turns"), list) and r["turns"] and isinstance(r["turns"][0], str):
            is_turn = True
            text = (r["turns"][0] if chat else template.format(prompt=r["turns"][0])) if r["turns"][0] else ""
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"{path}:{n}: needs a `prompt` string, `turns` list or `prompt_ids`", "prompts")
        out.append(BenchPrompt(pid, group, text=text, chat=chat and is_turn))
    if not out:
        raise InvalidRequestError(f"{path}: no prompts in the file", "prompts")
    return out


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InvalidRequestError(f"prompts file not found: {path}", "prompts") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read prompts file {path}: {exc}", "prompts") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{path}:{n}: not valid JSON ({exc.msg})", "prompts") from None
        if not isinstance(row, dict):
            raise InvalidRequestError(f"{path}:{n}: expected a JSON object", "prompts")
        rows.append((n, row))
    return rows

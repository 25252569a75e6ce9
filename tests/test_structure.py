"""The shape of the source tree, read with `ast` (nothing imported): no import circle between the
modules of src/specdec.

Every import counts, including those inside functions: a lazy import hides an edge of the graph
from a reader but not from the design (the two modules still need each other). A guarded import of
an optional extra (ray, fastapi, llguidance, matplotlib, ...) is an edge to a third-party module and
never part of a circle among ours, so counting them costs nothing. An import under
`if TYPE_CHECKING:` counts as well: a type in a signature is a dependency too.

`oversized(...)` lists functions over 80 lines and modules over 800 lines, for the size rules of
issue 43 (`python -c 'import sys; sys.path[:0] = ["tests"]; import test_structure as t; print(*t.oversized(), sep="\\n")'`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "specdec"


def modules(root: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package (a package is its __init__)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports anywhere in its body.

    `from X import y` names X.y when that is a module of ours (a submodule), else X itself."""
    base = name.split(".") if _is_package(path) else name.split(".")[:-1]  # what `.` means here
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                source = ".".join(anchor + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.add(sub if sub in known else source)
    # `import a.b.c` also imports a and a.b; only the named module is the dependency we mean.
    return {m for m in out if m in known and m != name}


def import_graph(root: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: imported(name, path, known) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted; a
    component is every module that can reach every other through imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def oversized(root: Path = SRC, package: str = PACKAGE, max_function: int = 80,
              max_module: int = 800) -> list[str]:
    """'path: N lines' for each module over `max_module` lines and 'path:line name: N lines' for
    each function (method, nested function) over `max_function` lines, decorators and docstring
    included."""
    out = []
    for path in modules(root, package).values():
        text = path.read_text()
        rel = path.relative_to(root)
        lines = len(text.splitlines())
        if lines > max_module:
            out.append(f"{rel}: {lines} lines")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > max_function:
                    out.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    return out


@pytest.mark.fast
def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 30 and graph["specdec.engine"]  # the tree was found and its imports read
    assert circles(graph) == []


@pytest.mark.fast
def test_the_circle_finder_sees_circles_and_lazy_imports(tmp_path):
    """The checker has power: a circle closed only by an import inside a function, through a
    relative `from . import`, is found; a one-way graph is not a circle."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("import os\n\ndef f():\n    from .. import a\n    return a\n")
    (pkg / "c.py").write_text("from pkg.sub.b import f\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.sub.b"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("import os\n")
    assert circles(import_graph(tmp_path, "pkg")) == []


@pytest.mark.fast
def test_no_module_or_function_over_the_size_rules():
    """Issue 43's size rules: no module over 800 lines, no function (method, nested function) over
    80, in src/specdec (bench and train included; the C++ kernels are not Python)."""
    assert oversized() == []


K_NAMES = {"k", "num_speculative_tokens", "draft_k"}
K_OPTIONS = {"-k", "--k", "--num-speculative-tokens", "--draft-k"}


def k_defaults(root: Path = SRC, package: str = PACKAGE) -> list[str]:
    """'module:line' for every place that writes a default draft length k as a number: a parameter
    or a dataclass field named like k with an integer default, a `DEFAULT...` constant of k, an
    argparse option for k with `default=<int>`."""
    out = []
    for name, path in modules(root, package).items():
        tree = ast.parse(path.read_text(), str(path))
        # Assignments count at module and class level only (a constant, a dataclass field); inside
        # a function `k = 0` is a value, not a default.
        top = {id(n) for scope in [tree] + [c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
               for n in scope.body}
        for node in ast.walk(tree):
            found = False
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + list(node.args.defaults) \
                    + list(node.args.kw_defaults)
                found = any(a.arg in K_NAMES and isinstance(d, ast.Constant) and type(d.value) is int
                            for a, d in zip(args, defaults))
            elif isinstance(node, (ast.AnnAssign, ast.Assign)) and id(node) in top:
                targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                value = node.value
                found = isinstance(value, ast.Constant) and type(value.value) is int and any(
                    n in K_NAMES or ("DEFAULT" in n and ("SPECULATIVE_TOKENS" in n or n.endswith("_K"))) for n in names)
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags = {a.value for a in node.args if isinstance(a, ast.Constant)}
                found = bool(flags & K_OPTIONS) and any(
                    kw.arg == "default" and isinstance(kw.value, ast.Constant) and type(kw.value.value) is int
                    for kw in node.keywords)
            if found:
                out.append(f"{name}:{node.lineno}")
    return out


@pytest.mark.fast
def test_the_default_k_is_written_once(tmp_path):
    """The default draft length is one constant (settings.DEFAULT_NUM_SPECULATIVE_TOKENS); every
    other default refers to it. The finder has power: a parameter, a field and an option that
    write their own number are found."""
    assert k_defaults() == ["specdec.settings:" + str(_line_of(SRC / PACKAGE / "settings.py",
                                                               "DEFAULT_NUM_SPECULATIVE_TOKENS ="))]
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from dataclasses import dataclass\n\ndef f(x, k=5):\n    return x\n\n"
                              "@dataclass\nclass S:\n    num_speculative_tokens: int = 4\n\n"
                              "def g(p):\n    p.add_argument('--num-speculative-tokens', type=int, default=5)\n")
    assert k_defaults(tmp_path, "pkg") == ["pkg.a:3", "pkg.a:8", "pkg.a:11"]


def _line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(text))

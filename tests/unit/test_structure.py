"""The package stays easy to read: no import cycle inside zerotrain/ (imports inside functions and
importlib.import_module count, `if TYPE_CHECKING:` imports do not), and no module over 450 lines."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"
MAX_LINES = 450


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for p in root.rglob("*.py"):
        parts = p.with_suffix("").relative_to(root.parent).parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _absolute(module: str | None, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return module or ""
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _type_checking_only(tree: ast.AST) -> set[int]:
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
            for n in ast.walk(node)}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in the file)."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_only(tree)
        is_package = path.name == "__init__.py"
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            targets: list[str] = []
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = _absolute(n.module, n.level, m, is_package)
                targets = [base] + [f"{base}.{a.name}" for a in n.names]
            elif isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "import_module" \
                    and n.args and isinstance(n.args[0], (ast.Constant, ast.JoinedStr)):
                arg = n.args[0]
                prefix = arg.value if isinstance(arg, ast.Constant) else "".join(
                    v.value for v in arg.values if isinstance(v, ast.Constant))
                targets = [t for t in mods if t.startswith(prefix)]  # a dynamic import may reach any of them
            graph[m].update(t for t in targets if t in mods and t != m and not m.startswith(t + "."))
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_sees_function_level_and_dynamic_imports(tmp_path):
    pkg = tmp_path / "zerotrain"
    (pkg / "commands").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "commands" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    (pkg / "cli.py").write_text("import importlib\ndef g(n):\n    return importlib.import_module(f'zerotrain.commands.{n}')\n")
    (pkg / "commands" / "run.py").write_text("from ..cli import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import X\n")
    (pkg / "d.py").write_text("from .c import TYPE_CHECKING\n")
    assert cycles(import_graph(pkg)) == [["zerotrain.a", "zerotrain.b"], ["zerotrain.cli", "zerotrain.commands.run"]]


def test_no_module_over_450_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}

"""The package stays a house by concern (README.md "Layout", docs/architecture.md): every import goes down the
layer table below, no import cycle of any kind (imports at module level, inside functions, under
`if TYPE_CHECKING:`, and importlib.import_module with a constant name all count), few modules at the top of
zerotrain/ and per folder. No module is above LONG_MODULE lines."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "util"),           # the user-error classes; small helpers that import nothing of zerotrain
    ("tasks",),                   # the task registry: one TaskSpec per task, read by every layer above
    ("assets",),                  # the embedded demo: tiny model presets, corpus, sentiment set
    ("config",),                  # RunConfig schema, the rules of a config on its own, the CLI flags
    ("distributed",),             # world layout, meshes by role, process group, collectives, agreement, JIT locks
    ("launch",),                  # launchers (their layout lines read distributed/layout.py)
    ("dist",),                    # the documented facade of distributed/process_group.py
    ("checkpoint",),              # the checkpoint directory protocol and the run directory
    ("data",),                    # datasets, tokenisation, packing, chat SFT
    ("model",),                   # model facts, building the model, LoRA / QAT preparation, pipeline blocks
    ("optim",),                   # optimizers made of several torch.optim ones (Muon + AdamW)
    ("plan",),                    # the resolved run plan, parallel rules, DeepSpeed JSON, engine table
    ("backends",),                # the engines: DeepSpeed (+ pipeline), FSDP2 (+ pipeline, tensor parallel)
    ("engine",),                  # build_engine: the documented entry point
    ("memory",),                  # estimate and measure memory
    ("train",),                   # preflight, the training loop, metrics, trackers
    ("export", "search"),         # HF / LoRA / quantized export | trials, tune, reports
    ("commands",),                # one module per CLI subcommand: parse, call, print
    ("cli",),
    ("__main__", ""),             # "" is zerotrain/__init__.py
)
"""Lowest first. A unit (a top-level module or a folder of zerotrain/) imports only itself and the units of
the layers before its own; two units in one layer do not import each other."""

MAX_TOP_MODULES = 8
MAX_FOLDER_MODULES = 12
LONG_MODULE = 600


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


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports, anywhere in the file (TYPE_CHECKING and function level too)."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        tree = ast.parse(path.read_text())
        is_package = path.name == "__init__.py"
        for n in ast.walk(tree):
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


def unit_of(module: str) -> str:
    """zerotrain.plan.resolve -> plan; zerotrain.cli -> cli; zerotrain -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    layer_of = {u: i for i, units in enumerate(layers) for u in units}
    out = []
    for m, targets in sorted(graph.items()):
        mu = unit_of(m)
        for t in sorted(targets):
            tu = unit_of(t)
            if tu == mu:
                continue
            if mu not in layer_of or tu not in layer_of:
                out.append(f"{m} -> {t}: unit '{mu if mu not in layer_of else tu}' is not in the layer table")
            elif layer_of[tu] >= layer_of[mu]:
                out.append(f"{m} -> {t}: '{mu}' (layer {layer_of[mu]}) may not import '{tu}' (layer {layer_of[tu]})")
    return out


def test_imports_follow_the_layers():
    assert layer_violations(import_graph()) == []


def test_no_import_cycle_of_any_kind():
    assert cycles(import_graph()) == []


def test_the_checks_see_type_only_function_level_and_dynamic_imports(tmp_path):
    pkg = tmp_path / "zerotrain"
    for d in ("commands", "config", "model"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from . import b\n")                      # function level
    (pkg / "b.py").write_text("from .a import f\n")
    (pkg / "cli.py").write_text("import importlib\ndef g(n):\n    return importlib.import_module(f'zerotrain.commands.{n}')\n")
    (pkg / "commands" / "run.py").write_text("from ..cli import g\n")                  # dynamic
    (pkg / "config" / "schema.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from ..model.facts import X\n")     # type-only, upward
    (pkg / "model" / "facts.py").write_text("from ..config.schema import TYPE_CHECKING\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["zerotrain.a", "zerotrain.b"], ["zerotrain.cli", "zerotrain.commands.run"],
                             ["zerotrain.config.schema", "zerotrain.model.facts"]]
    layers = (("config",), ("model",), ("a", "b"), ("commands",), ("cli",), ("",))
    assert layer_violations(graph, layers) == [
        "zerotrain.a -> zerotrain.b: 'a' (layer 2) may not import 'b' (layer 2)",  # same layer, other unit
        "zerotrain.b -> zerotrain.a: 'b' (layer 2) may not import 'a' (layer 2)",
        "zerotrain.commands.run -> zerotrain.cli: 'commands' (layer 3) may not import 'cli' (layer 4)",
        "zerotrain.config.schema -> zerotrain.model.facts: 'config' (layer 0) may not import 'model' (layer 1)"]


def test_few_modules_at_the_top_and_per_folder():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    crowded = {str(d.relative_to(PACKAGE)): n for d in PACKAGE.rglob("*") if d.is_dir() and d != PACKAGE
               and (n := len([p for p in d.glob("*.py") if p.name != "__init__.py"])) > MAX_FOLDER_MODULES}
    assert crowded == {}
    unknown = sorted(d.name for d in PACKAGE.iterdir() if d.is_dir() and (d / "__init__.py").exists()
                     and not any(d.name in units for units in LAYERS))
    assert unknown == [], "add the folder to LAYERS"


def test_no_module_is_long():
    """One concept per module, and none above LONG_MODULE lines: a module that grows past it is split by concern."""
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > LONG_MODULE}
    assert long == {}, f"split by concern (> {LONG_MODULE} lines): {long}"


ENGINE_CLASS_LINES = 450
"""The Engine base holds the backend only (checkpoint I/O, the HF export and the generation phase are modules of their
own: zerotrain/backends/checkpointing.py, hf_export.py, generation.py)."""
README_CHARS = 15_000
"""README.md is the landing page; detail lives in the guides under docs/."""


def test_the_engine_base_keeps_only_the_backend():
    tree = ast.parse((PACKAGE / "backends" / "base.py").read_text())
    engine = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    assert engine.end_lineno - engine.lineno + 1 <= ENGINE_CLASS_LINES


def test_the_readme_is_a_landing_page():
    assert len((PACKAGE.parent / "README.md").read_text()) <= README_CHARS

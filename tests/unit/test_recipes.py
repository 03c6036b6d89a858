"""The recipes (zerotrain/train/recipes/): every task names one that resolves, and the trainer stays the loop: Trainer.fit
reads top to bottom in at most 80 lines, imports nothing by name at run time, compares no task, objective or data-format
constant, and no train/ module outgrows 600 lines; one output type for every objective."""
from __future__ import annotations

import ast
from pathlib import Path

from zerotrain import tasks
from zerotrain.tasks import IMPLIED_TASKS, TASKS
from zerotrain.train.recipes.base import BatchSource, ObjectiveOutput, Recipe, recipe_class

TRAIN = Path(__file__).resolve().parents[2] / "zerotrain" / "train"
TRAINER = TRAIN / "trainer.py"
KIND_CONSTANTS = {name for name, value in vars(tasks).items() if name.isupper() and isinstance(value, str)}
"""TEXT, LM_LOSS, PAIR_LOSS, POLICY_GRADIENT, UNPAIRED, ...: the registry's data formats and objectives."""


def test_every_task_names_a_recipe_that_resolves():
    for spec in (*TASKS.values(), *IMPLIED_TASKS.values()):
        assert spec.recipe.startswith("zerotrain.train.recipes."), spec.name
        cls = recipe_class(spec.recipe)
        assert issubclass(cls, Recipe) and not getattr(cls, "__abstractmethods__", None), spec.name


def test_fit_reads_top_to_bottom_in_80_lines():
    tree = ast.parse(TRAINER.read_text())
    (fit,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "fit"]
    assert fit.end_lineno - fit.lineno + 1 <= 80


def test_the_trainer_imports_nothing_by_name_and_branches_on_no_kind():
    tree = ast.parse(TRAINER.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "importlib" not in imported and "import_module" not in TRAINER.read_text()
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("tasks")
             for a in n.names}
    assert not names & KIND_CONSTANTS, "the trainer compares no task, objective or data format: the recipe does"
    compared = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare)
                for side in (n.left, *n.comparators) if isinstance(side, ast.Name) and side.id in KIND_CONSTANTS]
    assert compared == []
    for attr in ("online", "stream", "_stream_done", "_stream_next"):
        assert f"self.{attr}" not in TRAINER.read_text(), attr


def test_train_modules_stay_under_600_lines():
    long = {str(p.relative_to(TRAIN)): n for p in TRAIN.rglob("*.py") if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


def test_one_output_type():
    """No objective re-implements ModelOutput's get / __getitem__: they all return ObjectiveOutput."""
    for path in TRAIN.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name != ObjectiveOutput.__name__:
                methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
                assert "__getitem__" not in methods, f"{path.name}: {node.name}"
    out = ObjectiveOutput(loss=__import__("torch").tensor(1.0), sums={})
    assert out["loss"] is out.loss and out.get("aux_loss") is None and out.get("nothing", 3) == 3


def test_a_source_fetches_ahead_unless_it_generates():
    from zerotrain.train.recipes.online_rl import GenerationSource
    from zerotrain.train.recipes.sources import MapSource, StreamSource

    assert MapSource.ahead and StreamSource.ahead and not GenerationSource.ahead
    assert all(issubclass(c, BatchSource) for c in (MapSource, StreamSource, GenerationSource))

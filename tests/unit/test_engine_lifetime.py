"""The engines read by lifetime (issue 48): the model-preparation sequence is written once, in the base
(backends/base.py Engine._prepare_model), and every backend calls it; no backend module re-derives the device
(plan.device is the owner: plan/resolve.py run_device); the offline checkpoint readers live in checkpoint_io.py,
not in the engine modules. Source checks (AST), each shown to fail on a snippet that breaks it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"
BACKENDS = PACKAGE / "backends"
BASE = BACKENDS / "base.py"
PREPARATION_STEPS = ("preparation.apply", "_watch_router", "_use_sequence_parallel", "_compile")
"""The sequence in its order: LoRA/QAT, the router watch, sequence parallelism, --compile."""


def _receiver_bindings(tree: ast.AST) -> set[str]:
    """Names bound to an expression ending in `.preparation` (so `prep = self.plan.preparation; prep.apply(m)`
    is still seen)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            if ast.unparse(node.value).endswith("preparation"):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def preparation_calls(source: str) -> list[tuple[int, str]]:
    """(line, step) of every call of a preparation step in the source."""
    tree = ast.parse(source)
    bound = _receiver_bindings(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, receiver = node.func.attr, ast.unparse(node.func.value)
        if attr == "apply" and (receiver.endswith("preparation") or receiver in bound):
            out.append((node.lineno, "preparation.apply"))
        elif attr in PREPARATION_STEPS:
            out.append((node.lineno, attr))
    return sorted(out)


def device_probes(source: str) -> list[int]:
    """Lines that ask torch whether a device exists (torch.cuda.is_available(), torch.accelerator.is_available(),
    an imported or aliased is_available) instead of reading plan.device."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name == "is_available":
                lines.append(node.lineno)
    return lines


def _backend_modules() -> list[Path]:
    return sorted(p for p in BACKENDS.rglob("*.py") if p != BASE)


def test_preparation_sequence_lives_only_in_the_base():
    offenders = {str(p.relative_to(PACKAGE)): calls for p in _backend_modules()
                 if (calls := preparation_calls(p.read_text()))}
    assert not offenders, f"call Engine._prepare_model instead of its steps: {offenders}"
    base = ast.parse(BASE.read_text())
    prepare = next(n for n in ast.walk(base) if isinstance(n, ast.FunctionDef) and n.name == "_prepare_model")
    steps = [step for _, step in preparation_calls(ast.unparse(prepare))]
    assert steps == list(PREPARATION_STEPS), steps  # once each, in this order


@pytest.mark.parametrize("module,cls", [("deepspeed/engine.py", "DeepSpeedEngine"), ("fsdp/engine.py", "FSDPEngine"),
                                        ("deepspeed/pipeline.py", "DeepSpeedPipelineEngine"),
                                        ("fsdp/pipeline.py", "FSDPPipelineEngine")])
def test_both_engines_prepare_through_the_base(module, cls):
    tree = ast.parse((BACKENDS / module).read_text())
    init = next(f for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == cls
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    called = [n.func.attr for n in ast.walk(init) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    assert called.count("_prepare_model") == 1, f"{cls}.__init__ must call self._prepare_model once"


def test_the_preparation_check_fails_on_a_backend_that_prepares_by_itself():
    snippet = ("class E:\n    def __init__(self, model):\n        prep = self.plan.preparation\n"
               "        model = prep.apply(model)\n        self.plan.preparation.apply(model)\n"
               "        self._watch_router(model)\n        self._use_sequence_parallel(model)\n"
               "        self._compile(model)\n        self.plan.preparation.uses_lora\n")
    assert [step for _, step in preparation_calls(snippet)] == ["preparation.apply", "preparation.apply",
                                                                "_watch_router", "_use_sequence_parallel", "_compile"]
    assert preparation_calls("model = self._prepare_model(model)\nx = self.plan.preparation.uses_lora\n") == []


def test_backends_read_the_device_from_the_plan():
    offenders = {str(p.relative_to(PACKAGE)): lines for p in [BASE, *_backend_modules()]
                 if (lines := device_probes(p.read_text()))}
    assert not offenders, f"read plan.device (plan/resolve.py run_device owns the probe): {offenders}"


def test_the_device_check_fails_on_a_probe():
    snippet = ("import torch\nfrom torch.cuda import is_available\ncuda = torch.cuda.is_available()\n"
               "acc = torch.accelerator.is_available()\nc = torch.cuda\nc.is_available()\nis_available()\n")
    assert device_probes(snippet) == [3, 4, 6, 7]
    assert device_probes("cuda = self.plan.device == 'cuda'\n") == []


def test_engine_modules_hold_no_offline_readers():
    """The exporters and adapter readers plan/registry.py names exist; the data-parallel engines' live in
    checkpoint_io.py (the DeepSpeed pipeline's exporter rebuilds its layers: deepspeed/pipeline.py)."""
    from zerotrain.plan.registry import ENGINES, _function

    for kind in ENGINES:
        for ref in (kind.exporter, kind.adapter_reader):
            if ref is not None:
                assert ref.split(":")[0].endswith(".checkpoint_io") or kind.checkpoint_format == "deepspeed-pipe", ref
                assert callable(_function(ref))
    for module in ("deepspeed/engine.py", "fsdp/engine.py", "fsdp/pipeline.py"):
        defined = {n.name for n in ast.parse((BACKENDS / module).read_text()).body if isinstance(n, ast.FunctionDef)}
        assert not defined & {"export_checkpoint", "load_full_model", "load_trainable", "read_adapter",
                              "load_full_state_dict", "convert_to_universal"}, module


def test_auxiliary_models_are_held_by_role_and_released_once():
    """Engine.auxiliary / release_auxiliary around the backend hooks (no process group: the hooks are fakes)."""
    from types import SimpleNamespace

    from zerotrain.backends.base import AuxiliaryModel, Engine

    dropped: list = []
    engine = SimpleNamespace(auxiliaries={}, _build_frozen=lambda factory: factory(), _drop_frozen=dropped.append)
    held = Engine.auxiliary(engine, "reference", lambda: "copy")
    assert held == AuxiliaryModel("reference", "copy") and engine.auxiliaries == {"reference": held}
    with pytest.raises(RuntimeError, match="already holds a reference model"):
        Engine.auxiliary(engine, "reference", lambda: "another")
    with pytest.raises(ValueError, match="unknown auxiliary model role 'critic'"):
        Engine.auxiliary(engine, "critic", lambda: "copy")
    Engine.release_auxiliary(engine, "reference")
    Engine.release_auxiliary(engine, "reference")  # nothing held: a no-op (a precomputed or adapter-off reference)
    assert dropped == ["copy"] and engine.auxiliaries == {}
    Engine.auxiliary(engine, "reference", lambda: "again")
    Engine.release_auxiliary(engine)  # close: every role
    assert dropped == ["copy", "again"] and engine.auxiliaries == {}

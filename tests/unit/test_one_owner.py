"""One owner per fact (issue 29): the plan's resolver is the only reader of the config fields it resolves,
engines never replace their plan after construction, and every command sizes the model `train` builds."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"

RESOLVED = {
    "backend": None,  # cfg.backend -> plan.backend (resolve.select_backend)
    "zero": {"stage", "offload_optimizer", "offload_param", "leaf_blocks", "reduce_bucket_size",
             "allgather_bucket_size", "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters",
             "reduce_scatter", "overlap_comm"},
    "parallel": {"tp", "pp", "sp", "ep"},  # -> plan.parallel (run_plan.degrees), plan.layout
    "batch": {"micro_batch", "grad_accum", "global_batch"},
    "run": {"max_steps", "epochs"},
    "optimizer": {"lr"},
    "precision": {"dtype"},
    "lora": {"r", "alpha", "dropout", "targets", "merge"},  # -> plan.preparation (zerotrain/model/preparation.py)
    "quant": {"qat"},
    "model": {"fused_loss"},  # -> plan.preparation.fused_loss / fused_loss_on (model/preparation.py from_config)
    "pref": {"beta", "ref_model", "precompute_ref"},  # -> tasks.TaskSpec.beta / .reference (a ReferencePlan)
}
"""RunConfig fields the plan resolves (section -> fields): everyone else reads plan.sharding, plan.comm,
plan.parallel / plan.layout, plan.batch, plan.total_steps, plan.lr, plan.dtype, plan.backend,
plan.preparation (LoRA, QAT, the fused loss); the task registry (zerotrain/tasks.py) resolves pref.beta's default and
the reference (TaskSpec.beta, TaskSpec.reference)."""

RESOLVER = {"config/schema.py", "config/rules.py", "config/flags.py", "plan/run_plan.py", "plan/parallel_rules.py",
            "plan/resolve.py", "model/preparation.py", "tasks.py"}
"""The schema, its flags, the validity rules and the resolver itself (model/preparation.py: LoRA / QAT / fused
loss; tasks.py: the task-dependent pref.* settings)."""


def _config_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, expression) of every read of a resolved field through a RunConfig (not through a plan)."""
    def from_plan(node: ast.expr) -> bool:
        return ast.unparse(node).split(".")[-1].endswith("plan") or ast.unparse(node).endswith(".batch") and \
            ast.unparse(node).split(".")[-2].endswith("plan")

    aliases: dict[str, str] = {}  # z = cfg.zero -> {"z": "zero"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            pairs = []
            if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(node.targets[0].elts, node.value.elts))
            else:
                pairs = [(t, node.value) for t in node.targets]
            for target, value in pairs:
                if (isinstance(target, ast.Name) and isinstance(value, ast.Attribute) and value.attr in RESOLVED
                        and not from_plan(value.value)):
                    aliases[target.id] = value.attr
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(node.ctx, ast.Store):
            continue
        v = node.value
        if node.attr == "backend" and ast.unparse(v).endswith("cfg"):
            found.append((node.lineno, ast.unparse(node)))
            continue
        section = None
        if isinstance(v, ast.Attribute) and not from_plan(v.value):
            section = v.attr
        elif isinstance(v, ast.Name):
            section = aliases.get(v.id)
        fields = RESOLVED.get(section) if section else None
        if fields and node.attr in fields:
            found.append((node.lineno, ast.unparse(node)))
    return found


NOT_CONFIG = {("distributed/layout.py", "self.parallel")}
"""Reads that look like a config section and are not: WorldLayout.parallel is the plan's ParallelDegrees (the
resolved degrees, RunPlan.parallel), not cfg.parallel."""


def test_only_the_resolver_reads_resolved_config_fields():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in RESOLVER:
            continue
        for line, expr in _config_reads(ast.parse(path.read_text())):
            if (rel, expr.rsplit(".", 1)[0]) in NOT_CONFIG:
                continue
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {expr}")
    assert not offenders, "read the plan instead:\n" + "\n".join(offenders)


def test_the_checker_finds_config_reads():
    """The check above can fail: it sees direct reads, aliases and cfg.backend, and lets plan reads pass."""
    code = ("def f(cfg, plan):\n    z = cfg.zero\n    b = plan.batch\n    q = cfg.quant\n    return (z.stage, "
            "cfg.parallel.tp, cfg.backend, plan.batch.micro_batch, b.grad_accum, self.cfg.optimizer.lr, "
            "cfg.zero.nvme_path, cfg.lora.r > 0, q.qat, cfg.quant.group_size, plan.preparation.lora)\n")
    assert sorted(e for _, e in _config_reads(ast.parse(code))) == sorted(
        ["z.stage", "cfg.parallel.tp", "cfg.backend", "self.cfg.optimizer.lr", "cfg.lora.r", "q.qat"])


def test_engines_never_replace_their_plan():
    """Only the engine base assigns self.plan: in __init__ and in _adopt_model (once, during construction,
    for a plan resolved without the model); and no module but the resolver rewrites a plan."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign) and any(ast.unparse(t) == "self.plan" for t in node.targets):
                    if not (path.relative_to(PACKAGE).as_posix() == "backends/base.py" and fn.name in ("__init__", "_adopt_model")):
                        offenders.append(f"{path.name}:{node.lineno} ({fn.name}) assigns self.plan")
                if (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("replace") and node.args
                        and "plan" in ast.unparse(node.args[0]) and path.relative_to(PACKAGE).as_posix() not in RESOLVER):
                    offenders.append(f"{path.name}:{node.lineno} ({fn.name}) rewrites a plan")
    assert not offenders, "\n".join(offenders)


# --- every command sizes the model `train` builds ----------------------------------------------------

def _zt(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    from tests.support.launch import rank_env, run

    res = run([sys.executable, "-m", "zerotrain", *map(str, args)], timeout=300, env=rank_env(), cwd=cwd)
    if check:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def _train_banner_params(res: subprocess.CompletedProcess) -> int:
    import re

    # "zerotrain train: <model>, 1,234 parameters[ (N trainable)]"
    found = re.search(r"^zerotrain train: .*, ([\d,]+) parameters", res.stdout, re.M)
    assert found, res.stdout[-2000:]
    return int(found.group(1).replace(",", ""))


@pytest.fixture(scope="module")
def sized(tmp_path_factory):
    from zerotrain.assets.demo import build_tiny

    root = tmp_path_factory.mktemp("owner")
    model = build_tiny(root / "gpt2", "tiny-gpt2")
    rows = [("good film", "pos"), ("bad film", "neg"), ("a film", "neutral")] * 12
    (root / "three.csv").write_text("text,label\n" + "".join(f"{t},{lab}\n" for t, lab in rows))
    return root, model


CASES = {
    "seq-cls-3-labels": ["--task", "seq-cls", "--data", "three.csv"],
    "lora": ["--lora-r", "4", "--lora-targets", "c_attn"],
}


def _in_process(capsys, *args: str) -> tuple[int, str]:
    """A sizing command run in this process (no start-up cost: none of them launches ranks here)."""
    from zerotrain.cli import main

    code = main(list(map(str, args)))
    return code, capsys.readouterr().out


@pytest.mark.multirank
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_command_counts_the_parameters_train_builds(sized, case, capsys, monkeypatch):
    """train's banner, estimate --json, compare's report header and tune's report say the same parameter
    count for a seq-cls model with 3 labels (a head sized from the data) and for a LoRA run."""
    root, model = sized
    monkeypatch.chdir(root)
    flags = ["--model", str(model), *CASES[case], "--seq-len", "32"]
    train = _zt("train", *flags, "--max-steps", "1", "--micro-batch", "2", "--output", f"t-{case}", "--overwrite",
                cwd=root)
    n = _train_banner_params(train)
    code, out = _in_process(capsys, "estimate", *flags, "--json")
    assert code == 0 and json.loads(out)["num_params"] == n
    # compare: a grid point the rules refuse (tp 3 on 2 ranks) is reported without launching anything
    _in_process(capsys, "compare", *flags, "--tp", "3", "--stages", "0", "--output", f"c-{case}")
    assert f"{n:,} parameters" in (root / f"c-{case}" / "report.md").read_text()
    # tune: a limit nothing fits ends before any trial, with the predictions written
    code, _ = _in_process(capsys, "tune", *flags, "--memory-per-rank", "1MiB", "--nproc", "2", "--output", f"u-{case}")
    assert code == 2
    assert f"{n:,} parameters" in (root / f"u-{case}" / "report.md").read_text()
    if case == "lora":
        assert " trainable)" in train.stdout
    if case == "seq-cls-3-labels":  # the head has 3 rows, not the HF default of 2
        from zerotrain.model.facts import model_facts
        from zerotrain.tasks import task_spec
        assert n - model_facts(str(model), task_spec("seq-cls")).num_params == 64  # (3 - 2) x n_embd 64


@pytest.mark.multirank
def test_estimate_sizes_model_config_with_models_tokenizer(sized, capsys, monkeypatch):
    """--model A --model-config B trains B from scratch with A's tokenizer: estimate sizes B, as train does."""
    root, model = sized
    monkeypatch.chdir(root)
    flags = ["--model", str(model), "--model-config", "tiny-llama", "--seq-len", "32"]
    n = _train_banner_params(_zt("train", *flags, "--max-steps", "1", "--micro-batch", "2", "--output", "ab",
                                 "--overwrite", cwd=root))
    est = json.loads(_in_process(capsys, "estimate", *flags, "--json")[1])
    alone = json.loads(_in_process(capsys, "estimate", "--model", str(model), "--json")[1])
    assert est["num_params"] == n != alone["num_params"]


def test_world_layout_dims_and_the_combination_table():
    """One named layout (dp, sp, ep, tp, pp, after torchtitan's ParallelDims) and one table of the
    model-parallel combinations each backend runs."""
    from zerotrain.errors import ConfigError
    from zerotrain.distributed.layout import MESH_DIMS, WorldLayout
    from zerotrain.plan.capabilities import COMBINATIONS as PARALLEL_COMBINATIONS
    from zerotrain.plan.capabilities import check_combination

    lay = WorldLayout(8, tp=2, pp=2)
    assert lay.degrees == {"pp": 2, "dp": 2, "sp": 1, "tp": 2} and set(lay.degrees) == set(MESH_DIMS)
    assert lay.dp * lay.model_parallel == 8 and lay.parallel_dims == {"tp", "pp"}
    # rank order: tp innermost, then dp, then pp (as init_device_mesh(("pp", "dp", "tp")))
    assert [(lay.pp_stage(r), lay.dp_rank(r), lay.coordinate(r, "tp")) for r in range(8)] == \
        [(p, d, t) for p in range(2) for d in range(2) for t in range(2)]
    for dims, backends in PARALLEL_COMBINATIONS.items():
        for backend in backends:
            check_combination(dims, backend)
    # expert parallelism splits the data-parallel ranks' experts: every rank still reads its own batch
    moe = WorldLayout(8, ep=4)
    assert moe.dp == 8 and moe.expert_dp == 2 and moe.parallel_dims == {"ep"}
    assert [moe.coordinate(r, "ep") for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # neighbours: one host
    with pytest.raises(ConfigError, match="--ep 3 does not divide the 8 data-parallel ranks"):
        WorldLayout(8, ep=3)
    for dims, backends in (({"tp", "pp"}, ("deepspeed",)), ({"ep", "sp"}, ("deepspeed",)),
                           ({"ep", "tp"}, ("deepspeed", "fsdp"))):
        for backend in backends:
            with pytest.raises(ConfigError, match="not supported"):
                check_combination(frozenset(dims), backend)

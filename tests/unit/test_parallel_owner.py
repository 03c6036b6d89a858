"""Parallelism has one owner (issue 48): every device mesh and process group of zerotrain is built by the mesh
builder (zerotrain/distributed/mesh.py), and arithmetic between parallel degrees (`world // tp`, `tp * pp * sp`,
`dp // ep`) is written only in the world layout (zerotrain/distributed/layout.py). AST checks, so a renamed
import or constant cannot dodge them; each is shown able to fail on a violating snippet."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"

MESH_OWNER = "distributed/mesh.py"
LAYOUT_OWNER = "distributed/layout.py"

GROUP_BUILDERS = frozenset({"init_device_mesh", "new_group", "DeviceMesh", "new_subgroups",
                            "new_subgroups_by_enumeration", "split_group", "from_group"})
"""torch.distributed calls that create a process group or a device mesh (DeviceMesh(...) and DeviceMesh.from_group
too)."""

DEGREES = frozenset({"tp", "pp", "sp", "ep", "dp", "world", "world_size", "expert_dp", "model_parallel", "nproc"})
"""Names that hold a parallel degree or a rank count (as a variable or an attribute: plan.world.dp)."""

DEGREE_ARITHMETIC_ALLOWED: dict[str, str] = {}
"""file -> why it may combine degrees (none today)."""


def _called_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def group_builds(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of every mesh or process-group construction."""
    return [(n.lineno, ast.unparse(n.func)) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and _called_name(n) in GROUP_BUILDERS]


def _degree_names(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and n.id in DEGREES:
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and n.attr in DEGREES:
            out.add(n.attr)
    return out


def degree_arithmetic(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, expression) of every *, // or % whose two operands hold two different degrees (world // tp, dp * sp,
    dp // ep): the layout's arithmetic. One degree against a model or batch size (heads % tp, micro * dp), or
    against itself (an all-to-all's (sp - 1) // sp share), is not flagged: that is the rule or the estimate that
    needs it."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.FloorDiv, ast.Mult, ast.Mod)) \
                and _degree_names(n.left) and _degree_names(n.right) \
                and len(_degree_names(n.left) | _degree_names(n.right)) > 1:
            found.append((n.lineno, ast.unparse(n)))
    return found


def _offenders(check, owner: str, allowed: dict[str, str] | None = None) -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == owner or rel in (allowed or {}):
            continue
        out += [f"zerotrain/{rel}:{line}: {expr}" for line, expr in check(ast.parse(path.read_text()))]
    return out


def test_meshes_and_groups_are_built_only_by_the_mesh_builder():
    offenders = _offenders(group_builds, MESH_OWNER)
    assert not offenders, "build it through ParallelMeshes.get(role) (zerotrain/distributed/mesh.py):\n" + \
        "\n".join(offenders)


def test_the_mesh_check_can_fail():
    code = ("from torch.distributed.device_mesh import init_device_mesh as idm, DeviceMesh\n"
            "import torch.distributed as dist\n"
            "def f(world, tp):\n"
            "    a = idm('cpu', (world,))\n"
            "    b = dist.new_group([0, 1], backend='gloo')\n"
            "    c = DeviceMesh('cpu', [0, 1])\n"
            "    d = torch.distributed.init_device_mesh('cpu', (2,))\n"
            "    return a, b, c, d, mesh.get('dp')\n")
    # an aliased import is a call of its alias: the alias must not hide it, so the check also reads imports
    found = group_builds(ast.parse(code)) + aliased_group_imports(ast.parse(code))
    assert [line for line, _ in found] == [5, 6, 7, 1]


def aliased_group_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """Imports of a group builder under another name (`init_device_mesh as idm`): a call of idm would dodge
    group_builds, so the import itself is flagged."""
    return [(n.lineno, f"{a.name} as {a.asname}") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            for a in n.names if a.name in GROUP_BUILDERS and a.asname and a.asname != a.name]


def test_no_aliased_group_builders():
    offenders = _offenders(aliased_group_imports, MESH_OWNER)
    assert not offenders, "\n".join(offenders)


def test_degree_arithmetic_only_in_the_layout():
    offenders = _offenders(degree_arithmetic, LAYOUT_OWNER, DEGREE_ARITHMETIC_ALLOWED)
    assert not offenders, "ask the layout (zerotrain/distributed/layout.py: dp, expert_dp, shard_ranks, " \
                          "stage_ranks, groups, rank_at) instead:\n" + "\n".join(offenders)


def test_the_degree_check_can_fail():
    code = ("def f(plan, world, tp, pp, sp, nproc, heads, micro, dp):\n"
            "    a = world // tp\n"
            "    b = plan.world.dp * plan.world.sp\n"
            "    c = nproc // (tp * pp * sp)\n"
            "    d = plan.layout.dp // plan.layout.ep\n"
            "    e = heads % tp + micro * dp + -(-heads // sp) + n * (sp - 1) // sp\n"  # one degree: not flagged
            "    return a, b, c, d, e\n")
    # line 4 thrice: nproc // (tp * pp * sp), tp * pp * sp, tp * pp
    assert sorted(line for line, _ in degree_arithmetic(ast.parse(code))) == [2, 3, 4, 4, 4, 5]


def test_the_layout_owns_the_arithmetic_the_engines_used():
    """The rank arithmetic that moved into the layout gives what each engine computed before."""
    from zerotrain.distributed.layout import ParallelDegrees, WorldLayout

    pipe = WorldLayout(8, pp=2)  # FSDP pipeline: tie groups {d, (pp-1)*dp + d}, sends to rank +- dp
    assert [[r, pipe.rank_at(r, pp=1)] for r in range(pipe.dp)] == [[d, 4 + d] for d in range(4)]
    assert pipe.rank_at(5, pp=0) == 1 and list(pipe.stages()) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    sp = WorldLayout(8, sp=2)  # sequence-parallel groups: neighbouring ranks
    assert sp.groups("sp") == [[0, 1], [2, 3], [4, 5], [6, 7]] and sp.shard_ranks == 8
    moe = WorldLayout(8, ep=4)  # expert mesh (world // ep, ep)
    assert (moe.expert_dp, moe.ep, moe.dp) == (2, 4, 8)
    tp = WorldLayout(8, tp=2)  # tensor-parallel 2-D mesh (world // tp, tp)
    assert (tp.dp, tp.tp) == (4, 2) and tp.groups("tp")[1] == [2, 3]
    assert ParallelDegrees(tp=2, pp=2).replicas(3) == 1 and ParallelDegrees(sp=2).replicas(8) == 4
    mixed = WorldLayout(8, pp=2, sp=2)  # the launcher's stages count sp ranks too (it used tp x dp)
    assert list(mixed.stages()) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_degrees_are_stored_once_in_the_plan():
    """RunPlan.parallel is the degrees, the layout is built from that very object, and a plan without a world
    (`zerotrain config`) still has them."""
    from zerotrain.config import build_config
    from zerotrain.plan.run_plan import RunPlan, build_plan

    cfg = build_config(overrides={"parallel.sp": 2, "model.task": "causal-lm"})
    plan = build_plan(cfg, 4, backend="fsdp", device="cpu")
    assert plan.layout.parallel is plan.parallel and plan.parallel.sp == 2 and plan.layout.dp == 2
    assert build_plan(cfg, None, backend="fsdp", device="cpu").parallel.sp == 2
    for name in ("tp", "pp", "sp", "ep"):
        assert name not in RunPlan.__dataclass_fields__


def test_the_groups_need_no_device_until_a_mesh_is_built(monkeypatch):
    """DeepSpeed's engine knows its device only after deepspeed.initialize, and asks for its sp group before: the
    groups (sp, the pipeline's tie groups) are built without asking the device; only meshes ask it."""
    import torch.distributed as tdist

    from zerotrain.distributed import mesh
    from zerotrain.distributed.layout import WorldLayout

    made: list[list[int]] = []
    monkeypatch.setattr(tdist, "new_group", lambda ranks, **kw: made.append(ranks) or len(made))
    monkeypatch.setattr(tdist, "get_rank", lambda: 3)

    def no_device() -> str:
        raise AssertionError("the device was asked for a group")

    meshes = mesh.ParallelMeshes(WorldLayout(4, sp=2), no_device)
    assert meshes.get("sp") == 2 and meshes.get("sp") == 2 and made == [[0, 1], [2, 3]]  # built once, every group
    tied = mesh.ParallelMeshes(WorldLayout(4, pp=2), no_device)
    assert tied.get("pp_tie") == 4 and made[2:] == [[0, 2], [1, 3]]


def test_a_new_combination_is_a_row_of_the_capability_table(monkeypatch):
    """What composes is read from one table: sp x pp is refused today, and runs past the rules once it is a row
    (its parallelize step in the backend is the rest of that work); sp x tp became one on FSDP2."""
    import pytest

    from zerotrain.errors import ConfigError
    from zerotrain.plan import capabilities as cap

    with pytest.raises(ConfigError, match="--pp 2 with --sp 2: pp and sp together are not supported yet"):
        cap.check_combination({"sp": 2, "pp": 2}, "fsdp")
    cap.check_combination({"ep": 2}, "deepspeed")  # AutoEP (issue 52), a row of COMBINATIONS
    with pytest.raises(ConfigError, match="--ep 2 with --sp 2: ep and sp together are not supported yet"):
        cap.check_combination({"ep": 2, "sp": 2}, "deepspeed")
    cap.check_combination({"sp": 2, "tp": 2}, "fsdp")
    monkeypatch.setitem(cap.COMBINATIONS, frozenset({"sp", "pp"}), {"fsdp": "Ulysses x pipelining x FSDP2"})
    cap.check_combination({"sp": 2, "pp": 2}, "fsdp")
    backend, why = cap.auto_backend({"ep": 2})
    assert backend == "fsdp" and why.startswith("backend=auto and parallel.ep=2 (expert parallelism runs on FSDP2")


CAPABILITY_OWNER = "plan/capabilities.py"
BACKEND_NAMES = frozenset({"deepspeed", "fsdp"})
"""The backend names as the capability table spells them (capabilities.BACKENDS)."""

CAPABILITY_RULES: dict[str, str] = {
    "plan/parallel_rules.py": "the rules read the table and check what a model needs on each backend"}
"""file -> why it may decide by backend under a parallel degree."""


def backend_under_degree(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, comparison) of every comparison with a backend name ("fsdp", "deepspeed") whose condition also reads a
    parallel dimension (tp, pp, sp, ep: a name, an attribute or the string): in the same boolean expression, or in
    the test of an enclosing if / conditional expression / while of the same function. That is a capability fact
    (which backend runs a layout, how, at which stages): the capability table's (zerotrain/plan/capabilities.py)."""
    dims = {"tp", "pp", "sp", "ep"}

    def reads_dim(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id in dims or isinstance(n, ast.Attribute) and n.attr in dims
                   or isinstance(n, ast.Constant) and n.value in dims for n in ast.walk(node))

    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    found = []
    for n in ast.walk(tree):
        if not isinstance(n, ast.Compare) or not any(isinstance(x, ast.Constant) and x.value in BACKEND_NAMES
                                                     for x in (n.left, *n.comparators)):
            continue
        conditions, node = [n], n
        while node in parents and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            node = parents[node]
            if isinstance(node, ast.BoolOp):
                conditions.append(node)
            elif isinstance(node, (ast.If, ast.IfExp, ast.While)):
                conditions.append(node.test)
        if any(reads_dim(c) for c in conditions):
            found.append((n.lineno, ast.unparse(n)))
    return found


def test_backend_facts_of_a_layout_are_the_capability_tables():
    offenders = _offenders(backend_under_degree, CAPABILITY_OWNER, CAPABILITY_RULES)
    assert not offenders, "read it from the capability table (zerotrain/plan/capabilities.py: COMBINATIONS, " \
                          "STAGES, SPLIT_BY, PIPELINE_SCHEDULE, AUTO_BACKEND; add a row or a helper there):\n" + \
        "\n".join(offenders)


def test_the_backend_check_can_fail():
    code = ("def f(plan, backend, tp, kind):\n"
            "    if plan.parallel.tp > 1:\n"
            "        how = 'the tp_plan' if plan.backend == 'fsdp' else 'AutoTP'\n"  # the banner's old literal
            "    a = backend == 'deepspeed' and tp > 1\n"
            "    b = backend == 'fsdp' and kind == 'ep'\n"
            "    c = backend == 'fsdp' and plan.stage == 1\n"  # no degree: a stage fact, not flagged
            "    if backend != 'deepspeed':\n"
            "        return None\n"
            "    return a, b, c\n")
    assert sorted(line for line, _ in backend_under_degree(ast.parse(code))) == [3, 4, 5]


# --- each capability refusal's text is written once, in the capability table ----------------------------------

CAPABILITY_ROWS = ("plan/capabilities.py", "tasks.py")
"""Where the capability table's rows live: plan/capabilities.py, and the rows a config rule refuses before a plan
exists in tasks.py (config/ is below plan/; capabilities serves them to the layers above)."""

REFUSAL_TEXTS = (
    "online RL under sequence parallelism",  # tasks.LAYOUT_REFUSALS["online_rl"]
    "QAT runs with data parallelism",  # tasks.LAYOUT_REFUSALS["qat"]
    "does not compose with {} yet: its forward is cut over ranks",  # capabilities.generation_refusal
    "DeepSpeed AutoEP runs model types",  # capabilities.NEEDS
    "asserts reduce-scatter for expert parameter groups",
    "builds new router modules inside deepspeed.initialize",
    "AutoTP does not compose with its pipeline engine",  # capabilities.REFUSED
    "split builds its own blocks and head",  # capabilities.FEATURES
    "no vocabulary-parallel loss is built",
    "together are not supported yet on the",  # capabilities.check_combination
)
"""A phrase of each capability refusal ({} stands for an f-string's field)."""


def string_texts(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string literal but docstrings (a string on its own as a statement), an f-string's
    fields written {}."""
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    parts |= {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.JoinedStr):
            out.append((n.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in n.values)))
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in parts:
            out.append((n.lineno, n.value))
    return out


def refusal_writers(tree: ast.AST, texts=REFUSAL_TEXTS) -> list[tuple[int, str]]:
    """(line, phrase) of every string literal that writes one of the capability refusals."""
    return [(line, t) for line, s in string_texts(tree) for t in texts if t in s]


def test_each_capability_refusal_is_written_once_in_the_table():
    written: dict[str, list[str]] = {t: [] for t in REFUSAL_TEXTS}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for line, text in refusal_writers(ast.parse(path.read_text())):
            written[text].append(f"zerotrain/{rel}:{line}")
    misplaced = [f"{w}: {t}" for t, where in written.items() for w in where
                 if w.split(":")[0].removeprefix("zerotrain/") not in CAPABILITY_ROWS]
    assert not misplaced, "ask the capability table (zerotrain/plan/capabilities.py) instead:\n" + "\n".join(misplaced)
    assert {t: len(w) for t, w in written.items() if len(w) != 1} == {}, written


def test_the_refusal_check_can_fail():
    code = ("def f(task, sp, qat):\n"
            "    a = f'--task {task} with --sp {sp}: online RL under sequence parallelism is not built'\n"
            "    b = ('--qat x: QAT runs with '\n"
            "         'data parallelism only')\n"
            "    c = f'generation (online RL) does not compose with {sp} yet: its forward is cut over ranks'\n"
            "    'a docstring: QAT runs with data parallelism'\n"
            "    return a, b, c, 'QAT runs'\n")
    assert [line for line, _ in refusal_writers(ast.parse(code))] == [2, 3, 5]


def test_the_rules_ask_the_capability_rows(monkeypatch):
    """config/rules.py, the generation engine, the expert-parallel rule and the fused loss's default read the rows:
    a changed row changes what they refuse; the loss types and the head-splitting dimensions are one object each."""
    import pytest

    from zerotrain import tasks
    from zerotrain.backends.generation import refused_layout
    from zerotrain.config import build_config, rules
    from zerotrain.errors import ConfigError
    from zerotrain.model import preparation
    from zerotrain.plan import capabilities as cap
    from zerotrain.plan import parallel_rules
    from zerotrain.train import grpo_loss

    monkeypatch.setitem(tasks.LAYOUT_REFUSALS, "qat", tasks.LayoutRefusal(("sp",), "a changed row"))
    rules.check_config(build_config(overrides={"quant.qat": "int4-weight", "parallel.tp": 2}))
    with pytest.raises(ConfigError, match=r"--qat int4-weight with --sp 2: a changed row; pass --sp 1"):
        rules.check_config(build_config(overrides={"quant.qat": "int4-weight", "parallel.sp": 2}))
    monkeypatch.setattr(cap, "GENERATION_CUTS", ("tp", "ep"))
    assert refused_layout(False, 1, 2, 1) is None and "tp 2" in refused_layout(False, 2, 1, 1)
    facts = type("Facts", (), {"num_experts": 4, "adapted_experts": False, "expert_parallel_plan": {"e": "ep"},
                               "model_type": "llama"})()
    with pytest.raises(ConfigError, match="DeepSpeed AutoEP runs model types"):
        parallel_rules._check_expert_parallel(2, facts, "deepspeed", False, None)
    monkeypatch.setitem(cap.NEEDS, ("deepspeed", "ep"), ())
    parallel_rules._check_expert_parallel(2, facts, "deepspeed", False, None)
    assert cap.FEATURES["model.fused_loss"].dims is tasks.HEAD_SPLIT_DIMS is preparation.HEAD_SPLIT_DIMS
    assert grpo_loss.LOSS_TYPES is rules.RL_LOSS_TYPES is tasks.RL_LOSS_TYPES


def test_one_list_of_loss_types():
    """No module but tasks.py writes the RL loss types as a list (a copy would drift from what the loss computes)."""
    copies = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, (ast.Tuple, ast.List, ast.Set)) and rel != "tasks.py" and \
                    {"dapo", "bnpo"} <= {e.value for e in n.elts if isinstance(e, ast.Constant)}:
                copies.append(f"zerotrain/{rel}:{n.lineno}")
    assert not copies, "read tasks.RL_LOSS_TYPES:\n" + "\n".join(copies)

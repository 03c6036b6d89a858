"""The task registry (zerotrain/tasks.py): every task is one TaskSpec, and no module outside it compares task names
(an AST check, so a renamed constant or a local alias cannot dodge it)."""
from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

from zerotrain.errors import ConfigError
from zerotrain.tasks import (FEATURES, LABELLED_TEXT, PARALLEL_DIMS, POLICY_GRADIENT, PREFERENCE_PAIRS, PROMPTS, PAIR_SCORE,
                             TASK_NAMES, TASKS, TEXT, UNPAIRED, UNPAIRED_LOSS,
                             task_spec)

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"
REGISTRY = "tasks.py"


# --- the source check ---------------------------------------------------------------------------------------
def _names_a_task(node: ast.AST) -> bool:
    """A task name string, a literal collection holding one, or a read of a task (`x.task`, a name `task`)."""
    if isinstance(node, ast.Constant):
        return node.value in TASK_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_task(e) for e in node.elts)
    if isinstance(node, ast.Attribute):
        return node.attr == "task"
    if isinstance(node, ast.Name):
        return node.id == "task"
    return False


def task_comparisons(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of every comparison (==, !=, in, not in, is, match) on a task name or a task, every lookup
    keyed by a task (`TABLE[cfg.model.task]`) and every literal tuple/list/set of two or more task names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_a_task(x) for x in (node.left, *node.comparators)):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Match) and (_names_a_task(node.subject) or any(
                isinstance(p, ast.MatchValue) and _names_a_task(p.value)
                for case in node.cases for p in ast.walk(case.pattern))):
            found.append((node.lineno, f"match {ast.unparse(node.subject)}"))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _names_a_task(node.slice) \
                and not isinstance(node.slice, ast.Constant):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and sum(
                isinstance(e, ast.Constant) and e.value in TASK_NAMES for e in node.elts) >= 2:
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_no_module_outside_the_registry_compares_tasks():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() == REGISTRY:
            continue
        for line, expr in task_comparisons(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {expr}")
    assert not offenders, "read the task's TaskSpec (zerotrain/tasks.py) instead:\n" + "\n".join(offenders)


def test_the_checker_finds_task_comparisons():
    """The check above can fail: literals on either side, `in` a renamed tuple of names, a local alias, a task
    read on the left, match statements and lookups keyed by the task; reads of a spec pass."""
    code = '''
NAMES = ("dpo", "simpo")
def f(cfg, lo, task):
    a = cfg.model.task == "causal-lm"
    b = "seq-cls" != lo.task
    c = cfg.model.task in NAMES
    d = task not in ("orpo",)
    e = BETA[cfg.model.task]
    match cfg.model.task:
        case "dpo":
            pass
    match kind:
        case "orpo":
            pass
    ok = task_spec(cfg.model.task).objective == LM_LOSS
    ok2 = task_spec(task).composes("pp") and spec.data_format != "text"
    ok3 = SPECS["dpo"]
    return a, b, c, d, e
'''
    found = [expr for _, expr in task_comparisons(ast.parse(code))]
    assert found == [
        "('dpo', 'simpo')", "cfg.model.task == 'causal-lm'", "'seq-cls' != lo.task", "cfg.model.task in NAMES",
        "task not in ('orpo',)", "BETA[cfg.model.task]", "match cfg.model.task", "match kind"], found


# --- the registry -------------------------------------------------------------------------------------------
def test_every_task_has_its_entry():
    assert TASK_NAMES == ("causal-lm", "seq-cls", "dpo", "simpo", "orpo", "grpo", "reward", "kto")
    for name, spec in TASKS.items():
        assert spec.name == name and spec.summary
        assert spec.data_format in (TEXT, LABELLED_TEXT, PREFERENCE_PAIRS, PROMPTS, UNPAIRED)
        assert spec.composes_with <= set(PARALLEL_DIMS + FEATURES), name
        assert spec.eval_metrics[:1] == (() if spec.online_rl else ("eval_loss",))
        assert (spec.online_rl is not None) == (spec.data_format == PROMPTS) == (spec.objective == POLICY_GRADIENT)
        assert (spec.reward_model is not None) == (spec.objective == PAIR_SCORE) == (spec.head_labels == 1)
        assert (spec.data_format == UNPAIRED) == (spec.objective == UNPAIRED_LOSS) == \
            (spec.preference is not None and spec.preference.family == "kto")
        assert (spec.data_format == PREFERENCE_PAIRS) == (spec.rows_per_sample == 2)
        assert spec.reads_pref == (spec.preference is not None or spec.online_rl is not None
                                   or spec.reward_model is not None)
    lm, cls = task_spec("causal-lm"), task_spec("seq-cls")
    assert lm.causal_lm and not cls.causal_lm and all(task_spec(t).causal_lm for t in ("dpo", "simpo", "orpo"))
    assert all(lm.composes(x) for x in PARALLEL_DIMS + FEATURES)
    assert not any(cls.composes(x) for x in ("pp", "sp", "packing", "fused_loss", "chunked_loss", "qat"))
    for t in ("dpo", "simpo", "orpo"):
        spec = task_spec(t)
        assert not any(spec.composes(x) for x in ("tp", "pp", "ep", "packing", "fused_loss", "qat"))
        assert spec.composes("chunked_loss") and spec.composes("lora") and spec.composes("sp")
    # sequence parallelism: every preference task and the reward model, not online RL (config/rules.py refuses it)
    assert [t for t in TASK_NAMES if task_spec(t).reads_pref and task_spec(t).composes("sp")] == \
        ["dpo", "simpo", "orpo", "reward", "kto"]
    assert {t: task_spec(t).preference.default_beta for t in ("dpo", "simpo", "orpo")} == \
        {"dpo": 0.1, "simpo": 2.0, "orpo": 0.1}
    assert [t for t in TASK_NAMES if task_spec(t).preference and task_spec(t).preference.reference] == ["dpo", "kto"]
    reward, kto = task_spec("reward"), task_spec("kto")
    assert reward.classifier and not reward.causal_lm and reward.data_format == PREFERENCE_PAIRS
    assert reward.pref_settings == {"pref.center_rewards_coef"} and reward.reference(None) is None
    assert kto.causal_lm and kto.preference.default_beta == 0.1 and kto.estimate_parts == ("reference",)
    assert {"pref.desirable_weight", "pref.undesirable_weight", "pref.ref_model"} <= kto.pref_settings
    assert task_spec("orpo").preference.nll_over == "sequence" and task_spec("dpo").preference.nll_over == "completion"
    assert task_spec("dpo").estimate_parts == ("reference",)
    grpo = task_spec("grpo")
    assert grpo.causal_lm and grpo.online_rl.default_beta == 0.0 and grpo.composes_with == {"lora", "chunked_loss"}
    assert grpo.pref_settings == {"pref.beta", "pref.max_prompt_len"}
    with pytest.raises(ValueError, match="no parallel dimension or feature"):
        lm.composes("packed")


def test_eval_metric_names_are_the_ones_written():
    from zerotrain.train.preference import METRICS

    assert task_spec("dpo").eval_metrics == ("eval_loss", *(f"eval_{m}" for m in METRICS))


def test_auto_classes_and_peft_task_types_exist():
    import transformers
    from peft import TaskType

    for spec in TASKS.values():
        assert hasattr(transformers, spec.auto_class) and hasattr(TaskType, spec.peft_task_type)


def test_an_unknown_task_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        task_spec("ppo")
    assert "\n" not in str(e.value) and "causal-lm, seq-cls, dpo, simpo, orpo, grpo" in str(e.value)


def test_the_schema_takes_its_choices_from_the_registry():
    from zerotrain.config.schema import ModelConfig

    assert typing.get_args(ModelConfig.model_fields["task"].annotation) == TASK_NAMES


def test_the_reference_is_resolved_once():
    from zerotrain.config import build_config

    def ref(**o):
        cfg = build_config(overrides={"data.path": "x.jsonl", **o})
        return task_spec(cfg.model.task).reference(cfg), task_spec(cfg.model.task).holds_reference(cfg)

    assert ref(**{"model.task": "simpo"}) == (None, False)
    plan, held = ref(**{"model.task": "dpo"})
    assert held and plan.path is None and not plan.precomputed and not plan.adapters_off
    assert ref(**{"model.task": "dpo", "pref.precompute_ref": True})[1] is False
    plan, held = ref(**{"model.task": "dpo", "lora.r": 4, "model.name": "m"})
    assert plan.adapters_off and not held
    plan, held = ref(**{"model.task": "dpo", "lora.r": 4, "model.name": "m", "pref.ref_model": "r"})
    assert plan.path == "r" and not plan.adapters_off and held


@pytest.mark.parametrize("task,reference", [("dpo", "a frozen copy"), ("orpo", "none held")])
def test_estimate_prints_a_preference_task_table(capsys, task, reference) -> None:
    """`zerotrain estimate --task dpo|orpo` prints its pair line and the table (the pair count once shadowed the
    table's rows)."""
    from zerotrain.cli import main

    assert main(["estimate", "--nproc", "2", "--task", task]) == 0
    out = capsys.readouterr().out
    assert f"{task}: every micro-batch of 4 pairs runs 8 rows (chosen and rejected); reference model: {reference}" in out
    header = next(ln for ln in out.splitlines() if ln.startswith("config "))
    assert ("reference" in header.split()) == (task == "dpo")


def test_the_task_of_a_saved_model_class_comes_from_transformers_auto_mappings() -> None:
    """An exported LoRA checkpoint's base is loaded as the task whose Auto class builds its class."""
    from zerotrain.errors import ConfigError
    from zerotrain.tasks import task_of_model_class

    assert [task_of_model_class(c).name for c in ("GPT2LMHeadModel", "LlamaForCausalLM", "GptOssForCausalLM",
                                                  "LlamaForSequenceClassification", "RobertaForSequenceClassification")
            ] == ["causal-lm"] * 3 + ["seq-cls"] * 2
    with pytest.raises(ConfigError, match="BertModel: no task of zerotrain trains this model class"):
        task_of_model_class("BertModel")


def test_a_feature_the_task_does_not_compose_with_is_refused_by_name(monkeypatch) -> None:
    """Every task today runs with LoRA and the tiled MLP; a task entry without them (a later issue's) is refused by
    the generic check, naming the setting."""
    import dataclasses

    from zerotrain import tasks
    from zerotrain.config import build_config
    from zerotrain.config.rules import check_task_features
    from zerotrain.errors import ConfigError

    check_task_features(build_config(overrides={"lora.r": 4, "model.tiled_mlp": 16}))
    bare = dataclasses.replace(tasks.TASKS["causal-lm"], composes_with=frozenset())
    monkeypatch.setitem(tasks.TASKS, "causal-lm", bare)
    with pytest.raises(ConfigError, match=r"^lora.r with --task causal-lm: the task does not run with it; pass "
                                          r"--lora-r 0$"):
        check_task_features(build_config(overrides={"lora.r": 4}))


def test_every_data_format_says_which_data_settings_it_reads():
    """config/rules.py refuses a data.* shaping setting the task's format does not read (tasks.DATA_SETTINGS): every
    format a reader reads is in the table, and only settings the schema has."""
    from zerotrain.config.schema import field_paths
    from zerotrain.data.datasets import READERS
    from zerotrain.tasks import DATA_SETTINGS

    assert set(DATA_SETTINGS) == set(READERS)
    assert set().union(*DATA_SETTINGS.values()) <= set(field_paths())

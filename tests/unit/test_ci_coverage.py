"""Which CI cell proves which feature (tests/features.yaml read by tests/features.py, the one table; issues 49 and 66) against what pytest
collects: every node id it names is collected, every feature has a cell collected without `slow` (so CI runs it;
tests/features.py's PENDING, the known gaps, aside, and each of those must still be slow-only), every `slow` test is
the rest of the matrix of some feature (or a SLOW_ONLY test, with why), the features issue 49 found proven only by
slow cells keep their CI cell, and docs/testing.md is the text tests/support/testing_doc.py generates from the table
and the committed CI log (benchmarks/results/ci_run.txt)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import features
from tests.support import testing_doc

ROOT = Path(__file__).resolve().parents[2]
ISSUE_49 = [
    "tests/multirank/test_elastic.py::test_async_save_trains_on_and_a_kill_mid_write_keeps_the_previous_latest[fsdp]",
    "tests/multirank/test_preference.py::test_simpo_fsdp_equals_trl_cpo",
    "tests/multirank/test_preference.py::test_variants_equal_trl[orpo-deepspeed]",
    "tests/multirank/test_preference.py::test_variants_equal_trl[ipo-deepspeed-z2]",
    "tests/multirank/test_preference.py::test_rpo_fsdp_lora_equals_trl_without_a_second_copy",
    "tests/multirank/test_compile.py::test_compiled_losses_equal_eager[gc-gpt2-ds3]",
    "tests/multirank/test_compile.py::test_compiled_losses_equal_eager[lora-llama-fsdp3]",
    "tests/multirank/test_ds_config_train.py::test_generated_configs_train_with_equal_losses",
    "tests/multirank/test_families.py::test_losses_equal_one_process[qwen2-ds3]",
    "tests/multirank/test_families.py::test_losses_equal_one_process[roberta-ds3]",
    "tests/multirank/test_sequence_parallel.py::test_sp2_step_loss_is_the_global_token_mean[gpt2]",
    "tests/multirank/test_sequence_parallel.py::test_sp2_step_loss_is_the_global_token_mean[qwen2-mqa]",
    "tests/multirank/test_sequence_parallel.py::test_sp2_step_loss_is_the_global_token_mean[qwen2-alternating]",
    "tests/multirank/test_moe.py::test_ep2_equals_one_process_with_half_the_experts_per_rank[deepseek-v3]",
    "tests/multirank/test_moe.py::test_ep2_x_dp2_on_four_ranks_equals_one_process",
    "tests/multirank/test_cli_resume.py::test_resume_mid_run_continues_exactly[ep2-fsdp]",
    "tests/multirank/test_qat.py::test_int8_keeps_a_fine_tuned_models_perplexity_at_a_third_of_the_size[int8-dynamic]",
    "tests/multirank/test_elastic.py::test_lost_node_reforms_a_smaller_world_with_the_same_global_batch[fsdp]",
]
"""Issue 49's list of features CI never ran (FSDP2 --async-save; SimPO, ORPO, IPO, RPO vs TRL; --compile under
inductor with gradient checkpointing and LoRA; the ds_configs/ presets; Qwen2 / RoBERTa parity; sp on GPT-2, a
one-kv-head Qwen2 and alternating windows; ep2 on DeepSeek-V3 and Qwen3-MoE and its resume; the int8 perplexity and
size test; the single-host lost node): one CI cell each."""


def _paths() -> list[str]:
    """What to collect: tests/multirank whole (every slow test there must be some feature's), and the unit test files
    the table names (everything else under tests/unit is CI, never slow, bar what the table names)."""
    named = {n.split("::", 1)[0] for f in features.FEATURES for n in (*f.ci, *f.slow)}
    return ["tests/multirank", *sorted(p for p in named if p.startswith("tests/unit/"))]


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[str, bool]:
    """node id -> slow, for every test under tests/multirank and the unit files the table names (pytest's own
    collection, marks included)."""
    out = tmp_path_factory.mktemp("collect") / "marks.json"
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "slow or not slow", "-p", "tests.support.collect_marks", *_paths()],
                         cwd=ROOT, env={**os.environ, "ZT_COLLECT_MARKS_OUT": str(out)}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def function_of(node: str) -> str:
    return node.split("[", 1)[0]


def problems(rows: list[features.Feature], collected: dict[str, bool], excused: dict[str, str] | None = None,
             pending: set[str] = frozenset()) -> list[str]:
    """What is wrong with the table against the collection (empty: nothing); excused: slow-only tests with their
    reason; pending: the known gaps, features whose cells are all slow today (and must be)."""
    found = [f"slow-only {name} gives no reason" for name, why in (excused or {}).items() if len(why) < 20]
    found += [f"PENDING names no feature: {name!r}" for name in sorted(pending - {f.name for f in rows})]
    for feature, ci, _ in rows:
        if not ci:
            found.append(f"{feature!r}: no CI cell")
        for node in ci:
            if node not in collected:
                found.append(f"{feature!r}: {node} is not collected (renamed or removed?)")
        in_ci = [n for n in ci if n in collected and not collected[n]]
        if feature in pending and in_ci:
            found.append(f"{feature!r}: in PENDING but {in_ci[0]} is a CI cell: drop it from PENDING")
        elif feature not in pending:
            found += [f"{feature!r}: {n} is slow: CI does not run it" for n in ci if collected.get(n)]
    rest = {name for _, _, slow in rows for name in slow} | set(excused or {})
    functions = {function_of(n) for n in collected}
    found += [f"named as slow but no such test: {name}" for name in sorted(rest - functions)]
    found += [f"slow test whose feature the table does not name (add it to its `slow`): {name}"
              for name in sorted({function_of(n) for n, slow in collected.items() if slow} - rest)]
    return found


def test_every_feature_has_a_ci_cell_and_every_slow_test_a_feature(collected):
    assert len(features.FEATURES) >= 30, "the table lost its rows"
    assert problems(features.FEATURES, collected, features.SLOW_ONLY, features.PENDING) == []


def test_slow_only_is_no_issue_49_feature_and_names_slow_tests(collected):
    assert len(features.SLOW_ONLY) <= 4, "more features proven only by the slow pass: find them a CI cell"
    for name in features.SLOW_ONLY:
        assert any(function_of(n) == name and slow for n, slow in collected.items()), f"{name}: no slow test"
        assert name not in {function_of(n) for n in ISSUE_49}


def test_issue_49_features_keep_a_ci_cell(collected):
    named = {n for f in features.FEATURES if f.name not in features.PENDING for n in f.ci}
    for node in ISSUE_49:
        assert node in named, f"{node} is not in tests/features.py"
        assert node in collected and not collected[node], f"{node}: not a CI cell"


def test_the_check_fails_on_a_slow_cell_named_as_ci_and_on_an_unnamed_slow_test(collected):
    rows = features.FEATURES
    slow = next(n for n, s in collected.items() if s)
    ci = next(n for n, s in collected.items() if not s)
    assert any("is slow" in p for p in problems([*rows, features.Feature("x", (slow,), ())], collected))
    without = [features.Feature(f, c, tuple(n for n in rest if n != function_of(slow))) for f, c, rest in rows]
    assert any(function_of(slow) in p for p in problems(without, collected))
    assert any("no CI cell" in p for p in problems([*rows, features.Feature("x", (), ())], collected))
    assert any("not collected" in p for p in problems([*rows, features.Feature("x", (ci + "-renamed",), ())], collected))
    # a known gap is allowed only while it is one, and only by name
    assert problems([*rows, features.Feature("x", (slow,), ())], collected, pending={"x"}) == problems(rows, collected)
    assert any("drop it from PENDING" in p for p in problems([*rows, features.Feature("x", (ci,), ())], collected, pending={"x"}))
    assert any("PENDING names no feature" in p for p in problems(rows, collected, pending={"y"}))


def test_testing_md_is_the_generated_text():
    """docs/testing.md below its GENERATED line is tests/features.py's table and the committed CI log's times:
    `python -m tests.support.testing_doc` regenerates it (after a new ci_run.txt too)."""
    doc, log = testing_doc.DOC.read_text(), testing_doc.LOG.read_text()
    assert doc == testing_doc.render(doc, log), "docs/testing.md is stale: run python -m tests.support.testing_doc"


def test_the_doc_quotes_whatever_the_log_says():
    """The times come from the log as parsed: another log gives another doc (its commit, counts, seconds and each
    cell's duration), and a log without its summary is an error, not an old figure kept."""
    doc, log = testing_doc.DOC.read_text(), testing_doc.LOG.read_text()
    parsed = testing_doc.read_log(log)
    assert f"{parsed.passed} passed" in doc and f"{parsed.pytest_s} s of pytest, {parsed.script_s} s for the whole" in doc
    node = "tests/multirank/test_token_weighting.py::test_step_loss_is_the_global_token_mean[fsdp-3]"  # not in the log
    other = (log.replace(parsed.commit, "abcdef1", 1).replace(f"whole script {parsed.script_s} s", "whole script 1999 s")
             .replace(f" in {parsed.pytest_s}s", " in 1800.50s") + f"\n12.34s call     {node}\n")
    new = testing_doc.render(doc, other)
    assert "commit abcdef1" in new and "1800.50 s of pytest, 1999 s for the whole script" in new
    assert parsed.pytest_s not in new.split(testing_doc.GENERATED)[1]
    row = next(r for r in new.splitlines() if node in r and r.startswith("| Token-weighted loss"))
    assert "12.34" in row and "12.34" not in doc
    with pytest.raises(ValueError, match="summary"):
        testing_doc.render(doc, log.replace(" passed", " ok"))

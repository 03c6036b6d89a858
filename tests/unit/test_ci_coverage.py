"""docs/testing.md's table "Which feature each CI cell proves" against what pytest collects (issue 49): every CI
cell it names is collected without `slow` (so CI runs it), every feature has one, and every `slow` test is named
as the rest of the matrix of a feature that CI proves; the features issue 49 found proven only by slow cells
keep their CI cell."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "testing.md"
SECTION = "## Which feature each CI cell proves"
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
NODE = re.compile(r"`(tests/[^`]+::[^`]+)`")


SLOW_ONLY = "### Proven only by the slow pass"


def _rows(section: str, width: int) -> list[list[str]]:
    text = DOC.read_text()
    assert section in text, f"{DOC} has no section {section!r}"
    body = text.split(section, 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    rows = []
    for line in body.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cols) == width and not set(cols[1]) <= {"-"} and cols[0] not in (
                "Feature", "Slow test"):
            rows.append(cols)
    return rows


def table() -> list[tuple[str, list[str], list[str]]]:
    """(feature, CI node ids, slow test functions) per row of the docs table, and one row per slow-only test
    (no CI cell, its reason given) under SLOW_ONLY."""
    rows = [(c[0], NODE.findall(c[1]), NODE.findall(c[2])) for c in _rows(SECTION, 3)]
    return rows


def slow_only() -> dict[str, str]:
    """Slow test function -> why it is not in CI (docs/testing.md's SLOW_ONLY table)."""
    return {NODE.findall(c[0])[0]: c[1] for c in _rows(SLOW_ONLY, 2)}


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> dict[str, bool]:
    """node id -> slow, for every test under tests/multirank (pytest's own collection, marks included)."""
    out = tmp_path_factory.mktemp("collect") / "marks.json"
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "slow or not slow", "-p", "tests.support.collect_marks", "tests/multirank"],
                         cwd=ROOT, env={**os.environ, "ZT_COLLECT_MARKS_OUT": str(out)}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def function_of(node: str) -> str:
    return node.split("[", 1)[0]


def problems(rows: list[tuple[str, list[str], list[str]]], collected: dict[str, bool],
             excused: dict[str, str] | None = None) -> list[str]:
    """What is wrong with the table against the collection (empty: nothing); excused: slow-only tests with their
    reason."""
    found = [f"slow-only {name} gives no reason" for name, why in (excused or {}).items() if len(why) < 20]
    for feature, ci, _ in rows:
        if not ci:
            found.append(f"{feature!r}: no CI cell")
        for node in ci:
            if node not in collected:
                found.append(f"{feature!r}: {node} is not collected (renamed or removed?)")
            elif collected[node]:
                found.append(f"{feature!r}: {node} is slow: CI does not run it")
    rest = {name for _, _, slow in rows for name in slow} | set(excused or {})
    functions = {function_of(n) for n in collected}
    found += [f"named as slow but no such test: {name}" for name in sorted(rest - functions)]
    found += [f"slow test whose feature the table does not name (add it to its third column): {name}"
              for name in sorted({function_of(n) for n, slow in collected.items() if slow} - rest)]
    return found


def test_every_feature_has_a_ci_cell_and_every_slow_test_a_feature(collected):
    rows = table()
    assert len(rows) >= 30, "the table lost its rows"
    assert problems(rows, collected, slow_only()) == []


def test_slow_only_is_no_issue_49_feature_and_names_slow_tests(collected):
    excused = slow_only()
    assert len(excused) <= 4, "more features proven only by the slow pass: find them a CI cell"
    for name in excused:
        assert any(function_of(n) == name and slow for n, slow in collected.items()), f"{name}: no slow test"
        assert name not in {function_of(n) for n in ISSUE_49}


def test_issue_49_features_keep_a_ci_cell(collected):
    named = {n for _, ci, _ in table() for n in ci}
    for node in ISSUE_49:
        assert node in named, f"{node} is not in {DOC.name}'s table"
        assert node in collected and not collected[node], f"{node}: not a CI cell"


def test_the_check_fails_on_a_slow_cell_named_as_ci_and_on_an_unnamed_slow_test(collected):
    rows = table()
    slow = next(n for n, s in collected.items() if s)
    assert any("is slow" in p for p in problems([*rows, ("x", [slow], [])], collected))
    without = [(f, ci, [n for n in rest if n != function_of(slow)]) for f, ci, rest in rows]
    assert any(function_of(slow) in p for p in problems(without, collected))
    assert any("no CI cell" in p for p in problems([*rows, ("x", [], [])], collected))

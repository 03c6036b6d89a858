"""Measured figures in README.md and docs/ are the ones their scripts' committed raw output holds.

Each row: a doc, the script that measures, its raw output under benchmarks/, and the sentence the doc must
contain, rendered from that output. A rerun of the script that changes a figure fails here until the doc
quotes the new figure (or a doc edited by hand without a measurement behind it fails at once).
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks"


def _json(rel: str) -> dict:
    return json.loads((RESULTS / rel).read_text())


def _flat(text: str) -> str:
    """Markdown with line breaks and runs of spaces folded to one space (a sentence may wrap anywhere)."""
    return re.sub(r"\s+", " ", text)


def _demo_readme(d: dict) -> str:
    return f"{d['steps']} steps, loss {d['loss_first']:.2f} -> {d['loss_last']:.2f}, {d['wall_s']:.0f} s for the whole command"


def _demo_training(d: dict) -> str:
    return (f"{d['steps']} steps, loss {d['loss_first']:.2f} -> {d['loss_last']:.2f}, {d['train_s']:.0f} s of training, "
            f"{d['peak_rss_mib']} MiB peak RSS per rank, {d['wall_s']:.0f} s for the whole command")


def _bf16(d: dict) -> str:
    return (f"{statistics.median(d['bf16_s']) * 1e3:.0f} ms vs {statistics.median(d['fp32_s']) * 1e3:.1f} ms")


def _peak_in_sample(d: dict) -> str:
    errs = [r["error_pct"] for r in d.values() if r.get("measured")]
    return f"{len(errs)} whole runs"


def _peak_in_sample_range(d: dict) -> str:
    errs = [r["error_pct"] for r in d.values() if r.get("measured")]
    return f"from {-min(errs):.1f}% over to {max(errs):.1f}% under the measured peak"


def _peak_held_out(d: dict) -> str:
    errs = [r["error_pct"] for r in d.values() if r.get("measured")]
    return f"{len(errs)} held-out runs, {sum(abs(e) <= 15 for e in errs)} within 15%"


def _rank0(d: dict) -> str:
    r = d["runs"]
    return (f"rank 1 peaks at {r['rank0']['ranks'][1]['after_build_mib']:,} MiB after the engine is built vs "
            f"{r['every_rank']['ranks'][1]['after_build_mib']:,} MiB when every rank loads the weights")


def _rank0_table(d: dict) -> str:
    r = d["runs"]
    return (f"rank 1 peaks at {r['rank0']['ranks'][1]['after_build_mib']:,} MiB vs "
            f"{r['every_rank']['ranks'][1]['after_build_mib']:,} MiB")


def _buckets(d: dict) -> str:
    t = d["timed"]
    med = statistics.median
    return (f"{med(t['zt_generated']['ratio']):.2f}x DeepSpeed's defaults' ZeRO-3 speed at "
            f"{t['zt_generated']['state'] / 2**20:.0f} MiB instead of {t['ds_defaults']['state'] / 2**20:.0f} MiB")


def _acc_rule(d: dict) -> str:
    return f'Accelerate/HF "auto" rule was {statistics.median(d["timed"]["acc_rule"]["ratio"]):.2f}x'


def _layouts(d: dict) -> list[str]:
    rows = []
    for backend, name in (("fsdp", "FSDP"), ("deepspeed", "DeepSpeed")):
        for r in d["layouts"][backend]:
            if r["tokens_per_s"]:
                layout = "dp=2" if r["tp"] == r["pp"] == "1" else f"tp={r['tp']}" if r["tp"] != "1" else f"pp={r['pp']}"
                rows.append(f"| {name}, {r['stage']} | {layout} | {float(r['tokens_per_s']):,.0f} | "
                            f"{float(r['model_state_bytes_measured']) / 2**20:.2f} |")
    return rows


def _longest(d: dict) -> str:
    """The long-context benchmark's answer per configuration: the longest sequence that trained within the limit."""
    best: dict[str, int] = {}
    labels = {}
    for t in d["trials"]:
        labels[t["framework"]] = t["label"]
        if t["status"] == "ok":
            best[t["framework"]] = max(best.get(t["framework"], 0), t["seq_len"])
    return "; ".join(f"{labels[k]}: {best[k]} tokens" for k in ("zt-sp2", "zt-sp2-plain", "hf-alst", "hf-z3", "zt-sp1"))


def _long_memory(d: dict) -> list[str]:
    r = {(x["sp"], x["reducers"]): x for x in d["rows"]}
    gib = 2**30
    err = {k: 100 * (x["peak_rss_bytes"] - x["peak_rss_predicted"]) / x["peak_rss_predicted"] for k, x in r.items()}
    plain = [e for (sp, red), e in err.items() if red in ("none", "tiled-mlp")]
    chunked = [e for (sp, red), e in err.items() if red in ("chunked-loss", "both")]
    return [f"sp=1 {r[1, 'none']['peak_rss_bytes'] / gib:.2f} GiB, sp=2 {r[2, 'none']['peak_rss_bytes'] / gib:.2f} GiB, "
            f"sp=2 with the tiled MLP and the chunked loss {r[2, 'both']['peak_rss_bytes'] / gib:.2f} GiB",
            f"(+{min(plain):.1f}% to +{max(plain):.1f}%, under) and {min(chunked):.0f}-{max(chunked):.0f}% under"]


def _long_speed(d: dict) -> list[str]:
    tps = {(t["framework"], t["seq_len"]): t["tokens_per_s"] for t in d["trials"]}
    seqs = (1024, 2048, 4096)
    sp = [f"{tps['zt-sp2-plain', s] / tps['zt-sp1', s]:.2f}x ({s})" for s in seqs]
    hf = [100 * (tps["zt-sp2-plain", s] / tps["hf-alst", s] - 1) for s in seqs]
    return [f"{sp[0]}, {sp[1]} and {sp[2]} of sp=1's tokens/s", f"{min(hf):.0f}-{max(hf):.0f}% faster than HF's ALST"]


FIGURES: list[tuple[str, str, Callable[[dict], str | list[str]]]] = [
    ("docs/long-context.md", "results/long_context.json", _longest),
    ("docs/long-context.md", "results/long_context_memory.json", _long_memory),
    ("docs/long-context.md", "results/long_context_speed.json", _long_speed),
    ("README.md", "results/demo.json", _demo_readme),
    ("docs/training.md", "results/demo.json", _demo_training),
    ("docs/training.md", "results/bf16_matmul.json", _bf16),
    ("docs/benchmarks.md", "results/bf16_matmul.json", _bf16),
    ("docs/engine-api.md", "results/rank0_load.json", _rank0),
    ("docs/benchmarks.md", "results/rank0_load.json", _rank0_table),
    ("docs/configs.md", "results/sweep_stage3.md.json", _buckets),
    ("docs/configs.md", "results/sweep_stage3.md.json", _acc_rule),
    ("docs/benchmarks.md", "results/sweep_stage3.md.json", _buckets),
    ("benchmarks/RESULTS.md", "results/parallel_layouts.json", _layouts),
    ("docs/memory-and-tuning.md", "results_peak_calibration.json", _peak_in_sample),
    ("docs/memory-and-tuning.md", "results_peak_calibration.json", _peak_in_sample_range),
    ("docs/memory-and-tuning.md", "results/peak_heldout.json", _peak_held_out),
]


@pytest.mark.parametrize("doc,raw,render", FIGURES, ids=[f"{d}:{f.__name__}" for d, _, f in FIGURES])
def test_doc_quotes_the_measured_figure(doc: str, raw: str, render: Callable[[dict], str | list[str]]) -> None:
    text = _flat((REPO / doc).read_text())
    expected = render(_json(raw))
    for phrase in expected if isinstance(expected, list) else [expected]:
        assert phrase in text, f"{doc} should say {phrase!r} (benchmarks/{raw})"


@pytest.mark.parametrize("table", sorted([*(RESULTS / "results").glob("sweep_*.md"),
                                           *(RESULTS / "results").glob("long_context*.md")]), ids=lambda p: p.name)
def test_results_md_quotes_each_sweep_table_as_measured(table: Path) -> None:
    """Every table row a sweep or the long-context benchmarks wrote (benchmarks/results/*.md, next to its .json) is
    in RESULTS.md as is."""
    doc = (RESULTS / "RESULTS.md").read_text()
    rows = [ln for ln in table.read_text().splitlines() if ln.startswith("| ") and not ln.startswith("| ---")]
    assert rows and all(row in doc for row in rows), [row for row in rows if row not in doc]


def test_the_unit_suite_time_quoted_is_the_logged_one() -> None:
    import re as _re

    log = (RESULTS / "results" / "unit_tests.txt").read_text()
    seconds = float(_re.search(r"passed.* in ([0-9.]+)s", log).group(1))
    for doc in ("README.md", "docs/testing.md"):
        assert f"{seconds:.0f} s" in _flat((REPO / doc).read_text()), doc

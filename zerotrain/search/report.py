"""Tables and charts for `estimate` and `compare`: plain-text table, CSV, Markdown, PNG.

Pure formatting: rows are dicts, columns are chosen by the caller. matplotlib is imported only
when a chart is drawn (and with the Agg backend, so it works without a display).
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

REPORT_COLUMNS: tuple[str, ...] = (
    "backend", "stage", "offload_optimizer", "offload_param", "precision", "world_size", "tp", "pp", "sp", "ep",
    "model_state_bytes_measured", "model_state_bytes_predicted", "model_state_error_pct",
    "peak_rss_bytes", "peak_rss_predicted", "peak_rss_error_pct",
    "tokens_per_s", "step_time_s", "final_loss", "status", "error", "output",
)
"""Columns of compare's report.csv, in order (tp, pp, sp: tensor-, pipeline- and sequence-parallel degrees of the run;
the model-state bytes are per rank, the largest rank measured and the largest pipeline stage predicted)."""


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def text_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], headers: Optional[Sequence[str]] = None) -> str:
    """Aligned plain-text table; numbers right-aligned."""
    headers = list(headers or columns)
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(row) for row in cells]
    return "\n".join(out)


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str],
                   headers: Optional[Sequence[str]] = None) -> str:
    """GitHub Markdown table."""
    headers = list(headers or columns)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(_cell(r.get(c)).replace("|", "\\|").replace("\n", " ") for c in columns) + " |")
    return "\n".join(out)


def write_csv(path: str | Path, rows: Iterable[dict[str, Any]], columns: Sequence[str] = REPORT_COLUMNS) -> Path:
    """CSV with a fixed column order; missing values are empty, extra keys dropped."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in columns})
    return path


def read_csv(path: str | Path) -> list[dict[str, str]]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def config_label(r: dict[str, Any]) -> str:
    """Short name of one configuration: 'ds z2', 'ds z3 +opt+param', 'fsdp tp2 z3', 'ds pp2 z1', 'ds sp2 z3';
    grpo's rollout choices after it: 'ds z3 exact', 'fsdp z2 rows8 gfwd'."""
    be = {"deepspeed": "ds"}.get(str(r.get("backend")), str(r.get("backend")))
    off = []
    if r.get("offload_optimizer") not in (None, "", "none"):
        off.append("opt")
    if r.get("offload_param") not in (None, "", "none"):
        off.append("param")
    par = "".join(f" {k}{r.get(k)}" for k in ("tp", "pp", "sp", "ep") if str(r.get(k) or 1) not in ("1", ""))
    engine, rows, gather = r.get("rollout_engine"), str(r.get("rollout_rows") or 0), r.get("generation_gather")
    rl = (" exact" if engine == "exact" else f" rows{rows}" if engine == "batched" and rows != "0" else "") \
        + (" gfwd" if gather == "forward" else "")
    return f"{be}{par} z{r.get('stage')}" + (" +" + "+".join(off) if off else "") + rl


def plot_compare(path: str | Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Two panels: per-rank model-state bytes measured vs predicted, and tokens/s, per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [config_label(r) for r in rows]
    x = list(range(len(rows)))

    def mib(v: Any) -> float:
        try:
            return float(v) / 2**20
        except (TypeError, ValueError):
            return 0.0

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(rows) + 4), 4.5))
    w = 0.38
    ax1.bar([i - w / 2 for i in x], [mib(r.get("model_state_bytes_measured")) for r in rows], w, label="measured")
    ax1.bar([i + w / 2 for i in x], [mib(r.get("model_state_bytes_predicted")) for r in rows], w, label="predicted")
    ax1.set_title("model-state memory per rank")
    ax1.set_ylabel("MiB")
    ax1.set_xticks(x, labels, rotation=30, ha="right")
    ax1.legend()
    tps = []
    for r in rows:
        try:
            tps.append(float(r.get("tokens_per_s") or 0))
        except (TypeError, ValueError):
            tps.append(0.0)
    colors = ["tab:green" if r.get("status") == "ok" else "tab:red" for r in rows]
    ax2.bar(x, tps, 0.6, color=colors)
    ax2.set_title("throughput (red: failed)")
    ax2.set_ylabel("tokens/s (all ranks)")
    ax2.set_xticks(x, labels, rotation=30, ha="right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_tune(path: str | Path, rows: Sequence[dict[str, Any]], limit: int, usable: int,
              winner: Optional[dict[str, Any]] = None, measure: str = "tokens_per_s", unit: str = "tokens/s") -> Path:
    """`zerotrain tune`'s chart: measured speed (`measure`, in `unit`: tokens/s, grpo's completions/s) against
    memory per rank (measured peak) for every trial that ran; candidates without a measurement (pruned, not run,
    failed) as markers on the memory axis at their predicted peak; the winner starred; the memory limit and the
    pruning line (limit less the margin) drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def num(v: Any) -> Optional[float]:
        try:
            return float(v) if v not in (None, "") else None
        except (TypeError, ValueError):
            return None

    mib = 2.0 ** 20
    fig, ax = plt.subplots(figsize=(11, 5.5))
    ran = [r for r in rows if r.get("status") in ("ok", "winner", "over-limit") and num(r.get("measured_peak_bytes"))]
    for r in ran:
        x, y = num(r["measured_peak_bytes"]) / mib, num(r.get(measure)) or 0.0
        color = "tab:orange" if r["status"] == "over-limit" else "tab:blue"
        ax.scatter([x], [y], s=40, color=color, zorder=3)
        pred = num(r.get("predicted_peak_bytes"))
        if pred:  # the prediction of the same trial, joined to its measurement
            ax.plot([pred / mib, x], [y, y], color="tab:gray", lw=0.8, ls=":", zorder=2)
            ax.scatter([pred / mib], [y], s=14, marker="|", color="tab:gray", zorder=2)
        ax.annotate(f"{config_label(r)} mb{r.get('micro_batch')}" + (" ckpt" if str(r.get("gradient_checkpointing"))
                                                                     in ("True", "true", "1") else ""),
                    (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    top = max([num(r.get(measure)) or 0.0 for r in ran] + [1.0])
    markers = {"pruned": ("x", "tab:red", "pruned (predicted peak)"), "not-run": ("o", "tab:gray", "not run "
               "(predicted peak)"), "failed": ("X", "black", "failed (predicted peak)"),
               "timeout": ("X", "black", "failed (predicted peak)")}
    seen: set[str] = set()
    for r in rows:
        mk = markers.get(str(r.get("status")))
        pred = num(r.get("predicted_peak_bytes"))
        if mk is None or pred is None:
            continue
        ax.scatter([pred / mib], [0.0], marker=mk[0], color=mk[1], s=36, zorder=3,
                   facecolors="none" if mk[0] == "o" else None, label=None if mk[2] in seen else mk[2])
        seen.add(mk[2])
    if winner is not None and num(winner.get("measured_peak_bytes")):
        ax.scatter([num(winner["measured_peak_bytes"]) / mib], [num(winner[measure])], marker="*", s=320,
                   color="gold", edgecolors="black", zorder=4, label=f"winner: {config_label(winner)} "
                                                                     f"mb{winner.get('micro_batch')}")
    ax.axvline(limit / mib, color="tab:red", lw=1.5, label=f"memory limit {limit / mib:,.0f} MiB")
    ax.axvline(usable / mib, color="tab:red", lw=1.0, ls="--", label=f"pruning line {usable / mib:,.0f} MiB")
    ax.scatter([], [], color="tab:blue", label="measured trial")
    if ran:
        ax.scatter([], [], marker="|", color="tab:gray", label="its predicted peak (dotted)")
    if any(r["status"] == "over-limit" for r in ran):
        ax.scatter([], [], color="tab:orange", label="measured above the limit")
    ax.set_xlabel("memory per rank (MiB): measured peak; markers on the axis: predicted")
    ax.set_ylabel(f"{unit} (all ranks, median of timed steps)")
    ax.set_ylim(bottom=-0.05 * top, top=top * 1.2)
    ax.set_title("zerotrain tune: throughput vs memory per rank")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

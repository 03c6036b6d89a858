"""`zerotrain tune`'s report files: report.csv (every candidate, TUNE_COLUMNS), report.md (the winner, every
candidate with its predicted and measured memory, tokens/s and why it was pruned or lost, how the decision was
made, the estimator's error on each measured trial) and report.png (report.plot_tune)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..util import human_bytes


def write_reports(out_dir: Path, rows: list[dict], ctx: dict, winner: Optional[dict]) -> None:
    from .report import plot_tune, write_csv
    from .tune_decisions import MEASURES, TUNE_COLUMNS

    write_csv(out_dir / "report.csv", rows, TUNE_COLUMNS)
    (out_dir / "report.md").write_text(_markdown(rows, ctx, winner))
    measure = ctx.get("rank_by", "tokens_per_s")  # a trials.json from before grpo's measure: tokens/s
    plot_tune(out_dir / "report.png", rows, ctx["limit"], int(ctx["limit"] * (1 - ctx["safety_margin"])), winner,
              measure, MEASURES[measure])


def _markdown(rows: list[dict], ctx: dict, winner: Optional[dict]) -> str:
    from .report import config_label, markdown_table
    from .tune_decisions import MEASURES, PEAK_TOLERANCE_PCT, mib, underpredicted, usable

    measure = ctx.get("rank_by", "tokens_per_s")
    unit = MEASURES[measure]

    def pct(v: Any) -> str:
        return "-" if v is None or v == "" else f"{float(v):+.1f}%"

    def fmt(r: dict) -> dict:
        tps, speed = r.get("tokens_per_s"), r.get(measure)
        return {"candidate": f"{config_label(r)} mb{r['micro_batch']}" + (" ckpt" if r["gradient_checkpointing"]
                                                                          else ""),
                "accum": r.get("grad_accum", "-"), "status": r["status"] or "-",
                "predicted peak": mib(r["predicted_peak_bytes"]) if r.get("predicted_peak_bytes") else "-",
                "measured peak": mib(r["measured_peak_bytes"]) if r.get("measured_peak_bytes") else "-",
                "peak error": pct(r.get("peak_error_pct")),
                "model states meas./pred.": f"{human_bytes(r.get('measured_model_state_bytes'))} / "
                                            f"{human_bytes(r.get('predicted_model_state_bytes'))}",
                "tokens/s": "-" if not tps else f"{float(tps):,.0f}",
                **({} if measure == "tokens_per_s" else {unit: "-" if not speed else f"{float(speed):,.2f}",
                                                         "step s": f"{float(r['step_time_s']):.3f}"
                                                         if r.get("step_time_s") else "-",
                                                         "generation s": f"{float(r['generation_s']):.3f}"
                                                         if r.get("generation_s") else "-"}),
                "why": (r.get("error") and f"{r['reason']}: `{r['error']}`") or r.get("reason") or "-"}

    order = {"winner": 0, "ok": 1, "over-limit": 2, "unknown-peak": 2, "failed": 3, "timeout": 3, "not-run": 4, "pruned": 5}
    listed = sorted([r for r in rows if r["status"] != "refused"],
                    key=lambda r: (order.get(r["status"], 6), -(float(r.get(measure) or 0)),
                                   r.get("prior_rank") or 0, r.get("predicted_peak_bytes") or 0))
    measured = [r for r in rows if r.get("measured_peak_bytes")]
    cap = usable(ctx["limit"], ctx["safety_margin"])
    lines = [f"# zerotrain tune: {ctx['model']}", "",
             f"{ctx['num_params']:,} parameters" + (f" ({ctx['trainable_params']:,} trainable, LoRA r={ctx['lora_r']})"
                                                    if ctx.get("lora_r") else "")
             + f", {ctx['nproc']} ranks ({ctx['device']}), {ctx['precision']}, seq-len {ctx['seq_len']}, global batch "
               f"{ctx['global_batch']}" + (f" ({ctx['batch_note']})" if ctx.get("batch_note") else "") + f"; {ctx['date']}.",
             "",
             f"Memory per rank: {human_bytes(ctx['limit'])} ({ctx['limit_source']}); candidates are pruned when their "
             f"predicted peak exceeds {human_bytes(cap)} (a {ctx['safety_margin']:.0%} safety margin for the "
             f"estimator's error). Trials: {ctx['trial_steps']} steps each, the first {ctx['warmup_steps']} left out of "
             f"{unit}, {ctx['repeats']} round(s), at most {ctx['max_trials']} trials in {ctx['budget_s']:g} s.", ""]
    if winner is not None:
        lines += [f"**Winner: {config_label(winner)}, micro-batch {winner['micro_batch']} x grad-accum "
                  f"{winner['grad_accum']}" + (", gradient checkpointing" if winner["gradient_checkpointing"] else "")
                  + _rollout_words(winner)
                  + f"**: {float(winner[measure]):,.{0 if measure == 'tokens_per_s' else 2}f} {unit}"
                  + (f" (step {float(winner['step_time_s']):.3f} s)" if measure != "tokens_per_s" else "")
                  + ", measured peak "
                    f"{human_bytes(winner['measured_peak_bytes'])} per rank.", "",
                  "```bash", f"torchrun --nproc_per_node {ctx['nproc']} -m zerotrain train --config run.yaml", "```", ""]
    else:
        lines += ["**No winner**: no measured candidate fits (see the statuses below).", ""]
    lines += [markdown_table([fmt(r) for r in listed], list(fmt(listed[0]))) if listed else "(no candidate)", ""]
    outside = [r for r in rows if r["status"] != "refused" and r.get("outside_calibration")]
    if outside:
        lines += ["## Outside the calibrated region", "",
                  f"{len(outside)} of {len([r for r in rows if r['status'] != 'refused'])} candidates have a predicted "
                  "peak that no measured run of their kind has checked (benchmarks/PEAK_CALIBRATION.md): their pruning "
                  "rests on an extrapolation; a larger --safety-margin guards against it.", ""]
        for why in dict.fromkeys(r["outside_calibration"] for r in outside):
            names = [r["name"] for r in outside if r["outside_calibration"] == why]
            lines.append(f"- {len(names)} candidate(s) ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): "
                         f"{why}")
        lines.append("")
    refused = [r for r in rows if r["status"] == "refused"]
    if refused:
        lines += ["## Refused by the rules (not estimated, not run)", ""]
        for reason in dict.fromkeys(r["reason"] for r in refused):
            names = [r["name"] for r in refused if r["reason"] == reason]
            lines.append(f"- {len(names)} candidate(s) ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}): "
                         f"{reason.removeprefix('refused: ')}")
        lines.append("")
    lines += ["## How it was decided", "",
              "- Search space: backends " + ", ".join(ctx["space"]["backends"]) + "; stages "
              + ", ".join(map(str, ctx["space"]["stages"])) + "; micro-batches "
              + (", ".join(map(str, ctx["space"]["micro_batches"])) if isinstance(ctx["space"]["micro_batches"], list)
                 else "auto (powers of two dividing the global batch per replica)") + "; gradient checkpointing "
              + "/".join("on" if c else "off" for c in ctx["space"]["checkpointing"]) + "; tp "
              + ", ".join(map(str, ctx["space"]["tp"])) + "; pp " + ", ".join(map(str, ctx["space"]["pp"]))
              + "; sp " + ", ".join(map(str, ctx["space"].get("sp", [1])))
              + "; ep " + ", ".join(map(str, ctx["space"].get("ep", [1]))) + "; memory reducers "
              + "/".join("on" if c else "off" for c in ctx["space"].get("reducers", [False]))
              + ("; rollout engines " + ", ".join(ctx["space"]["rollout_engines"]) + "; rollout rows "
                 + (", ".join(map(str, ctx["space"]["rollout_rows"])) if ctx["space"].get("rollout_rows")
                    else "auto (0: a rank's whole generation batch per call, and half of it in whole groups)")
                 + " (batched only); generation gather " + ", ".join(ctx["space"]["gathers"])
                 + " (where the weights are sharded: ZeRO-3, FSDP2 stage 1-3)"
                 if any(ctx["space"].get("rollout_engines") or [""]) else "") + ".",
              "- Offload: " + ("searched (optimizer offload at stage 1-3, parameter offload at stage 3)."
                               if ctx["space"]["offload"] else
                               "not searched: " + ("a CPU-only machine keeps the \"device\" in host RAM, so offloading "
                                                   "moves nothing off it and its cost would be measured for no gain."
                                                   if ctx["device"] == "cpu" else "--offload off.")),
              "- Predicted peak: `zerotrain estimate` of the same run plan (" +
              ("whole-run peak RSS of a CPU-only rank: runtime baseline, model states, activations, the largest "
               "transient" if ctx["device"] == "cpu" else "GPU bytes: model states kept on the device + activations")
              + "). Trials run in the order of a prior cost (zerotrain/search/tune_decisions.py prior_cost: micro-batch overhead, "
                "recomputation, stage communication, offload, tp, pipeline bubble); the measurements decide.",
              f"- Ranked by {unit}" + (": completions per second, the global batch over the step time (generation "
                                       "included): a grpo step is mostly generation and its trained tokens vary with "
                                       "the sampled lengths, so tokens/s would not compare trials."
                                       if measure == "samples_per_s" else ".")
              + (f" {ctx['rl_note']}" if ctx.get("rl_note") else ""),
              f"- Winner: the highest measured {unit} among trials that finished with a measured peak within the "
              f"{human_bytes(ctx['limit'])} limit; rows within {ctx['tie_pct']:g}% of the best {unit} tie and the "
              "smallest measured peak wins the tie. A trial that failed, timed out or peaked above the limit is "
              "infeasible and listed with its first error line.", ""]
    if measured:
        worst = underpredicted(measured)
        errs = [float(r["peak_error_pct"]) for r in measured if r.get("peak_error_pct") is not None]
        lines += ["## Estimator error on the measured trials", "",
                  f"Peak per rank, (measured - predicted) / predicted: {min(errs):+.1f}% to {max(errs):+.1f}% over "
                  f"{len(errs)} trial(s)." if errs else "No peak was measured."]
        if worst:
            lines.append(f"**Above the {PEAK_TOLERANCE_PCT:g}% tolerance** (the prediction under-estimates these: "
                         "raise --safety-margin for such runs): " + ", ".join(
                             f"{r['name']} {float(r['peak_error_pct']):+.1f}%" for r in worst) + ".")
        else:
            lines.append(f"Every measured peak is within {PEAK_TOLERANCE_PCT:g}% above its prediction.")
        lines.append("")
    return "\n".join(lines) + "\n"


def _rollout_words(r: dict) -> str:
    """A grpo winner's rl.* choices in words ('' for another task)."""
    if not r.get("rollout_engine"):
        return ""
    rows = int(r.get("rollout_rows") or 0)
    return (f", rollout engine {r['rollout_engine']}"
            + (f" ({rows} rows a call)" if rows else " (a rank's generation batch in one call)"
               if r["rollout_engine"] == "batched" else "")
            + (f", generation gather {r['generation_gather']}" if r.get("generation_gather") else ""))

"""`zerotrain estimate`: per-rank memory for every ZeRO stage x offload, DeepSpeed and FSDP2.

    zerotrain estimate --model gpt2 --nproc 8 --nodes 2 --precision bf16
    zerotrain estimate --model tiny-gpt2 --nproc 2 --micro-batch 2 --seq-len 64 --json
    zerotrain estimate --model path/to/config.json --explain
    zerotrain estimate --config run.yaml --nproc 2     # the run flags and YAML of `zerotrain train`
    zerotrain estimate --model tiny-llama --nproc 4 --tp 2          # tensor-parallel 2 x data-parallel 2
    zerotrain estimate --model tiny-llama --nproc 2 --pp 2 --grad-accum 4   # pipeline: largest stage
    zerotrain estimate --model tiny-llama --nproc 8 --tp 2 --pp 2 --grad-accum 4   # tp 2 x pp 2 x dp 2 (FSDP2 rows)

Reads only the model's config (the parameter count is exact, from a meta-device model); no
weights are loaded. Each row is the run plan `zerotrain train` would build (zerotrain/plan/run_plan.py) with
that backend, stage and offload; rows train refuses are named, not listed (a layout no row can run,
e.g. --tp 2 on GPT-2, is one line; dimensions a backend does not run together, per the capability table
zerotrain/plan/capabilities.py, are its rows' one refusal line). Under --tp/--pp (and tp x pp, sp x tp) the
figures are per rank of the largest pipeline stage, sharded over the data-parallel (x sequence-parallel) size. The formulas are in zerotrain.memory.estimate.FORMULAS
(`--explain` prints them).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..config.flags import add_run_flags, config_from_args
from ..errors import UserError
from ..plan.capabilities import BACKENDS
from ..search.report import text_table
from ..tasks import task_spec
from ..util import human_bytes

SWEPT = ("zero.stage", "zero.offload_optimizer", "zero.offload_param", "backend")
"""Run-config keys every row sets itself (the sweep), so they are not flags here."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=1, help="ranks per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes")
    p.add_argument("--backends", default=",".join(BACKENDS), help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--explain", action="store_true", help="also print the formulas")
    add_run_flags(p, skip=SWEPT)  # train's own run flags and defaults
    p.epilog = ("--model also takes a config.json or a tiny preset (tiny-gpt2, small-gpt2); with neither --model "
                "nor --model-config it estimates the embedded model `zerotrain train` would build.")


def _check(args: argparse.Namespace) -> list[str]:
    for name in ("nproc", "nodes"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name} must be >= 1 (got {getattr(args, name)})")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad or not backends:
        raise UserError(f"--backends {args.backends!r}: use a comma list of {', '.join(BACKENDS)}")
    return backends


def _serving(cfg) -> dict:
    """fp32 and per-scheme serving bytes of the model (meta build; None where the scheme cannot apply)."""
    from ..model.quant import serving_bytes
    from ..model.source import meta_train_model

    if not task_spec(cfg.model.task).causal_lm:
        return {}
    return serving_bytes(meta_train_model(cfg), cfg.quant.group_size)


def run(args: argparse.Namespace) -> int:
    from ..assets.demo import DEMO_PRESET
    from ..memory.activations import expert_all_to_all_bytes
    from ..memory.estimate import FORMULAS, estimate, setup_plan, setups
    from ..memory.runtime import outside_calibration
    from ..model.source import model_facts_for

    backends = _check(args)
    cfg = config_from_args(args)
    model = cfg.model.from_config or cfg.model.name or f"embedded {DEMO_PRESET}"  # what is sized
    spec = model_facts_for(cfg)  # the model `train` builds (no --model: the embedded demo)
    world = args.nproc * args.nodes
    ests, refused = [], []
    for s in setups(backends):
        try:
            ests.append(estimate(setup_plan(cfg, s, world, facts=spec)))
        except UserError as e:  # a row `train` would refuse (e.g. fp16 under FSDP) is not listed
            refused.append((s, str(e)))
    if not ests:
        raise UserError(f"no configuration can run: {refused[0][1]}")
    b, layout = ests[0].plan.batch, ests[0].plan.world
    task = ests[0].plan.task
    holds_reference = task.holds_reference(cfg)
    serving = _serving(cfg)
    if args.json:
        out = {"model": model, "num_params": spec.num_params, "active_params": spec.active_params,
               "num_experts": spec.num_experts, "world_size": world, "tp": layout.tp, "pp": layout.pp, "ep": layout.ep,
               "dp": layout.dp, "bubble": ests[0].bubble, "precision": ests[0].plan.dtype,
               "micro_batch": b.micro_batch, "seq_len": cfg.data.seq_len, "grad_accum": b.grad_accum,
               "gradient_checkpointing": cfg.model.gradient_checkpointing,
               "estimates": [dict(e.to_dict(), peak_rss_train_cli=e.run_peak_rss) for e in ests],
               "formulas": FORMULAS, "serving_bytes": serving}
        if refused:
            out["refused"] = [dict(s._asdict(), error=err) for s, err in refused]
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    rows = []
    for e in ests:
        c = e.by_category()
        rows.append({"config": e.setup.label, "params": human_bytes(c["params"]), "grads": human_bytes(c["grads"]),
                     "optim": human_bytes(c["optimizer_states"]), "master": human_bytes(c["master"]),
                     "buffers": human_bytes(c["buffers"]),
                     **({"reference": human_bytes(c["reference"])} if holds_reference else {}),
                     "device/rank": human_bytes(e.device_bytes),
                     "host/rank": human_bytes(e.host_bytes), "activations": human_bytes(e.activations),
                     **({"generation": human_bytes(e.generation)} if task.online_rl is not None else {}),
                     "peak RSS (CPU run)": human_bytes(e.run_peak_rss)})
        if layout.pp > 1:  # the row's figures are its largest stage's; every stage's model states + activations
            rows[-1]["pp stage"] = e.pp_stage
            rows[-1]["per stage (states+acts)"] = " / ".join(human_bytes(m + a) for m, a in e.stages)
    print(f"{model}: {spec.num_params:,} parameters, {world} rank(s) ({args.nodes} node(s) x {args.nproc}), "
          f"{ests[0].plan.dtype}, micro-batch {b.micro_batch} x seq {cfg.data.seq_len}"
          + (f" x accum {b.grad_accum}" if b.grad_accum > 1 else "")
          + (", gradient checkpointing" if cfg.model.gradient_checkpointing else ""))
    if spec.num_experts:
        ep = layout.ep
        how = (f"split over expert-parallel {ep} ranks ({spec.expert_params // ep:,} per rank before FSDP sharding "
               f"over the {layout.expert_dp} rank(s) holding the same experts); the tokens' all-to-alls send "
               f"{human_bytes(expert_all_to_all_bytes(spec, b.micro_batch, cfg.data.seq_len, ests[0].plan.dtype, ep))}"
               " per rank per micro-batch") if ep > 1 else "sharded by ZeRO/FSDP like the rest (--ep N splits them)"
        print(f"mixture of experts: {spec.num_experts} experts per block, top-{spec.experts_per_token}: "
              f"{spec.active_params:,} of the {spec.num_params:,} parameters active per token; the experts' "
              f"{spec.expert_params:,} are {how}")
    if ests[0].image_text is not None:
        from ..memory.activations import image_text_line

        print(image_text_line(ests[0].image_text, b.micro_batch, ests[0].plan.dtype))
    if task.preference is not None or task.reward_model is not None:
        reference = "a frozen copy (the reference column)" if holds_reference else \
            "none held (LoRA's base with the adapters off, precomputed, or reference-free)"
        model_rows = task.rows_per_sample * b.micro_batch
        what = (f"{b.micro_batch} pairs runs {model_rows} rows (chosen and rejected)"
                if task.rows_per_sample == 2 else f"{b.micro_batch} completions runs {model_rows} rows with "
                "gradients and, before the step, their KL rows without")
        print(f"{task.name}: every micro-batch of {what}; reference model: {reference}")
    if task.online_rl is not None:
        rl = cfg.rl
        print(f"{task.name}: {rl.num_generations} completions of <= {rl.max_completion_len} tokens per prompt, sampled "
              f"with the weights {'gathered once per generation phase' if rl.generation_gather == 'phase' else 'gathered per forward'}"
              f"; reference model: {'a frozen copy (the reference column)' if holds_reference else 'none held'}; "
              "device/rank counts the larger of the step's activations and the generation phase (never together)")
    if layout.tp > 1 or layout.pp > 1 or layout.sp > 1 or layout.ep > 1:
        print(f"layout: {layout.describe()}; per rank: "
              + ("block linears split by the tp_plan, " if layout.tp > 1 else "")
              + ("the largest pipeline stage, " if layout.pp > 1 else "")
              + (f"activations of a 1/{layout.sp} sequence shard, " if layout.sp > 1 else "")
              + f"ZeRO/FSDP sharding over data-parallel {layout.dp}"
              + (f" x sequence-parallel {layout.sp} ranks" if layout.sp > 1 else ""))
    if layout.pp > 1:
        print(f"pipeline bubble (p-1)/(m+p-1) = {ests[0].bubble:.2f} with p = {layout.pp} stages, m = grad_accum "
              f"{b.grad_accum} micro-batches (raise --grad-accum to shrink it)")
    print(text_table(rows, list(rows[0])))
    print("serving size (weights on disk, zerotrain export --quantize): " + ", ".join(
        f"{k} {human_bytes(v)}" if v is not None else f"{k} n/a" for k, v in serving.items()))
    print("device/rank = model states kept on the accelerator + activations; host/rank = offloaded states.\n"
          "peak RSS (CPU run) = the whole `zerotrain train` run on a CPU-only machine (largest rank, final save on):\n"
          "everything in host RAM + the measured runtime baseline of torch/transformers/backend and the train CLI,\n"
          "allocator slack and the largest transient (load or a training step's copies; see --explain).")
    for e in ests:
        for n in e.notes:
            print(f"note ({e.setup.label}): {n}")
    uncalibrated = {e.setup.label: "; ".join(outside_calibration(e.plan, spec, device="cpu")) for e in ests}
    for why in dict.fromkeys(w for w in uncalibrated.values() if w):  # the CPU-run column is what was calibrated
        labels = ", ".join(label for label, w in uncalibrated.items() if w == why)
        print(f"outside the calibrated region ({labels}): {why}: the peak RSS above extrapolates beyond the runs it "
              "was checked against (benchmarks/PEAK_CALIBRATION.md)")
    for err in dict.fromkeys(err for _, err in refused):  # one line per reason, in row order
        print(f"not listed ({', '.join(s.label for s, e in refused if e == err)}): {err}")
    if args.explain:
        print()
        print(FORMULAS)
    return 0

"""`zerotrain estimate`: per-rank memory for every ZeRO stage x offload, DeepSpeed and FSDP2.

    zerotrain estimate --model gpt2 --nproc 8 --nodes 2 --precision bf16
    zerotrain estimate --model tiny-gpt2 --nproc 2 --micro-batch 2 --seq-len 64 --json
    zerotrain estimate --model path/to/config.json --explain

Reads only the model's config (the parameter count is exact, from a meta-device model); no
weights are loaded. The formulas are in zerotrain.memory.FORMULAS (`--explain` prints them).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import UserError
from ..report import text_table
from ..util import human_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="HF hub id, local model directory, config.json, or a tiny preset (tiny-gpt2, small-gpt2)")
    p.add_argument("--task", choices=["causal-lm", "seq-cls"], default="causal-lm")
    p.add_argument("--nproc", type=int, default=1, help="ranks per node")
    p.add_argument("--nodes", type=int, default=1, help="nodes")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per rank per forward")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per step (FSDP keeps unsharded grads while accumulating)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--backends", default="deepspeed,fsdp", help="comma list of deepspeed, fsdp")
    p.add_argument("--reduce-bucket-size", type=int, default=None,
                   help="DeepSpeed reduce bucket (elements); default: zerotrain's rule for this model size")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--explain", action="store_true", help="also print the formulas")


def _check(args: argparse.Namespace) -> list[str]:
    for name in ("nproc", "nodes", "micro_batch", "seq_len", "grad_accum"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in ("deepspeed", "fsdp")]
    if bad or not backends:
        raise UserError(f"--backends {args.backends!r}: use a comma list of deepspeed, fsdp")
    return backends


def run(args: argparse.Namespace) -> int:
    from ..memory import FORMULAS, TRAIN_CLI_EXTRA_RSS, estimate, setups
    from ..model_info import model_facts

    backends = _check(args)
    spec = model_facts(args.model, args.task)
    world = args.nproc * args.nodes
    ests = [estimate(spec, s, micro_batch=args.micro_batch, seq_len=args.seq_len,
                     gradient_checkpointing=args.gradient_checkpointing, reduce_bucket_size=args.reduce_bucket_size,
                     grad_accum=args.grad_accum)
            for s in setups(world, args.precision, backends)]
    if args.json:
        out = {"model": args.model, "num_params": spec.num_params, "world_size": world, "precision": args.precision,
               "micro_batch": args.micro_batch, "seq_len": args.seq_len, "grad_accum": args.grad_accum,
               "gradient_checkpointing": args.gradient_checkpointing,
               "estimates": [dict(e.to_dict(), peak_rss_train_cli=e.peak_rss + TRAIN_CLI_EXTRA_RSS) for e in ests],
               "formulas": FORMULAS}
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    rows = []
    for e in ests:
        c = e.by_category()
        rows.append({"config": e.setup.label, "params": human_bytes(c["params"]), "grads": human_bytes(c["grads"]),
                     "optim": human_bytes(c["optimizer_states"]), "master": human_bytes(c["master"]),
                     "buffers": human_bytes(c["buffers"]), "device/rank": human_bytes(e.device_bytes),
                     "host/rank": human_bytes(e.host_bytes), "activations": human_bytes(e.activations),
                     "peak RSS (CPU run)": human_bytes(e.peak_rss + TRAIN_CLI_EXTRA_RSS)})
    print(f"{args.model}: {spec.num_params:,} parameters, {world} rank(s) ({args.nodes} node(s) x {args.nproc}), "
          f"{args.precision}, micro-batch {args.micro_batch} x seq {args.seq_len}"
          + (", gradient checkpointing" if args.gradient_checkpointing else ""))
    print(text_table(rows, list(rows[0])))
    print("device/rank = model states kept on the accelerator + activations; host/rank = offloaded states.\n"
          "peak RSS (CPU run) = `zerotrain train` on a CPU-only machine: everything in host RAM + the measured\n"
          "runtime baseline of torch/transformers/backend and the train CLI (constants, see --explain).")
    for e in ests:
        for n in e.notes:
            print(f"note ({e.setup.label}): {n}")
    if args.explain:
        print()
        print(FORMULAS)
    return 0

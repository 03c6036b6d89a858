"""Stage-3 knob sweep in ONE 2-rank job: the same loop, only the zero_optimization block differs.

    torchrun --nproc_per_node 2 benchmarks/sweep_stage3.py --rounds 3 --out /tmp/sweep.md

Start-up (imports, process group, data) is paid once, so on a shared 2-core machine many
configurations fit in a few minutes. Every round builds one engine per variant in turn (order
rotated each round), trains `--steps` optimizer steps, times the last `steps - warmup` (step end to
step end, rank 0), counts per-rank model-state bytes, destroys the engine. Variants are zerotrain's
generated config with one knob changed, and DeepSpeed's defaults (only stage/batch/bf16/optimizer/
clipping set, as benchmarks/peers/ds_loop.py). The loop is the hand-written DeepSpeed one for every
variant, so the differences are the knobs alone.
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import gc
import json
import pstats
import statistics
import sys
from datetime import timedelta
from pathlib import Path
from typing import Optional

import deepspeed
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from peers.ds_loop import ds_config as ds_default_config  # noqa: E402


def zerotrain_config(world: int, num_params: int, hidden: int, zero: dict, offload: bool = False,
                     stage: int = 3, precision: str = "bf16") -> dict:
    """zerotrain's generated DeepSpeed config for the job, with `zero` (zero.* fields) changed.

    A "no_pin" key (not a zero.* field) switches pin_memory off in the offload blocks."""
    zero = dict(zero)
    no_pin = zero.pop("no_pin", False)
    raw = zero.pop("ds", {})  # raw DeepSpeed keys merged last (zero_optimization merged key by key)
    if offload:
        zero.update(offload_optimizer="cpu", offload_param="cpu")
    from zerotrain.config.load import build_config
    from zerotrain.model.facts import ModelFacts
    from zerotrain.plan.ds_config import build_ds_config

    cfg = build_config(None, {"zero.stage": stage, "precision.dtype": precision, "batch.micro_batch": C.MICRO_BATCH,
                              "batch.grad_accum": C.GRAD_ACCUM, "optimizer.lr": C.LR, "optimizer.clip": C.CLIP,
                              **{f"zero.{k}": v for k, v in zero.items()}})
    ds = build_ds_config(cfg, world, ModelFacts(num_params, hidden), device="cpu")  # as the engine on CPU ranks
    ds.pop("scheduler", None)
    for k, v in raw.items():
        if isinstance(v, dict) and isinstance(ds.get(k), dict):
            ds[k] = {**ds[k], **v}
        else:
            ds[k] = v
    for key in ("offload_optimizer", "offload_param"):
        if no_pin and key in ds["zero_optimization"]:
            ds["zero_optimization"][key]["pin_memory"] = False
    return ds


def variants(h: int, blocks: tuple[str, ...]) -> dict[str, Optional[dict]]:
    """name -> zero.* changes to zerotrain's generated config (None = DeepSpeed's defaults).

    h: hidden size; blocks: the model's transformer-block classes (model_info.block_classes)."""
    return {
        "ds_defaults": None,
        "zt_generated": {},
        "persist_0": {"param_persistence_threshold": 0},
        "persist_10h": {"param_persistence_threshold": 10 * h},
        "persist_1e4": {"param_persistence_threshold": 10_000},
        "persist_1e5": {"param_persistence_threshold": 100_000},
        "persist_all": {"param_persistence_threshold": 1 << 40},  # no tensor partitioned (ZeRO-2-like params)
        "prefetch_5e7": {"prefetch_bucket_size": 50_000_000},
        # one fetch/release/reduce hook per transformer block instead of per Linear/LayerNorm
        "leaf_blocks": {"ds": {"zero_optimization": {"leaf_module": {"classes": list(blocks)}}}},
        "prefetch_0": {"prefetch_bucket_size": 0},
        "prefetch_1e6": {"prefetch_bucket_size": 1_000_000},
        "no_overlap": {"overlap_comm": False},
        "reduce_1e6": {"reduce_bucket_size": 1_000_000},
        "reduce_hxh": {"reduce_bucket_size": h * h},
        "acc_rule": {"reduce_bucket_size": h * h, "prefetch_bucket_size": int(0.9 * h * h),
                     "param_persistence_threshold": 10 * h},
        "no_pin": {"no_pin": True},
        "ds_sizes_persist_0": {"reduce_bucket_size": 500_000_000, "prefetch_bucket_size": 50_000_000,
                               "max_live_parameters": 1_000_000_000, "param_persistence_threshold": 0},
        # stages 1-2: the knobs that exist there
        "ds_buckets": {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000},
        "overlap": {"overlap_comm": True},
        "comm_fp32": {"ds": {"communication_data_type": "fp32"}},
        "no_reduce_scatter": {"ds": {"zero_optimization": {"reduce_scatter": False}}},
        "reduce_scatter": {"reduce_scatter": True},
        "no_contiguous": {"ds": {"zero_optimization": {"contiguous_gradients": False}}},
        "no_rs_no_contig": {"ds": {"zero_optimization": {"reduce_scatter": False, "contiguous_gradients": False}}},
    }


def run_variant(cfg: dict, mdir: Path, train, collate, steps: int, warmup: int,
                prof: Optional[cProfile.Profile] = None) -> tuple[list[float], int, float]:
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    torch.manual_seed(C.SEED)
    model = AutoModelForCausalLM.from_pretrained(str(mdir))
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=copy.deepcopy(cfg))  # the same dict serves every round
    if prof is not None:
        prof.enable()  # the training loop only, not the engine build
    res, last = C.hand_loop(engine, train, collate, world, rank, steps)  # the peers' loop (wraps epochs)
    if prof is not None:
        prof.disable()
    ends = res.step_ends
    state = int(C.model_state_bytes(engine)["total"])
    engine.destroy()
    del engine, model
    gc.collect()
    durations = [b - a for a, b in zip(ends, ends[1:])]
    return durations[warmup - 1:], state, last


# DeepSpeed's ZeRO-3 Python machinery: module hooks, the parameter coordinator, gradient hooks.
ZERO_FILES = ("runtime/zero/", "runtime/utils.py")
HOOKS = ("fetch_sub_module", "release_sub_module", "pre_sub_module_forward_function",
         "post_sub_module_backward_function", "reduce_partition_and_remove_grads")


def profile_rows(prof: cProfile.Profile, steps: int) -> dict[str, float]:
    """Per optimizer step: Python calls and own time inside DeepSpeed's zero/ package, and the calls of
    the per-submodule hook functions. Call counts do not depend on machine load; times do."""
    stats = pstats.Stats(prof).stats
    zero = [(v[1], v[2]) for k, v in stats.items() if any(f in k[0].replace("\\", "/") for f in ZERO_FILES)]
    out = {"zero_calls": sum(c for c, _ in zero) / steps, "zero_own_s": sum(t for _, t in zero) / steps,
           "all_calls": sum(v[1] for v in stats.values()) / steps}
    for h in HOOKS:
        out[h] = sum(v[1] for k, v in stats.items() if k[2] == h) / steps
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default="")
    ap.add_argument("--offload", action="store_true", help="stage 3 with optimizer and params offloaded to CPU")
    ap.add_argument("--stage", type=int, default=3, help="ZeRO stage (variants must exist at that stage)")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default=C.default_precision())
    ap.add_argument("--profile", action="store_true",
                    help="after the timed rounds, one cProfiled run per variant (rank 0): DeepSpeed calls per step")
    ap.add_argument("--preset", default=C.PRESET, help="model preset (zerotrain.model.facts.TINY_PRESETS), e.g. small-llama")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    # Before the process group: with one, transformers' save_pretrained writes on rank 0 only, and a
    # rank > 0 that builds the model directory would publish it without weights (zerotrain/assets/demo.py).
    mdir = C.model_dir(args.preset)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=300))
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    train, collate = C.dataset(mdir)
    from transformers import AutoConfig

    from zerotrain.model.facts import block_classes

    hf_config = AutoConfig.from_pretrained(str(mdir))
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(hf_config)
    num_params, hidden = sum(p.numel() for p in meta.parameters()), hf_config.hidden_size
    allv = variants(hidden, block_classes(meta))
    names = args.variants.split(",") if args.variants else list(allv)
    rows: dict[str, dict] = {n: {"step_s": [], "state": 0, "ratio": [], "vs_generated": [], "loss": [],
                                 "config": allv[n]} for n in names}
    job = C.Job(stage=args.stage, offload=args.offload, precision=args.precision)
    cfgs = {n: ds_default_config(job, world, {}) if allv[n] is None
            else zerotrain_config(world, num_params, hidden, allv[n], args.offload, args.stage, args.precision)
            for n in names}
    for rnd in range(args.rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        this_round: dict[str, float] = {}
        for n in order:
            durations, state, last = run_variant(cfgs[n], mdir, train, collate, args.steps, args.warmup)
            med = statistics.median(durations)
            this_round[n] = med
            rows[n]["step_s"].append(med)
            rows[n]["state"] = max(rows[n]["state"], state)
            rows[n]["loss"].append(last)
            if rank == 0:
                print(f"round {rnd} {n:<20} {med:.3f} s/step  state {state / 2**20:.1f} MiB  loss {last:.4f}", flush=True)
        for base, key in (("ds_defaults", "ratio"), ("zt_generated", "vs_generated")):
            if base in this_round:  # paired within the round: load drifts between rounds
                for n, med in this_round.items():
                    rows[n][key].append(this_round[base] / med)
    profiled: dict[str, dict[str, float]] = {}
    if args.profile:
        for n in names:
            prof = cProfile.Profile() if rank == 0 else None
            run_variant(cfgs[n], mdir, train, collate, args.steps, args.warmup, prof)
            if prof is not None:
                profiled[n] = profile_rows(prof, args.steps)
    # the state figure is per rank: take the max over ranks
    state = torch.tensor([rows[n]["state"] for n in names], dtype=torch.float64)
    torch.distributed.all_reduce(state, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        tokens = C.MICRO_BATCH * C.GRAD_ACCUM * world * C.SEQ_LEN

        def mr(xs: list[float], fmt: str) -> str:
            return f"{fmt.format(statistics.median(xs))} [{fmt.format(min(xs))}-{fmt.format(max(xs))}]" if xs else "-"

        lines = [f"{args.preset} ({hf_config.model_type}, {num_params:,} parameters), stage {args.stage}, {args.precision}, "
                 f"{args.rounds} rounds x {args.steps} steps ({args.warmup} warm-up)", "",
                 "| variant | zero_optimization change | step s | tokens/s | ds_defaults step / variant step (per round) "
                 "| zt_generated step / variant step (per round) | model-state MiB (max rank) |",
                 "| --- | --- | --- | --- | --- | --- | --- |"]
        for i, n in enumerate(names):
            xs = rows[n]["step_s"]
            lines.append(f"| {n} | {json.dumps(allv[n]) if allv[n] is not None else 'DeepSpeed defaults'} | "
                         f"{mr(xs, '{:.3f}')} | {mr([tokens / x for x in xs], '{:,.0f}')} | {mr(rows[n]['ratio'], '{:.2f}')} "
                         f"| {mr(rows[n]['vs_generated'], '{:.2f}')} | {state[i].item() / 2**20:.1f} |")
        if profiled:
            lines += ["", f"cProfile, rank 0, one run per variant ({args.steps} steps, engine build excluded), per optimizer step:",
                      "", "| variant | Python calls | calls in DeepSpeed zero/ | own time in zero/ s | "
                      + " | ".join(HOOKS) + " |", "| --- " * (len(HOOKS) + 4) + "|"]
            for n, r in profiled.items():
                lines.append(f"| {n} | {r['all_calls']:,.0f} | {r['zero_calls']:,.0f} | {r['zero_own_s']:.3f} | "
                             + " | ".join(f"{r[h]:,.0f}" for h in HOOKS) + " |")
        Path(args.out).write_text("\n".join(lines) + "\n")
        import time

        run_meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "args": vars(args), "model_type": hf_config.model_type,
                "num_params": num_params, "world_size": world, "tokens_per_step": tokens,
                "native_cpu_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}
        Path(args.out + ".json").write_text(json.dumps({"meta": run_meta, "timed": rows, "profiled": profiled}, indent=1))
        print("\n".join(lines))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()

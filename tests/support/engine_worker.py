"""One rank of an engine test run, launched by the tests as plain ranks (tests/support/launch.py ranks) or torchrun.

    torchrun --nproc_per_node 2 tests/support/engine_worker.py --model-dir D --out R.json --stage 3 --steps 6

Trains the tiny model of tests/support/reference.py on its synthetic global batches through
zerotrain.engine.build_engine (any backend), and writes on rank 0 a JSON with per-step loss
(mean over all ranks' micro-batches), grad norm and LR, so the test compares it to the
single-process reference. Optional: save checkpoints at given steps, resume, save_hf + probe
logits, SIGKILL one rank in the middle of a checkpoint save (fault test).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch

import tests.support.families as families
import tests.support.reference as ref


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", "--local-rank", type=int, default=None)  # deepspeed launcher
    p.add_argument("--model-dir", required=True)
    p.add_argument("--out", required=True, help="rank-0 JSON result")
    p.add_argument("--backend", default="deepspeed")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--offload-optimizer", default="none")
    p.add_argument("--offload-param", default="none")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--steps", type=int, default=6, help="total optimizer steps of the run (schedule length)")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this global step (default: --steps)")
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--seq", type=int, default=ref.DEFAULT_SEQ)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--schedule", default="cosine")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="dist_timeout_s")
    p.add_argument("--ckpt-root", default=None)
    p.add_argument("--save-at", type=int, nargs="*", default=[])
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--resume", default=None)
    p.add_argument("--save-hf", default=None)
    p.add_argument("--probe-out", default=None, help="save probe logits (.pt) after training")
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--factory", choices=("builder", "plain"), default="builder",
                   help="builder: zerotrain's ModelBuilder (FSDP builds ranks > 0 on meta); plain: a lambda")
    p.add_argument("--kill-at-save", type=int, default=None, help="SIGKILL --kill-rank while writing this step's shards")
    p.add_argument("--task", choices=("causal-lm", "seq-cls"), default="causal-lm",
                   help="seq-cls: a fresh classification head on the saved body (tests/support/families.py)")
    p.add_argument("--leaf-blocks", choices=("auto", "on", "off"), default="auto", help="zero.leaf_blocks")
    p.add_argument("--freeze-embeddings", action="store_true", help="input embeddings not trained (families.freeze)")
    p.add_argument("--ds-overrides", default="{}", help="JSON: ds_overrides")
    p.add_argument("--tp", type=int, default=1, help="parallel.tp (tensor parallelism)")
    p.add_argument("--pp", type=int, default=1, help="parallel.pp (pipeline parallelism)")
    p.add_argument("--sp", type=int, default=1, help="parallel.sp (sequence parallelism)")
    p.add_argument("--ep", type=int, default=1, help="parallel.ep (expert parallelism)")
    p.add_argument("--router-aux-coef", type=float, default=None, help="model.router_aux_coef (None: the model's)")
    p.add_argument("--freeze-router", action="store_true", help="model.freeze_router")
    p.add_argument("--collectives-out", default=None,
                   help="after training, write this rank's collectives (torch's flight recorder; launch with "
                        "TORCH_FR_BUFFER_SIZE set) to <path>.<rank>.json, with each process group's ranks")
    p.add_argument("--lora-r", type=int, default=0, help="lora.r (LoRA rank; 0 = full fine-tuning)")
    p.add_argument("--lora-targets", default="all-linear", help="lora.targets")
    p.add_argument("--merge-lora", action="store_true", help="lora.merge (save_hf also writes merged/)")
    p.add_argument("--qat", default="none", help="quant.qat (quantization-aware training scheme)")
    p.add_argument("--quant-group-size", type=int, default=16, help="quant.group_size")
    p.add_argument("--gradient-checkpointing", action="store_true", help="model.gradient_checkpointing")
    p.add_argument("--tiled-mlp", type=int, default=0, help="model.tiled_mlp (tokens per MLP tile)")
    p.add_argument("--chunked-loss", type=int, default=0, help="model.chunked_loss (tokens per loss chunk)")
    p.add_argument("--masked-labels", action="store_true",
                   help="causal-lm labels with a varying -100 prefix per row (families.masked_labels)")
    p.add_argument("--whole-step", action="store_true",
                   help="train through engine.train_step (always under --pp: a pipeline has no per-micro-batch backward)")
    return p.parse_args()


def install_kill_hook(at_step: int, engine_ref: list) -> None:
    """SIGKILL this process half-way through writing its optimizer shard of checkpoint `at_step`."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    real_save = TorchCheckpointEngine.save

    def save(self, state_dict, path):
        if engine_ref[0].global_step == at_step and "optim_states" in str(path):
            with open(path, "wb") as f:  # a torn file, as a crash would leave it
                f.write(b"PARTIAL" * 1000)
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(self, state_dict, path)

    TorchCheckpointEngine.save = save


def local_shares(engine) -> dict[str, list[int]]:
    """{parameter: [elements this rank holds, elements of the whole tensor]} for DTensor parameters
    split over a tensor- or expert-parallel mesh dimension (the proof that tp / ep really split them)."""
    out = {}
    for name, p in engine.module.named_parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and ({"tp", "ep"} & set(mesh.mesh_dim_names or ())):
            out[name] = [p.to_local().numel(), p.numel()]
    return out


def write_collectives(path: str) -> None:
    """The flight recorder's entries of this rank (collective, input/output sizes, process group) and the
    groups' ranks, as JSON."""
    import pickle

    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    entries = [{"op": e["profiling_name"], "in": e["input_sizes"], "out": e["output_sizes"],
                "group": e["process_group"][0]} for e in trace["entries"]]
    from torch.distributed.distributed_c10d import _world

    groups = {name: torch.distributed.get_process_group_ranks(pg) for pg, name in _world.pg_names.items()}
    Path(path).write_text(json.dumps({"entries": entries, "groups": groups}))


def local_params(engine) -> dict[str, int]:
    """{parameter name: elements this rank holds} of the engine's module (DTensor shards by their local
    part): gathered from every rank, it shows which stage holds which blocks."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return out


def main() -> int:
    a = parse()
    from zerotrain.config.load import build_config
    from zerotrain.distributed import process_group as dist
    from zerotrain.engine import build_engine

    cfg = build_config(overrides={
        "backend": a.backend, "zero.stage": a.stage, "zero.offload_optimizer": a.offload_optimizer,
        "zero.offload_param": a.offload_param, "precision.dtype": a.dtype, "batch.micro_batch": a.micro,
        "batch.grad_accum": a.grad_accum, "optimizer.lr": a.lr, "optimizer.weight_decay": a.weight_decay,
        "optimizer.clip": a.clip, "schedule.name": a.schedule, "schedule.warmup_steps": a.warmup,
        "run.keep_last": a.keep_last, "dist_timeout_s": a.timeout, "run.seed": 0,
        "zero.leaf_blocks": {"auto": None, "on": True, "off": False}[a.leaf_blocks],
        "ds_overrides": json.loads(a.ds_overrides), "parallel.tp": a.tp, "parallel.pp": a.pp, "parallel.sp": a.sp,
        "parallel.ep": a.ep, "model.router_aux_coef": a.router_aux_coef, "model.freeze_router": a.freeze_router,
        "lora.r": a.lora_r, "lora.alpha": 2.0 * a.lora_r if a.lora_r else 16.0, "lora.targets": a.lora_targets, "lora.merge": a.merge_lora,
        "model.gradient_checkpointing": a.gradient_checkpointing,
        "model.tiled_mlp": a.tiled_mlp, "model.chunked_loss": a.chunked_loss,
        "quant.qat": a.qat, **({"quant.group_size": a.quant_group_size} if a.qat != "none" else {}),
        "model.task": a.task})
    from zerotrain.plan.resolve import quantizes_nothing

    if quantizes_nothing(cfg):  # as `zerotrain train` does (zerotrain/commands/train.py): torchao's import skipped
        from zerotrain.model.quant import transformers_without_torchao

        transformers_without_torchao()
    if a.factory == "plain":
        factory = lambda: ref.load_model(a.model_dir)  # noqa: E731 - a user's own callable
    else:
        factory = families.builder(a.model_dir, a.task, seed=0, gradient_checkpointing=a.gradient_checkpointing)
    if a.freeze_embeddings:
        factory = families.frozen_embeddings(factory)
    engine = build_engine(factory, cfg, total_steps=a.steps)
    rank, world = engine.rank, engine.world_size
    if a.kill_at_save is not None and rank == a.kill_rank:
        install_kill_hook(a.kill_at_save, [engine])

    loaded_client_state = None
    if a.resume:
        loaded_client_state = engine.load_checkpoint(a.resume).client_state
    start = engine.global_step
    dp, dp_rank = engine.plan.world.dp, engine.dp_rank  # tensor-parallel ranks of one replica read the same batch
    data = ref.global_batches(a.steps, dp * a.grad_accum * a.micro, a.seq)
    result = {"steps": {}, "ds_config": engine.backend_config(), "backend": engine.name, "notes": engine.notes,
              "describe": engine.describe(),
              "start_step": start, "client_state": loaded_client_state,
              "from_rank0": getattr(engine, "_from_rank0", None), "param_local": local_shares(engine)}
    rank_params: list = [None] * world
    torch.distributed.all_gather_object(rank_params, local_params(engine))
    result["rank_params"] = rank_params
    counts = engine.plan.world.counts_for_data(rank)  # each replica's loss once (tp ranks and early stages repeat or lack it)
    whole_step = a.whole_step or engine.plan.world.pp > 1
    engine.train()
    stop = a.stop_at or a.steps
    for s in range(start, stop):
        lr = engine.lr
        local = 0.0
        micro = [families.model_inputs(ref.micro_batch(data, s, dp_rank, m, a.micro, a.grad_accum), a.task)
                 for m in range(a.grad_accum)]
        if a.masked_labels:
            micro = [dict(b, labels=families.masked_labels(b["input_ids"])) for b in micro]
        if whole_step:
            local = sum(float(loss.float()) for loss in engine.train_step(micro))
        else:
            for m, batch in enumerate(micro):
                loss = engine(**engine.to_device(batch)).loss
                engine.backward(loss)
                stepped = engine.step()
                assert stepped == (m == a.grad_accum - 1), (s, m, stepped)
                local += float(loss.detach().float())
        t = torch.tensor([local / a.grad_accum if counts else 0.0], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        assert engine.global_step == s + 1, (engine.global_step, s)
        result["steps"][s] = {"loss": float(t) / dp, "grad_norm": engine.last_grad_norm, "lr": lr}
        if a.ckpt_root and engine.global_step in a.save_at:
            engine.save_checkpoint(a.ckpt_root, {"next_step": engine.global_step, "note": "client-state",
                                                 "nested": {"a": [1, 2, 3]}})
            assert not engine.save_failures, [f.warning() for f in engine.save_failures]  # a save is never dropped
    if a.save_hf:
        engine.save_hf(a.save_hf)
    if a.probe_out:
        engine.eval()  # every rank runs forward (ZeRO-3 gathers parameters collectively)
        logits = engine.eval_step({"input_ids": ref.probe_input(seq_len=a.seq)})
        if logits is not None and engine.plan.world.counts_for_data(rank) and dp_rank == 0:
            torch.save(logits.float().cpu(), a.probe_out)  # the last pipeline stage holds the logits
    result["final_step"] = engine.global_step
    if a.collectives_out:
        write_collectives(f"{a.collectives_out}.{rank}.json")
    if rank == 0:
        Path(a.out).write_text(json.dumps(result, indent=1))
    engine.close()
    assert not dist.is_initialized()
    return 0


if __name__ == "__main__":
    from zerotrain.distributed import process_group as dist

    dist.exit_cleanly(main())  # the product's exit path (as `python -m zerotrain`): no C++ teardown race

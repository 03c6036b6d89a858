"""Launched under torchrun by test_plan_agreement.py: build one engine from a run config, take one real
optimizer step, and report how the run is laid out as the libraries themselves see it.

    torchrun --nproc_per_node 2 tests/support/plan_worker.py OUT.json MODEL_DIR TASK '{"zero.stage": 3, ...}'

Reported (rank 0 writes OUT.json):
- plan:     what zerotrain's RunPlan says (stage that runs, grad-accum, micro/global batch, dtype, dp size)
- parsed:   DeepSpeed only: what DeepSpeed's own DeepSpeedConfig parser reads from the engine's JSON
- live:     what the live engine reports: DeepSpeed's engine getters; FSDP2's param groups (mesh size,
            reshard-after-forward, mixed-precision param dtype) or DDP; the accumulation seen from
            which backward call made step() return True
- estimate: the memory estimate (zerotrain estimate's) built for the same run config
- banner:   the start banner lines (engine.describe())
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import tests.support.families as families


def _device(offload) -> str:
    """An offload section's device as text ("none" when absent); DeepSpeed keeps it as a str enum."""
    return "none" if offload is None else str(getattr(offload.device, "value", offload.device))


def deepspeed_views(engine) -> tuple[dict, dict]:
    import copy

    from deepspeed.runtime.config import DeepSpeedConfig

    parsed_cfg = DeepSpeedConfig(copy.deepcopy(engine.ds_config))  # DeepSpeed's parser, this world size
    zc = parsed_cfg.zero_config
    parsed = {"stage": parsed_cfg.zero_optimization_stage, "grad_accum": parsed_cfg.gradient_accumulation_steps,
              "dp": parsed_cfg.world_size,
              "micro_batch": parsed_cfg.train_micro_batch_size_per_gpu, "global_batch": parsed_cfg.train_batch_size,
              "dtype": "bf16" if parsed_cfg.bfloat16_config.enabled else "fp16" if parsed_cfg.float16_config.enabled else "fp32",
              "offload_optimizer": _device(zc.offload_optimizer), "offload_param": _device(zc.offload_param)}
    ds = engine._ds  # the live deepspeed.DeepSpeedEngine
    live = {"stage": ds.zero_optimization_stage(), "grad_accum": ds.gradient_accumulation_steps(),
            "micro_batch": ds.train_micro_batch_size_per_gpu(), "global_batch": ds.train_batch_size(),
            "dp": ds.dp_world_size,
            "dtype": "bf16" if ds.bfloat16_enabled() else "fp16" if ds.fp16_enabled() else "fp32",
            "offload_optimizer": _device(ds.zero_offload_optimizer()), "offload_param": _device(ds.zero_offload_param())}
    return parsed, live


def fsdp_view(engine) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from zerotrain.model.facts import transformer_blocks

    model = engine.module
    if isinstance(model, DistributedDataParallel):
        return {"stage": 0, "dp": model.process_group.size(), "dtype": "fp32"}
    group = transformer_blocks(model)[0]._get_fsdp_state()._fsdp_param_group
    resharded = group.post_forward_mesh_info is not None
    param_dtype = group.mp_policy.param_dtype
    return {"stage": 3 if resharded else 2, "dp": group.mesh_info.mesh.size(),
            "dtype": {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[param_dtype]}


def fsdp_checkpoint_stage(engine, root: Path) -> dict:
    """The stage an FSDP checkpoint records, and that one recording the asked stage (as checkpoints
    written before the plan did: FSDP stage 1 recorded 1 though it ran 2) still loads."""
    from zerotrain.checkpoint import store as ck
    from zerotrain.distributed import process_group as dist

    target = engine.save_checkpoint(root, {"marker": 7})
    assert not engine.save_failures, [f.warning() for f in engine.save_failures]
    recorded = ck.read_meta(target).zero_stage
    if engine.is_main:
        old = ck.read_meta(target)
        old.zero_stage = engine.plan.sharding.stage
        ck.write_meta(target, old)
    dist.barrier()
    step = engine.global_step
    client = engine.load_checkpoint(root).client_state
    return {"recorded_stage": recorded, "old_meta_loads": client == {"marker": 7} and engine.global_step == step}


def main() -> int:
    out, model_dir, task, overrides = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    from zerotrain.config.load import build_config
    from zerotrain.engine import build_engine
    from zerotrain.memory.estimate import estimate
    from zerotrain.model.facts import model_facts
    from zerotrain.plan.run_plan import build_plan
    from zerotrain.tasks import task_spec

    cfg = build_config(overrides={"run.seed": 0, "dist_timeout_s": 120, "run.tune_malloc": False, **overrides})
    facts = model_facts(model_dir, task_spec(task))
    engine = build_engine(families.builder(model_dir, task, seed=0), cfg, total_steps=2, model_facts=facts)
    plan = engine.plan
    report = {"backend": engine.name, "banner": engine.describe(), "plan": {
        "stage": plan.sharding.effective_stage, "asked_stage": plan.sharding.stage, "grad_accum": plan.batch.grad_accum,
        "micro_batch": plan.batch.micro_batch, "global_batch": plan.batch.global_batch, "dtype": plan.dtype,
        "dp": plan.world.dp, "offload_optimizer": plan.sharding.offload_optimizer,
        "offload_param": plan.sharding.offload_param}}
    if engine.name == "deepspeed":
        report["parsed"], report["live"] = deepspeed_views(engine)
    else:
        report["live"] = fsdp_view(engine)
    # the accumulation the engine really runs: which backward makes step() take the optimizer step
    engine.train()
    stepped = []
    gen = torch.Generator().manual_seed(engine.rank)
    for _ in range(plan.batch.grad_accum + 1):
        x = torch.randint(0, families.VOCAB, (plan.batch.micro_batch, 16), generator=gen).to(engine.device)
        engine.backward(engine(**families.model_inputs(x, task)).loss)
        stepped.append(engine.step())
    report["live"]["steps_at_backward"] = [i + 1 for i, s in enumerate(stepped) if s]
    report["live"]["global_step"] = engine.global_step
    if engine.name == "fsdp":
        report["checkpoint"] = fsdp_checkpoint_stage(engine, Path(out).with_name("ckpt"))
    # the estimate `zerotrain estimate` prints for this run config on this world
    est_plan = build_plan(cfg, engine.world_size, backend=engine.name, device=plan.device, facts=facts)
    report["estimate"] = estimate(est_plan).to_dict()
    if engine.rank == 0:
        Path(out).write_text(json.dumps(report, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    from zerotrain.distributed import process_group as dist

    dist.exit_cleanly(main())

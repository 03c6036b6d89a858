"""FSDP2 pipeline engine: torch.distributed.pipelining (PipelineStage + ScheduleGPipe) over a (pp, dp) mesh, or a
(pp, dp, tp) one with tensor parallelism inside each stage.

    torchrun --nproc_per_node 4 -m zerotrain train --backend fsdp --pp 2 --grad-accum 8 ...          # pp 2 x dp 2
    torchrun --nproc_per_node 8 -m zerotrain train --backend fsdp --tp 2 --pp 2 --grad-accum 8 ...   # x dp 2

Each rank keeps the layers of its stage (pipeline_parts.decoder_layers cut at stage_bounds), shards
them with FSDP2 over the data-parallel mesh dimension (torchtitan's layout) and runs GPipe over the
grad_accum micro-batches (GPipe first: pipelining has had hangs with other schedules on non-NCCL
backends, pytorch#132644). With --tp the stage's blocks are first split by the model's HF tp_plan
(backends/fsdp/tensor_parallel.py, DTensor over the mesh's tp dimension; embeddings, norms and head stay whole,
replicated over tp), then sharded over dp (torchtitan's 3-D layout). A tied embedding/head (GPT-2) lives on the first and the last stage; its
gradient is summed between the two before clipping, so both copies stay one weight. The global grad
norm sums every stage's and shard's squares. Checkpoints are DCP directories keyed by the HF names,
so `zerotrain export` (backends/fsdp/checkpoint_io.py export_checkpoint) reassembles one HF model from all stages.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ...checkpoint import store as ck
from ...model import lora
from ...model.pipeline_parts import Block, causal_lm_loss, decoder_layers, hf_names, stage_bounds, tied_weight
from ...plan.run_plan import RunPlan
from ...plan.schedule import make_scheduler
from ..base import Batch, ModelFactory, StepLosses, WholeStepEngine
from .engine import ENGINE_STATE, FSDPShared, forget_state, read_around_unsaved
from .tensor_parallel import apply_tensor_parallel


def _meta_param(p: torch.Tensor) -> nn.Parameter:
    """A storage-less stand-in for a parameter another stage holds (keeps the HF model's structure)."""
    return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)


class FSDPPipelineEngine(FSDPShared, WholeStepEngine):
    """One pipeline stage per rank group, FSDP2 over its data-parallel replicas, GPipe schedule."""

    _held = ("_schedule", "_pipe_stage", "scheduler", "optimizer", "_runner", "_stage_module", "_mesh", "_tie_groups")

    def __init__(self, model_factory: ModelFactory, plan: RunPlan):
        super().__init__(plan)
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        cfg = plan.cfg
        self._join()
        pp = plan.world.pp
        self._stage_id = plan.world.pp_stage(self._rank)
        torch.manual_seed(cfg.run.seed)
        model = model_factory()
        self._hold_rank0_weights(model)  # every stage starts from rank 0's weights (an unseeded factory cannot differ)
        if getattr(model.config, "architectures", None) is None:
            model.config.architectures = [type(model).__name__]  # export rebuilds this class
        # the one preparation sequence (backends/base.py): peft wraps the whole model first (seeded alike
        # everywhere) and the tiled MLP tiles each block in place; the stages then hold these blocks
        model = self._prepare_model(model)
        self._hf = model
        layers = decoder_layers(lora.unwrapped(model))
        a, b = stage_bounds(len(layers) - 2, pp)[self._stage_id]
        self._tied = tied_weight(lora.unwrapped(model))
        # a tied embedding/head: one group per dp index of {first stage rank, last stage rank}
        self._tie_groups = self.meshes.get("pp_tie") if self._tied is not None else None

        self._mesh = self.meshes.get("pp")
        stage_module = _Sequential(nn.ModuleList(layers[a:b])).to(self._device)
        if plan.world.tp > 1:  # the stage's blocks split over tp first, then sharded over dp (torchtitan's order)
            blocks = nn.ModuleList([layer.block for layer in stage_module.layers if isinstance(layer, Block)])
            apply_tensor_parallel(blocks, self._mesh["tp"], plan.facts.block_tp_plan)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if plan.dtype == "bf16" else MixedPrecisionPolicy()
        kw = dict(mesh=self._mesh["dp"], reshard_after_forward=plan.sharding.reshard_after_forward, mp_policy=mp)
        for layer in stage_module.layers:
            fully_shard(layer, **kw)
        fully_shard(stage_module, **kw)
        if dist.get_backend() == "gloo":
            stage_module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (backends/fsdp/engine.py)
        self._stage_module = stage_module
        self._free_other_stages()
        self._names = self._hf_names()

        self._runner = stage_module
        self._pipe_stage = PipelineStage(self._runner, self._stage_id, pp, self._device,
                                         group=self._mesh["pp"].get_group())
        self._schedule = ScheduleGPipe(self._pipe_stage, n_microbatches=plan.batch.grad_accum,
                                       loss_fn=causal_lm_loss, scale_grads=True)
        self.optimizer = self._make_optimizer(stage_module.parameters())
        self.scheduler = make_scheduler(self.optimizer, cfg, plan.total_steps)

    def _free_other_stages(self) -> None:
        """Drop the HF model's parameters this stage does not run (the factory built them all)."""
        mine = {id(p) for p in self._stage_module.parameters()}
        for module in self._hf.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and id(p) not in mine:
                    module._parameters[key] = _meta_param(p)
        gc.collect()

    def _hf_names(self) -> dict[str, nn.Parameter]:
        """HF state-dict name -> this stage's parameter (the tied weight under both its names: the
        first stage saves it as the embedding, the last as the head)."""
        out = {}
        for p, names in hf_names(self._stage_module, self._hf).items():
            for n in names:
                out[n] = p
        return out

    # --- identity (the rest is FSDPShared's) -----------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._stage_module

    @property
    def hf_model(self) -> nn.Module:
        return self._hf

    def state_holders(self) -> tuple[nn.Module, Any]:
        return self._stage_module, self.optimizer

    def train(self) -> None:
        self._stage_module.train()

    def eval(self) -> None:
        self._stage_module.eval()

    # --- the whole step ---------------------------------------------------------------------
    def train_step(self, micro_batches: Iterable[Batch],
                   after_backward: Optional[Callable[[int], None]] = None,
                   label_tokens: Optional[float] = None, objective: Any = None) -> StepLosses:
        if objective is not None:  # tasks.LAYOUT_REFUSALS refuses --pp for the tasks that have one
            raise ValueError("a pipeline engine trains the model's own loss; it runs no task objective")
        micro = list(micro_batches)
        self._check_micro_batches(len(micro))
        first, last = self._stage_id == 0, self._stage_id == self.plan.world.pp - 1
        losses: list[torch.Tensor] = []
        args = (torch.cat([m["input_ids"] for m in micro]).to(self._device),) if first else ()
        target = torch.cat([m["labels"] for m in micro]).to(self._device) if last else None
        self._schedule.step(*args, target=target, losses=losses if last else None)
        self._reduce_tied_grad()
        if after_backward is not None:
            after_backward(0)  # every micro-batch's gradient is in, the optimizer has not stepped
        self.last_grad_norm = self._clip(self.cfg.optimizer.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        self.micro_step += len(micro)
        return StepLosses([x.detach() for x in losses] if last else [torch.zeros(()) for _ in micro])

    def _tied_param(self) -> Optional[nn.Parameter]:
        if self._tied is None:
            return None
        return self._names.get(self._tied.hf_name if self._stage_id == 0 else self._tied.head_name)

    def _reduce_tied_grad(self) -> None:
        """Sum the tied weight's gradient between the first and last stage (each saw half its uses)."""
        p = self._tied_param()
        if p is None or self._tie_groups is None or p.grad is None:
            return
        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(local, group=self._tie_groups)

    def _clip(self, max_norm: float) -> float:
        """Global L2 norm over every stage, shard and tensor-parallel split (the tied weight counted once, a
        weight replicated over tp once: its tp rank 0 counts it), then clip."""
        grads = [p.grad for p in self._stage_module.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        tied = self._tied_param()
        skip = {id(tied.grad)} if tied is not None and self._stage_id != 0 and tied.grad is not None else set()
        if self.plan.world.tp > 1 and self.plan.world.coordinate(self._rank, "tp") != 0:
            skip |= {id(g) for g in grads if "tp" not in (getattr(getattr(g, "device_mesh", None),
                                                                  "mesh_dim_names", None) or ())}
        sq = sum((t.float().pow(2).sum() for g, t in zip(grads, local) if id(g) not in skip),
                 torch.zeros((), device=self._device))
        sq = sq.to(torch.float64)
        dist.all_reduce(sq)
        total = float(sq.sqrt())
        if max_norm > 0:
            coef = min(max_norm / (total + 1e-6), 1.0)  # clip_grads_with_norm_'s rule
            if coef < 1.0:
                torch._foreach_mul_(local, coef)
        return total

    def eval_step(self, batch: Batch) -> Optional[torch.Tensor]:
        """Forward only, stage by stage over point-to-point sends (hidden states as fp32)."""
        ids = batch["input_ids"].to(self._device)
        world = self.plan.world
        pp = world.pp
        with torch.no_grad():
            if self._stage_id == 0:
                x = ids
            else:
                x = torch.empty((*ids.shape, self._hf.config.hidden_size), dtype=torch.float32, device=self._device)
                dist.recv(x, src=world.rank_at(self._rank, pp=self._stage_id - 1))
            out = self._runner(x)
            if self._stage_id < pp - 1:
                dist.send(out.float().contiguous(), dst=world.rank_at(self._rank, pp=self._stage_id + 1))
                return None
            return out

    # --- checkpoints --------------------------------------------------------------------------
    def _keyed(self) -> tuple[dict, dict, dict]:
        """(model, optimizer-state) dicts keyed by HF names, and the torch FQN -> HF name map."""
        msd, osd = get_state_dict(self._stage_module, self.optimizer, options=self._state_options())
        fqn_param = dict(self._stage_module.named_parameters())
        to_hf = {}
        for fqn, p in fqn_param.items():
            names = [n for n, q in self._names.items() if q is p]
            to_hf[fqn] = names
        model = {n: msd[fqn] for fqn, names in to_hf.items() for n in names if fqn in msd}
        optim = {to_hf[fqn][0]: st for fqn, st in osd["state"].items()}
        return model, optim, {"fqn": to_hf, "param_groups": osd["param_groups"]}

    def _dcp_state(self) -> dict[str, Any]:
        model, optim, _ = self._keyed()
        return {"model": model, "optim": optim}

    def _engine_state(self, client_state: dict[str, Any]) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "global_step": self.global_step,
                "lrs": [g["lr"] for g in self.optimizer.param_groups], "client_state": client_state}

    def _read_shards(self, target: Path, meta: ck.CheckpointMeta) -> dict[str, Any]:
        model, optim, info = self._keyed()
        saved, fresh = read_around_unsaved(optim, "optim.", target / ck.DCP_SUBDIR)  # never-stepped parameters
        state = {"model": model, "optim": saved}
        dcp.load(state, checkpoint_id=str(target / ck.DCP_SUBDIR))
        state["optim"].update(fresh)
        msd = {fqn: state["model"][names[0]] for fqn, names in info["fqn"].items()}
        osd = {"state": {fqn: state["optim"][names[0]] for fqn, names in info["fqn"].items()
                         if names[0] in state["optim"]}, "param_groups": info["param_groups"]}
        set_state_dict(self._stage_module, self.optimizer, model_state_dict=msd, optim_state_dict=osd,
                       options=self._state_options())
        forget_state(self.optimizer, (self._names[name] for name in fresh))
        extra = torch.load(target / ENGINE_STATE, map_location="cpu", weights_only=True)
        self.scheduler.load_state_dict(extra["scheduler"])
        for g, lr in zip(self.optimizer.param_groups, extra["lrs"]):
            g["lr"] = lr
        self.global_step = int(extra["global_step"])
        return dict(extra.get("client_state") or {})

    def _trainable_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Every stage's adapters at full shape (peft's names) on rank 0 (lora.write_adapter writes them)."""
        return self._gathered(lambda p: p.requires_grad)

    def _full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Every stage's full weights (HF names) on rank 0; each stage gathers its FSDP shards and tensor-parallel
        splits first."""
        return self._gathered(lambda p: True)

    def _gathered(self, keep: Callable[[nn.Parameter], bool]) -> Optional[dict[str, torch.Tensor]]:
        mine = {}
        for n, p in self._names.items():
            if not keep(p):
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # collective over the stage's dp ranks
            if self.plan.world.dp_rank(self._rank) == 0 and self.plan.world.coordinate(self._rank, "tp") == 0:
                mine[n] = full.detach().cpu().clone()
        gathered: list = [None] * self._world
        dist.all_gather_object(gathered, mine)
        if not self.is_main:
            return None
        state = {k: v for part in gathered for k, v in part.items()}
        if self._tied is not None and self._tied.hf_name in state:
            state[self._tied.head_name] = state[self._tied.hf_name]  # one tensor: save_pretrained drops the tie
        return state


class _Sequential(nn.Module):
    """The stage's layers run in order (a ModuleList holding FSDP-wrapped layers, tensor in, tensor out)."""

    def __init__(self, layers: nn.ModuleList):
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

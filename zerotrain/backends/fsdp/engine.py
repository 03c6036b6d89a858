"""PyTorch FSDP2 engine: the fallback when DeepSpeed is absent, or `backend: fsdp`.

ZeRO stages map onto FSDP2 as in torchtitan docs/fsdp.md:
  stage 3   -> fully_shard(reshard_after_forward=True)   params, grads, optimizer states sharded
  stage 1/2 -> fully_shard(reshard_after_forward=False)  params stay gathered between fwd and bwd
              (FSDP has no optimizer-only sharding: stage 1 runs as stage 2, with a warning)
  stage 0   -> DistributedDataParallel                   plain data parallel

Checkpoints are torch.distributed.checkpoint (DCP) directories, so they load on any world size
and stage. Launch: `torchrun --nproc_per_node 2 -m zerotrain train --backend fsdp ...`.

Model build: with zerotrain's ModelBuilder only rank 0 reads the weights; the other ranks build the
model on the meta device and receive their shards from rank 0 (set_model_state_dict with
broadcast_from_rank0), so a job holds one full copy of the weights in host memory, not one per rank.
Devices: cuda:LOCAL_RANK over NCCL on a cuda run (RunPlan.device), else CPU over gloo.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from ...checkpoint import store as ck
from ...checkpoint.async_save import FutureTicket, Ticket
from ...distributed import faults
from ...distributed import process_group as zdist
from ...distributed.collectives import comm_device
from ...model import lora
from ...model.facts import transformer_blocks
from ...plan.run_plan import RunPlan
from ...plan.schedule import make_scheduler
from ..base import Engine, ModelFactory
from .expert_parallel import apply_expert_parallel, host_warning
from .tensor_parallel import apply_tensor_parallel, clip_grad_norm

ENGINE_STATE = ck.ENGINE_STATE
"""Per-checkpoint file (rank 0) with scheduler, step counters and the caller's client_state."""


def _warn0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(msg, stacklevel=3)


class FSDPShared:
    """What both FSDP engines (FSDPEngine here, pipeline.FSDPPipelineEngine) share: the backend name,
    joining the process group, and the identity read from it and from the optimizer."""

    name = "fsdp"
    cfg: Any
    plan: RunPlan
    optimizer: torch.optim.Optimizer
    uses_lora: bool
    _ckpt_group: Any = None
    """--async-save: the gloo group DCP's writer thread runs its collectives on (made at the first async save)."""

    def _dcp_state(self) -> dict[str, Any]:
        """{"model", "optim"}: this rank's state as torch.distributed.checkpoint saves and loads it."""
        raise NotImplementedError

    def _engine_state(self, client_state: dict[str, Any]) -> dict[str, Any]:
        """What rank 0 saves beside the DCP directory (ENGINE_STATE): scheduler, global step, client state."""
        raise NotImplementedError

    def _state_options(self) -> StateDictOptions:
        """The DCP state-dict options of both engines: under LoRA checkpoints hold the adapters and their optimizer
        state, not a copy of the frozen base (strict=False on load: the frozen base is not in them and stays as
        built)."""
        return StateDictOptions(ignore_frozen_params=self.uses_lora, strict=not self.uses_lora)

    def _write_shards(self, target: Path, client_state: dict[str, Any]) -> None:
        dcp.save(self._dcp_state(), checkpoint_id=str(target / ck.DCP_SUBDIR))
        if self.is_main:
            torch.save(self._engine_state(client_state), target / ENGINE_STATE)

    def _write_shards_async(self, target: Path, client_state: dict[str, Any]) -> Ticket:
        # DCP's async_save copies the state to CPU memory before it returns, then writes in a thread whose
        # collectives run on their own gloo group (never interleaved with training's collectives)
        if self._ckpt_group is None:
            self._ckpt_group = self.meshes.get("async_checkpoint")
        future = dcp.async_save(self._dcp_state(), checkpoint_id=str(target / ck.DCP_SUBDIR),
                                process_group=self._ckpt_group)
        error: Optional[OSError] = None
        if self.is_main:  # after async_save started: the other ranks' DCP threads wait for this rank's
            try:
                target.mkdir(parents=True, exist_ok=True)  # DCP's thread creates it later
                torch.save(self._engine_state(client_state), target / ENGINE_STATE)
            except OSError as e:  # reported with the DCP write, once that is done (Engine.commit_pending_save)
                error = e
        return FutureTicket(future, hold=faults.holds_write(self.rank, self.global_step), error=error)

    def _make_optimizer(self, params: Any) -> torch.optim.Optimizer:
        """The plan's torch.optim optimizer over the trainable ones of `params` (made after sharding: DTensors)."""
        name, kwargs = optimizer_arguments(self.plan)
        if name == "MuonAdamW":  # its split reads the model's blocks (plan/parallel_rules.py check_optimizer: where)
            from ...optim.muon import make_muon_adamw

            return make_muon_adamw(self.hf_model, **kwargs)
        return getattr(torch.optim, name)([p for p in params if p.requires_grad], **kwargs)

    def _hold_rank0_weights(self, model: nn.Module) -> None:
        """Every rank made to hold rank 0's weights (fully_shard keeps each rank's local shard of its own copy, so a
        factory that is not seeded identically cannot mix two initialisations); through the group's device (NCCL
        moves only CUDA tensors); a no-op copy on CPU."""
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                on_device = t.data.to(self._device)
                dist.broadcast(on_device, src=0)
                t.data.copy_(on_device)

    _held: tuple[str, ...] = ()
    """The attributes holding a process group that close() drops (_release), in order."""

    def _release(self) -> None:
        for attr in self._held:
            if hasattr(self, attr):
                delattr(self, attr)
        self._ckpt_group = None

    def _join(self) -> None:
        """Join the process group and take this rank's device: cuda:LOCAL_RANK on a cuda run (plan.device)."""
        env = zdist.init("fsdp", self.cfg.dist_timeout_s)  # nccl on CUDA (one GPU per local rank), else gloo
        self._device = torch.device("cuda", env.local_rank) if self.plan.device == "cuda" else torch.device("cpu")
        self._rank, self._world = env.rank, env.world_size

    # --- identity ------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


class FSDPEngine(FSDPShared, Engine):
    """FSDP2 (stages 1-3) or DDP (stage 0) behind the Engine API."""

    _held = ("scheduler", "optimizer", "_model", "_mesh")

    def __init__(self, model_factory: ModelFactory, plan: RunPlan):
        super().__init__(plan)
        cfg = plan.cfg
        self._join()
        cuda = plan.device == "cuda"
        self._stage = plan.sharding.effective_stage

        torch.manual_seed(cfg.run.seed)  # same init on every rank for from-config models
        # Ranks > 0 build the model on the meta device when the factory can (zerotrain's ModelBuilder):
        # no weights read, no memory; rank 0's weights reach them once sharded. A plain callable
        # builds the full model everywhere and rank 0's copy wins. Not under GPU + CPU offload: there
        # rank 0's buffers live on the GPU and its parameters on the host, which the state-dict
        # broadcast refuses. Not with tensor parallelism: every rank takes rank 0's weights before
        # its blocks are split.
        self._from_rank0 = (self._world > 1 and callable(getattr(model_factory, "empty", None))
                            and not (cuda and self._wants_offload()) and plan.world.tp == 1)
        model = model_factory.empty() if self._from_rank0 and self._rank != 0 else model_factory()
        if self._from_rank0 and not _same_on_all_ranks(len(list(model.parameters()))):
            # e.g. a checkpoint whose lm_head differs from its embeddings although the config ties them:
            # from_pretrained unties them on rank 0, from_config does not. Build it for real everywhere.
            self._from_rank0 = False
            if self._rank != 0:
                model = model_factory()
        self._hf_config = getattr(model, "config", None)
        if self._hf_config is not None and not getattr(self._hf_config, "architectures", None):
            self._hf_config.architectures = [type(model).__name__]  # export rebuilds this class
        # a user's own loop adopts the model here (its tensor-parallel split plan); LoRA on meta too, QAT
        # before sharding (fully_shard sees the fake-quantized Linears): Engine._prepare_model
        model = self._prepare_model(model)
        self._bf16 = plan.dtype == "bf16"
        if self._stage == 0:
            self._model = self._wrap_ddp(model)
        else:
            self._model = self._wrap_fsdp(model)
        self._set_sync()

        self.optimizer = self._make_optimizer(self._model.parameters())  # after sharding: sees DTensors
        self.scheduler = make_scheduler(self.optimizer, cfg, plan.total_steps)
        self._pending_backward = False

    # --- wrapping ------------------------------------------------------------------------------
    def _wrap_ddp(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        self._offload_warning()
        _materialize(model, self._device)
        if self._bf16:
            # DDP has no mixed-precision policy: run forward under bf16 autocast, master weights fp32.
            model.forward = torch.autocast(self._device.type, dtype=torch.bfloat16)(model.forward)
        # DDP broadcasts rank 0's parameters and buffers at construction (the meta-built ranks' too).
        return DDP(model, device_ids=[self._device.index] if self._device.type == "cuda" else None)

    def _wrap_fsdp(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if self.plan.stage_note():
            _warn0(self.plan.stage_note())
        full_sd = self._rank0_weights(model, self._from_rank0)  # before tensor/expert parallelism splits anything
        args = fsdp_arguments(self.plan)
        mp = self._mixed_precision()
        offload: OffloadPolicy = CPUOffloadPolicy() if args["cpu_offload"] else OffloadPolicy()
        if self._wants_offload() and not args["cpu_offload"]:
            self._offload_warning()
        kw = dict(reshard_after_forward=args["reshard_after_forward"], mp_policy=mp, offload_policy=offload)
        tp, ep = self.plan.world.tp, self.plan.world.ep
        if tp > 1:  # 2-D (dp, tp): blocks split over tp first, then sharded over dp (torchtitan's order); under
            # sp the "dp" dimension is dp x sp (mesh.py): the attention all-to-alls its local heads over sp
            mesh2d = self.meshes.get("tp")
            apply_tensor_parallel(model, mesh2d["tp"], self.plan.facts.block_tp_plan)
            self._mesh = mesh2d["dp"]
        elif ep > 1:  # experts split over ep groups and sharded over their copies first, then the blocks over dp
            spans_hosts = host_warning(ep, zdist.env().local_world_size)
            if spans_hosts:
                _warn0(spans_hosts)
            self._mesh = apply_expert_parallel(lora.unwrapped(model), self.meshes, self._world, ep, kw)
        else:
            self._mesh = self.meshes.get("dp")
        kw["mesh"] = self._mesh
        self._shard(model, kw, self._from_rank0, full_sd)
        if dist.get_backend() == "gloo":
            # gloo has no PREMUL_SUM, which FSDP2 switches to once a gradient divide factor is set (AVG
            # works today): plain SUM + a post-divide works on every dtype, at the cost of one div.
            model.set_force_sum_reduction_for_comms(True)
        return model

    def _mixed_precision(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        bf16 = fsdp_arguments(self.plan)["param_dtype"] == "bfloat16"
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
            else MixedPrecisionPolicy()

    def _rank0_weights(self, model: nn.Module, from_rank0: bool) -> Optional[dict[str, torch.Tensor]]:
        """Before anything splits the model: rank 0's full state dict when the other ranks were built on meta
        (from_rank0; they receive their shards from it in _shard), else every rank made to hold rank 0's weights."""
        if from_rank0:
            return model.state_dict() if self._rank == 0 else None
        if self._world > 1:
            self._hold_rank0_weights(model)
        return None

    def _shard(self, model: nn.Module, kw: dict[str, Any], from_rank0: bool,
               full_sd: Optional[dict[str, torch.Tensor]]) -> None:
        """fully_shard every transformer block, then the root, with kw; from_rank0: then fill the meta-built
        ranks' shards from rank 0's full_sd (_rank0_weights)."""
        from torch.distributed.fsdp import fully_shard

        for block in transformer_blocks(model):
            fully_shard(block, **kw)
        fully_shard(model, **kw)
        if from_rank0:
            self._fill_from_rank0(model, full_sd)

    def _build_frozen(self, model_factory: Any) -> nn.Module:
        """A frozen copy sharded over the policy's mesh, resharded after every forward (stages 1-3; it has no
        backward), or whole on every rank under DDP (stage 0); see AuxiliaryModel."""
        from_rank0 = self._stage != 0 and self._from_rank0 and callable(getattr(model_factory, "empty", None))
        model = model_factory.empty() if from_rank0 and self._rank != 0 else model_factory()
        model.requires_grad_(False)
        if self._stage == 0:
            _materialize(model, self._device)
            if self._bf16:
                model.forward = torch.autocast(self._device.type, dtype=torch.bfloat16)(model.forward)
        else:
            full_sd = self._rank0_weights(model, from_rank0)
            self._shard(model, {"mesh": self._mesh, "reshard_after_forward": True, "mp_policy": self._mixed_precision()},
                        from_rank0, full_sd)
        return model.eval()

    def _fill_from_rank0(self, model: nn.Module, full_sd: Optional[dict[str, torch.Tensor]]) -> None:
        """Give the meta-built ranks their shards of rank 0's weights, one tensor at a time (no rank but
        0 ever holds a full copy), and rank 0's buffers (non-persistent ones, e.g. rotary tables, are in
        no state dict)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        if self._rank != 0:
            model.to_empty(device=self._device)
        set_model_state_dict(model, full_sd if full_sd is not None else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        del full_sd  # rank 0's unsharded originals
        with torch.no_grad():
            for b in model.buffers():
                dist.broadcast(b, src=0)

    def _wants_offload(self) -> bool:
        return self.plan.sharding.offloads  # nvme was refused by parallel_rules.check_backend

    def _offload_warning(self) -> None:
        if self._wants_offload() and self.plan.device == "cpu":
            _warn0("zero.offload_optimizer/offload_param=cpu has no effect in an FSDP run on a CPU-only machine "
                   "(everything already lives in host memory); continuing without offload")

    def _set_sync(self) -> None:
        """Reduce gradients only on the accumulation boundary. Set before the forward: DDP reads the flag
        there, FSDP2 in its post-backward hook."""
        sync = self.is_accumulation_boundary()
        if self._stage == 0:
            self._model.require_backward_grad_sync = sync  # what DDP.no_sync() toggles
        else:
            self._model.set_requires_gradient_sync(sync)

    # --- generation (backends/generation.py) ---------------------------------------------------
    def _generation_sharded(self) -> bool:
        return self._stage != 0  # stages 1-2 reshard after backward too: sharded between steps

    @contextlib.contextmanager
    def _gather_for_generation(self, whole: bool) -> Iterator[None]:
        """whole: every FSDP module unsharded once (one all-gather each: the whole model on every rank); else only
        the root's own parameters (embeddings, head: under LoRA generate calls the HF model inside the peft root,
        never the root's forward, which would gather them), the blocks gathering in each forward and resharding after
        it (stages 1-2 included). Kept so for the context; every module resharded at the exit, each one's reshard-after-forward
        setting put back (torch 2.13's fields: FSDPModule has no getter)."""
        from torch.distributed.fsdp import FSDPModule

        root = self._model
        root._get_fsdp_state()._lazy_init()  # the root is the root, though its forward may never run here
        every = [m for m in root.modules() if isinstance(m, FSDPModule)]
        kept = []
        for m in every:
            state = m._get_fsdp_state()
            kept.append((state, state._auto_reshard_after_forward,
                         [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups]))
        try:
            for m in every:
                held = whole or m is root
                # "forward" at stages 1-2: the blocks reshard after each forward too, or the first forward's
                # gathers would stay for the whole context (no backward) and the rank hold the whole model
                m.set_reshard_after_forward(not held, recurse=False)
                if held:
                    m.unshard()
            yield
        finally:
            for m in every:  # stages 1-2 keep what a no-grad forward gathered (no backward reshards it)
                m.reshard()
            for state, auto, groups in kept:
                state._auto_reshard_after_forward = auto
                for group, info in groups:
                    group.post_forward_mesh_info = info

    # --- identity (the rest is FSDPShared's) --------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._model

    @property
    def hf_model(self) -> nn.Module:
        """The HF model itself (FSDP2 shards in place; DDP wraps)."""
        return self._model.module if self._stage == 0 else self._model

    def state_holders(self) -> tuple[nn.Module, Any]:
        return self._model, self.optimizer

    # --- training ------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        self._set_sync()
        (loss / self.grad_accum).backward()
        self.micro_step += 1
        self._pending_backward = True
        self._set_sync()  # for the next micro-batch's forward

    def step(self) -> bool:
        if not self._pending_backward:
            raise RuntimeError("engine.step() called without a backward since the last step")
        self._pending_backward = False
        if self.micro_step % self.grad_accum:
            return False
        # Pre-clip global norm; on DTensor grads the local norms are reduced over each mesh.
        self.last_grad_norm = clip_grad_norm(self._model.parameters(), self.cfg.optimizer.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return True

    # --- checkpoint shards (the commit protocol is the base class's) ---------------------------
    def _dcp_state(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self._model, self.optimizer, options=self._state_options())
        return {"model": msd, "optim": osd}

    def _engine_state(self, client_state: dict[str, Any]) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "global_step": self.global_step, "client_state": client_state}

    def _read_shards(self, target: Path, meta: ck.CheckpointMeta) -> dict[str, Any]:
        # Any world size and stage: DCP reads each rank's slice of the saved tensors (resharding).
        options = self._state_options()
        msd, osd = get_state_dict(self._model, self.optimizer, options=options)  # also creates empty optimizer state
        saved, fresh = read_around_unsaved(osd["state"], "optim.state.", target / ck.DCP_SUBDIR)
        state = {"model": msd, "optim": {**osd, "state": saved}}
        dcp.load(state, checkpoint_id=str(target / ck.DCP_SUBDIR))
        state["optim"]["state"].update(fresh)
        set_state_dict(self._model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
        params = dict(self._model.named_parameters())
        forget_state(self.optimizer, (params[fqn] for fqn in fresh if fqn in params))
        extra = torch.load(target / ENGINE_STATE, map_location="cpu", weights_only=True)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.global_step = int(extra["global_step"])
        self._pending_backward = False
        self.micro_step = self.global_step * self.grad_accum
        self._set_sync()  # for the next forward, on the restored accumulation position
        return dict(extra.get("client_state") or {})

    def _full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        # Collective: every rank gathers; only rank 0 keeps the full CPU copy.
        sd = get_model_state_dict(self._model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        _share_tied(self.hf_model, sd)
        return sd

    def _trainable_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        sd = get_model_state_dict(self.hf_model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                           ignore_frozen_params=True))
        return {k: v.float() for k, v in sd.items()} if self.is_main else None

def optimizer_arguments(plan: RunPlan) -> tuple[str, dict[str, Any]]:
    """(torch.optim class name, its keyword arguments) of the plan's optimizer."""
    o, lr = plan.cfg.optimizer, plan.lr
    if o.name == "muon":  # zerotrain/optim/muon.py make_muon_adamw's keywords
        return "MuonAdamW", dict(lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                                 momentum=o.muon_momentum, adjust_lr=o.muon_adjust_lr)
    if o.name in ("adamw", "adam"):
        return ("AdamW" if o.name == "adamw" else "Adam",
                dict(lr=lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay))
    return "SGD", dict(lr=lr, momentum=o.momentum, weight_decay=o.weight_decay)


def fsdp_arguments(plan: RunPlan) -> dict[str, Any]:
    """What this engine hands torch for a plan, as plain values (the engine builds from it; the
    unused-settings test diffs it): DDP (stage 0) or fully_shard per block and its arguments, the
    optimizer, the clipping norm. CPU offload only on an accelerator run (plan.device): on a CPU-only
    one everything already lives in host memory."""
    accelerator = plan.device != "cpu"
    s = plan.sharding
    return {"wrapper": "DDP" if s.effective_stage == 0 else "fully_shard",
            "reshard_after_forward": s.reshard_after_forward,
            "param_dtype": "bfloat16" if plan.dtype == "bf16" else "float32",
            "cpu_offload": accelerator and s.offloads, "optimizer": optimizer_arguments(plan),
            "clip": plan.cfg.optimizer.clip}


def _same_on_all_ranks(n: int) -> bool:
    """Whether every rank passed the same integer (collective)."""
    t = torch.tensor([n, -n], dtype=torch.int64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0]) == -int(t[1])


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Move the model to `device`; a meta-built one gets uninitialised storage there (filled by the
    caller's broadcast) and its tied weights tied again."""
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
    else:
        model.to(device)


def _share_tied(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Make tied parameters one tensor again in a gathered state dict (the gather copies each FQN),
    so save_pretrained drops the duplicate (e.g. lm_head.weight) exactly as for an unsharded model."""
    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    for names in by_param.values():
        keep = next((n for n in names if n in sd), None)
        for n in names:
            if keep is not None and n != keep and n in sd:
                sd[n] = sd[keep]


def read_around_unsaved(states: dict[str, Any], prefix: str, dcp_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fresh optimizer's state (get_state_dict creates one for every parameter), keyed as `states` is and saved
    under `prefix` + key, split into (what the checkpoint holds: DCP loads it, the entries it does not hold). A
    parameter that never had a gradient when the checkpoint was written has no state saved (LLaVA's vision tower
    post_layernorm: LLaVA reads the tower's hidden states before it), and DCP refuses a key it cannot find. Both FSDP
    engines load the first and drop the second's state after set_state_dict (forget_state)."""
    saved = set(dcp.FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata)
    # all of a parameter's keys absent: never stepped; some absent is a real mismatch, left for DCP to refuse
    fresh = {key: st for key, st in states.items() if st and all(f"{prefix}{key}.{k}" not in saved for k in st)}
    return {k: v for k, v in states.items() if k not in fresh}, fresh


def forget_state(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter]) -> None:
    """No optimizer state for these parameters, as in the straight run until their first gradient (AdamW creates it
    then; not a zero-lr step's state)."""
    for p in params:
        optimizer.state.pop(p, None)

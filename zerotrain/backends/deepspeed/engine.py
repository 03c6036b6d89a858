"""DeepSpeed engine: `deepspeed.initialize` behind the Engine API (deepspeed imported lazily).

    torchrun --nproc_per_node 2 my_loop.py      # or: deepspeed --no_ssh ... my_loop.py
    engine = build_engine(factory, cfg, total_steps=100)      # zerotrain/engine.py

The config is the run plan's rendering (ds_config.render) minus its "scheduler" block: the LR
follows zerotrain.plan.schedule (a LambdaLR handed to deepspeed.initialize) so both backends share one
curve. `self.ds_config` is the exact dict DeepSpeed got (the trainer writes it out); the engine
reads every run fact from the plan, never back from that dict.
"""
from __future__ import annotations

import contextlib
import copy
import shutil
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from ...checkpoint import store as ck
from ...checkpoint.async_save import FileWriter, Ticket, WriteGuard, guarded_checkpoint_engine
from ...distributed import process_group as dist
from ...distributed.collectives import reduce_max
from ...distributed.jit_locks import check_build_locks
from ...errors import ConfigError, UserError, first_line
from ...model import router
from ...plan.ds_config import render
from ...plan.run_plan import RunPlan
from ...plan.schedule import make_scheduler
from ..base import Engine, ModelFactory
from . import expert_parallel, op_builds
from .checkpoint_io import convert_to_universal

UNIVERSAL_DIR = ".universal"
"""Under the checkpoints dir: where a checkpoint is converted for another world size/stage (removed after)."""
_CLIENT_KEY = "zerotrain_client_state"
"""The caller's client_state lives under this key of DeepSpeed's model-states file."""


def plain_cuda_arch_list(environ: Optional[dict[str, str]] = None) -> Optional[str]:
    """TORCH_CUDA_ARCH_LIST without architecture suffixes ('9.0a' -> '9.0'), set in place; a line saying so, or
    None when there was nothing to change. DeepSpeed 0.19's JIT op builder (compute_capability_args) reads
    each entry's minor version with int(), so '9.0a' (an image built for Hopper's arch-specific features)
    fails every op build, FusedAdam's first, with "invalid literal for int() with base 10: '0a'"."""
    import os
    import re

    env = os.environ if environ is None else environ
    value = env.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return None
    plain = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)
    if plain == value:
        return None
    env["TORCH_CUDA_ARCH_LIST"] = plain
    return (f"TORCH_CUDA_ARCH_LIST={value!r}: DeepSpeed's op builds cannot read architecture suffixes; building "
            f"its ops for {plain!r} (set TORCH_CUDA_ARCH_LIST without suffixes to silence this)")


def _ds_json(plan: RunPlan) -> dict[str, Any]:
    ds = render(plan)
    ds.pop("scheduler", None)  # our LambdaLR drives the LR (DeepSpeed's cannot do warmup 0)
    return ds


class DeepSpeedShared:
    """What both DeepSpeed engines (DeepSpeedEngine here, pipeline.DeepSpeedPipelineEngine) share: the
    backend name, the start of their construction and the identity read from the process group and
    DeepSpeed's engine."""

    name = "deepspeed"
    cfg: Any
    _dist: Any
    _ds: Any

    def _start(self, plan: RunPlan) -> None:
        """Refuse stale JIT build locks, join the process group, render the DeepSpeed config."""
        check_build_locks()  # before any collective: every rank refuses alike instead of polling forever
        op_builds.install()  # the same ninja on every launch, py-cpuinfo asked once per machine (op_builds.py)
        note = plain_cuda_arch_list()  # DeepSpeed's op builds cannot parse arch suffixes (9.0a): seen on an H100
        if note and dist.env().rank == 0:
            print(f"zerotrain: warning: {note}", flush=True)
        self._dist = dist.init("deepspeed", self.cfg.dist_timeout_s)
        self.ds_config: dict[str, Any] = _ds_json(plan)
        """The exact config given to deepspeed.initialize (a rendering of the plan)."""
        self._stage = plan.sharding.effective_stage

    def backend_config(self) -> Optional[dict]:
        return self.ds_config

    def _plan_adopted(self) -> None:
        # DeepSpeed reads the plan's leaf_module and buckets in initialize, after the build
        self.ds_config = _ds_json(self.plan)

    def _release(self) -> None:
        """close(): DeepSpeed's engine released (it holds the process groups)."""
        if getattr(self, "_ds", None) is not None:
            _release_deepspeed_engine(self._ds)
        self._ds = self._scheduler = None

    # --- identity -------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._dist.rank

    @property
    def world_size(self) -> int:
        return self._dist.world_size

    @property
    def device(self) -> torch.device:
        return self._ds.device

    @property
    def lr(self) -> float:
        return float(self._ds.get_lr()[0])

    @property
    def module(self) -> torch.nn.Module:
        return self._ds.module

    def state_holders(self) -> tuple[torch.nn.Module, Any]:
        return self._ds.module, self._ds.optimizer

    def _write_guard(self) -> WriteGuard:
        """DeepSpeed writes through its checkpoint_engine: swapped (once) for one whose writes go through a
        WriteGuard (zerotrain/checkpoint/async_save.py): an OSError is kept, not raised out of DeepSpeed's save
        (whose collectives the other ranks are in), or the file is queued to a writer thread (--async-save). Rank
        0's copy of DeepSpeed's recovery script goes through it too."""
        guard = getattr(self, "_guard", None)
        if guard is None:
            guard = self._guard = WriteGuard()
            self._ds.checkpoint_engine = guarded_checkpoint_engine(self._ds.checkpoint_engine, guard)
            copy_script = self._ds._copy_recovery_script
            self._ds._copy_recovery_script = lambda path: guard.call(copy_script, path)
        return guard

    def _save_through_guard(self, target: Path, client_state: dict[str, Any], **kwargs: Any) -> None:
        """DeepSpeed's save_checkpoint of this tag (every rank); raises this rank's OSError after it returned."""
        guard = self._write_guard()
        guard.begin()
        # save_latest=False: DeepSpeed writes `latest` from rank 0 BEFORE its final barrier, i.e.
        # possibly before other ranks finished their shards, and not atomically. The base commits.
        self._ds.save_checkpoint(str(target.parent), tag=target.name, client_state={_CLIENT_KEY: client_state},
                                 save_latest=False, **kwargs)
        guard.raise_error()

    def _write_shards_async(self, target: Path, client_state: dict[str, Any]) -> Ticket:
        """The state of each file copied to host memory and queued for a writer thread
        (zerotrain/checkpoint/async_save.py); the ticket is done when this rank's files are written."""
        guard = self._write_guard()
        if guard.writer is None:
            guard.writer = FileWriter(self.rank)
        ticket = guard.writer.begin(self.global_step)
        try:
            self._write_shards(target, client_state)
        finally:
            guard.writer.end()
        return ticket


class DeepSpeedEngine(DeepSpeedShared, Engine):
    def __init__(self, model_factory: ModelFactory, plan: RunPlan):
        super().__init__(plan)
        import deepspeed

        self._start(plan)
        self._plain_fp32 = self._stage == 0 and plan.dtype == "fp32"  # see _norm_before_step
        self._hf_ds_cfg = None  # transformers' ZeRO-3 switch; kept alive for the engine's lifetime

        model = self._build_model(model_factory, deepspeed)
        model = self._prepare_model(model)  # outside zero.Init: initialize shards the adapters (Engine._prepare_model)
        params = [p for p in model.parameters() if p.requires_grad]
        ep = plan.parallel.ep > 1  # AutoEP swaps the MoE blocks inside initialize (expert_parallel.py)
        with expert_parallel.registry_as_dict() if ep else contextlib.nullcontext():
            self._ds, self._optimizer, _, self._scheduler = deepspeed.initialize(
                model=model, model_parameters=params, config=copy.deepcopy(self.ds_config),
                lr_scheduler=lambda opt: make_scheduler(opt, self.cfg, self.plan.total_steps))
        if ep:  # the HF routers are gone: count AutoEP's (its router's gate, where the recorder now points)
            self.expert_load = router.ExpertLoad.attach(self._ds.module)
        if self._stage == 3:
            self._guard_leaf_inputs()
        self._clip_norm: Optional[torch.Tensor] = None
        if self._plain_fp32 and self.cfg.optimizer.clip > 0.0:
            self._ds.clip_fp32_gradients = self._clip_keeping_norm  # see _clip_keeping_norm

    def _before_preparation(self, model: torch.nn.Module) -> None:
        if self.plan.preparation.uses_lora and self._stage == 3:
            _unpartition_heads(model)

    def _guard_leaf_inputs(self) -> None:
        """DeepSpeed reduces a leaf module's gradients in a full backward hook, which PyTorch fires before
        the module's own parameter gradients exist when none of its inputs requires grad (a block behind
        frozen layers; model_info.transformer_blocks says more). Such a block's first floating-point input
        (its hidden state) is made to require grad (as HF's enable_input_require_grads does for frozen
        embeddings); a leaf fed only integer tensors cannot be helped and is refused with the setting
        that turns leaves off."""
        from deepspeed.utils import z3_leaf_module

        for m in self._ds.module.modules():
            if z3_leaf_module(m) and any(p.requires_grad for p in m.parameters()):
                m.register_forward_pre_hook(_leaf_inputs_need_grad, with_kwargs=True)

    def _build_model(self, factory: ModelFactory, deepspeed: Any) -> torch.nn.Module:
        """Call the factory; under ZeRO-3 so that no rank ever holds the whole model.

        HfDeepSpeedConfig makes transformers' from_pretrained/from_config use zero.Init (and load
        weights shard by shard); the outer zero.Init covers plain nn.Module factories. DeepSpeed
        counts nested zero.Init contexts, so an HF factory inside both is partitioned once.
        """
        if self._stage != 3:
            return factory()
        # zero.Init patches torch's tensor constructors; torch._dynamo imported for the first time
        # inside it (transformers imports it lazily with the model code) fails its signature checks.
        import torch._dynamo  # noqa: F401
        from transformers.integrations import HfDeepSpeedConfig

        self._hf_ds_cfg = HfDeepSpeedConfig(self.ds_config)
        with deepspeed.zero.Init(config_dict_or_path=self.ds_config):
            return factory()

    def _build_frozen(self, model_factory: ModelFactory) -> Any:
        """A frozen copy in a DeepSpeed engine without optimizer (TRL's prepare_deepspeed): at ZeRO-3 built
        under zero.Init and partitioned like the policy (a factory that merges a LoRA adapter is built whole,
        then partitioned by initialize), else whole on every rank (ZeRO stage 0: nothing to shard without
        gradients or optimizer states); bf16 runs hold it in bf16 as DeepSpeed holds the policy."""
        import deepspeed

        config = copy.deepcopy(self.ds_config)
        for key in ("optimizer", "scheduler", "gradient_clipping"):
            config.pop(key, None)
        if self._stage == 3:
            config["zero_optimization"].pop("offload_optimizer", None)
            if getattr(model_factory, "adapter", False):  # peft merges full tensors: build outside zero.Init
                with self._hf_write():
                    model = model_factory()
            else:
                model = self._build_model(model_factory, deepspeed)
        else:
            config["zero_optimization"] = {"stage": 0}
            model = model_factory()
        model.requires_grad_(False)
        frozen, *_ = deepspeed.initialize(model=model, config=config)
        frozen.eval()
        return frozen

    def _drop_frozen(self, model: Any) -> None:
        _release_deepspeed_engine(model)

    # --- generation (backends/generation.py) ---------------------------------------------------
    def _generation_sharded(self) -> bool:
        return self._stage == 3

    @contextlib.contextmanager
    def _gather_for_generation(self, whole: bool) -> Iterator[None]:
        """whole: every ZeRO-3 partition gathered at once (the whole model on every rank) and the ZeRO-3 forward
        hooks removed, so a forward fetches nothing; put back and re-partitioned at the exit (TRL 1.16's
        unwrap_model_for_generation: GatheredParameters + its remove_hooks / add_hooks). Else nothing: the
        hooks gather every module in every forward."""
        if not whole:
            yield
            return
        import deepspeed

        offload = self._ds.optimizer.parameter_offload
        with deepspeed.zero.GatheredParameters(list(self._ds.module.parameters()), modifier_rank=None):
            for p in self._ds.module.parameters():
                p.ds_active_sub_modules.clear()
            for hook in offload.forward_hooks + offload.backward_hooks:
                hook.remove()
            offload.forward_hooks, offload.backward_hooks = [], []
            try:
                yield
            finally:
                coordinator = offload.param_coordinator  # its trace of the training forward is stale now
                if not coordinator.is_invalid_trace():
                    coordinator._invalidate_trace()
                offload._register_deepspeed_module(offload.module)

    # --- identity (the rest is DeepSpeedShared's) --------------------------------------------
    @property
    def hf_model(self) -> torch.nn.Module:
        return self._ds.module

    def _forward(self, *args, **kwargs):
        return self._ds(*args, **kwargs)  # the engine's forward (ZeRO-3 gathers, bf16 casts)

    # --- training -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        # Accelerate's DeepSpeedEngineWrapper pattern: tell DeepSpeed where the boundary is, and
        # let engine.backward scale by 1/grad_accum and reduce gradients only on the boundary.
        self._ds.set_gradient_accumulation_boundary(self.is_accumulation_boundary())
        self._ds.backward(loss)
        self.micro_step += 1

    def step(self) -> bool:
        # engine.step() is called after every micro-batch (DeepSpeed's contract); it only clips,
        # steps the optimizer and our LambdaLR on the boundary set in backward().
        boundary = self.micro_step % self.grad_accum == 0
        unclipped = boundary and self._plain_fp32 and self._ds.gradient_clipping() <= 0.0
        own_norm = self._norm_before_step() if unclipped else None
        self._clip_norm = None
        self._ds.step()
        if not boundary:
            return False
        self.global_step = int(self._ds.global_steps)
        if self._plain_fp32:
            norm = own_norm if unclipped else self._clip_norm
        else:
            norm = self._ds.get_global_grad_norm()
        self.last_grad_norm = norm  # read only when logged (Engine.grad_norm_unread)
        return True

    def _clip_keeping_norm(self) -> None:
        """Stage 0 fp32: DeepSpeed's engine.clip_fp32_gradients computes the global norm and throws it
        away (get_global_grad_norm() is None there). This replaces it on our engine instance with the
        same call, keeping the norm, so the step computes it once instead of twice. Under --ep the norm is
        expert_parallel.grad_norm's (DeepSpeed's averages the ranks' local norms) and the clip its formula."""
        from deepspeed.runtime.utils import clip_grad_norm_

        if self.plan.parallel.ep > 1:  # the experts' share summed over their ranks (expert_parallel.grad_norm)
            norm = self._clip_norm = expert_parallel.grad_norm(self._ds.module)
            coef = min(1.0, self._ds.gradient_clipping() / (float(norm) + 1e-6))  # clip_grad_norm_'s formula
            for p in self._ds.module.parameters():
                if p.grad is not None and coef < 1.0:
                    p.grad.detach().mul_(coef)
            return
        self._clip_norm = clip_grad_norm_(parameters=self._ds.module.parameters(),
                                          max_norm=self._ds.gradient_clipping(), mpu=self._ds.mpu)

    def _norm_before_step(self) -> float:
        """Stage 0 fp32 without clipping: DeepSpeed computes no norm at all, so take it here;
        gradients are already all-reduced by backward() on the boundary."""
        if self.plan.parallel.ep > 1:
            return float(expert_parallel.grad_norm(self._ds.module))
        norms = [p.grad.detach().float().norm() for p in self._ds.module.parameters() if p.grad is not None]
        return float(torch.stack(norms).norm()) if norms else 0.0  # one device sync, not one per tensor

    # --- checkpoint shards (the commit protocol is the base class's) ------------------------
    def _write_shards(self, target: Path, client_state: dict[str, Any]) -> None:
        self._save_through_guard(target, client_state, exclude_frozen_parameters=self.uses_lora)  # LoRA: no base copy

    def _read_shards(self, target: Path, meta: ck.CheckpointMeta) -> dict[str, Any]:
        if ck.needs_universal(meta, self.world_size, self._stage):
            if self.plan.parallel.ep > 1:
                raise UserError(f"--resume {target}: an --ep checkpoint of {meta.world_size} ranks at stage "
                                f"{meta.zero_stage} resumes on DeepSpeed only with the same ranks and --stage (AutoEP's "
                                "expert files are not converted); or `zerotrain export` it and start from the HF dir")
            if self.uses_lora:
                raise UserError(f"--resume {target}: a LoRA checkpoint of {meta.world_size} ranks at stage "
                                f"{meta.zero_stage} resumes on DeepSpeed only on {meta.world_size} ranks at --stage "
                                f"{meta.zero_stage} (its universal conversion needs the frozen base too); or resume "
                                "it with the same layout, or `zerotrain export` the adapter")
            load_path, client_state = self._load_universal(target, meta)
        else:
            load_path, client_state = self._ds.load_checkpoint(str(target.parent), tag=target.name,
                                                               load_optimizer_states=True, load_lr_scheduler_states=True,
                                                               load_module_strict=not self.uses_lora)
        if load_path is None:
            raise UserError(f"--resume {target}: DeepSpeed could not load it (files missing); pick another checkpoint")
        self.global_step = int(self._ds.global_steps)
        return dict((client_state or {}).get(_CLIENT_KEY, {}))  # DeepSpeed mixes its own keys in

    def _load_universal(self, target: Path, meta: ck.CheckpointMeta) -> tuple[Optional[str], dict]:
        """Another world size or stage: rank 0 converts the checkpoint to DeepSpeed's universal format
        (one file per parameter: fp32 weights + Adam moments), every rank loads its new partition
        from it, and the converted copy (as large as the checkpoint) is deleted again."""
        work = target.parent / UNIVERSAL_DIR / target.name  # never inside the source: the converter walks it
        error: Optional[BaseException] = None
        if self.is_main:
            print(f"zerotrain: converting {target} ({meta.world_size} ranks, stage {meta.zero_stage}) to DeepSpeed's "
                  f"universal format for {self.world_size} ranks at stage {self._stage}", flush=True)
            try:
                shutil.rmtree(work.parent, ignore_errors=True)  # an interrupted earlier conversion
                convert_to_universal(target, work)
            except Exception as e:  # noqa: BLE001 - reported on every rank below
                error = e
        (failed,) = reduce_max(0.0 if error is None else 1.0)  # nobody waits on a rank that failed
        if failed:
            why = "rank 0 failed (its error is printed above)" if error is None else \
                f"{type(error).__name__}: {first_line(error)}"
            raise UserError(f"--resume {target}: converting it to DeepSpeed's universal format failed ({why}); "
                            f"resume with --stage {meta.zero_stage} on {meta.world_size} ranks") from error
        config = self._ds._config
        config.load_universal_checkpoint = True  # DeepSpeed reads it only while loading, so switch it per load
        try:
            loaded = self._ds.load_checkpoint(str(work.parent), tag=work.name, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        finally:
            config.load_universal_checkpoint = False
        dist.barrier()  # every rank has read its partition
        if self.is_main:
            shutil.rmtree(work.parent, ignore_errors=True)
        return loaded

    def _full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        if self.plan.parallel.ep > 1:  # a collective: every block's experts gathered over its ep group
            experts = expert_parallel.gathered_experts(self._ds.module)
            if not self.is_main:
                return None
            state = {k: v.detach().cpu() for k, v in self._ds.module.state_dict().items()}
            return {k: v.contiguous() for k, v in expert_parallel.hf_state_dict({**state, **experts}).items()}
        if self._stage == 3 or self.plan.world.tp > 1:
            # A collective: every rank gathers (ZeRO-3 partitions, AutoTP shards), rank 0 receives it.
            state = self._ds._consolidated_16bit_state_dict()
        else:
            state = self._ds.module.state_dict() if self.is_main else None
        if not self.is_main:
            return None
        return {k: v.detach().cpu().contiguous() for k, v in state.items()}

    def _trainable_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        named = [(n, p) for n, p in self._ds.module.named_parameters() if p.requires_grad]
        gather = contextlib.nullcontext()
        if self._stage == 3:  # only the adapters are gathered, never the frozen base
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None)
        with gather:
            return {n: p.detach().float().cpu().clone() for n, p in named} if self.is_main else None

    @contextlib.contextmanager
    def _hf_write(self) -> Iterator[None]:
        # With the HF ZeRO-3 switch on, any HF model work on rank 0 alone runs zero.Init
        # collectives on one rank and hangs: switch it off around the rank-0 write.
        from transformers.integrations.deepspeed import set_hf_deepspeed_config, unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        try:
            yield
        finally:
            if self._hf_ds_cfg is not None:
                set_hf_deepspeed_config(self._hf_ds_cfg)

    def _release(self) -> None:
        super()._release()
        self._optimizer = None
        if self._hf_ds_cfg is not None:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            self._hf_ds_cfg = None


def _unpartition_heads(model: torch.nn.Module) -> None:
    """ZeRO-3 + LoRA on a classifier: peft trains the head through a deep copy (modules_to_save), and
    a deep copy of ZeRO-3-partitioned parameters is broken (peft#1450). The head (small: hidden x
    labels) gets ordinary parameters holding its gathered values; deepspeed.initialize partitions
    them and peft's copy like any parameter it has not seen."""
    import deepspeed

    for name in ("classifier", "score"):
        head = getattr(model, name, None)
        if not isinstance(head, torch.nn.Module):
            continue
        params = list(head.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            for module in head.modules():
                for pname, p in list(module.named_parameters(recurse=False)):
                    setattr(module, pname, torch.nn.Parameter(p.data.detach().clone(), requires_grad=p.requires_grad))


def _leaf_inputs_need_grad(module: torch.nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook of a ZeRO-3 leaf module (DeepSpeedEngine._guard_leaf_inputs): when gradients
    are being recorded and no tensor input requires grad, the first floating-point input (the hidden
    state, first by HF convention) is replaced by a detached copy that does, so DeepSpeed's gradient
    hook fires after the module's backward instead of before it."""
    if not torch.is_grad_enabled():
        return None
    named = [*enumerate(args), *kwargs.items()]
    tensors = [(k, t) for k, t in named if isinstance(t, torch.Tensor)]
    if any(t.requires_grad for _, t in tensors):
        return None
    key = next((k for k, t in tensors if t.is_floating_point()), None)
    if key is None:
        raise ConfigError(f"ZeRO-3 leaf module {type(module).__name__} is fed no floating-point input (token ids only), "
                          "so DeepSpeed would reduce its gradients before they exist; set zero: {leaf_blocks: false} "
                          "(and no leaf_module in ds_overrides)")
    args, kwargs = list(args), dict(kwargs)
    holder = args if isinstance(key, int) else kwargs
    holder[key] = holder[key].detach().requires_grad_()
    return tuple(args), kwargs


def _release_deepspeed_engine(engine: Any) -> None:
    """Break the references DeepSpeed keeps from long-lived places to the engine and its groups."""
    with contextlib.suppress(Exception):
        engine.destroy()  # DeepSpeed's own cleanup (ZeRO-3 hooks, param coordinator)

"""The engine API: one base class over DeepSpeed and FSDP2 (imitates Lightning Fabric's Strategy split).

A user loop with it is as short as a single-device PyTorch loop:

    engine = build_engine(model_factory, cfg, total_steps=100)
    for batch in loader:
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()            # steps the optimizer on the accumulation boundary only
    engine.save_hf("out/final", tokenizer)
    engine.close()

The base owns what does not depend on the backend: the run plan it was built from (zerotrain/plan/run_plan.py),
the model-preparation sequence (_prepare_model), accumulation counting, the whole-step primitives, the start-banner
description and one close(). Three concerns live in modules of their own, which the base calls or inherits:
checkpointing.py (the checkpoint commit protocol, its meta, resume, and safe reads of checkpoint files),
hf_export.py (save_hf) and generation.py (AuxiliaryHost: the auxiliary models a task holds beside the policy, and
the generation phase). A backend implements the primitives marked abstract: wrap the model, backward, optimizer
step, write/read its checkpoint shards, gather the full state dict; and the hooks of construction (_plan_adopted,
_before_preparation), of teardown (_release: its process-group objects), of auxiliary models (_build_frozen,
_drop_frozen) and of generation (_generation_sharded, _gather_for_generation).
Reading a checkpoint back offline (export) is each backend's checkpoint_io.py, not an engine's.

The sections below follow an engine's lifetime: construction, identity, training, checkpoints, HF export,
teardown.
"""
from __future__ import annotations

import contextlib
import gc
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from ..checkpoint import store as ck
from ..checkpoint.async_save import PendingSave, Ticket
from ..distributed import process_group as dist
from ..distributed.mesh import ParallelMeshes
from ..errors import UserError
from ..model import lora, router
from ..model import sequence_parallel as seqpar
from ..plan.run_plan import RunPlan
from . import checkpointing, hf_export
from .generation import AUXILIARY_ROLES, AuxiliaryHost, AuxiliaryModel, GenerationStats

__all__ = ["AUXILIARY_ROLES", "AuxiliaryModel", "Batch", "Engine", "ModelFactory", "WholeStepEngine"]

ModelFactory = Callable[[], torch.nn.Module]
"""Builds the model. Called by the backend, so a ZeRO-3 backend can build it under zero.Init."""
Batch = dict[str, torch.Tensor]


class StepLosses(list):
    """Engine.train_step's result: each micro-batch's detached loss, in order, and `objective_sums`: a task
    objective's per-micro-batch figures (summed over its pairs; empty for the model's own loss)."""

    def __init__(self, losses: Iterable[torch.Tensor] = (), objective_sums: Iterable[dict[str, torch.Tensor]] = ()):
        super().__init__(losses)
        self.objective_sums = list(objective_sums)

class Engine(AuxiliaryHost, ABC):
    """One training engine. Every method is called on every rank (collectives inside)."""

    name: str = "base"
    """Backend name: 'deepspeed' or 'fsdp'."""
    whole_step: bool = False
    """True for an engine whose unit of work is the whole step (WholeStepEngine: the pipeline engines)."""

    def __init__(self, plan: RunPlan):
        self.plan = plan
        """The resolved run plan (layout, batch, dtype, sharding); the engine reads every run fact from it."""
        self.cfg = plan.cfg
        self.total_steps = plan.total_steps
        self.global_step = 0
        """Optimizer steps taken (restored by load_checkpoint)."""
        self.micro_step = 0
        """Backward calls since the start (the accumulation position is micro_step % grad_accum)."""
        self._loss_takes_tokens: Optional[bool] = None
        """Whether the task's loss is the model's causal-LM loss and it takes num_items_in_batch (local_label_tokens;
        found at the first step)."""
        self._grad_norm: Any = None
        """Global gradient norm before clipping at the last optimizer step, as the backend computed it (a device
        tensor is not read here: reading it waits for the device; last_grad_norm reads it)."""
        self._model_id: tuple[str, str] = ("", "")
        """(class name, config hash) of the model, recorded in checkpoint meta; set by the backend."""
        self._sp: Optional[seqpar.SequenceGroup] = None
        """This rank's sequence-parallel group when the layout has sp > 1 (set by a backend that runs it)."""
        self.expert_load: Optional[router.ExpertLoad] = None
        """A mixture of experts' routing counter (zerotrain/model/router.py), set by _watch_router; None if dense."""
        self.router_aux: list[torch.Tensor] = []
        """The router load-balancing loss of each micro-batch of the last train_step (empty without one)."""
        self._router_kwargs: dict[str, bool] = {}
        """Every forward's router-loss switch for a mixture of experts (router.forward_kwargs); set by _watch_router."""
        self.auxiliaries: dict[str, AuxiliaryModel] = {}
        """The auxiliary models held beside the policy, by role (auxiliary), until release_auxiliary or close."""
        self.last_generation: Optional[GenerationStats] = None
        """What the last generation phase did on this rank (generation_phase; the tokens/s benchmark reads it)."""
        self.pending_save: Optional[PendingSave] = None
        """--async-save: the checkpoint being written in the background, until it is committed."""
        self.save_failures: list[ck.SaveFailure] = []
        """Checkpoint saves that failed and were removed (checkpointing.py), oldest first; the trainer takes them."""
        self.failed_saves_in_row = 0
        """Checkpoint saves that failed since the last one committed (the trainer stops at ck.MAX_FAILED_SAVES)."""

    # --- construction: between the backend's build of the model and its wrapping --------------------
    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model-preparation sequence, in its one order, for every backend: called once by the backend's
        construction when the model is built, before the backend wraps or shards it. Returns the model to wrap
        (under LoRA the peft model).

        1. identity: the model's (class, config hash) for checkpoint meta, before wrapping renames the class;
        2. a plan resolved without the model adopts it (_adopt_model), then the backend's _plan_adopted hook;
        3. the backend's _before_preparation hook;
        4. LoRA, then QAT (ModelPreparation.apply): under DeepSpeed outside zero.Init (initialize shards the
           adapters), under FSDP on the meta-built ranks too (rank 0's adapters reach them with its weights);
           QAT's fake-quantized layers take over the (partitioned) parameters before anything shards them;
        5. a mixture of experts' routing counted and its router-loss switch passed (_watch_router);
        6. sp > 1: the all-to-all attention (_use_sequence_parallel); the backend then shards over dp x sp;
        7. --compile: the blocks (_compile), before the backend's hooks go around them."""
        self._model_id = ck.config_hash(model)
        if self.plan.facts is None:
            self._adopt_model(model)
            self._plan_adopted()
        self._before_preparation(model)
        model = self.plan.preparation.apply(model)
        self._watch_router(model)
        self._use_sequence_parallel(model)
        self._compile(model)
        return model

    def _adopt_model(self, model: torch.nn.Module) -> None:
        """A plan resolved without the model (build_engine with a plain factory) gets the rules and defaults
        that need it (parallel splits, ZeRO-3 leaf blocks, bucket sizes) from the resolver, before anything
        reads them. A plan from `zerotrain train` (preflight) already knows the model and stays the same
        object (_prepare_model does not call this then)."""
        from ..model.facts import facts_of
        from ..plan.run_plan import with_model

        self.plan = with_model(self.plan, facts_of(model, getattr(model, "config", None)))

    def _plan_adopted(self) -> None:
        """Hook: the plan has just adopted the model (_prepare_model step 2); a backend that rendered its
        config from the plan before the build renders it again here (DeepSpeed)."""

    def _before_preparation(self, model: torch.nn.Module) -> None:
        """Hook: what a backend changes in the built model before LoRA and QAT (_prepare_model step 3;
        DeepSpeed at ZeRO-3 with LoRA: a classifier head's parameters unpartitioned)."""

    # --- identity -------------------------------------------------------------------------
    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def last_grad_norm(self) -> Optional[float]:
        """Global gradient norm before clipping at the last optimizer step (reading it waits for the device)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @last_grad_norm.setter
    def last_grad_norm(self, norm: Any) -> None:
        # a copy: a backend may overwrite its norm tensor in place at the next step, before the trainer reads it
        self._grad_norm = norm.detach().clone() if isinstance(norm, torch.Tensor) else norm

    def grad_norm_unread(self) -> Any:
        """The last step's gradient norm as the backend holds it (None, a float or a device tensor): the trainer
        keeps it and reads it only on the steps it logs, so no other step waits for the device."""
        return self._grad_norm

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica (keys the sampler and the metrics)."""
        return self.plan.world.dp_rank(self.rank)

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def lr(self) -> float:
        """Learning rate the next optimizer step will use."""

    @property
    @abstractmethod
    def module(self) -> torch.nn.Module:
        """The (wrapped) model to call for forward."""

    @property
    @abstractmethod
    def hf_model(self) -> torch.nn.Module:
        """The model itself, unwrapped (its config and save_pretrained)."""

    @abstractmethod
    def state_holders(self) -> tuple[torch.nn.Module, Any]:
        """(module holding the parameters, optimizer holding the states): what measure.py counts."""

    def __call__(self, *args, **kwargs):
        kwargs = {**self._router_kwargs, **kwargs}  # a mixture of experts' router-loss switch (router.forward_kwargs)
        with self._saved_activations():
            if self._sp is None:
                return self._forward(*args, **kwargs)
            return seqpar.forward_shard(self._forward, kwargs, self._sp)

    def _saved_activations(self) -> contextlib.AbstractContextManager:
        """Where the forward keeps what backward needs: pinned host memory under --offload-activations (a GPU
        run's; refused on CPU by config/rules.py), else where it is computed."""
        if self.cfg.model.offload_activations and self.device.type != "cpu":
            return torch.autograd.graph.save_on_cpu(pin_memory=True)
        return contextlib.nullcontext()

    def _forward(self, *args, **kwargs):
        """The backend's forward of one micro-batch (DeepSpeed: its engine's, with ZeRO-3 gathers and casts)."""
        return self.module(*args, **kwargs)

    def _compile(self, model: torch.nn.Module) -> None:
        """--compile: every transformer block's forward compiled (zerotrain/model/compile.py), after the model is
        prepared and sequence parallelism installed, before the backend wraps or shards it."""
        plan = self.plan.preparation.compile
        if plan is not None:
            from ..model.compile import compile_blocks
            from ..model.facts import transformer_blocks

            hf = lora.unwrapped(model)
            compile_blocks(hf, transformer_blocks(hf), plan)

    def _watch_router(self, model: torch.nn.Module) -> None:
        """Count a mixture of experts' routing and pass its router-loss switch to every forward (after
        ModelPreparation.apply, before wrapping)."""
        self.expert_load = router.ExpertLoad.attach(model)
        self._router_kwargs = router.forward_kwargs(model)

    @property
    def router_aux_coef(self) -> Optional[float]:
        """The weight of the router load-balancing loss in the trained loss (None: not in it)."""
        return router.trained_coef(self.hf_model)

    @property
    def meshes(self) -> ParallelMeshes:
        """This run's meshes and process groups by role (zerotrain/distributed/mesh.py), each built on first use."""
        if getattr(self, "_meshes", None) is None:
            self._meshes = ParallelMeshes(self.plan.world, lambda: self.device.type)
        return self._meshes

    def _drop_meshes(self) -> None:
        """Forget every mesh and group this engine was handed (close(), before the process group is destroyed:
        objects still holding groups at exit abort the process: zerotrain/distributed/process_group.py teardown)."""
        self._meshes = self._sp = None

    def _use_sequence_parallel(self, model: torch.nn.Module) -> None:
        """Under sp > 1: this rank's group (every rank creates every group, in the same order) and the model
        switched to the all-to-all attention (zerotrain/model/sequence_parallel.py)."""
        world = self.plan.world
        if world.sp == 1:
            return
        mine = self.meshes.get("sp")
        self._sp = seqpar.SequenceGroup(mine, world.sp, world.coordinate(self.rank, "sp"))
        seqpar.install(model, self._sp)

    @property
    def sequence_group(self) -> Optional[seqpar.SequenceGroup]:
        """This rank's sequence-parallel group (None without sp): what an objective cuts its rows' labels by and
        sums their shards over (zerotrain/train/preference.py sequence_logps)."""
        return self._sp

    @property
    def grad_accum(self) -> int:
        return self.plan.batch.grad_accum

    @property
    def notes(self) -> list[str]:
        """One-line facts about how this engine runs the model (stage mapping, ZeRO-3 leaf blocks)."""
        return self.plan.notes()

    def describe(self) -> list[str]:
        """The start banner's engine lines: the resolved layout, batch and sharding, the notes, then LoRA's
        and QAT's (ModelPreparation.banner), then the optimizer's where it has any (--optimizer muon: which
        parameters went to Muon, which to AdamW: zerotrain/optim/muon.py)."""
        optimizer_lines = getattr(getattr(self, "optimizer", None), "describe", lambda: [])()
        return [f"{self.name}: {self.plan.describe()}", *self.notes, *self.plan.preparation.banner(self.hf_model),
                *optimizer_lines]

    def backend_config(self) -> Optional[dict]:
        """The exact backend config the run used, written to the run dir (DeepSpeed: its JSON)."""
        return None

    def is_accumulation_boundary(self) -> bool:
        """True when the next backward is the last micro-batch of an optimizer step."""
        return (self.micro_step + 1) % self.grad_accum == 0

    # --- training -------------------------------------------------------------------------
    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch loss (the mean over its samples); scaling for accumulation is inside."""

    @abstractmethod
    def step(self) -> bool:
        """After every backward: on the accumulation boundary clip, step optimizer and LR, zero grads
        and return True; otherwise return False."""

    def to_device(self, batch: Batch) -> Batch:
        """A collated (host) batch on the model's device; no copy when they are the same (non-tensor
        forward options such as a packed batch's use_cache=False pass through)."""
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def train_step(self, micro_batches: Iterable[Batch],
                   after_backward: Optional[Callable[[int], None]] = None,
                   label_tokens: Optional[float] = None, objective: Any = None) -> StepLosses:
        """One optimizer step over grad_accum host micro-batches: forward, backward, step each.

        objective: what runs per micro-batch instead of the model's own loss (a recipe's, zerotrain/train/recipes/
        base.py Objective); None: the model's loss.

        label_tokens: the step's label tokens summed over every rank (local_label_tokens reduced; the trainer folds
        that sum into its step-boundary exchange); None: counted here with a collective of its own.
        Returns each micro-batch's detached loss (read by the caller once per step). A pipeline engine
        replaces this whole-step path (it has no per-micro-batch backward); its losses are real on the
        last stage only (plan.world.counts_for_data says which ranks' figures count) and zeros elsewhere. after_backward(i) runs
        after the i-th backward, before its step (the memory-measurement hook)."""
        losses = StepLosses()
        stepped = False
        micro_batches = list(micro_batches)
        weight = self._token_weighting(micro_batches, label_tokens) if objective is None else {}
        if objective is not None:
            objective.begin_step(self, micro_batches)
        self.router_aux = []
        counting = self.expert_load.counting if self.expert_load is not None else contextlib.nullcontext
        for i, batch in enumerate(micro_batches):
            with counting():
                if objective is None:
                    out = self(**self.to_device(batch), **weight)
                else:
                    out = objective(self, self.to_device(batch))
                    losses.objective_sums.append(out.sums)
            loss = out.loss
            if out.get("aux_loss") is not None:
                self.router_aux.append(out["aux_loss"].detach())
            self.backward(loss)
            if after_backward is not None:
                after_backward(i)
            stepped = self.step()
            losses.append(loss.detach())
        if not stepped:
            raise RuntimeError(f"the engine did not step after {len(losses)} micro-batches (grad_accum "
                               f"{self.grad_accum}): the step must be given exactly grad_accum micro-batches")
        return losses

    def local_label_tokens(self, micro_batches: list[Batch]) -> Optional[float]:
        """This rank's share of the step's label tokens (tp ranks repeat their replica's batch: one counts it), or
        None when the step's loss is not weighted by the global token count (_token_weighting; no collective)."""
        if self._loss_takes_tokens is None:  # the task's and the model's: the same every step (0.5 ms a step, profiled)
            self._loss_takes_tokens = self.plan.task.next_token_loss and _accepts_loss_kwargs(self.hf_model)
        labels = [b.get("labels") for b in micro_batches]
        if not self._loss_takes_tokens or any(
                lab is None or lab.dim() != 2 for lab in labels):
            return None
        share = 1.0 if self.plan.world.counts_for_data(self.rank) else 0.0
        return share * float(sum(seqpar.label_tokens(lab) for lab in labels))  # HF shifts labels by one

    def _token_weighting(self, micro_batches: list[Batch], label_tokens: Optional[float] = None) -> dict[str, Any]:
        """Causal-LM token labels: {"num_items_in_batch": N / (grad_accum x dp)}, N the step's label tokens
        over every micro-batch and replica (label_tokens, or a collective here), so that each micro-batch's loss is its token
        sum / N scaled back by the engines' 1/grad_accum and the replicas' mean: the step trains on the
        global per-token mean, as one process with the whole global batch would, however the tokens
        fall across micro-batches (assistant-only chat labels, padded rows). HF's causal-LM loss takes
        the divisor (transformers' num_items_in_batch); the mean of per-micro-batch means does not."""
        local = self.local_label_tokens(micro_batches)
        if local is None:
            return {}
        if label_tokens is None:
            from ..distributed.collectives import reduce_sum

            (label_tokens,) = reduce_sum(local)
        tokens = label_tokens
        scale = max(tokens, 1.0) / self.plan.batch.step_micro_batches
        return {"num_items_in_batch": torch.tensor(scale, dtype=torch.float32, device=self.device)}

    def eval_step(self, batch: Batch) -> Optional[torch.Tensor]:
        """Logits of one host batch, without gradients (the model stays in whatever mode it is).

        Every rank calls it (collectives inside); a pipeline engine returns the logits on its last
        stage only and None on the others."""
        with torch.no_grad():
            logits = self(**self.to_device(batch)).logits
            if self._sp is not None:  # each rank holds its shard of the sequence
                logits = seqpar.gather_sequence(logits, self._sp, batch["input_ids"].shape[1])
            return logits

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    # --- checkpoints: the commit protocol (zerotrain/checkpoint/store.py) around the backend's shards ------
    @abstractmethod
    def _write_shards(self, target: Path, client_state: dict[str, Any]) -> None:
        """Every rank: write this rank's model/optimizer/scheduler state and client_state into target."""

    @abstractmethod
    def _read_shards(self, target: Path, meta: ck.CheckpointMeta) -> dict[str, Any]:
        """Every rank: load model/optimizer/scheduler state and global_step; return the client_state."""

    def identity(self) -> ck.RunIdentity:
        """What this run's checkpoints record and what a resume must match (checkpoint.check_resume)."""
        base = lora.base_name(self.hf_model) if self.uses_lora else None
        return ck.identity_of(self.plan, self._model_id, lora_base=base)

    @property
    def uses_lora(self) -> bool:
        """Whether the model trains through LoRA adapters (a peft model: adapters trainable, base frozen);
        the plan's preparation says so."""
        return self.plan.preparation.uses_lora

    def _write_shards_async(self, target: Path, client_state: dict[str, Any]) -> Ticket:
        """Every rank: start writing this rank's state into target and return once it is copied (the live
        tensors may change after); the ticket is done when the files are. Backends without it write now."""
        self._write_shards(target, client_state)
        ticket = Ticket()
        ticket.finish()
        return ticket

    def _layout_record(self) -> dict[str, Any]:
        """What CheckpointMeta.extra records of the backend's file layout beyond the plan's (checkpoint.store
        expected_files; DeepSpeed's pipeline engine: its layers)."""
        return {}

    def save_checkpoint(self, ckpt_root: str | Path, client_state: dict[str, Any],
                        extras: checkpointing.CheckpointExtras = checkpointing.CheckpointExtras()) -> Path:
        """Save a checkpoint under ckpt_root (tag from global_step), 'latest' once every rank wrote all of its files;
        returns its dir. A failed save is removed and appended to save_failures; --async-save returns while the files
        are written (pending_save). The protocol: backends/checkpointing.py save."""
        return checkpointing.save(self, Path(ckpt_root), client_state, extras)

    def commit_pending_save(self, any_failed: Optional[bool] = None) -> Optional[PendingSave]:
        """Every rank, once no rank's write of the pending save is running: commit it, or remove it when a rank's
        write failed (any_failed: the trainer's agreement; None: gathered here). Returns it when committed."""
        return checkpointing.commit_pending(self, any_failed)

    def finish_pending_save(self) -> Optional[PendingSave]:
        """Every rank: wait for this rank's write of the pending save, then settle it (commit or remove, every
        rank's result gathered) (no-op without one). Returns it when committed."""
        return checkpointing.finish_pending(self)

    def load_checkpoint(self, path: str | Path) -> checkpointing.Loaded:
        """Load ckpt_root (its latest) or one checkpoint dir; restores model, optimizer, LR, global_step. Every file is
        read safely unless cfg.run.trust_checkpoint (backends/checkpointing.py). Returns the client_state given at
        save time and this rank's CheckpointExtras.rank_state."""
        return checkpointing.load(self, path)

    # --- HF export --------------------------------------------------------------------------
    @abstractmethod
    def _full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Collective: the whole model's weights as CPU tensors on rank 0 (tied weights one tensor),
        None on the other ranks."""

    def _hf_write(self) -> contextlib.AbstractContextManager:
        """Context around rank 0's save_pretrained (DeepSpeed switches its HF ZeRO-3 hook off)."""
        return contextlib.nullcontext()

    def _trainable_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Collective: the trainable parameters (LoRA adapters, modules_to_save heads) at full shape as
        CPU tensors on rank 0, None elsewhere; nothing frozen is gathered."""
        raise UserError(f"the {self.name} engine does not export LoRA adapters")

    def save_hf(self, out_dir: str | Path, tokenizer: Any = None, kept: str = "", fix: str = "") -> None:
        """HF save_pretrained directory (LoRA: the adapter) written by rank 0, staged and renamed into place; an OS
        error ends every rank as one line naming `kept` and `fix` (backends/hf_export.py save_hf)."""
        hf_export.save_hf(self, out_dir, tokenizer, kept, fix)

    # --- teardown ---------------------------------------------------------------------------------

    def close(self, barrier: bool = True) -> None:
        """Release the engine and tear down the process group (barrier + destroy; barrier=False after a
        failure, so a failed rank does not wait for peers still inside a collective). Every object that holds a
        process group is dropped first (objects still holding groups at exit abort the process:
        zerotrain/distributed/process_group.py teardown): the auxiliary models, the backend's (_release), the meshes."""
        self.release_auxiliary()
        self._release()
        self._drop_meshes()
        gc.collect()
        dist.teardown(barrier=barrier)

    def _release(self) -> None:
        """Backend hook of close: drop the backend's objects that hold a process group (engine, optimizer, model)."""



def _accepts_loss_kwargs(model: torch.nn.Module) -> bool:
    """Whether the model's loss takes num_items_in_batch: HF Trainer's test (the model's own
    accepts_loss_kwargs flag, else a **kwargs forward), on the model under a peft wrapper."""
    import inspect

    base = lora.unwrapped(model)
    if hasattr(base, "accepts_loss_kwargs"):
        return bool(base.accepts_loss_kwargs)
    params = inspect.signature(base.forward).parameters.values()
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)


class WholeStepEngine(Engine):
    """An engine whose unit of work is the whole step (the pipeline engines): the schedule runs every
    micro-batch's forward and backward across the stages, so the per-micro-batch primitives refuse."""

    whole_step = True

    def __call__(self, *args, **kwargs):
        raise UserError(f"the {self.name} pipeline engine has no per-micro-batch forward: use engine.eval_step")

    def backward(self, loss: torch.Tensor) -> None:
        raise UserError(f"the {self.name} pipeline engine has no per-micro-batch backward: use engine.train_step")

    def step(self) -> bool:
        raise UserError(f"the {self.name} pipeline engine has no per-micro-batch step: use engine.train_step")

    def local_label_tokens(self, micro_batches: list[Batch]) -> Optional[float]:
        return None  # the schedule's loss is its own (no token-weighted divisor to agree on)

    def _check_micro_batches(self, n: int) -> None:
        if n != self.grad_accum:
            raise RuntimeError(f"a pipeline step takes exactly grad_accum={self.grad_accum} micro-batches (got {n})")

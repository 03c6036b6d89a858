"""DeepSpeed pipeline engine: a HF decoder as a `deepspeed.pipe.PipelineModule`, trained with `train_batch`.

    zerotrain train --backend deepspeed --pp 2 --grad-accum 8 ...     # 8 pipeline micro-batches per step

The model is the flat layer list of pipeline_parts ([Embed, Block x n, Head]) cut at
pipeline_parts.stage_bounds, so each rank runs (and its optimizer holds) only its stage's blocks.
GPT-2 ties its input embedding and LM head: both ends are one `TiedLayerSpec` (the first stage's
embedding and the last stage's head read the same `wte.weight`; DeepSpeed broadcasts it at start
and all-reduces its gradient between the two stages), and the final norm is its own layer there.
The whole step is DeepSpeed's (its 1F1B schedule over grad_accum micro-batches, the tied-gradient
and data-parallel reductions, ZeRO-1 and the optimizer step), so train_step replaces the base's
per-micro-batch loop. Checkpoints are DeepSpeed's pipeline layout (one layer_XX file per layer,
written by the stage that holds it); export_checkpoint rebuilds one HF model from them.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ...checkpoint import store as ck
from ...errors import UserError
from ...model.pipeline_parts import (
    PIPELINE_FAMILIES,
    Block,
    Embed,
    Head,
    causal_lm_loss,
    hf_names,
    stage_bounds,
    tied_weight,
)
from ...plan.run_plan import RunPlan
from ...plan.schedule import make_scheduler
from ..base import Batch, ModelFactory, StepLosses, WholeStepEngine
from ..checkpointing import read_file
from .engine import _CLIENT_KEY, DeepSpeedShared

TIED_KEY = "embed"
"""TiedLayerSpec key of GPT-2's embedding / LM-head weight."""


class TiedEnds(nn.Module):
    """GPT-2's embeddings, built once per end stage: the first stage embeds with it, the last stage's
    head multiplies by its `wte.weight` (pipeline_parts.Embed's modules, one tied weight)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        embed = Embed(model)
        self.wte, self.wpe, self.drop = embed.wte, embed.wpe, embed.drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return Embed.forward(self, input_ids)  # type: ignore[arg-type]  (same attributes)

    @staticmethod
    def head(module: "TiedEnds", hidden: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(hidden, module.wte.weight)


class FinalNorm(nn.Module):
    """GPT-2's ln_f as a layer of its own (the tied head after it holds no parameters to save)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.norm = Head(model).norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


def pipe_layers(model: nn.Module) -> tuple[list, bool]:
    """(the PipelineModule layer list of `model`, whether it ties embedding and head). Untied:
    [Embed, Block x n, Head] as modules; tied: [TiedLayerSpec, Block x n, FinalNorm, TiedLayerSpec]."""
    from deepspeed.pipe import TiedLayerSpec

    base = getattr(model, PIPELINE_FAMILIES[model.config.model_type])
    n = len(base.h if model.config.model_type == "gpt2" else base.layers)
    blocks = [Block(model, i) for i in range(n)]
    if tied_weight(model) is None:
        return [Embed(model), *blocks, Head(model)], False
    return [TiedLayerSpec(TIED_KEY, TiedEnds, model, tied_weight_attr=["wte.weight"]), *blocks, FinalNorm(model),
            TiedLayerSpec(TIED_KEY, TiedEnds, model, forward_fn=TiedEnds.head, tied_weight_attr=["wte.weight"])], True


def pipe_parts(num_blocks: int, pp: int, tied: bool) -> list[int]:
    """DeepSpeed's `parts` (stage s holds layers parts[s]:parts[s+1]) from pipeline_parts.stage_bounds;
    a tied model's head is two layers (FinalNorm, the tied head) on the last stage."""
    parts = [a for a, _ in stage_bounds(num_blocks, pp)] + [num_blocks + 2]
    if tied:
        parts[-1] += 1
    return parts


class DeepSpeedPipelineEngine(DeepSpeedShared, WholeStepEngine):
    def __init__(self, model_factory: ModelFactory, plan: RunPlan):
        super().__init__(plan)
        import deepspeed
        from deepspeed.pipe import PipelineModule

        self._start(plan)
        self._hf: nn.Module = self._prepare_model(model_factory())  # the base's sequence (LoRA, QAT, ... refused here)
        layers, tied = pipe_layers(self._hf)
        parts = pipe_parts(len(layers) - (3 if tied else 2), self.plan.world.pp, tied)

        class _Stages(PipelineModule):  # DeepSpeed's own partitioners do not know stage_bounds' rule
            def _partition_layers(self, method: str = "uniform") -> None:
                self.parts = parts
                stage = self._topo.get_coord(self.global_rank).pipe
                self._set_bounds(start=parts[stage], stop=parts[stage + 1])

        self._losses: list[torch.Tensor] = []
        self._pipe = _Stages(layers=layers, num_stages=self.plan.world.pp, loss_fn=self._loss, dynamic_shape=True)
        self._owned = self._free_other_stages(tied)
        params = [p for p in self._pipe.parameters() if p.requires_grad]
        self._ds, _, _, self._scheduler = deepspeed.initialize(
            model=self._pipe, model_parameters=params, config=copy.deepcopy(self.ds_config),
            lr_scheduler=lambda opt: make_scheduler(opt, self.cfg, self.plan.total_steps))
        self._after_backward: Optional[Callable[[int], None]] = None
        take_step = self._ds._take_model_step

        def step_after_hook(lr_kwargs=None):  # gradients reduced, optimizer not stepped yet
            if self._after_backward is not None:
                self._after_backward(0)
            take_step(lr_kwargs)

        self._ds._take_model_step = step_after_hook

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = causal_lm_loss(logits, labels)
        self._losses.append(loss.detach())  # per micro-batch (train_batch returns only their mean)
        return loss

    def _free_other_stages(self, tied: bool) -> set[str]:
        """Drop the HF model's parameters this stage does not run (the factory built them all) and
        return the HF names this stage holds the trained value of (export reads them from here)."""
        mine = {id(p) for p in self._pipe.parameters()}
        for module in self._hf.modules():
            for key, p in list(module._parameters.items()):
                if p is not None and id(p) not in mine:
                    module._parameters[key] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                           requires_grad=False)
        last_copy: set[int] = set()
        if tied and not self._first_stage():
            # The last stage's copy of the tied ends: only wte.weight is used (DeepSpeed keeps it equal
            # to the first stage's, which is the one exported); its position embedding is not trained here.
            ends = self._pipe.tied_modules[TIED_KEY]
            ends.wpe.weight.requires_grad_(False)
            last_copy = {id(p) for p in ends.parameters()}
        return {n for p, ns in hf_names(self._pipe, self._hf).items() if id(p) not in last_copy for n in ns}

    def _first_stage(self) -> bool:
        return self.plan.world.pp_stage(self.rank) == 0

    # --- identity (the rest is DeepSpeedShared's) --------------------------------------------
    @property
    def hf_model(self) -> nn.Module:
        return self._hf

    # --- the whole step ---------------------------------------------------------------------
    def train_step(self, micro_batches: Iterable[Batch],
                   after_backward: Optional[Callable[[int], None]] = None,
                   label_tokens: Optional[float] = None, objective: Any = None) -> StepLosses:
        if objective is not None:  # tasks.LAYOUT_REFUSALS refuses --pp for the tasks that have one
            raise ValueError("a pipeline engine trains the model's own loss; it runs no task objective")
        batches = [(b["input_ids"], b["labels"]) for b in micro_batches]
        self._check_micro_batches(len(batches))
        self._losses, self._after_backward = [], after_backward
        self._ds.train()
        self._ds.train_batch(data_iter=iter(batches))
        self._after_backward = None
        self.micro_step += len(batches)
        self.global_step = int(self._ds.global_steps)
        norm = self._ds.get_global_grad_norm()
        self.last_grad_norm = norm  # read only when logged (Engine.grad_norm_unread)
        if self._ds.is_last_stage():
            return StepLosses(self._losses)
        return StepLosses(torch.zeros(()) for _ in batches)

    def eval_step(self, batch: Batch) -> Optional[torch.Tensor]:
        ids = batch["input_ids"]
        # compute_loss=False would add the logits to the loss total the last train_batch left behind
        # (DeepSpeed resets it only in train_batch); the loss of the ids themselves is cheap and unused.
        _, logits = self._ds.eval_batch(iter([(ids, ids)]), return_logits=True, compute_loss=True,
                                        bcast_loss=False, num_micro_batches=1)
        return logits if self._ds.is_last_stage() else None

    def train(self) -> None:
        self._ds.train()

    def eval(self) -> None:
        self._ds.eval()

    # --- checkpoints ------------------------------------------------------------------------
    def _write_shards(self, target: Path, client_state: dict[str, Any]) -> None:
        self._save_through_guard(target, client_state)

    def _layout_record(self) -> dict[str, Any]:
        """The layers DeepSpeed writes a layer_XX-model_states.pt for (checkpoint.store.expected_files): every built
        module; not a plain function, nor a tied layer with a forward_fn (DeepSpeed runs it as a functools.partial,
        which has no state_dict: the tied GPT-2 head)."""
        from deepspeed.pipe import LayerSpec, TiedLayerSpec

        def written(spec: Any) -> bool:
            if isinstance(spec, TiedLayerSpec):
                return spec.forward_fn is None
            return isinstance(spec, (LayerSpec, nn.Module))

        return {"pipe_layers": [i for i, spec in enumerate(self._ds.module._layer_specs) if written(spec)]}

    def _read_shards(self, target: Path, meta: ck.CheckpointMeta) -> dict[str, Any]:
        load_path, client_state = self._ds.load_checkpoint(str(target.parent), tag=target.name,
                                                           load_optimizer_states=True, load_lr_scheduler_states=True)
        if load_path is None:
            raise UserError(f"--resume {target}: DeepSpeed could not load it (files missing); pick another checkpoint")
        self.global_step = int(self._ds.global_steps)
        return dict((client_state or {}).get(_CLIENT_KEY, {}))

    def _full_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """Every stage's weights (HF names) gathered on rank 0; data-parallel replicas hold the same."""
        mine: dict[str, torch.Tensor] = {}
        if self.plan.world.dp_rank(self.rank) == 0:
            for p, names in hf_names(self._pipe, self._hf).items():
                for n in names:
                    if n in self._owned:
                        mine[n] = p.detach().cpu().clone()
        gathered: list = [None] * self.world_size
        torch.distributed.all_gather_object(gathered, mine)
        if not self.is_main:
            return None
        state = {k: v for part in gathered for k, v in part.items()}
        tied = tied_weight(self._hf)
        if tied is not None:
            state[tied.head_name] = state[tied.hf_name]
        return state

    def _release(self) -> None:
        super()._release()
        self._pipe = None


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path) -> Path:
    """A pipeline checkpoint (layer_XX files of every stage) -> one HF save_pretrained dir, in one process."""
    import transformers

    path = Path(ckpt_dir)
    meta = ck.read_meta(path)
    if not (path / "config.json").is_file():
        raise UserError(f"{path}: no config.json in the checkpoint; only HF models can be exported")
    hf = transformers.AutoConfig.from_pretrained(str(path))
    cls = getattr(transformers, meta.model_class, None)
    if cls is None:
        raise UserError(f"{path}: model class {meta.model_class} is not a transformers class; cannot export to HF")
    model = cls(hf)
    layers, _ = pipe_layers(model)
    names = {}
    for idx, layer in enumerate(layers):
        if getattr(layer, "forward_fn", None) is not None:
            continue  # the tied head: its weight is the first layer's
        module = layer.build() if hasattr(layer, "build") else layer
        file = path / f"layer_{idx:02d}-model_states.pt"
        if not file.is_file():
            raise UserError(f"{path}: {file.name} is missing; the checkpoint is incomplete")
        saved = read_file(file)
        owner = {id(p): n for n, p in module.named_parameters()}
        for p, hf_ns in hf_names(module, model).items():
            for n in hf_ns:
                names[n] = saved[owner[id(p)]]
    missing, unexpected = model.load_state_dict(names, strict=False)
    tied = tied_weight(model)
    if set(missing) - ({tied.head_name} if tied else set()) or unexpected:
        raise UserError(f"{path}: the layer files do not fit {meta.model_class} (missing {sorted(missing)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]}); the checkpoint is damaged or of another model")
    model.tie_weights()
    return ck.write_hf_dir(Path(out_dir), model, tokenizer=path)

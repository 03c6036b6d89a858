"""Model preparation: what a run does to the model it builds before training it (frozen image-text parts, LoRA,
then QAT).

    prep = ModelPreparation.from_config(cfg)     # or plan.preparation (build_plan sets it)
    prep.uses_lora, prep.uses_qat                # the one answer to "is LoRA / QAT on?"
    model = prep.apply(model)                    # both engines, before wrapping / sharding

The one owner of those facts: the engines (backends/*.py) ask `plan.preparation`; preflight, the
model facts every command sizes (model_info.run_facts), tune and the checkpoint identity
(checkpoint.identity_of) ask a ModelPreparation. Whether a config may ask for them at all is the
rules layer's (rules.check_lora, rules.check_qat); how they are done is lora.py's and quant.py's.

Importing this module imports neither torch nor peft nor torchao (the plan holds a preparation and
`zerotrain config` builds plans): lora.py and quant.py are imported by the methods that use them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ..tasks import HEAD_SPLIT_DIMS, TaskSpec, task_spec
from ..config.preparation import LoraPlan, QatPlan

if TYPE_CHECKING:
    from torch import nn

    from ..config.schema import RunConfig
    from .compile import CompilePlan


@dataclass(frozen=True)
class ModelPreparation:
    """What is done to the built model before training: LoRA (lora is not None), then QAT (qat is not None).
    The default prepares nothing (full fine-tuning in full precision)."""

    lora: Optional[LoraPlan] = None
    """The adapters to add; None: every weight trains (lora.r 0)."""
    qat: Optional[QatPlan] = None
    """The fake quantization to train with; None: quant.qat none."""
    tiled_mlp: int = 0
    """Tokens per MLP tile (memory_reducers.tile_mlps); 0: the MLPs run whole."""
    chunked_loss: Optional[int] = 0
    """Tokens per head + loss chunk asked for (--chunked-loss; memory_reducers.chunked_lm_loss); 0: the fused
    loss's own chunk when it is on, else the model's own head and loss; None: the task chunks by default
    (TaskSpec.chunks_by_default): fused_loss.auto_chunk_tokens of the vocabulary where the model's head carries
    it (loss_chunk), else the whole logits."""
    fused_loss: Optional[bool] = False
    """The causal-LM loss fused with the head (zerotrain/model/fused_loss.py): None (auto) on where the model's
    head carries it, True required (refused where it cannot), False the model's own head and loss (or, with
    chunked_loss, chunks recomputed in backward). Resolved to False off plain causal-LM training and under
    tp/pp (model.fused_loss's docstring)."""
    router_aux_coef: Optional[float] = None
    """Mixture of experts: the router load-balancing loss weight (router.configure); None: the model's own,
    0: none (also what a layout that cuts the forward gets, plan/parallel_rules.py router_aux_cut)."""
    freeze_router: bool = False
    """Mixture of experts: the gates do not train."""
    freeze: tuple[str, ...] = ()
    """Image-text models: the roles (vision, projector, language) whose parameters do not train (--freeze;
    zerotrain/model/vision_roles.py); a text-only model refuses any."""
    compile: Optional["CompilePlan"] = None
    """--compile: the transformer blocks compiled after apply, before the engine wraps the model
    (Engine._compile, zerotrain/model/compile.py); None: eager."""

    @classmethod
    def from_config(cls, cfg: "RunConfig", task: Optional["TaskSpec"] = None) -> "ModelPreparation":
        """The preparation a (validated) config asks for; task: the run's (RunPlan.task; None: model.task's)."""
        lo, q = cfg.lora, cfg.quant
        task = task or task_spec(cfg.model.task)
        from .vision_roles import parse_roles

        frozen = parse_roles(cfg.model.freeze)
        lora = LoraPlan(r=lo.r, alpha=lo.alpha, dropout=lo.dropout, targets=lo.targets, merge=lo.merge,
                        peft_task_type=task.peft_task_type, seed=cfg.run.seed,
                        gradient_checkpointing=cfg.model.gradient_checkpointing,
                        scope=lo.scope,
                        frozen=frozen) if lo.r > 0 else None
        qat = QatPlan(scheme=q.qat, group_size=q.group_size) if q.qat != "none" else None
        chunked = cfg.model.chunked_loss if task.composes("chunked_loss") else 0
        if chunked is None and not task.chunks_by_default:
            chunked = 0
        fused = cfg.model.fused_loss
        if fused is None and (not task.composes("fused_loss")
                              or any(getattr(cfg.parallel, d) > 1 for d in HEAD_SPLIT_DIMS)):
            fused = False  # auto: off where the loss is not the LM's own or a split builds its own head
        from ..config.rules import router_aux_cut

        aux = cfg.model.router_aux_coef
        if aux is None and router_aux_cut(cfg):
            aux = 0.0  # warned by name (parallel_rules.router_warnings)
        compiled = None
        if cfg.compile.enabled:
            from .compile import CompilePlan

            d = cfg.data
            plain_text = d.format == "text" or (d.format == "auto" and (d.path is None or str(d.path).endswith(".txt")))
            packed = task.composes("packing") and d.pack and d.packing == "off"
            unknown = d.format == "auto" and not plain_text  # chat or text: known once the columns are read
            dynamic = None if packed and unknown else not (packed and plain_text)
            compiled = CompilePlan(mode=cfg.compile.mode, backend=cfg.compile.backend, dynamic=dynamic)
        return cls(lora=lora, qat=qat, tiled_mlp=cfg.model.tiled_mlp, chunked_loss=chunked, fused_loss=fused,
                   compile=compiled, router_aux_coef=aux,
                   freeze_router=cfg.model.freeze_router, freeze=frozen)

    @property
    def uses_lora(self) -> bool:
        """The model trains through LoRA adapters (base frozen; checkpoints and final/ hold the adapter)."""
        return self.lora is not None

    @property
    def uses_qat(self) -> bool:
        """The model trains with fake-quantized Linears (final/quantized-<scheme>/ gets the converted model)."""
        return self.qat is not None

    @property
    def fused_loss_on(self) -> bool:
        """The one answer to "is the fused loss on?" (decided in from_config): True where it is asked for or
        auto (None) left it on, on every model whose head carries it (loss_chunk says which built model does)."""
        return self.fused_loss is not False

    @property
    def lora_rank(self) -> int:
        """LoRA's rank; 0 without LoRA (the config's convention)."""
        return self.lora.r if self.lora is not None else 0

    @property
    def merge_lora(self) -> bool:
        """save_hf also writes the merged model (--merge-lora, which needs LoRA)."""
        return self.lora is not None and self.lora.merge

    # --- the model ---------------------------------------------------------------------------
    def check(self, model: "nn.Module") -> None:
        """Refuse (UserError, one line) a model this preparation cannot be applied to: LoRA target names it
        lacks, a model torchao would leave as it is or whose layers the QAT group size does not divide."""
        if self.lora is not None:
            from .lora import check_targets

            check_targets(model, self.lora.targets)
        if self.qat is not None:
            self._check_qat(model)

    def apply(self, model: "nn.Module") -> "nn.Module":
        """The model to train: LoRA's peft model around `model` (lora.apply_lora, seeded), then QAT's
        FakeQuantizedLinears swapped in (quant.qat_prepare, in place). Both engines call it on the model as
        built (ZeRO-3: partitioned; FSDP ranks > 0: on the meta device), outside any zero.Init and before
        wrapping or sharding: the swapped layers take over the existing Parameter objects. Returns the
        model itself when nothing is prepared. --freeze's parts lose requires_grad first, so the engine gives the
        optimizer none of them."""
        self._freeze(model)
        if self.lora is not None:
            from .lora import apply_lora

            model = apply_lora(model, self.lora)
        if self.qat is not None:
            from .quant import qat_prepare

            qat_prepare(model, self.qat.scheme, self.qat.group_size)
        chunk = self.loss_chunk(model)
        if self.tiled_mlp or chunk:
            from . import memory_reducers

            memory_reducers.apply(model, self.tiled_mlp, chunk, fused=self.fused_loss_on)
        self._configure_router(model)
        return model

    def _freeze(self, model: "nn.Module") -> None:
        """--freeze: the named image-text parts' parameters stop requiring grad (vision_roles.freeze); a text-only
        model refuses it (UserError, one line naming the setting)."""
        if not self.freeze:
            return
        from ..tasks import image_text
        from .vision_roles import freeze

        config = getattr(model, "config", None)
        if config is None or not image_text(config):
            from ..errors import UserError

            raise UserError(f"model.freeze={','.join(self.freeze)}: {type(model).__name__} is a text-only model (no "
                            "vision_config), it has no vision, projector or language parts; drop --freeze")
        freeze(model, self.freeze)

    def sized_loss_chunk(self, vocab_size: int, mixture_of_experts: bool = False) -> int:
        """loss_chunk as the estimate sizes it, from the model's facts: the vocabulary, and whether it is a mixture
        of experts (a default chunking, the task's or the fused loss's, leaves its logits whole, as loss_chunk does:
        memory_reducers.default_chunk_problem). A model whose head cannot carry the fused loss for another reason
        runs without it: sized as if it did."""
        if self.chunked_loss is not None and (self.chunked_loss or not self.fused_loss_on):
            return self.chunked_loss
        if mixture_of_experts:
            return 0
        from .fused_loss import auto_chunk_tokens  # the task's default (None) or the fused loss's own chunk

        return auto_chunk_tokens(vocab_size)

    def loss_chunk(self, model: "nn.Module") -> int:
        """Tokens per head + loss chunk on this (built) model: --chunked-loss's, else the fused loss's own
        (fused_loss.auto_chunk_tokens) where it is on and the model carries it, else 0 (the model's own loss).
        fused_loss True on a model that cannot carry it is refused (UserError, one line). chunked_loss None (a task
        that chunks by default): the vocabulary's auto chunk, 0 where memory_reducers.default_chunk_problem says
        the model cannot run it (logits transformed, a mixture of experts' router loss)."""
        if self.chunked_loss is None:
            from .memory_reducers import default_chunk_problem

            head = None if default_chunk_problem(model) else model.get_output_embeddings()
            return self.sized_loss_chunk(head.out_features) if head is not None else 0
        if self.chunked_loss or not self.fused_loss_on:
            return self.chunked_loss
        from .memory_reducers import fused_loss_problem

        problem = fused_loss_problem(model)
        if problem and self.fused_loss:
            from ..errors import UserError

            raise UserError(f"model.fused_loss: {problem}; drop --fused-loss")
        return 0 if problem else self.sized_loss_chunk(model.get_output_embeddings().out_features)

    def _configure_router(self, model: "nn.Module") -> None:
        """A mixture of experts' router loss and frozen gates (router.configure); dense models untouched."""
        from . import router

        if router.moe_blocks(model):
            router.configure(model, self.router_aux_coef, self.freeze_router)

    def for_sizing(self, model: "nn.Module") -> "nn.Module":
        """The model whose facts size the run (model_info.run_facts), from the built one on the meta device:
        LoRA applied (adapters trainable, base frozen), QAT only checked (its fake-quantized Linears keep
        the same parameters), so a model torchao cannot quantize is refused before launch. --freeze's parts are
        frozen as apply freezes them (a text-only model refused)."""
        self._freeze(model)
        if self.lora is not None:
            from .lora import apply_lora

            model = apply_lora(model, self.lora)
        if self.qat is not None:
            self._check_qat(model)
        chunk = self.loss_chunk(model)
        if self.tiled_mlp or chunk:
            from . import memory_reducers

            memory_reducers.check(model, self.tiled_mlp, chunk)
        self._configure_router(model)
        return model

    def _loss_banner(self, model: "nn.Module") -> list[str]:
        """The banner's line about how the causal-LM loss is computed (none when it is the model's own by choice)."""
        from .memory_reducers import fused_head, installed_chunk

        head, chunk = fused_head(model), installed_chunk(model)
        if head is not None and getattr(head, "_zt_fused", False):
            from .fused_loss import kernel_name

            return [f"fused loss: head + cross-entropy over chunks of {chunk} tokens, gradients made in the forward "
                    f"({kernel_name(head.weight.device)}; no whole [tokens, vocab] logits; --no-fused-loss: off)"]
        if chunk:
            auto = "; the task's default, --chunked-loss 0: off" if self.chunked_loss is None else ""
            return [f"chunked loss: head + loss over chunks of {chunk} tokens, recomputed in backward "
                    f"(no whole [seq, vocab] logits{auto})"]
        if self.chunked_loss is None:  # the task's default chunking, which this model cannot carry
            from .memory_reducers import default_chunk_problem

            return [f"chunked loss: off ({default_chunk_problem(model)}): the whole [seq, vocab] logits"]
        if self.fused_loss is None:
            from .memory_reducers import fused_loss_problem

            problem = fused_loss_problem(model)
            if problem:
                return [f"fused loss: off ({problem})"]
        return []

    def _check_qat(self, model: "nn.Module") -> None:
        from .quant import check_model

        check_model(model, self.qat.scheme, self.qat.group_size, "--qat")

    # --- what the run records and says -------------------------------------------------------
    def lora_record(self, base: Optional[str]) -> Optional[dict[str, Any]]:
        """What a checkpoint records about the adapter trained on base weights `base` (path or hub id):
        lora.identity_of; None without LoRA (the base is not looked at)."""
        if self.lora is None:
            return None
        from .lora import identity_of

        return identity_of(base, self.lora)

    def qat_record(self) -> Optional[dict[str, Any]]:
        """What a checkpoint records about QAT ({"scheme", "group_size"}); None without QAT."""
        return self.qat.record() if self.qat is not None else None

    def banner(self, model: "nn.Module") -> list[str]:
        """The start banner's lines about the prepared model (the engine's, after apply)."""
        lines = []
        if self.freeze:
            from .vision_roles import describe_frozen

            lines.append(describe_frozen(model, self.freeze))
        if self.lora is not None:  # e.g. "LoRA r=8: 12,288 trainable of 1,234,567 parameters (1.00%)"
            from .lora import describe

            lines.append(describe(model))
        if self.qat is not None:
            from .quant import SCHEMES, fake_quantized_layers

            q = self.qat
            group = f", group size {q.group_size}" if SCHEMES[q.scheme].grouped else ""
            lines.append(f"QAT {q.scheme}{group}: {fake_quantized_layers(model)} fake-quantized Linear "
                         f"layers (torchao); final/quantized-{q.scheme}/ gets the converted model")
        if self.tiled_mlp:
            from .memory_reducers import mlp_modules

            lines.append(f"tiled MLP: {len(mlp_modules(model))} MLPs run over tiles of {self.tiled_mlp} tokens, "
                         "recomputed in backward")
        lines += self._loss_banner(model)
        if self.compile is not None:
            from .lora import unwrapped

            lines.append(self.compile.describe(getattr(unwrapped(model), "_zt_compiled_blocks", 0)))
        from .router import moe_blocks, trained_coef

        if moe_blocks(model):
            coef = trained_coef(model)
            aux = (f"router load-balancing loss x {coef} (per rank and micro-batch)" if coef is not None
                   else "no router load-balancing loss")
            lines.append(f"mixture of experts: {aux}" + ("; routers frozen" if self.freeze_router else ""))
        return lines

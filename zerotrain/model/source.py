"""HF model and tokenizer: resolve and validate what to train (before any process group), then a factory.

`resolve_model` runs on every rank before `torch.distributed` starts: it reads only the config and the
tokenizer (no weights), so every rank fails the same way, at once, on a bad `--model`. The returned
`ModelSource.factory(...)` is what the engine calls to build the model, so a ZeRO-3 engine can call it
under `zero.Init` / `HfDeepSpeedConfig` on every rank together.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..config.schema import RunConfig
from ..tasks import TaskSpec, task_for_model, task_spec
from ..errors import UserError, first_line
from ..util import hub_offline
from .facts import ModelFacts, max_positions, meta_model, run_facts  # noqa: F401


def _looks_local(name: str) -> bool:
    """A path rather than a hub id: absolute, relative with ./ or ../, ~, or something that exists."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name)
            or name.count("/") > 1 or os.sep != "/" and os.sep in name)


def _load_error(flag: str, name: str, e: BaseException) -> UserError:
    hint = ("the hub is offline (HF_HUB_OFFLINE=1) and it is not in the local cache; "
            "pass a local model directory or download it first") if hub_offline() else first_line(e)
    return UserError(f"{flag} {name}: cannot load ({hint})")


def check_local_dir(flag: str, name: str) -> Path:
    """A local model directory that exists, is readable and holds a config.json."""
    p = Path(name).expanduser()
    if not p.exists():
        raise UserError(f"{flag} {name}: no such directory; pass a local model directory or a hub id")
    if not p.is_dir():
        raise UserError(f"{flag} {name}: not a directory; pass a directory written by save_pretrained")
    if not os.access(p, os.R_OK | os.X_OK):
        raise UserError(f"{flag} {name}: directory is not readable (permissions)")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise UserError(f"{flag} {name}: no config.json in it; pass a directory written by save_pretrained")
    if not os.access(cfg, os.R_OK):
        raise UserError(f"{flag} {name}: config.json is not readable (permissions)")
    return p


@dataclass
class ModelSource:
    """What to train, resolved and validated; no weights loaded yet."""

    task: TaskSpec
    """The task trained, resolved once here on the model: --task's entry, or the one it becomes on this model
    (tasks.task_for_model: causal-lm on an image-text model trains image-text); the run's plan holds it from here on
    (RunPlan.task)."""
    weights: Optional[str]
    """Directory or hub id to load weights from; None trains from scratch (hf_config)."""
    hf_config: Any
    """The transformers PretrainedConfig (from weights' config.json or --model-config)."""
    tokenizer: Any
    """The transformers tokenizer, with a pad token."""
    embedded: bool = False
    """True for the locally built demo model (no --model, no --model-config)."""
    description: str = ""
    """One line naming the model for logs and checkpoint metadata."""
    gradient_checkpointing: bool = False
    attn_implementation: Optional[str] = None
    """transformers' attn_implementation to build the model with; None keeps transformers' default."""
    processor: Any = None
    """An image-text model's processor (AutoProcessor: image processor, tokenizer, chat template); None otherwise."""

    @property
    def preprocessor(self) -> Any:
        """What checkpoints, final/ and export save beside the weights: the processor where there is one (its
        tokenizer, image processor and chat template), else the tokenizer."""
        return self.processor if self.processor is not None else self.tokenizer

    def config_kwargs(self, num_labels: Optional[int] = None,
                      id2label: Optional[dict[int, str]] = None) -> dict[str, Any]:
        """Config overrides for the task head (seq-cls, reward: label count and names)."""
        kwargs: dict[str, Any] = {}
        if self.task.classifier:  # seq-cls, and reward models' one-label head
            kwargs.update(num_labels=num_labels)
            if id2label:
                kwargs.update(id2label={int(k): v for k, v in id2label.items()},
                              label2id={v: int(k) for k, v in id2label.items()})
        return kwargs

    def factory(self, num_labels: Optional[int] = None, id2label: Optional[dict[int, str]] = None,
                seed: int = 0) -> "ModelBuilder":
        """A no-argument builder for the engine (called on every rank; under zero.Init for ZeRO-3)."""
        pad = None
        if self.task.classifier:  # the head reads the last token before the padding
            pad = self.tokenizer.pad_token_id if self.tokenizer is not None else self.hf_config.pad_token_id
        return ModelBuilder(self, self.config_kwargs(num_labels, id2label), seed, pad)


@dataclass
class ModelBuilder:
    """Builds the model to train: `builder()` with its weights, `builder.empty()` on the meta device.

    Weights load in float32 whatever dtype the checkpoint was saved in (transformers 5 would keep a
    bf16 checkpoint in bf16): they are the optimizer's master weights; the engines cast the compute
    to bf16/fp16. `empty()` reads no weights and allocates nothing: the FSDP engine builds ranks > 0
    that way and fills their shards from rank 0.
    """

    source: ModelSource
    kwargs: dict[str, Any]
    """Config overrides for the task head (ModelSource.config_kwargs)."""
    seed: int = 0
    head_pad_id: Optional[int] = None
    """A classifier's pad id, set on the config AFTER the model is built: given at construction it would become
    the embedding's padding_idx, whose row then never trains, and with pad = eos that is the EOS a reward model's
    sequences end with (TRL's RewardTrainer sets it after construction too; its gradients are the reference)."""

    def _auto(self):
        return self.source.task.model_class

    def _config(self):
        from transformers import AutoConfig

        if self.source.weights is None:
            cfg = self.source.hf_config
            for k, v in self.kwargs.items():
                setattr(cfg, k, v)
            return cfg
        return AutoConfig.from_pretrained(self.source.weights, **self.kwargs)

    def _finish(self, model):
        if self.head_pad_id is not None:
            model.config.pad_token_id = self.head_pad_id
            model.config.get_text_config().pad_token_id = self.head_pad_id
        if self.source.task.causal_lm and getattr(model, "loss_type", "") is None:
            # a class whose name matches no loss (GPT2LMHeadModel): transformers logs "loss_type=None ...
            # unrecognized" at the first step and uses ForCausalLM; name it, so the same loss runs silently
            model.loss_type = "ForCausalLM"
        if self.source.gradient_checkpointing:
            model.config.use_cache = False
            # transformers 5 renamed it (the old name warns and goes in v6)
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        return model

    def __call__(self):
        import torch

        torch.manual_seed(self.seed)  # fresh heads / from-scratch weights are the same on every rank
        if self.source.weights is None:
            return self._finish(self._auto().from_config(self._config(), dtype=torch.float32, **self._attention()))
        return self._finish(self._auto().from_pretrained(self.source.weights, dtype=torch.float32, **self._attention(),
                                                         **self.kwargs))

    def _attention(self) -> dict[str, str]:
        impl = self.source.attn_implementation
        return {"attn_implementation": impl} if impl else {}

    def empty(self):
        """The same architecture (same parameter names, shapes, dtypes, ties) on the meta device."""
        import torch

        return self._finish(meta_model(self._config(), self.source.task, dtype=torch.float32, **self._attention()))


def _load_tokenizer(flag: str, name: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError, TypeError) as e:
        raise _load_error(flag, name, e) from None
    if tok.pad_token is None:
        # GPT-2 style tokenizers have no pad token; padding is masked out anyway.
        if tok.eos_token is None:
            raise UserError(f"{flag} {name}: the tokenizer has neither a pad nor an eos token; add a pad token to it")
        tok.pad_token = tok.eos_token
    return tok


def _load_processor(flag: str, name: str):
    """An image-text model's processor (AutoProcessor); one line when the model has none. transformers falls back
    to the bare tokenizer when it cannot build a processor (no processor files, or a sub-processor's dependency
    missing, e.g. torchvision for Qwen2-VL's video processor): that is refused too."""
    from transformers import AutoProcessor

    fix = ("save its processor into the directory (processor.save_pretrained), and install what the processor "
           "class needs (e.g. torchvision for Qwen2-VL)")
    try:
        proc = AutoProcessor.from_pretrained(name)
    except (OSError, ValueError, TypeError, ImportError) as e:
        if not Path(name).is_dir():
            raise _load_error(flag, name, e) from None
        raise UserError(f"{flag} {name}: an image-text model without a processor (AutoProcessor: "
                        f"{first_line(e)}); {fix}") from None
    if getattr(proc, "image_processor", None) is None or getattr(proc, "tokenizer", None) is None:
        raise UserError(f"{flag} {name}: an image-text model without a processor (AutoProcessor gave a "
                        f"{type(proc).__name__}); {fix}")
    if proc.tokenizer.pad_token is None:
        if proc.tokenizer.eos_token is None:
            raise UserError(f"{flag} {name}: the tokenizer has neither a pad nor an eos token; add a pad token to it")
        proc.tokenizer.pad_token = proc.tokenizer.eos_token
    return proc


def resolve_model(cfg: RunConfig) -> ModelSource:
    """Validate --model / --model-config / --seq-len and load config + tokenizer (no weights).

    Raises UserError with one line on any problem. Runs before the process group exists.
    """
    from ..assets.demo import TINY_PRESETS
    from .facts import load_hf_config

    m = cfg.model
    embedded = m.name is None
    if embedded:
        from ..assets.demo import DEMO_PRESET, ensure_tiny_model

        name = str(ensure_tiny_model())
        desc = f"embedded {DEMO_PRESET} (built locally, {name})"
    else:
        name = m.name
        if _looks_local(name):
            name = str(check_local_dir("--model", name).resolve())  # LoRA adapters record their base by it
        desc = name

    if m.from_config:
        src = m.from_config
        if src not in TINY_PRESETS and not Path(src).is_file():
            raise UserError(f"--model-config {src}: neither a config.json file nor a preset "
                            f"({', '.join(TINY_PRESETS)})")
        hf_config = load_hf_config(src)
        weights = None
        desc = f"{src} from scratch, tokenizer {desc}"
    else:
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(name)
        except (OSError, ValueError, KeyError) as e:
            raise _load_error("--model", name, e) from None
        weights = name

    spec = task_for_model(m.task, hf_config)  # causal-lm on an image-text model: image-text
    if spec.implied_by is not None:  # the entry it became refuses its own features (packing, streaming, QAT ...)
        from ..config.rules import check_config

        check_config(cfg, spec)
    processor = _load_processor("--model", name) if spec.reads_images else None
    tokenizer = processor.tokenizer if processor is not None else _load_tokenizer("--model", name)
    if m.from_config:
        # A preset's vocabulary follows the tokenizer; a user config.json must already cover it.
        if m.from_config in TINY_PRESETS:
            hf_config.vocab_size = -(-len(tokenizer) // 64) * 64
        elif getattr(hf_config, "vocab_size", None) and len(tokenizer) > hf_config.vocab_size:
            raise UserError(f"--model-config {m.from_config}: vocab_size {hf_config.vocab_size} is smaller than the "
                            f"tokenizer's {len(tokenizer)} tokens; raise vocab_size or pick another tokenizer (--model)")
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tid = getattr(tokenizer, key, None)
            if tid is not None:
                setattr(hf_config, key, tid)

    check_head(spec, weights, hf_config)
    if spec.implied_by is not None:  # the banner says which entry the asked task became
        desc += (f"; --task {spec.implied_by} on an image-text model ({type(hf_config).__name__}): task {spec.name} "
                 f"({spec.auto_class}, {type(processor).__name__})")
    limit = max_positions(hf_config)
    if limit is not None and cfg.data.seq_len > limit:
        raise UserError(f"--seq-len {cfg.data.seq_len} is above the model's maximum of {limit} positions; "
                        f"use --seq-len {limit} or less")
    return ModelSource(task=spec, weights=weights, hf_config=hf_config, tokenizer=tokenizer, embedded=embedded,
                       description=desc, gradient_checkpointing=m.gradient_checkpointing,
                       attn_implementation=None if m.attn_implementation == "auto" else m.attn_implementation,
                       processor=processor)


def check_head(task: TaskSpec, weights: Optional[str], hf_config: Any) -> None:
    """A head of fixed size (a reward model's one score) takes a causal LM (a fresh head, seeded) or a classifier of
    that size as it is; a classifier with another number of labels is refused (its head cannot be reused)."""
    want = task.head_labels
    classifier = any(a.endswith("ForSequenceClassification") for a in getattr(hf_config, "architectures", None) or [])
    if want is None or weights is None or not classifier or hf_config.num_labels == want:
        return
    raise UserError(f"--model {weights}: a sequence classifier with {hf_config.num_labels} labels; --task {task.name} "
                    f"trains a head of {want} (a reward score): pass its base causal LM (the head starts fresh) or a "
                    f"{want}-label classifier")


def _sizing_only(name: Optional[str]) -> bool:
    """A tiny preset or a config.json file: what `estimate`/`config`/`tune` accept as --model to size an
    architecture (train refuses them: there are no weights or tokenizer to train with)."""
    from ..assets.demo import TINY_PRESETS

    return name is not None and (name in TINY_PRESETS or Path(name).is_file())


def data_labels(cfg: RunConfig, task: Optional[TaskSpec] = None) -> tuple[Optional[int], Optional[dict[int, str]]]:
    """(num_labels, id2label) of the seq-cls head `train` builds: from the label column of --data (the
    packaged sentiment set without it), at least --num-labels; (None, None) for causal LMs."""
    spec = task or task_spec(cfg.model.task)
    if spec.head_labels is not None:  # a head of fixed size (a reward model's one score)
        return spec.head_labels, None
    if not spec.classifier:  # a head of fixed size returned above: seq-cls, whose classes are the label column's
        return None, None
    from ..assets.demo import SENTIMENT
    from ..data.datasets import label_names, load_raw

    d = cfg.data
    raw = load_raw(d.path or str(SENTIMENT), "--data", d.data_config, d.split)
    return label_names(raw, d.label_column, cfg.model.num_labels)


def meta_train_model(cfg: RunConfig, source: Optional[ModelSource] = None,
                     labels: Optional[tuple[Optional[int], Optional[dict[int, str]]]] = None):
    """The model `zerotrain train` builds for cfg, on the meta device (no weights, no memory), before LoRA
    and QAT: the same source (--model weights, --model-config from scratch with --model's tokenizer, or the
    embedded demo) and the same head (labels: preflight's from the prepared data, else data_labels).
    A preset or config.json given as --model (the sizing commands' shorthand) is built as written."""
    if source is None:
        if cfg.model.from_config is None and _sizing_only(cfg.model.name):
            from .facts import load_hf_config

            hf_config = load_hf_config(cfg.model.name)
            source = ModelSource(task=task_for_model(cfg.model.task, hf_config), weights=None,
                                 hf_config=hf_config, tokenizer=None, description=cfg.model.name or "")
        else:
            source = resolve_model(cfg)
    num_labels, id2label = labels if labels is not None else data_labels(cfg, source.task)
    return source.factory(num_labels, id2label, seed=cfg.run.seed).empty()


def model_facts_for(cfg: RunConfig, source: Optional[ModelSource] = None,
                    labels: Optional[tuple[Optional[int], Optional[dict[int, str]]]] = None) -> ModelFacts:
    """The facts of the model a run trains: meta_train_model with LoRA / QAT applied (model_info.run_facts).
    train's preflight, estimate, config, compare, tune and `tune --replay` all ask this one function, so
    they size the model train runs."""
    meta = meta_train_model(cfg, source, labels)
    return run_facts(meta, meta.config, cfg)

"""Every validity rule of a run, in one place; each failure is one line naming the setting and the fix.

Config-only rules (`check_config`) run when a RunConfig is built (zerotrain/config.py); the rules that
need the backend and the device (`check_backend`) run when the run plan is resolved
(zerotrain/plan.py). `zerotrain estimate`/`compare` ask `offload_problem` which stage/offload
combinations exist, so they list exactly what `train` accepts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from .errors import ConfigError

if TYPE_CHECKING:  # the config module imports this one at run time
    from .config import RunConfig
    from .model_info import ModelFacts

AUTO = "auto"
"""HF Trainer / Accelerate fill a DeepSpeed value marked "auto" from their own arguments."""


def offload_problem(stage: int, offload_optimizer: str, offload_param: str) -> Optional[str]:
    """Why this stage cannot run with these offloads (one line with the fix), or None if it can."""
    if offload_param != "none" and stage != 3:
        return (f"zero.offload_param={offload_param} needs ZeRO stage 3 (got stage {stage}); "
                "use --stage 3 or --offload-param none")
    if offload_optimizer != "none" and stage == 0:
        return (f"zero.offload_optimizer={offload_optimizer} needs ZeRO stage 1, 2 or 3 (got stage 0); "
                "use --stage 2 or --offload-optimizer none")
    return None


def check_config(cfg: RunConfig) -> None:
    """Cross-field rules of the config alone (no backend or device needed)."""
    z, b, o = cfg.zero, cfg.batch, cfg.optimizer
    problem = offload_problem(z.stage, z.offload_optimizer, z.offload_param)
    if problem:
        raise ConfigError(problem)
    if "nvme" in (z.offload_optimizer, z.offload_param) and not z.nvme_path:
        raise ConfigError("NVMe offload needs zero.nvme_path; pass --nvme-path /local/nvme/dir or use cpu offload")
    if z.offload_optimizer != "none" and o.name == "sgd":
        raise ConfigError("optimizer.name=sgd cannot be offloaded (DeepSpeed has CPU Adam only); "
                          "use --optimizer adamw or --offload-optimizer none")
    if b.micro_batch < 1:
        raise ConfigError(f"batch.micro_batch must be >= 1 (got {b.micro_batch}); pass --micro-batch 1 or more")
    if b.grad_accum < 1:
        raise ConfigError(f"batch.grad_accum must be >= 1 (got {b.grad_accum}); pass --grad-accum 1 or more")
    if b.global_batch is not None and b.global_batch < 1:
        raise ConfigError(f"batch.global_batch must be >= 1 (got {b.global_batch})")
    if o.lr < 0:
        raise ConfigError(f"optimizer.lr must be >= 0 (got {o.lr}); pass e.g. --lr 5e-5")
    check_lora(cfg)
    check_qat(cfg)
    check_data_format(cfg)
    report_targets(cfg.run.report_to)
    check_overrides(cfg)


TRACKERS = ("tensorboard", "mlflow", "wandb")
"""What --report-to accepts besides none (zerotrain/trackers.py)."""


def report_targets(report_to: str) -> list[str]:
    """The trackers named by --report-to (comma list; 'none' alone means none)."""
    names = [n.strip().lower() for n in report_to.split(",") if n.strip()]
    bad = [n for n in names if n not in (*TRACKERS, "none")]
    if bad:
        raise ConfigError(f"run.report_to: unknown tracker {bad[0]!r}; pass a comma list of none, {', '.join(TRACKERS)}")
    return [n for n in names if n != "none"]


def check_lora(cfg: RunConfig) -> None:
    """LoRA needs pretrained weights and no model parallelism; --merge-lora needs LoRA."""
    lo, par = cfg.lora, cfg.parallel
    if lo.merge and lo.r == 0:
        raise ConfigError("--merge-lora needs LoRA; pass --lora-r 8 (or another rank), or drop --merge-lora")
    if lo.r == 0:
        return
    if cfg.model.from_config:
        raise ConfigError(f"--lora-r {lo.r}: LoRA adapts pretrained weights, but --model-config {cfg.model.from_config} "
                          "trains from scratch; pass --model DIR (a save_pretrained directory or hub id)")
    if par.tp > 1 or par.pp > 1:
        raise ConfigError(f"--lora-r {lo.r} with --tp {par.tp} --pp {par.pp}: LoRA runs with data parallelism "
                          "(ZeRO 0-3 / FSDP) only; pass --tp 1 --pp 1, or --lora-r 0")
    if not [t for t in lo.targets.split(",") if t.strip()]:
        raise ConfigError("--lora-targets is empty; pass all-linear or a comma list of module names (q_proj,v_proj)")


def check_qat(cfg: RunConfig) -> None:
    """QAT fake-quantizes the full model's Linears with data parallelism (ZeRO 0-3 / FSDP), causal LMs only."""
    qat, par = cfg.quant.qat, cfg.parallel
    if qat == "none":
        return
    if cfg.lora.r > 0:
        raise ConfigError(f"--qat {qat} with --lora-r {cfg.lora.r}: QAT trains the full weights it fake-quantizes; "
                          "drop --lora-r, or --qat none and quantize the merged model with zerotrain export --quantize")
    if par.tp > 1 or par.pp > 1:
        raise ConfigError(f"--qat {qat} with --tp {par.tp} --pp {par.pp}: QAT runs with data parallelism (ZeRO 0-3 / "
                          "FSDP) only; pass --tp 1 --pp 1")
    if cfg.model.task != "causal-lm":
        raise ConfigError(f"--qat {qat}: quantized export is for causal LMs; pass --task causal-lm or --qat none")


def check_data_format(cfg: RunConfig) -> None:
    """Chat/prompt-completion data and document-separated packing are causal-LM data parallel only."""
    d = cfg.data
    if cfg.model.task == "seq-cls" and (d.format not in ("auto", "text") or d.packing != "off"):
        what = f"--data-format {d.format}" if d.format not in ("auto", "text") else "--packing"
        raise ConfigError(f"{what} is for causal-lm; seq-cls reads text_column and label_column "
                          "(drop it, or pass --task causal-lm)")
    if d.packing != "off" and cfg.parallel.pp > 1:
        raise ConfigError(f"--packing {d.packing} with --pp {cfg.parallel.pp}: the pipeline stages do not pass "
                          "per-document position ids; pass --pp 1 or --packing off")


def check_backend(cfg: RunConfig, backend: str, device_type: str,
                  native_cpu_bf16: Optional[bool] = None) -> list[str]:
    """Rules that need the backend ('deepspeed'/'fsdp') and the device ('cuda'/'cpu').

    Raises ConfigError for what cannot run; returns one-line warnings for what runs badly.
    native_cpu_bf16: whether this CPU has oneDNN bf16 kernels (None = ask torch).
    """
    if cfg.precision.dtype == "fp16" and device_type == "cpu":
        raise ConfigError("precision.dtype=fp16 is not supported on CPU; use --precision bf16 or fp32")
    z = cfg.zero
    if backend == "fsdp":
        if cfg.precision.dtype == "fp16":
            raise ConfigError("precision.dtype=fp16 is not supported by the FSDP backend (no loss scaling); "
                              "use --precision bf16 or --backend deepspeed")
        if "nvme" in (z.offload_optimizer, z.offload_param):
            raise ConfigError("zero.offload_optimizer/offload_param=nvme is DeepSpeed-only; the FSDP backend has no "
                              "NVMe offload: use --offload-optimizer cpu / --offload-param cpu or --backend deepspeed")
    warn: list[str] = []
    if cfg.precision.dtype == "bf16" and device_type == "cpu":
        if native_cpu_bf16 is None:
            import torch

            native_cpu_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if not native_cpu_bf16:
            # Without AVX-512, torch falls back to a scalar bf16 matmul: 266 ms vs 5.4 ms in fp32 for
            # 512x256 @ 256x1024 on an AVX2-only EPYC (benchmarks/results/bf16_matmul.json).
            warn.append("precision.dtype=bf16 on a CPU without AVX-512 bf16 kernels: matrix multiplies run "
                        "~50x slower than fp32 here; use --precision fp32 on this machine")
    return warn


STAGES_WITH = {("deepspeed", "tp"): (0, 1, 2), ("deepspeed", "pp"): (0, 1), ("fsdp", "tp"): (1, 2, 3),
               ("fsdp", "pp"): (1, 2, 3)}
"""ZeRO stages each backend runs with tensor (tp) or pipeline (pp) parallelism: DeepSpeed's AutoTP
training supports ZeRO 0-2 and its pipeline engine asserts stage < 2; under FSDP stage 0 is DDP,
which cannot hold split layers or stages."""

_WHY = {("deepspeed", "tp"): "DeepSpeed's AutoTP training supports ZeRO 0-2",
        ("deepspeed", "pp"): "DeepSpeed's pipeline engine supports ZeRO 0-1",
        ("fsdp", "tp"): "stage 0 is DDP under FSDP, which cannot hold split layers",
        ("fsdp", "pp"): "stage 0 is DDP under FSDP, which does not compose with pipeline stages"}


def resolve_stage(cfg: RunConfig, backend: str) -> tuple[int, str]:
    """(ZeRO stage the run uses, why it differs from zero.stage or ""): a stage the user did not set is
    moved to the highest one the parallel layout supports; an explicit unsupported one is refused."""
    stage, explicit = cfg.zero.stage, "stage" in cfg.zero.model_fields_set
    for kind in ("tp", "pp"):
        degree = getattr(cfg.parallel, kind)
        allowed = STAGES_WITH[(backend, kind)]
        if degree == 1 or stage in allowed:
            continue
        if explicit:
            fix = " or ".join(f"--stage {s}" for s in allowed[-2:])
            raise ConfigError(f"--{kind} {degree} with --stage {stage} on the {backend} backend: {_WHY[(backend, kind)]}; "
                              f"pass {fix}" + (" or --backend fsdp" if backend == "deepspeed" else ""))
        stage = max(s for s in allowed if s <= stage) if any(s <= stage for s in allowed) else allowed[0]
        return stage, (f"zero.stage {cfg.zero.stage} (the default) resolved to {stage}: --{kind} {degree}, "
                       f"{_WHY[(backend, kind)]}")
    return stage, ""


PARALLEL_COMBINATIONS: dict[frozenset[str], dict[str, str]] = {
    frozenset(): {"deepspeed": "ZeRO 0-3", "fsdp": "FSDP2 stages 0-3 (0 = DDP)"},
    frozenset({"tp"}): {"deepspeed": "AutoTP training, ZeRO 0-2", "fsdp": "DTensor tp_plan x FSDP2 over dp"},
    frozenset({"pp"}): {"deepspeed": "PipelineModule, ZeRO 0-1", "fsdp": "torch.distributed.pipelining x FSDP2"},
}
"""Which model-parallel mesh dimensions (plan.MESH_DIMS besides dp) each backend runs together, and how.
Data parallelism composes with every row. A set not listed (tp with pp today; sequence and expert
parallelism until they are built) is refused by check_parallel in one line naming what is supported."""


def check_combination(dims: frozenset[str], backend: str) -> None:
    """Refuse a set of model-parallel dimensions the backend does not run together (PARALLEL_COMBINATIONS)."""
    if backend in PARALLEL_COMBINATIONS.get(dims, {}):
        return
    asked = " with ".join(f"--{d}" for d in sorted(dims))
    ok = ", ".join(" + ".join(sorted(k)) for k in PARALLEL_COMBINATIONS if k and backend in PARALLEL_COMBINATIONS[k])
    if len(dims) > 1:
        raise ConfigError(f"{asked}: {' and '.join(sorted(dims))} together are not supported yet on the {backend} "
                          f"backend (it runs {ok}, each with data parallelism); pick one of them")
    raise ConfigError(f"{asked}: not supported on the {backend} backend (it runs {ok}, each with data parallelism)")


def check_parallel(cfg: RunConfig, backend: str, world_size: int, facts: Optional[ModelFacts]) -> None:
    """What parallel.tp / parallel.pp > 1 need: a world they divide, one of them at a time, a model the
    backend can split (heads and widths divisible by tp; a decoder family with enough blocks for pp)."""
    from .pipeline_parts import pipeline_problem

    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    if tp == 1 and pp == 1:
        return
    if tp > 1 and pp > 1:  # kept word for word: users and tests match this line
        raise ConfigError(f"--tp {tp} with --pp {pp}: tensor and pipeline parallelism together are not supported yet; "
                          "pick one of them (--tp 1 or --pp 1)")
    check_combination(frozenset(d for d, n in (("tp", tp), ("pp", pp)) if n > 1), backend)
    degree, kind = (tp, "tp") if tp > 1 else (pp, "pp")
    if world_size % degree:
        raise ConfigError(f"--{kind} {degree} does not divide the world of {world_size} ranks; "
                          f"pick a {kind} that divides it")
    if pp > 1 and cfg.model.task == "causal-lm" and not cfg.data.pack:
        raise ConfigError(f"--pp {pp} runs packed causal-lm batches (no padding: the stages pass no attention "
                          "mask); set data.pack: true")
    if facts is None:
        return  # checked again when the model is known (the engine builds the plan with it)
    if pp > 1:
        problem = pipeline_problem(facts.model_type, cfg.model.task, facts.num_layers, pp, facts.attention_types)
        if problem:
            raise ConfigError(problem)
        return
    if backend == "fsdp":
        styles = {style for _, style in facts.block_tp_plan}
        if not facts.block_tp_plan or styles - {"colwise", "rowwise"}:
            why = "has no tensor-parallel plan" if not facts.block_tp_plan else f"uses plan styles {sorted(styles)}"
            raise ConfigError(f"--tp {tp}: model type '{facts.model_type or '?'}' {why}; tensor parallelism on FSDP "
                              "runs on models whose HF config has a colwise/rowwise base_model_tp_plan (e.g. Llama, "
                              "Qwen2): pass --tp 1")
    elif facts.model_type in AUTOTP_REFUSED:
        raise ConfigError(f"--tp {tp}: DeepSpeed AutoTP cannot split model type '{facts.model_type}' "
                          f"({AUTOTP_REFUSED[facts.model_type]}); AutoTP splits Llama-style models (Llama, Qwen2, "
                          "Mistral): pass --tp 1")
    for what, n in (("attention heads", facts.num_heads), ("key/value heads", facts.num_kv_heads),
                    ("hidden size", facts.hidden_size), ("MLP width", facts.intermediate_size),
                    ("vocabulary", facts.vocab_size)):
        if n % tp:
            raise ConfigError(f"--tp {tp} does not divide the model's {n} {what}; pick a tp that divides it")


AUTOTP_REFUSED = {"gpt2": "its fused-QKV Conv1D attention has only a kernel-injection policy, no training split",
                  "bert": "an encoder; AutoTP training covers decoder LMs",
                  "roberta": "an encoder; AutoTP training covers decoder LMs"}
"""Model types DeepSpeed's AutoTP training refuses or mis-splits (probed: GPT-2 fails in its
fused-QKV policy), with why."""


def resolve_batch(cfg: RunConfig, dp_size: int) -> tuple[int, int, int]:
    """(micro_batch, grad_accum, global_batch) for a data-parallel size; refuses a global batch it
    does not divide."""
    b = cfg.batch
    if dp_size < 1:
        raise ConfigError(f"world size must be >= 1 (got {dp_size})")
    if b.global_batch is None:
        return b.micro_batch, b.grad_accum, b.micro_batch * b.grad_accum * dp_size
    per_step = b.micro_batch * dp_size
    if b.global_batch % per_step:
        raise ConfigError(
            f"batch.global_batch={b.global_batch} is not divisible by micro_batch {b.micro_batch} x world size "
            f"{dp_size} = {per_step}; pick a global batch that is a multiple of {per_step} or change --micro-batch")
    return b.micro_batch, b.global_batch // per_step, b.global_batch


# ds_overrides keys that a typed field owns: overriding them would silently fight the field.
_OWNED = {
    "train_micro_batch_size_per_gpu": "batch.micro_batch", "gradient_accumulation_steps": "batch.grad_accum",
    "train_batch_size": "batch.global_batch", "gradient_clipping": "optimizer.clip",
    "zero_optimization.stage": "zero.stage", "zero_optimization.offload_optimizer": "zero.offload_optimizer",
    "zero_optimization.offload_param": "zero.offload_param", "bf16": "precision.dtype", "fp16": "precision.dtype",
    "optimizer": "optimizer.*", "scheduler": "schedule.*",
}


def _flatten(d: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in d.items():
        keys.append(prefix + k)
        if isinstance(v, dict):
            keys += _flatten(v, f"{prefix}{k}.")
    return keys


def check_overrides(cfg: RunConfig) -> None:
    """Refuse ds_overrides that conflict with a typed field or hold "auto"."""
    for key in _flatten(cfg.ds_overrides):
        if key in _OWNED:
            raise ConfigError(f"ds_overrides.{key} conflicts with the typed setting {_OWNED[key]}; "
                              f"set {_OWNED[key]} instead")

    def has_auto(v: Any) -> bool:
        return v == AUTO or (isinstance(v, dict) and any(has_auto(x) for x in v.values()))

    if has_auto(cfg.ds_overrides):
        raise ConfigError('ds_overrides holds "auto", which raw DeepSpeed silently ignores; give a concrete value')


# --- settings that mean nothing where they are set ------------------------------------------------

@dataclass(frozen=True)
class Unused:
    """Where a setting means nothing: set to a non-default value there, it is refused or warned by name."""

    fields: tuple[str, ...]
    """Dotted RunConfig paths, e.g. "zero.reduce_bucket_size"."""
    unused: Callable[["RunConfig", str, int, str], bool]
    """(cfg, backend, stage that runs, device) -> whether the fields mean nothing in this run."""
    why: str
    """Why they mean nothing there (the line names the field before it)."""
    fix: str
    """What to do instead."""
    sweep: bool = False
    """A value a sweep applies to every cell (compare/tune grid stages): warned, never refused."""


_DS_COMM = ("zero.reduce_bucket_size", "zero.allgather_bucket_size", "zero.prefetch_bucket_size",
            "zero.param_persistence_threshold", "zero.max_live_parameters", "zero.overlap_comm", "zero.leaf_blocks",
            "zero.reduce_scatter")
_LOSS_SCALING = ("precision.loss_scale", "precision.initial_scale_power", "precision.loss_scale_window",
                 "precision.hysteresis", "precision.min_loss_scale")

UNUSED: tuple[Unused, ...] = (
    Unused(_DS_COMM + ("ds_overrides",), lambda c, backend, s, d: backend == "fsdp",
           "is a DeepSpeed setting; the FSDP backend has none like it", "drop it, or pass --backend deepspeed"),
    Unused(("zero.reduce_bucket_size", "zero.overlap_comm"), lambda c, b, stage, d: b == "deepspeed" and stage == 0,
           "has no effect at ZeRO stage 0 (no gradient partitioning)", "use it with --stage 1, 2 or 3", sweep=True),
    Unused(("zero.allgather_bucket_size", "zero.reduce_scatter"), lambda c, b, stage, d: b == "deepspeed" and stage in (0, 3),
           "is read by DeepSpeed at ZeRO stages 1 and 2 only", "use it with --stage 1 or 2", sweep=True),
    Unused(("zero.prefetch_bucket_size", "zero.param_persistence_threshold", "zero.max_live_parameters",
            "zero.leaf_blocks"), lambda c, b, stage, d: b == "deepspeed" and stage != 3,
           "is read by DeepSpeed at ZeRO stage 3 only", "use it with --stage 3", sweep=True),
    Unused(("zero.offload_optimizer",), lambda c, backend, s, device: backend == "fsdp" and device != "cpu"
           and c.zero.offload_optimizer != "none" and c.zero.offload_param == "none",
           "alone is not a mode of FSDP2 (its CPUOffloadPolicy offloads parameters, gradients and optimizer "
           "states together)", "pass --offload-param cpu as well, or --backend deepspeed for optimizer-only offload"),
    Unused(("zero.nvme_path",), lambda c, b, s, d: "nvme" not in (c.zero.offload_optimizer, c.zero.offload_param),
           "is only read for NVMe offload", "drop it, or pass --offload-optimizer nvme / --offload-param nvme"),
    Unused(_LOSS_SCALING, lambda c, b, s, d: c.precision.dtype != "fp16",
           "is fp16 loss scaling; this run is not fp16", "drop it, or pass --precision fp16"),
    Unused(("optimizer.momentum",), lambda c, b, s, d: c.optimizer.name != "sgd",
           "is SGD's; this run's optimizer has none", "drop it, or pass --optimizer sgd"),
    Unused(("optimizer.betas", "optimizer.eps"), lambda c, b, s, d: c.optimizer.name == "sgd",
           "is Adam's; SGD has none", "drop it, or pass --optimizer adamw"),
    Unused(("schedule.min_lr_ratio",), lambda c, b, s, d: c.schedule.name == "constant",
           "is the end of a decay; a constant schedule has none", "drop it, or pass --schedule cosine or linear"),
    Unused(("lora.alpha", "lora.dropout", "lora.targets", "lora.merge"), lambda c, b, s, d: c.lora.r == 0,
           "shapes LoRA adapters; lora.r is 0 (full fine-tuning)", "drop it, or pass --lora-r 8 (or another rank)"),
    Unused(("quant.group_size",), lambda c, b, s, d: c.quant.qat == "none",
           "is a QAT setting; quant.qat is none", "drop it, or pass --qat int4-weight"),
    Unused(("model.num_labels", "data.label_column"), lambda c, b, s, d: c.model.task != "seq-cls",
           "is for sequence classification; model.task is causal-lm", "drop it, or pass --task seq-cls"),
)
"""Every setting that means nothing in some runs, and where; rules.unused_settings applies it and
tests/test_unused_settings.py checks it against the run's real outputs (DeepSpeed JSON, FSDP2
arguments, plan, banner), not against this table."""


def _value(cfg: "RunConfig", path: str) -> tuple[Any, Any, bool]:
    """(value, default, explicitly set) of a dotted RunConfig path."""
    *sections, name = path.split(".")
    owner: Any = cfg
    for s in sections:
        owner = getattr(owner, s)
    field_info = type(owner).model_fields[name]
    default = field_info.default_factory() if field_info.default_factory is not None else field_info.default
    return getattr(owner, name), default, name in owner.model_fields_set


def unused_settings(cfg: "RunConfig", backend: str, stage: int, device: str, backend_fallback: bool = False) -> list[str]:
    """Refuse (ConfigError, one line) a setting that means nothing in this run and was set; warn instead
    when backend auto fell back to FSDP (`backend_fallback`: the user did not choose the backend that
    ignores it) or a sweep applies the value to every cell (Unused.sweep). Returns the warnings."""
    fallback = "backend auto fell back to fsdp" if backend_fallback else ""
    warnings: list[str] = []
    for rule in UNUSED:
        if not rule.unused(cfg, backend, stage, device):
            continue
        for path in rule.fields:
            value, default, explicit = _value(cfg, path)
            if value == default:
                continue
            shown = json.dumps(value) if isinstance(value, dict) else value
            line = f"{path}={shown} {rule.why}"
            if explicit and not fallback and not rule.sweep:
                raise ConfigError(f"{line}; {rule.fix}")
            warnings.append(f"{line} ({fallback or 'ignored here'}); {rule.fix}")
    return warnings

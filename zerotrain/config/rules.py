"""The validity rules of a run config on its own; each failure is one line naming the setting and the fix.

`check_config` runs when a RunConfig is built (zerotrain/config/load.py); the rules that need the
backend, the device, the world or the model run when the plan is resolved (zerotrain/plan/parallel_rules.py).
`zerotrain estimate`/`compare` ask `offload_problem` which stage/offload combinations exist, so they list
exactly what `train` accepts. `unused_settings` says which set fields mean nothing for a backend/stage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..errors import ConfigError
from ..tasks import LAYOUT_REFUSALS, PARALLEL_DIMS, RL_LOSS_TYPES, TaskSpec, task_spec
from .schema import IMAGE_TEXT_ROLES, OnlineRLSection, PreferenceSection

if TYPE_CHECKING:
    from .schema import RunConfig

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


def check_config(cfg: RunConfig, task: Optional[TaskSpec] = None) -> None:
    """Cross-field rules of the config alone (no backend or device needed). task: the run's task as the model resolved
    it (RunPlan.task: causal-lm on an image-text model is image-text); None: model.task's."""
    spec = task or _task(cfg)
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
    check_freeze(cfg)
    check_qat(cfg, spec)
    check_data_format(cfg, spec)
    check_head(cfg, spec)
    check_preference(cfg, spec)
    check_task_features(cfg, spec)
    check_streaming(cfg, spec)
    report_targets(cfg.run.report_to)
    check_overrides(cfg)


TRACKERS = ("tensorboard", "mlflow", "wandb")
"""What --report-to accepts besides none (zerotrain/train/trackers.py)."""


def report_targets(report_to: str) -> list[str]:
    """The trackers named by --report-to (comma list; 'none' alone means none)."""
    names = [n.strip().lower() for n in report_to.split(",") if n.strip()]
    bad = [n for n in names if n not in (*TRACKERS, "none")]
    if bad:
        raise ConfigError(f"run.report_to: unknown tracker {bad[0]!r}; pass a comma list of none, {', '.join(TRACKERS)}")
    return [n for n in names if n != "none"]


def check_lora(cfg: RunConfig) -> None:
    """LoRA needs pretrained weights; --merge-lora needs LoRA. (LoRA with --tp / --pp runs on FSDP2; on DeepSpeed it
    is refused with the backend known: capabilities.FEATURES["lora.r"].)"""
    lo = cfg.lora
    if lo.merge and lo.r == 0:
        raise ConfigError("--merge-lora needs LoRA; pass --lora-r 8 (or another rank), or drop --merge-lora")
    if lo.r == 0:
        return
    if cfg.model.from_config:
        raise ConfigError(f"--lora-r {lo.r}: LoRA adapts pretrained weights, but --model-config {cfg.model.from_config} "
                          "trains from scratch; pass --model DIR (a save_pretrained directory or hub id)")
    if not [t for t in lo.targets.split(",") if t.strip()]:
        raise ConfigError("--lora-targets is empty; pass all-linear or a comma list of module names (q_proj,v_proj)")


def check_freeze(cfg: RunConfig) -> None:
    """--freeze names image-text roles (schema.IMAGE_TEXT_ROLES) and leaves something to train: not every part
    without LoRA, not the adapters' whole --lora-scope with it. (A text-only model is refused once the model is
    known: zerotrain/model/preparation.py.)"""
    names = [n.strip() for n in cfg.model.freeze.split(",") if n.strip()]
    bad = [n for n in names if n not in IMAGE_TEXT_ROLES]
    if bad:
        raise ConfigError(f"model.freeze: unknown part {bad[0]!r}; pass a comma list of {', '.join(IMAGE_TEXT_ROLES)} "
                          "(e.g. --freeze vision,projector)")
    frozen = set(names)
    if cfg.lora.r == 0 and frozen == set(IMAGE_TEXT_ROLES):
        raise ConfigError(f"--freeze {cfg.model.freeze} freezes every part of the model: nothing would train; "
                          "leave out the part to train (e.g. --freeze vision,projector)")
    if cfg.lora.r > 0:
        scope = set(IMAGE_TEXT_ROLES) if cfg.lora.scope == "all" else {"language"}
        if scope <= frozen:
            raise ConfigError(f"--freeze {cfg.model.freeze} with --lora-scope {cfg.lora.scope or 'language'}: the "
                              "adapters' whole "
                              "scope is frozen, nothing would train; "
                              + ("drop a part from --freeze" if cfg.lora.scope == "all" else
                                 "drop language from --freeze, or pass --lora-scope all"))


def _degrees(par: Any) -> dict[str, int]:
    """The parallel section's degrees by dimension ({"tp": 2, "pp": 1, ...}), as the capability rows read them."""
    return {d: getattr(par, d) for d in PARALLEL_DIMS}


def check_qat(cfg: RunConfig, spec: Optional[TaskSpec] = None) -> None:
    """QAT fake-quantizes the full model's Linears with data parallelism (ZeRO 0-3 / FSDP), causal LMs only."""
    qat, par = cfg.quant.qat, cfg.parallel
    if qat == "none":
        return
    if cfg.lora.r > 0:
        raise ConfigError(f"--qat {qat} with --lora-r {cfg.lora.r}: QAT trains the full weights it fake-quantizes; "
                          "drop --lora-r, or --qat none and quantize the merged model with zerotrain export --quantize")
    problem = LAYOUT_REFUSALS["qat"].line(f"--qat {qat}", _degrees(par))
    if problem:
        raise ConfigError(problem)
    spec = spec or _task(cfg)
    if not spec.composes("qat"):
        fix = "pass --qat none" if spec.implied_by else "pass --task causal-lm or --qat none"  # an image-text model
        raise ConfigError(f"--qat {qat}: quantized export is for causal LMs (task {spec.name}); {fix}")


def check_head(cfg: RunConfig, spec: Optional[TaskSpec] = None) -> None:
    """model.num_labels fits the task's head: 2 or more classes for seq-cls, the one score of a reward model."""
    n, spec = cfg.model.num_labels, spec or _task(cfg)
    if n is None or not spec.classifier:
        return
    if spec.head_labels is not None and n != spec.head_labels:
        raise ConfigError(f"--num-labels {n} with --task {spec.name}: a reward model scores with one label; drop "
                          "--num-labels (or pass --num-labels 1)")
    if spec.head_labels is None and n < 2:
        raise ConfigError(f"--num-labels {n} with --task {spec.name}: a classifier needs 2 or more classes; a "
                          "one-label scorer trained on chosen/rejected pairs is --task reward")


def check_data_format(cfg: RunConfig, spec: Optional[TaskSpec] = None) -> None:
    """Chat/prompt-completion data and document-separated packing are causal-LM data parallel only."""
    d = cfg.data
    labelled = (spec or _task(cfg)).reads_data("data.label_column")
    if labelled and (d.format not in ("auto", "text") or d.packing != "off"):
        what = f"--data-format {d.format}" if d.format not in ("auto", "text") else "--packing"
        raise ConfigError(f"{what} is for causal-lm; seq-cls reads text_column and label_column "
                          "(drop it, or pass --task causal-lm)")
    if d.packing != "off" and cfg.parallel.pp > 1:
        raise ConfigError(f"--packing {d.packing} with --pp {cfg.parallel.pp}: the pipeline stages do not pass "
                          "per-document position ids; pass --pp 1 or --packing off")


def check_streaming(cfg: RunConfig, spec: Optional[TaskSpec] = None) -> None:
    """--streaming (zerotrain/data/streaming.py) reads causal-LM text or SFT samples, has no length (the run's length
    is --max-steps) and holds nothing out; --shuffle-buffer means nothing without it."""
    d, spec = cfg.data, spec or _task(cfg)
    if not d.streaming:
        if d.shuffle_buffer:
            raise ConfigError(f"data.shuffle_buffer={d.shuffle_buffer} (--shuffle-buffer) shuffles a stream; without "
                              "--streaming the data is shuffled whole every epoch; drop it, or pass --streaming")
        return
    if not spec.streams:
        raise ConfigError(f"--streaming with --task {spec.name}: only causal-lm text, chat and prompt-completion "
                          "data stream; drop --streaming")
    if cfg.run.max_steps is None:
        raise ConfigError("--streaming needs --max-steps: a stream has no length, so --epochs cannot size the run "
                          "(or its LR schedule); pass --max-steps N")
    if d.eval_split > 0:
        raise ConfigError(f"--eval-split {d.eval_split} with --streaming: holding rows out needs the whole data set; "
                          "pass --eval-data FILE (read whole) or drop --eval-split")
    if d.loader_workers > 1:
        raise ConfigError(f"--loader-workers {d.loader_workers} with --streaming: a stream position is exact with 0 "
                          "or 1 worker (several would split the shards between them); pass --loader-workers 1")


TASK_FEATURE_SETTINGS = {"tiled_mlp": ("model.tiled_mlp", "--tiled-mlp 0", lambda c: c.model.tiled_mlp > 0),
                         "lora": ("lora.r", "--lora-r 0", lambda c: c.lora.r > 0)}
"""The features whose refusal is the task's alone (TaskSpec.composes): (setting, the fix, whether it is on). The
others are refused where their own rule reads the task (qat: check_qat; packing: check_data_format; the
parallel dimensions: check_preference and plan/parallel_rules.py; the fused and chunked losses: UNUSED)."""


def check_task_features(cfg: RunConfig, spec: Optional[TaskSpec] = None) -> None:
    """A feature the task does not compose with (zerotrain/tasks.py) is refused by name."""
    spec = spec or _task(cfg)
    for feature, (setting, fix, on) in TASK_FEATURE_SETTINGS.items():
        if on(cfg) and not spec.composes(feature):
            raise ConfigError(f"{setting} with --task {spec.name}: the task does not run with it; pass {fix}")


def check_preference(cfg: RunConfig, spec: Optional[TaskSpec] = None) -> None:
    """Preference and online-RL tasks run data parallel (ZeRO 0-3 / FSDP2, with LoRA) on unpacked rows; what is
    not built with them is refused. pref.beta 0 means something for grpo only (no reference)."""
    spec = spec or _task(cfg)
    task, par = spec.name, cfg.parallel
    if cfg.pref.beta == 0 and spec.preference is not None:
        raise ConfigError(f"--beta 0 with --task {task}: the loss divides by or scales with beta; pass a positive "
                          "--beta (or leave it unset for the task's default)")
    if not spec.reads_pref:
        return
    what = "online RL (grpo)" if spec.online_rl is not None else "a reward model" if spec.reward_model is not None \
        else "preference tuning"
    problem = LAYOUT_REFUSALS["online_rl"].line(f"--task {task}", _degrees(par)) if spec.online_rl is not None else None
    if problem:
        raise ConfigError(problem)
    for d in PARALLEL_DIMS:
        if getattr(par, d) > 1 and not spec.composes(d):
            with_sp = " and sequence parallelism (--sp)" if spec.composes("sp") else ""
            raise ConfigError(f"--task {task} with --{d} {getattr(par, d)}: {what} runs with data "
                              f"parallelism (ZeRO 0-3 / FSDP2, LoRA){with_sp} only; pass --{d} 1")
    if cfg.quant.qat != "none":
        raise ConfigError(f"--task {task} with --qat {cfg.quant.qat}: quantization-aware {what} is not "
                          "built; drop --qat (quantize the result with zerotrain export --quantize)")
    if cfg.data.packing != "off":
        raise ConfigError(f"--task {task} with --packing: its rows are never packed; drop --packing")
    if cfg.pref.split_forward and cfg.batch.micro_batch < 1:
        raise ConfigError("--dpo-split-forward needs --micro-batch 1 or more")
    if spec.online_rl is not None:
        check_online_rl(cfg)


TRL_ONLY_LOSS_TYPES = ("cispo", "sapo", "vespo", "luspo")
"""TRL's loss types besides the ones built (tasks.RL_LOSS_TYPES), refused by name."""


def check_online_rl(cfg: RunConfig) -> None:
    """--task grpo's own settings: the loss types built, no vLLM yet (the batch arithmetic is refused where the plan
    resolves it: zerotrain/plan/rl_cycle.py cycle_of)."""
    rl = cfg.rl
    if rl.loss_type not in RL_LOSS_TYPES:
        trl = f" is TRL's, not built in zerotrain yet" if rl.loss_type in TRL_ONLY_LOSS_TYPES else " is no loss type"
        raise ConfigError(f"--loss-type {rl.loss_type}{trl}; pass one of {', '.join(RL_LOSS_TYPES)}")
    if rl.use_vllm:
        raise ConfigError("--use-vllm: generation with vLLM is not built yet (a follow-up); drop --use-vllm: "
                          "zerotrain generates with the training engine's own weights (rl.generation_gather)")
    if cfg.pref.beta and cfg.pref.precompute_ref:
        raise ConfigError("--precompute-ref with --task grpo: the completions are sampled during training, so no "
                          "reference log-probs exist before it; drop --precompute-ref")


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
    unused: Callable[["RunConfig", TaskSpec, str, int, str], bool]
    """(cfg, the run's task, backend, stage that runs, device) -> whether the fields mean nothing in this run."""
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


def _task(cfg: "RunConfig") -> TaskSpec:
    return task_spec(cfg.model.task)


def _pref_lacks(spec: TaskSpec, setting: str) -> bool:
    """A task reading pref.* settings that does not read this one (tasks.TaskSpec.pref_settings)."""
    return spec.reads_pref and setting not in spec.pref_settings


_NO_CHUNKS = "chunks a causal LM's vocabulary logits; this task (model.task) does not run with it"
"""Why model.chunked_loss / model.fused_loss mean nothing for a task that does not compose with the chunked loss."""
UNUSED: tuple[Unused, ...] = (
    Unused(_DS_COMM + ("ds_overrides",), lambda c, t, backend, s, d: backend == "fsdp",
           "is a DeepSpeed setting; the FSDP backend has none like it", "drop it, or pass --backend deepspeed"),
    Unused(("zero.reduce_bucket_size", "zero.overlap_comm"), lambda c, t, b, stage, d: b == "deepspeed" and stage == 0,
           "has no effect at ZeRO stage 0 (no gradient partitioning)", "use it with --stage 1, 2 or 3", sweep=True),
    Unused(("zero.allgather_bucket_size", "zero.reduce_scatter"), lambda c, t, b, stage, d: b == "deepspeed" and stage in (0, 3),
           "is read by DeepSpeed at ZeRO stages 1 and 2 only", "use it with --stage 1 or 2", sweep=True),
    Unused(("zero.prefetch_bucket_size", "zero.param_persistence_threshold", "zero.max_live_parameters",
            "zero.leaf_blocks"), lambda c, t, b, stage, d: b == "deepspeed" and stage != 3,
           "is read by DeepSpeed at ZeRO stage 3 only", "use it with --stage 3", sweep=True),
    Unused(("zero.offload_optimizer",), lambda c, t, backend, s, device: backend == "fsdp" and device != "cpu"
           and c.zero.offload_optimizer != "none" and c.zero.offload_param == "none",
           "alone is not a mode of FSDP2 (its CPUOffloadPolicy offloads parameters, gradients and optimizer "
           "states together)", "pass --offload-param cpu as well, or --backend deepspeed for optimizer-only offload"),
    Unused(("zero.nvme_path",), lambda c, t, b, s, d: "nvme" not in (c.zero.offload_optimizer, c.zero.offload_param),
           "is only read for NVMe offload", "drop it, or pass --offload-optimizer nvme / --offload-param nvme"),
    Unused(_LOSS_SCALING, lambda c, t, b, s, d: c.precision.dtype != "fp16",
           "is fp16 loss scaling; this run is not fp16", "drop it, or pass --precision fp16"),
    Unused(("optimizer.momentum",), lambda c, t, b, s, d: c.optimizer.name != "sgd",
           "is SGD's; this run's optimizer has none", "drop it, or pass --optimizer sgd"),
    Unused(("optimizer.muon_momentum", "optimizer.muon_adjust_lr"), lambda c, t, b, s, d: c.optimizer.name != "muon",
           "is Muon's; this run's optimizer is not muon", "drop it, or pass --optimizer muon"),
    Unused(("optimizer.betas", "optimizer.eps"), lambda c, t, b, s, d: c.optimizer.name == "sgd",
           "is Adam's; SGD has none", "drop it, or pass --optimizer adamw"),
    Unused(("schedule.min_lr_ratio",), lambda c, t, b, s, d: c.schedule.name == "constant",
           "is the end of a decay; a constant schedule has none", "drop it, or pass --schedule cosine or linear"),
    Unused(("lora.alpha", "lora.dropout", "lora.targets", "lora.scope", "lora.merge"), lambda c, t, b, s, d: c.lora.r == 0,
           "shapes LoRA adapters; lora.r is 0 (full fine-tuning)", "drop it, or pass --lora-r 8 (or another rank)"),
    Unused(("compile.mode", "compile.backend"), lambda c, t, b, s, d: not c.compile.enabled,
           "is a --compile setting; compile.enabled is false", "drop it, or pass --compile"),
    Unused(("quant.group_size",), lambda c, t, b, s, d: c.quant.qat == "none",
           "is a QAT setting; quant.qat is none", "drop it, or pass --qat int4-weight"),
    Unused(("data.label_column",), lambda c, t, b, s, d: not t.reads_data("data.label_column"),
           "is for sequence classification; model.task is causal-lm", "drop it, or pass --task seq-cls"),
    Unused(("model.num_labels",), lambda c, t, b, s, d: not t.classifier,
           "is for sequence classification; model.task is causal-lm", "drop it, or pass --task seq-cls"),
    # an explicit --chunked-loss 0 (off) means nothing wrong for such a task: only a chunk asked for is refused
    Unused(("model.chunked_loss",), lambda c, t, b, s, d: not t.composes("chunked_loss") and bool(c.model.chunked_loss),
           _NO_CHUNKS, "drop it"),
    Unused(("model.fused_loss",), lambda c, t, b, s, d: not t.composes("chunked_loss"), _NO_CHUNKS, "drop it"),
    Unused(("model.fused_loss",), lambda c, t, b, s, d: t.causal_lm and not t.next_token_loss,
           "fuses the causal-LM loss; a preference task sums per-token log-probs instead (--chunked-loss chunks "
           "them)", "drop it"),
    Unused(tuple(f"pref.{name}" for name in PreferenceSection.model_fields),
           lambda c, t, b, s, d: not t.reads_pref, "is a preference-tuning setting; model.task is not "
           "dpo, simpo, orpo, kto, reward or grpo", "drop it, or pass --task dpo"),
    Unused(("pref.loss", "pref.rpo_alpha"), lambda c, t, b, s, d: _pref_lacks(t, "pref.rpo_alpha"),
           "is DPO's loss setting", "drop it, or pass --task dpo"),
    Unused(("pref.ref_model", "pref.precompute_ref"),
           lambda c, t, b, s, d: _pref_lacks(t, "pref.ref_model"), "sets the reference of dpo and kto; simpo, orpo, "
           "reward and grpo take no reference model setting (grpo's reference, when --beta > 0, is the starting "
           "weights)", "drop it, or pass --task dpo"),
    Unused(("pref.beta", "pref.max_prompt_len", "pref.split_forward"),
           lambda c, t, b, s, d: t.reward_model is not None, "is no reward-model setting (its loss has no beta, "
           "its pairs are scored whole: a pair longer than --seq-len is dropped, as TRL's RewardTrainer does)",
           "drop it"),
    Unused(("pref.split_forward",), lambda c, t, b, s, d: _pref_lacks(t, "pref.split_forward"),
           "splits a pair's forward (dpo, simpo, orpo); this task's rows are single completions (kto's KL rows and "
           "grpo's samples run as forwards of their own)", "drop it"),
    Unused(("pref.center_rewards_coef",), lambda c, t, b, s, d: _pref_lacks(t, "pref.center_rewards_coef"),
           "is the reward model's centring term", "drop it, or pass --task reward"),
    Unused(("pref.desirable_weight", "pref.undesirable_weight"),
           lambda c, t, b, s, d: _pref_lacks(t, "pref.desirable_weight"), "weighs KTO's desirable and undesirable rows",
           "drop it, or pass --task kto"),
    Unused(("pref.label_smoothing",), lambda c, t, b, s, d: t.online_rl is not None,
           "is a pair-loss setting; grpo trains on sampled completions", "drop it"),
    Unused(("rl.generation_gather",), lambda c, t, backend, stage, d: stage == 0 or (backend == "deepspeed" and stage < 3),
           "chooses how sharded weights reach generation; at this stage every rank holds them whole (DeepSpeed "
           "ZeRO 0-2, FSDP stage 0)", "drop it, or use it with --stage 3 (FSDP: 1-3)", sweep=True),
    Unused(("rl.rollout_rows",), lambda c, t, b, s, d: c.rl.rollout_engine == "exact",
           "sizes a batched rollout call; rl.rollout_engine exact generates each prompt's group alone",
           "drop it, or pass --rollout-engine batched"),
    Unused(tuple(f"rl.{name}" for name in OnlineRLSection.model_fields),
           lambda c, t, b, s, d: t.online_rl is None, "is an online-RL setting; model.task is not grpo",
           "drop it, or pass --task grpo"),
    Unused(("pref.simpo_gamma",), lambda c, t, b, s, d: _pref_lacks(t, "pref.simpo_gamma"), "is SimPO's margin",
           "drop it, or pass --task simpo"),
    Unused(("pref.label_smoothing",), lambda c, t, b, s, d: _pref_lacks(t, "pref.label_smoothing") or c.pref.loss == "ipo",
           "smooths the sigmoid losses (dpo sigmoid, simpo); this run's loss is orpo or ipo", "drop it"),
    Unused(("data.text_column", "data.pack", "data.format", "data.train_on_prompt", "data.truncation"),
           lambda c, t, b, s, d: not t.reads_data("data.text_column"),
           "shapes causal-LM text or SFT samples; preference pairs "
           "are read from prompt/chosen/rejected, cut at --seq-len keeping the start", "drop it"),
    Unused(("data.loader_workers",), lambda c, t, b, s, d: t.online_rl is not None,
           "reads a dataset's micro-batches ahead of the step; grpo's come from its own generation", "drop it"),
    Unused(("model.offload_activations",), lambda c, t, b, s, device: device == "cpu",
           "moves saved activations from GPU to host memory; on CPU they already are in host memory",
           "drop it (it is for GPU runs)"),
)
"""Every setting that means nothing in some runs, and where; rules.unused_settings applies it and
tests/unit/test_unused_settings.py checks it against the run's real outputs (DeepSpeed JSON, FSDP2
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


def unused_settings(cfg: "RunConfig", backend: str, stage: int, device: str, backend_fallback: bool = False,
                    task: Optional[TaskSpec] = None) -> list[str]:
    """Refuse (ConfigError, one line) a setting that means nothing in this run and was set; warn instead
    when backend auto fell back to FSDP (`backend_fallback`: the user did not choose the backend that
    ignores it) or a sweep applies the value to every cell (Unused.sweep). Returns the warnings. task: the run's
    (RunPlan.task; None: model.task's)."""
    spec = task or _task(cfg)
    fallback = "backend auto fell back to fsdp" if backend_fallback else ""
    warnings: list[str] = []
    for rule in UNUSED:
        if not rule.unused(cfg, spec, backend, stage, device):
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


def router_aux_cut(cfg: RunConfig) -> str:
    """What cuts the forward the router load-balancing loss needs whole ("--sp 2"; the chunked loss, which
    replaces the causal LM's loss code), or ""."""
    cut = next((f"--{d} {getattr(cfg.parallel, d)}" for d in ("sp", "pp", "tp") if getattr(cfg.parallel, d) > 1), "")
    return cut or (f"--chunked-loss {cfg.model.chunked_loss}" if cfg.model.chunked_loss else "")

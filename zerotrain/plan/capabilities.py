"""The capability table of parallelism: which model-parallel dimensions (tp, pp, sp, ep) each backend runs
together and how, the ZeRO stages each backend runs a dimension at, the refusals that have a reason of their
own, which backend `backend: auto` takes for a dimension, and the features that do not compose with a
dimension yet; the stage a backend really runs for the one asked (RUNS_AS), what splits a dimension on each
backend (SPLIT_BY, for the start banner) and the schedule of each backend's pipeline (PIPELINE_SCHEDULE, for the
memory estimate). The rules (zerotrain/plan/parallel_rules.py), the backend choice (zerotrain/plan/resolve.py),
the plan and its banner (zerotrain/plan/run_plan.py), the memory estimate (zerotrain/memory/estimate.py,
zerotrain/memory/parallel.py), tune's and compare's search (zerotrain/commands/tune.py,
zerotrain/commands/compare.py, zerotrain/commands/estimate.py) and the docs read these facts here and nowhere
else.

A new combination (tp x pp, sp x tp, ep on DeepSpeed) is a row of COMBINATIONS (and of STAGES if it limits the
stage) plus its parallelize step in the backend; a refusal with a reason of its own is a row of REFUSED; what a
backend needs of the model and settings to run a dimension is a row of NEEDS; a layout generation refuses is
GENERATION_CUTS. The rows a config rule refuses before a plan exists (online RL x sp, QAT x tp/pp: LAYOUT_REFUSALS)
and the dimensions that build their own head (HEAD_SPLIT_DIMS: the fused loss's default) live in zerotrain/tasks.py,
the layer config/ may import; they are served from here to the layers above. Each refusal's text is written once
(tests/unit/test_parallel_owner.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import ConfigError
from ..tasks import HEAD_SPLIT_DIMS, LAYOUT_REFUSALS, LayoutRefusal  # noqa: F401 (served to the layers above)

BACKENDS = ("deepspeed", "fsdp")
"""The backends a run can take (`--backend`, the `--backends` lists of estimate, compare and tune), in report
order."""

NAMES: dict[str, str] = {"deepspeed": "DeepSpeed", "fsdp": "FSDP"}
"""How notes and refusals name each backend."""

COMBINATIONS: dict[frozenset[str], dict[str, str]] = {
    frozenset(): {"deepspeed": "ZeRO 0-3", "fsdp": "FSDP2 stages 0-3 (0 = DDP)"},
    frozenset({"tp"}): {"deepspeed": "AutoTP training, ZeRO 0-2", "fsdp": "DTensor tp_plan x FSDP2 over dp"},
    frozenset({"pp"}): {"deepspeed": "PipelineModule, ZeRO 0-1", "fsdp": "torch.distributed.pipelining x FSDP2"},
    frozenset({"sp"}): {"deepspeed": "Ulysses all-to-all attention x ZeRO 0-3 over dp x sp",
                        "fsdp": "Ulysses all-to-all attention x FSDP2 over dp x sp"},
    frozenset({"ep"}): {"deepspeed": "AutoEP: experts split over ep ranks (all-to-all token dispatch) x ZeRO 0-2",
                        "fsdp": "experts split over ep ranks (all-to-all token dispatch) x FSDP2 over dp"},
    frozenset({"ep", "sp"}): {"fsdp": "experts split over ep ranks of one sp coordinate x Ulysses all-to-all "
                                      "attention x FSDP2 over dp x sp"},
    frozenset({"sp", "tp"}): {"deepspeed": "AutoTP training, Ulysses all-to-all over each rank's heads / tp x ZeRO "
                                           "0-2 over dp x sp",
                              "fsdp": "DTensor tp_plan, Ulysses all-to-all over each rank's heads / tp x FSDP2 over "
                                      "dp x sp"},
    frozenset({"tp", "pp"}): {
        "fsdp": "torch.distributed.pipelining stages, DTensor tp_plan inside each, FSDP2 over dp"},
}
"""Which model-parallel mesh dimensions (distributed/layout.MESH_DIMS besides dp, and ep) each backend runs
together, and how. Data parallelism composes with every row. A set not listed (tp with pp on DeepSpeed: see
REFUSED; sp with pp, ep with tp or pp; ep with sp on DeepSpeed) is refused by check_combination in one line naming
what is supported."""


@dataclass(frozen=True)
class Stages:
    """The ZeRO stages a backend runs with one model-parallel dimension, and why no other."""

    allowed: tuple[int, ...]
    """The stages that run, lowest first."""
    why: str
    """Why the others do not (one phrase, in the refusal and the stage note)."""


STAGES: dict[tuple[str, str], Stages] = {
    ("deepspeed", "tp"): Stages((0, 1, 2), "DeepSpeed's AutoTP training supports ZeRO 0-2"),
    ("deepspeed", "pp"): Stages((0, 1), "DeepSpeed's pipeline engine supports ZeRO 0-1"),
    ("fsdp", "tp"): Stages((1, 2, 3), "stage 0 is DDP under FSDP, which cannot hold split layers"),
    ("fsdp", "pp"): Stages((1, 2, 3), "stage 0 is DDP under FSDP, which does not compose with pipeline stages"),
    ("fsdp", "ep"): Stages((1, 2, 3), "stage 0 is DDP under FSDP, which cannot hold split experts"),
    ("deepspeed", "ep"): Stages((0, 1, 2), "AutoEP under ZeRO-3 keeps the experts in the ZeRO shards, which "
                                           "zerotrain's final/ and export do not gather yet"),
}
"""ZeRO stages each backend runs with tensor (tp), pipeline (pp) or expert (ep) parallelism: DeepSpeed's AutoTP
training supports ZeRO 0-2 and its pipeline engine asserts stage < 2; under FSDP stage 0 is DDP, which cannot
hold split layers, stages or experts. A (backend, dimension) not listed runs every stage."""


RUNS_AS: dict[tuple[str, int], tuple[int, str]] = {
    ("fsdp", 1): (2, "FSDP has no optimizer-only sharding (gradients are sharded too); use --backend deepspeed for "
                     "a true stage 1"),
}
"""(backend, asked ZeRO stage) -> (the stage it runs as, why): FSDP2 shards gradients whenever it shards the
optimizer states. A (backend, stage) not listed runs as asked."""


def effective_stage(backend: str, stage: int) -> int:
    """The ZeRO stage a backend really runs for the asked one (RUNS_AS)."""
    return RUNS_AS.get((backend, stage), (stage, ""))[0]


def runs_as_why(backend: str, stage: int) -> str:
    """Why the backend runs another stage than the one asked ("" when it runs it)."""
    return RUNS_AS.get((backend, stage), (stage, ""))[1]


SPLIT_BY: dict[tuple[str, str], str] = {
    ("deepspeed", "tp"): "DeepSpeed AutoTP",
    ("fsdp", "tp"): "the model's tp_plan",
}
"""What splits the transformer blocks along a dimension on each backend (the start banner's "blocks split by
..."): DeepSpeed's AutoTP training, or DTensor's parallelize_module with the model's HF tp_plan
(zerotrain/backends/fsdp/tensor_parallel.py)."""

PIPELINE_SCHEDULE: dict[str, str] = {"deepspeed": "1f1b", "fsdp": "gpipe"}
"""The schedule each backend's pipeline engine runs (activation memory depends on it, memory/parallel.in_flight):
DeepSpeed's PipelineEngine runs its 1F1B TrainSchedule (stage k keeps min(p - k, m) micro-batches' activations);
zerotrain's FSDP pipeline runs torch.distributed.pipelining's ScheduleGPipe (all m forwards first, so every stage
keeps all m micro-batches' activations)."""


def _deepspeed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "(not installed)"


@dataclass(frozen=True)
class Refusal:
    """A combination refused with a reason of its own (checked before the generic line of check_combination)."""

    dims: frozenset[str]
    """The dimensions that, all in use together, are refused."""
    backends: tuple[str, ...]
    """The backends it is refused on."""
    line: Callable[[dict[str, int]], str]
    """The one-line refusal, from the degrees asked ({"tp": 2, "pp": 2})."""


REFUSED: tuple[Refusal, ...] = (
    Refusal(frozenset({"tp", "pp"}), ("deepspeed",),
            lambda d: f"--tp {d['tp']} with --pp {d['pp']} on the deepspeed backend: DeepSpeed "
                      f"{_deepspeed_version()}'s AutoTP does not compose with its pipeline engine "
                      "(deepspeed.initialize of a PipelineModule fails: "
                      "'Not able to determine model policy automatically', and with preset_model a tp broadcast that "
                      "mismatches across stages; benchmarks/results/tp_pp_deepspeed_probe/); pass --backend fsdp for "
                      "tensor x pipeline parallelism"),
)
"""Refusals with their own reason, in the order they are checked."""

AUTO_BACKEND: dict[str, tuple[str, str]] = {
    "tp": ("fsdp", "tensor parallelism runs on FSDP2"),
    "ep": ("fsdp", "expert parallelism runs on FSDP2 at every stage and MoE family; DeepSpeed's AutoEP at ZeRO 0-2 on "
                   "Mixtral and Qwen3-MoE"),
}
"""The backend `backend: auto` takes when a dimension is in use, and why (resolve.select_backend), in the order
asked: tensor parallelism runs on both but is DTensor-native on FSDP2; expert parallelism runs on both, but DeepSpeed's
AutoEP only on the AUTOEP_PRESETS families at ZeRO 0-2, so auto keeps FSDP2."""

AUTOEP_PRESETS: dict[str, str] = {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe"}
"""HF model_type -> DeepSpeed AutoEP preset_model that --ep runs on DeepSpeed (backends/deepspeed/expert_parallel.py
rebuilds their HF expert layout: fused gate_up_proj / down_proj and a `gate` router); DeepSpeed 0.19.8's other
presets (qwen3_5_moe, deepseek_v2/v3, minimax_m3) have HF layouts not rebuilt there."""


@dataclass(frozen=True)
class Asked:
    """What a NEEDS row reads of a run once the model is known."""

    degree: int
    """The degree of the row's dimension (--ep 2)."""
    model_type: str
    """The HF model_type ("" when the config names none)."""
    freeze_router: bool
    """model.freeze_router."""
    reduce_scatter: Optional[bool]
    """zero.reduce_scatter (None: the backend's default)."""


@dataclass(frozen=True)
class Need:
    """What a backend needs of the model or the settings to run a dimension, refused in one line otherwise."""

    unmet: Callable[[Asked], bool]
    """Whether the run asked does not have it."""
    line: Callable[[Asked], str]
    """The one-line refusal."""


NEEDS: dict[tuple[str, str], tuple[Need, ...]] = {
    ("deepspeed", "ep"): (
        Need(lambda a: a.model_type not in AUTOEP_PRESETS,
             lambda a: f"--ep {a.degree} on the deepspeed backend: DeepSpeed AutoEP runs model types "
                       f"{sorted(AUTOEP_PRESETS)} here, not '{a.model_type or '?'}' (its HF expert layout is not "
                       "rebuilt for final/); pass --backend fsdp"),
        Need(lambda a: a.reduce_scatter is False,
             lambda a: f"--ep {a.degree} on the deepspeed backend with zero.reduce_scatter: false: DeepSpeed's "
                       "ZeRO 1-2 asserts reduce-scatter for expert parameter groups; drop zero.reduce_scatter"),
        Need(lambda a: a.freeze_router,
             lambda a: f"--ep {a.degree} on the deepspeed backend with model.freeze_router: not supported yet (AutoEP "
                       "builds new router modules inside deepspeed.initialize, which no test freezes); pass "
                       "--backend fsdp to freeze routers under --ep"),
    ),
}
"""(backend, dimension) -> what it needs beyond the model's own split (checked in order once the model is known,
parallel_rules._check_expert_parallel): DeepSpeed's AutoEP runs the AUTOEP_PRESETS families, asserts ZeRO's
reduce-scatter for expert groups and builds its own routers."""


def unmet_need(backend: str, dim: str, asked: Asked) -> Optional[str]:
    """The first NEEDS row of (backend, dim) the run does not meet, as its one-line refusal; None when all are met."""
    return next((n.line(asked) for n in NEEDS.get((backend, dim), ()) if n.unmet(asked)), None)


GENERATION_CUTS: tuple[str, ...] = ("tp", "sp", "ep")
"""The dimensions whose split cuts generation's forward over ranks (a pipeline does too): online RL samples with
data parallelism only (LAYOUT_REFUSALS["online_rl"] refuses sp when the config is built, the grpo TaskSpec composes
with no dimension; the engine asks generation_refusal again before sampling)."""


def generation_refusal(pipeline: bool, degrees: dict[str, int]) -> Optional[str]:
    """Why generation does not run on this layout yet (one line), or None."""
    cut = [f"{d} {degrees[d]}" for d in GENERATION_CUTS if degrees.get(d, 1) > 1]
    if pipeline:
        cut.insert(0, "a pipeline (pp > 1)")
    if not cut:
        return None
    return (f"generation (online RL) does not compose with {', '.join(cut)} yet: its forward is cut over ranks; "
            "run it with data parallelism only (tp, pp, sp, ep 1)")


@dataclass(frozen=True)
class Feature:
    """A feature that does not compose with some model-parallel dimensions yet (on some backends)."""

    flag: str
    """The CLI flag that turns it on (named in the fix)."""
    dims: tuple[str, ...]
    """The dimensions it is refused with, in the order checked."""
    why: str
    """Why, with {dim} for the dimension."""
    backends: tuple[str, ...] = BACKENDS
    """The backends it is refused on with those dimensions (the others run it)."""
    why_for: tuple[tuple[str, str], ...] = ()
    """(dimension, why) where one dimension has a reason of its own (overrides `why`)."""


LORA_DEEPSPEED_WHY: tuple[tuple[str, str], ...] = (
    ("tp", f"DeepSpeed {_deepspeed_version()}'s AutoTP training fails on peft's wrapped layers: ZeRO 1-2 in "
           "deepspeed.initialize (stage_1_and_2.py _create_param_mapping: KeyError on a parameter), ZeRO 0 in its "
           "backward (\"loss must be a scalar tensor\"); benchmarks/results/lora_autotp_probe/REPORT.md"),
    ("pp", "the DeepSpeed pipeline builds its PipelineModule from the model's own layers, without peft's adapters"),
    ("ep", "AutoEP swaps the MoE blocks inside deepspeed.initialize, under peft's wrapper, which no test has run"),
)
"""Why LoRA does not run on DeepSpeed with tp, pp and ep (benchmarks/results/lora_autotp_probe/REPORT.md)."""


OWN_HEAD_WHY = "the {dim} split builds its own blocks and head"
"""Why a feature that wraps the model's blocks or head does not compose with HEAD_SPLIT_DIMS."""
VOCAB_PARALLEL_WHY: tuple[tuple[str, str], ...] = (("tp", "no vocabulary-parallel loss is built"),)
"""Why a loss over the whole vocabulary does not compose with tp."""

FEATURES: dict[str, Feature] = {
    "model.tiled_mlp": Feature("--tiled-mlp", HEAD_SPLIT_DIMS, OWN_HEAD_WHY, backends=("deepspeed",)),
    "model.chunked_loss": Feature("--chunked-loss", HEAD_SPLIT_DIMS, OWN_HEAD_WHY, why_for=VOCAB_PARALLEL_WHY),
    "model.fused_loss": Feature("--fused-loss", HEAD_SPLIT_DIMS, OWN_HEAD_WHY, why_for=VOCAB_PARALLEL_WHY),
    "model.offload_activations": Feature("--offload-activations", ("pp",),
                                         "the pipeline schedule runs its own forwards"),
    "compile.enabled": Feature("--compile", ("tp", "pp", "sp", "ep"),
                               "the {dim} layout splits or wraps the blocks --compile compiles"),
    "lora.r": Feature("--lora-r", ("tp", "pp", "ep"), "{dim} on DeepSpeed wraps LoRA's peft layers in none of its splits",
                      backends=("deepspeed",), why_for=LORA_DEEPSPEED_WHY),
}
"""Features x dimensions refused (parallel_rules._check_features): the chunked and fused loss
(zerotrain/model/memory_reducers.py) compute the whole vocabulary's logits on each rank, which a tensor-parallel
head would need a vocabulary-parallel loss for, and wrap the whole model's head, which the pipeline stages build
their own of; the tiled MLP wraps each block's MLP in place, which FSDP2's tensor-parallel split (DTensor hooks on
the MLP's Linears) and pipeline stages (the same HF blocks) keep, but DeepSpeed's AutoTP and PipelineModule are not
proved with it; the activation offload wraps the engine's per-micro-batch forward, which a pipeline does not have;
--compile compiles the blocks before the layouts split or wrap them, and sp's and ep's all-to-alls run collectives
inside them; LoRA runs under FSDP2's tp (backends/fsdp/tensor_parallel.py lora_plan) and pp, not DeepSpeed's."""


def feature_refusal(setting: str, label: str, degrees: dict[str, int], backend: str = "") -> Optional[str]:
    """The one-line refusal of a feature that is on (`label`: how the line names it, e.g. "model.tiled_mlp=True")
    with the first dimension in use it does not compose with on `backend` (every backend when ""); None when it
    composes."""
    f = FEATURES[setting]
    if backend and backend not in f.backends:
        return None
    whys = dict(f.why_for)
    for dim in f.dims:
        if degrees.get(dim, 1) > 1:
            where = f" on the {backend} backend" if f.backends != BACKENDS else ""
            other = [b for b in BACKENDS if b not in f.backends]
            fix = f", or --backend {other[0]}" if f.backends != BACKENDS and other else ""
            return (f"{label} with --{dim} {degrees[dim]}{where}: not supported yet "
                    f"({whys.get(dim, f.why).format(dim=dim)}); drop {f.flag} or pass --{dim} 1{fix}")
    return None


def supported(backend: str) -> str:
    """The combinations a backend runs, for a refusal ("tp, pp, sp")."""
    return ", ".join(" + ".join(sorted(k)) for k in COMBINATIONS if k and backend in COMBINATIONS[k])


def check_combination(dims: frozenset[str] | dict[str, int], backend: str) -> None:
    """Refuse a set of model-parallel dimensions the backend does not run together: a REFUSED row's own line
    (when the degrees are given), else one naming what is supported; dims with their degrees ({"sp": 2}) are named
    with them in the line."""

    degrees = dict(dims) if isinstance(dims, dict) else {}
    dims = frozenset(dims)
    if degrees:
        for r in REFUSED:
            if r.dims <= dims and backend in r.backends:
                raise ConfigError(r.line(degrees))
    if backend in COMBINATIONS.get(dims, {}):
        return
    asked = " with ".join(f"--{d} {degrees[d]}" if d in degrees else f"--{d}" for d in sorted(dims))
    ok = supported(backend)
    if len(dims) > 1:
        raise ConfigError(f"{asked}: {' and '.join(sorted(dims))} together are not supported yet on the {backend} "
                          f"backend (it runs {ok}, each with data parallelism); pick one of them")
    raise ConfigError(f"{asked}: not supported on the {backend} backend (it runs {ok}, each with data parallelism)")


def auto_backend(degrees: dict[str, int], features_on: tuple[str, ...] = ()) -> Optional[tuple[str, str]]:
    """(backend, why) that `backend: auto` must take for the dimensions in use and the FEATURES settings that are on
    (e.g. "lora.r" with --pp runs on FSDP2 only); None: any backend runs them."""
    for dim, (backend, why) in AUTO_BACKEND.items():
        if degrees.get(dim, 1) > 1:
            return backend, f"backend=auto and parallel.{dim}={degrees[dim]} ({why})"
    for setting in features_on:
        f = FEATURES[setting]
        runs_on = [b for b in BACKENDS if b not in f.backends]
        dim = next((d for d in f.dims if degrees.get(d, 1) > 1), None)
        if dim is not None and len(runs_on) == 1:
            return runs_on[0], (f"backend=auto, {setting} with parallel.{dim}={degrees[dim]} (it runs on "
                                f"{NAMES[runs_on[0]]} only)")
    return None

"""The rules of a run that need more than its config: the backend and device (`check_backend`), the ZeRO
stage a backend runs with a model-parallel layout (`resolve_stage`), what the degrees need of the backend, the
world and the model (`check_parallel`), and the batch arithmetic over the data-parallel size (`resolve_batch`).
The facts of what composes with what are the capability table's (zerotrain/plan/capabilities.py), the rank
arithmetic the layout's (zerotrain/distributed/layout.py). The plan (zerotrain/plan/run_plan.py) calls
them; each failure is one line naming the setting and the fix.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..config.rules import router_aux_cut
from ..errors import ConfigError
from .capabilities import STAGES, Asked, check_combination, feature_refusal, unmet_need

if TYPE_CHECKING:
    from ..config.schema import RunConfig
    from ..distributed.layout import ParallelDegrees
    from ..model.facts import ModelFacts
    from ..tasks import TaskSpec


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
    _check_attention(cfg, device_type)
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


def check_optimizer(cfg: RunConfig, backend: str, parallel: ParallelDegrees) -> None:
    """--optimizer muon where its update is proved exact so far (issue 68's first slice): FSDP2 at any stage without
    LoRA, offload or a model-parallel split. Stage 0 (DDP) holds every whole matrix; at stages 1-3 the parameters are
    DTensor shards, and torch.optim.Muon's Newton-Schulz on them runs DTensor ops whose sharding propagation computes
    the whole matrix's result (tests/multirank/test_muon.py: equal to one process). DeepSpeed's engine builds its own
    optimizer (its Muon tags parameters by name), and offload, LoRA and tp/pp/sp/ep are unproved: refused."""
    if cfg.optimizer.name != "muon":
        return
    z = cfg.zero
    pairs = [(f"--backend {backend}", backend == "deepspeed"),
             *((f"--{dim} {n}", True) for dim, n in sorted(parallel.asked.items())),
             (f"--lora-r {cfg.lora.r}", cfg.lora.r > 0),
             (f"--offload-optimizer {z.offload_optimizer}", z.offload_optimizer != "none"),
             (f"--offload-param {z.offload_param}", z.offload_param != "none")]
    for what, on in pairs:
        if on:
            raise ConfigError(f"--optimizer muon with {what}: not yet supported (issue 68: proved on FSDP2 alone so "
                              "far); use --backend fsdp with no offload, LoRA or model parallelism, or --optimizer "
                              "adamw")


FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
"""The package each flash-attention kernel of transformers imports."""


def _check_attention(cfg: RunConfig, device_type: str) -> None:
    """model.attn_implementation: a flash kernel needs a CUDA GPU and its package; sp runs its own attention."""
    import importlib.util

    impl, sp = cfg.model.attn_implementation, cfg.parallel.sp
    if sp > 1 and impl not in ("auto", "sdpa"):
        raise ConfigError(f"model.attn_implementation={impl} with --sp {sp}: sequence parallelism runs its own "
                          "all-to-all attention over PyTorch SDPA; pass --attn-implementation sdpa (or auto)")
    if impl in FLASH_PACKAGES:
        if device_type != "cuda":
            raise ConfigError(f"model.attn_implementation={impl} needs a CUDA GPU (this run is on {device_type}); "
                              "pass --attn-implementation sdpa")
        if importlib.util.find_spec(FLASH_PACKAGES[impl]) is None:
            raise ConfigError(f"model.attn_implementation={impl} needs the {FLASH_PACKAGES[impl]} package, which "
                              "does not import here; install it or pass --attn-implementation sdpa")


def resolve_stage(cfg: RunConfig, backend: str) -> tuple[int, str]:
    """(ZeRO stage the run uses, why it differs from zero.stage or ""): a stage the user did not set is
    moved to the highest one the parallel layout supports; an explicit unsupported one is refused."""
    stage, explicit = cfg.zero.stage, "stage" in cfg.zero.model_fields_set
    for kind in ("tp", "pp", "ep"):
        degree = getattr(cfg.parallel, kind)
        if degree == 1 or (backend, kind) not in STAGES:  # a layout the backend refuses (check_combination)
            continue
        allowed, why = STAGES[(backend, kind)].allowed, STAGES[(backend, kind)].why
        if stage in allowed:
            continue
        if explicit:
            fix = " or ".join(f"--stage {s}" for s in allowed[-2:])
            raise ConfigError(f"--{kind} {degree} with --stage {stage} on the {backend} backend: {why}; "
                              f"pass {fix}" + (" or --backend fsdp" if backend == "deepspeed" else ""))
        stage = max(s for s in allowed if s <= stage) if any(s <= stage for s in allowed) else allowed[0]
        return stage, (f"zero.stage {cfg.zero.stage} (the default) resolved to {stage}: --{kind} {degree}, "
                       f"{why}")
    return stage, ""


def check_parallel(cfg: RunConfig, backend: str, parallel: ParallelDegrees, world_size: int,
                   facts: Optional[ModelFacts], task: Optional["TaskSpec"] = None) -> None:
    """What the model-parallel degrees (tp / pp / sp / ep > 1) need: a combination the backend runs
    (capabilities.check_combination), a world they divide (the layout's rule), a model the backend can
    split (heads and widths divisible by tp; a decoder family with enough blocks for pp; for sp a causal LM whose
    attention goes through transformers' interface with masks it rebuilds (causal, sliding) and heads sp divides (under
    tp: the heads / tp of a tensor-parallel rank); for ep a mixture of experts whose experts ep divides); the features
    that do not compose with a dimension (capabilities.FEATURES); and the router settings a mixture of experts
    only has (_check_router)."""
    from ..model.pipeline_parts import pipeline_problem

    tp, pp, sp, ep = parallel.tp, parallel.pp, parallel.sp, parallel.ep
    _check_features(cfg, parallel, backend)
    _check_router(cfg, facts)
    if not parallel.asked:
        return
    check_combination(parallel.asked, backend)
    if ep > 1:  # the experts first; the world's data-parallel ranks are the layout's (WorldLayout) to check
        _check_expert_parallel(ep, facts, backend, cfg.model.freeze_router, cfg.zero.reduce_scatter)
        if sp == 1:
            return
    parallel.layout(world_size)  # refuses degrees that do not divide the world (distributed/layout.py)
    from ..tasks import task_spec

    task = task or task_spec(cfg.model.task)  # the run's (RunPlan.task)
    if pp > 1 and task.composes("pp") and not cfg.data.pack:
        raise ConfigError(f"--pp {pp} runs packed causal-lm batches (no padding: the stages pass no attention "
                          "mask); set data.pack: true")
    if sp > 1:  # then tp's checks too (sp x tp): the all-to-all splits the heads each tp rank computes
        _check_sequence_parallel(cfg, sp, facts, tp, task)
        if tp == 1:
            return
    if facts is None:
        return  # checked again when the model is known (the engine builds the plan with it)
    if pp > 1:
        problem = pipeline_problem(facts.model_type, task, facts.num_layers, pp, facts.attention_types)
        if problem:
            raise ConfigError(problem)
        if tp == 1:
            return
    # tensor parallelism alone or inside each pipeline stage (tp x pp): the model's split must fit it too
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


def _check_features(cfg: RunConfig, parallel: ParallelDegrees, backend: str) -> None:
    """The features that do not compose with a model-parallel dimension yet on this backend
    (capabilities.FEATURES), refused in one line naming both."""
    m, degrees = cfg.model, parallel.asked
    for name, value in (("model.tiled_mlp", m.tiled_mlp), ("model.chunked_loss", m.chunked_loss),
                        ("model.fused_loss", m.fused_loss), ("lora.r", cfg.lora.r)):
        # fused_loss None (auto) is off under tp / pp (ModelPreparation.from_config)
        problem = feature_refusal(name, f"{name}={value}", degrees, backend) if value else None
        if problem:
            raise ConfigError(problem)
    for name, on in (("model.offload_activations", m.offload_activations), ("compile.enabled", cfg.compile.enabled)):
        problem = feature_refusal(name, name, degrees, backend) if on else None
        if problem:
            raise ConfigError(problem)


def _check_expert_parallel(ep: int, facts: Optional[ModelFacts], backend: str, freeze_router: bool,
                           reduce_scatter: Optional[bool]) -> None:
    """What --ep needs of the model: routed experts ep divides, and the HF expert-parallel plan transformers
    dispatches tokens with (the config's base_model_ep_plan); then what the backend needs to run ep
    (capabilities.NEEDS: on DeepSpeed a family AutoEP has a preset for, trainable routers, ZeRO's reduce-scatter)."""
    if facts is None:
        return  # checked again when the model is known
    if not facts.num_experts:
        raise ConfigError(f"--ep {ep}: model type '{facts.model_type or '?'}' is dense (no mixture-of-experts "
                          "blocks), so there are no experts to split; pass --ep 1")
    if facts.num_experts % ep:
        raise ConfigError(f"--ep {ep} does not divide the model's {facts.num_experts} experts per block; pick an ep "
                          "that divides it")
    if facts.adapted_experts:
        raise ConfigError(f"--ep {ep} with LoRA adapters on the experts' fused weights (peft wraps them under "
                          "all-linear): not supported yet (each adapter spans every expert, which ep splits); pass "
                          "--lora-targets naming the attention modules, e.g. q_proj,k_proj,v_proj,o_proj")
    if not facts.expert_parallel_plan:
        raise ConfigError(f"--ep {ep}: model type '{facts.model_type or '?'}' ships no expert-parallel plan "
                          "(its HF config has no base_model_ep_plan), so transformers cannot dispatch its tokens; "
                          "pass --ep 1")
    problem = unmet_need(backend, "ep", Asked(ep, facts.model_type or "", freeze_router, reduce_scatter))
    if problem:
        raise ConfigError(problem)


def _check_router(cfg: RunConfig, facts: Optional[ModelFacts]) -> None:
    """The router settings (zerotrain/model/router.py) mean something only for a mixture of experts, and the
    load-balancing loss only where the HF model defines one and each rank's forward sees whole sequences."""
    m = cfg.model
    explicit = m.model_fields_set
    if facts is not None and not facts.num_experts:
        for name, flag in (("router_aux_coef", "--router-aux-coef"), ("freeze_router", "--freeze-router")):
            if name in explicit and getattr(m, name) not in (None, False):
                raise ConfigError(f"model.{name}: model type '{facts.model_type or '?'}' is dense (no "
                                  f"mixture-of-experts router); drop {flag}")
        return
    if m.router_aux_coef and facts is not None and facts.router_aux_coef is None:
        raise ConfigError(f"model.router_aux_coef={m.router_aux_coef}: model type '{facts.model_type or '?'}' "
                          "defines no router load-balancing loss in transformers; drop --router-aux-coef")
    cut = router_aux_cut(cfg)
    if m.router_aux_coef and cut:
        raise ConfigError(f"model.router_aux_coef={m.router_aux_coef} with {cut}: not supported yet (the loss is "
                          "computed inside the causal LM's whole forward, which that cuts); pass "
                          "--router-aux-coef 0")


def router_warnings(cfg: RunConfig, facts: Optional[ModelFacts]) -> list[str]:
    """The model's own router loss left out (a layout that cuts the forward, the coefficient not set): said by
    name rather than dropped silently."""
    cut = router_aux_cut(cfg)
    if facts is None or not facts.router_aux_coef or cfg.model.router_aux_coef is not None or not cut:
        return []
    return [f"the model's router load-balancing loss (router_aux_loss_coef {facts.router_aux_coef}) is left out "
            f"with {cut}: it needs the causal LM's whole forward; the LM loss alone trains"]


SP_ATTENTION_TYPES = ("full_attention", "sliding_attention")
"""Block attention kinds whose mask the sequence-parallel attention rebuilds over the whole sequence
(zerotrain/model/sequence_parallel.py: causal, the layer's window, packed documents)."""


def _check_sequence_parallel(cfg: RunConfig, sp: int, facts: Optional[ModelFacts], tp: int = 1,
                             task: Optional["TaskSpec"] = None) -> None:
    """What the Ulysses attention (zerotrain/model/sequence_parallel.py) needs: transformers hands a custom
    attention function no mask, so it rebuilds the ones it knows (causal, sliding windows, packed documents) and
    everything else is refused rather than run as full causal. Under tp > 1 it all-to-alls the heads / tp (and
    key/value heads / tp) a tensor-parallel rank computes; tp's own divisibility is check_parallel's."""
    from ..tasks import task_spec

    task = task or task_spec(cfg.model.task)
    if not task.composes("sp"):
        raise ConfigError(f"--sp {sp} needs a causal-lm model (got model.task={task.name}): the "
                          "sequence-parallel attention is causal; pass --sp 1")
    if facts is None:
        return  # checked again when the model is known
    if not facts.attention_interface:
        raise ConfigError(f"--sp {sp}: model type '{facts.model_type or '?'}' computes attention in its own code, not "
                          "through transformers' attention interface, so the sequence-parallel attention cannot "
                          "replace it; pass --sp 1")
    masked = sorted(set(facts.attention_types) - set(SP_ATTENTION_TYPES))
    if masked:
        raise ConfigError(f"--sp {sp}: the model's blocks use {', '.join(masked)}, a mask the sequence-parallel "
                          f"attention does not build (it builds {', '.join(SP_ATTENTION_TYPES)}); pass --sp 1")
    if facts.attention_extras:
        raise ConfigError(f"--sp {sp}: the model's attention adds {', '.join(facts.attention_extras)}, which the "
                          "sequence-parallel attention (plain SDPA) does not compute; pass --sp 1")
    heads, kv = facts.num_heads, facts.num_kv_heads or facts.num_heads
    if tp > 1:
        if not heads or heads % tp or kv % tp:
            return  # tp's own line names it (check_parallel)
        local, local_kv = heads // tp, kv // tp  # the heads a tensor-parallel rank computes (colwise q/k/v)
        if local % sp:
            raise ConfigError(f"--sp {sp} with --tp {tp}: sp does not divide the {local} attention heads each "
                              f"tensor-parallel rank computes (the model's {heads} / tp {tp}; the all-to-all gives "
                              "each rank heads / tp / sp of them); pick sp and tp with sp x tp dividing the heads")
        if local_kv % sp and sp % local_kv:
            raise ConfigError(f"--sp {sp} with --tp {tp}: the {local_kv} key/value heads each tensor-parallel rank "
                              f"computes (the model's {kv} / tp {tp}) must be divided by sp or divide it (then each "
                              "is repeated); pick such an sp and tp")
        return
    if not heads or heads % sp:
        raise ConfigError(f"--sp {sp} does not divide the model's {heads} attention heads (the all-to-all gives "
                          "each rank heads / sp of them); pick an sp that divides it")
    if kv % sp and sp % kv:
        raise ConfigError(f"--sp {sp} with the model's {kv} key/value heads: sp must divide them or be a multiple "
                          "of them (then each is repeated); pick such an sp")


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

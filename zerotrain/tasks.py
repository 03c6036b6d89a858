"""The tasks zerotrain trains, one TaskSpec each: the one place that says what a task is.

    spec = plan.task                          # the run's task, resolved once on the model (RunPlan.task)
    spec = task_spec(cfg.model.task)          # the asked task (ConfigError naming the valid tasks for an unknown one)
    spec.causal_lm, spec.data_format, spec.objective, spec.composes("pp"), spec.holds_reference(cfg)

Every other module reads a task's facts here instead of comparing its name (tests/unit/test_tasks.py checks the
source for such comparisons): its data format (the data layer picks the tokenizer and collator by it,
zerotrain/data/datasets.py), its objective (and, for preference tuning, which pair loss and where its NLL term
is taken, zerotrain/train/preference.py), the auxiliary model it holds (a reference), its eval metrics, the
rows it adds to the memory estimate (zerotrain/memory/estimate.py), its transformers Auto class and peft
TaskType, and the parallel dimensions and features it composes with. Adding a task is one entry of TASKS plus
what is new in it (a new data format, objective or pair loss and the code behind it).

It does not merge with plan/registry.py (backend -> engine class): that table names engine classes in the
plan layer, while this one sits below the config (the schema's model.task choices come from it) and is read by
every layer from config up, so one table would make the config import the engines.

It also resolves the task-dependent settings the preference section leaves open (pref.beta's default,
pref.ref_model / pref.precompute_ref as the ReferencePlan): the readers get the resolved values, not the fields
(tests/unit/test_one_owner.py RESOLVED).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from .errors import ConfigError

TEXT, LABELLED_TEXT, PREFERENCE_PAIRS, PROMPTS = "text", "labelled-text", "preference-pairs", "prompts"
UNPAIRED = "unpaired-completions"
IMAGE_CHAT = "image-chat"
"""Data formats: text (plain documents, chat or prompt-completion samples: data.format picks), text with a class
label (data.text_column + data.label_column), {prompt, chosen, rejected} pairs, prompts to complete (a `prompt`
column; the other columns reach the reward functions, zerotrain/data/prompts.py), {prompt, completion, label}
rows judged good or bad one by one (KTO; pairs are unpaired by rule, zerotrain/data/unpaired.py), chats with images
in TRL's vision format (`messages` of {"type": "image"} / {"type": "text"} parts and an `images` column of paths,
zerotrain/data/vision.py)."""
_TEXT_SHAPING = frozenset({"data.text_column", "data.pack", "data.format", "data.train_on_prompt", "data.truncation"})
DATA_SETTINGS: dict[str, frozenset[str]] = {
    TEXT: _TEXT_SHAPING, LABELLED_TEXT: _TEXT_SHAPING | {"data.label_column"}, IMAGE_CHAT: _TEXT_SHAPING,
    PREFERENCE_PAIRS: frozenset(), PROMPTS: frozenset(), UNPAIRED: frozenset()}
"""The data.* shaping settings each data format's reader takes; the others are refused as unused (config/rules.py
UNUSED). Labelled text takes the text settings to refuse them with a reason of its own (rules.check_data_format)."""
LM_LOSS, CLASSIFICATION, PAIR_LOSS, POLICY_GRADIENT = "lm-loss", "classification", "pair-loss", "policy-gradient"
PAIR_SCORE, UNPAIRED_LOSS = "pair-score", "unpaired-loss"
"""Objectives: the causal LM's next-token cross-entropy (the model's own loss), the classifier's cross-entropy
(the model's own loss on the label), a preference loss on chosen/rejected pairs (zerotrain/train/preference.py),
a clipped policy-gradient loss on completions the policy samples and reward functions score (GRPO,
zerotrain/train/grpo.py), the Bradley-Terry loss on a one-label head's scores of chosen and rejected (reward
models, zerotrain/train/reward_model.py), KTO's loss on completions labelled desirable or not against a KL
estimate (zerotrain/train/kto.py)."""
PARALLEL_DIMS = ("tp", "pp", "sp", "ep")
"""The model-parallel dimensions beside data parallelism (parallel.tp / pp / sp / ep)."""
FEATURES = ("packing", "fused_loss", "chunked_loss", "tiled_mlp", "lora", "qat")
"""The features a task may compose with: data.pack / data.packing, model.fused_loss, model.chunked_loss,
model.tiled_mlp, LoRA (lora.r), quantization-aware training (quant.qat)."""


@dataclass(frozen=True)
class PairLossSpec:
    """What a preference task's loss is (zerotrain/train/preference.py computes it by `family`)."""

    family: Literal["dpo", "simpo", "orpo", "kto"]
    """The loss formula (PreferenceLoss dispatches on the pair families): dpo (sigmoid or IPO, against a
    reference), simpo (length-normalized margin), orpo (odds ratio + NLL); kto (unpaired rows against a KL
    estimate: zerotrain/train/kto.py, which shares dpo's reference)."""
    default_beta: float
    """pref.beta when it is None: the paper's default (DPO's beta, SimPO's beta, ORPO's lambda)."""
    reference: bool
    """The loss compares against a reference model's log-probs (held, precomputed or LoRA's base)."""
    nll_weight: Optional[float]
    """Weight of the chosen rows' NLL term: a fixed number (orpo 1, simpo 0) or None: pref.rpo_alpha (dpo's RPO)."""
    nll_over: Literal["completion", "sequence"]
    """The tokens of the NLL term: the chosen completion (RPO, TRL's "sft" loss) or every token after the first,
    prompt included (TRL's ORPOTrainer)."""
    settings: frozenset[str]
    """The pref.* settings this loss reads; the others are refused as unused (config/rules.py UNUSED)."""
    per_token_logps: bool
    """The log-probs it trains on and reports are per-token means (SimPO, ORPO: TRL's CPO/ORPO) rather than sums."""


@dataclass(frozen=True)
class OnlineRLSpec:
    """What an online-RL task reads (GRPO and its loss variants: zerotrain/train/grpo.py)."""

    default_beta: float
    """pref.beta when it is None: the KL weight to the frozen reference (TRL's GRPOConfig.beta, 0: no reference)."""
    settings: frozenset[str]
    """The pref.* settings it reads (pref.beta, pref.max_prompt_len); the others are refused as unused."""


@dataclass(frozen=True)
class RewardModelSpec:
    """What a reward-model task reads (a Bradley-Terry loss on a one-label head: zerotrain/train/reward_model.py)."""

    settings: frozenset[str]
    """The pref.* settings it reads (pref.center_rewards_coef); the others are refused as unused."""


@dataclass(frozen=True)
class TaskSpec:
    """One task: everything the layers need to know about it, by field."""

    name: str
    """model.task's value (--task)."""
    summary: str
    """One line for docs and help."""
    data_format: Literal["text", "labelled-text", "preference-pairs", "prompts", "unpaired-completions", "image-chat"]
    """TEXT, LABELLED_TEXT, PREFERENCE_PAIRS, PROMPTS, UNPAIRED or IMAGE_CHAT: what the data layer reads, tokenizes and
    collates (its reader: zerotrain/data/datasets.py READERS)."""
    objective: Literal["lm-loss", "classification", "pair-loss", "policy-gradient", "pair-score", "unpaired-loss"]
    """LM_LOSS, CLASSIFICATION, PAIR_LOSS, POLICY_GRADIENT, PAIR_SCORE or UNPAIRED_LOSS: what a step minimizes."""
    auto_class: str
    """The transformers Auto class of the trained model, by name (the class itself: model_class)."""
    peft_task_type: str
    """peft's TaskType member for LoRA (model/lora.py peft_config); SEQ_CLS makes peft train the new head whole."""
    eval_metrics: tuple[str, ...]
    """The figures an evaluation reports, as metrics.jsonl names them, in order (the recipe's evaluate computes
    them; train/trainer.py evaluate writes them in this order and checks the set)."""
    recipe: str
    """`module:Class` of the Recipe that trains it (zerotrain/train/recipes/: its micro-batch source, objective,
    evaluation, step figures, checkpoint state and teardown), imported when a run builds it (recipes/base.py
    build_recipe), as plan/registry.py names engines; tests/unit/test_recipes.py resolves every one."""
    rows_per_sample: int = 1
    """Model rows one sample runs with gradients (a pair: chosen and rejected; KTO's mismatched KL rows run under
    no_grad before the step); the memory estimate's activations scale by it."""
    estimate_parts: tuple[str, ...] = ()
    """Rows the task may add to the memory estimate beside the policy's (memory/estimate.py): "reference" (the
    frozen reference copy, where holds_reference says it is held)."""
    preference: Optional[PairLossSpec] = None
    """Preference tuning: its pair loss; None for the other tasks."""
    online_rl: Optional[OnlineRLSpec] = None
    """Online RL (completions sampled from the policy during training): what it reads; None for the other tasks."""
    reward_model: Optional[RewardModelSpec] = None
    """A reward model (a one-label sequence classifier trained on pairs): what it reads; None for the other tasks."""
    head_labels: Optional[int] = None
    """A classifier head of fixed size (reward: 1 score); None: the label column says (seq-cls) or no head."""
    composes_with: frozenset[str] = field(default_factory=frozenset)
    """The PARALLEL_DIMS and FEATURES it runs with; the others are refused by name (config/rules.py:
    check_task_features, check_qat, check_preference, check_data_format, UNUSED; plan/parallel_rules.py for pp and
    sp) or, for the fused loss, turned off by its auto default (model/preparation.py)."""
    implied_by: Optional[str] = None
    """An entry no --task names: the task a run asks for (--task) that becomes this one on the model it fits
    (task_for_model: causal-lm on an image-text model trains image-text); None for the --task choices."""
    min_global_batch: int = 1
    """The fewest samples one optimizer step may take (KTO: 2, its KL estimate pairs each row with another row's
    completion of the same global batch; plan/resolve.py refuses fewer with min_global_batch_why)."""
    min_global_batch_why: str = ""
    """Why min_global_batch is above 1 (the refusal's reason)."""
    chunks_by_default: bool = False
    """Its objective's per-token log-probs go through the output head in chunks unless model.chunked_loss says
    otherwise (None: fused_loss.auto_chunk_tokens of the vocabulary, where the model's head carries it:
    model/preparation.py loss_chunk): grpo, whose completions' [tokens, vocab] logits (and their log-softmax and
    entropies) are the largest tensors of its step (benchmarks/RESULTS.md "Rollouts at scale": 0.259x the peak)."""
    streams: bool = False
    """Its training data can be read as a stream (data.streaming: tokenized and packed on the fly, split by rank,
    zerotrain/data/streaming.py): causal-lm's text and chat / prompt-completion samples; the others are refused by
    name (config/rules.py check_streaming)."""

    @property
    def next_token_loss(self) -> bool:
        """A step minimizes the model's own next-token loss (LM_LOSS: causal-lm, image-text), which takes the step's
        label-token count (backends/base.py local_label_tokens)."""
        return self.objective == LM_LOSS

    @property
    def model_class(self) -> Any:
        """The transformers Auto class itself (auto_class), which builds and loads the trained model."""
        import transformers

        return getattr(transformers, self.auto_class)

    @property
    def causal_lm(self) -> bool:
        """It trains an AutoModelForCausalLM (causal-lm and the preference tasks)."""
        return self.auto_class == "AutoModelForCausalLM"

    def composes(self, what: str) -> bool:
        """Whether the task runs with a parallel dimension or feature (PARALLEL_DIMS, FEATURES)."""
        if what not in PARALLEL_DIMS and what not in FEATURES:
            raise ValueError(f"{what!r} is no parallel dimension or feature ({', '.join(PARALLEL_DIMS + FEATURES)})")
        return what in self.composes_with

    # --- the task-dependent settings, resolved once ----------------------------------------------------------
    @property
    def classifier(self) -> bool:
        """It trains an AutoModelForSequenceClassification (a head over the last token: seq-cls, reward)."""
        return self.auto_class == "AutoModelForSequenceClassification"

    @property
    def reads_images(self) -> bool:
        """Its data are chats with images (IMAGE_CHAT): the model's processor reads them (model/source.py)."""
        return self.data_format == IMAGE_CHAT

    def reads_data(self, setting: str) -> bool:
        """Its data format's reader takes this data.* setting (DATA_SETTINGS)."""
        return setting in DATA_SETTINGS[self.data_format]

    @property
    def reads_pref(self) -> bool:
        """It reads pref.* settings (preference tuning, KTO, online RL, reward models): runs data parallel only."""
        return self.preference is not None or self.online_rl is not None or self.reward_model is not None

    @property
    def pref_settings(self) -> frozenset[str]:
        """The pref.* settings the task reads (a preference loss's, online RL's, a reward model's); the others are
        refused as unused."""
        for spec in (self.preference, self.online_rl, self.reward_model):
            if spec is not None:
                return spec.settings
        return frozenset()

    def beta(self, cfg: Any) -> float:
        """pref.beta, or the task's default when it is None (preference and online-RL tasks only)."""
        default = self.preference.default_beta if self.preference is not None else self.online_rl.default_beta
        return cfg.pref.beta if cfg.pref.beta is not None else default

    def reference(self, cfg: Any) -> Optional["ReferencePlan"]:
        """Where a run's reference log-probs come from; None when the task's loss has no reference (online RL:
        when its KL weight beta is 0)."""
        if self.online_rl is not None:
            return ReferencePlan(path=None, precomputed=False, adapters_off=cfg.lora.r > 0) if self.beta(cfg) > 0 \
                else None
        if self.preference is None or not self.preference.reference:
            return None
        p = cfg.pref
        return ReferencePlan(path=p.ref_model, precomputed=p.precompute_ref,
                             adapters_off=cfg.lora.r > 0 and p.ref_model is None)

    def holds_reference(self, cfg: Any) -> bool:
        """Whether the run holds a second model while it trains, the frozen reference copy (the one answer:
        train/reference.py builds it, memory/estimate.py sizes it, commands/estimate.py shows it)."""
        ref = self.reference(cfg)
        return ref is not None and ref.holds_copy


@dataclass(frozen=True)
class ReferencePlan:
    """A preference run's reference, resolved from pref.ref_model, pref.precompute_ref and LoRA."""

    path: Optional[str]
    """--ref-model: a HF model dir, hub id or an SFT run's final/; None: the policy's starting weights."""
    precomputed: bool
    """--precompute-ref: a pass before training stores the log-probs; training holds no reference model."""
    adapters_off: bool
    """LoRA without --ref-model: the policy with its adapters disabled is the reference (no second copy)."""

    @property
    def holds_copy(self) -> bool:
        """A frozen copy is held while training (neither precomputed nor LoRA's base)."""
        return not self.precomputed and not self.adapters_off


_PREF_COMMON = frozenset({"pref.beta", "pref.split_forward", "pref.max_prompt_len"})
_CAUSAL = dict(auto_class="AutoModelForCausalLM", peft_task_type="CAUSAL_LM")
_PAIRS = dict(_CAUSAL, data_format=PREFERENCE_PAIRS, objective=PAIR_LOSS, rows_per_sample=2,
              recipe="zerotrain.train.recipes.pairs:PairsRecipe",
              eval_metrics=("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies",
                            "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"),
              composes_with=frozenset({"sp", "chunked_loss", "tiled_mlp", "lora"}))

TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("causal-lm", "next-token prediction on text, chat or prompt-completion data", data_format=TEXT,
             objective=LM_LOSS, eval_metrics=("eval_loss", "eval_perplexity"), **_CAUSAL,
             recipe="zerotrain.train.recipes.lm:LMRecipe",
             composes_with=frozenset(PARALLEL_DIMS + FEATURES), streams=True),
    TaskSpec("seq-cls", "sequence classification on labelled text", data_format=LABELLED_TEXT,
             objective=CLASSIFICATION, auto_class="AutoModelForSequenceClassification", peft_task_type="SEQ_CLS",
             eval_metrics=("eval_loss", "eval_accuracy"), recipe="zerotrain.train.recipes.lm:ClassifierRecipe",
             composes_with=frozenset({"tp", "ep", "tiled_mlp", "lora"})),
    TaskSpec("dpo", "direct preference optimization against a reference model", estimate_parts=("reference",),
             preference=PairLossSpec("dpo", 0.1, reference=True, nll_weight=None, nll_over="completion",
                                     per_token_logps=False, settings=_PREF_COMMON | {
                                         "pref.loss", "pref.label_smoothing", "pref.rpo_alpha", "pref.ref_model",
                                         "pref.precompute_ref"}), **_PAIRS),
    TaskSpec("simpo", "simple preference optimization (reference-free)",
             preference=PairLossSpec("simpo", 2.0, reference=False, nll_weight=0.0, nll_over="completion",
                                     per_token_logps=True,
                                     settings=_PREF_COMMON | {"pref.label_smoothing", "pref.simpo_gamma"}), **_PAIRS),
    TaskSpec("orpo", "odds-ratio preference optimization (reference-free, with the NLL of the chosen)",
             preference=PairLossSpec("orpo", 0.1, reference=False, nll_weight=1.0, nll_over="sequence",
                                     per_token_logps=True, settings=_PREF_COMMON), **_PAIRS),
    TaskSpec("grpo", "online RL: completions sampled from the policy, scored by reward functions (GRPO, DAPO, "
             "Dr. GRPO, GSPO)", data_format=PROMPTS, objective=POLICY_GRADIENT, **_CAUSAL,
             estimate_parts=("reference", "generation"), eval_metrics=(),
             recipe="zerotrain.train.recipes.online_rl:OnlineRLRecipe",
             online_rl=OnlineRLSpec(0.0, frozenset({"pref.beta", "pref.max_prompt_len"})),
             composes_with=frozenset({"lora", "chunked_loss"}), chunks_by_default=True),
    TaskSpec("reward", "a reward model: a one-label sequence classifier trained on chosen/rejected pairs "
             "(Bradley-Terry)", data_format=PREFERENCE_PAIRS, objective=PAIR_SCORE,
             auto_class="AutoModelForSequenceClassification", peft_task_type="SEQ_CLS", rows_per_sample=2,
             head_labels=1, recipe="zerotrain.train.recipes.scored:RewardRecipe", reward_model=RewardModelSpec(frozenset({"pref.center_rewards_coef"})),
             eval_metrics=("eval_loss", "eval_accuracy", "eval_margin", "eval_mean_reward", "eval_min_reward",
                           "eval_max_reward"), composes_with=frozenset({"sp", "lora"})),
    TaskSpec("kto", "Kahneman-Tversky optimization: completions labelled desirable or not, one by one, against a "
             "reference", data_format=UNPAIRED, objective=UNPAIRED_LOSS,
             estimate_parts=("reference",), **_CAUSAL, min_global_batch=2,
             recipe="zerotrain.train.recipes.scored:UnpairedRecipe",
             min_global_batch_why="its KL estimate pairs each row with another row's completion of the same global "
                                  "batch",
             preference=PairLossSpec("kto", 0.1, reference=True, nll_weight=0.0, nll_over="completion",
                                     per_token_logps=False, settings=frozenset({
                                         "pref.beta", "pref.max_prompt_len", "pref.ref_model", "pref.precompute_ref",
                                         "pref.desirable_weight", "pref.undesirable_weight"})),
             eval_metrics=("eval_loss", "eval_kl", "eval_rewards/chosen", "eval_rewards/rejected",
                           "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected"),
             composes_with=frozenset({"sp", "lora"})),
)}
"""Every task, in --task's order."""

TASK_NAMES: tuple[str, ...] = tuple(TASKS)
"""model.task's choices (zerotrain/config/schema.py): --task's."""

IMPLIED_TASKS: dict[str, TaskSpec] = {t.name: t for t in (
    TaskSpec("image-text", "next-token prediction on chats with images (TRL's vision format), assistant tokens only: "
             "what causal-lm trains on an image-text model", data_format=IMAGE_CHAT, objective=LM_LOSS,
             auto_class="AutoModelForImageTextToText", peft_task_type="CAUSAL_LM",
             eval_metrics=("eval_loss", "eval_perplexity"), implied_by="causal-lm",
             recipe="zerotrain.train.recipes.lm:LMRecipe",
             composes_with=frozenset({"lora"})),
)}
"""Entries that --task does not name: a run's task resolves to one on the model it fits (task_for_model: the model's
source resolves it, zerotrain/model/source.py, and the run's plan holds it, RunPlan.task; model.task keeps the
asked task). image-text composes with no parallel dimension and no packing yet (an image's tokens would be split
across ranks or rows)."""

def image_text(hf_config: Any) -> bool:
    """Whether a HF config is an image-text model's, as transformers declares it: its model type is in the
    image-text-to-text auto mapping (AutoModelForImageTextToText builds it) and it has a vision sub-config
    (LLaVA, Qwen2-VL, Gemma 3, Mllama, ...; a text-only Gemma3TextConfig is neither)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return (getattr(hf_config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
            and "vision_config" in (getattr(hf_config, "sub_configs", None) or {}))


def task_for_model(name: str, hf_config: Any) -> TaskSpec:
    """The entry a run of --task `name` trains on a model of `hf_config`: an image-text model (its config class in
    transformers' image-text-to-text mapping, with a vision sub-config: facts.image_text) trains image-text for
    causal-lm (or image-text itself) and refuses the other tasks; any other model trains `name`, image-text refused.
    hf_config None (a model not known yet): `name`.
    ConfigError in one line."""
    spec = task_spec(name)
    implied = [t for t in IMPLIED_TASKS.values() if spec.name in (t.name, t.implied_by)]
    if hf_config is not None and image_text(hf_config):
        if not implied:
            kind = type(hf_config).__name__
            raise ConfigError(f"--task {name}: the model is an image-text model ({kind}); it trains with the default "
                              f"task (causal-lm, on chats with images); drop --task {name}")
        return implied[0]
    if spec.implied_by is not None:
        raise ConfigError(f"model.task={name}: the model is not an image-text model; use --task {spec.implied_by}")
    return spec


def task_of_model_class(class_name: str) -> TaskSpec:
    """The first task whose transformers Auto class builds the HF class `class_name` (transformers' own auto
    mappings: GPT2LMHeadModel -> causal-lm, LlamaForSequenceClassification -> seq-cls): what an exported LoRA
    checkpoint's base is loaded as. ConfigError for a class no task builds."""
    import transformers

    for spec in (*TASKS.values(), *IMPLIED_TASKS.values()):
        built = getattr(transformers, spec.auto_class)._model_mapping._model_mapping.values()
        if any(class_name == c or (isinstance(c, (tuple, list)) and class_name in c) for c in built):
            return spec
    raise ConfigError(f"{class_name}: no task of zerotrain trains this model class ({', '.join(TASK_NAMES)})")


def task_spec(name: str) -> TaskSpec:
    """The task named `name`; ConfigError (one line, the valid names) for any other."""
    try:
        return TASKS[name] if name in TASKS else IMPLIED_TASKS[name]
    except KeyError:
        raise ConfigError(f"model.task={name!r} is no task; pass --task with one of {', '.join(TASK_NAMES)}") from None


# --- capability rows the config rules read before a plan exists --------------------------------------------------
# config/ sits below plan/, so these rows of the capability table live here; plan/capabilities.py serves them to
# every layer above it. Each refusal's text is written here once (tests/unit/test_parallel_owner.py).

@dataclass(frozen=True)
class LayoutRefusal:
    """What does not run with some model-parallel dimensions yet (a kind of task, a feature), refused in one line."""

    dims: tuple[str, ...]
    """The dimensions refused, in the order the line names them."""
    why: str
    """Why, between "SETTING with --DIM N: " and "; pass --DIM 1"."""

    def line(self, setting: str, degrees: dict[str, int]) -> Optional[str]:
        """The refusal of `setting` (how the line names it, e.g. "--task grpo") with the degrees asked; None when
        none of the dimensions is in use."""
        if all(degrees.get(d, 1) <= 1 for d in self.dims):
            return None
        asked = " ".join(f"--{d} {degrees.get(d, 1)}" for d in self.dims)
        return f"{setting} with {asked}: {self.why}; pass {' '.join(f'--{d} 1' for d in self.dims)}"


LAYOUT_REFUSALS: dict[str, LayoutRefusal] = {
    "online_rl": LayoutRefusal(("sp",), "online RL under sequence parallelism is not built (its generation and "
                                        "per-token policy-gradient loss run whole sequences; dpo, simpo, orpo, kto and "
                                        "reward run with --sp)"),
    "qat": LayoutRefusal(("tp", "pp"), "QAT runs with data parallelism (ZeRO 0-3 / FSDP) only"),
}
"""online_rl: a task with an OnlineRLSpec (the sampled completions' log-probs are not cut over sp ranks); qat:
quant.qat (it fake-quantizes the whole model's Linears)."""

HEAD_SPLIT_DIMS: tuple[str, ...] = ("pp", "tp")
"""The dimensions whose split builds its own blocks and head, in the order checked: the tiled MLP, the chunked and the
fused loss do not compose with them (plan/capabilities.FEATURES), and the fused loss's auto is off under them
(model/preparation.py)."""

RL_LOSS_TYPES: tuple[str, ...] = ("grpo", "dapo", "dr_grpo", "bnpo")
"""The rl.loss_type values built (zerotrain/train/grpo_loss.py computes them; config/rules.py refuses any other)."""

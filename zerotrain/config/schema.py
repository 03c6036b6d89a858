"""Typed run config: every knob of a zerotrain run, with a default and a one-line doc.

A run config comes from defaults, then a YAML file (`--config run.yaml`), then CLI flags, the
last one winning (zerotrain/config/load.py builds it). Unknown keys are an error naming the closest valid key. Cross-field rules that
DeepSpeed would only catch at start-up (or silently ignore) live in zerotrain/config/rules.py and raise
`ConfigError` (a `UserError`, zerotrain/errors.py) with one line naming the setting and the fix.

Every leaf field is also a CLI flag (zerotrain/config/flags.py generates them): `--<leaf-name>` by default; a
field's `json_schema_extra` may name its flag ("flag"), the value of the flag given bare
("flag_const") and the help placeholder ("metavar").
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..tasks import TASK_NAMES


IMAGE_TEXT_ROLES = ("vision", "projector", "language")
"""The parts of an image-text model that model.freeze names (zerotrain/model/vision_roles.py finds each family's)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(_Section):
    name: Optional[str] = Field(None, json_schema_extra={"flag": "--model"})
    """HF hub id or local directory of the model to fine-tune; None builds the embedded tiny GPT-2."""
    task: Literal[TASK_NAMES] = "causal-lm"
    """causal-lm (AutoModelForCausalLM), seq-cls (AutoModelForSequenceClassification), or preference tuning of a
    causal LM on {prompt, chosen, rejected} pairs: dpo (against a reference model), simpo or orpo (reference-free);
    see the pref section; or online RL of a causal LM on prompts: grpo (see the rl section)."""
    from_config: Optional[str] = Field(None, json_schema_extra={"flag": "--model-config"})
    """A config.json path or a named tiny preset ('tiny-gpt2') to train from scratch instead of loading weights."""
    num_labels: Optional[int] = Field(None, ge=1)
    """Number of classes for seq-cls (2 or more); None infers it from the data. reward: 1 (its one score) or unset."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory (HF gradient_checkpointing_enable)."""
    tiled_mlp: int = Field(0, ge=0, json_schema_extra={"flag_const": 2048, "metavar": "TOKENS"})
    """Run every block's MLP over sequence tiles of this many tokens, recomputed in backward, so its
    [seq, intermediate] activations exist one tile at a time (long sequences; bare --tiled-mlp: 2048); 0 = off."""
    chunked_loss: Optional[int] = Field(None, ge=0, json_schema_extra={"flag_const": 2048, "metavar": "TOKENS"})
    """causal-lm: compute the head and the loss over chunks of this many tokens, so the [seq, vocab] logits never
    exist whole (long sequences, large vocabularies; bare --chunked-loss: 2048): fused (see fused_loss) where
    the head is a plain Linear, else recomputed in backward; None or 0: the fused loss's own chunk
    (fused_loss.auto_chunk_tokens) when it is on, else the whole logits. Preference tasks and grpo: their
    per-token log-probs (and grpo's entropies, old and reference log-probs) over such chunks, recomputed in
    backward; 0: the whole logits; None (auto): grpo chunks by default (fused_loss.auto_chunk_tokens of the
    vocabulary) where the model carries it (a model that transforms its logits, or a mixture of experts whose forward
    adds the router loss, runs whole: the banner says which), the preference tasks run the whole logits."""
    fused_loss: Optional[bool] = None
    """causal-lm: the output head and the cross-entropy computed together, chunk by chunk, with their gradients
    made in the forward (zerotrain/model/fused_loss.py; Liger-Kernel's kernel on a GPU where installed), so
    the [tokens, vocab] logits never exist whole and nothing is recomputed. None (auto): on where the model and
    layout carry it (a plain Linear head; no --tp/--pp), off elsewhere, the banner says which; true: required;
    false (--no-fused-loss): the model's own head and loss (with --chunked-loss: recomputed chunks)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] = "auto"
    """The model's attention kernel (transformers' attn_implementation): auto keeps transformers' choice (SDPA
    where the model supports it); eager materialises the [seq, seq] scores (estimate counts them); flash
    kernels need a CUDA GPU and their package. --sp runs its own all-to-all attention over SDPA."""
    offload_activations: bool = False
    """Keep the tensors saved for backward (with --gradient-checkpointing: only the blocks' inputs) in pinned
    host memory instead of GPU memory (torch.autograd.graph.save_on_cpu). GPU runs only."""
    router_aux_coef: Optional[float] = Field(None, ge=0.0)
    """Mixture-of-experts: weight of the router's load-balancing loss added to the LM loss (computed per rank
    and micro-batch inside the model's forward, as transformers does); None takes the model config's
    router_aux_loss_coef; 0 trains without it. Refused for models whose HF class defines none."""
    freeze_router: bool = False
    """Mixture-of-experts: keep the routers (each MoE block's gate) frozen, so routing stays as pretrained."""
    freeze: str = Field("", json_schema_extra={"metavar": "ROLES"})
    """Image-text models: a comma list of the parts that do not train, from vision (the image encoder), projector
    (what maps image features into the language model) and language (the decoder and its head), e.g.
    vision,projector; each family's modules are found from what transformers declares about it
    (zerotrain/model/vision_roles.py). Frozen parts get no gradients and no optimizer state. Refused on a text-only
    model; empty: every part trains."""


class DataConfig(_Section):
    path: Optional[str] = Field(None, json_schema_extra={"flag": "--data"})
    """Local .json/.jsonl/.csv/.txt/.parquet file(s) or a hub dataset id; None uses the embedded corpus. A comma list
    is concatenated (one file type), or mixed by data_weights (any file types); a directory written by `zerotrain
    data prepare` is read as it was tokenized there (its manifest must match the run's tokenizer and settings)."""
    data_weights: Optional[str] = Field(None, json_schema_extra={"flag": "--data-weights"})
    """Comma list of weights, one per --data source, making a mixture: a weight is the source's share of the
    training rows (packed text: of tokens too); a source that runs out restarts, an epoch ends when every source has
    been seen whole; the order follows --seed (zerotrain/data/mixture.py). None: a comma list is concatenated."""
    data_config: Optional[str] = None
    """Hub dataset configuration name (the second argument of datasets.load_dataset)."""
    split: str = "train"
    """Dataset split to train on."""
    text_column: str = "text"
    """Column that holds the input text."""
    label_column: str = "label"
    """Column that holds the class label (seq-cls only); strings or ints."""
    eval_path: Optional[str] = Field(None, json_schema_extra={"flag": "--eval-data"})
    """Separate evaluation file(s) or dataset id; None uses eval_split."""
    eval_split: float = Field(0.0, ge=0.0, lt=1.0)
    """Fraction of the training data held out for evaluation when eval_path is not given (0 = none)."""
    seq_len: int = Field(128, ge=8)
    """Tokens per sample: causal-lm texts are packed (or truncated) to this length."""
    pack: bool = True
    """causal-lm plain text: concatenate texts (EOS between them) and cut into seq_len blocks, the usual
    way to train on raw text (False truncates each text). Chat/prompt-completion data is never
    concatenated this way; see packing."""
    format: Literal["auto", "text", "chat", "prompt-completion"] = Field("auto", json_schema_extra={"flag": "--data-format"})
    """causal-lm data format: text (text_column), chat (a `messages` list of {role, content}),
    prompt-completion (`prompt`/`completion`, or Alpaca `instruction`/`input`/`output`); auto picks by columns."""
    chat_template: Optional[str] = None
    """Jinja chat template file, or 'chatml', for a tokenizer that has no chat template of its own."""
    train_on_prompt: bool = False
    """chat/prompt-completion: also train on prompt, system and user tokens (default: assistant/completion only)."""
    truncation: Literal["truncate", "drop"] = "truncate"
    """chat/prompt-completion samples longer than seq_len: cut at seq_len, or drop them (counted in the banner)."""
    packing: Literal["off", "separate"] = Field("off", json_schema_extra={"flag_const": "separate"})
    """separate: put several samples in one seq_len row, each with position ids restarting at 0 and
    attention kept inside its own sample (bare --packing); off: one sample per row (plain text keeps
    `pack`'s concatenation)."""
    loader_workers: int = Field(0, ge=0, le=64)
    """Processes that read and collate the training micro-batches ahead of the step (torch DataLoader
    num_workers; the batches and their order are the same for any value). 0: the training process reads
    them itself, between steps (measured faster on 2-core CPU ranks: benchmarks/RESULTS.md, loop cost)."""
    streaming: bool = False
    """Read --data as a stream (datasets' IterableDataset; local files, globs of shards or a hub id): split by
    data-parallel rank, tokenized and packed on the fly, so nothing reads the whole corpus before step 1. Needs
    --max-steps (a stream has no length); causal-lm only; --eval-data is read whole (map-style). Resume is exact:
    each rank's stream is re-read from its epoch's start and the consumed rows skipped untokenized
    (zerotrain/data/streaming.py)."""
    shuffle_buffer: int = Field(0, ge=0)
    """--streaming only: rows held in datasets' shuffle buffer (IterableDataset.shuffle, which also shuffles the
    order of the shards), reseeded every epoch from --seed; 0 reads the stream in file order."""


OffloadDevice = Literal["none", "cpu", "nvme"]


class ZeroConfig(_Section):
    stage: int = Field(2, ge=0, le=3)
    """ZeRO stage: 0 data parallel, 1 optimizer states, 2 + gradients, 3 + parameters sharded."""
    offload_optimizer: OffloadDevice = "none"
    """Where optimizer states live: none (device), cpu, or nvme (needs nvme_path); stage >= 1."""
    offload_param: OffloadDevice = "none"
    """Where parameters live between uses: none, cpu, or nvme; stage 3 only."""
    nvme_path: Optional[str] = None
    """Directory on a fast local NVMe drive for nvme offload."""
    reduce_bucket_size: Optional[int] = Field(None, gt=0)
    """Elements per gradient reduce bucket; None sizes it from the model (see plan.bucket_sizes)."""
    allgather_bucket_size: Optional[int] = Field(None, gt=0)
    """Elements per parameter all-gather bucket (stages 1-2); None sizes it from the model."""
    prefetch_bucket_size: Optional[int] = Field(None, ge=0)
    """Stage 3: elements of parameters prefetched ahead of use; None sizes it from the model."""
    param_persistence_threshold: Optional[int] = Field(None, ge=0)
    """Stage 3: tensors with fewer elements stay unpartitioned; None sizes it from the model."""
    max_live_parameters: Optional[int] = Field(None, ge=0)
    """Stage 3: most parameter elements gathered at once; None sizes it from the model."""
    overlap_comm: Optional[bool] = None
    """Overlap gradient reduction with backward; None picks per stage (DeepSpeed's choice)."""
    leaf_blocks: Optional[bool] = None
    """Stage 3, DeepSpeed: fetch, release and reduce each transformer block (the layer stack's
    members, model_info.transformer_blocks) as one ZeRO-3 leaf module (DeepSpeed's `leaf_module`),
    the unit FSDP shards by, instead of one hook per Linear/LayerNorm. None (auto): on for the model
    types it was measured faster on (plan.LEAF_BLOCKS_MEASURED), off elsewhere; true/false force
    it. Only written when the model is known (--model / the trainer / the engine)."""
    reduce_scatter: Optional[bool] = None
    """Stages 1-2: reduce gradients by per-rank slices (True) or one all-reduce per bucket (False);
    None: True on GPUs, False on CPU ranks (gloo), where it is never slower (benchmarks/RESULTS.md, GPT-2)."""


class PrecisionConfig(_Section):
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", json_schema_extra={"flag": "--precision"})
    """Training precision; bf16/fp16 keep fp32 master weights in the optimizer."""
    loss_scale: float = Field(0.0, ge=0.0)
    """fp16 only: static loss scale, 0 = dynamic loss scaling."""
    initial_scale_power: int = Field(16, ge=0, le=32)
    """fp16 only: dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = Field(1000, ge=1)
    """fp16 only: steps without overflow before the scale grows."""
    hysteresis: int = Field(2, ge=1)
    """fp16 only: overflows tolerated before the scale shrinks."""
    min_loss_scale: float = Field(1.0, gt=0.0)
    """fp16 only: the dynamic scale never goes below this."""


class BatchConfig(_Section):
    micro_batch: int = 4
    """Samples per rank per forward/backward."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    global_batch: Optional[int] = None
    """Samples per optimizer step over all ranks; if set, grad_accum is derived from it and the world size."""


class OptimizerConfig(_Section):
    name: Literal["adamw", "adam", "sgd", "muon"] = Field("adamw", json_schema_extra={"flag": "--optimizer"})
    """Optimizer; CPU offload needs adamw/adam (DeepSpeedCPUAdam). muon: torch.optim.Muon on the 2-D matrices inside
    the transformer blocks, AdamW (lr, betas, eps, weight_decay) on the rest (--backend fsdp without offload, LoRA or tp/pp/sp/ep for now)."""
    lr: float = 5e-5
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(1e-8, gt=0.0)
    """Adam epsilon."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay (adamw) or L2 (adam, sgd)."""
    momentum: float = Field(0.0, ge=0.0)
    """SGD momentum."""
    muon_momentum: float = Field(0.95, ge=0.0, lt=1.0)
    """Muon's (Nesterov) momentum, torch.optim.Muon's momentum."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """How Muon scales --lr per matrix (torch.optim.Muon's adjust_lr_fn): match_rms_adamw (0.2 * sqrt(max(fan_out,
    fan_in)), the Moonlight recipe: AdamW's lr works for both) or original (sqrt(max(1, fan_out / fan_in)))."""
    clip: float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables clipping."""


class ScheduleConfig(_Section):
    name: Literal["cosine", "linear", "constant"] = Field("cosine", json_schema_extra={"flag": "--schedule"})
    """LR shape after warmup: cosine or linear decay to min_lr_ratio * lr, or constant."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 to lr."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Final LR as a fraction of lr for cosine/linear decay."""


class RunSection(_Section):
    max_steps: Optional[int] = Field(None, ge=1)
    """Optimizer steps to train; None trains for `epochs` epochs."""
    epochs: float = Field(1.0, gt=0.0)
    """Passes over the training data when max_steps is None."""
    seed: int = 42
    """Seed for model init, data order and dropout."""
    output: str = "runs/zerotrain"
    """Output directory: configs, metrics.jsonl, checkpoints/, final/."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N optimizer steps (0 = only at the end)."""
    keep_last: int = Field(2, ge=1)
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    async_save: bool = False
    """Write checkpoints in the background: training goes on once the state is copied to host memory (one more
    copy of this rank's model and optimizer state, until its write ends); the checkpoint becomes `latest` at
    the first step boundary after every rank's write finished. At most one save in flight."""
    eval_every: int = Field(0, ge=0)
    """Evaluate every N optimizer steps (0 = only at the end, if there is eval data)."""
    log_every: int = Field(1, ge=1)
    """Write a metrics line every N optimizer steps."""
    resume: Optional[str] = Field(None, json_schema_extra={"flag_const": "latest", "metavar": "PATH"})
    """'latest' resumes from the newest complete checkpoint in output; 'auto' does too, or starts fresh when there
    is none (a restarted elastic worker group); a path resumes from that one."""
    trust_checkpoint: bool = False
    """Read the resumed checkpoint's files as they are, unpickling whatever they hold. Without it they are read
    safely (tensors, plain containers and the few types DeepSpeed's files hold), and a file that needs any other type
    is refused: set it only for a checkpoint you trust (one you wrote), since a crafted file can run code."""
    overwrite: bool = False
    """Allow writing into an output dir that holds another run's checkpoints (they are removed)."""
    tensorboard: bool = False
    """Also write TensorBoard event files under output/tensorboard (the same as report_to tensorboard)."""
    report_to: str = "none"
    """Experiment trackers, comma list of none, tensorboard, mlflow, wandb: the metrics.jsonl figures
    and the run config. MLflow logs to $MLFLOW_TRACKING_URI or sqlite:///OUTPUT/mlflow.db; W&B runs
    offline without an API key."""
    save_final: bool = True
    """Write a HF save_pretrained model + tokenizer to output/final at the end."""
    tune_malloc: bool = True
    """Fix glibc malloc's mmap/trim thresholds (32/64 MiB) when the engine starts: steadier, faster CPU steps (see zerotrain/distributed/host_malloc.py)."""


class ParallelConfig(_Section):
    tp: int = Field(1, ge=1)
    """Tensor-parallel degree: ranks that split every transformer block's linear layers and read the
    same batch (FSDP: DTensor with the model's HF tp_plan; DeepSpeed: AutoTP, ZeRO 0-2).
    Data-parallel size = world / (tp x pp)."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel degree: ranks that each hold a contiguous slice of the transformer blocks
    (embeddings on the first stage, final norm + head on the last); the grad_accum micro-batches of a
    step are the pipeline's micro-batches. Decoder-only causal LMs (GPT-2, Llama, Qwen2, Mistral);
    DeepSpeed runs it at ZeRO 0-1."""
    sp: int = Field(1, ge=1)
    """Sequence-parallel degree: ranks that split every sample's sequence and read the same batch (Ulysses
    attention: an all-to-all turns the sequence shards into head shards around attention, so each rank's
    activations are ~1/sp of the sequence's). Both backends (ZeRO / FSDP2 shard over dp x sp); causal LMs, sliding-window
    and packed batches included (their masks are rebuilt for the whole sequence, docs/long-context.md); attention
    heads (and key/value heads, or sp a multiple of them) divisible by sp.
    Data-parallel size = world / (tp x pp x sp)."""
    ep: int = Field(1, ge=1)
    """Expert-parallel degree (mixture-of-experts models): every ep neighbouring data-parallel ranks split each
    MoE block's routed experts, 1/ep each, and send every token to its experts' ranks and back with all-to-all
    (transformers' expert-parallel dispatch). Each rank still reads its own batch: the dense parameters are
    data-parallel over the whole world, the experts over world / ep ranks. FSDP2 backend, stages 1-3."""


class LoraSection(_Section):
    r: int = Field(0, ge=0, json_schema_extra={"flag": "--lora-r"})
    """LoRA rank (HF peft); 0 trains every weight (no LoRA)."""
    alpha: float = Field(16.0, gt=0.0, json_schema_extra={"flag": "--lora-alpha"})
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0, json_schema_extra={"flag": "--lora-dropout"})
    """Dropout on the LoRA input."""
    targets: str = Field("all-linear", json_schema_extra={"flag": "--lora-targets"})
    """Modules that get adapters: 'all-linear' (every Linear/Conv1D except the output head) or a comma
    list of module names (e.g. q_proj,v_proj)."""
    scope: Optional[Literal["language", "all"]] = Field(None, json_schema_extra={"flag": "--lora-scope"})
    """Image-text models: where the adapters go: language (the language model's modules only; the image encoder
    and projector stay as they are) or all (the image encoder and projector too, less the parts --freeze names);
    --lora-targets picks the module names inside it. None (not set): language. Refused on a text-only model."""
    merge: bool = Field(False, json_schema_extra={"flag": "--merge-lora"})
    """Also write final/merged/: the base model with the adapter merged in, a plain HF model."""


class QuantSection(_Section):
    qat: Literal["none", "int4-weight", "int8-dynamic-int4-weight"] = Field("none", json_schema_extra={"flag": "--qat"})
    """Quantization-aware training (torchao fake-quantized Linear layers): the scheme the model will be
    served in; final/quantized-<scheme>/ holds the converted model (zerotrain/model/quant.py)."""
    group_size: int = Field(32, gt=0, json_schema_extra={"flag": "--quant-group-size"})
    """int4 schemes: weights per quantization group along each Linear's input dimension (must divide
    every quantized Linear's in_features)."""


class CompileSection(_Section):
    enabled: bool = Field(False, json_schema_extra={"flag": "--compile"})
    """Compile each transformer block with torch.compile before the engine wraps the model (regional
    compilation, torchtitan's way: the blocks share one compiled code; zerotrain/model/compile.py). The first
    step pays the compile (the run prints how long); data padded to its longest row compiles for any length,
    packed text for static shapes. Both backends, every ZeRO stage; with LoRA and gradient checkpointing; not with
    --tp/--pp/--sp/--ep."""
    mode: Literal["default", "max-autotune-no-cudagraphs"] = Field("default", json_schema_extra={"flag": "--compile-mode"})
    """torch.compile's mode (CUDA graphs are out: ZeRO-3 and FSDP2 move parameters between steps)."""
    backend: Literal["inductor", "aot_eager"] = Field("inductor", json_schema_extra={"flag": "--compile-backend"})
    """torch.compile's backend: inductor (generated kernels: the speed) or aot_eager (traced but run by eager
    kernels: checks that the model compiles, as the tests do, without inductor's code generation)."""


class PreferenceSection(_Section):
    beta: Optional[float] = Field(None, ge=0.0)
    """dpo: the KL weight beta (TRL's beta; IPO's tau); simpo: the reward scale beta; orpo: the odds-ratio weight
    lambda; grpo: the KL weight to a frozen reference (0: no reference, the only task where 0 is allowed). None
    takes the paper's or TRL's default: dpo 0.1, simpo 2.0, orpo 0.1, grpo 0.0, kto 0.1 (KTO's beta)."""
    loss: Literal["sigmoid", "ipo"] = Field("sigmoid", json_schema_extra={"flag": "--dpo-loss"})
    """dpo: sigmoid (the DPO paper's -log sigmoid(beta x margin)) or ipo (IPO's squared loss on the per-token
    averaged margin, as TRL computes it)."""
    label_smoothing: float = Field(0.0, ge=0.0, lt=0.5)
    """dpo sigmoid and simpo: the probability that a pair's preference is flipped (conservative DPO, cDPO):
    -(1-e) log sigmoid(z) - e log sigmoid(-z); 0 = plain DPO."""
    rpo_alpha: float = Field(0.0, ge=0.0)
    """dpo: weight of the NLL of the chosen completions added to the loss (RPO; TRL's loss_type
    ["sigmoid", "sft"] with loss_weights [1, rpo_alpha]); the token mean over the whole global batch. 0 = off."""
    simpo_gamma: float = Field(0.5, ge=0.0)
    """simpo: the target reward margin gamma (TRL CPOConfig.simpo_gamma)."""
    ref_model: Optional[str] = None
    """dpo: the reference model: a HF model dir or hub id, or an SFT run's final/ (a merged model, or a LoRA
    adapter dir, merged into its base when loaded). None: the policy's starting weights (with LoRA: the base
    with the adapters disabled, no second copy)."""
    precompute_ref: bool = False
    """dpo: one pass over the data before training stores the reference's log-probabilities (in the run dir,
    reference_logps.pt), then training holds no reference model."""
    split_forward: bool = Field(False, json_schema_extra={"flag": "--dpo-split-forward"})
    """Run chosen and rejected as two forward passes (half the rows each: half the largest transient, the
    [rows, seq, vocab] logits) instead of one concatenated forward (one weight gather per step under ZeRO-3)."""
    max_prompt_len: Optional[int] = Field(None, ge=1)
    """Keep only the last this-many prompt tokens (the ones next to the completion) before the --seq-len
    truncation (grpo: before generating, as TRL's max_prompt_length); None keeps the whole prompt."""
    center_rewards_coef: Optional[float] = Field(None, ge=0.0)
    """reward: TRL's center_rewards_coefficient, adding coef x mean((r_chosen + r_rejected)^2) to the loss so the
    scores stay centred on 0 (Eisenstein et al. 2023 use 0.01); None: off."""
    desirable_weight: float = Field(1.0, gt=0.0)
    """kto: the weight of the desirable (label true) rows' losses (TRL's desirable_weight); with unbalanced data
    TRL's range is warned about at the start."""
    undesirable_weight: float = Field(1.0, gt=0.0)
    """kto: the weight of the undesirable (label false) rows' losses (TRL's undesirable_weight)."""


class OnlineRLSection(_Section):
    """--task grpo: completions sampled from the policy and scored by reward functions (TRL 1.16's GRPOConfig names
    and defaults; pref.beta is the KL weight, pref.max_prompt_len the prompt cut)."""

    reward_funcs: Optional[str] = None
    """Comma list of reward functions, each a Python file path and a function name after a colon, or
    `package.module:fn`, with TRL's signature fn(prompts, completions, completion_ids, **columns) -> list[float |
    None]."""
    reward_weights: Optional[str] = None
    """Comma list of weights, one per reward (--reward-model first, then the functions, as TRL orders them); None:
    all 1.0. The reward of a
    completion is the weighted sum (a None from a function is skipped, as TRL's nansum)."""
    reward_model: Optional[str] = None
    """A HF dir or hub id of a 1-label sequence classifier scoring prompt + completion with its own tokenizer (a
    reward model, e.g. a `--task reward` run's final/); one more reward beside the functions."""
    num_generations: int = Field(8, ge=2)
    """Completions sampled per prompt (TRL's G); the group whose rewards are compared. --global-batch and
    --micro-batch count completions, so the global batch must be a multiple of it."""
    max_completion_len: int = Field(512, ge=1)
    """The most tokens a completion may have (TRL's max_completion_length); one cut there is 'clipped'."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0: off)."""
    top_k: int = Field(0, ge=0)
    """Keep only the top_k most likely tokens (0: off)."""
    loss_type: str = "dapo"
    """grpo (each completion's token mean, then the mean over completions), dapo (the token mean over the
    global batch: TRL's default), dr_grpo (the token sum / (completions x max_completion_len)) or bnpo (the token
    mean over the global batch; TRL: over the local batch). TRL's other loss types are refused by name."""
    epsilon: float = Field(0.2, gt=0.0)
    """The clipping range's lower side: the importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]."""
    epsilon_high: Optional[float] = Field(None, gt=0.0)
    """The clipping range's upper side (DAPO's clip-higher); None: epsilon."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """token: one importance ratio per token (GRPO); sequence: one per completion, the geometric mean of its
    tokens' ratios (GSPO)."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer passes over each generation batch (TRL's mu); above 1 the old log-probs are kept from the
    generation and the ratio is clipped against them."""
    steps_per_generation: Optional[int] = Field(None, ge=1)
    """Micro-steps between generations, as TRL counts them (a generation batch is steps_per_generation x
    micro-batch x ranks completions); a multiple of --grad-accum. None: --grad-accum (one generation per optimizer
    step)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide each advantage (reward - its group's mean) by the std of its group, of the whole generation batch,
    or not at all (Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """Completions cut at max_completion_len count no tokens in the loss (DAPO)."""
    log_completions_every: int = Field(0, ge=0)
    """Every N optimizer steps, write the generation batch's completions (every rank's, as TRL logs them) with their
    rewards and advantages to OUTPUT/completions.jsonl (and a table to W&B where it reports); 0: never."""
    generation_gather: Literal["phase", "forward"] = "phase"
    """How sharded weights (ZeRO-3, FSDP2) reach generation: phase gathers them once per generation phase (the
    whole model on every rank meanwhile, as DeepSpeed-Chat's hybrid engine); forward gathers per forward as in
    training (one gather per generated token: slow, kept to measure against)."""
    rollout_engine: Literal["batched", "exact"] = "batched"
    """How a rank generates its completions: batched (its prompts of a generation batch in as few transformers
    `generate` calls as rl.rollout_rows allows, left-padded: the fastest, benchmarks/results/grpo_speed_rollouts.md) or
    exact (each prompt's group in a call of its own, unpadded: 2 ranks sample bitwise what one process samples).
    Both sample every completion with its own seeded generator (zerotrain/backends/generation.py)."""
    cache_implementation: Optional[Literal["dynamic", "static"]] = None
    """The rollout `generate` calls' KV cache (TRL's cache_implementation, transformers' GenerationConfig name): None
    or dynamic (transformers' default, grown a token at a time) or static (allocated once per call for the longest
    prompt plus max_completion_len; the same tokens as dynamic in the tests, its log-probs within fp32 rounding);
    a model whose layers have no static cache in transformers is refused."""
    rollout_rows: int = Field(0, ge=0)
    """batched: the most completions one `generate` call samples (whole groups, at least one; 0: all of a rank's
    generation batch in one call). Its KV cache grows with it: lower it when generation runs out of memory."""
    use_vllm: bool = False
    """Generate with vLLM: not built yet (refused)."""


class RunConfig(_Section):
    """A whole zerotrain run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """What to train."""
    data: DataConfig = Field(default_factory=DataConfig)
    """What to train on."""
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO sharding and offload."""
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    """Numeric precision and fp16 loss scaling."""
    batch: BatchConfig = Field(default_factory=BatchConfig)
    """Batch arithmetic."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Model parallelism beside data parallelism."""
    lora: LoraSection = Field(default_factory=LoraSection)
    """LoRA adapters (HF peft) instead of full fine-tuning."""
    quant: QuantSection = Field(default_factory=QuantSection)
    """Quantization-aware training."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """Optimizer and gradient clipping."""
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """Learning-rate schedule."""
    run: RunSection = Field(default_factory=RunSection)
    """Length, seed, output and cadences."""
    backend: Literal["auto", "deepspeed", "fsdp"] = "auto"
    """auto picks DeepSpeed when it imports, else PyTorch FSDP2."""
    dist_timeout_s: float = Field(300.0, gt=0.0, json_schema_extra={"flag": "--dist-timeout"})
    """Seconds any collective may wait before the job fails (no rank hangs forever); the rank that times out
    writes OUTPUT/hang/rank<R>.txt (zerotrain/distributed/watchdog.py)."""
    hang_timeout_s: float = Field(300.0, ge=0.0, json_schema_extra={"flag": "--hang-timeout"})
    """Seconds without a finished optimizer step after which a rank stuck outside any collective dumps its stack
    to OUTPUT/hang/ and ends (so an elastic agent restarts the job); at least 5x the slowest step so far; 0 turns
    the watchdog off. Saves, evaluation and export are not timed by it (their collectives are bounded by
    --dist-timeout)."""
    compile: CompileSection = Field(default_factory=CompileSection)
    """torch.compile of the transformer blocks."""
    pref: PreferenceSection = Field(default_factory=PreferenceSection)
    """Preference tuning (model.task dpo, simpo, orpo; grpo reads beta and max_prompt_len)."""
    rl: OnlineRLSection = Field(default_factory=OnlineRLSection)
    """Online RL (model.task grpo)."""
    ds_overrides: dict[str, Any] = Field(default_factory=dict)
    """Raw DeepSpeed config keys merged last into the generated config; a conflict with a set field is an error."""


# ----------------------------------------------------------------------------------------------
# field paths, for unknown-key suggestions and CLI overrides

def field_paths(model_cls: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the config as a dotted path ('zero.stage', 'optimizer.lr', ...)."""
    paths = []
    for name, info in model_cls.model_fields.items():
        key = info.alias or name
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            paths += field_paths(ann, f"{prefix}{key}.")
        else:
            paths.append(prefix + key)
    return paths

"""Sampling completions from the policy under sharding: the generation view of an engine (Engine.generation_phase).

    params = SamplingParams(max_new_tokens=64, temperature=1.0, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    with engine.generation_phase(params) as gen:         # every rank enters it together
        for i, prompt in my_prompts:                      # this rank's share
            c = gen.generate(prompt, num=8, seed=seed_of(step, i))

It copies nothing: generate runs transformers' own `generate` (KV cache, TRL's sampling settings) on the policy
itself, under LoRA through the peft model with its adapters applied (no merged second copy). Where the policy's
weights are sharded (DeepSpeed ZeRO-3, FSDP2 stages 1-3) SamplingParams.gather says how they reach the forward:

- "phase": gathered ONCE for the whole phase and released at its end (DeepSpeed-Chat's hybrid engine; TRL's
  unwrap_model_for_generation under ZeRO-3). Every rank then holds the WHOLE model for the phase (plus its KV
  cache): memory of an unsharded model, the price of generating without a collective per token. No rank waits
  for another while it generates (any number of calls, any lengths); the phase's end is where they meet.
- "forward": nothing gathered ahead; every forward gathers layer by layer as in training (memory stays sharded,
  one whole-model gather per generated token; FSDP2 holds its root's own parameters, embeddings and head, for the
  phase, as it keeps them between a training forward and its backward). Every rank must then run the same forwards: generate steps in
  lockstep (transformers' synced_gpus: a rank whose completions ended keeps stepping until every rank is done),
  and every rank must make the same number of generate calls in the phase.

Where nothing is sharded (DeepSpeed stages 0-2, FSDP2 stage 0 = DDP) both generate directly.

Sampling: every completion draws from its own torch.Generator, seeded by (the caller's seed of its prompt, its index
in the prompt's group): transformers' greedy step takes the argmax of the warped scores (temperature, top-k, top-p,
as TRL's GenerationConfig sets them) plus Gumbel noise from the row's generator (RowSampler), which is a sample of
the warped softmax (the Gumbel-max trick). A completion's tokens therefore depend only on its own seed and logits,
never on which other rows share its call. The caller derives the seed from (run seed, step, prompt index in the
global batch).

Two ways to call it (rl.rollout_engine):
- `generate`: ONE prompt's group per call, unpadded ("exact"): the call's shapes, and so its logits bitwise, do not
  depend on how prompts fall on ranks, so 1 process and N ranks draw the same completions for the same
  (seed, prompt, weights). The layout-invariance tests use it.
- `generate_batch`: many prompts' groups per call, left-padded with an attention mask ("batched", the default):
  one decoding loop for a rank's whole generation batch instead of one per prompt. A token still depends only on
  its row's seed and logits, but padding and the batch's size change the logits' last bits, so a completion can
  differ from its exact-mode twin where two tokens are near-tied (docs/rl.md measures how often).

Either way the KV cache is transformers' (SamplingParams.cache_implementation, rl.cache_implementation): dynamic by
default, or static, allocated per call for its longest prompt plus max_new_tokens and sized by that call alone, so an
exact call's shapes still depend on its own prompt only (its logits differ from the dynamic cache's in the last bits).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Union

import torch

from ..model import lora

GATHER_MODES: dict[str, str] = {
    "phase": "the sharded weights gathered once per generation phase (the whole model on every rank for the phase)",
    "forward": "each forward gathers the layers as in training (ranks step in lockstep until all are done)",
}
"""SamplingParams.gather's choices."""

CACHE_IMPLEMENTATIONS: tuple[Optional[str], ...] = (None, "dynamic", "static")
"""SamplingParams.cache_implementation's choices: transformers' GenerationConfig names that run on any device (its
offloaded caches move layers to host memory from an accelerator; its quantized cache needs the quanto package)."""


@dataclass(frozen=True)
class SamplingParams:
    """How one generation phase samples (TRL's GRPOTrainer GenerationConfig for its transformers path)."""

    max_new_tokens: int
    """The most tokens a completion gets (TRL's max_completion_length); EOS included."""
    pad_token_id: int
    """What fills a completion after its EOS (and the batch's shorter rows)."""
    eos_token_id: Union[int, list[int], None] = None
    """Token(s) that end a completion (TRL: the tokenizer's EOS); None: every completion runs max_new_tokens."""
    temperature: float = 1.0
    """Softmax temperature of sampling (> 0; greedy decoding is not offered)."""
    top_p: float = 1.0
    """Nucleus sampling's probability mass (1.0: off)."""
    top_k: int = 0
    """Sample among the k likeliest tokens (0: off)."""
    gather: str = "phase"
    """How sharded weights reach the forward: GATHER_MODES ("phase" or "forward")."""
    cache_implementation: Optional[str] = None
    """transformers' KV cache of the calls (CACHE_IMPLEMENTATIONS; TRL's cache_implementation): None: its default
    (dynamic: grown a token at a time); "static": allocated once per call for the prompt plus max_new_tokens."""

    def __post_init__(self) -> None:
        if self.gather not in GATHER_MODES:
            raise ValueError(f"SamplingParams.gather must be one of {', '.join(GATHER_MODES)} (got {self.gather!r})")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1 (got {self.max_new_tokens})")
        if not self.temperature > 0.0:
            raise ValueError(f"SamplingParams.temperature must be > 0 (got {self.temperature}); greedy is not offered")
        if self.cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(f"SamplingParams.cache_implementation must be one of "
                             f"{', '.join(map(str, CACHE_IMPLEMENTATIONS))} (got {self.cache_implementation!r})")
        if not 0.0 < self.top_p <= 1.0 or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_p must be in (0, 1] and top_k >= 0 (got {self.top_p}, {self.top_k})")

    @property
    def eos_ids(self) -> list[int]:
        """eos_token_id as a list (empty: none)."""
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def generation_config(self) -> Any:
        """transformers' GenerationConfig of a phase: TRL's for its non-vLLM path (no compile), with the KV cache
        asked for explicitly (a gradient-checkpointed model's config turns use_cache off). Its decoding step is
        greedy: the sampling is the warpers' and RowSampler's, in the logits processors (`warpers`)."""
        from transformers import GenerationConfig

        return GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self.pad_token_id,
                                eos_token_id=self.eos_token_id, repetition_penalty=1.0, use_cache=True,
                                disable_compile=True, cache_implementation=self.cache_implementation)

    def warpers(self) -> list[Any]:
        """transformers' logits warpers of these settings, in the order its sampling applies them (temperature,
        top-k, top-p); the ones that change nothing are left out, as transformers leaves them out."""
        from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        out: list[Any] = []
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p))
        return out


class LogpRecorder:
    """A logits processor placed after the temperature warper (before top-k / top-p): the log-prob, under
    softmax(logits / temperature), of each token the call samples. A step's token is known only after the step, so
    each call keeps its log-softmax ([rows, vocab], one step's) and reads the previous step's token from input_ids;
    `finish` reads the last one from the call's output."""

    def __init__(self) -> None:
        self._pending: Optional[torch.Tensor] = None
        self._steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self._pending is not None:
            self._steps.append(self._pending.gather(1, tokens.unsqueeze(1)).squeeze(1))
            self._pending = None

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[rows, steps]: the log-prob of every sampled token (last_tokens: the call's last column)."""
        self._take(last_tokens)
        if not self._steps:
            return torch.zeros((last_tokens.shape[0], 0), device=last_tokens.device)
        return torch.stack(self._steps, dim=1)


def row_seed(seed: int, index: int) -> int:
    """The seed of completion `index` of a prompt whose group is seeded `seed` (its own generator's)."""
    return (int(seed) * 1_000_003 + int(index) + 1) % (2**63 - 1)


class RowSampler:
    """A logits processor that samples each row with its own generator: the scores (already warped) plus standard
    Gumbel noise drawn from the row's torch.Generator, so that transformers' greedy argmax is a sample of the
    row's softmax (the Gumbel-max trick: argmax(s + G) ~ Categorical(softmax(s))). Masked scores (-inf) stay -inf.
    Each row draws one vocabulary-wide uniform per decoding step, whatever the other rows do."""

    def __init__(self, seeds: list[int], device: torch.device):
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise RuntimeError(f"RowSampler: {scores.shape[0]} rows scored, {len(self.generators)} generators")
        vocab = scores.shape[1]
        uniform = torch.stack([torch.rand(vocab, generator=g, device=scores.device, dtype=torch.float32)
                               for g in self.generators])
        tiny = torch.finfo(torch.float32).tiny
        gumbel = -torch.log(-torch.log(uniform.clamp_min(tiny)))
        return scores.float() + gumbel


@dataclass
class Completions:
    """The `num` completions of one prompt (GenerationView.generate)."""

    completion_ids: torch.Tensor
    """LongTensor [num, L], L the longest completion (<= max_new_tokens), right-padded with pad_token_id after EOS."""
    lengths: torch.Tensor
    """LongTensor [num]: each completion's tokens, its EOS included."""
    truncated: torch.Tensor
    """BoolTensor [num]: no EOS within max_new_tokens (TRL's clipped completions)."""
    sampling_logps: Optional[torch.Tensor] = None
    """FloatTensor [num, L]: each sampled token's log-prob under the generation forward's softmax(logits /
    temperature) (LogpRecorder; 0 after a completion's end): what TRL's sampling_logp_difference compares with the
    training forward's."""

    @property
    def mask(self) -> torch.Tensor:
        """[num, L] 1 on each completion's tokens (EOS included), 0 on the padding (TRL's completion_mask)."""
        steps = torch.arange(self.completion_ids.shape[1], device=self.lengths.device)
        return (steps.unsqueeze(0) < self.lengths.unsqueeze(1)).long()


def completions_of(new_tokens: torch.Tensor, eos_ids: list[int], pad_token_id: int) -> Completions:
    """Completions from generate's new tokens [num, L]: each ends at its first EOS (TRL's eos_idx), the rest set to
    pad_token_id."""
    num, width = new_tokens.shape
    if eos_ids:
        is_eos = torch.isin(new_tokens, torch.tensor(eos_ids, device=new_tokens.device))
    else:
        is_eos = torch.zeros_like(new_tokens, dtype=torch.bool)
    ended = is_eos.any(dim=1)
    first = torch.where(ended, is_eos.int().argmax(dim=1), torch.full((num,), width, device=new_tokens.device))
    lengths = torch.where(ended, first + 1, first)
    steps = torch.arange(width, device=new_tokens.device).unsqueeze(0)
    ids = torch.where(steps < lengths.unsqueeze(1), new_tokens, torch.full_like(new_tokens, pad_token_id))
    return Completions(ids, lengths.long(), ~ended)


@dataclass
class GenerationStats:
    """What one generation phase did on this rank (Engine.last_generation; the benchmark's tokens/s)."""

    gather: str
    """The phase's SamplingParams.gather."""
    sharded: bool
    """Whether the policy's weights are sharded (else nothing was gathered, both modes generate directly)."""
    lockstep: bool
    """Whether generate stepped in lockstep with the other ranks (transformers' synced_gpus)."""
    gathers: int = 0
    """Whole-model gathers: 1 for a sharded "phase"; under "forward" one per forward (each gathers every layer)."""
    calls: int = 0
    """transformers `generate` calls (exact mode: one per prompt; batched: as --rollout-rows allows)."""
    forwards: int = 0
    """Model forwards (prefill + one per decoding step; under lockstep also the steps a finished rank idles)."""
    cached_forwards: int = 0
    """Forwards fed one new token per row (the KV cache at work): forwards - calls when the cache is on."""
    tokens: int = 0
    """Completion tokens sampled (EOS included, padding not)."""
    seconds: float = 0.0
    """Wall time inside generate calls."""
    gather_seconds: float = 0.0
    """Wall time of the phase's gather ("phase" on sharded weights)."""
    forward_widths: list[int] = field(default_factory=list)
    """Input length of each forward (prefill: the prompt; with the cache: 1 after it)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class GenerationView:
    """The policy seen as a generator for one phase (held by the phase's AuxiliaryModel "generation").
    Engine.generation_phase builds it after the weights are gathered and closes it before they are released."""

    def __init__(self, model: torch.nn.Module, params: SamplingParams, device: torch.device, stats: GenerationStats):
        self.model = model
        """What generate runs: the HF model, or under LoRA the peft model (adapters applied)."""
        self.params = params
        self.device = device
        self.stats = stats
        self._config = params.generation_config()
        self._warpers = params.warpers()
        self._hook = lora.unwrapped(model).register_forward_pre_hook(self._count, with_kwargs=True)
        self._open = True

    def _count(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        width = int(ids.shape[1]) if ids is not None else 0
        self.stats.forwards += 1
        self.stats.cached_forwards += int(width == 1)
        self.stats.forward_widths.append(width)
        if self.stats.gather == "forward" and self.stats.sharded:
            self.stats.gathers += 1

    def generate(self, prompt_ids: torch.Tensor, num: int, seed: int) -> Completions:
        """`num` completions of one prompt (prompt_ids: LongTensor [P], no padding) in one call of its own, row g
        sampled with its generator seeded row_seed(seed, g): the same (seed, prompt, weights) draws the same
        completions on any layout. Local to this rank under "phase"; under "forward" every rank calls it together."""
        return self._call([_prompt(prompt_ids)], num, [seed])[0]

    def generate_batch(self, prompts: list[torch.Tensor], num: int, seeds: list[int],
                       rows_per_call: int = 0) -> list[Completions]:
        """`num` completions of each prompt, seeded as `generate` seeds them, in as few calls as `rows_per_call`
        allows (whole groups per call, at least one; 0: every prompt in one call), left-padded with an attention
        mask. Under "forward" every rank calls it together with as many prompts (so as many calls)."""
        if len(prompts) != len(seeds):
            raise ValueError(f"generate_batch: {len(prompts)} prompts, {len(seeds)} seeds")
        groups = max(1, (rows_per_call or len(prompts) * num) // num)
        out: list[Completions] = []
        for i in range(0, len(prompts), groups):
            out += self._call([_prompt(p) for p in prompts[i:i + groups]], num, seeds[i:i + groups])
        return out

    def _call(self, prompts: list[torch.Tensor], num: int, seeds: list[int]) -> list[Completions]:
        """One transformers `generate` call over the prompts' groups, left-padded to the longest prompt."""
        if not self._open:
            raise RuntimeError("GenerationView.generate called outside its generation phase")
        if num < 1:
            raise ValueError(f"generate needs num >= 1 (got {num})")
        width = max(p.numel() for p in prompts)
        ids = torch.full((len(prompts) * num, width), self.params.pad_token_id, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i * num:(i + 1) * num, width - p.numel():] = p.to(self.device)
            mask[i * num:(i + 1) * num, width - p.numel():] = 1
        sampler = RowSampler([row_seed(s, g) for s in seeds for g in range(num)], self.device)
        recorder = LogpRecorder()
        scaled = int(self.params.temperature != 1.0)  # warpers() puts the temperature first when there is one
        temperature, rest = self._warpers[:scaled], self._warpers[scaled:]
        if self.params.cache_implementation == "static":
            # transformers sizes a static cache for the longest of the model's calls so far; sized by this call
            # alone, a call's shapes (and so its logits' bits) do not depend on the calls before it on this rank
            lora.unwrapped(self.model)._previous_max_cache_length = -1
        start = time.perf_counter()
        with torch.no_grad():
            from transformers import LogitsProcessorList

            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self._config,
                                      logits_processor=LogitsProcessorList([*temperature, recorder, *rest, sampler]),
                                      synced_gpus=self.stats.lockstep)
        new = out[:, width:]
        logps = recorder.finish(out[:, -1])[:, :new.shape[1]]
        groups = []
        for i in range(len(prompts)):
            rows = slice(i * num, (i + 1) * num)
            c = completions_of(new[rows], self.params.eos_ids, self.params.pad_token_id)
            longest = int(c.lengths.max())  # the group's own longest (other groups may have run longer)
            kept = torch.arange(longest, device=logps.device).unsqueeze(0) < c.lengths.unsqueeze(1)
            groups.append(Completions(c.completion_ids[:, :longest], c.lengths, c.truncated,
                                      torch.where(kept, logps[rows, :longest], torch.zeros((), device=logps.device))))
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1
        self.stats.tokens += sum(int(c.lengths.sum()) for c in groups)
        return groups

    def close(self) -> None:
        self._hook.remove()
        self._open = False


def check_static_cache(model: torch.nn.Module) -> None:
    """Refuse (UserError, one line) a model for which transformers builds no static cache (the model facts' rule,
    static_cache_refusal, which the plan applies before launch; here for the engine API's own SamplingParams)."""
    from ..errors import UserError
    from ..model.facts import static_cache_refusal

    refusal = static_cache_refusal(model)
    if refusal:
        raise UserError(refusal)


def _prompt(prompt_ids: torch.Tensor) -> torch.Tensor:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if prompt.numel() == 0:
        raise ValueError("generate needs a non-empty prompt")
    return prompt


@contextlib.contextmanager
def generation_mode(model: torch.nn.Module) -> Iterator[None]:
    """Every module in eval mode (no dropout; HF's gradient checkpointing, and with it the use_cache=False it
    forces, only acts in training mode) and gradients off; each module's own mode restored after."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


def refused_layout(pipeline: bool, tp: int, sp: int, ep: int) -> Optional[str]:
    """Why generation does not run on this layout yet (one line), or None (the capability table's fact)."""
    from ..plan.capabilities import generation_refusal

    return generation_refusal(pipeline, {"tp": tp, "sp": sp, "ep": ep})


AUXILIARY_ROLES: dict[str, str] = {
    "reference": "a frozen copy of a model: a preference task's reference (zerotrain/train/preference.py)",
    "generation": "the policy seen as a generator for one phase (Engine.generation_phase; backends/generation.py)",
}
"""What an engine holds beside the policy, by role (Engine.auxiliary builds a "reference"; a "generation" view is
entered with Engine.generation_phase; any other role is refused)."""


@dataclass
class AuxiliaryModel:
    """A model an engine holds beside the policy for the run's task (Engine.auxiliary), until
    Engine.release_auxiliary or close; every rank holds its part, and every rank calls it alike.

    Today's kind is a frozen copy ("reference"): built from a factory, held like the policy (partitioned over
    the ranks where the policy's parameters are at ZeRO-3 / FSDP2, whole on every rank otherwise, in the run's
    compute dtype), never trained, called like the HF model under torch.no_grad. Its backend part is the
    engine's _build_frozen / _drop_frozen hooks: DeepSpeed builds a ZeRO inference engine without optimizer,
    partitioned like the policy (TRL's prepare_deepspeed); FSDP2 fully_shards it over the policy's mesh,
    resharded after every forward.

    The second kind, role "generation", is a view of the policy that copies nothing (GenerationView):
    Engine.generation_phase yields it, with the policy's weights gathered once for the phase where they are
    sharded and released at the phase's end, as DeepSpeed-Chat's hybrid engine does (DeepSpeed ZeRO-3: its
    partitions gathered and its forward hooks off, as TRL's unwrap_model_for_generation; FSDP2: every sharded
    module unsharded once, resharded at the end). Its `generate` lives on this object; its backend part is the
    engine's _generation_sharded / _gather_for_generation hooks."""

    role: str
    """Its key in AUXILIARY_ROLES."""
    model: Any
    """What the task calls like the HF model: the backend's holder of the copy (a DeepSpeed engine, whose
    .module is the HF model; the fully_shard'ed HF model itself); for "generation" the GenerationView."""

    def generate(self, prompt_ids: torch.Tensor, num: int, seed: int) -> Completions:
        """A "generation" view's `num` completions of one prompt (GenerationView.generate)."""
        if self.role != "generation":
            raise TypeError(f"a {self.role} model does not generate; enter engine.generation_phase(params)")
        return self.model.generate(prompt_ids, num, seed)

    def generate_batch(self, prompts: list[torch.Tensor], num: int, seeds: list[int],
                       rows_per_call: int = 0) -> list[Completions]:
        """A "generation" view's completions of many prompts, batched (GenerationView.generate_batch)."""
        if self.role != "generation":
            raise TypeError(f"a {self.role} model does not generate; enter engine.generation_phase(params)")
        return self.model.generate_batch(prompts, num, seeds, rows_per_call)


class AuxiliaryHost:
    """What an engine holds beside the policy (the Engine base inherits it): the auxiliary models by role
    (AuxiliaryModel), and the generation phase. A backend fills in the hooks: _build_frozen / _drop_frozen for a
    frozen copy, _generation_sharded / _gather_for_generation for generation."""

    name: str
    auxiliaries: dict[str, AuxiliaryModel]
    last_generation: Optional[GenerationStats]

    def auxiliary(self, role: str, model_factory: Any) -> AuxiliaryModel:
        """Build and hold the task's auxiliary model of `role` (every rank; AUXILIARY_ROLES): today a frozen
        copy of what model_factory builds, held like the policy (AuxiliaryModel says how, and where the
        generation view of the policy will live). Held until release_auxiliary(role) or close."""
        if role not in AUXILIARY_ROLES:
            raise ValueError(f"unknown auxiliary model role {role!r}; known: {', '.join(AUXILIARY_ROLES)}")
        if role == "generation":
            raise ValueError("the generation view is built from no factory: enter engine.generation_phase(params)")
        if role in self.auxiliaries:
            raise RuntimeError(f"the engine already holds a {role} model; release_auxiliary({role!r}) first")
        held = AuxiliaryModel(role, self._build_frozen(model_factory))
        self.auxiliaries[role] = held
        return held

    def release_auxiliary(self, role: Optional[str] = None) -> None:
        """Drop the auxiliary model of `role` (None: every one; every rank), freeing its memory before the
        engine closes or the policy is gathered for export; nothing held under that role is a no-op."""
        for name in [role] if role is not None else list(self.auxiliaries):
            held = self.auxiliaries.pop(name, None)
            if held is not None:
                self._drop_frozen(held.model)

    def _build_frozen(self, model_factory: Any) -> Any:
        """Backend hook of a frozen copy (AuxiliaryModel): build it with model_factory, requires_grad off,
        in eval mode, placed like the policy; returns what is called like the HF model."""
        from ..errors import UserError

        raise UserError(f"the {self.name} engine cannot hold a reference model; pass --precompute-ref")

    def _drop_frozen(self, model: Any) -> None:
        """Backend hook: release what _build_frozen built beyond dropping the reference (DeepSpeed: its engine)."""

    @contextlib.contextmanager
    def generation_phase(self, params: SamplingParams) -> Iterator[AuxiliaryModel]:
        """Every rank enters it together: inside, the yielded view's generate(prompt_ids, num, seed) samples from
        the current policy (eval mode, no gradients, KV cache; under LoRA through the adapters). Sharded weights
        reach it as params.gather says (the module docstring): "phase" gathers them once here, holding the
        whole model on every rank until the end, and releases them; "forward" lets each forward gather and steps
        the ranks in lockstep. The end is where every rank meets: one all-reduce tells every rank whether any
        failed inside (all raise then, none waits). last_generation keeps what the phase did."""
        from ..distributed.agree import PeerFailed, mark_agreed
        from ..distributed.collectives import reduce_max
        from ..errors import UserError

        engine: Any = self
        world = engine.plan.world
        problem = refused_layout(engine.whole_step, world.tp, world.sp, world.ep)
        if problem:
            raise UserError(problem)
        model = engine.hf_model
        if params.cache_implementation == "static":  # before any gather: every rank refuses alike
            check_static_cache(lora.unwrapped(model))
        sharded = self._generation_sharded()
        stats = GenerationStats(params.gather, sharded, lockstep=params.gather == "forward" and sharded
                                and engine.world_size > 1)
        error: Optional[Exception] = None
        with generation_mode(model):
            start = time.perf_counter()
            with self._gather_for_generation(params.gather == "phase") if sharded else contextlib.nullcontext():
                if sharded and params.gather == "phase":
                    stats.gathers, stats.gather_seconds = 1, time.perf_counter() - start
                view = GenerationView(model, params, engine.device, stats)
                try:
                    yield AuxiliaryModel("generation", view)
                except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
                    error = e
                finally:
                    view.close()
        self.last_generation = stats
        (failed,) = reduce_max(0.0 if error is None else 1.0)
        if error is not None:
            raise mark_agreed(error)
        if failed:
            raise mark_agreed(PeerFailed("generation: another rank failed (its error is printed above); "
                                         "stopping this rank too"))

    def _generation_sharded(self) -> bool:
        """Backend hook: whether the policy's weights are sharded over the ranks (a forward gathers them)."""
        return False

    def _gather_for_generation(self, whole: bool) -> contextlib.AbstractContextManager:
        """Backend hook (sharded weights only), around a generation phase: whole (gather "phase"): the whole
        policy gathered on every rank and the per-forward gathering off; else (gather "forward") what a forward
        of the HF model would not gather itself (FSDP2: its root's own parameters). Everything released and
        restored at the exit (also on an error)."""
        raise NotImplementedError(f"the {self.name} engine cannot gather its weights for generation")

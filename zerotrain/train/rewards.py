"""GRPO's rewards as TRL 1.16's GRPOTrainer computes them (__init__'s reward_funcs / reward_weights handling,
_calculate_rewards, and the reward metrics of _generate_and_score_completions).

A reward is either
  a function         --reward-funcs rewards.py:NAME (a file) or package.module:NAME (comma separated), called as
                     TRL calls it:
                     fn(prompts=, completions=, completion_ids=, **every other dataset column as a list,
                     trainer_state=, log_extra=, log_metric=) -> one float (or None: NaN, "not mine") per completion.
                     prompts are the "prompt" values (strings or message lists), completions the decoded text
                     (plain prompts) or [{"role": "assistant", "content": text}] (conversational ones), both
                     repeated once per generation; an `async def` function is awaited, the async ones together;
  a reward model     --reward-model DIR: a 1-label AutoModelForSequenceClassification; prompt + completion text
                     (conversational: the messages plus the assistant message, rendered with ITS tokenizer's chat
                     template) tokenized with its own tokenizer (no special tokens added, right padding, no
                     truncation), the reward is logits[:, 0].
Rewards are ordered as TRL's `trl grpo` script orders them: the reward model first, then the functions in the
order given; --reward-weights has one weight per reward in that order (default 1.0 each) and their names
(a function's __name__, the model directory's basename) make the metrics rewards/<name>/mean and /std.
The total is TRL's: nansum(per_func * weights) per completion, NaN where every reward returned None.
Every mistake is one UserError line naming the flag, the item and the fix; a function that raises or returns
the wrong thing is named with the prompt index (its position in the global batch).
"""
from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import numbers
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..errors import UserError, first_line

FUNCS_FLAG, WEIGHTS_FLAG, MODEL_FLAG = "--reward-funcs", "--reward-weights", "--reward-model"
RESERVED = ("prompt", "completion", "completion_ids")
"""Dataset columns TRL does not pass as keyword arguments (its prompts= / completions= / completion_ids= stand
for them)."""


@dataclass
class RewardModel:
    """A 1-label sequence classifier used as a reward, with the tokenizer its texts are tokenized with."""

    model: Any
    """The AutoModelForSequenceClassification (eval mode, frozen, on the run's device)."""
    tokenizer: Any
    """Its own tokenizer (pad token = eos where it had none, as TRL sets it)."""
    path: str
    """--reward-model as given (named in errors)."""


@dataclass
class RewardSet:
    """The rewards of a GRPO run, in TRL's order (the reward model first, then the functions)."""

    names: list[str]
    """TRL's names: a function's __name__ (a functools.partial's wrapped function, a callable object's class),
    a reward model's config._name_or_path basename."""
    weights: torch.Tensor
    """float32 [n_rewards]: --reward-weights (1.0 each by default)."""
    rewards: list[Any] = field(default_factory=list)
    """Per reward: a RewardModel or the callable."""
    sources: list[str] = field(default_factory=list)
    """Per reward: what the user wrote (the --reward-funcs item, the --reward-model dir), named in errors."""
    device: Any = "cpu"
    """Where score() returns its tensor (the reward model runs there)."""
    pending_metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """Scalars the functions logged through log_metric(name, value) (TRL averages them per logging step); the
    trainer reads and clears them."""
    pending_extra: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    """Columns the functions logged through log_extra(column, values) for the completions log; the trainer reads
    and clears them."""

    def __len__(self) -> int:
        return len(self.names)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's log_metric keyword argument."""
        self.pending_metrics[name].append(value)

    def log_extra(self, column: str, values: list) -> None:
        """TRL's log_extra keyword argument."""
        self.pending_extra[column].extend(values)

    def score(self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict[str, list],
              first_index: int = 0, trainer_state: Any = None) -> torch.Tensor:
        """[N, n_rewards] float32 on self.device: each reward of each (prompt, completion) pair of this rank, NaN
        where a function returned None. prompts / completions / completion_ids / every column hold N values (one
        per completion: each prompt's values repeated per generation). first_index: the global batch index of
        row 0 (named in errors). trainer_state: what reward functions get as trainer_state= (TRL passes its
        transformers.TrainerState: see trainer_state() below)."""
        n = len(prompts)
        if len(completions) != n or len(completion_ids) != n:
            raise ValueError(f"score: {n} prompts, {len(completions)} completions, {len(completion_ids)} ids")
        out = torch.zeros(n, len(self.rewards), dtype=torch.float32, device=self.device)
        kwargs = {k: list(v) for k, v in columns.items() if k not in RESERVED}
        for k, v in kwargs.items():
            if len(v) != n:
                raise ValueError(f"score: column {k!r} has {len(v)} values for {n} completions")
        kwargs["trainer_state"] = trainer_state if trainer_state is not None else make_trainer_state(0)
        kwargs["log_extra"] = self.log_extra
        kwargs["log_metric"] = self.log_metric
        pending = []
        for i, (reward, source, name) in enumerate(zip(self.rewards, self.sources, self.names)):
            if isinstance(reward, RewardModel):
                out[:, i] = _model_rewards(reward, prompts, completions).to(out.device)
            elif _is_async(reward):
                pending.append(i)
            else:
                values = _call(reward, source, name, prompts, completions, completion_ids, kwargs, first_index)
                out[:, i] = _as_floats(values, source, name, n, first_index).to(out.device)
        if pending:
            async def together():
                return await asyncio.gather(*(_await(self.rewards[i], self.sources[i], self.names[i], prompts,
                                                     completions, completion_ids, kwargs, first_index)
                                              for i in pending))

            for i, values in zip(pending, asyncio.run(together())):
                out[:, i] = _as_floats(values, self.sources[i], self.names[i], n, first_index).to(out.device)
        unscored = torch.isnan(out).all(dim=1).nonzero()
        if len(unscored):  # TRL warns too: such a completion teaches nothing (advantage 0)
            warnings.warn(f"every reward returned None at prompt index {first_index + int(unscored[0])} "
                          f"({len(unscored)} of {n} completions unscored); each completion needs one reward that "
                          "applies to it", stacklevel=2)
        return out


def make_trainer_state(global_step: int, max_steps: int = 0, epoch: Optional[float] = None) -> Any:
    """What reward functions get as trainer_state=: a transformers.TrainerState (TRL passes its trainer's) with
    the optimizer steps done so far, the run's total steps and the epoch (a fraction); its other fields keep
    their defaults."""
    from transformers import TrainerState

    return TrainerState(global_step=global_step, max_steps=max_steps, epoch=epoch)


def callable_name(fn: Any) -> str:
    """TRL's get_callable_name: a partial's wrapped function, else __name__, else the object's class name."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def _is_async(fn: Any) -> bool:
    """TRL's is_async_callable (partials unwrapped, callable objects by their __call__)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _rows(kwargs: dict[str, Any], j: int) -> dict[str, Any]:
    return {k: (v[j:j + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}


def _culprit(fn: Any, prompts: list, completions: list, completion_ids: list, kwargs: dict) -> Optional[int]:
    """The first completion on which fn raises when called alone (None: none does; it fails on the batch only).
    Only run after fn raised on the whole batch."""
    for j in range(len(prompts)):
        try:
            out = fn(prompts=prompts[j:j + 1], completions=completions[j:j + 1],
                     completion_ids=completion_ids[j:j + 1], **_rows(kwargs, j))
            if inspect.isawaitable(out):
                out.close()  # a coroutine never awaited: the async path does not search
                return None
        except Exception:  # noqa: BLE001 - any exception of the user's function is what we look for
            return j
    return None


def _raised(e: Exception, source: str, name: str, where: str) -> UserError:
    return UserError(f"{FUNCS_FLAG} {source}: reward function '{name}' raised {type(e).__name__}: {first_line(e)} "
                     f"({where}); fix the function (it is called as fn(prompts, completions, completion_ids, "
                     "**columns, trainer_state, log_extra, log_metric): take **kwargs)")


def _call(fn: Any, source: str, name: str, prompts: list, completions: list, completion_ids: list, kwargs: dict,
          first: int) -> Any:
    try:
        return fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    except Exception as e:  # noqa: BLE001 - the user's function: any exception is theirs, named in one line
        j = _culprit(fn, prompts, completions, completion_ids, kwargs)
        where = (f"at prompt index {first + j}" if j is not None else
                 f"on the batch of prompt indices {first}..{first + len(prompts) - 1}")
        raise _raised(e, source, name, where) from None


async def _await(fn: Any, source: str, name: str, prompts: list, completions: list, completion_ids: list,
                 kwargs: dict, first: int) -> Any:
    try:
        return await fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
    except Exception as e:  # noqa: BLE001 - as _call
        raise _raised(e, source, name, f"on the batch of prompt indices {first}..{first + len(prompts) - 1}") \
            from None


def _as_floats(values: Any, source: str, name: str, n: int, first: int) -> torch.Tensor:
    """A function's output as float32 [n] (None -> NaN, as TRL), or one line naming what is wrong."""
    head = f"{FUNCS_FLAG} {source}: reward function '{name}'"
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a tensor or an array
        values = values.tolist()
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__") or not hasattr(values, "__iter__"):
        raise UserError(f"{head} returned a {type(values).__name__}, not a list; return one float (or None) per "
                        f"completion, for prompt indices {first}..{first + n - 1}")
    values = list(values)
    if len(values) != n:
        raise UserError(f"{head} returned {len(values)} rewards for {n} completions (prompt indices {first}.."
                        f"{first + n - 1}); return exactly one float (or None) per completion")
    out = []
    for j, v in enumerate(values):
        if v is None:
            out.append(float("nan"))
        elif isinstance(v, numbers.Real) or torch.is_tensor(v) and v.numel() == 1:
            out.append(float(v))
        else:
            raise UserError(f"{head} returned {type(v).__name__} {str(v)[:40]!r} at prompt index {first + j}; "
                            "return a float (or None where it does not apply) per completion")
    return torch.tensor(out, dtype=torch.float32)


def _model_rewards(rm: RewardModel, prompts: list, completions: list) -> torch.Tensor:
    """TRL's reward-model branch of _calculate_rewards: [N] logits[:, 0]."""
    if _conversational(prompts[0]):
        try:
            texts = [rm.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        except Exception as e:  # noqa: BLE001 - no template, or a jinja error of any kind
            raise UserError(f"{MODEL_FLAG} {rm.path}: its tokenizer could not render the conversation "
                            f"({type(e).__name__}: {first_line(e)}); save a chat template with that tokenizer "
                            "(or use plain-text prompts)") from None
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    device = next(rm.model.parameters()).device
    enc = rm.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        logits = rm.model(**{k: v.to(device) for k, v in enc.items()}).logits
    return logits[:, 0].float()


def _conversational(prompt: Any) -> bool:
    """TRL's is_conversational for one prompt: a list whose first item is a dict with a role."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def total_reward(per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N]: TRL's nansum(per_func * weights, dim=1), NaN where every reward is NaN (TRL's unscorable rows: they
    stay out of the group baseline and get advantage 0)."""
    w = torch.as_tensor(weights, dtype=per_func.dtype, device=per_func.device)
    total = (per_func * w.unsqueeze(0)).nansum(dim=1)
    total[torch.isnan(per_func).all(dim=1)] = torch.nan
    return total


def nanstd(x: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """TRL's nanstd: the Bessel-corrected std of the non-NaN values (NaN for fewer than two)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    var = var * torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = torch.sqrt(var)
    return std.squeeze(dim) if dim is not None else std.reshape(())


def reward_metrics(per_func: torch.Tensor, names: list[str]) -> dict[str, float]:
    """TRL's rewards/<name>/mean and rewards/<name>/std (nanmean / nanstd) of the completions given (TRL gives it
    every rank's: see reward_sums for a reduction over ranks)."""
    out = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_func[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(per_func[:, i]).item()
    return out


def reward_sums(values: torch.Tensor) -> torch.Tensor:
    """float64 [K, 3]: per column of values [N, K] (a reward per column, or the total as [N, 1]) the sum, the sum
    of squares and the count of its non-NaN entries: all-reduce (SUM) it over the ranks, then
    metrics_from_sums gives the global nanmean / nanstd exactly as TRL computes them on the gathered batch."""
    v = values.detach().to(torch.float64)
    ok = ~torch.isnan(v)
    z = torch.where(ok, v, torch.zeros_like(v))
    return torch.stack([z.sum(0), (z * z).sum(0), ok.sum(0).to(torch.float64)], dim=1)


def mean_std_from_sums(sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([K] mean, [K] Bessel-corrected std) from reward_sums rows (NaN mean for no value, NaN std for < 2)."""
    s, sq, n = sums[:, 0], sums[:, 1], sums[:, 2]
    nan = torch.full_like(s, float("nan"))
    mean = torch.where(n > 0, s / n.clamp(min=1), nan)
    var = torch.where(n > 1, (sq - n * mean * mean).clamp(min=0) / (n - 1).clamp(min=1), nan)
    return mean, var.sqrt()


def metrics_from_sums(sums: torch.Tensor, names: list[str]) -> dict[str, float]:
    """rewards/<name>/mean and /std from the (rank-summed) reward_sums of the per-reward columns."""
    mean, std = mean_std_from_sums(sums)
    out = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = mean[i].item()
        out[f"rewards/{name}/std"] = std[i].item()
    return out


def decode_completions(tokenizer: Any, completion_ids: list[list[int]], conversational: bool) -> list:
    """What reward functions get as completions=, as TRL decodes them: batch_decode(skip_special_tokens=True);
    conversational prompts: [{"role": "assistant", "content": text}] each. (TRL parses a tokenizer's
    response_schema for tool calls instead; zerotrain does not generate tool calls.)"""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


def _load_function(item: str) -> tuple[Callable, str]:
    """(the callable, its name) of one --reward-funcs item, or one UserError line."""
    where, sep, attr = item.rpartition(":")
    if not sep or not where or not attr:
        raise UserError(f"{FUNCS_FLAG} {item!r}: expected FILE.py:FUNCTION or package.module:FUNCTION (several: "
                        "comma separated)")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    if is_file:
        path = Path(where).expanduser()
        if not path.is_file():
            raise UserError(f"{FUNCS_FLAG} {item}: no such file {where}; pass an existing .py file (or "
                            "package.module:FUNCTION)")
        path = path.resolve()
        name = f"zerotrain_reward_{path.stem}_{abs(hash(str(path))):x}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            folder = str(path.parent)
            if folder not in sys.path:  # its own imports resolve beside it, as under `python rewards.py`
                sys.path.insert(0, folder)
            sys.modules[name] = module  # pickling, dataclasses and typing resolve the module by name
            try:
                spec.loader.exec_module(module)
            except Exception as e:  # noqa: BLE001 - the user's file: any error in it is named in one line
                del sys.modules[name]
                raise UserError(f"{FUNCS_FLAG} {item}: running {where} failed ({type(e).__name__}: {first_line(e)});"
                                " fix the file") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as e:  # noqa: BLE001 - not found, or its import failed
            raise UserError(f"{FUNCS_FLAG} {item}: module {where} is not importable ({type(e).__name__}: "
                            f"{first_line(e)}); install it or put its folder on PYTHONPATH (or pass FILE.py:"
                            "FUNCTION)") from None
    if not hasattr(module, attr):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise UserError(f"{FUNCS_FLAG} {item}: {where} has no '{attr}' (its functions: "
                        f"{', '.join(found) or 'none'}); name one of them")
    fn = getattr(module, attr)
    if isinstance(fn, type) or not callable(fn):
        raise UserError(f"{FUNCS_FLAG} {item}: '{attr}' is a {type(fn).__name__}, not a function; name a function "
                        "(or a callable object) fn(prompts, completions, **kwargs) -> list[float | None]")
    return fn, callable_name(fn)


def _load_model(path: str, device: Any, dtype: torch.dtype) -> tuple[RewardModel, str]:
    """The reward model of --reward-model DIR and its name, or one UserError line."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():  # from_pretrained would build it partitioned under zero.Init
        raise RuntimeError("load_reward_funcs runs before the ZeRO-3 engine is built (a live HfDeepSpeedConfig would "
                           "partition the reward model)")
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise UserError(f"{MODEL_FLAG} {path}: no config.json there; pass a directory saved with save_pretrained "
                        "(a 1-label AutoModelForSequenceClassification and its tokenizer)")
    try:
        config = AutoConfig.from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001 - any unreadable config
        raise UserError(f"{MODEL_FLAG} {path}: its config does not load ({type(e).__name__}: {first_line(e)}); "
                        "pass a directory saved with save_pretrained") from None
    if config.num_labels != 1:
        raise UserError(f"{MODEL_FLAG} {path}: the classifier has num_labels={config.num_labels}; a reward model "
                        "scores with one label (train it with num_labels=1, e.g. `zerotrain train --task reward`)")
    try:
        model = AutoModelForSequenceClassification.from_pretrained(str(p), dtype=dtype)
    except Exception as e:  # noqa: BLE001 - no sequence-classification head for it, missing weights, ...
        raise UserError(f"{MODEL_FLAG} {path}: not loadable as AutoModelForSequenceClassification "
                        f"({type(e).__name__}: {first_line(e)}); pass a sequence classifier's directory") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p))
    except Exception as e:  # noqa: BLE001 - no tokenizer files
        raise UserError(f"{MODEL_FLAG} {path}: its tokenizer does not load ({type(e).__name__}: {first_line(e)}); "
                        "save the tokenizer into that directory") from None
    if tokenizer.pad_token_id is None:  # TRL: pad with eos, and tell the model which id pads (it scores the last
        tokenizer.pad_token = tokenizer.eos_token  # non-pad token)
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.requires_grad_(False)
    model.eval().to(device)
    return RewardModel(model=model, tokenizer=tokenizer, path=path), str(model.config._name_or_path).rstrip(
        "/").split("/")[-1]


def _weights(spec: Optional[str], names: list[str]) -> torch.Tensor:
    if spec is None or not str(spec).strip():
        return torch.ones(len(names), dtype=torch.float32)
    items = [s.strip() for s in str(spec).split(",")]
    try:
        values = [float(s) for s in items]
    except ValueError:
        raise UserError(f"{WEIGHTS_FLAG} {spec}: not a comma-separated list of numbers; e.g. "
                        f"{','.join(['1.0'] * len(names))}") from None
    if len(values) != len(names):
        raise UserError(f"{WEIGHTS_FLAG} {spec}: {len(values)} weights for {len(names)} rewards ("
                        f"{', '.join(names)}, in that order: {MODEL_FLAG} first, then {FUNCS_FLAG}); give one "
                        "weight per reward")
    if not all(torch.isfinite(torch.tensor(values))):
        raise UserError(f"{WEIGHTS_FLAG} {spec}: a weight is not finite; give finite numbers")
    return torch.tensor(values, dtype=torch.float32)


def load_reward_funcs(spec: Optional[str], weights: Optional[str], reward_model: Optional[str], device: Any = "cpu",
                      dtype: torch.dtype = torch.float32) -> RewardSet:
    """The RewardSet of --reward-funcs / --reward-weights / --reward-model (the reward model loaded on device in
    dtype), or one UserError line naming the flag, the item and the fix."""
    rewards, sources, names = [], [], []
    if reward_model:
        rm, name = _load_model(reward_model, device, dtype)
        rewards.append(rm)
        sources.append(reward_model)
        names.append(name)
    for item in [s.strip() for s in (spec or "").split(",") if s.strip()]:
        fn, name = _load_function(item)
        rewards.append(fn)
        sources.append(item)
        names.append(name)
    if not rewards:
        raise UserError(f"--task grpo needs a reward: pass {FUNCS_FLAG} FILE.py:FUNCTION (or package.module:FUNCTION,"
                        f" comma separated) and/or {MODEL_FLAG} DIR")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"{FUNCS_FLAG}: two rewards are named '{dup[0]}' (their metrics rewards/{dup[0]}/mean would "
                        "be one); give each reward its own function name")
    return RewardSet(names=names, weights=_weights(weights, names), rewards=rewards, sources=sources,
                     device=torch.device(device) if isinstance(device, str) else device)

"""zerotrain/train/grpo_loss.py against TRL 1.16's own code: GRPOTrainer._compute_loss (the loss, its gradient and
its logged metrics) and GRPOTrainer._generate_and_score_completions (the advantages and reward metrics), each called
on a trainer object built without its __init__ whose model forward, generation and reward functions return fixed
tensors; and the micro-batch x rank split reproducing the one-batch loss, gradient and metrics."""
from __future__ import annotations

import collections
import dataclasses
import math
import types

import pytest
import torch

from zerotrain.train import grpo_loss as G

EPS_LOW, EPS_HIGH, MAX_LEN = 0.2, 0.28, 8


def _trl_config_defaults() -> dict:
    """GRPOConfig's field defaults (TRL's own, read without building a TrainingArguments)."""
    from trl import GRPOConfig

    return {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}


def _trl_trainer(**attrs):
    """A GRPOTrainer without __init__: only the attributes its methods read here."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    t = object.__new__(GRPOTrainer)
    base = dict(model=types.SimpleNamespace(training=True, is_gradient_checkpointing=False), use_vllm=False,
                vllm_importance_sampling_correction=False,
                _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)})
    for k, v in {**base, **attrs}.items():
        object.__setattr__(t, k, v)
    return t


def trl_loss(loss: G.GRPOLoss, logps, old, ref, adv, mask, entropies=None, *, num_items=None, ga=1, procs=1, spg=1):
    """TRL's _compute_loss on one micro-batch: (loss, grad w.r.t. logps, its logged metrics). num_items: TRL's
    num_items_in_batch (the generation batch's completion tokens over every rank); ga/procs/spg: its gradient
    accumulation steps, processes and steps_per_generation (the accelerator stand-in gathers nothing: the metrics
    are this micro-batch's)."""
    args = types.SimpleNamespace(**{**_trl_config_defaults(), "steps_per_generation": spg})
    assert args.use_bias_correction_kl is loss.use_bias_correction_kl and args.delta is None
    accel = types.SimpleNamespace(num_processes=procs, gather=lambda x: x, reduce=lambda x, reduction: x)
    t = _trl_trainer(loss_type=loss.loss_type, beta=loss.beta, epsilon_low=loss.epsilon_low,
                     epsilon_high=loss.epsilon_high, importance_sampling_level=loss.importance_sampling_level,
                     max_completion_length=loss.max_completion_len, top_entropy_quantile=args.top_entropy_quantile,
                     off_policy_mask_threshold=args.off_policy_mask_threshold, aux_loss_enabled=False,
                     _entropy_bonus_enabled=False, current_gradient_accumulation_steps=ga, args=args,
                     accelerator=accel)
    leaf = logps.detach().clone().requires_grad_(True)
    ent = torch.zeros_like(logps) if entropies is None else entropies
    t._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, ent, None)
    n, length = mask.shape
    imask = mask.long()  # TRL's completion_mask is an int tensor
    inputs = dict(prompt_ids=torch.zeros(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
                  completion_ids=torch.zeros(n, length, dtype=torch.long), completion_mask=imask, advantages=adv,
                  num_items_in_batch=torch.tensor(float(imask.sum()) if num_items is None else float(num_items)))
    if old is not None:
        inputs["old_per_token_logps"] = old
    if loss.beta != 0.0:
        inputs["ref_per_token_logps"] = ref
    out = t._compute_loss(None, inputs)
    out.backward()
    return out.detach(), leaf.grad, {k: v[-1] for k, v in t._metrics["train"].items()}


def ours(loss: G.GRPOLoss, logps, old, ref, adv, mask, norm, entropies=None):
    leaf = logps.detach().clone().requires_grad_(True)
    out = loss(leaf, old, ref, adv, mask, norm, entropies=entropies)
    out.loss.backward()
    return out.loss.detach(), leaf.grad, out.sums


def batch(lengths, length=MAX_LEN, seed=0):
    """Fixed log-probs (policy, old off by 0.3 per token and per
    completion so ratios clip both ways at both levels, reference), advantages and entropies; a mask
    of the given completion lengths (0: a completion masked whole, as mask_truncated_completions leaves it)."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    logps = -torch.rand(n, length, generator=g) * 3
    old = logps + 0.3 * torch.randn(n, length, generator=g) + 0.3 * torch.randn(n, 1, generator=g)
    ref = logps + 0.5 * torch.randn(n, length, generator=g)
    adv = torch.randn(n, generator=g)
    ent = torch.rand(n, length, generator=g) * 2
    mask = (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).float()
    return logps, old, ref, adv, mask, ent


LENGTHS = [8, 3, 0, 5, 1, 8, 6, 2]


def close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("old_given", [False, True], ids=["on-policy", "num_iterations2"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("level", G.IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", G.LOSS_TYPES)
def test_one_batch_loss_and_gradient_equal_trls(loss_type, level, beta, old_given):
    logps, old, ref, adv, mask, _ = batch(LENGTHS)
    old = old if old_given else None
    loss = G.GRPOLoss(loss_type, beta, EPS_LOW, EPS_HIGH, level, MAX_LEN)
    t_loss, t_grad, _ = trl_loss(loss, logps, old, ref, adv, mask)
    z_loss, z_grad, _ = ours(loss, logps, old, ref, adv, mask, G.StepNormaliser.whole(mask))
    close(z_loss, t_loss, "loss")
    close(z_grad, t_grad, "grad")
    assert t_grad.abs().sum() > 0 and t_loss != 0


@pytest.mark.parametrize("level", G.IMPORTANCE_SAMPLING_LEVELS)
def test_metrics_from_sums_equal_trls_logged_metrics(level):
    logps, old, ref, adv, mask, ent = batch(LENGTHS)
    loss = G.GRPOLoss("dapo", 0.04, EPS_LOW, EPS_HIGH, level, MAX_LEN)
    _, _, logged = trl_loss(loss, logps, old, ref, adv, mask, ent)
    _, _, sums = ours(loss, logps, old, ref, adv, mask, G.StepNormaliser.whole(mask), ent)
    metrics = G.step_metrics(sums)
    assert set(metrics) == set(G.LOSS_METRICS) and set(G.LOSS_METRICS) <= set(logged)
    for k in G.LOSS_METRICS:
        assert metrics[k] == pytest.approx(logged[k], rel=1e-6, abs=1e-7), k
    # the batch clips both ways, so the clip metrics are no zeros that would match anything
    assert 0 < metrics["clip_ratio/low_mean"] < 1 and 0 < metrics["clip_ratio/high_mean"] < 1
    assert "kl" not in G.step_metrics(ours(dataclasses.replace(loss, beta=0.0), logps, old, ref, adv, mask,
                                           G.StepNormaliser.whole(mask))[2])


def _split(x, parts):
    return list(torch.chunk(x, parts)) if x is not None else [None] * parts


@pytest.mark.parametrize("level", G.IMPORTANCE_SAMPLING_LEVELS)
@pytest.mark.parametrize("loss_type", G.LOSS_TYPES)
def test_micro_batches_x_ranks_equal_one_batch(loss_type, level):
    """4 micro-batches (2 per rank x 2 simulated ranks) of uneven token counts: the mean of the scaled losses (what
    the engines backpropagate) and its gradient equal TRL's loss of the whole batch on one process (its own
    _compute_loss, not zerotrain's: a bug in the shared loss code fails here); the combined sums give TRL's logged
    metrics of that batch."""
    logps, old, ref, adv, mask, ent = batch(LENGTHS, seed=1)
    loss = G.GRPOLoss(loss_type, 0.04, EPS_LOW, EPS_HIGH, level, MAX_LEN)
    one_loss, one_grad, one_logged = trl_loss(loss, logps, old, ref, adv, mask, ent)
    k_times_d = 4
    norm = G.StepNormaliser(completions=len(LENGTHS), tokens=float(mask.sum()), micro_batches=k_times_d)
    leaf = logps.detach().clone().requires_grad_(True)
    outs = [loss(*parts, norm, entropies=e) for *parts, e in
            zip(torch.chunk(leaf, k_times_d), _split(old, k_times_d), _split(ref, k_times_d),
                _split(adv, k_times_d), _split(mask, k_times_d), _split(ent, k_times_d))]
    mean = torch.stack([o.loss for o in outs]).mean()
    mean.backward()
    close(mean.detach(), one_loss, "loss")
    close(leaf.grad, one_grad, "grad")
    summed = {}
    for o in outs:
        summed = G.combine(summed, o.sums)
    split_metrics = G.step_metrics(summed)
    assert set(split_metrics) == set(G.LOSS_METRICS)
    assert split_metrics == pytest.approx({k: one_logged[k] for k in G.LOSS_METRICS}, rel=1e-6, abs=1e-7, nan_ok=True)


@pytest.mark.parametrize("loss_type", G.LOSS_TYPES)
def test_trl_under_grad_accum_and_processes_equals_the_global_loss(loss_type):
    """TRL itself on 2 processes x 2 accumulation steps (its losses summed per process, averaged over processes, as
    Trainer and DDP do): its step loss and gradient equal ours on the whole batch. The micro-batches hold equal token
    counts (8 each, uneven rows), where TRL's bnpo (a local token mean) is global too."""
    lengths = [7, 1, 3, 5, 0, 8, 4, 4]
    logps, old, ref, adv, mask, _ = batch(lengths, seed=2)
    loss = G.GRPOLoss(loss_type, 0.04, EPS_LOW, EPS_HIGH, "token", MAX_LEN)
    one_loss, one_grad, _ = ours(loss, logps, old, ref, adv, mask, G.StepNormaliser.whole(mask))
    procs, ga = 2, 2
    total, grads = 0.0, []
    for parts in zip(*(torch.chunk(x, procs * ga) for x in (logps, old, ref, adv, mask))):
        l, g, _ = trl_loss(loss, *parts, num_items=mask.sum(), ga=ga, procs=procs, spg=ga)
        total, grads = total + l / procs, grads + [g / procs]
    close(torch.as_tensor(total), one_loss, "loss")
    close(torch.cat(grads), one_grad, "grad")


def test_dapo_with_a_generation_serving_two_steps_equals_trl():
    """steps_per_generation 2: TRL divides each step's token sum by the generation batch's tokens / 2; dapo_tokens
    says so here (and `tokens`, this step's own count, would not)."""
    logps, old, ref, adv, mask, _ = batch(LENGTHS, seed=3)
    loss = G.GRPOLoss("dapo", 0.0, EPS_LOW, EPS_HIGH, "token", MAX_LEN)
    for step in torch.chunk(torch.arange(len(LENGTHS)), 2):
        parts = [x[step] for x in (logps, old, ref, adv, mask)]
        t_loss, t_grad, _ = trl_loss(loss, *parts, num_items=mask.sum(), spg=2)
        norm = G.StepNormaliser(completions=len(step), tokens=float(parts[-1].sum()), micro_batches=1,
                                dapo_tokens=float(mask.sum()) * len(step) / len(LENGTHS))
        z_loss, z_grad, _ = ours(loss, *parts, norm)
        close(z_loss, t_loss, "loss")
        close(z_grad, t_grad, "grad")
        assert float(parts[-1].sum()) != norm.dapo_tokens  # the two divisors differ on this data


def trl_advantages(rewards_per_func: torch.Tensor, num_generations: int, scale: str):
    """TRL's _generate_and_score_completions on one process: generation and the reward functions return fixed
    values; (its advantages, its reward metrics)."""
    n = rewards_per_func.shape[0]
    t = _trl_trainer(environment_factories=None, environments=None, tools=None, pad_to_multiple_of=None,
                     mask_truncated_completions=False, _tokenizer=types.SimpleNamespace(pad_token_id=0),
                     num_iterations=1, beta=0.0, num_generations=num_generations,
                     multi_objective_aggregation="sum_then_normalize", scale_rewards=scale,
                     reward_weights=torch.ones(rewards_per_func.shape[1]),
                     reward_func_names=[f"r{i}" for i in range(rewards_per_func.shape[1])],
                     _logs={"prompt": [], "completion": [], "rewards": collections.defaultdict(list),
                            "advantages": [], "extra": collections.defaultdict(list), "images": []},
                     _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False,
                     accelerator=types.SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1,
                                                       gather=lambda x: x),
                     args=types.SimpleNamespace(per_device_train_batch_size=n, steps_per_generation=1,
                                                gradient_accumulation_steps=1, gradient_checkpointing_kwargs=None))
    t._generate = lambda prompts: ([[1, 2]] * len(prompts), [[3, 4, 5]] * len(prompts), None, ["c"] * len(prompts),
                                   None, {}, None, None)
    t._calculate_rewards = lambda *a: rewards_per_func
    out = t._generate_and_score_completions([{"prompt": "p"}] * n)
    return out["advantages"], {k: v[-1] for k, v in t._metrics["train"].items()}


@pytest.mark.parametrize("scale", G.SCALE_REWARDS)
def test_advantages_equal_trls(scale):
    """3 prompts x 4 generations, two reward functions: one group of equal rewards (zero std), a completion every
    function declined (None: NaN) and one where a single function declined."""
    g = torch.Generator().manual_seed(4)
    per_func = torch.randn(12, 2, generator=g)
    per_func[4:8] = torch.tensor([1.0, 0.5])  # group 2: all equal
    per_func[9] = math.nan
    per_func[2, 1] = math.nan
    t_adv, t_metrics = trl_advantages(per_func, 4, scale)
    rewards = per_func.nansum(dim=1)  # the reward functions' weighted sum, as TRL's
    rewards[torch.isnan(per_func).all(dim=1)] = math.nan
    adv, metrics = G.advantages(rewards, 4, scale)
    close(adv, t_adv, "advantages")
    assert metrics == pytest.approx({k: t_metrics[k] for k in G.REWARD_METRICS}, rel=1e-6)
    assert adv[9] == 0 and (metrics["frac_reward_zero_std"] > 0) == (scale != "batch")


def test_refusals_and_notes():
    with pytest.raises(ValueError, match="cispo"):
        G.GRPOLoss("cispo", 0.0, 0.2, 0.2, "token", 8)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        G.GRPOLoss("grpo", 0.0, 0.2, 0.2, "seq", 8)
    logps, old, ref, adv, mask, _ = batch(LENGTHS)
    with pytest.raises(ValueError, match="ref_logps"):
        G.GRPOLoss("grpo", 0.04, 0.2, 0.2, "token", 8)(logps, old, None, adv, mask, G.StepNormaliser.whole(mask))
    with pytest.raises(ValueError, match="groups of 3"):
        G.advantages(torch.zeros(8), 3, "group")
    assert [G.reduction(k) for k in ("clip_low_seq_min", "clip_high_seq_max", "kl_sum")] == ["min", "max", "sum"]
    for t in G.LOSS_TYPES:
        note = G.loss_scale_note(t)
        assert note.startswith(t) and "\n" not in note
    assert "local" in G.loss_scale_note("bnpo")


# --- the policy loss without the whole logits (--chunked-loss) ---------------------------------------------
def _policy_batch(vocab: int) -> dict[str, torch.Tensor]:
    """4 completions of 2 prompts, right-padded rows of different lengths (the collated layout of grpo.py)."""
    g = torch.Generator().manual_seed(3)
    rows = [(4, 9), (4, 3), (6, 7), (6, 1)]  # (prompt, completion) tokens
    width = max(p + c for p, c in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attn, comp = torch.zeros_like(ids), torch.zeros((len(rows), width))
    for i, (p, c) in enumerate(rows):
        ids[i, :p + c] = torch.randint(1, vocab, (p + c,), generator=g)
        attn[i, :p + c] = 1
        comp[i, p - 1:p + c - 1] = 1.0
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": comp,
            "advantages": torch.tensor([1.0, -0.5, 0.25, -1.0])}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_chunked_policy_loss_and_its_gradients_equal_the_whole_logits(family):
    """Every loss type x token / sequence ratios x beta 0 / 0.04, with old and reference log-probs: the log-probs
    (temperature 0.7), entropies, loss and every parameter's gradient of the chunked head (chunks of 5 tokens:
    boundaries inside rows) equal the whole-logits path's to 1e-6 (the gradients to 1e-5 relative: fp32 sums in another
    order)."""
    import copy

    from tests.support.families import FAMILIES
    from transformers import AutoModelForCausalLM
    from zerotrain.model.memory_reducers import apply
    from zerotrain.train.grpo import completion_logps

    torch.manual_seed(0)
    whole = AutoModelForCausalLM.from_config(FAMILIES[family].config())
    chunked = apply(copy.deepcopy(whole), 0, 5)
    batch = _policy_batch(whole.config.vocab_size)
    mask = batch["completion_mask"]
    with torch.no_grad():
        old = completion_logps(whole, batch, 0.7)[0] + 0.05 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
        ref = old - 0.1
        ent_ref = completion_logps(whole, batch, 0.7, entropies=True)[1]
        lp_c, ent_c = completion_logps(chunked, batch, 0.7, entropies=True, chunked=5)
    assert torch.allclose(lp_c, completion_logps(whole, batch, 0.7)[0], atol=1e-6) and torch.allclose(ent_c, ent_ref, atol=1e-6)
    for loss_type in G.LOSS_TYPES:
        for level in ("token", "sequence"):
            for beta in (0.0, 0.04):
                loss = G.GRPOLoss(loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28,
                                importance_sampling_level=level, max_completion_len=12)
                norm = G.StepNormaliser.whole(mask)
                results = []
                for model, chunk in ((whole, 0), (chunked, 5)):
                    model.zero_grad()
                    logps, ent = completion_logps(model, batch, 0.7, entropies=True, chunked=chunk)
                    out = loss(logps, old, ref if beta else None, batch["advantages"], mask, norm, entropies=ent)
                    out.loss.backward()
                    results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                        if p.grad is not None}))
                (a, ga), (b, gb) = results
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), (loss_type, level, beta, float(a - b), float(a))
                assert ga.keys() == gb.keys() and len(ga) == len(list(whole.parameters()))
                for n in ga:
                    assert torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-6), (loss_type, level, beta, n)

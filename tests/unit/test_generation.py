"""The generation view's parts that need no ranks (zerotrain/backends/generation.py): completions cut at their
first EOS as TRL cuts them, the sampling settings TRL's GRPOTrainer gives transformers, their refusals, the
layouts refused, the per-row sampler (a sample of the warped softmax, a row's draws independent of the others), and
one process's generate through the view: each row's tokens those of a plain per-row sampling loop without a cache,
the KV cache on although the model's config turned it off, the model's modes and torch's RNG state restored; the
batched calls sample what one call per prompt samples (GPT-2 and Llama, prompts of different lengths)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zerotrain.backends.base import AuxiliaryModel, Engine
from zerotrain.backends.generation import (GenerationStats, GenerationView, RowSampler, SamplingParams,
                                           completions_of, generation_mode, refused_layout, row_seed)


def test_completions_end_at_the_first_eos_and_pad_after_it():
    new = torch.tensor([[5, 3, 9, 3], [7, 7, 7, 7], [2, 8, 1, 1]])
    c = completions_of(new, eos_ids=[3, 2], pad_token_id=1)
    assert c.completion_ids.tolist() == [[5, 3, 1, 1], [7, 7, 7, 7], [2, 1, 1, 1]]
    assert c.lengths.tolist() == [2, 4, 1] and c.truncated.tolist() == [False, True, False]
    assert c.mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    none = completions_of(new, eos_ids=[], pad_token_id=0)
    assert none.lengths.tolist() == [4, 4, 4] and none.truncated.all()


def test_sampling_params_are_trls_and_refuse_what_they_cannot_do():
    p = SamplingParams(max_new_tokens=8, pad_token_id=0, eos_token_id=[2, 3], temperature=0.7, top_p=0.9, top_k=5)
    g = p.generation_config()  # greedy over the warped, Gumbel-perturbed scores: the sampling is the processors'
    assert (g.do_sample, g.max_new_tokens, g.use_cache) == (False, 8, True)
    assert g.eos_token_id == [2, 3] and g.pad_token_id == 0 and g.disable_compile and p.eos_ids == [2, 3]
    warpers = p.warpers()  # transformers' own, in its sampling order
    assert [type(w).__name__ for w in warpers] == ["TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper"]
    assert (warpers[0].temperature, warpers[1].top_k, warpers[2].top_p) == (0.7, 5, 0.9)
    assert SamplingParams(max_new_tokens=1, pad_token_id=0).warpers() == []  # temperature 1, no top-k / top-p
    assert SamplingParams(max_new_tokens=1, pad_token_id=0, eos_token_id=4).eos_ids == [4]
    for bad, match in (({"gather": "layer"}, "gather"), ({"temperature": 0.0}, "temperature"),
                       ({"max_new_tokens": 0}, "max_new_tokens"), ({"top_p": 0.0}, "top_p")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(**{"max_new_tokens": 4, "pad_token_id": 0, **bad})


def test_layouts_that_cut_the_forward_are_refused_by_name():
    assert refused_layout(False, 1, 1, 1) is None
    line = refused_layout(True, 2, 1, 2)
    assert "a pipeline (pp > 1), tp 2, ep 2" in line and "\n" not in line


def test_the_generation_role_is_entered_not_built():
    engine = SimpleNamespace(auxiliaries={})
    with pytest.raises(ValueError, match="generation_phase"):
        Engine.auxiliary(engine, "generation", lambda: None)
    with pytest.raises(TypeError, match="does not generate"):
        AuxiliaryModel("reference", None).generate(torch.tensor([1]), 2, 0)


def test_the_row_sampler_samples_the_softmax_and_a_rows_draws_are_its_own():
    scores = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5]])
    n = 20000
    sampler = RowSampler(list(range(n)), torch.device("cpu"))
    picks = sampler(torch.zeros(n, 1, dtype=torch.long), scores.expand(n, -1)).argmax(dim=1)
    freq = torch.bincount(picks, minlength=6).double() / n
    want = torch.softmax(scores[0].double(), dim=0)
    assert freq[4] == 0 and torch.allclose(freq, want, atol=0.015), (freq, want)  # ~3.5 sigma at n = 20000
    # row 1's noise is the same whether row 0 is there or not, and the next step draws afresh
    pair, alone = RowSampler([5, 9], torch.device("cpu")), RowSampler([9], torch.device("cpu"))
    flat = torch.zeros(2, 32)
    first = pair(None, flat)
    assert torch.equal(first[1], alone(None, flat[:1])[0]) and not torch.equal(first[1], pair(None, flat)[1])
    with pytest.raises(RuntimeError, match="3 rows scored, 2 generators"):
        pair(None, torch.zeros(3, 32))


def _tiny(family: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                                          bos_token_id=1, eos_token_id=3))
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                        attention_dropout=0.5, use_cache=False))


def _sampled_alone(model, prompt: torch.Tensor, seed: int, params: SamplingParams) -> list[int]:
    """One row the plain way: a whole forward per token (no cache, no batch), the warped scores plus Gumbel noise
    from the row's own generator, argmax, until an EOS or max_new_tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids, out = prompt.tolist(), []
    for _ in range(params.max_new_tokens):
        with torch.no_grad():
            scores = model(torch.tensor([ids])).logits[0, -1].float() / params.temperature
        if params.top_k:
            scores = scores.masked_fill(scores < torch.topk(scores, params.top_k).values[-1], float("-inf"))
        u = torch.rand(scores.numel(), generator=gen).clamp_min(torch.finfo(torch.float32).tiny)
        token = int(torch.argmax(scores - torch.log(-torch.log(u))))
        ids.append(token)
        out.append(token)
        if token in params.eos_ids:
            break
    return out


def test_one_process_generate_samples_each_row_alone_with_the_cache_on_and_leaves_no_trace():
    model = _tiny("llama")
    model.activation_checkpointing_enable()  # in training it turns the cache off: generation must not be
    model.train()
    model.model.layers[0].eval()  # a mode of its own, restored as it was
    params = SamplingParams(max_new_tokens=6, pad_token_id=0, eos_token_id=[3, 4], temperature=0.8, top_k=20)
    prompt = torch.tensor([5, 6, 7])
    rng = torch.get_rng_state()
    stats = GenerationStats("phase", sharded=False, lockstep=False)
    with generation_mode(model):
        assert not model.training and not torch.is_grad_enabled()
        view = GenerationView(model, params, torch.device("cpu"), stats)
        got = view.generate(prompt, num=3, seed=11)
        view.close()
    assert torch.equal(rng, torch.get_rng_state())  # the global generator is not drawn from
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    model.eval()
    for g in range(3):
        want = _sampled_alone(model, prompt, row_seed(11, g), params)
        assert got.completion_ids[g, :got.lengths[g]].tolist() == want, (g, got.completion_ids[g], want)
        assert bool(got.truncated[g]) == (want[-1] not in (3, 4))
    assert len({tuple(got.completion_ids[g].tolist()) for g in range(3)}) > 1  # each row its own draws
    assert stats.forward_widths[0] == 3 and set(stats.forward_widths[1:]) <= {1}  # the KV cache
    assert stats.calls == 1 and stats.tokens == int(got.lengths.sum()) and stats.gathers == 0
    with pytest.raises(RuntimeError, match="outside its generation phase"):
        view.generate(prompt, 1, 0)


def _four_prompts() -> tuple[list[torch.Tensor], list[int]]:
    """Four prompts of 3, 7, 5 and 2 tokens (left-padded to 7 in a batched call) and their seeds."""
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(5, 128, (n,), generator=gen) for n in (3, 7, 5, 2)], [21, 22, 23, 24]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_batched_calls_sample_what_one_call_per_prompt_samples(family):
    """Left-padded prompts of 2-7 tokens, 4 completions each: one call, two groups per call and one group per call
    all sample the exact mode's tokens. (The padded logits differ from the unpadded ones in their last bits only:
    a token can flip only where two perturbed scores tie that closely; none here.)"""
    model = _tiny(family).eval()
    params = SamplingParams(max_new_tokens=8, pad_token_id=0, eos_token_id=3, temperature=0.9, top_k=40)
    prompts, seeds = _four_prompts()
    with generation_mode(model):
        view = GenerationView(model, params, torch.device("cpu"), GenerationStats("phase", False, False))
        exact = [view.generate(p, 4, s) for p, s in zip(prompts, seeds)]
        for rows, calls in ((0, 1), (8, 2), (3, 4)):
            before = view.stats.calls
            batched = view.generate_batch(prompts, 4, seeds, rows_per_call=rows)
            assert view.stats.calls - before == calls
            for a, b in zip(exact, batched):
                assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.lengths, b.lengths)
                assert torch.equal(a.truncated, b.truncated)
        view.close()
    assert view.stats.forward_widths[0] == 3  # the exact call of the first prompt: unpadded
    assert 7 in view.stats.forward_widths  # a batched call's prefill: padded to the longest prompt


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_static_cache_samples_the_dynamic_caches_tokens_and_its_calls_do_not_depend_on_the_ones_before(family):
    """rl.cache_implementation static: exact and batched calls sample the dynamic cache's tokens (each row its own
    seeded generator, cut at its EOS); the cache's longer masked attention moves the log-probs in their last bits
    only (fp32: < 1e-6). An exact call is sized by its own prompt (transformers would keep the longest of the
    model's earlier calls): the same call after a longer one is bitwise the same, as on a rank that had no other."""
    model = _tiny(family).eval()
    base = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=3, temperature=0.9, top_k=40)
    prompts, seeds = _four_prompts()
    runs = {}
    with generation_mode(model):
        for cache in (None, "static"):
            params = SamplingParams(**base, cache_implementation=cache)
            assert params.generation_config().cache_implementation == cache
            view = GenerationView(model, params, torch.device("cpu"), GenerationStats("phase", False, False))
            exact = [view.generate(p, 4, s) for p, s in zip(prompts, seeds)]
            runs[cache] = exact, view.generate_batch(prompts, 4, seeds), view.generate(prompts[0], 4, seeds[0])
            view.close()
    for dynamic, static in zip(runs[None][0] + runs[None][1], runs["static"][0] + runs["static"][1]):
        assert torch.equal(dynamic.completion_ids, static.completion_ids)
        assert torch.equal(dynamic.lengths, static.lengths) and torch.equal(dynamic.truncated, static.truncated)
        assert torch.allclose(dynamic.sampling_logps, static.sampling_logps, rtol=0, atol=1e-6)
    first, again = runs["static"][0][0], runs["static"][2]  # the first prompt alone, then after longer calls
    assert torch.equal(first.completion_ids, again.completion_ids) and torch.equal(first.sampling_logps,
                                                                                   again.sampling_logps)


def test_a_static_cache_is_refused_by_name_where_transformers_builds_none():
    from zerotrain.backends.generation import check_static_cache
    from zerotrain.errors import UserError

    with pytest.raises(ValueError, match="cache_implementation must be one of None, dynamic, static"):
        SamplingParams(max_new_tokens=4, pad_token_id=0, cache_implementation="offloaded")
    model = _tiny("gpt2")
    check_static_cache(model)  # GPT-2 and Llama have one
    check_static_cache(_tiny("llama"))
    own = type("OwnCacheLM", (type(model),), {"_supports_default_dynamic_cache": classmethod(lambda cls: False)})
    model.__class__ = own  # a model with a cache of its own (transformers: reformer, xlnet, rwkv, ...)
    with pytest.raises(UserError, match=r"^rl.cache_implementation=static: OwnCacheLM \(model type 'gpt2'\) has a cache of its own; drop"):
        check_static_cache(model)
    # the phase refuses it before it gathers anything (the engine's gather hook is never reached)
    engine = SimpleNamespace(hf_model=model, plan=SimpleNamespace(world=SimpleNamespace(tp=1, sp=1, ep=1)),
                             whole_step=False)
    static = SamplingParams(max_new_tokens=4, pad_token_id=0, cache_implementation="static")
    with pytest.raises(UserError, match=r"OwnCacheLM \(model type 'gpt2'\) has a cache of its own"):
        with Engine.generation_phase(engine, static):
            pass
    model = _tiny("llama")
    model.config.layer_types = ["no_such_layer"] * 2  # a layer kind transformers' StaticCache does not know
    with pytest.raises(UserError, match="has a layer transformers' StaticCache does not hold"):
        check_static_cache(model)

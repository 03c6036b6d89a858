"""The generation view's parts that need no ranks (zerotrain/backends/generation.py): completions cut at their
first EOS as TRL cuts them, the sampling settings TRL's GRPOTrainer gives transformers, their refusals, the
layouts refused, and one process's generate through the view: transformers' own samples for the seed, the KV cache
on although the model's config turned it off, the model's modes and torch's RNG state restored."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zerotrain.backends.base import AuxiliaryModel, Engine
from zerotrain.backends.generation import (GenerationStats, GenerationView, SamplingParams, completions_of,
                                           generation_mode, refused_layout)


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
    g = p.generation_config()
    assert (g.do_sample, g.max_new_tokens, g.temperature, g.top_p, g.top_k, g.use_cache) == (True, 8, 0.7, 0.9, 5, True)
    assert g.eos_token_id == [2, 3] and g.pad_token_id == 0 and g.disable_compile and p.eos_ids == [2, 3]
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


def test_one_process_generate_is_transformers_with_the_cache_on_and_leaves_no_trace():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=128,
                                         attention_dropout=0.5, use_cache=False))
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
    assert torch.equal(rng, torch.get_rng_state())
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    model.eval()
    torch.manual_seed(11)
    with torch.no_grad():
        out = model.generate(input_ids=prompt.repeat(3, 1), attention_mask=torch.ones(3, 3, dtype=torch.long),
                             do_sample=True, max_new_tokens=6, eos_token_id=[3, 4], pad_token_id=0,
                             temperature=0.8, top_k=20, use_cache=True)
    want = completions_of(out[:, 3:], [3, 4], 0)
    assert torch.equal(got.completion_ids, want.completion_ids) and torch.equal(got.lengths, want.lengths)
    assert stats.forward_widths[0] == 3 and set(stats.forward_widths[1:]) <= {1}  # the KV cache
    assert stats.calls == 1 and stats.tokens == int(want.lengths.sum()) and stats.gathers == 0
    with pytest.raises(RuntimeError, match="outside its generation phase"):
        view.generate(prompt, 1, 0)

"""The pipeline split runs each block with the mask the HF model builds for it (pipeline_parts.Block):
chained, the layers give the model's own logits for a sliding-window Mistral and a Qwen2 whose blocks
alternate full / sliding attention; an attention type the split does not build is refused in one line."""
from __future__ import annotations

import pytest
import torch

import tests.support.families as families
import tests.support.reference as ref


@pytest.mark.parametrize("family", ["mistral", "qwen2-alternating", "llama", "gpt2"])
def test_chained_layers_give_the_models_logits(tmp_path, family):
    import transformers

    from zerotrain.model.pipeline_parts import decoder_layers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(families.make_model_dir(family, tmp_path))).eval()
    ids = ref.probe_input()  # 32 tokens: twice the sliding window
    with torch.no_grad():
        hidden, unmasked = ids, ids
        for layer in decoder_layers(model):
            hidden = layer(hidden)
            if hasattr(layer, "mask_builder"):  # what the split did before: full causal attention everywhere
                layer.mask_builder = "create_causal_mask"
            unmasked = layer(unmasked)
        logits = model(ids).logits
    torch.testing.assert_close(hidden, logits, rtol=0, atol=0)
    window = family in ("mistral", "qwen2-alternating")
    assert (unmasked - logits).abs().max().item() > 1e-4 if window else torch.equal(unmasked, logits)


def test_attention_types_and_the_refusal():
    from zerotrain.model.facts import attention_types_of
    from zerotrain.model.pipeline_parts import pipeline_problem
    from zerotrain.tasks import task_spec

    assert attention_types_of(families.MASKED_DECODERS["mistral"].config()) == ("sliding_attention",) * 2
    assert attention_types_of(families.MASKED_DECODERS["qwen2-alternating"].config()) == \
        ("full_attention", "sliding_attention")
    assert attention_types_of(families.FAMILIES["llama"].config()) == ("full_attention",) * 2
    assert pipeline_problem("qwen2", task_spec("causal-lm"), 2, 2, ("full_attention", "sliding_attention")) is None
    line = pipeline_problem("qwen2", task_spec("causal-lm"), 2, 2, ("chunked_attention", "full_attention"))
    assert line == ("parallel.pp=2: the model's blocks use chunked_attention, whose mask the pipeline split does not "
                    "build (it builds full_attention, sliding_attention); pass --pp 1")

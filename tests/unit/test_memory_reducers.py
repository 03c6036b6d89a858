"""The memory reducers (zerotrain/model/memory_reducers.py) in one process: the tiled MLP and the chunked loss give
the untiled model's loss and gradients (fp32, 1e-5) on a GPT-2 (Conv1D MLP, tied head) and a Llama (gated MLP,
untied head); what backward keeps shrinks by the activations they cut (the [seq, vocab] logits, the MLPs'
[seq, intermediate] tensors), counted from autograd's saved tensors; the settings are refused in one line where
they mean nothing or cannot be carried. Under ranks (sp=2, ZeRO-3 and FSDP2): tests/multirank/test_sequence_parallel.py."""
from __future__ import annotations

import pytest
import torch

import tests.support.families as families
from zerotrain.config.load import build_config
from zerotrain.errors import UserError
from zerotrain.model import memory_reducers as mr
from zerotrain.model.facts import model_facts
from zerotrain.plan.run_plan import build_plan

RTOL = 1e-5


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def family_model(request, tmp_path_factory):
    d = families.make_model_dir(request.param, tmp_path_factory.mktemp("reducers") / request.param)
    return request.param, families.builder(d, "causal-lm")


def _batch(seq: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, families.VOCAB, (2, seq), generator=g)
    labels = x.clone()
    labels[0, seq * 3 // 4:] = -100  # rows count different numbers of tokens
    return x, labels


def _loss_and_grads(model, x, labels, **kw):
    out = model(input_ids=x, labels=labels, **kw)
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("reducers", [dict(tiled_mlp=7, chunked_loss=0), dict(tiled_mlp=0, chunked_loss=9),
                                      dict(tiled_mlp=5, chunked_loss=13), dict(tiled_mlp=0, chunked_loss=9, fused=True),
                                      dict(tiled_mlp=5, chunked_loss=13, fused=True)])
def test_loss_and_grads_equal_the_plain_model(family_model, reducers):
    family, build = family_model
    x, labels = _batch()
    loss, grads = _loss_and_grads(build(), x, labels)
    model = mr.apply(build(), **reducers)
    loss_r, grads_r = _loss_and_grads(model, x, labels)
    assert loss_r == pytest.approx(loss, rel=RTOL)
    for name, g in grads.items():
        torch.testing.assert_close(grads_r[name], g, rtol=RTOL, atol=1e-7, msg=f"{family} {reducers} {name}")
    with torch.no_grad():  # eval keeps the model's own forward: the logits the metrics read
        assert model(input_ids=x, labels=labels).logits.shape == (2, x.shape[1], families.VOCAB)


def test_chunked_loss_takes_the_engines_divisor_and_preshifted_labels(family_model):
    """The engines pass num_items_in_batch (the step's token count) and, under sp, labels already shifted."""
    _, build = family_model
    x, labels = _batch()
    n = torch.tensor(50.0)
    plain = build()(input_ids=x, labels=labels, num_items_in_batch=n).loss
    model = mr.apply(build(), 0, 16)
    assert float(model(input_ids=x, labels=labels, num_items_in_batch=n).loss) == pytest.approx(float(plain), rel=RTOL)
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    assert float(model(input_ids=x, shift_labels=shifted, labels=shifted).loss) == pytest.approx(
        float(build()(input_ids=x, labels=labels).loss), rel=RTOL)


def test_chunked_token_logps_are_the_log_softmax_of_the_labels(family_model):
    _, build = family_model
    model = build()
    x, labels = _batch()
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    hidden = model.base_model(input_ids=x).last_hidden_state
    logps = mr.chunked_token_logps(hidden, model.get_output_embeddings(), shifted, 11)
    full = model.get_output_embeddings()(hidden).float().log_softmax(-1)
    expected = torch.where(shifted == -100, 0.0, full.gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(logps, expected, rtol=RTOL, atol=1e-6)


def test_a_chunked_model_still_generates_left_padded_prompts_as_it_did(family_model):
    """transformers' generate builds position ids from the attention mask only for a forward that declares
    position_ids: the chunked forward shows the model's own parameters, so a left-padded prompt generates the
    tokens it generates alone (before: shifted positions, other tokens)."""
    import inspect

    _, build = family_model
    plain = build().eval()
    chunked = mr.apply(build().eval(), 0, 9)
    assert inspect.signature(chunked.forward).parameters.keys() == inspect.signature(plain.forward).parameters.keys()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6]])
    mask = (torch.arange(6) >= torch.tensor([[3], [0]])).long()
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        got = chunked.generate(input_ids=ids, attention_mask=mask, **kw)[0, 6:]
        alone = plain.generate(input_ids=ids[:1, 3:], attention_mask=torch.ones(1, 3, dtype=torch.long), **kw)[0, 3:]
    assert got.tolist() == alone.tolist()


def _saved_bytes(model, x, labels) -> int:
    """Bytes autograd keeps for backward after the forward (each storage once)."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=x, labels=labels).loss.backward()
    return sum(storages.values())


def test_backward_keeps_less(family_model):
    """At 256 tokens: the chunked loss drops at least the fp32 logits (4 x tokens x vocab bytes), the tiled MLP at
    least two [tokens, intermediate] fp32 tensors per block."""
    family, build = family_model
    x, labels = _batch(256)
    cfg = build().config
    tokens, inter = x.numel(), getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size
    layers = cfg.num_hidden_layers
    plain = _saved_bytes(build(), x, labels)
    chunked = _saved_bytes(mr.apply(build(), 0, 32), x, labels)
    tiled = _saved_bytes(mr.apply(build(), 32, 0), x, labels)
    assert plain - chunked >= 4 * tokens * families.VOCAB, (family, plain, chunked)
    assert plain - tiled >= 2 * 4 * tokens * inter * layers, (family, plain, tiled)


def test_a_model_whose_logits_are_transformed_is_refused(family_model):
    _, build = family_model
    model = build()
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(UserError, match=r"model.chunked_loss: .* transforms its logits \(final_logit_softcapping=30.0\)"):
        mr.apply(model, 0, 16)
    mr.apply(model, 16, 0)  # the tiled MLP does not touch the head


def test_grpo_chunks_its_policy_head_by_default_where_the_head_carries_it(family_model):
    """grpo's default (model.chunked_loss None, TaskSpec.chunks_by_default): the vocabulary's auto chunk on the
    model's plain Linear head, named on the banner; --chunked-loss 0 and the preference tasks keep the whole logits;
    a model that transforms its logits runs whole, named on the banner, instead of being refused."""
    from zerotrain.model.fused_loss import auto_chunk_tokens
    from zerotrain.model.preparation import ModelPreparation

    _, build = family_model

    def prepared(task: str, **overrides):
        prep = ModelPreparation.from_config(build_config(overrides={"model.task": task, **overrides}))
        return prep, prep.apply(build())

    prep, model = prepared("grpo")
    assert prep.chunked_loss is None and mr.installed_chunk(model) == auto_chunk_tokens(families.VOCAB) > 0
    assert "the task's default, --chunked-loss 0: off" in " ".join(prep.banner(model))
    assert mr.installed_chunk(prepared("grpo", **{"model.chunked_loss": 0})[1]) == 0
    assert mr.installed_chunk(prepared("grpo", **{"model.chunked_loss": 16})[1]) == 16
    assert mr.installed_chunk(prepared("dpo")[1]) == 0
    prep = ModelPreparation.from_config(build_config(overrides={"model.task": "grpo"}))
    capped = build()
    capped.config.final_logit_softcapping = 30.0
    capped = prep.apply(capped)
    assert mr.installed_chunk(capped) == 0
    assert "chunked loss: off (" in " ".join(prep.banner(capped)) and "final_logit_softcapping=30.0" in \
        " ".join(prep.banner(capped))


def test_grpos_default_leaves_a_mixture_of_experts_whole(tmp_path):
    """A mixture of experts' causal LM adds the router loss after the backbone, which the chunked path skips: grpo's
    default runs it whole (its router loss kept), named on the banner."""
    from zerotrain.model.preparation import ModelPreparation

    moe = families.builder(families.make_model_dir("mixtral", tmp_path / "mixtral"), "causal-lm")()
    prep = ModelPreparation.from_config(build_config(overrides={"model.task": "grpo"}))
    model = prep.apply(moe)
    assert mr.installed_chunk(model) == 0
    assert "chunked loss: off (MixtralForCausalLM is a mixture of experts" in " ".join(prep.banner(model))


def _plan(device: str = "cpu", backend: str = "fsdp", **settings):
    cfg = build_config(overrides={"backend": backend, **{k.replace("__", "."): v for k, v in settings.items()}})
    return build_plan(cfg, 2, backend=backend, device=device, facts=model_facts("tiny-llama"))


@pytest.mark.parametrize("settings,needle", [
    (dict(model__offload_activations=True), "model.offload_activations=True moves saved activations from GPU to host "
                                            "memory; on CPU they already are in host memory; drop it"),
    (dict(model__chunked_loss=512, model__task="seq-cls"), "model.chunked_loss=512 chunks a causal LM's vocabulary "
                                                            "logits; this task (model.task) does not run with it"),
    (dict(backend="deepspeed", model__tiled_mlp=512, parallel__pp=2),
     "model.tiled_mlp=512 with --pp 2 on the deepspeed backend: not supported yet (the pp split builds its own blocks "
     "and head); drop --tiled-mlp or pass --pp 1, or --backend fsdp"),
    (dict(backend="deepspeed", zero__stage=2, model__tiled_mlp=512, parallel__tp=2),
     "model.tiled_mlp=512 with --tp 2 on the deepspeed backend: not supported yet"),
    (dict(model__chunked_loss=512, parallel__tp=2), "model.chunked_loss=512 with --tp 2: not supported yet (no "
                                                     "vocabulary-parallel loss is built); drop --chunked-loss or pass "
                                                     "--tp 1"),
    (dict(model__fused_loss=True, parallel__tp=2), "model.fused_loss=True with --tp 2: not supported yet (no "
                                                   "vocabulary-parallel loss is built)"),
    (dict(model__chunked_loss=512, parallel__pp=2), "model.chunked_loss=512 with --pp 2: not supported yet (the pp "
                                                     "split builds its own blocks and head)"),
    (dict(device="cuda", model__offload_activations=True, parallel__pp=2),
     "model.offload_activations with --pp 2: not supported yet"),
])
def test_refusals_are_one_line(settings, needle):
    with pytest.raises(UserError) as e:
        _plan(settings.pop("device", "cpu"), **settings)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("dim", ["tp", "pp"])
def test_tiled_mlp_runs_under_fsdp_tp_and_pp(dim):
    """FSDP2's tensor-parallel split and pipeline stages keep each block's tiled MLP (tests/multirank/
    test_lora_tensor_parallel.py proves them against one process)."""
    settings = {"model__tiled_mlp": 64, f"parallel__{dim}": 2, **({"data__pack": True} if dim == "pp" else {})}
    assert _plan(**settings).preparation.tiled_mlp == 64


def test_flags_and_plan():
    """A bare flag takes 2048 tokens; the plan's preparation carries them; offload is a GPU run's setting."""
    import argparse

    from zerotrain.config.flags import add_run_flags, config_from_args

    p = argparse.ArgumentParser()
    add_run_flags(p)
    cfg = config_from_args(p.parse_args(["--tiled-mlp", "--chunked-loss", "1024"]))
    assert (cfg.model.tiled_mlp, cfg.model.chunked_loss) == (2048, 1024)
    prep = _plan(model__tiled_mlp=64, model__chunked_loss=128).preparation
    assert (prep.tiled_mlp, prep.chunked_loss) == (64, 128)
    assert _plan("cuda", model__offload_activations=True).cfg.model.offload_activations


def test_estimate_knows_the_reducers_and_sp():
    """What estimate/compare/tune size: the chunked loss keeps one chunk's logits (V x (4 + 8) bytes a token in fp32),
    the tiled MLP one tile's inner width, sp a 1/sp shard and its all-to-all volume; offload moves activations to host."""
    from dataclasses import replace

    from zerotrain.memory.estimate import estimate

    facts = replace(model_facts("tiny-llama"), max_positions=8192)

    def est(device="cpu", **settings):
        cfg = build_config(overrides={"backend": "fsdp", "zero.stage": 3, "data.seq_len": 4096, "batch.micro_batch": 1,
                                      **{k.replace("__", "."): v for k, v in settings.items()}})
        return estimate(build_plan(cfg, 2, backend="fsdp", device=device, facts=facts))

    plain, tiled = est(model__fused_loss=False), est(model__fused_loss=False, model__tiled_mlp=512)
    chunked = est(model__fused_loss=False, model__chunked_loss=512)
    assert plain.activations - chunked.activations == (4096 - 512) * facts.vocab_size * (4 + 8)
    from zerotrain.model.fused_loss import auto_chunk_tokens

    fused = est()  # the default: the fused loss, its own chunk and its fp32 head-gradient buffer
    chunk = auto_chunk_tokens(facts.vocab_size)
    assert plain.activations - fused.activations == (4096 - min(chunk, 4096)) * facts.vocab_size * (4 + 8) \
        - 4 * facts.vocab_size * facts.hidden_size
    inner = 2 * facts.intermediate_size * 4
    assert plain.activations - tiled.activations == facts.num_layers * 4096 * inner - 512 * inner
    sp2 = est(parallel__sp=2)
    assert sp2.activations < 0.51 * plain.activations and any("all-to-alls send" in n for n in sp2.notes)
    gpu = est("cuda", model__offload_activations=True, model__gradient_checkpointing=True)
    assert gpu.host_activations > 0 and gpu.activations + gpu.host_activations == est(
        "cuda", model__gradient_checkpointing=True).activations


def test_attn_implementation_builds_the_kernel_asked_and_its_refusals(tmp_path):
    """--attn-implementation reaches from_pretrained (the model's config records it); eager's [seq, seq] scores are
    in the estimate; a flash kernel on CPU and a non-SDPA kernel under sp are refused in one line."""
    from dataclasses import replace

    from transformers import AutoConfig

    from zerotrain.memory.estimate import estimate
    from zerotrain.model.source import ModelBuilder, ModelSource
    from zerotrain.tasks import task_spec

    d = families.make_model_dir("llama", tmp_path / "llama")
    for impl in ("eager", "sdpa"):
        source = ModelSource(task_spec("causal-lm"), str(d), AutoConfig.from_pretrained(d), tokenizer=None,
                             attn_implementation=impl)
        assert ModelBuilder(source, {}).__call__().config._attn_implementation == impl
        assert ModelBuilder(source, {}).empty().config._attn_implementation == impl
    facts = replace(model_facts("tiny-llama"), max_positions=8192)

    def est(**settings):
        cfg = build_config(overrides={"backend": "fsdp", "data.seq_len": 2048, "batch.micro_batch": 1,
                                      **{k.replace("__", "."): v for k, v in settings.items()}})
        return estimate(build_plan(cfg, 2, backend="fsdp", device="cpu", facts=facts)).activations

    assert est(model__attn_implementation="eager") - est() == facts.num_layers * 2 * facts.num_heads * 2048 ** 2 * 4
    for settings, needle in ((dict(model__attn_implementation="flash_attention_2"),
                              "model.attn_implementation=flash_attention_2 needs a CUDA GPU (this run is on cpu)"),
                             (dict(model__attn_implementation="eager", parallel__sp=2),
                              "model.attn_implementation=eager with --sp 2: sequence parallelism runs its own")):
        with pytest.raises(UserError) as e:
            _plan(**settings)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_tiled_mlp_refuses_mixture_of_experts_blocks(tmp_path):
    d = families.make_model_dir("mixtral", tmp_path / "mixtral")
    with pytest.raises(UserError, match=r"model.tiled_mlp: MixtralForCausalLM's MLPs are mixture-of-experts blocks"):
        mr.check(families.builder(d, "causal-lm")(), 64, 0)
    mr.check(families.builder(d, "causal-lm")(), 0, 64)  # its head is a plain Linear: the chunked loss runs


def test_reducers_under_a_peft_wrapper(family_model):
    """LoRA first, then the reducers (ModelPreparation.apply's order): the chunked forward sits on peft's base
    model, the tiles on its MLPs, and the adapters' gradients equal the plain peft model's."""
    from peft import LoraConfig, get_peft_model

    family, build = family_model
    targets = ["c_attn", "c_fc"] if family == "gpt2" else ["q_proj", "up_proj"]

    def peft_model():
        torch.manual_seed(0)
        m = get_peft_model(build(), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        for n, p in m.named_parameters():
            if "lora_B" in n:  # non-zero B, so every adapter gets a gradient through the reducers
                torch.nn.init.normal_(p, std=0.02)
        return m

    x, labels = _batch()
    torch.manual_seed(1)
    loss, grads = _loss_and_grads(peft_model(), x, labels)
    model = mr.apply(peft_model(), tiled_mlp=7, chunked_loss=9)
    loss_r, grads_r = _loss_and_grads(model, x, labels)
    assert loss_r == pytest.approx(loss, rel=RTOL)
    lora = [n for n in grads if "lora_" in n]
    assert lora and all(torch.allclose(grads_r[n], grads[n], rtol=RTOL, atol=1e-7) for n in lora), family


# --- the fused linear + cross-entropy (zerotrain/model/fused_loss.py) ---------------------------------------------
@pytest.mark.parametrize("vocab", [32000, 128256])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_loss_equals_the_plain_loss_and_gradients(vocab, with_bias):
    """At Llama-2's and Llama-3's vocabularies, fp32, against F.linear + cross_entropy in fp64: the loss within 1e-6 and
    the gradients of the hidden states, weight and bias within 2e-6 of their largest entry, never further than fp32
    F.linear + cross_entropy itself (1.1e-5 at vocab 128k: its sums over the vocabulary); with ignored labels, a chunk
    that does not divide the tokens and an upstream gradient (a loss divisor) that scales them."""
    from zerotrain.model.fused_loss import fused_linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    n, h = 300, 24
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, h, generator=g, dtype=torch.float64).mul_(0.5)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64) if with_bias else None
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::7] = -100

    def run(dtype, fused):
        wrt = [t.to(dtype).requires_grad_() for t in (hidden, weight) + ((bias,) if with_bias else ())]
        b = wrt[2] if with_bias else None
        loss = fused_linear_cross_entropy(wrt[0], wrt[1], b, labels, 64) if fused else \
            torch.nn.functional.cross_entropy(torch.nn.functional.linear(wrt[0], wrt[1], b), labels,
                                              ignore_index=-100, reduction="sum")
        return float(loss), [t.double() for t in torch.autograd.grad(loss / 7.0, wrt)]

    exact, exact_grads = run(torch.float64, False)
    plain, plain_grads = run(torch.float32, False)
    fused, fused_grads = run(torch.float32, True)
    assert fused == pytest.approx(exact, rel=1e-6)
    for name, f, p, e in zip(("hidden", "weight", "bias"), fused_grads, plain_grads, exact_grads):
        err, plain_err = float((f - e).abs().max()), float((p - e).abs().max())
        assert err <= max(2e-6 * float(e.abs().max()), plain_err), (name, err, plain_err, float(e.abs().max()))


def test_the_fused_loss_is_the_default_and_says_so(family_model):
    """A causal-LM plan without --chunked-loss installs the fused loss with its own chunk (the banner names it);
    --no-fused-loss keeps the model's own loss; a head the fused loss cannot compute (a fake-quantized Linear)
    is run by its own forward (auto) or refused (--fused-loss)."""
    from zerotrain.model import fused_loss
    from zerotrain.model.preparation import ModelPreparation

    family, build = family_model
    x, labels = _batch()
    loss, grads = _loss_and_grads(build(), x, labels)
    prep = ModelPreparation(fused_loss=None)
    model = prep.apply(build())
    assert getattr(model.get_output_embeddings(), "_zt_fused", False)
    assert any(line.startswith("fused loss: head + cross-entropy over chunks of "
                               f"{fused_loss.auto_chunk_tokens(families.VOCAB)} tokens") for line in prep.banner(model))
    loss_f, grads_f = _loss_and_grads(model, x, labels)
    assert loss_f == pytest.approx(loss, rel=RTOL)
    for name, gr in grads.items():
        torch.testing.assert_close(grads_f[name], gr, rtol=RTOL, atol=1e-7, msg=f"{family} {name}")
    off = ModelPreparation(fused_loss=False).apply(build())
    assert not getattr(off.get_output_embeddings(), "_zt_fused", False)

    class FakeQuantized(torch.nn.Linear):
        pass

    odd = build()
    head = odd.get_output_embeddings()
    head.__class__ = FakeQuantized
    auto = ModelPreparation(fused_loss=None)
    assert auto.loss_chunk(odd) == 0 and "fused loss: off (" in auto.banner(auto.apply(odd))[-1]
    with pytest.raises(UserError, match=r"^model.fused_loss: .*FakeQuantized .*; drop --fused-loss$"):
        ModelPreparation(fused_loss=True).apply(build_with_head(build, FakeQuantized))


def build_with_head(build, cls):
    model = build()
    model.get_output_embeddings().__class__ = cls
    return model


def test_the_fused_loss_keeps_far_less_for_backward(family_model):
    """At 256 tokens the fused loss keeps no logits for backward: at least the fp32 logits (4 x tokens x vocab bytes)
    less than the plain loss, counted from autograd's saved tensors."""
    from zerotrain.model.preparation import ModelPreparation

    family, build = family_model
    x, labels = _batch(256)
    plain = _saved_bytes(build(), x, labels)
    fused = _saved_bytes(ModelPreparation(fused_loss=None).apply(build()), x, labels)
    assert plain - fused >= 4 * x.numel() * families.VOCAB, (family, plain, fused)


def test_a_mixture_of_experts_keeps_its_own_loss(tmp_path):
    """Mixtral's forward adds the router's load-balancing loss to the LM loss: the fused loss (auto) stays off and
    says why, so the router loss is never dropped; asking for it is refused in one line."""
    from zerotrain.model.preparation import ModelPreparation

    build = families.builder(families.make_model_dir("mixtral", tmp_path / "mixtral"), "causal-lm")
    auto = ModelPreparation(fused_loss=None)
    model = auto.apply(build())
    assert auto.loss_chunk(model) == 0 and not getattr(model.get_output_embeddings(), "_zt_fused", False)
    assert "fused loss: off (MixtralForCausalLM is a mixture of experts" in auto.banner(model)[0]
    with pytest.raises(UserError, match=r"^model.fused_loss: MixtralForCausalLM is a mixture of experts.*; drop"):
        ModelPreparation(fused_loss=True).apply(build())


def test_an_explicit_chunked_loss_0_is_off_for_any_task():
    """--chunked-loss 0 says "off" (grpo's default on, the others' already): accepted for a task without the chunked
    loss, where a chunk asked for is refused."""
    from zerotrain.config.rules import unused_settings

    assert unused_settings(build_config(overrides={"model.task": "seq-cls", "model.chunked_loss": 0}), "fsdp", 3,
                           "cpu") == []
    with pytest.raises(UserError, match="model.chunked_loss=16 chunks a causal LM's vocabulary logits"):
        unused_settings(build_config(overrides={"model.task": "seq-cls", "model.chunked_loss": 16}), "fsdp", 3, "cpu")


def test_the_estimate_leaves_a_mixture_of_experts_logits_whole_where_the_run_does():
    """A default chunking (grpo's task default, the causal LM's fused loss) is off on a mixture of experts
    (default_chunk_problem: its forward adds the router loss after the backbone), so the estimate sizes its whole
    logits, as --chunked-loss 0 / --no-fused-loss; an explicit chunk is sized as asked; a dense model keeps its chunk
    (a 128k vocabulary: its auto chunk, 512 tokens, is below the micro-batch's 8192)."""
    from dataclasses import replace

    from zerotrain.memory.estimate import estimate

    def acts(name: str, task: str, **settings) -> int:
        cfg = build_config(overrides={"model.task": task, "backend": "fsdp", "zero.stage": 3, "data.seq_len": 2048,
                                      "batch.micro_batch": 4, **({"rl.num_generations": 4} if task == "grpo" else {}),
                                      **{k.replace("__", "."): v for k, v in settings.items()}})
        facts = replace(model_facts(name), vocab_size=131072)
        return estimate(build_plan(cfg, 2, backend="fsdp", device="cpu", facts=facts)).activations

    assert model_facts("tiny-mixtral").moe_blocks > 0 and model_facts("tiny-llama").moe_blocks == 0
    assert acts("tiny-mixtral", "grpo") == acts("tiny-mixtral", "grpo", model__chunked_loss=0)
    assert acts("tiny-mixtral", "causal-lm") == acts("tiny-mixtral", "causal-lm", model__fused_loss=False)
    assert acts("tiny-mixtral", "grpo", model__chunked_loss=64) < acts("tiny-mixtral", "grpo")
    assert acts("tiny-llama", "grpo") < acts("tiny-llama", "grpo", model__chunked_loss=0)

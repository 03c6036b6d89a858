"""Quantized export and QAT conversion in one process (torchao through zerotrain/model/quant.py), tiny Llama and
Qwen2 built locally and loaded back through from_pretrained; GPT-2 (Conv1D) is refused.

Each export is reloaded with `AutoModelForCausalLM.from_pretrained(OUT)`: its Linear layers must hold the
scheme's own torchao weight type (int8-weight and int8-dynamic told apart by the activation kwargs), and its
logits must equal the in-memory quantized model's.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import tests.support.families as families

pytest.importorskip("torchao")

from zerotrain.config.load import build_config  # noqa: E402
from zerotrain.errors import UserError  # noqa: E402
from zerotrain.export.quantized import REPORT_FILE, QuantizeRequest, export_quantized  # noqa: E402
from zerotrain.model import quant  # noqa: E402
from zerotrain.model.preparation import ModelPreparation  # noqa: E402

EXPORTABLE = ("int8-weight", "int8-dynamic", "int4-weight", "int8-dynamic-int4-weight")
GROUP = 16  # divides the tiny families' widths (64, 128)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant")
    return {f: families.make_model_dir(f, root / f) for f in ("llama", "qwen2", "gpt2")}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ids(n: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, families.VOCAB, (n, seq), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme", EXPORTABLE)
def test_export_reloads_with_the_schemes_layers_and_logits(model_dirs, tmp_path, family, scheme):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "q"
    group = GROUP if quant.SCHEMES[scheme].grouped else None
    report = export_quantized(model_dirs[family], out, QuantizeRequest(scheme=scheme, group_size=group, seq_len=16,
                                                                       serve_timing="eager"))
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    counts = quant.layer_schemes(reloaded)
    assert counts == {scheme: 14}, counts  # 2 blocks x 7 projections
    assert quant.embedding_schemes(reloaded) == {"input_embedding": "none", "output_head": "none"}  # stay fp32
    assert report["layer_schemes"] == counts and report["layers_quantized"] == 14
    # the same quantization in memory, by torchao directly, gives the reloaded directory's logits
    expected = AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=torch.float32).eval()
    from torchao.quantization import quantize_

    heads = {id(expected.get_output_embeddings())}
    quantize_(expected, quant.torchao_config(scheme, GROUP),
              filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and id(m) not in heads)
    ids = _ids()
    assert torch.allclose(_logits(reloaded, ids), _logits(expected, ids), rtol=0, atol=1e-6)
    assert report["max_abs_logit_diff_reloaded_vs_in_memory"] <= 1e-6
    saved = json.loads((out / REPORT_FILE).read_text())
    assert saved["scheme"] == scheme and saved["bytes_quantized"] < saved["bytes_source"]
    for model in ("fp32", "quantized"):
        for shape in ("prefill", "decode"):
            t = saved["latency_ms"][model]["eager"][shape]
            assert 0 < t["min_ms"] <= t["median_ms"] <= t["max_ms"], t
    assert saved["timed_shapes"] == {"prefill": [4, 16], "decode": [1, 1]} and saved["serving_path"] == "eager"
    assert saved["group_size"] == (GROUP if quant.SCHEMES[scheme].grouped else None)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "torchao"
    # estimate's serving size (meta build) against the bytes on disk (safetensors header + torchao metadata
    # are the difference: ~30 KB, a few % at this size)
    from zerotrain.model.facts import load_hf_config, meta_model

    predicted = quant.serving_bytes(meta_model(load_hf_config(str(model_dirs[family]))), GROUP)
    assert predicted[scheme] == pytest.approx(saved["bytes_quantized"], rel=0.08)
    assert predicted["fp32"] == pytest.approx(saved["bytes_source"], rel=0.02)


def test_qat_convert_equals_quantizing_the_learned_weights(model_dirs):
    """final/quantized-<scheme>/ quantizes the QAT run's saved full-precision weights: the same result as
    torchao's QAT convert step, and the converted logits equal the fake-quantized model's."""
    from transformers import AutoModelForCausalLM

    for scheme in quant.QAT_SCHEMES:
        cfg = build_config(overrides={"quant.qat": scheme, "quant.group_size": GROUP})
        model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
        plain = copy.deepcopy(model)
        assert ModelPreparation.from_config(cfg).apply(model) is model  # in place, as the engines prepare it
        assert quant.fake_quantized_layers(model) == 14
        assert model.state_dict().keys() == plain.state_dict().keys()  # checkpoints and final/ unchanged
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = _ids(4, 16)
        losses = []
        for _ in range(3):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        plain_loss = float(plain(input_ids=ids, labels=ids).loss)
        assert abs(losses[0] - plain_loss) > 1e-4 * plain_loss, "the fake-quantized forward changed nothing"
        model.eval()
        fake = _logits(model, ids)
        learned = {k: v.detach().clone() for k, v in model.state_dict().items()}
        quant.qat_convert(model, scheme, GROUP)
        assert torch.equal(_logits(model, ids), fake)  # the converted model computes what training saw
        plain.load_state_dict(learned)
        quant.quantize_model(plain, scheme, GROUP)
        assert torch.equal(_logits(plain.eval(), ids), fake)


def test_conv1d_models_are_refused_in_one_line(model_dirs, tmp_path):
    with pytest.raises(UserError, match=r"gpt2 keeps its projections in transformers' Conv1D.*Llama, Qwen2"):
        export_quantized(model_dirs["gpt2"], tmp_path / "g", QuantizeRequest(scheme="int8-weight"))
    assert not (tmp_path / "g").exists()
    from zerotrain.model.facts import load_hf_config, meta_model, model_facts

    sizes = quant.serving_bytes(meta_model(load_hf_config(str(model_dirs["gpt2"]))), GROUP)
    assert sizes["fp32"] > 0 and all(v is None for k, v in sizes.items() if k != "fp32")
    with pytest.raises(UserError, match="--qat int4-weight: gpt2 keeps its projections"):
        model_facts(str(model_dirs["gpt2"]), None, build_config(overrides={"quant.qat": "int4-weight"}))


def test_refusals(model_dirs, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(UserError, match=r"--quant-group-size 48: does not divide the input width 64 .*pass --quant-group-size 64"):
        export_quantized(model_dirs["llama"], out, QuantizeRequest(scheme="int4-weight", group_size=48))
    with pytest.raises(UserError, match="does not exist"):
        export_quantized(tmp_path / "nothing", out, QuantizeRequest(scheme="int8-weight"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(UserError, match="holds a LoRA adapter, not a model.*--merge-lora"):
        export_quantized(adapter, out, QuantizeRequest(scheme="int8-weight"))
    assert not out.exists()
    from zerotrain.config.rules import ConfigError, check_config

    for overrides, match in (({"lora.r": 8, "model.name": "x"}, "QAT trains the full weights"),
                             ({"parallel.tp": 2}, "QAT runs with data parallelism"),
                             ({"model.task": "seq-cls"}, "quantized export is for causal LMs")):
        with pytest.raises(ConfigError, match=match):
            check_config(build_config(overrides={"quant.qat": "int4-weight", **overrides}))


def test_a_failed_export_keeps_the_earlier_output(model_dirs, tmp_path):
    out = tmp_path / "q"
    export_quantized(model_dirs["llama"], out, QuantizeRequest(scheme="int8-weight", seq_len=16, serve_timing="off"))
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(UserError):
        export_quantized(model_dirs["llama"], out, QuantizeRequest(scheme="int4-weight", group_size=48, seq_len=16,
                                                                        serve_timing="off"))
    assert sorted(p.name for p in out.iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind

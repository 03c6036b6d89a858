"""int8-static (PT2E + x86 inductor quantizer, a torch.export program) and --quantize-embeddings, through the CLI as
a user runs them, on a tiny Llama and a tiny Qwen2 (q/k/v biases, sliding window) fine-tuned here for a few dozen
steps so their perplexity means something; GPT-2 (Conv1D) is refused.

The program is reloaded in a fresh process with the loader lines docs/quantization.md gives, and its logits must
equal the in-memory quantized model's (the same calibration, redone here); the perplexity of the reloaded program
must stay within 2% of fp32's on the held-out split.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tests.support.families as families

pytest.importorskip("torchao")

from zerotrain.errors import UserError  # noqa: E402
from zerotrain.export import static_int8  # noqa: E402
from zerotrain.export.quantized import REPORT_FILE, QuantizeRequest, export_quantized  # noqa: E402
from zerotrain.model import quant  # noqa: E402

SEQ, BATCH = 32, 4
LOADER = """
import sys, torch
import torchao.quantization.pt2e  # registers the quantized_decomposed ops the program calls
program = torch.export.load(sys.argv[1] + "/model.pt2").module()
ids = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(program(ids), sys.argv[3])
    if sys.argv[4] == "compiled":
        torch._inductor.config.freezing = True
        torch.save(torch.compile(program)(ids), sys.argv[3] + ".compiled")
"""


def _fine_tune(model_dir: Path, train_rows: list[list[int]], steps: int = 40) -> None:
    """A few AdamW steps on the training split, saved back: perplexity well below a uniform guess."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        pick = torch.randint(0, len(train_rows), (8,), generator=g)
        ids = torch.tensor([train_rows[i] for i in pick])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(model_dir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from zerotrain.assets.demo import CORPUS, build_tokenizer

    root = tmp_path_factory.mktemp("static")
    lines = CORPUS.read_text().splitlines()
    cut = int(len(lines) * 0.9)
    train, val = root / "train.txt", root / "val.txt"
    train.write_text("\n".join(lines[:cut]) + "\n")
    val.write_text("\n".join(lines[cut:]) + "\n")
    tokenizer = build_tokenizer()  # 742 tokens: fits the families' vocabulary of 1024
    stream = tokenizer(" ".join(lines[:cut]))["input_ids"]
    rows = [stream[i:i + SEQ] for i in range(0, len(stream) - SEQ, SEQ)]
    dirs = {}
    for family in ("llama", "qwen2", "gpt2"):
        d = families.make_model_dir(family, root / family)
        tokenizer.save_pretrained(d)
        if family != "gpt2":
            _fine_tune(d, rows)
        dirs[family] = d
    return {"train": train, "val": val, "dirs": dirs}


def _zt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotrain", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=600)


def _request(setup, **kw) -> QuantizeRequest:
    return QuantizeRequest(**{"scheme": "int8-static", "calibration_data": str(setup["train"]),
                              "eval_data": str(setup["val"]), "seq_len": SEQ, "batch_size": BATCH, **kw})


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow), "qwen2"])  # CI: Qwen2 (CI time)
def test_static_int8_reloads_in_a_fresh_process_with_the_in_memory_logits(setup, tmp_path, family):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "static"
    timing = "both" if family == "llama" else "eager"  # compiled timing costs ~10 s a graph: one family
    res = _zt("export", str(setup["dirs"][family]), str(out), "--quantize", "int8-static", "--calibration-data",
              str(setup["train"]), "--eval-data", str(setup["val"]), "--seq-len", str(SEQ), "--batch-size", str(BATCH),
              "--serve-timing", timing)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "int8-static, 14 Linear layers" in res.stdout, res.stdout
    report = json.loads((out / REPORT_FILE).read_text())
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.pt2", REPORT_FILE,
                                                     "tokenizer.json", "tokenizer_config.json"]
    assert static_int8.README.split("    import torch\n")[1].split("    logits")[0].replace("    ", "") in \
        (Path(__file__).parents[2] / "docs" / "quantization.md").read_text().replace('"out/static/model.pt2"', '"model.pt2"')
    assert report["artifact"] == "program" and report["layer_schemes"] == {"int8-static": 14}
    assert report["embedding_schemes"] == {"input_embedding": "none", "output_head": "none"}
    assert report["calibration_batches"] > 0 and report["max_abs_logit_diff_reloaded_vs_in_memory"] == 0.0
    vocab = AutoModelForCausalLM.from_pretrained(setup["dirs"][family]).config.vocab_size
    import math

    assert report["eval_loss_before"] < 0.8 * math.log(vocab), report  # fine-tuned: far below a uniform guess
    assert abs(report["perplexity_change"]) <= 0.02, report
    # the program's tensors: int8 Linear weights (3 bytes saved a weight, less a scale and a zero point a row and the rotary buffers), fp32
    # embeddings and head; the serialized graph (~1.5 KB a node) is the rest of the file, more than a 64-wide model
    linear = sum(m.weight.numel() for m in quant.quantizable_linears(
        AutoModelForCausalLM.from_pretrained(setup["dirs"][family])).values())
    saved = report["bytes_source"] - report["bytes_quantized_tensors"]
    assert 0.8 * 3 * linear < saved < 3 * linear, (saved, linear)
    if timing == "both":
        assert set(report["latency_ms"]["quantized"]) == {"eager", "compiled"}
        assert set(report["compiled_vs_fp32_eager"]) == {"prefill", "decode"}
        assert report["serving_path"] in ("eager", "compiled")
    # the same quantization in this process (same calibration rows -> same scales) against the fresh process
    model = AutoModelForCausalLM.from_pretrained(setup["dirs"][family], dtype=torch.float32).eval()
    from zerotrain.export.quantized import _data_batches

    req = _request(setup)
    calibration = [b["input_ids"] for b in _data_batches(str(setup["train"]), req, _tokenizer(setup["dirs"][family]), 8)]
    in_memory = static_int8.quantize_static(model, calibration, False, 256)
    ids = torch.randint(0, vocab, (3, 24), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    mode = "compiled" if family == "llama" else "eager"
    res = subprocess.run([sys.executable, "-c", LOADER, str(out), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"),
                          mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    reloaded = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        expected = in_memory(ids)
    assert torch.allclose(reloaded, expected, rtol=1e-5, atol=1e-5), float((reloaded - expected).abs().max())
    if mode == "compiled":  # oneDNN's fused int8 kernels: the same quantized math, other rounding
        fused = torch.load(str(tmp_path / "out.pt") + ".compiled")
        assert float((fused - expected).abs().max()) < 0.05 * float(expected.abs().max())


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_quantize_embeddings_reaches_the_smaller_size_and_reloads(setup, tmp_path):
    """--quantize-embeddings: the torchao schemes reload with int8 embedding and head (from_pretrained), the static
    program holds an int8 embedding and a static int8 head; both smaller than without, perplexity within 2%."""
    from transformers import AutoModelForCausalLM

    src = setup["dirs"]["llama"]
    plain = export_quantized(src, tmp_path / "dyn", _request(setup, scheme="int8-dynamic", calibration_data=None,
                                                             serve_timing="off"))
    emb = export_quantized(src, tmp_path / "dyn-emb", _request(setup, scheme="int8-dynamic", calibration_data=None,
                                                               quantize_embeddings=True, serve_timing="off"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dyn-emb")
    assert quant.embedding_schemes(reloaded) == {"input_embedding": "int8-weight", "output_head": "int8-weight"}
    assert quant.layer_schemes(reloaded) == {"int8-dynamic": 14}
    assert emb["embedding_schemes"] == quant.embedding_schemes(reloaded)
    assert emb["max_abs_logit_diff_reloaded_vs_in_memory"] <= 1e-6
    assert emb["size_ratio"] < plain["size_ratio"] - 0.1, (emb["size_ratio"], plain["size_ratio"])
    assert abs(emb["perplexity_change"]) <= 0.02, emb
    static = export_quantized(src, tmp_path / "st-emb", _request(setup, quantize_embeddings=True, serve_timing="off"))
    assert static["embedding_schemes"] == {"input_embedding": "int8-weight", "output_head": "int8-static"}
    assert static["layer_schemes"] == {"int8-static": 14}
    assert static["max_abs_logit_diff_reloaded_vs_in_memory"] == 0.0
    assert abs(static["perplexity_change"]) <= 0.02, static
    program = torch.export.load(str(tmp_path / "st-emb" / "model.pt2"))
    big = {k: (type(v).__name__, v.dtype) for k, v in program.state_dict.items() if v.numel() >= families.VOCAB * 64}
    assert sorted(big.values()) == [("IntxUnpackedToInt8Tensor", torch.float32), ("Tensor", torch.int8)], big
    # (the embedding's torchao tensor holds int8 data under its float32 face; the head is a frozen int8 constant)


def test_refusals_and_the_calibration_warning(setup, tmp_path):
    src, out = setup["dirs"]["llama"], tmp_path / "o"
    with pytest.raises(UserError, match="--quantize int8-static: pass --calibration-data FILE"):
        export_quantized(src, out, QuantizeRequest(scheme="int8-static"))
    with pytest.raises(UserError, match="--calibration-data: only --quantize int8-static calibrates"):
        export_quantized(src, out, QuantizeRequest(scheme="int8-dynamic", calibration_data=str(setup["train"])))
    with pytest.raises(UserError, match="--calibration-batches: only --quantize int8-static calibrates"):
        export_quantized(src, out, QuantizeRequest(scheme="int8-weight", calibration_batches=4))
    with pytest.raises(UserError, match="--calibration-batches 0: pass at least 1"):
        export_quantized(src, out, _request(setup, calibration_batches=0))
    with pytest.raises(UserError, match="--quant-group-size: int8-static quantizes per output channel"):
        export_quantized(src, out, _request(setup, group_size=16))
    with pytest.raises(UserError, match="gpt2 keeps its projections in transformers' Conv1D"):
        export_quantized(setup["dirs"]["gpt2"], out, _request(setup))
    with pytest.raises(UserError, match="has no model.pt2; it is not an int8-static export"):
        static_int8.load_program(src)
    assert not out.exists()
    res = _zt("export", str(src), str(out), "--quantize", "int8-static", "--calibration-data", str(setup["val"]),
              "--eval-data", str(setup["val"]), "--seq-len", str(SEQ), "--serve-timing", "off",
              "--calibration-batches", "2")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "warning: --calibration-data is the --eval-data file" in res.stdout
    _assert_program_holds_the_int8_weights(out, src)
    res = _zt("export", str(src), str(tmp_path / "x"), "--quantize", "int8-static")
    assert res.returncode != 0 and "pass --calibration-data FILE" in res.stderr and "Traceback" not in res.stderr


def _assert_program_holds_the_int8_weights(out: Path, src: Path) -> None:
    """The saved program's tensors: each of the 14 Linear weights stored once as int8 [out, in] with an fp32 scale
    and a zero zero-point per output row (symmetric per-channel), and int8 x scale within half a step of the source
    weight it replaces; no fp32 copy of a Linear weight left in the file."""
    from transformers import AutoModelForCausalLM

    import torchao.quantization.pt2e  # noqa: F401  registers the quantized_decomposed ops

    program = torch.export.load(str(out / "model.pt2"))
    sig = program.graph_signature
    names = {**sig.inputs_to_parameters, **sig.inputs_to_buffers, **sig.inputs_to_lifted_tensor_constants}
    tensors = {**program.state_dict, **program.constants}
    linears = {k: m.weight.detach() for k, m in quant.quantizable_linears(
        AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)).items()}
    matched = set()
    for node in program.graph.nodes:
        if not (node.op == "call_function" and "dequantize_per_channel" in str(node.target)):
            continue
        q, scale, zero = (tensors[names[a.name]] for a in node.args[:3])
        assert (q.dtype, scale.dtype, zero.dtype) == (torch.int8, torch.float32, torch.int64), (q.dtype, scale.dtype)
        assert scale.shape == zero.shape == (q.shape[0],) and not zero.any() and node.args[3] == 0
        dequantized = q.float() * scale[:, None]
        hit = [k for k, w in linears.items() if k not in matched and w.shape == q.shape
               and bool(((dequantized - w).abs() <= scale[:, None] / 2 + 1e-6).all())]
        assert hit, f"int8 weight {tuple(q.shape)} is no Linear weight of {src} rounded to its scale"
        matched.add(hit[0])
    assert matched == set(linears), sorted(set(linears) - matched)
    fp32_shapes = sorted(tuple(v.shape) for v in tensors.values() if v.dtype == torch.float32 and v.dim() == 2)
    assert not set(fp32_shapes) & {tuple(w.shape) for w in linears.values()}, fp32_shapes


def test_tied_embeddings_are_untied_before_each_is_quantized(setup, tmp_path):
    """A Llama whose head shares the embedding's weight (Llama-3.2-1B's layout): --quantize-embeddings gives each its
    own copy in its own scheme, and both artifacts reload with the in-memory logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = families._llama()
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    tied = AutoModelForCausalLM.from_config(config)
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    tied.save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(setup["dirs"]["llama"]).save_pretrained(tmp_path / "tied")
    for scheme, extra in (("int8-weight", {"calibration_data": None}), ("int8-static", {})):
        out = tmp_path / scheme
        report = export_quantized(tmp_path / "tied", out, _request(setup, scheme=scheme, quantize_embeddings=True,
                                                                   eval_data=None, serve_timing="off", **extra))
        assert report["max_abs_logit_diff_reloaded_vs_in_memory"] <= 1e-6, report
        assert report["embedding_schemes"]["input_embedding"] == "int8-weight", report
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "int8-weight")
    assert quant.embedding_schemes(reloaded) == {"input_embedding": "int8-weight", "output_head": "int8-weight"}

"""Quantization-aware training on real CPU ranks against one plain PyTorch + torchao process.

Each case trains 6 steps on 2 ranks against a 1-process run whose Linears torchao's QATConfig prepared by
hand: fp32 loss parity at 1e-5 while the weights are the same (before the first update), and after it within the
fixed bounds LOSS_RTOL_AFTER_UPDATE / GRAD_NORM_RTOL_AFTER_UPDATE (int4 rounding turns float reduction-order noise
into flipped levels once the weights have moved); a clear
difference from the same run without QAT (so QAT was on); final/ is the full-precision model with the learned weights, and
final/quantized-<scheme>/ reloads through from_pretrained with the scheme's layers and gives the trained
fake-quantized engine's logits. Families: Llama under DeepSpeed ZeRO-3 (the fake-quantized layers take over
already partitioned parameters), Qwen2 under FSDP2. The CLI case trains with `zerotrain train --qat`,
exports the checkpoint with `zerotrain export --quantize`, and refuses a resume without --qat.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import tests.support.families as families
import tests.support.reference as ref
from tests.support.launch import rank_env, ranks, run, torchrun
from tests.support.matrix import cells

pytest.importorskip("torchao")

GROUP, LR = 16, ref.LR
FP32_RTOL = 1e-5
LOSS_RTOL_AFTER_UPDATE = 2.5e-4
"""The losses after the first update vs the torchao reference. Measured (issue 49, both cells): 6.0e-5 (Llama int4)
and 4.4e-5 (Qwen2 int8-dynamic-int4); the reference's own reduction-order spread (the same global batch in one
forward instead of 2x2 micro-batches) 6.0e-5 and 5.6e-5, vs ~1e-7 without QAT. The bound is 4x the larger spread,
fixed, so that a reference made noisier cannot widen the tolerance with it."""
GRAD_NORM_RTOL_AFTER_UPDATE = 1.2e-2
"""The same for the gradient norms: measured 1.8e-3 and 6.7e-4, spreads 2.9e-3 and 1.7e-3; 4x the larger spread."""


def qat_build(model_dir: Path, scheme: str):
    """The reference model: the same weights, prepared by torchao directly (not through zerotrain)."""
    import torch as t
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import QATConfig

    base = (IntxWeightOnlyConfig(weight_dtype=t.int4, granularity=PerGroup(GROUP)) if scheme == "int4-weight" else
            Int8DynamicActivationIntxWeightConfig(weight_dtype=t.int4, weight_granularity=PerGroup(GROUP)))

    def build():
        model = families.builder(model_dir, "causal-lm", seed=0)()
        head = model.get_output_embeddings()
        quantize_(model, QATConfig(base, step="prepare"),
                  filter_fn=lambda m, fqn: isinstance(m, t.nn.Linear) and m is not head)
        return model

    return build


def _reference(model_dir: Path, build=None) -> dict:
    return ref.reference_run(model_dir, steps=ref.STEPS, world=ref.WORLD, grad_accum=ref.ACCUM, micro=ref.MICRO,
                             lr=LR, weight_decay=ref.WD, clip=ref.CLIP, warmup=ref.WARMUP, build=build)


@pytest.mark.multirank
@pytest.mark.parametrize("family,backend,stage,scheme", [
    ("llama", "deepspeed", 3, "int4-weight"),
    ("qwen2", "fsdp", 3, "int8-dynamic-int4-weight"),
])
def test_qat_matches_one_process_and_converts(tmp_path, family, backend, stage, scheme):
    from transformers import AutoModelForCausalLM

    from zerotrain.model import quant

    model_dir = families.make_model_dir(family, tmp_path / family)
    out, final = tmp_path / "result.json", tmp_path / "final"
    probe = tmp_path / "probe.pt"
    ranks(ref.engine_worker_args(model_dir, out, "--backend", backend, "--stage", stage, "--lr", LR,
                                 "--qat", scheme, "--quant-group-size", GROUP, "--save-hf", final,
                                 "--probe-out", probe), timeout=300)
    res = json.loads(out.read_text())
    qat_ref = _reference(model_dir, qat_build(model_dir, scheme))
    plain_ref = _reference(model_dir)
    losses = ref.series(res, "loss")
    first = ref.WARMUP  # the steps before the first weight update see the same weights: no rounding noise yet
    assert ref.max_rel(losses[:first], qat_ref["losses"][:first]) <= FP32_RTOL, (losses, qat_ref["losses"])
    assert ref.max_rel(losses, qat_ref["losses"]) <= LOSS_RTOL_AFTER_UPDATE, (losses, qat_ref["losses"])
    norms = ref.series(res, "grad_norm")
    assert ref.max_rel(norms[:first], qat_ref["grad_norms"][:first]) <= FP32_RTOL
    assert ref.max_rel(norms, qat_ref["grad_norms"]) <= GRAD_NORM_RTOL_AFTER_UPDATE, (norms, qat_ref["grad_norms"])
    # QAT was on: with the same weights, the losses sit far from the plain model's and on the QAT reference's
    off = ref.max_rel(losses[:first], plain_ref["losses"][:first])
    assert off > 5 * FP32_RTOL, f"QAT losses within {off:.1e} of the plain run's: QAT was not on"
    print(f"\nQAT {family} {backend} z{stage} {scheme}: loss max rel diff "
          f"{ref.max_rel(losses, qat_ref['losses']):.2e} (same-weights steps {ref.max_rel(losses[:first], qat_ref['losses'][:first]):.1e}); "
          f"grad norm {ref.max_rel(norms, qat_ref['grad_norms']):.2e}; vs no QAT {off:.2e} on the same weights")

    # final/: the full-precision model with the learned weights: prepared again, it is the trained engine
    full = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    assert quant.layer_schemes(full) == {"none": 14}  # the Linears below the head
    from zerotrain.config.load import build_config
    from zerotrain.model.preparation import ModelPreparation

    ModelPreparation.from_config(build_config(overrides={"quant.qat": scheme, "quant.group_size": GROUP})).apply(full)
    fake = torch.load(probe)
    with torch.no_grad():
        relearned = full.eval()(input_ids=ref.probe_input()).logits
    assert (relearned - fake).abs().max() <= 1e-5 * fake.abs().max(), float((relearned - fake).abs().max())
    # final/quantized-<scheme>/: the converted model computes what the trained fake-quantized engine did
    converted = AutoModelForCausalLM.from_pretrained(final / f"quantized-{scheme}").eval()
    assert quant.layer_schemes(converted) == {scheme: 14}
    with torch.no_grad():
        logits = converted(input_ids=ref.probe_input()).logits
    assert (logits - fake).abs().max() <= 1e-4 * fake.abs().max(), float((logits - fake).abs().max())
    report = json.loads((final / f"quantized-{scheme}" / "quantization_report.json").read_text())
    assert report["group_size"] == GROUP and report["size_ratio"] < 1.0
    assert json.loads((final / quant.QAT_FILE).read_text()) == {"scheme": scheme, "group_size": GROUP}


@pytest.mark.multirank
@pytest.mark.slow  # CI: tests/multirank/test_cli_resume.py's qat-int8dyn-fsdp cell makes these checks in its own runs
def test_qat_cli_train_export_and_resume_refusal(tmp_path):
    """zerotrain train --qat on 2 ranks (ZeRO-2), the banner line, final/quantized-int4-weight/, export
    of the checkpoint with the run's own group size, and a resume without --qat refused in one line."""
    from transformers import AutoModelForCausalLM

    from zerotrain.assets.demo import build_tokenizer
    from zerotrain.model import quant

    model_dir = families.make_model_dir("llama", tmp_path / "llama")
    build_tokenizer(vocab_size=families.VOCAB - 24).save_pretrained(str(model_dir))
    out = tmp_path / "run"
    args = ["-m", "zerotrain", "train", "--model", str(model_dir), "--seq-len", "32", "--micro-batch", "2",
            "--max-steps", "3", "--save-every", "3", "--stage", "2", "--output", str(out)]
    res = torchrun([*args, "--qat", "int4-weight", "--quant-group-size", str(GROUP)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "QAT int4-weight, group size 16: 14 fake-quantized Linear layers" in res.stderr + res.stdout
    converted = AutoModelForCausalLM.from_pretrained(out / "final" / "quantized-int4-weight")
    assert quant.layer_schemes(converted) == {"int4-weight": 14}

    exported = tmp_path / "from-ckpt"
    res = run([sys.executable, "-m", "zerotrain", "export", str(out / "checkpoints"), str(exported),
               "--quantize", "int8-dynamic-int4-weight", "--serve-timing", "eager"], env=rank_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((exported / "quantization_report.json").read_text())
    assert report["group_size"] == GROUP  # the checkpoint's own group size, not the default 32
    assert quant.layer_schemes(AutoModelForCausalLM.from_pretrained(exported)) == {"int8-dynamic-int4-weight": 14}

    args[args.index("--max-steps") + 1] = "4"
    res = torchrun([*args, "--resume", "latest"], timeout=300, check=False)
    assert res.returncode != 0, res.stderr[-3000:]  # (torchrun adds its own ChildFailedError traceback)
    assert "zerotrain train: error: " in res.stderr and \
        "trained with --qat int4-weight --quant-group-size 16; resume with the same flags" in res.stderr, res.stderr[-3000:]


INT8_EXPORTS = {  # name: (scheme, extra export flags, the largest size ratio)
    "int8-weight": ("int8-weight", (), 0.40),
    "int8-dynamic": ("int8-dynamic", (), 0.40),
    "int8-static": ("int8-static", ("static",), 0.45),  # + the program's graph
    "int8-dynamic-emb": ("int8-dynamic", ("--quantize-embeddings",), 0.30),
    "int8-static-emb": ("int8-static", ("static", "--quantize-embeddings"), 0.33),
}
INT8_SLOW = {"int8-weight", "int8-static", "int8-dynamic-emb"}
"""CI exports the dynamic scheme (the headline: a third of the size) and the static one with quantized embeddings
(calibration, the embeddings and the program's graph) from one fine-tuned model; the other three are slow."""


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory) -> dict:
    """small-llama (mostly Linear weights) fine-tuned with `zerotrain train` (30 steps, once for the module)."""
    from zerotrain.assets.demo import CORPUS, build_tiny

    root = tmp_path_factory.mktemp("int8")
    model = build_tiny(root / "small-llama", "small-llama")
    lines = CORPUS.read_text().splitlines()
    train, val = root / "train.txt", root / "val.txt"
    train.write_text("\n".join(lines[:990]) + "\n")
    val.write_text("\n".join(lines[990:]) + "\n")
    out = root / "run"
    run([sys.executable, "-m", "zerotrain", "train", "--model", str(model), "--data", str(train), "--seq-len", "128",
         "--micro-batch", "8", "--lr", "3e-3", "--max-steps", "30", "--save-every", "30", "--output", str(out)],
        env=rank_env(), timeout=600, check=True)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    return {"final": out / "final", "train": train, "val": val, "vocab": vocab}


@pytest.mark.multirank
@pytest.mark.parametrize("name", cells(INT8_EXPORTS, INT8_SLOW))
def test_int8_keeps_a_fine_tuned_models_perplexity_at_a_third_of_the_size(tmp_path, fine_tuned, name):
    """The fine-tuned model's eval loss is far below the untrained one; `zerotrain export --quantize` with an int8
    scheme (static: calibrated on the training split): perplexity within 2% of fp32, <= 0.40x the bytes (the fp32
    embeddings and output head are the rest: 2 x vocab x 256 x 4 bytes), <= 0.30x with --quantize-embeddings (the
    static program: its graph on top)."""
    import math

    scheme, flags, most = INT8_EXPORTS[name]
    extra = [x for f in flags for x in (("--calibration-data", str(fine_tuned["train"])) if f == "static" else (f,))]
    q = tmp_path / name
    run([sys.executable, "-m", "zerotrain", "export", str(fine_tuned["final"]), str(q), "--quantize", scheme,
         "--eval-data", str(fine_tuned["val"]), "--batch-size", "8", "--serve-timing", "eager", *extra],
        env=rank_env(), timeout=300, check=True)
    r = json.loads((q / "quantization_report.json").read_text())
    assert r["eval_loss_before"] < 0.7 * math.log(fine_tuned["vocab"]), r  # trained: well below a uniform guess
    assert abs(r["perplexity_change"]) <= 0.02, (name, r)
    assert r["size_ratio"] <= most, (name, r)

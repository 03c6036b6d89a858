"""Pipeline parallelism on the DeepSpeed backend (deepspeed.pipe.PipelineModule + train_batch, ZeRO-1) on real
CPU ranks, against one plain process with the same global batch: GPT-2 (tied embedding/head through
TiedLayerSpec) pp=2 with save_hf, eval logits, checkpoint, resume and export; a Qwen2 with full and
sliding-window blocks pp=2; Llama pp=2 x dp=2 on 4 ranks."""
from __future__ import annotations

import json
from pathlib import Path

import tests.support.families as families
import pytest
import tests.support.reference as ref
import torch

FP32_RTOL = 1e-5
CLIP = ref.MP_CLIP


def pipe_worker(model_dir: Path, out: Path, *args, nproc: int, dp: int) -> dict:
    return ref.mp_worker(model_dir, out, "--backend", "deepspeed", "--stage", "1", "--pp", "2", *args, nproc=nproc, dp=dp)


def assert_stages(result: dict, pp: int, dp: int, num_blocks: int, tied: bool) -> None:
    """Each rank's module holds only its stage's layers (pipeline_parts.stage_bounds, as DeepSpeed's
    `parts`): the blocks of its slice, the embeddings on the first stage, norm and head on the last; a
    tied embedding on both ends (loss parity alone would pass if every rank ran the whole model)."""
    from zerotrain.backends.deepspeed.pipeline import pipe_parts

    parts = pipe_parts(num_blocks, pp, tied)
    for rank, names in enumerate(result["rank_params"]):
        stage = rank // dp
        layers = {int(n.split(".")[0]) for n in names if n.split(".")[0].isdigit()}
        expected = set(range(parts[stage], parts[stage + 1])) - ({0, num_blocks + 2} if tied else set())
        assert layers == expected, (rank, sorted(names))
        assert ("tied_modules.embed.wte.weight" in names) == (tied and stage in (0, pp - 1)), (rank, sorted(names))


@pytest.mark.multirank
def test_gpt2_tied_pp2_parity_stages_export_and_resume(tmp_path):
    import transformers

    from zerotrain.export.to_hf import export_checkpoint

    gpt2 = families.make_model_dir("gpt2", tmp_path / "gpt2")
    reference = ref.mp_reference(gpt2, dp=1)
    straight = pipe_worker(gpt2, tmp_path / "pp2.json", "--ckpt-root", tmp_path / "ck", "--save-at", "3", "6",
                           "--save-hf", tmp_path / "hf", "--probe-out", tmp_path / "probe.pt", nproc=2, dp=1)
    ref.assert_parity(straight, reference, FP32_RTOL, FP32_RTOL, "deepspeed pp=2 gpt2 (tied)", clip=CLIP)
    assert_stages(straight, pp=2, dp=1, num_blocks=2, tied=True)
    # final/: the stages reassembled into one GPT-2 whose head is still its embedding
    hf = ref.load_safetensors(tmp_path / "hf")
    ref.assert_same_weights(hf, reference["state_dict"], rtol=1e-4, atol=1e-5)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    with torch.no_grad():  # the pipeline's eval_step gives the trained model's logits
        torch.testing.assert_close(torch.load(tmp_path / "probe.pt"), model(ref.probe_input()).logits,
                                   rtol=1e-5, atol=1e-5)
    meta = json.loads((tmp_path / "ck" / "global_step3" / "zerotrain_meta.json").read_text())
    assert meta["extra"] == {"pp": 2} and meta["format"] == "deepspeed-pipe" and meta["zero_stage"] == 1
    resumed = pipe_worker(gpt2, tmp_path / "resume.json", "--resume", tmp_path / "ck" / "global_step3",
                          "--save-hf", tmp_path / "hf_resumed", nproc=2, dp=1)
    assert resumed["start_step"] == 3
    for key in ("loss", "grad_norm", "lr"):
        assert ref.series(resumed, key, start=3) == ref.series(straight, key, start=3), key
    ref.assert_same_weights(ref.load_safetensors(tmp_path / "hf_resumed"), hf)
    out = export_checkpoint(tmp_path / "ck" / "global_step6", tmp_path / "exported")
    ref.assert_same_weights(transformers.AutoModelForCausalLM.from_pretrained(str(out)).state_dict(), hf)


@pytest.mark.multirank
def test_alternating_attention_pp2_parity_and_stages(tmp_path):
    """Qwen2 with a full block then a sliding-window block (16 < 32 tokens): each stage builds its
    block's own mask (Llama, full attention only, is the pp x dp test below)."""
    model = families.make_model_dir("qwen2-alternating", tmp_path / "qwen2")
    result = pipe_worker(model, tmp_path / "pp2.json", nproc=2, dp=1)
    ref.assert_parity(result, ref.mp_reference(model, dp=1), FP32_RTOL, FP32_RTOL, "deepspeed pp=2 qwen2 full/sliding",
                      clip=CLIP)
    assert_stages(result, pp=2, dp=1, num_blocks=2, tied=False)


@pytest.mark.multirank
def test_llama_pp2_dp2_on_four_ranks(tmp_path):
    llama = families.make_model_dir("llama", tmp_path / "llama")
    result = pipe_worker(llama, tmp_path / "pp2dp2.json", nproc=4, dp=2)
    ref.assert_parity(result, ref.mp_reference(llama, dp=2), FP32_RTOL, FP32_RTOL, "deepspeed pp=2 x dp=2", clip=CLIP)
    assert_stages(result, pp=2, dp=2, num_blocks=2, tied=False)

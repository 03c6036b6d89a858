"""Pipeline parallelism on the FSDP2 backend (torch.distributed.pipelining: PipelineStage + ScheduleGPipe, FSDP2
over the data-parallel mesh dimension) on real CPU ranks, against one plain process with the same global
batch: Llama pp=2 with save_hf, eval logits, checkpoint, resume and export; GPT-2 (tied embedding/head on
the first and last stage) pp=2; a sliding-window Mistral pp=2 x dp=2 on 4 ranks."""
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
    return ref.mp_worker(model_dir, out, "--backend", "fsdp", "--stage", "3", "--pp", "2", *args, nproc=nproc, dp=dp)


def assert_stages(result: dict, pp: int, dp: int, num_blocks: int) -> None:
    """Each rank's module holds only its stage's layers (pipeline_parts.stage_bounds): the blocks of its
    slice, the embeddings only on the first stage, the final norm and head only on the last (loss parity
    alone would also pass if every rank ran the whole model)."""
    from zerotrain.model.pipeline_parts import stage_bounds

    bounds = stage_bounds(num_blocks, pp)
    for rank, names in enumerate(result["rank_params"]):
        stage = rank // dp
        a, b = bounds[stage]
        blocks = {n.split(".")[1] for n in names if ".block." in n}
        expected_blocks = len(range(max(a, 1), min(b, num_blocks + 1)))
        assert len(blocks) == expected_blocks, (rank, sorted(names))
        assert any(".wte." in n for n in names) == (stage == 0), (rank, sorted(names))
        assert any(".lm_head." in n for n in names) == (stage == pp - 1), (rank, sorted(names))


@pytest.mark.multirank
def test_llama_pp2_parity_stages_export_and_resume(tmp_path):
    import transformers

    from zerotrain.export.to_hf import export_checkpoint

    llama = families.make_model_dir("llama", tmp_path / "llama")
    reference = ref.mp_reference(llama, dp=1)
    straight = pipe_worker(llama, tmp_path / "pp2.json", "--ckpt-root", tmp_path / "ck", "--save-at", "3", "6",
                           "--save-hf", tmp_path / "hf", "--probe-out", tmp_path / "probe.pt", nproc=2, dp=1)
    ref.assert_parity(straight, reference, FP32_RTOL, FP32_RTOL, "fsdp pp=2 llama", clip=CLIP)
    assert_stages(straight, pp=2, dp=1, num_blocks=2)
    hf = ref.load_safetensors(tmp_path / "hf")  # final/: the stages reassembled into one HF model
    ref.assert_same_weights(hf, reference["state_dict"], rtol=1e-4, atol=1e-5)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():  # the pipeline's eval_step gives the trained model's logits
        torch.testing.assert_close(torch.load(tmp_path / "probe.pt"), model(ref.probe_input()).logits,
                                   rtol=1e-5, atol=1e-5)
    meta = json.loads((tmp_path / "ck" / "global_step3" / "zerotrain_meta.json").read_text())
    assert meta["extra"] == {"pp": 2} and meta["format"] == "dcp"
    resumed = pipe_worker(llama, tmp_path / "resume.json", "--resume", tmp_path / "ck" / "global_step3",
                          "--save-hf", tmp_path / "hf_resumed", nproc=2, dp=1)
    assert resumed["start_step"] == 3
    for key in ("loss", "grad_norm", "lr"):
        assert ref.series(resumed, key, start=3) == ref.series(straight, key, start=3), key
    ref.assert_same_weights(ref.load_safetensors(tmp_path / "hf_resumed"), hf)
    out = export_checkpoint(tmp_path / "ck" / "global_step6", tmp_path / "exported")
    ref.assert_same_weights(transformers.AutoModelForCausalLM.from_pretrained(str(out)).state_dict(), hf)


@pytest.mark.multirank
def test_gpt2_tied_pp2_parity_and_stages(tmp_path):
    import transformers

    gpt2 = families.make_model_dir("gpt2", tmp_path / "gpt2")
    result = pipe_worker(gpt2, tmp_path / "pp2.json", "--save-hf", tmp_path / "hf", nproc=2, dp=1)
    reference = ref.mp_reference(gpt2, dp=1)
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, "fsdp pp=2 gpt2 (tied)", clip=CLIP)
    assert_stages(result, pp=2, dp=1, num_blocks=2)
    ref.assert_same_weights(ref.load_safetensors(tmp_path / "hf"), reference["state_dict"], rtol=1e-4, atol=1e-5)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.multirank
def test_sliding_window_pp2_dp2_on_four_ranks(tmp_path):
    """Mistral with a sliding window (16) on every block, shorter than the 32 tokens: each stage builds the
    windowed mask (Llama's full attention is the export / resume test above)."""
    mistral = families.make_model_dir("mistral", tmp_path / "mistral")
    result = pipe_worker(mistral, tmp_path / "pp2dp2.json", nproc=4, dp=2)
    ref.assert_parity(result, ref.mp_reference(mistral, dp=2), FP32_RTOL, FP32_RTOL, "fsdp pp=2 x dp=2 mistral (window)",
                      clip=CLIP)
    assert_stages(result, pp=2, dp=2, num_blocks=2)

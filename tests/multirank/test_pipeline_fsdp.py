"""Pipeline parallelism on the FSDP2 backend (torch.distributed.pipelining: PipelineStage + ScheduleGPipe, FSDP2
over the data-parallel mesh dimension) on real CPU ranks, against one plain process with the same global
batch: Llama pp=2 with save_hf, eval logits, checkpoint, resume and export; GPT-2 (tied embedding/head on
the first and last stage, and a cross-attention that never gets a gradient) pp=2 with a resume; a sliding-window
Mistral pp=2 x dp=2 on 4 ranks."""
from __future__ import annotations

from pathlib import Path

import pytest

import tests.support.export_check as export_check
import tests.support.families as families
import tests.support.reference as ref

FP32_RTOL = export_check.FP32_RTOL
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


@pytest.mark.slow  # CI time (issue 52): FSDP2 pp in CI: test_composed_layouts.py (tp2 x pp2)
@pytest.mark.multirank
def test_llama_pp2_parity_stages_export_and_resume(tmp_path):
    llama = families.make_model_dir("llama", tmp_path / "llama")
    straight, reference = export_check.checkpointed_run(pipe_worker, llama, tmp_path, "pp2.json", "fsdp pp=2 llama",
                                                        "--probe-out", tmp_path / "probe.pt")
    assert_stages(straight, pp=2, dp=1, num_blocks=2)
    hf = export_check.final_weights(tmp_path, reference)  # final/: the stages reassembled into one HF model
    export_check.final_model(tmp_path)  # the pipeline's eval_step gives the trained model's logits
    meta = export_check.step3_meta(tmp_path)
    assert meta["extra"] == {"pp": 2, "optimizer": "adamw"} and meta["format"] == "dcp"
    export_check.assert_resume_and_export(pipe_worker, llama, tmp_path, straight, hf)


def gpt2_with_unused_cross_attention(path: Path) -> Path:
    """The tiny GPT-2 with add_cross_attention: each block holds a cross-attention and its layer norm that a plain
    causal-LM forward never reads (no encoder states), so they never get a gradient and a checkpoint holds no
    optimizer state for them (LLaVA's CLIP post_layernorm is the case met in the field)."""
    import transformers

    families.make_model_dir("gpt2", path)  # the family's weights (the run learns), the cross-attention added
    config = transformers.AutoConfig.from_pretrained(str(path))
    config.add_cross_attention = True
    model = transformers.GPT2LMHeadModel(config)
    missing, unexpected = model.load_state_dict(transformers.GPT2LMHeadModel.from_pretrained(str(path)).state_dict(),
                                                strict=False)
    assert not unexpected and missing and all("cross" in k for k in missing), (missing, unexpected)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.mark.multirank
def test_gpt2_tied_pp2_parity_stages_and_resume_around_unused_parameters(tmp_path):
    """GPT-2 pp=2 (tied embedding/head on the first and last stage) against the one process; its blocks' unused
    cross-attention never has a gradient, so the step-3 checkpoint has no optimizer state for it, and a resume
    from it (FSDPPipelineEngine._read_shards reads around the missing keys) repeats steps 3-5 exactly."""
    import torch.distributed.checkpoint as dcp
    import transformers

    gpt2 = gpt2_with_unused_cross_attention(tmp_path / "gpt2")
    result = pipe_worker(gpt2, tmp_path / "pp2.json", "--save-hf", tmp_path / "hf", "--ckpt-root", tmp_path / "ck",
                         "--save-at", "3", nproc=2, dp=1)
    reference = ref.mp_reference(gpt2, dp=1)
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, "fsdp pp=2 gpt2 (tied)", clip=CLIP)
    assert_stages(result, pp=2, dp=1, num_blocks=2)
    export_check.final_weights(tmp_path, reference)  # the unused weights too: untouched (no decay without a gradient)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.lm_head.weight is model.transformer.wte.weight

    saved = dcp.FileSystemReader(str(tmp_path / "ck" / "global_step3" / "dcp")).read_metadata().state_dict_metadata
    # one on each stage: its weights saved, no optimizer state for it
    for unused in ("transformer.h.0.crossattention.c_attn.weight", "transformer.h.1.ln_cross_attn.weight"):
        assert f"model.{unused}" in saved and not any(k.startswith(f"optim.{unused}.") for k in saved), sorted(saved)
    assert any(k.startswith("optim.transformer.h.1.attn.c_attn.weight.") for k in saved), sorted(saved)
    resumed = pipe_worker(gpt2, tmp_path / "resume.json", "--resume", tmp_path / "ck" / "global_step3",
                          nproc=2, dp=1)
    assert resumed["start_step"] == 3
    for key in ("loss", "grad_norm", "lr"):
        assert ref.series(resumed, key, start=3) == ref.series(result, key, start=3), key


@pytest.mark.multirank
@pytest.mark.slow  # CI time (issue 50): pp x dp is CI on DeepSpeed (test_pipeline_deepspeed.py), windowed
# attention under pp is CI through test_pipeline_deepspeed.py's alternating-attention pp2 cell
def test_sliding_window_pp2_dp2_on_four_ranks(tmp_path):
    """Mistral with a sliding window (16) on every block, shorter than the 32 tokens: each stage builds the
    windowed mask (Llama's full attention is the export / resume test above)."""
    mistral = families.make_model_dir("mistral", tmp_path / "mistral")
    result = export_check.parity_run(pipe_worker, mistral, tmp_path / "pp2dp2.json", "fsdp pp=2 x dp=2 mistral (window)",
                                     nproc=4, dp=2)
    assert_stages(result, pp=2, dp=2, num_blocks=2)

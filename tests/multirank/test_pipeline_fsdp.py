"""Pipeline parallelism on the FSDP2 backend (torch.distributed.pipelining: PipelineStage + ScheduleGPipe, FSDP2
over the data-parallel mesh dimension) on real CPU ranks, against one plain process with the same global
batch: Llama pp=2 with save_hf, eval logits, checkpoint, resume and export; GPT-2 (tied embedding/head on
the first and last stage) pp=2; a sliding-window Mistral pp=2 x dp=2 on 4 ranks."""
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
    assert meta["extra"] == {"pp": 2} and meta["format"] == "dcp"
    export_check.assert_resume_and_export(pipe_worker, llama, tmp_path, straight, hf)


@pytest.mark.multirank
def test_gpt2_tied_pp2_parity_and_stages(tmp_path):
    import transformers

    gpt2 = families.make_model_dir("gpt2", tmp_path / "gpt2")
    result = pipe_worker(gpt2, tmp_path / "pp2.json", "--save-hf", tmp_path / "hf", nproc=2, dp=1)
    reference = ref.mp_reference(gpt2, dp=1)
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, "fsdp pp=2 gpt2 (tied)", clip=CLIP)
    assert_stages(result, pp=2, dp=1, num_blocks=2)
    export_check.final_weights(tmp_path, reference)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert model.lm_head.weight is model.transformer.wte.weight


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

"""Pipeline parallelism on the DeepSpeed backend (deepspeed.pipe.PipelineModule + train_batch, ZeRO-1) on real
CPU ranks, against one plain process with the same global batch: GPT-2 (tied embedding/head through
TiedLayerSpec) pp=2 with save_hf, eval logits, checkpoint, resume and export; a Qwen2 with full and
sliding-window blocks pp=2; Llama pp=2 x dp=2 on 4 ranks."""
from __future__ import annotations

from pathlib import Path

import pytest

import tests.support.export_check as export_check
import tests.support.families as families
import tests.support.reference as ref


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
    gpt2 = families.make_model_dir("gpt2", tmp_path / "gpt2")
    straight, reference = export_check.checkpointed_run(pipe_worker, gpt2, tmp_path, "pp2.json",
                                                        "deepspeed pp=2 gpt2 (tied)", "--probe-out", tmp_path / "probe.pt")
    assert_stages(straight, pp=2, dp=1, num_blocks=2, tied=True)
    # final/: the stages reassembled into one GPT-2 whose head is still its embedding, and the
    # pipeline's eval_step gives its logits
    hf = export_check.final_weights(tmp_path, reference)
    model = export_check.final_model(tmp_path)
    assert model.lm_head.weight is model.transformer.wte.weight
    meta = export_check.step3_meta(tmp_path)
    # layers 0-3 (tied embedding, 2 blocks, final norm) have files; the tied head (4) runs as the embedding's function
    assert meta["extra"] == {"pp": 2, "optimizer": "adamw", "pipe_layers": [0, 1, 2, 3]}
    assert meta["format"] == "deepspeed-pipe" and meta["zero_stage"] == 1
    export_check.assert_resume_and_export(pipe_worker, gpt2, tmp_path, straight, hf)


@pytest.mark.multirank
def test_alternating_attention_pp2_parity_and_stages(tmp_path):
    """Qwen2 with a full block then a sliding-window block (16 < 32 tokens): each stage builds its
    block's own mask (Llama, full attention only, is the pp x dp test below)."""
    model = families.make_model_dir("qwen2-alternating", tmp_path / "qwen2")
    result = export_check.parity_run(pipe_worker, model, tmp_path / "pp2.json", "deepspeed pp=2 qwen2 full/sliding",
                                     nproc=2, dp=1)
    assert_stages(result, pp=2, dp=1, num_blocks=2, tied=False)


@pytest.mark.multirank
def test_llama_pp2_dp2_on_four_ranks(tmp_path):
    llama = families.make_model_dir("llama", tmp_path / "llama")
    result = export_check.parity_run(pipe_worker, llama, tmp_path / "pp2dp2.json", "deepspeed pp=2 x dp=2", nproc=4, dp=2)
    assert_stages(result, pp=2, dp=2, num_blocks=2, tied=False)

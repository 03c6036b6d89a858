"""Tensor parallelism on the DeepSpeed backend (AutoTP training, `tensor_parallel.autotp_size`) on real CPU
ranks, against one plain process with the same global batch: sp=2 x tp=2 on 4 ranks (Llama, ZeRO-2: save_hf,
checkpoint, resume, export; tp=2 alone on 2 ranks at ZeRO-1 is `slow`) and tp=2 x dp=2 on 4 ranks (Qwen2, ZeRO-2;
`slow`: tp x dp is CI on FSDP2)."""
from __future__ import annotations

from pathlib import Path

import pytest

import tests.support.export_check as export_check
import tests.support.families as families
import tests.support.reference as ref

FP32_RTOL = export_check.FP32_RTOL
CLIP = ref.MP_CLIP
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The block linears AutoTP splits (column: q/k/v/gate/up, row: o/down)."""


def autotp_worker(model_dir: Path, out: Path, *args, stage: int, nproc: int, dp: int) -> dict:
    return ref.mp_worker(model_dir, out, "--backend", "deepspeed", "--stage", stage, "--tp", "2", *args, nproc=nproc,
                         dp=dp)


def assert_split(result: dict, reference: dict, tp: int) -> None:
    """Every rank holds 1/tp of each block linear's weight (AutoTP's layers are plain tensors, so the
    local size is compared with the full one of the 1-process model): equal losses alone would also pass
    unsplit, since both ranks of a tensor-parallel group read the same batch."""
    full = {name: t.numel() for name, t in reference["state_dict"].items()}
    for rank, local in enumerate(result["rank_params"]):
        split = [n for n in local if any(f".{s}." in n for s in SPLIT)]
        assert {s for s in SPLIT if any(f".{s}." in n for n in split)} == set(SPLIT), (rank, sorted(local))
        for name in split:
            assert local[name] * tp == full[name], (rank, name, local[name], full[name])


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return families.make_model_dir("llama", tmp_path_factory.mktemp("dstp") / "llama")


@pytest.mark.multirank
@pytest.mark.parametrize("sp,stage", [pytest.param(2, 2, id="sp2-tp2"),
                                      pytest.param(1, 1, id="tp2", marks=pytest.mark.slow)])
def test_autotp2_parity_split_export_and_resume(llama, tmp_path, sp, stage):
    """CI: sp 2 x tp 2 on 4 ranks at ZeRO-2 (the Ulysses attention over AutoTP's split heads: each tp rank's 2 heads
    and 1 key/value head cut again over sp; sp x tp on DeepSpeed folded into this launch set; the stage probed in
    benchmarks/results/sp_tp_deepspeed_probe/; sp is on, or the 4 ranks would be 2 replicas of twice the global
    batch and the losses would differ); slow: tp 2 alone on 2 ranks at ZeRO-1."""
    def worker(model_dir: Path, out: Path, *args, stage: int, nproc: int, dp: int) -> dict:
        return autotp_worker(model_dir, out, "--sp", sp, *args, stage=stage, nproc=nproc * sp, dp=dp)

    straight, reference = export_check.checkpointed_run(worker, llama, tmp_path, "tp2.json",
                                                        f"deepspeed autotp=2 x sp={sp}", stage=stage)
    assert straight["ds_config"]["tensor_parallel"] == {"autotp_size": 2}
    assert_split(straight, reference, tp=2)
    # final/ is one ordinary HF model: the tensor-parallel slices gathered, equal to the 1-process weights
    hf = export_check.final_weights(tmp_path, reference)
    meta = export_check.step3_meta(tmp_path)
    assert meta["extra"] == {"tp": 2, "optimizer": "adamw"} and meta["zero_stage"] == stage, meta  # sp changes no checkpoint
    # a resume from step 3 repeats the straight run; `zerotrain export` of the last checkpoint (DeepSpeed's
    # universal conversion merges the slices from the fp32 optimizer partitions) equals final/, and leaves no
    # work files beside the checkpoints
    export_check.assert_resume_and_export(worker, llama, tmp_path, straight, hf, stage=stage)
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".")] == []


@pytest.mark.multirank
@pytest.mark.slow  # CI time (issue 50): tp x dp is CI on FSDP2 (test_tensor_parallel.py) and AutoTP's split,
# export and resume on 4 ranks (sp 2 x tp 2) above
def test_autotp2_dp2_on_four_ranks(tmp_path):
    qwen2 = families.make_model_dir("qwen2", tmp_path / "qwen2")
    reference = ref.mp_reference(qwen2, dp=2)
    result = autotp_worker(qwen2, tmp_path / "tp2dp2.json", stage=2, nproc=4, dp=2)
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, "deepspeed autotp=2 x dp=2", clip=CLIP)
    assert_split(result, reference, tp=2)

"""Sequence x tensor parallelism (`--sp 2 --tp 2`, FSDP2) on real CPU ranks, against one plain process with the
same global batch (fp32, per-step loss and grad norm 1e-5 relative, clipping active):
- sp2 x tp2 on 4 ranks on a Mistral whose sliding window (16) is shorter than the sequence (32): the blocks split
  over tp by the model's tp_plan (2 of its 4 heads and 1 of its 2 key/value heads per rank), the Ulysses
  all-to-all over sp cutting those local heads again (the one key/value head repeated for both sp ranks), the
  window rebuilt over the whole sequence; FSDP2 shards over the dp x sp ranks. final/, eval logits (gathered over
  the sequence), the step-3 checkpoint, an exact resume and export, all from one straight run and one resume;
- sp2 x tp2 on DeepSpeed (AutoTP, ZeRO-2) on the same Mistral, all the same checks (`slow`; CI on a Llama in
  tests/multirank/test_deepspeed_tp.py);
- sp2 x tp2 on a Llama (GQA), and sp2 x tp2 x dp2 on 8 ranks (`slow`);
- `zerotrain train --sp 2 --tp 2` through the CLI equals `zerotrain train` in one process (`slow`);
- ep 2 x sp 2 (FSDP2) on 4 ranks on Mixtral (Qwen3-MoE: `slow`).
The rules (accepted on both backends, ZeRO 0-2 on DeepSpeed, the head divisibility lines): tests/unit/test_sequence_parallel.py;
ep x sp's: tests/unit/test_moe_rules.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import tests.support.export_check as export_check
import tests.support.families as families
import tests.support.reference as ref
from tests.multirank.test_sequence_parallel import cli_against_one_process
from tests.multirank.test_tensor_parallel import assert_split
from tests.support.matrix import cells

FP32_RTOL = export_check.FP32_RTOL

pytestmark = pytest.mark.multirank


def sptp_worker(model_dir: Path, out: Path, *args, nproc: int, dp: int) -> dict:
    """The engine worker at sp 2 x tp 2 (FSDP2 stage 3): `nproc` ranks per model-parallel pair, so the 2 ranks of
    export_check's runs are 4 here; dp replicas of 4 ranks each."""
    return ref.mp_worker(model_dir, out, "--backend", "fsdp", "--stage", "3", "--sp", "2", "--tp", "2", *args,
                         nproc=2 * nproc, dp=dp)


def test_sp2_tp2_mistral_sliding_parity_final_resume_and_export(tmp_path):
    model = families.make_model_dir("mistral", tmp_path / "mistral")
    window = families.SLIDING_WINDOW
    assert window < ref.DEFAULT_SEQ  # the window cuts the sequence: a whole-sequence causal mask would differ
    straight, reference = export_check.checkpointed_run(sptp_worker, model, tmp_path, "sp2tp2.json",
                                                        "fsdp sp=2 x tp=2", "--probe-out", tmp_path / "probe.pt")
    assert_split(straight, tp=2, dp=2)  # split over tp, then sharded over the dp x sp = 2 ranks
    assert "4 ranks = data-parallel 1 x tensor-parallel 2 x sequence-parallel 2" in "\n".join(straight["describe"])
    hf = export_check.final_weights(tmp_path, reference)
    export_check.final_model(tmp_path)  # eval_step's logits (tp forward, gathered over sp) are final/'s
    assert export_check.step3_meta(tmp_path)["zero_stage"] == 3
    exported = export_check.assert_resume_and_export(sptp_worker, model, tmp_path, straight, hf)
    ref.assert_same_weights(exported, reference["state_dict"], rtol=1e-4, atol=1e-5)


def ds_sptp_worker(model_dir: Path, out: Path, *args, nproc: int, dp: int) -> dict:
    """The same at DeepSpeed ZeRO-2 (AutoTP training runs ZeRO 0-2; its tp groups are neighbouring ranks, ZeRO's
    data-parallel group the ranks of one tp coordinate: the layout's)."""
    return ref.mp_worker(model_dir, out, "--backend", "deepspeed", "--stage", "2", "--sp", "2", "--tp", "2", *args,
                         nproc=2 * nproc, dp=dp)


@pytest.mark.slow  # CI: sp x tp on FSDP2 above, and on DeepSpeed (Llama, ZeRO-2) in test_deepspeed_tp.py
def test_sp2_tp2_deepspeed_autotp_parity_final_resume_and_export(tmp_path):
    """DeepSpeed AutoTP x the Ulysses attention on the sliding-window Mistral (probed first:
    benchmarks/results/sp_tp_deepspeed_probe/): parity, the split, final/, eval logits, resume and export."""
    from tests.multirank.test_deepspeed_tp import assert_split as assert_autotp_split

    model = families.make_model_dir("mistral", tmp_path / "mistral")
    def check(straight: dict, reference: dict) -> None:
        assert straight["ds_config"]["tensor_parallel"] == {"autotp_size": 2}
        assert_autotp_split(straight, reference, tp=2)
        assert export_check.step3_meta(tmp_path)["zero_stage"] == 2

    export_check.proven_run(ds_sptp_worker, model, tmp_path, "sp2tp2.json", "deepspeed sp=2 x autotp=2", check=check)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,dp", [(2, 1), (4, 2)], ids=["llama-gqa", "dp2-eight-ranks"])
def test_sp2_tp2_llama(tmp_path, nproc, dp):
    """Llama, 4 heads and 2 key/value heads: each tp rank attends with 2 heads and 1 key/value head (repeated for both
    sp ranks); on 8 ranks dp 2 replicas of sp 2 x tp 2, FSDP2 sharding over the 4 dp x sp ranks of each tp rank."""
    model = families.make_model_dir("llama", tmp_path / "llama")
    result = export_check.parity_run(sptp_worker, model, tmp_path / "sp2tp2.json", f"fsdp sp=2 x tp=2 x dp={dp}",
                                     nproc=nproc, dp=dp)
    assert_split(result, tp=2, dp=2 * dp)


@pytest.mark.slow
def test_cli_sp2_tp2_equals_one_process(tmp_path):
    """`zerotrain train --sp 2 --tp 2` on 4 ranks and `zerotrain train` in one process, the same global batch: the
    same losses, grad norms and eval losses (eval through the split model, logits gathered over the sequence)."""
    # --loader-workers 2: each rank's batches read ahead by two loader processes, the losses still one process's
    config = cli_against_one_process(tmp_path, ["--sp", "2", "--tp", "2", "--loader-workers", "2"], nproc=4)
    assert "sp: 2" in config and "tp: 2" in config


# CI: Mixtral (one 4-rank launch); Qwen3-MoE slow (its ep x dp on 4 ranks is CI in tests/multirank/test_moe.py)
@pytest.mark.parametrize("family", cells(["qwen3-moe", "mixtral"], slow={"qwen3-moe"}))
def test_ep2_sp2_on_four_ranks_equals_one_process(tmp_path, family):
    """ep 2 x sp 2 (FSDP2 stage 3) on 4 ranks = dp 2 x sp 2: each sequence cut over an sp pair, each MoE block's
    experts split over the 2 data-parallel ranks of one sp coordinate (tokens dispatched by all-to-all within it),
    each expert held by its rank and that rank's sp peer (FSDP2-sharded between them). The router loss is cut with the
    forward under sp (refused when asked: tests/unit/test_moe_rules.py), so both runs train the LM loss alone."""
    model = families.make_model_dir(family, tmp_path / family)
    result = ref.mp_worker(model, tmp_path / "ep2sp2.json", "--backend", "fsdp", "--stage", "3", "--ep", "2", "--sp",
                           "2", "--router-aux-coef", "0", nproc=4, dp=2)
    reference = ref.reference_run(model, steps=ref.STEPS, world=2, grad_accum=ref.ACCUM, micro=ref.mp_micro(2),
                                  lr=ref.LR, weight_decay=ref.WD, clip=ref.MP_CLIP, warmup=ref.WARMUP,
                                  router_aux_coef=0.0)
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, f"{family} fsdp z3 ep2 x sp2", clip=ref.MP_CLIP)
    assert "4 ranks = data-parallel 2 x sequence-parallel 2 x expert-parallel 2" in result["describe"][0]
    split = {n: v for n, v in result["param_local"].items() if ".experts." in n}
    # half the experts (ep), of which half the rows (FSDP over the expert's rank and its sp peer)
    assert split and all(local * 4 == whole for local, whole in split.values()), split

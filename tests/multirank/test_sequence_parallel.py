"""Sequence parallelism (`--sp`, Ulysses all-to-all attention; FSDP2, and DeepSpeed ZeRO-3) on real CPU ranks, against one
plain process with the same global batch (fp32, per-step loss and grad norm 1e-5 relative, clipping active):
- sp=2 on a Llama (GQA: 2 key/value heads, one per rank): final/, eval logits, checkpoint, resume, export, on
  FSDP2 and on DeepSpeed ZeRO-3;
- sp=2 on a Qwen2 with one key/value head (repeated for both ranks) through the whole-step path with
  per-row label masks (the global token mean over the sp shards), on GPT-2 (absolute positions, tied head), on a
  sliding-window Mistral and a Qwen2 with full and sliding blocks (the windows rebuilt over the whole sequence);
- `zerotrain train --sp 2 --packing` on chat data (documents packed into rows: their mask rebuilt from the
  restarting position ids) equals one process, on DeepSpeed ZeRO-3;
- sp=2 with LoRA and gradient checkpointing (the attention under peft's wrapper, recomputed in backward);
- sp=2 x dp=2 on 4 ranks;
- `zerotrain train --sp 2` through the CLI equals `zerotrain train` in one process, eval included.
The model features the all-to-all attention cannot carry are refused in one line (tests/unit/test_sequence_parallel.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.support.export_check as export_check
import tests.support.families as families
import tests.support.reference as ref
from tests.support.launch import rank_env, ranks, run, torchrun
from tests.support.matrix import cells

FP32_RTOL = export_check.FP32_RTOL

pytestmark = pytest.mark.multirank


def sp_worker(model_dir: Path, out: Path, *args, nproc: int, dp: int, stage: int = 3, backend: str = "fsdp") -> dict:
    return ref.mp_worker(model_dir, out, "--backend", backend, "--stage", stage, "--sp", "2", *args, nproc=nproc,
                         dp=dp)


def ds_sp_worker(model_dir: Path, out: Path, *args, nproc: int, dp: int) -> dict:
    return sp_worker(model_dir, out, *args, nproc=nproc, dp=dp, backend="deepspeed")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return families.make_model_dir("llama", tmp_path_factory.mktemp("sp") / "llama")


def _stage(tmp_path, stage: int) -> None:
    assert export_check.step3_meta(tmp_path)["zero_stage"] == stage


@pytest.mark.slow  # CI time (issue 52): FSDP2 sp in CI: test_sequence_tensor_parallel.py (sp2 x tp2)
def test_sp2_llama_parity_final_resume_and_export(llama, tmp_path):
    # sp shards nothing of the model: final/ is the model; eval_step's logits (gathered over the sequence) are final/'s
    export_check.proven_run(sp_worker, llama, tmp_path, "sp2.json", "fsdp sp=2",
                            check=lambda straight, reference: _stage(tmp_path, 3))


@pytest.mark.slow  # CI time (issue 52): ZeRO-3 sp in CI: test_preference_sp.py (DPO sp2, CLI)
def test_sp2_deepspeed_zero3_parity_final_resume_and_export(llama, tmp_path):
    """The same attention under DeepSpeed ZeRO-3 (model built under zero.Init; ZeRO averages gradients over dp x sp,
    the JSON leaves train_batch_size to DeepSpeed): parity, final/, eval logits, resume and export."""
    straight, _ = export_check.proven_run(ds_sp_worker, llama, tmp_path, "sp2.json", "deepspeed sp=2")
    assert "train_batch_size" not in straight["ds_config"]


@pytest.mark.parametrize("family", cells(["qwen2-mqa", "gpt2", "mistral", "qwen2-alternating"],
                                         slow={"mistral"}))  # Qwen2's sliding blocks cover Mistral's window
def test_sp2_step_loss_is_the_global_token_mean(family, tmp_path):
    """Rows with a varying -100 prefix, through engine.train_step, against one process running the whole global
    batch in one forward: the loss is the step's token mean although the two sequence halves hold different
    numbers of label tokens (tests/multirank/test_token_weighting.py's reference, the same 8 samples a step).
    Mistral (a sliding window of 16 over 32 tokens) and a Qwen2 with full and sliding blocks get their windows
    rebuilt over the whole sequence after the all-to-all."""
    model = families.make_model_dir(family, tmp_path / family)
    expected = ref.whole_batch_reference(model)
    out = tmp_path / "sp2.json"
    ranks(ref.engine_worker_args(model, out, "--backend", "fsdp", "--stage", "3", "--sp", "2", "--whole-step",
                                 "--masked-labels", "--micro", ref.WORLD * ref.MICRO), timeout=300)
    result = json.loads(out.read_text())
    assert ref.max_rel(ref.series(result, "loss"), expected["losses"]) <= FP32_RTOL, (result, expected)
    assert ref.max_rel(ref.series(result, "grad_norm"), expected["grad_norms"]) <= FP32_RTOL, (result, expected)


def test_sp2_with_lora_and_gradient_checkpointing(llama, tmp_path):
    """The all-to-all attention installed under peft's wrapper, recomputed in backward: LoRA r=4 on every linear
    with gradient checkpointing, sp=2 (micro-batch 4, dp 1) against the one-process peft run of tests/multirank/
    test_lora.py (2 replicas x micro-batch 2: the same 8 samples a step)."""
    from tests.multirank.test_lora import CLIP, LR, R, lora_reference

    out = tmp_path / "sp2_lora.json"
    ranks(ref.engine_worker_args(llama, out, "--backend", "fsdp", "--stage", "3", "--sp", "2", "--lora-r", R,
                                 "--lr", LR, "--clip", CLIP, "--micro", ref.WORLD * ref.MICRO,
                                 "--gradient-checkpointing"), timeout=300)
    reference = lora_reference(llama, "causal-lm", checkpointing=True)
    ref.assert_parity(json.loads(out.read_text()), reference, FP32_RTOL, FP32_RTOL, "fsdp sp=2 lora ckpt", clip=CLIP)


@pytest.mark.slow  # CI time (issue 52): CI's 4-rank FSDP2 cell is tp2 x pp2 (test_composed_layouts.py)
def test_sp2_dp2_on_four_ranks(llama, tmp_path):
    result = sp_worker(llama, tmp_path / "sp2dp2.json", nproc=4, dp=2, stage=2)
    ref.assert_parity(result, ref.mp_reference(llama, dp=2), FP32_RTOL, FP32_RTOL, "fsdp sp=2 x dp=2",
                      clip=ref.MP_CLIP)


def _metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def _assert_same_metrics(one_dir: Path, sp_dir: Path, steps: int, evals: int) -> None:
    """The two runs logged the same losses, grad norms and eval losses (fp32, 1e-5), steps and >= evals of them."""
    (one, one_eval), (sp2, sp2_eval) = _metrics(one_dir), _metrics(sp_dir)
    assert len(one) == len(sp2) == steps and len(one_eval) == len(sp2_eval) >= evals
    for a, b in zip(one + one_eval, sp2 + sp2_eval):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=FP32_RTOL), (key, a, b)


@pytest.mark.slow  # CI: the packed-chat CLI cell below runs --sp 2 with the tiled MLP and the chunked loss
def test_cli_sp2_equals_one_process(tmp_path):
    """`zerotrain train --sp 2 --tiled-mlp 16 --chunked-loss 16` on 2 ranks (two tiles and chunks per row of each
    32-token shard) and `zerotrain train` in one process, the same global batch: the same losses, grad norms and
    eval losses (eval runs the model's own head; its logits gathered over the sequence)."""
    config = cli_against_one_process(tmp_path, ["--sp", "2", "--tiled-mlp", "16", "--chunked-loss", "16"])
    assert "sp: 2" in config and "tiled_mlp: 16" in config and "chunked_loss: 16" in config


def cli_against_one_process(tmp_path: Path, flags: list[str], nproc: int = 2) -> str:
    """`zerotrain train` of a packed tiny Llama (FSDP2 stage 3, 4 steps, eval every 2) in one process and with
    `flags` on `nproc` ranks, the same global batch: the same losses, grad norms and eval losses; the parallel run's
    run_config.yaml."""
    import sys

    common = ["train", "--model-config", "tiny-llama", "--seq-len", "64", "--pack", "--micro-batch", "2",
              "--grad-accum", "2", "--lr", "1e-3", "--max-steps", "4", "--eval-split", "0.1", "--eval-every", "2",
              "--backend", "fsdp", "--stage", "3", "--dist-timeout", "120", "--no-save-final", "--overwrite"]
    env = rank_env(ZEROTRAIN_CACHE=str(tmp_path / "cache"))
    run([sys.executable, "-m", "zerotrain", *common, "--output", str(tmp_path / "one")], env=env, timeout=300,
        check=True)
    torchrun(["-m", "zerotrain", *common, *flags, "--output", str(tmp_path / "parallel")], env=env, nproc=nproc,
             timeout=400)
    _assert_same_metrics(tmp_path / "one", tmp_path / "parallel", steps=4, evals=2)
    return (tmp_path / "parallel" / "run_config.yaml").read_text()


REDUCERS = ("--tiled-mlp", 8, "--chunked-loss", 8)
"""Tiles of 8 tokens over each rank's 16-token shard (2 MLP tiles a row, 8 loss chunks a micro-batch of 4 rows)."""


@pytest.mark.parametrize("backend", cells(["deepspeed", "fsdp"], slow={"fsdp"}))
def test_sp2_with_memory_reducers(llama, tmp_path, backend):
    """sp=2 with the tiled MLP and the chunked loss (zerotrain/model/memory_reducers.py) at stage 3 and gradient
    checkpointing (the tiles' checkpoints nested in the blocks'): DeepSpeed ZeRO-3 gathers the partitioned head in
    every chunk's forward and recompute; FSDP2 shards it as a DTensor. Against the one-process run."""
    result = sp_worker(llama, tmp_path / "sp2_reducers.json", *REDUCERS, "--gradient-checkpointing", nproc=2, dp=1,
                       backend=backend)
    ref.assert_parity(result, ref.mp_reference(llama, dp=1), FP32_RTOL, FP32_RTOL, f"{backend} sp=2 reducers",
                      clip=ref.MP_CLIP)
    banner = "\n".join(result["describe"])
    assert "tiled MLP: 2 MLPs run over tiles of 8 tokens" in banner and "chunks of 8 tokens" in banner, banner


def test_cli_sp2_packed_chat_equals_one_process(tmp_path):
    """Chat samples packed into 64-token rows (--packing: position ids restart per sample, attention must stay in
    its sample) cut over 2 ranks on DeepSpeed ZeRO-3: the per-document mask rebuilt from the whole sequence's
    position ids gives one process's losses, grad norms and eval losses. The sp=2 run also tiles the MLP and chunks
    the loss (--tiled-mlp 16 --chunked-loss 16: two tiles and chunks per row of each 32-token shard; one process runs
    without them), which the CLI writes to run_config.yaml (issue 50 folded test_cli_sp2_equals_one_process in)."""
    import sys

    from tests.multirank.test_sft_train import chat_rows, write_jsonl
    from zerotrain.assets.demo import build_tokenizer

    model = families.make_model_dir("llama", tmp_path / "llama")
    build_tokenizer(vocab_size=families.VOCAB - 24).save_pretrained(str(model))
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(48))
    common = ["train", "--model", str(model), "--data", str(data), "--chat-template", "chatml", "--packing",
              "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2", "--lr", "1e-3", "--max-steps", "3",
              "--eval-split", "0.1", "--eval-every", "3", "--backend", "deepspeed", "--stage", "3",
              "--dist-timeout", "120", "--no-save-final", "--overwrite"]
    env = rank_env(ZEROTRAIN_CACHE=str(tmp_path / "cache"))
    run([sys.executable, "-m", "zerotrain", *common, "--output", str(tmp_path / "one")], env=env, timeout=300,
        check=True)
    # --loader-workers 1: the sp run's batches are read ahead by a loader process (one process reads its own)
    res = torchrun(["-m", "zerotrain", *common, "--sp", "2", "--tiled-mlp", "16", "--chunked-loss", "16", "--output",
                    str(tmp_path / "sp2"), "--loader-workers", "1"], env=env, timeout=300)
    assert "efficiency" in res.stdout  # the rows really are packed
    _assert_same_metrics(tmp_path / "one", tmp_path / "sp2", steps=3, evals=1)
    config = (tmp_path / "sp2" / "run_config.yaml").read_text()
    assert "sp: 2" in config and "tiled_mlp: 16" in config and "chunked_loss: 16" in config

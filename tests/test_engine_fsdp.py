"""FSDP2 engine on real ranks (2 CPU processes, gloo): parity with the single-process PyTorch
reference at every ZeRO stage mapping, resume (same and different world size), save_hf/export,
and the automatic fallback when DeepSpeed is absent.

Each launch costs ~10-20 s of start-up, so each does several checks ("launch once, check much").
Launching tests are marked multirank; the config refusals and block discovery run in-process.
Run: .venv/bin/python -m pytest tests/test_engine_fsdp.py -v -s
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import reference as ref
from reference import ACCUM, WORLD, assert_same_weights, engine_worker_args, load_safetensors, max_rel, series
from launch import rank_env, run, torchrun

FP32_RTOL = 1e-5
# bf16 (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)): forward/backward run on bf16
# copies of the fp32 master weights (8 mantissa bits: 2**-8 = 3.9e-3 relative per element), while
# gradient reduction, clipping and AdamW stay fp32. For this tiny random model the loss is close
# to log(vocab) and a mean over 256 tokens, so rounding averages out: measured here, 6 steps, max
# rel diff vs the fp32 reference 2.3e-5 (loss) and 6.3e-4 (grad norm), deterministic on CPU.
# Bounds are ~9x / ~8x those. They still catch real bugs: with gradient sync switched off
# (each rank steps on its own gradients) the same run is off by 1.5e-3 (loss) and 1.0 (norm).
BF16_RTOL_LOSS, BF16_RTOL_NORM = 2e-4, 5e-3
STAGE1_WARNING = "FSDP runs as stage 2"
OFFLOAD_WARNING = "has no effect in an FSDP run on a CPU-only machine"


def worker(model_dir: Path, out: Path, *args, nproc: int = WORLD, accum: int = ACCUM, timeout: float = 400):
    """One torchrun launch of the shared engine worker with backend=fsdp; (rank-0 result, process)."""
    proc = torchrun(engine_worker_args(model_dir, out, "--backend", "fsdp", *args, accum=accum), nproc=nproc,
                    timeout=timeout, check=True)
    result = json.loads(out.read_text())
    assert result["backend"] == "fsdp"
    return result, proc


def assert_parity(result: dict, reference: dict, rtol_loss: float, rtol_norm: float, label: str) -> None:
    ref.assert_parity(result, reference, rtol_loss, rtol_norm, f"fsdp {label}")


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp32_parity(model_dir, reference, work, stage):
    """Stage 0 = DDP, 1 and 2 = fully_shard(reshard_after_forward=False); stage 3 is below.
    Stages 0 and 2 build rank 1's model on the meta device (zerotrain's ModelBuilder) and fill it from
    rank 0; stage 1 is given a plain callable (a user's own factory: full model on every rank)."""
    factory = "plain" if stage == 1 else "builder"
    result, proc = worker(model_dir, work / f"stage{stage}.json", "--stage", stage, "--factory", factory)
    assert result["from_rank0"] == (factory == "builder")
    assert_parity(result, reference, FP32_RTOL, FP32_RTOL, f"stage{stage}")
    assert (STAGE1_WARNING in proc.stderr) == (stage == 1)  # the lossy mapping is announced, once
    assert proc.stderr.count(STAGE1_WARNING) <= 1


@pytest.mark.multirank
def test_bf16_stage3_with_offload_requested(model_dir, reference, work):
    """bf16 mixed precision; CPU offload asked for on a CPU-only machine warns and trains."""
    result, proc = worker(model_dir, work / "bf16.json", "--stage", "3", "--dtype", "bf16",
                          "--offload-optimizer", "cpu", "--offload-param", "cpu")
    assert_parity(result, reference, BF16_RTOL_LOSS, BF16_RTOL_NORM, "stage3-bf16")
    assert proc.stderr.count(OFFLOAD_WARNING) == 1, proc.stderr[-3000:]  # rank 0 only


@pytest.fixture(scope="module")
def stage3_run(model_dir, work) -> dict:
    """Full shard fp32, 6 steps straight: checkpoints at 3 and 6 (keep 2), save_hf, probe logits."""
    result, _ = worker(model_dir, work / "s3.json", "--stage", "3", "--ckpt-root", work / "s3ck",
                       "--save-at", "3", "6", "--save-hf", work / "s3hf", "--probe-out", work / "s3probe.pt")
    return result


@pytest.mark.multirank
def test_stage3_parity_and_checkpoint_layout(stage3_run, reference, work):
    assert_parity(stage3_run, reference, FP32_RTOL, FP32_RTOL, "stage3")
    from zerotrain import checkpoint as ck

    root = work / "s3ck"
    assert ck.read_latest(root) == "global_step6"
    assert [d.name for d in ck.list_complete(root)] == ["global_step3", "global_step6"]
    meta = ck.read_meta(root / "global_step6")
    assert (meta.backend, meta.format, meta.zero_stage, meta.world_size, meta.global_step, meta.model_class) == \
        ("fsdp", "dcp", 3, 2, 6, "GPT2LMHeadModel")
    tag = root / "global_step6"
    assert (tag / "config.json").is_file() and (tag / ck.DCP_SUBDIR / ".metadata").is_file()
    assert len(list((tag / ck.DCP_SUBDIR).glob("*.distcp"))) == WORLD  # one shard file per rank


@pytest.mark.multirank
def test_stage3_save_hf_and_export(stage3_run, reference, work):
    """save_hf loads with from_pretrained and gives the training model's logits; `zerotrain export`
    of the FSDP checkpoint (one process, no process group) gives the same weights."""
    hf = ref.load_model(work / "s3hf")
    hf.eval()
    with torch.no_grad():
        logits = hf(input_ids=ref.probe_input()).logits
    torch.testing.assert_close(logits, torch.load(work / "s3probe.pt"), rtol=1e-5, atol=1e-5)
    saved = load_safetensors(work / "s3hf")
    assert all(v.dtype == torch.float32 for v in saved.values())
    assert "lm_head.weight" not in saved  # tied to wte, dropped like an unsharded save_pretrained
    assert_same_weights(saved, reference["state_dict"], rtol=1e-4, atol=1e-5)  # and they are the reference's

    out = work / "exported"
    res = run([sys.executable, "-m", "zerotrain", "export", str(work / "s3ck"), str(out)], timeout=300, check=True)
    assert "global_step6" in res.stdout
    assert_same_weights(load_safetensors(out), saved)
    exported = ref.load_model(out)
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ref.probe_input()).logits, logits, rtol=1e-6, atol=1e-6)


@pytest.mark.multirank
def test_stage3_resume_same_world(stage3_run, model_dir, work):
    """3 steps + save inside the straight run, then a NEW launch resumes at 3 and runs to 6."""
    r, _ = worker(model_dir, work / "resume.json", "--stage", "3", "--resume", work / "s3ck" / "global_step3",
                  "--save-hf", work / "resumehf")
    assert r["start_step"] == 3
    assert r["client_state"] == {"next_step": 3, "note": "client-state", "nested": {"a": [1, 2, 3]}}
    straight, resumed = series(stage3_run, "loss", 3), series(r, "loss", 3)
    print(f"RESUME fsdp stage3 2->2 ranks: loss max rel diff {max_rel(resumed, straight):.2e}")
    assert max_rel(resumed, straight) <= 1e-6, (resumed, straight)
    assert max_rel(series(r, "grad_norm", 3), series(stage3_run, "grad_norm", 3)) <= 1e-6
    assert_same_weights(load_safetensors(work / "resumehf"), load_safetensors(work / "s3hf"), rtol=1e-6, atol=1e-7)


@pytest.mark.multirank
def test_resume_on_one_rank_at_stage2(stage3_run, model_dir, work):
    """DCP resharding: the 2-rank stage-3 checkpoint resumes on ONE rank at stage 2 (grad-accum 4
    keeps the same global batch), and continues the straight run."""
    r, _ = worker(model_dir, work / "resume1.json", "--stage", "2", "--resume", work / "s3ck" / "global_step3",
                  nproc=1, accum=2 * ACCUM)
    assert r["start_step"] == 3
    straight, resumed = series(stage3_run, "loss", 3), series(r, "loss", 3)
    d = max_rel(resumed, straight)
    print(f"RESUME fsdp stage3x2 -> stage2x1 rank: loss max rel diff {d:.2e}")
    assert d <= FP32_RTOL, (resumed, straight)  # summation order differs, so not bit-exact


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["absent", "broken"])
def test_auto_falls_back_to_fsdp_without_deepspeed(tmp_path, case):
    """With deepspeed not importable, `backend: auto` trains through FSDP and says so (whole CLI,
    one process, checkpoint + final/); `backend: deepspeed` is a one-line error with the install command.

    absent: `import deepspeed` finds nothing. broken: an installed deepspeed whose import raises (a failed
    op build, a torch mismatch): the package and its metadata are still there, so transformers and
    accelerate think it is usable and import it inside save_pretrained; `final/` was lost that way."""
    nods = tmp_path / "nods"
    nods.mkdir()
    if case == "absent":
        # sitecustomize runs at interpreter start: `import deepspeed` raises as if it were not installed.
        (nods / "sitecustomize.py").write_text('import sys\nsys.modules["deepspeed"] = None\n')
    else:  # first on the path, shadowing the real package, whose dist-info metadata stays visible
        (nods / "deepspeed").mkdir()
        (nods / "deepspeed" / "__init__.py").write_text('raise ImportError("simulated broken deepspeed build")\n')
    env = rank_env(PYTHONPATH=f"{nods}:{rank_env()['PYTHONPATH']}")
    probe = run([sys.executable, "-c", "import deepspeed"], env=env, timeout=60)
    error = "ModuleNotFoundError" if case == "absent" else "simulated broken deepspeed build"
    assert probe.returncode != 0 and error in probe.stderr  # the simulation holds

    out = tmp_path / "run"
    res = run([sys.executable, "-m", "zerotrain", "train", "--max-steps", "2", "--save-every", "2",
               "--output", str(out)], env=env, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-4000:]
    assert "zerotrain backend: fsdp" in res.stderr and "pip install" in res.stderr, res.stderr[-3000:]
    assert case == "absent" or "import deepspeed failed (ImportError: simulated" in res.stderr, res.stderr[-3000:]
    from zerotrain import checkpoint as ck

    assert ck.read_meta(out / "checkpoints" / "global_step2").backend == "fsdp"
    assert (out / "final" / "model.safetensors").is_file()

    res = run([sys.executable, "-m", "zerotrain", "train", "--backend", "deepspeed", "--max-steps", "1",
               "--output", str(tmp_path / "ds")], env=env, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [l for l in res.stderr.strip().splitlines() if "backend=deepspeed" in l]
    assert len(lines) == 1 and "pip install" in lines[0] and "Traceback" not in res.stderr, res.stderr[-3000:]


# --- in-process: no ranks launched ---------------------------------------------------------------

@pytest.mark.parametrize("overrides,needle", [
    ({"precision.dtype": "fp16"}, "precision.dtype=fp16"),
    ({"zero.stage": 3, "zero.offload_param": "nvme", "zero.nvme_path": "/tmp"}, "nvme"),
    ({"zero.stage": 2, "zero.offload_optimizer": "nvme", "zero.nvme_path": "/tmp"}, "nvme"),
])
def test_refused_settings_are_one_line_value_errors(overrides, needle):
    """Refused before any process group or model exists (the factory must never be called)."""
    from zerotrain.backends.fsdp import FSDPEngine
    from zerotrain.config import build_config

    cfg = build_config(overrides={"backend": "fsdp", **overrides})

    def factory():
        raise AssertionError("model built before the config was checked")

    with pytest.raises(ValueError) as e:
        FSDPEngine(factory, cfg, total_steps=1)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and ("--" in msg), msg  # names the setting and a flag to fix it


def test_transformer_blocks_are_the_layer_stack():
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from zerotrain.model_info import transformer_blocks
    from zerotrain.model_info import load_hf_config

    hf = load_hf_config("tiny-gpt2")
    with torch.device("meta"):
        lm, cls = AutoModelForCausalLM.from_config(hf), AutoModelForSequenceClassification.from_config(hf)
        stack = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
        plain = torch.nn.Sequential(torch.nn.Linear(2, 2), stack)
    assert [type(b).__name__ for b in transformer_blocks(lm)] == ["GPT2Block"] * hf.n_layer
    assert len(transformer_blocks(cls)) == hf.n_layer
    assert len(transformer_blocks(plain)) == 3  # no _no_split_modules: the first ModuleList

"""The runs and the checkpoint / final / resume / export checks the model-parallel tests share (tensor
and pipeline parallel, both backends: tests/multirank/test_tensor_parallel.py, test_deepspeed_tp.py,
test_pipeline_deepspeed.py, test_pipeline_fsdp.py).

A parity run is a worker's run against the one-process run of the same global batch
(reference.mp_reference). The export test of each module runs its worker once on 2 ranks (dp 1) with
checkpoints at steps 3 and 6 under tmp_path/ck and final/ at tmp_path/hf; then checks final/, the step-3
checkpoint's meta, a resume from it and the export of the step-6 checkpoint. A worker is called as
worker(model_dir, out, *args, nproc=, dp=, **kw), as the wrappers of reference.mp_worker in those tests are.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

import tests.support.reference as ref

FP32_RTOL = 1e-5
"""Loss and gradient-norm tolerance of an fp32 model-parallel run against the one-process run."""


def parity_run(worker: Callable[..., dict], model_dir: Path, out: Path, label: str, *, nproc: int,
               dp: int) -> dict:
    """`worker` on `nproc` ranks at data-parallel size `dp`, whose per-step loss, grad norm and lr must equal
    the one-process run's; its result."""
    result = worker(model_dir, out, nproc=nproc, dp=dp)
    ref.assert_parity(result, ref.mp_reference(model_dir, dp=dp), FP32_RTOL, FP32_RTOL, label, clip=ref.MP_CLIP)
    return result


def checkpointed_run(worker: Callable[..., dict], model_dir: Path, tmp_path: Path, out_name: str, label: str,
                     *args: Any, **kw: Any) -> tuple[dict, dict]:
    """The one-process reference, then `worker` on 2 ranks saving at steps 3 and 6 and final/ (plus `args`),
    whose per-step loss, grad norm and lr must equal the reference's: (the run's result, the reference)."""
    reference = ref.mp_reference(model_dir, dp=1)
    straight = worker(model_dir, tmp_path / out_name, "--ckpt-root", tmp_path / "ck", "--save-at", "3", "6",
                      "--save-hf", tmp_path / "hf", *args, nproc=2, dp=1, **kw)
    ref.assert_parity(straight, reference, FP32_RTOL, FP32_RTOL, label, clip=ref.MP_CLIP)
    return straight, reference


def final_weights(tmp_path: Path, reference: dict) -> dict[str, torch.Tensor]:
    """final/ (tmp_path/hf) is one ordinary HF model equal to the one-process weights; its state dict."""
    hf = ref.load_safetensors(tmp_path / "hf")
    ref.assert_same_weights(hf, reference["state_dict"], rtol=1e-4, atol=1e-5)
    return hf


def final_model(tmp_path: Path) -> torch.nn.Module:
    """final/'s model (tmp_path/hf), checked to give the engine's eval_step logits on the probe input
    (tmp_path/probe.pt, written by --probe-out)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "probe.pt"), model(ref.probe_input()).logits,
                                   rtol=1e-5, atol=1e-5)
    return model


def step3_meta(tmp_path: Path) -> dict:
    """The step-3 checkpoint's zerotrain_meta.json."""
    return json.loads((tmp_path / "ck" / "global_step3" / "zerotrain_meta.json").read_text())


def assert_resume_and_export(worker: Callable[..., dict], model_dir: Path, tmp_path: Path, straight: dict,
                             hf: dict[str, torch.Tensor], **kw: Any) -> dict[str, torch.Tensor]:
    """A run resumed from the step-3 checkpoint starts at step 3, repeats the straight run's steps 3-5
    exactly and saves the same final/; `zerotrain export` of the step-6 checkpoint equals final/. Returns
    the exported state dict."""
    import transformers

    from zerotrain.export.to_hf import export_checkpoint

    resumed = worker(model_dir, tmp_path / "resume.json", "--resume", tmp_path / "ck" / "global_step3",
                     "--save-hf", tmp_path / "hf_resumed", nproc=2, dp=1, **kw)
    assert resumed["start_step"] == 3
    for key in ("loss", "grad_norm", "lr"):
        assert ref.series(resumed, key, start=3) == ref.series(straight, key, start=3), key
    ref.assert_same_weights(ref.load_safetensors(tmp_path / "hf_resumed"), hf)
    out = export_checkpoint(tmp_path / "ck" / "global_step6", tmp_path / "exported")
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    ref.assert_same_weights(exported, hf)
    return exported


def proven_run(worker: Callable[..., dict], model_dir: Path, tmp_path: Path, out_name: str, label: str,
               *args: Any, check: Callable[[dict, dict], None] = lambda straight, reference: None,
               **kw: Any) -> tuple[dict, dict]:
    """The whole proof of a layout in one place: checkpointed_run (parity) with the probe logits, final/ equal to
    the one-process weights and giving the engine's logits, `check(straight, reference)` (the layout's own
    checks), then assert_resume_and_export, the export equal to the one-process weights too."""
    straight, reference = checkpointed_run(worker, model_dir, tmp_path, out_name, label, *args,
                                           "--probe-out", tmp_path / "probe.pt", **kw)
    hf = final_weights(tmp_path, reference)
    final_model(tmp_path)
    check(straight, reference)
    exported = assert_resume_and_export(worker, model_dir, tmp_path, straight, hf, **kw)
    ref.assert_same_weights(exported, reference["state_dict"], rtol=1e-4, atol=1e-5)
    return straight, reference

"""Probe: does DeepSpeed 0.19.8's AutoTP training (ZeRO 0-2, config "tensor_parallel": {"autotp_size": 2}) split a
peft-wrapped (LoRA) model so a tp=2 run equals one plain process with the same global batch?

Run from the repository root:  PYTHONPATH=$PWD python benchmarks/results/lora_autotp_probe/probe.py
It launches tests/support/engine_worker.py on 2 ranks with LoRA's tp refusal on DeepSpeed lifted (this file run as
the rank script: capabilities.FEATURES["lora.r"] refused on no backend), and compares per-step losses and grad norms with the
one-process peft reference of tests/multirank/test_lora_tensor_parallel.py; the log is probe.log next to it."""
from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))


def rank_main() -> None:
    from dataclasses import replace

    from zerotrain.plan import capabilities

    lora = capabilities.FEATURES["lora.r"]
    capabilities.FEATURES["lora.r"] = replace(lora, backends=())  # the refusal under probe, lifted
    worker = str(REPO / "tests" / "support" / "engine_worker.py")
    sys.argv = [worker, *sys.argv[2:]]
    runpy.run_path(worker, run_name="__main__")


def main() -> None:
    import subprocess

    import tests.support.families as families
    import tests.support.reference as ref
    from tests.multirank.test_lora import CLIP, LR, R
    from tests.multirank.test_lora_tensor_parallel import lora_tp_reference
    from tests.support.launch import torchrun

    tmp = Path(tempfile.mkdtemp(prefix="lora_autotp_"))
    llama = families.make_model_dir("llama", tmp / "llama")
    reference = lora_tp_reference(llama)
    for stage in (int(s) for s in os.environ.get("STAGES", "2").split(",")):
        out = tmp / f"z{stage}.json"
        args = ref.engine_worker_args(llama, out, "--backend", "deepspeed", "--stage", stage, "--tp", 2, "--lora-r", R,
                                      "--lr", LR, "--clip", CLIP, "--micro", ref.mp_micro(1))
        args[0] = __file__
        args.insert(1, "--rank-probe")
        proc = torchrun(args, nproc=2, timeout=600, check=False)
        print(f"== deepspeed z{stage} tp=2 LoRA: exit {proc.returncode}")
        if proc.returncode:
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("[rank0]:")]
            keep = [ln for i, ln in enumerate(lines)  # the traceback's frames and the error, not the tensor printed
                    if "File " in ln or "Error" in ln or (i and "File " in lines[i - 1])]
            print("\n".join(ln[:300] for ln in keep[-24:]))
            continue
        result = json.loads(out.read_text())
        losses, norms = ref.series(result, "loss"), ref.series(result, "grad_norm")
        print("losses    ", losses)
        print("reference ", reference["losses"])
        print("grad norms", norms)
        print("reference ", reference["grad_norms"])
        print(f"loss max rel diff {ref.max_rel(losses, reference['losses']):.2e}, grad-norm max rel diff "
              f"{ref.max_rel(norms, reference['grad_norms']):.2e}; split params {sorted(result['param_local'])[:4]}")


if __name__ == "__main__":
    rank_main() if len(sys.argv) > 1 and sys.argv[1] == "--rank-probe" else main()

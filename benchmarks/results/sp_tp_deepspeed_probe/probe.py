"""Probe: does DeepSpeed 0.19.8's AutoTP training (ZeRO 0-2) compose with zerotrain's Ulysses sp on DeepSpeed?

    PYTHONPATH=$PWD python benchmarks/results/sp_tp_deepspeed_probe/probe.py [stage ...]

4 CPU ranks (sp 2 x tp 2), the tests' tiny Llama (4 heads, 2 key/value heads), the parity tests' run (6 steps,
clipping 0.5) against the one-process reference with the same global batch; prints what happened per stage."""
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

import tests.support.families as families  # noqa: E402
import tests.support.reference as ref  # noqa: E402
from tests.support.launch import torchrun  # noqa: E402

RANK = Path(__file__).with_name("probe_rank.py")


def main(stages: list[int]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="sptp_ds_"))
    model = families.make_model_dir("llama", tmp / "llama")
    reference = ref.mp_reference(model, dp=1)
    print("reference losses", reference["losses"], flush=True)
    for stage in stages:
        out = tmp / f"stage{stage}.json"
        args = ref.engine_worker_args(model, out, "--clip", ref.MP_CLIP, "--micro", ref.mp_micro(1), "--backend",
                                      "deepspeed", "--stage", stage, "--sp", 2, "--tp", 2)
        res = torchrun([RANK, *args[1:]], nproc=4, timeout=500, check=False)
        print(f"== deepspeed stage {stage} sp2 x tp2: exit {res.returncode}", flush=True)
        if res.returncode != 0 or not out.exists():
            lines = [ln for ln in (res.stderr or "").splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln or "error" in ln][-8:]
            print("\n".join(errors or lines[-20:]), flush=True)
            continue
        got = json.loads(out.read_text())
        for key, mine in (("loss", "losses"), ("grad_norm", "grad_norms")):
            rel = ref.max_rel(ref.series(got, key), reference[mine])
            print(f"{key}: {ref.series(got, key)}\n  max relative difference to one process: {rel:.3g}", flush=True)
        print("banner:", *got["describe"], sep="\n  ")


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]] or [2])

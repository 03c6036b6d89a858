"""--optimizer muon on 2 real CPU ranks (FSDP2 stage 0: DDP, each rank holds every whole matrix; stage 3: DTensor
shards, whose Newton-Schulz DTensor ops compute the whole matrix's result) against ONE plain
process that trains the same batches with torch.optim.Muon (the blocks' 2-D matrices, picked by parameter name) +
torch.optim.AdamW (the rest), built straight from torch: per-step losses, pre-clip gradient norms and LRs (fp32, 1e-5).
The shared engine run (tests/support/reference.py): 6 steps, 2 micro-batches of 2 per rank, warm-up, clipping at 0.5.

This file is also the launched worker (`__main__`): tests/support/engine_worker.py's main with optimizer.name=muon
added to the config it builds (as tests/multirank/test_optimizers.py adds its cells' settings).

Run: .venv/bin/python -m pytest tests/multirank/test_muon.py -v -s -m slow
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import tests.support.families as F
import tests.support.reference as ref
from tests.support.matrix import cells
from tests.support.reference import ACCUM, LR, MICRO, STEPS, WARMUP, WD, WORLD

BLOCKS = {"gpt2": "transformer.h.", "llama": "model.layers."}
MOMENTUM = 0.95
CLIP = 0.5
NORM_RTOL = 5e-5
"""The pre-clip gradient norm's tolerance; the loss keeps 1e-5 (the issue's). torch.optim.Muon runs Newton-Schulz in
bfloat16: the 2 ranks' all-reduced gradient differs from one process's sum in the last fp32 bit, which can flip a bf16
rounding of one element of the update, so the weights part by ~1e-7 from step 2 on and the next norms by up to 1.8e-5
(gpt2 stage 3; 1.4e-5 gpt2 stage 0, 1e-5 and 5.6e-6 llama; the losses by at most 1.2e-6)."""
"""Below both families' gradient norms in some step (as tests/multirank/test_optimizers.py), so clipping acts."""


def torch_reference(model_dir: Path, family: str) -> dict:
    """The engine run in one process: torch.optim.Muon (match_rms_adamw, Nesterov) + AdamW stepped together."""
    model: list[torch.nn.Module] = []

    def build():
        model.append(ref.load_model(model_dir))
        return model[0]

    class Both(torch.optim.Optimizer):  # one object for the reference loop: AdamW's groups first, then Muon's
        def __init__(self, params):
            named = list(model[0].named_parameters())
            mats = [p for n, p in named if n.startswith(BLOCKS[family]) and p.ndim == 2]
            rest = [p for n, p in named if not (n.startswith(BLOCKS[family]) and p.ndim == 2)]
            assert len(mats) + len(rest) == len(params)
            self.parts = [torch.optim.AdamW(rest, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD),
                          torch.optim.Muon(mats, lr=LR, weight_decay=WD, momentum=MOMENTUM, nesterov=True,
                                           adjust_lr_fn="match_rms_adamw")]
            super().__init__(params, {})
            self.param_groups = [g for o in self.parts for g in o.param_groups]

        def step(self, closure=None):
            for o in self.parts:
                o.step()

    run = ref.reference_run(model_dir, steps=STEPS, world=WORLD, grad_accum=ACCUM, micro=MICRO, lr=LR,
                            weight_decay=WD, clip=CLIP, warmup=WARMUP, build=build, make_optimizer=Both)
    return {k: run[k] for k in ("losses", "grad_norms", "lrs")}


@pytest.mark.parametrize("family,stage", cells([("gpt2", 0), ("llama", 0), ("gpt2", 3), ("llama", 3)],
                                               {"gpt2-0", "llama-0", "gpt2-3"}, ids=lambda c: f"{c[0]}-{c[1]}"))
def test_muon_fsdp_equals_torch(tmp_path, family, stage):
    from tests.support.launch import ranks

    model_dir = F.make_model_dir(family, tmp_path / "model")
    out = tmp_path / "result.json"
    worker_args = ref.engine_worker_args(model_dir, out, "--backend", "fsdp", "--stage", stage, "--clip", CLIP)[1:]  # less its path
    ranks([__file__, *map(str, worker_args)], nproc=WORLD, timeout=400)
    result = json.loads(out.read_text())
    reference = torch_reference(model_dir, family)
    ref.assert_parity(result, reference, 1e-5, NORM_RTOL, f"{family}-muon-fsdp-z{stage}", clip=CLIP)
    per_block = 4 if family == "gpt2" else 7  # c_attn, c_proj, c_fc, mlp.c_proj | q, k, v, o, gate, up, down
    assert any(line.startswith(f"muon: {2 * per_block} block matrices") for line in result["describe"]), result


@pytest.mark.slow
def test_muon_resume_is_exact(tmp_path):
    """FSDP2 stage 3: a run saved at step 3 and resumed (the composite's state through DCP) logs the steps after 3 as
    the run that never stopped."""
    from tests.support.launch import ranks

    model_dir = F.make_model_dir("llama", tmp_path / "model")

    def run(out: str, *extra) -> dict:
        args = ref.engine_worker_args(model_dir, tmp_path / out, "--backend", "fsdp", "--stage", 3, *extra)[1:]
        ranks([__file__, *map(str, args)], nproc=WORLD, timeout=400)
        return json.loads((tmp_path / out).read_text())

    whole = run("whole.json")
    run("first.json", "--ckpt-root", tmp_path / "ck", "--save-at", 3, "--stop-at", 3)
    rest = run("rest.json", "--resume", tmp_path / "ck" / "global_step3")
    assert rest["start_step"] == 3
    assert ref.series(rest, "loss", start=3) == ref.series(whole, "loss", start=3)


def _worker() -> int:
    import tests.support.engine_worker as engine_worker
    import zerotrain.config.load as zc

    build_config = zc.build_config

    def with_muon(*args, overrides=None, **kwargs):
        return build_config(*args, overrides={**(overrides or {}), "optimizer.name": "muon",
                                              "optimizer.muon_momentum": MOMENTUM}, **kwargs)

    zc.build_config = with_muon  # engine_worker.main imports it from the module at call time
    sys.argv = [engine_worker.__file__, *sys.argv[1:]]
    return engine_worker.main()


if __name__ == "__main__":
    from zerotrain.distributed import process_group as dist

    dist.exit_cleanly(_worker())

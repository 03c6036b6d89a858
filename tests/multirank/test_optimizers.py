"""Every optimizer zerotrain offers, trained on the DeepSpeed backend through 2 real CPU ranks, against ONE
plain process that builds its optimizer and LR schedule straight from torch / transformers
(torch.optim.AdamW / Adam / SGD, transformers.get_cosine_schedule_with_warmup), never from zerotrain code:
per-step losses, pre-clip gradient norms and LRs (fp32, 1e-5 relative).

Cells: adamw, adam and sgd (momentum 0.9) at ZeRO-3, and sgd at ZeRO-1 (the momentum buffer is then
partitioned optimizer state), on a tiny GPT-2 and a tiny Llama (tests/support/families.py). All 8 cells run in ONE
torchrun launch: this file is also the launched worker (`__main__` below), which runs tests/support/engine_worker.py's
main once per cell in the same 2 processes (engine.close() tears the process group down, the next cell's
engine builds a new one), with the cell's optimizer settings added to the config the worker builds.

Every cell also checks that the optimizer mattered: the run is farther from the reference of a neighbouring
optimizer (adam <-> adamw: L2 vs decoupled weight decay; sgd: without momentum) than 30x the tolerance, so
an engine that stepped the wrong optimizer (DeepSpeed's "Adam" is AdamW unless adam_w_mode is false) fails.

Run: .venv/bin/python -m pytest tests/multirank/test_optimizers.py -v -s   (-s prints the parity figures)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import tests.support.families as F  # the launched copy of this file imports them too (launch.rank_env puts the repo on PYTHONPATH)
import tests.support.reference as ref
from tests.support.reference import ACCUM, MICRO, STEPS, WARMUP, WORLD, max_rel

FP32_RTOL = 1e-5
CLIP = 0.5
"""Below both families' gradient norms in some step (tests/multirank/test_families.py), so clipping acts."""
BETAS, EPS = (0.9, 0.999), 1e-8
HYPER: dict[str, dict] = {
    # Weight decay large enough that Adam's L2 and AdamW's decoupled decay part visibly (the adam <-> adamw
    # check: 6-9e-4 apart in loss, 60-90x the tolerance); SGD needs a larger lr than Adam to move a tiny model
    # in 6 steps. With these every reference run ends below its first loss (reference.assert_parity).
    "adamw": {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.3},
    "adam": {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.3},
    "sgd": {"lr": 0.5, "momentum": 0.9, "weight_decay": 0.1},
}
DS_TYPE = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
NEIGHBOUR = {"adamw": ("adam", {}), "adam": ("adamw", {}), "sgd": ("sgd", {"momentum": 0.0})}
"""The optimizer each cell must NOT reproduce (see the module docstring)."""
CELLS = [("adamw", 3), ("adam", 3), ("sgd", 3), ("sgd", 1)]
FAMILIES = ("gpt2", "llama")
CASES = [(fam, opt, stage) for fam in FAMILIES for opt, stage in CELLS]


def _cell_name(family: str, opt: str, stage: int) -> str:
    return f"{family}-{opt}-z{stage}"


def torch_reference(model_dir: str | Path, opt: str, *, lr: float, momentum: float, weight_decay: float,
                    clip: float = CLIP) -> dict:
    """The engine worker's run in one process (tests/support/reference.py's loop and data layout), optimizer and
    schedule from torch and transformers directly: per-step losses, pre-clip grad norms and LRs."""
    from transformers import get_cosine_schedule_with_warmup

    def make_optimizer(params):
        if opt == "adamw":
            return torch.optim.AdamW(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)
        if opt == "adam":
            return torch.optim.Adam(params, lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay)
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)

    run = ref.reference_run(model_dir, steps=STEPS, world=WORLD, grad_accum=ACCUM, micro=MICRO, lr=lr,
                            weight_decay=weight_decay, clip=clip, make_optimizer=make_optimizer,
                            make_scheduler=lambda optim: get_cosine_schedule_with_warmup(optim, WARMUP, STEPS))
    return {k: run[k] for k in ("losses", "grad_norms", "lrs")}


class Runs:
    """Model dirs, references and the one launch of every cell, shared by the module."""

    def __init__(self, root: Path):
        self.root = root
        self.dirs = {fam: F.make_model_dir(fam, root / fam) for fam in FAMILIES}
        self.refs: dict[tuple, dict] = {}
        self.results: dict[str, dict] | None = None

    def reference(self, family: str, opt: str, **change) -> dict:
        key = (family, opt, tuple(sorted(change.items())))
        if key not in self.refs:
            self.refs[key] = torch_reference(self.dirs[family], opt, **{**HYPER[opt], **change})
        return self.refs[key]

    def launch(self) -> dict[str, dict]:
        if self.results is None:
            from tests.support.launch import torchrun

            cells = []
            for fam, opt, stage in CASES:
                h = HYPER[opt]
                out = self.root / f"{_cell_name(fam, opt, stage)}.json"
                argv = ref.engine_worker_args(self.dirs[fam], out, "--stage", stage, "--clip", CLIP, "--lr", h["lr"],
                                              "--weight-decay", h["weight_decay"])[1:]
                over = ({"optimizer.momentum": h["momentum"]} if opt == "sgd"
                        else {"optimizer.betas": list(BETAS), "optimizer.eps": EPS})
                cells.append({"name": _cell_name(fam, opt, stage), "out": str(out), "argv": [str(a) for a in argv],
                              "overrides": {"optimizer.name": opt, **over}})
            spec = self.root / "cells.json"
            spec.write_text(json.dumps(cells, indent=1))
            torchrun([__file__, str(spec)], nproc=WORLD, timeout=500, agent=True)  # its workers use the agent store
            self.results = {c["name"]: json.loads(Path(c["out"]).read_text()) for c in cells}
        return self.results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("optimizers"))


@pytest.mark.multirank
@pytest.mark.parametrize("family,opt,stage", CASES, ids=[_cell_name(*c) for c in CASES])
def test_optimizer_matches_plain_torch(runs, family, opt, stage) -> None:
    result = runs.launch()[_cell_name(family, opt, stage)]
    ds = result["ds_config"]
    assert ds["optimizer"]["type"] == DS_TYPE[opt] and ds["zero_optimization"]["stage"] == stage, ds
    reference = runs.reference(family, opt)
    label = f"deepspeed z{stage} {opt} {family}"
    ref.assert_parity(result, reference, FP32_RTOL, FP32_RTOL, label, clip=CLIP)
    # assert_parity compared the engine's LRs (zerotrain's LambdaLR inside DeepSpeed) with transformers' schedule
    assert max(reference["lrs"]) == HYPER[opt]["lr"], reference["lrs"]
    other, change = NEIGHBOUR[opt]
    apart = max_rel(ref.series(result, "loss"), runs.reference(family, other, **change)["losses"])
    print(f"PARITY {label}: {apart:.2e} from the {other} {change or ''} reference")
    assert apart > 30 * FP32_RTOL, (label, other, change, apart)


# --- the launched worker ------------------------------------------------------------------------------
def _fresh_rendezvous(cell: int) -> None:
    """Point the next process group at a new TCP store that rank 0 hosts on a fresh port (agreed through
    torchrun's agent store). Re-initialising on the agent store does not work: destroy_process_group resets
    torch's group counter, so the new groups reuse the old groups' store keys, and a rank can read its peer's
    stale gloo address (seen here: "Timed out waiting 120000ms for send operation to complete")."""
    import os
    from datetime import timedelta

    from torch.distributed import TCPStore

    from zerotrain.util import free_port

    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["TORCHRUN_AGENT_PORT"]), is_master=False,
                     timeout=timedelta(seconds=120))
    key = f"test_optimizers/cell{cell}/port"
    if int(os.environ["RANK"]) == 0:
        agent.set(key, str(free_port()))
    os.environ["MASTER_PORT"] = agent.get(key).decode()
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 hosts the store (torch.distributed.rendezvous)


def _worker(spec_path: str) -> int:
    """Run tests/support/engine_worker.py's main once per cell of the spec, in this process (one rank), with the
    cell's overrides added to every config the worker builds."""
    import os

    import tests.support.engine_worker as engine_worker
    import zerotrain.config.load as zc

    os.environ["TORCHRUN_AGENT_PORT"] = os.environ["MASTER_PORT"]
    build_config = zc.build_config
    for i, cell in enumerate(json.loads(Path(spec_path).read_text())):
        def with_cell(*args, overrides=None, _extra=cell["overrides"], **kwargs):
            return build_config(*args, overrides={**(overrides or {}), **_extra}, **kwargs)

        if i:
            _fresh_rendezvous(i)
        zc.build_config = with_cell  # engine_worker.main imports it from the module at call time
        sys.argv = [engine_worker.__file__, *cell["argv"]]
        engine_worker.main()  # closes its engine: the process group is gone after each cell
    zc.build_config = build_config
    return 0


if __name__ == "__main__":
    from zerotrain.distributed import process_group as dist

    dist.exit_cleanly(_worker(sys.argv[1]))

"""Runner (a): the real `zerotrain train` command, with two read-only hooks for the benchmark.

    torchrun --nproc_per_node 2 benchmarks/run_zerotrain.py '{"stage": 3}' /tmp/res [RUN_YAML_EXTRA_JSON]

It calls `zerotrain.cli.main(["train", ...])` exactly as `python -m zerotrain train` does, and
- records perf_counter() whenever the trainer's `_train_step` returns (right after each optimizer
  step; the training record itself is written one step later, when its cross-rank figures arrive);
- after `Trainer.fit` returns (before the engine closes) counts per-rank model-state bytes of the
  DeepSpeed engine, like the peers.
The end-of-run checkpoint is skipped (Trainer.save is a no-op here): it happens after the timed
steps and only costs wall time. RUN_YAML_EXTRA_JSON is merged into the run config YAML (the
stage-3 knob sweep sets zero.* fields through it).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402


def main() -> None:
    job, out, extra = C.parse_job(sys.argv)
    from zerotrain import cli
    from zerotrain.train import trainer

    res = C.Result(rank=C.rank())
    train_step, fit = trainer.Trainer._train_step, trainer.Trainer.fit

    def timed_step(self, *args, **kwargs):  # returns on every rank right after each optimizer step
        t0 = C.now()
        out = train_step(self, *args, **kwargs)  # (any version's arguments: bench.py --before runs an older one)
        res.step_ends.append(C.now())
        res.in_step.append(res.step_ends[-1] - t0)
        return out

    def measured_fit(self):
        summary = fit(self)
        res.model_state_bytes = C.model_state_bytes(self.engine._ds)
        res.extra["last_loss"] = self.history[-1]["loss"] if self.history else None
        res.extra["ds_zero_config"] = self.engine.ds_config["zero_optimization"]
        C.write_result(out, res)
        return summary

    trainer.Trainer._train_step, trainer.Trainer.fit = timed_step, measured_fit
    trainer.Trainer.save = lambda self: None  # see the docstring

    run_dir = Path(f"{out}.run")
    cfg: dict = {"run": {"save_final": False, "overwrite": True}, "schedule": {"name": "constant"}}
    for section, values in json.loads(extra or "{}").items():
        cfg.setdefault(section, {}).update(values)
    run_dir.mkdir(parents=True, exist_ok=True)
    yaml_path = run_dir / f"bench.rank{C.rank()}.yaml"  # one per rank: no rank reads a half-written file
    yaml_path.write_text(yaml.safe_dump(cfg))
    argv = ["train", "--config", str(yaml_path), "--model", str(C.model_dir(job.preset)),
            "--seq-len", str(job.seq_len), "--stage", str(job.stage), "--precision", job.precision,
            "--micro-batch", str(C.MICRO_BATCH), "--grad-accum", str(C.GRAD_ACCUM), "--lr", str(C.LR),
            "--clip", str(C.CLIP), "--seed", str(C.SEED), "--max-steps", str(job.steps),
            "--output", str(run_dir / "out"), "--backend", "deepspeed"]
    if job.offload:
        argv += ["--offload-optimizer", "cpu", "--offload-param", "cpu"]
    sys.exit(cli.main(argv))


if __name__ == "__main__":
    main()

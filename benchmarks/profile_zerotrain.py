"""Where zerotrain's own per-step time goes: cProfile around `zerotrain train`, per rank.

    torchrun --nproc_per_node 2 benchmarks/profile_zerotrain.py '{"stage": 2, "steps": 20}' /tmp/prof

Writes PREFIX.rank<N>.prof and prints, for rank 0, the time inside Trainer._train_step split into
the engine's own work (forward, backward, step) and everything zerotrain does around it (data,
reseed, LR read, loss/tokens reads, the logging gather and the record written one step later by
`settle`, metrics file, progress bar).
"""
from __future__ import annotations

import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402


def main() -> None:
    job, out, _ = C.parse_job(sys.argv)
    from zerotrain import cli
    from zerotrain.train import trainer

    trainer.Trainer.save = lambda self: None  # the end-of-run checkpoint is not part of a step
    argv = ["train", "--model", str(C.model_dir(job.preset)), "--seq-len", str(job.seq_len), "--stage",
            str(job.stage), "--precision", job.precision, "--micro-batch", str(C.MICRO_BATCH), "--grad-accum",
            str(C.GRAD_ACCUM), "--lr", str(C.LR), "--max-steps", str(job.steps), "--output", f"{out}.run{C.rank()}",
            "--overwrite", "--backend", "deepspeed", "--schedule", "constant"]
    prof = cProfile.Profile()
    prof.enable()
    try:
        cli.main(argv)
    finally:
        prof.disable()
        prof.dump_stats(f"{out}.rank{C.rank()}.prof")
    if C.rank() == 0:
        st = pstats.Stats(prof)
        rows = {f"{Path(k[0]).name}:{k[2]}": (v[1], v[2], v[3]) for k, v in st.stats.items()}  # calls, tottime, cumtime

        def cum(name: str) -> float:
            return sum(v[2] for k, v in rows.items() if k.endswith(name))

        step = cum("trainer.py:_train_step") + cum("trainer.py:settle")  # settle: wait + write of the step before
        engine = cum("deepspeed.py:__call__") + cum("deepspeed.py:backward") + cum("deepspeed.py:step")
        print(f"_train_step + settle {step:.3f} s total; engine forward+backward+step {engine:.3f} s; "
              f"zerotrain around it {step - engine:.3f} s ({(step - engine) / max(step, 1e-9):.1%})")
        st.sort_stats("cumulative").print_stats(r"zerotrain/(trainer|metrics|data|backends/deepspeed)", 25)


if __name__ == "__main__":
    main()

"""Launched by tests/multirank/test_loop_cost.py: `zerotrain train` in one process (cli.main, as `python -m
zerotrain train` runs it) with every read of a tensor's value by zerotrain's own code counted.

    python tests/support/read_counter.py OUT.json train --max-steps 9 --log-every 9 ...

A read is Tensor.item / float() / int() / bool() / tolist() called from a module under zerotrain/: on a GPU each one
waits for the device (a host sync), so a step that logs nothing must make none. OUT.json: {"reads": [[step ends
before the read, "file.py:function"], ...], "step_ends": N}; a read made between the end of step k and the end of step k+1
has k step ends before it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

READ_METHODS = ("item", "__float__", "__int__", "__bool__", "tolist")


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    reads: list[tuple[int, str]] = []
    ends = [0]

    for name in READ_METHODS:
        inner = getattr(torch.Tensor, name)

        def counted(self, *args, _inner=inner, **kwargs):  # noqa: ANN001
            frame = sys._getframe(1)
            if "/zerotrain/" in frame.f_code.co_filename:
                reads.append((ends[0], f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"))
            return _inner(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)

    from zerotrain import cli
    from zerotrain.train import trainer

    step = trainer.Trainer._train_step

    def counted_step(self, *args, **kwargs):  # noqa: ANN001
        result = step(self, *args, **kwargs)
        ends[0] += 1
        return result

    trainer.Trainer._train_step = counted_step
    code = cli.main(argv)
    out.write_text(json.dumps({"reads": reads, "step_ends": ends[0]}))
    return code


if __name__ == "__main__":
    sys.exit(main())

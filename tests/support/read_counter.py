"""Launched by tests/multirank/test_loop_cost.py: `zerotrain train` in one process (cli.main, as `python -m
zerotrain train` runs it) with every read of a tensor's value by zerotrain's own code recorded, and each read told
apart by where its tensor would live on a GPU run.

    python tests/support/read_counter.py OUT.json train --max-steps 9 --log-every 9 ...

A read is Tensor.item / float() / int() / bool() / tolist() called from a module under zerotrain/. On a GPU a read
waits for the device (a host sync) when its tensor lives there. CPU ranks hold every tensor on the host, so this
process follows what would be on the device instead (DeviceTracker): every parameter, every batch the engine moves
(`Engine.to_device`, copied here so the loader's host batch stays apart as it does on a GPU), and every tensor an op
computes from one of those or writes in place with one (a torch dispatch mode sees every aten op, autograd's
backward ones and the collectives' included). Not seen: a tensor the code creates directly on the engine's device
from host numbers (`torch.tensor(..., device=...)`): on CPU that device is the host.

OUT.json: {"reads": [[step ends before the read, "file.py:function", on_device], ...], "step_ends": N}; a read
made between the end of step k and the end of step k+1 has k step ends before it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

READ_METHODS = ("item", "__float__", "__int__", "__bool__", "tolist")


class DeviceTracker(TorchDispatchMode):
    """Marks the tensors a GPU run would hold on the device: parameters, moved batches, and what ops derive from
    them (outputs, and the arguments an op writes into)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_device = WeakIdKeyDictionary()

    def mark(self, t: torch.Tensor) -> torch.Tensor:
        self.on_device[t] = True
        return t

    def holds(self, t: torch.Tensor) -> bool:
        return isinstance(t, torch.nn.Parameter) or t in self.on_device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(self.holds(t) for t in inputs):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark(t)
            for arg, value in zip(func._schema.arguments, args):  # in-place and out= writes
                if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                    self.mark(value)
            for name, value in kwargs.items():
                schema_arg = next((a for a in func._schema.arguments if a.name == name), None)
                if schema_arg is not None and schema_arg.alias_info is not None and schema_arg.alias_info.is_write \
                        and isinstance(value, torch.Tensor):
                    self.mark(value)
        return out


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    reads: list[tuple[int, str, bool]] = []
    ends = [0]
    tracker = DeviceTracker()

    for name in READ_METHODS:
        inner = getattr(torch.Tensor, name)

        def counted(self, *args, _inner=inner, **kwargs):  # noqa: ANN001
            frame = sys._getframe(1)
            if "/zerotrain/" in frame.f_code.co_filename:
                reads.append((ends[0], f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}",
                              tracker.holds(self)))
            return _inner(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)

    from zerotrain import cli
    from zerotrain.backends.base import Engine
    from zerotrain.train import trainer

    step = trainer.Trainer._train_step
    to_device = Engine.to_device

    def counted_step(self, *args, **kwargs):  # noqa: ANN001
        result = step(self, *args, **kwargs)
        ends[0] += 1
        return result

    def moved(self, batch):  # noqa: ANN001
        # a GPU run's copy: the loader's host tensors stay host tensors
        return {k: tracker.mark(v.clone()) if isinstance(v, torch.Tensor) else v
                for k, v in to_device(self, batch).items()}

    trainer.Trainer._train_step = counted_step
    Engine.to_device = moved
    with tracker:
        code = cli.main(argv)
    out.write_text(json.dumps({"reads": reads, "step_ends": ends[0]}))
    return code


if __name__ == "__main__":
    sys.exit(main())

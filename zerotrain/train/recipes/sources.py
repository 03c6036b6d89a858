"""The micro-batch sources of data read from disk: map-style (a shuffled loader per epoch, exact resume by (epoch,
position)) and a stream (--streaming: a position of its own, zerotrain/data/streaming.py). Online RL's generation
is its recipe's own (recipes/online_rl.py)."""
from __future__ import annotations

from typing import Any, Iterator, Optional

from ...data.datasets import train_loader
from ...errors import UserError
from .base import Batch, BatchSource, iterate


class MapSource(BatchSource):
    """A map-style data set: data order is a pure function of (seed, epoch); a resume skips the steps done."""

    def __init__(self, setup: Any, engine: Any):
        self.s, self.engine = setup, engine
        self.batches: Optional[Iterator[Batch]] = None
        """This epoch's micro-batches (None: the next fetch starts a loader)."""

    def check_resume(self, state: dict[str, Any]) -> None:
        if "stream" in state:  # a stream position is no (epoch, step) and back
            raise _other_loader(True)

    def new_epoch(self) -> None:
        self.batches = None

    def next_step(self, epoch: int, position: int) -> list[Batch]:
        plan = self.s.plan
        if self.batches is None:
            self.batches = iter(train_loader(self.s.data, self.engine.dp_rank, plan.world.dp, plan.batch.micro_batch,
                                             self.s.cfg.run.seed, epoch,
                                             skip_micro_batches=position * plan.batch.grad_accum,
                                             global_batch=plan.batch.global_batch,
                                             workers=self.s.cfg.data.loader_workers))
        return iterate(self.batches, plan.batch.grad_accum)


class StreamSource(BatchSource):
    """--streaming: this rank's micro-batches and stream position (StreamLoader); the epoch follows the stream's."""

    def __init__(self, setup: Any, engine: Any):
        self.s, self.engine = setup, engine
        self.stream: Any = None
        self.done: Any = None
        """The stream's position after the last step trained (what a checkpoint records: the loop fetches the next
        step's batches before the step boundary)."""
        self.next: Any = None
        """The position after the batches fetched for the next step."""

    def start(self, state: dict[str, Any], epoch: int) -> int:
        from ...data.streaming import StreamLoader

        plan = self.s.plan
        self.stream = StreamLoader(self.s.data.train, self.engine.dp_rank, plan.world.dp, plan.batch.micro_batch,
                                   self.s.data.collate, state.get("stream"), workers=self.s.cfg.data.loader_workers,
                                   global_batch=plan.batch.global_batch)
        self.done = self.stream.position()
        return self.stream.epoch

    def check_resume(self, state: dict[str, Any]) -> None:
        if "stream" not in state:
            raise _other_loader(False)

    def next_step(self, epoch: int, position: int) -> list[Batch]:
        micro = iterate(self.stream, self.s.plan.batch.grad_accum)  # crosses its epochs by itself
        self.next = self.stream.position()  # where the stream stands once this step has trained
        return micro

    def begin_step(self, epoch: int) -> int:
        self.done = self.next
        return self.done[0]

    def checkpoint_state(self) -> dict[str, Any]:
        return {"stream": self.stream.checkpoint_state(self.done)}  # collective


def _other_loader(streamed: bool) -> UserError:
    return UserError(f"--resume: the checkpoint was trained {'with' if streamed else 'without'} --streaming; resume "
                     f"{'with' if streamed else 'without'} it (its data position means nothing to the other loader)")


def data_source(setup: Any, engine: Any) -> BatchSource:
    """The source of a kind that reads its data from disk: a stream under --streaming, else map-style."""
    return StreamSource(setup, engine) if setup.cfg.data.streaming else MapSource(setup, engine)

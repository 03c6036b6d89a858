"""--streaming: causal-LM text and SFT samples read as a stream, split by rank, tokenized and packed on the fly,
resumed exactly.

    data = prepare_stream(cfg, tokenizer)                 # preflight: reads the first row only (format, columns)
    loader = StreamLoader(data.train, dp_rank, dp, micro_batch, data.collate, state=checkpoint.get("stream"))
    batch = next(loader)                                   # a micro-batch; epochs follow each other by themselves
    state = loader.checkpoint_state()                      # collective: every rank's position, for client_state

The rows come from `datasets.load_dataset(..., streaming=True)` (local .json/.jsonl/.csv/.txt/.parquet files, globs of
shards, or a hub id), shuffled with `IterableDataset.shuffle(seed, buffer_size)` when --shuffle-buffer > 0 (reseeded
each epoch by `set_epoch`), then split by `datasets.distributed.split_dataset_by_node`: whole shards per rank when the
number of shards is a multiple of the data-parallel size, otherwise every rank reads every row and keeps one in dp.
A row becomes tokens through the map-style path's own functions (text.document_ids / truncated_ids, sft.encode,
sft.pack), so an unshuffled stream on one rank gives the map-style blocks in their order (SFT packing: one row is
not cut at every 1000 samples, as the map-style batches are).

Exact resume: a rank's position is (epoch, row, offset): the rows of its share of that epoch's stream before the
first token still waiting to be packed, and how many tokens of that row were packed already. Neither datasets'
IterableDataset.state_dict() (its docs: "examples from shuffle buffers are lost when resuming") nor torchdata's
StatefulDataLoader (which stores that state_dict) restores a shuffle buffer or the packer's carry, so a resume
re-reads the rank's stream from the epoch's start (the same seed gives the same shuffle buffer) and skips `row`
rows without tokenizing them: exact, at a cost that grows with the position (docs/training.md "Streaming").
An epoch ends on every rank when the stream of any rank cannot fill a micro-batch (one all-reduce per micro-batch
decides it, so no rank waits alone); the other ranks' leftover rows are dropped, as DistributedSampler's drop_last
drops a tail. Positions are per data-parallel rank: another world size is refused on resume.

A mixture of streams (--data a.jsonl,b.parquet --data-weights 0.7,0.3, MixedStream): each source is its own
StreamSource, shuffled and split by rank on its own; position i of the mixture draws from the source that
mixture.schedule_window names (the map-style schedule, global batch by global batch, rank r taking positions
r, r + dp, ...), so every global batch holds each source's share to within one row. A source whose share on a rank
runs out restarts there (its next epoch, reshuffled by seed + epoch): the mixture runs until --max-steps. Its
position is (rows mixed, each source's epoch and position) per rank, resumed by the same replay.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from ..config.schema import RunConfig
from ..errors import UserError, first_line
from ..util import hub_offline
from . import mixture as mix
from . import sft, text
from .reader import BUILDERS, PreparedData, is_local, load_raw, local_files, require_columns
from .text import document_ids, tokenize_text, truncated_ids

STREAM_FORMAT = 2
"""The layout of the stream position in a checkpoint's client_state (bump when it or a stream's order changes;
2: a one-shard stream is shuffled without shard interleaving)."""
TOKENIZE_CHUNK = 256
"""Rows tokenized together (a fast tokenizer batches them); at most this many rows are tokenized ahead."""


class Position(NamedTuple):
    """Where a rank's stream stands within an epoch."""

    row: int
    """Rows of this rank's share of the epoch's stream that are consumed (not read again)."""
    offset: int
    """Tokens of row `row` already packed into emitted blocks (plain-text packing; 0 otherwise)."""


@dataclass
class StreamSource:
    """What a streamed run reads (PreparedData.train of a --streaming run): the stream of each rank and epoch and how
    its rows become blocks. Holds no row: len() of it is refused."""

    spec: str
    """--data as given."""
    files: Optional[list[str]]
    """The local files (globs expanded); None: a hub dataset id."""
    data_config: Optional[str]
    split: str
    seed: int
    shuffle_buffer: int
    fmt: str
    """The sample format (sft.detect_format): text, chat or prompt-completion."""
    tokenizer: Any
    template: Optional[str]
    """The chat template of chat data; None otherwise."""
    cfg: Any
    """The run's DataConfig (seq_len, pack, packing, text_column, truncation, train_on_prompt)."""
    tokenized: int = 0
    """Rows tokenized so far in this process (the CI's start-up counter: it must not grow with the corpus)."""
    skipped: int = field(default=0)
    """Rows read and skipped untokenized so far (a resume's replay)."""

    def __len__(self) -> int:
        raise TypeError("a stream has no length (--streaming runs for --max-steps)")

    def __bool__(self) -> bool:
        return True  # a source, not an empty container (len() is refused)

    def raw(self):
        """The rows as an unsplit, unshuffled datasets.IterableDataset (nothing is read yet)."""
        import datasets

        datasets.disable_progress_bars()
        if self.files is not None:
            builder = BUILDERS[os.path.splitext(self.files[0])[1].lower()]
            return datasets.load_dataset(builder, data_files=self.files, split="train", streaming=True)
        return datasets.load_dataset(self.spec, self.data_config, split=self.split, streaming=True)

    def rows(self, rank: int, world: int, epoch: int):
        """This rank's share of the epoch's rows (a datasets.IterableDataset): shuffled by (seed, epoch) when
        shuffle_buffer > 0, then split by node (the same shuffled stream on every rank, so the shares are disjoint)."""
        from datasets.distributed import split_dataset_by_node

        ds = self.raw()
        if self.shuffle_buffer:
            # One shard: nothing to interleave, and datasets' shard interleaving of a parquet stream sleeps 5 s
            # whenever its iterator closes (apache/arrow#45214), at every restart of a mixture's source.
            one = {"max_buffer_input_shards": 1} if ds.num_shards == 1 else {}
            ds = ds.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer, **one)
        ds = split_dataset_by_node(ds, rank=rank, world_size=world)
        ds.set_epoch(epoch)
        return ds

    def blocks(self, rank: int, world: int, epoch: int, at: Position = Position(0, 0)
               ) -> Iterator[tuple[dict[str, list[int]], Position]]:
        """This rank's training rows of `epoch` from position `at` on, each with the position after it."""
        rows = iter(self.rows(rank, world, epoch))
        for _ in itertools.islice(rows, at.row):  # consumed before the checkpoint: read, never tokenized
            self.skipped += 1
        numbered = zip(itertools.count(at.row), rows)
        d = self.cfg
        if self.fmt == "text" and d.packing == "off":
            yield from (self._text_blocks(numbered, at) if d.pack else self._text_rows(numbered))
        else:
            yield from self._samples(numbered)

    def _chunks(self, numbered) -> Iterator[list[tuple[int, dict]]]:
        while True:
            chunk = list(itertools.islice(numbered, TOKENIZE_CHUNK))
            if not chunk:
                return
            self.tokenized += len(chunk)
            yield chunk

    def _texts(self, chunk: list[tuple[int, dict]], encode: Callable[[list], list[list[int]]]
               ) -> list[tuple[int, list[int]]]:
        """(row, token ids) of each row of the chunk; [] for a row without text."""
        col = self.cfg.text_column
        texts = [r.get(col) for _, r in chunk]
        if any(col not in r for _, r in chunk):
            raise UserError(f"--data {self.spec}: a row has no column '{col}'; pass --text-column NAME")
        kept = [j for j, t in enumerate(texts) if isinstance(t, str) and t]
        ids = dict(zip(kept, encode([texts[j] for j in kept])))
        return [(i, ids.get(j, [])) for j, (i, _) in enumerate(chunk)]

    def _text_blocks(self, numbered, at: Position):
        """Plain text packed as text.pack_blocks does: documents + EOS concatenated, cut into seq_len blocks."""
        seq = self.cfg.seq_len
        buf: list[int] = []
        held: list[list[int]] = []  # [row, its tokens, its tokens still in buf] for the rows buf holds
        for chunk in self._chunks(numbered):
            for row, ids in self._texts(chunk, lambda t: document_ids(self.tokenizer, t)):
                start = at.offset if row == at.row else 0
                if len(ids) > start:
                    buf.extend(ids[start:])
                    held.append([row, len(ids), len(ids) - start])
                while len(buf) >= seq:
                    block, buf = buf[:seq], buf[seq:]
                    need = seq
                    while need:
                        take = min(need, held[0][2])
                        held[0][2] -= take
                        need -= take
                        if held[0][2] == 0:
                            held.pop(0)
                    after = Position(held[0][0], held[0][1] - held[0][2]) if held else Position(row + 1, 0)
                    yield {"input_ids": block}, after

    def _text_rows(self, numbered):
        """Plain text unpacked: one row per document, cut at seq_len (text.truncated_ids)."""
        for chunk in self._chunks(numbered):
            for row, ids in self._texts(chunk, lambda t: truncated_ids(self.tokenizer, t, self.cfg.seq_len)):
                if ids:
                    yield {"input_ids": ids}, Position(row + 1, 0)

    def _samples(self, numbered):
        """Chat / prompt-completion / per-document samples (sft.encode), one per row or packed (sft.pack)."""
        d = self.cfg
        pending_ids: list[list[int]] = []
        pending_labels: list[list[int]] = []
        used, last = 0, 0
        for chunk in self._chunks(numbered):
            for row, r in chunk:
                last = row
                enc = sft.encode({k: [v] for k, v in r.items()}, self.fmt, self.tokenizer, self.template, d.seq_len,
                                 d.train_on_prompt, d.truncation, d.text_column, first_row=row)
                for ids, labels in zip(enc.input_ids, enc.labels):
                    if d.packing == "off":
                        yield {"input_ids": ids, "labels": labels}, Position(row + 1, 0)
                        continue
                    if pending_ids and used + len(ids) > d.seq_len:  # sft.pack's rule: the sample opens a new row
                        packed = sft.pack(pending_ids, pending_labels, d.seq_len)
                        yield {k: v[0] for k, v in packed.items()}, Position(row, 0)
                        pending_ids, pending_labels, used = [], [], 0
                    pending_ids.append(ids)
                    pending_labels.append(labels)
                    used += len(ids)
        if pending_ids:  # the epoch's last row, as the map-style batches keep theirs
            packed = sft.pack(pending_ids, pending_labels, d.seq_len)
            yield {k: v[0] for k, v in packed.items()}, Position(last + 1, 0)


class MixPosition(NamedTuple):
    """Where a rank's mixture of streams stands."""

    mixed: int
    """Rows this rank has taken from the mixture (its place in mixture.schedule_window's windows)."""
    epochs: tuple[int, ...]
    """Each source's epoch on this rank (a source restarts by itself when its share runs out)."""
    at: tuple[Position, ...]
    """Each source's position within that epoch."""


@dataclass
class MixedStream:
    """A streamed mixture (PreparedData.train of a --streaming --data-weights run): its sources and weights."""

    sources: list[StreamSource]
    """One StreamSource per --data source, in --data's order."""
    mixture: mix.Mixture
    """The names and weights (sizes None: streamed)."""
    spec: str
    """--data as given."""

    def __len__(self) -> int:
        raise TypeError("a stream has no length (--streaming runs for --max-steps)")

    def __bool__(self) -> bool:
        return True

    @property
    def seed(self) -> int:
        return self.sources[0].seed

    @property
    def shuffle_buffer(self) -> int:
        return self.sources[0].shuffle_buffer

    @property
    def cfg(self) -> Any:
        return self.sources[0].cfg

    @property
    def skipped(self) -> int:
        return sum(s.skipped for s in self.sources)

    @property
    def tokenized(self) -> int:
        return sum(s.tokenized for s in self.sources)

    def start(self) -> MixPosition:
        n = len(self.sources)
        return MixPosition(0, (0,) * n, (Position(0, 0),) * n)

    def blocks(self, rank: int, world: int, window: int, at: MixPosition
               ) -> Iterator[tuple[dict, MixPosition]]:
        """This rank's rows of the mixture from `at` on (each with mixture.SOURCE, its source's index), each with the
        position after it. window: the global batch (rows of one optimizer step over every rank). Ends only when a
        source's share on this rank yields no row in a whole epoch (the loader refuses that, agreed by every rank)."""
        per = window // world
        mixed, epochs, pos = at.mixed, list(at.epochs), list(at.at)
        its: list[Optional[Iterator]] = [None] * len(self.sources)
        fresh = [False] * len(self.sources)
        k, order = -1, None
        while True:
            w, i = divmod(mixed, per)
            if w != k:  # the map-style schedule's window w; this rank's positions are r, r + world, ...
                k, order = w, mix.schedule_window(self.mixture.weights, w, window, self.seed, 0)[rank::world]
            s = int(order[i])
            if its[s] is None:
                its[s] = self.sources[s].blocks(rank, world, epochs[s], pos[s])
                fresh[s] = pos[s] == Position(0, 0)
            got = next(its[s], None)
            if got is None:
                if fresh[s]:  # a whole epoch of this source gave this rank nothing
                    return
                epochs[s], pos[s], its[s] = epochs[s] + 1, Position(0, 0), None  # the source restarts on this rank
                continue
            row, after = got
            fresh[s] = False
            pos[s] = Position(*after)
            mixed += 1
            yield {**row, mix.SOURCE: s}, MixPosition(mixed, tuple(epochs), tuple(pos))


def host_agreement() -> Callable[[bool], bool]:
    """`agree(full)`: whether every rank filled its micro-batch, over a gloo group of its own (a CPU tensor of a host
    flag: on a GPU run the default NCCL group would read a device tensor, waiting for the step before every
    micro-batch). Build it on every rank at the same point (the group is created collectively); one process: itself."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1):
        return lambda full: full
    from ..distributed.mesh import side_group

    group = side_group("zerotrain_stream_epoch")

    def agree(full: bool) -> bool:
        flag = torch.tensor([0.0 if full else 1.0])
        tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=group)
        return float(flag[0]) == 0.0

    return agree


class _Ahead:
    """Iterates `blocks` in a thread, up to AHEAD rows ahead of the caller, in their order. A thread, not a torch
    DataLoader worker process: inside a worker datasets shifts the shuffle buffer's seed by the worker id, so a
    worker's stream would not be the one the position was counted on."""

    AHEAD = 64

    def __init__(self, blocks: Iterator):
        import queue
        import threading

        self._queue: Any = queue.Queue(self.AHEAD)
        self._stop = threading.Event()
        self._done = object()

        def run() -> None:
            try:
                for item in blocks:
                    while not self._stop.is_set():
                        try:
                            self._queue.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if self._stop.is_set():
                        return
                self._queue.put(self._done)
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread (a bad row's UserError)
                self._queue.put(e)

        self._thread = threading.Thread(target=run, daemon=True, name="zerotrain-stream")
        self._thread.start()
        self._finished = False

    def __iter__(self) -> "_Ahead":
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is self._done:
            self._finished = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        return item

    def close(self) -> None:
        self._stop.set()


class StreamLoader:
    """This rank's micro-batches of a StreamSource, epoch after epoch, from a checkpoint's position when given.

    `agree(full)` decides together whether every rank filled its micro-batch (default: host_agreement, an
    all-reduce of a host flag over every rank; tests pass their own). workers: 0 reads, tokenizes and packs between steps; 1 does it ahead of the step in
    a thread (_Ahead: the same rows in the same order, so resume stays exact; a fast tokenizer releases the GIL);
    more are refused (several workers would split the shards between them, which the position does not record)."""

    def __init__(self, source: "StreamSource | MixedStream", rank: int, world: int, micro_batch: int,
                 collate: Callable[[list[dict]], Any], state: Optional[dict] = None, workers: int = 0,
                 agree: Optional[Callable[[bool], bool]] = None, global_batch: int = 0):
        if workers not in (0, 1):
            raise UserError(f"--streaming with {workers} loader workers: a stream position is exact with 0 or 1 "
                            "worker (several would split the shards between them); pass 0 or 1")
        self.source, self.rank, self.world, self.micro_batch = source, rank, world, micro_batch
        self.collate, self.workers = collate, workers
        self.agree = agree if agree is not None else host_agreement()
        self.mixed = source if isinstance(source, MixedStream) else None
        """A mixture of streams (MixedStream): self.at is then a MixPosition, self.epoch its least source epoch."""
        self.window = global_batch or world * micro_batch
        """A mixture's schedule window: the global batch (micro-batch x grad-accum x data-parallel ranks)."""
        self.epoch, self.at = 0, self.mixed.start() if self.mixed else Position(0, 0)
        if state is not None:
            if self.mixed:
                self.at = resume_mixture(state, self.mixed, rank, world, self.window)
                self.epoch = min(self.at.epochs)
            else:
                self.epoch, self.at = resume_position(state, source, rank, world)
        self._open()

    def _open(self) -> None:
        if getattr(self, "_blocks", None) is not None and self.workers:
            self._blocks.close()
        if self.mixed:
            blocks = self.mixed.blocks(self.rank, self.world, self.window, self.at)
        else:
            blocks = self.source.blocks(self.rank, self.world, self.epoch, self.at)
        self._blocks = _Ahead(blocks) if self.workers else blocks
        self._fresh = self.at == Position(0, 0)

    def __iter__(self) -> "StreamLoader":
        return self

    def __next__(self) -> Any:
        while True:
            got = list(itertools.islice(self._blocks, self.micro_batch))
            if self.agree(len(got) == self.micro_batch):
                rows = [row for row, _ in got]
                self._fresh = False
                if self.mixed:  # each source's tokens and rows, as the map-style train_loader counts them
                    self.at = got[-1][1]
                    self.epoch = min(self.at.epochs)
                    return {**self.collate(rows), mix.SOURCE_COUNTS: mix.count_sources(rows, len(self.mixed.sources))}
                self.at = Position(*got[-1][1])
                return self.collate(rows)
            if self.mixed:  # its sources restart by themselves: only a source with no row on some rank ends it
                raise UserError(f"--data {self.source.spec}: a data-parallel rank's share of a mixture source "
                                f"yields no row in a whole epoch (a row holds {self.source.cfg.seq_len} tokens); pass more data "
                                "in every source or a smaller --seq-len")
            if self._fresh:  # the same on every rank (agreed), so every rank stops here
                raise UserError(f"--data {self.source.spec}: a data-parallel rank's share of the stream (epoch "
                                f"{self.epoch}) does not fill one micro-batch of {self.micro_batch} rows; pass more "
                                "data or a smaller --micro-batch / --seq-len")
            self.epoch, self.at = self.epoch + 1, Position(0, 0)  # some rank's stream ended: a new epoch everywhere
            self._open()

    def position(self) -> tuple[int, Any]:
        """(epoch, position) after the last micro-batch read (a mixture's: MixPosition)."""
        return self.epoch, self.at

    def checkpoint_state(self, position: Optional[tuple[int, Position]] = None) -> dict[str, Any]:
        """Every data-parallel rank's position (collective over every rank: call it on all of them), for the
        checkpoint's client_state. position: this rank's to record (`position()` taken earlier: the trainer reads
        the next step's batches before the step boundary), else the current one."""
        from ..distributed.collectives import reduce_max

        epoch, at = position if position is not None else (self.epoch, self.at)
        head = {"format": STREAM_FORMAT, "dp": self.world, "epoch": epoch, "seed": self.source.seed,
                "shuffle_buffer": self.source.shuffle_buffer, "data": self.source.spec,
                "seq_len": self.source.cfg.seq_len}
        if self.mixed:  # per rank: rows mixed, then each source's (epoch, row, offset)
            width = 1 + 3 * len(self.mixed.sources)
            mine = [float(at.mixed)] + [float(x) for e, p in zip(at.epochs, at.at) for x in (e, p.row, p.offset)]
            values = [0.0] * (width * self.world)
            values[width * self.rank:width * (self.rank + 1)] = mine
            g = [int(x) for x in reduce_max(*values)]  # ranks of one data-parallel rank (tp, pp, sp) hold the same
            ranks = [g[width * r:width * (r + 1)] for r in range(self.world)]
            return {**head, "weights": self.mixed.mixture.weights, "global_batch": self.window,
                    "mixed": [v[0] for v in ranks],
                    "sources": [{"name": name, "epochs": [v[1 + 3 * i] for v in ranks],
                                 "rows": [v[2 + 3 * i] for v in ranks], "offsets": [v[3 + 3 * i] for v in ranks]}
                                for i, name in enumerate(self.mixed.mixture.names)]}
        values = [0.0] * (2 * self.world)
        values[2 * self.rank:2 * self.rank + 2] = [float(at.row), float(at.offset)]
        gathered = reduce_max(*values)  # ranks of one data-parallel rank (tp, pp, sp) hold the same position
        return {**head, "rows": [int(x) for x in gathered[0::2]], "offsets": [int(x) for x in gathered[1::2]]}


def resume_position(state: dict, source: StreamSource, rank: int, world: int) -> tuple[int, Position]:
    """(epoch, position) of this rank from a checkpoint's stream state; one-line UserError when the run reads
    another stream (data-parallel size, seed, shuffle buffer, data or sequence length changed)."""
    _same_stream(state, source, world)
    if "sources" in state:
        raise UserError(f"--data-weights: the checkpoint streamed a mixture of {state['data']} with weights "
                        f"{_weights(state['weights'])}, this run streams one dataset; resume with --data-weights "
                        f"{_weights(state['weights'])}")
    return int(state["epoch"]), Position(int(state["rows"][rank]), int(state["offsets"][rank]))


def _weights(weights: list[float]) -> str:
    return ",".join(f"{w:.6g}" for w in weights)


def resume_mixture(state: dict, source: MixedStream, rank: int, world: int, window: int) -> MixPosition:
    """This rank's MixPosition from a checkpoint's stream state; one-line UserError when the run mixes otherwise
    (another stream as resume_position refuses, other weights, another global batch, or no mixture)."""
    _same_stream(state, source, world)
    now = _weights(source.mixture.weights)
    if "sources" not in state:
        raise UserError(f"--data-weights {now}: the checkpoint streamed {state['data']} as one dataset, not a mixture; "
                        "resume without --data-weights")
    if _weights(state["weights"]) != now:
        was = _weights(state["weights"])
        raise UserError(f"--data-weights: the checkpoint streamed the mixture with weights {was}, this run has {now}; "
                        f"resume with --data-weights {was}")
    if state["global_batch"] != window:
        raise UserError(f"--resume: the checkpoint mixed its streams by global batches of {state['global_batch']} "
                        f"rows, this run has {window}; pass --global-batch {state['global_batch']}")
    src = state["sources"]
    return MixPosition(int(state["mixed"][rank]), tuple(int(s["epochs"][rank]) for s in src),
                       tuple(Position(int(s["rows"][rank]), int(s["offsets"][rank])) for s in src))


def _same_stream(state: dict, source: "StreamSource | MixedStream", world: int) -> None:
    """Refuse in one line a checkpoint's stream state that means other rows for this run."""
    if state.get("format") != STREAM_FORMAT:
        raise UserError(f"--resume: the checkpoint's stream position has format {state.get('format')}, this zerotrain "
                        f"reads {STREAM_FORMAT}; resume with the zerotrain that wrote it")
    if state["dp"] != world:
        raise UserError(f"--resume with --streaming on {world} data-parallel ranks: the checkpoint's stream positions "
                        f"are per rank of {state['dp']} (another split reads other rows); resume on {state['dp']} "
                        "data-parallel ranks")
    for key, now, flag in (("data", source.spec, "--data"), ("shuffle_buffer", source.shuffle_buffer,
                                                               "--shuffle-buffer"),
                           ("seq_len", source.cfg.seq_len, "--seq-len"), ("seed", source.seed, "--seed")):
        if state.get(key) != now:
            raise UserError(f"--resume: the checkpoint streamed with {flag} {state.get(key)}, this run has {flag} "
                            f"{now}; the position means other rows then: resume with {flag} {state.get(key)}")


def prepare_stream(cfg: RunConfig, tokenizer: Any) -> PreparedData:
    """A --streaming run's data: the StreamSource (its format read from the first row only) and the --eval-data
    set, read whole (map-style, zerotrain/data/datasets.py): evaluation needs the same rows every time."""
    from ..assets.demo import CORPUS

    from .prepared import is_prepared

    d = cfg.data  # config/rules.py check_streaming refused the tasks that do not stream
    spec = d.path or str(CORPUS)
    if is_prepared(d.path):
        raise UserError(f"--data {spec} with --streaming: that directory was written by `zerotrain data prepare` "
                        "(tokenized shards, memory-mapped: nothing is tokenized before step 1 either); drop --streaming")
    weights = mix.parse_weights(spec, d.data_weights)
    train: "StreamSource | MixedStream"
    if weights is None:
        train = source = _stream_source(spec, cfg, tokenizer)
    else:  # each source streamed, shuffled and split by rank on its own
        parts = [_stream_source(s, cfg, tokenizer) for s in mix.split_sources(spec)]
        kinds = {p.spec: "plain text" if p.fmt == "text" else "samples" for p in parts}
        if len(set(kinds.values())) > 1:
            said = "; ".join(f"{k}: {v}" for k, v in kinds.items())
            raise UserError(f"--data {spec}: the sources of a mixture must be one kind of data ({said}); mix text with "
                            "text and chat with chat")
        source = parts[0]
        train = MixedStream(parts, mix.Mixture(mix.source_names([p.spec for p in parts]), None, weights), spec)
    fmt, files = source.fmt, source.files
    evals = None
    if d.eval_path:
        raw_eval = load_raw(d.eval_path, "--eval-data", d.data_config, d.split)
        if fmt == "text":
            require_columns(raw_eval, "--eval-data", d.eval_path, [("--text-column", d.text_column)])
        sft.detect_format(raw_eval.column_names, d.text_column, fmt, d.eval_path)
        if fmt != "text" or d.packing != "off":
            evals = sft.tokenize_samples(raw_eval, tokenizer, fmt, source.template, cfg)[0]
        else:
            evals = tokenize_text(raw_eval, tokenizer, cfg.model.task, d.text_column, d.seq_len, d.pack)
        if len(evals) == 0:
            raise UserError("--eval-data: the evaluation set is empty after tokenizing; pass more eval data")
    shuffled = f"shuffle buffer {d.shuffle_buffer}" if d.shuffle_buffer else "in file order"
    if isinstance(train, MixedStream):
        what = f"{train.mixture.line()} [" + " | ".join(
            f"{p.spec} ({p.fmt}, {len(p.files) if p.files else 'hub'} shard(s))" for p in train.sources) + \
            f"], streamed {shuffled}"
    else:
        what = f"{spec} ({fmt}, streamed {shuffled}, {len(files) if files else 'hub'} shard(s))"
    desc = (f"{what}: rows of <= {d.seq_len} tokens, tokenized as they are read" +
            (f" / {len(evals)} eval" if evals is not None else ""))
    return PreparedData(train, evals, None, None, tokenizer.pad_token_id, desc, reader=text.READER,
                        mixture=train.mixture if isinstance(train, MixedStream) else None)


def _stream_source(spec: str, cfg: RunConfig, tokenizer: Any) -> StreamSource:
    """One source of --data as a StreamSource, its format read from its first row only."""
    d = cfg.data
    files = local_files(spec) if is_local(spec) else None
    source = StreamSource(spec, files, d.data_config, d.split, cfg.run.seed, d.shuffle_buffer, "text", tokenizer,
                          None, d)
    try:
        first = next(iter(source.raw()), None)
    except Exception as e:  # noqa: BLE001 - any load or parse failure is about --data
        why = ("offline and not in the local cache" if files is None and hub_offline("HF_DATASETS_OFFLINE")
               else first_line(e))
        raise UserError(f"--data {spec}: cannot stream it ({why}); pass local files or a reachable hub dataset id"
                        ) from None
    if first is None:
        raise UserError(f"--data {spec}: the dataset is empty; pass data with rows")
    fmt = sft.detect_format(list(first), d.text_column, d.format, spec)
    if fmt == "text" and d.text_column not in first:
        raise UserError(f"--data {spec}: no column '{d.text_column}' (columns: {', '.join(first)}); "
                        "pass --text-column NAME")
    source.fmt = fmt
    source.template = sft.chat_template(tokenizer, d.chat_template) if fmt == "chat" else None
    return source

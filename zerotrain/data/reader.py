"""A data format's reader, and the steps every reader shares.

One reader per data format (tasks.py TaskSpec.data_format): a DataReader holds the steps that turn a run's --data
into tokenized sets and its rows into micro-batches. Each reader is defined beside its format's module (text.py,
preference.py, unpaired.py, prompts.py, vision.py) and listed in zerotrain/data/datasets.py READERS, where
prepare_data looks it up by the task's format (or takes the one a recipe chose): a new format is one reader and one
entry there.

The shared steps: raw rows from local files or a hub id (load_raw), their columns checked and the eval rows loaded or
held out (with_eval), and the keys of datasets' cache (fingerprint_of, tokenizer_hash) with the count of rows
tokenized (ROWS_TOKENIZED).
"""
from __future__ import annotations

import glob
import hashlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..config.schema import RunConfig
from ..errors import UserError, first_line
from ..tasks import TaskSpec
from ..util import hub_offline
from . import mixture as mix

BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text", ".parquet": "parquet"}
"""A local file's extension -> the datasets builder that reads it."""
_FORMAT_VERSION = "2"  # bump when tokenization changes, so old caches are not reused


def is_local(spec: str) -> bool:
    first = spec.split(",")[0].strip()
    return (os.path.splitext(first)[1].lower() in BUILDERS or os.path.isabs(first) or first.startswith((".", "~"))
            or os.path.exists(first))


def load_raw(spec: str, flag: str, data_config: Optional[str] = None, split: str = "train"):
    """A `datasets.Dataset` from local files (comma-separated, one format) or a hub dataset id."""
    import datasets

    if MAP_PROCS["num_proc"] is None:  # training ranks print no bars; `zerotrain data prepare` shows datasets' own
        datasets.disable_progress_bars()
    if is_local(spec):
        files = [str(Path(f.strip()).expanduser()) for f in spec.split(",") if f.strip()]
        for f in files:
            if not os.path.isfile(f):
                raise UserError(f"{flag} {f}: no such file; pass an existing .json/.jsonl/.csv/.txt/.parquet file")
            if not os.access(f, os.R_OK):
                raise UserError(f"{flag} {f}: file is not readable (permissions)")
        exts = {os.path.splitext(f)[1].lower() for f in files}
        if len(exts) != 1 or next(iter(exts)) not in BUILDERS:
            raise UserError(f"{flag} {spec}: expected files of one type among {', '.join(BUILDERS)} (got {sorted(exts)})")
        builder = BUILDERS[exts.pop()]
        if all(os.path.getsize(f) == 0 for f in files):
            raise UserError(f"{flag} {spec}: the dataset is empty; pass a file with rows")
        try:
            return datasets.load_dataset(builder, data_files=files, split="train")
        except Exception as e:  # noqa: BLE001 - any parse failure is a user error about this file
            raise UserError(f"{flag} {spec}: cannot read it as {builder} ({first_line(e)})") from None
    try:
        return datasets.load_dataset(spec, data_config, split=split)
    except Exception as e:  # noqa: BLE001
        why = "offline and not in the local cache" if hub_offline("HF_DATASETS_OFFLINE") else first_line(e)
        raise UserError(f"{flag} {spec}: cannot load dataset ({why}); pass a local file or a reachable "
                        f"hub dataset id (--data-config, --split)") from None


def local_files(spec: str, flag: str = "--data") -> list[str]:
    """The local files of --data: comma-separated paths or globs (shards/*.jsonl), sorted per glob, one type
    (a stream's: zerotrain/data/streaming.py)."""
    files: list[str] = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        path = str(Path(part).expanduser())
        found = sorted(glob.glob(path)) if glob.has_magic(path) else [path]
        if not found:
            raise UserError(f"{flag} {part}: no file matches; pass existing files or a glob of shards")
        for f in found:
            if not os.path.isfile(f):
                raise UserError(f"{flag} {f}: no such file; pass an existing .json/.jsonl/.csv/.txt/.parquet file")
        files += found
    exts = {os.path.splitext(f)[1].lower() for f in files}
    if len(exts) != 1 or next(iter(exts)) not in BUILDERS:
        raise UserError(f"{flag} {spec}: expected files of one type among {', '.join(BUILDERS)} (got {sorted(exts)})")
    return files


def require_columns(ds, flag: str, spec: str, columns: Sequence[tuple[str, str]]) -> None:
    """Refuse an empty set, or one without a column the run names: (the option naming it, the column)."""
    if len(ds) == 0:
        raise UserError(f"{flag} {spec}: the dataset is empty; pass data with rows")
    for option, col in columns:
        if col not in ds.column_names:
            raise UserError(f"{flag} {spec}: no column '{col}' (columns: {', '.join(ds.column_names)}); "
                            f"pass {option} NAME")


def check_sets(check: Callable[[Any, str], Any], raw: Any, raw_eval: Optional[Any]) -> None:
    """check(rows, flag) of the train rows (--data) and of the eval rows where there are some (--eval-data)."""
    check(raw, "--data")
    if raw_eval is not None:
        check(raw_eval, "--eval-data")


def tokenizer_hash(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else f"{tokenizer.name_or_path}:{len(tokenizer)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def fingerprint_of(ds, *parts: Any) -> str:
    """The datasets cache fingerprint of `ds` tokenized by the settings `parts`."""
    h = hashlib.sha256(str((_FORMAT_VERSION, ds._fingerprint, *parts)).encode())
    return h.hexdigest()[:16]


ROWS_TOKENIZED = {"rows": 0}
"""Rows this process has put through the tokenizer (a hit of datasets' cache, or a directory of `zerotrain data
prepare`, puts none): prepare_data reports the rows of its own call (PreparedData.rows_tokenized, the banner)."""
MAP_PROCS: dict[str, Optional[int]] = {"num_proc": None}
"""Processes of the tokenizing maps (`zerotrain data prepare` takes every core; training ranks one each). Only maps
whose rows are tokenized one by one take it: packing's batches must not depend on how the rows were split."""


def counted(fn: Callable[..., dict]) -> Callable[..., dict]:
    """fn (a batched map function) that adds its batch's rows to ROWS_TOKENIZED (in this process)."""
    def counted(batch, *args):
        ROWS_TOKENIZED["rows"] += len(next(iter(batch.values())))
        return fn(batch, *args)
    return counted


TEXT_PACKING = 2
"""How plain text is packed into seq_len blocks (recorded in every checkpoint, so a resumed run keeps its data):
2 = the whole dataset's token stream cut into blocks (text.pack_blocks); 1 = each batch of 1000 texts packed on its
own, its remainder dropped (zerotrain before 2026-11-26: with long blocks that lost most of the data), kept only
to resume the runs that started with it."""


@dataclass(frozen=True)
class ReadRequest:
    """What a reader reads with."""

    cfg: RunConfig
    """The run's settings (data.*, pref.*, model.*)."""
    task: TaskSpec
    """The run's task as the model resolved it (RunPlan.task)."""
    tokenizer: Any
    """The model's tokenizer."""
    text_packing: int = TEXT_PACKING
    """The TEXT_PACKING version plain text is packed with (a resumed run's own, from its checkpoint)."""
    processor: Any = None
    """An image-text model's processor (zerotrain/data/vision.py); None for the others."""


def with_eval(req: ReadRequest, spec: str, eval_path: Optional[str], columns: Sequence[tuple[str, str]] = (),
              check_eval: Optional[Callable[[Any], Any]] = None, raw: Any = None) -> tuple[Any, Optional[Any]]:
    """(train rows, eval rows or None) of one source: the rows of `spec` (raw: loaded already) and eval_path's rows,
    their columns checked (check_eval: the format's own check of the eval rows), or --eval-split's share of the
    rows held out by the seed."""
    d = req.cfg.data
    if raw is None:
        raw = load_raw(spec, "--data", d.data_config, d.split)
    require_columns(raw, "--data", spec, columns)
    if eval_path:
        raw_eval = load_raw(eval_path, "--eval-data", d.data_config, d.split)
        require_columns(raw_eval, "--eval-data", eval_path, columns)
        if check_eval is not None:
            check_eval(raw_eval)
        return raw, raw_eval
    if d.eval_split > 0:
        n_eval = math.ceil(len(raw) * d.eval_split)
        if n_eval >= len(raw):
            raise UserError(f"--eval-split {d.eval_split}: leaves no training rows out of {len(raw)}; use a smaller fraction")
        parts = raw.train_test_split(test_size=n_eval, seed=req.cfg.run.seed, shuffle=True)
        return parts["train"], parts["test"]
    return raw, None


def _refuses_nothing(cfg: RunConfig) -> None:
    """A format with no setting of its own to refuse."""


def _same_rows(rows: Any, *_: int) -> Any:
    return rows


@dataclass(frozen=True)
class DataReader:
    """How one data format is read and batched: its steps, in the order prepare_data runs them."""

    data_format: str
    """The format it reads (tasks.py TaskSpec.data_format: TEXT, LABELLED_TEXT, ...): its key in datasets.READERS."""
    read: Callable[[ReadRequest, str, Optional[str]], "PreparedData"]
    """One source's sets: (request, the --data source, --eval-data or None) -> the tokenized train (and eval) rows;
    a bad row or setting refused in one line."""
    collate: Callable[[list[dict], "PreparedData"], dict[str, Any]]
    """A micro-batch of rows (PreparedData.collate), padded with the data's pad id."""
    demo: Optional[Path] = None
    """The embedded set read without --data; None: a run without --data is refused (missing)."""
    missing: str = ""
    """A format without a demo set: the one-line refusal of a run without --data ("{task}": the task's name)."""
    check: Callable[[RunConfig], None] = _refuses_nothing
    """Refuses in one line, before anything is read, the settings the format does not support."""
    mixes: bool = False
    """Whether --data-weights mixes several sources of it (each read on its own: zerotrain/data/mixture.py)."""
    counts_rows: bool = False
    """Whether the banner says how many rows a training run tokenized before step 1."""
    train_rows: Callable[..., Any] = _same_rows
    """The rows a training loader reads, from (rows, world, seed, epoch, global batch): KTO's carry their KL partners
    from the global batch (zerotrain/data/unpaired.py); the rows themselves for the others."""
    eval_rows: Callable[[Any], Any] = _same_rows
    """The rows an evaluation loader reads, from the set's rows (KTO's: each with its KL partner)."""


@dataclass
class PreparedData:
    """Tokenized train (and eval) sets plus what the model needs to know about labels."""

    train: Any
    """datasets.Dataset with input_ids (and labels for seq-cls)."""
    eval: Optional[Any]
    """Same, for evaluation; None when there is no eval data."""
    num_labels: Optional[int]
    """seq-cls: number of classes."""
    id2label: Optional[dict[int, str]]
    """seq-cls with string labels: class index -> name."""
    pad_id: int
    """Token id used to pad (masked out)."""
    description: str
    """One line for logs."""
    text_packing: int = TEXT_PACKING
    """How plain text was packed (TEXT_PACKING's versions); checkpoints record it, a resume asks for it again."""
    pair_len: int = 0
    """Preference tasks, reward models and KTO: the rows are chosen/rejected pairs or single completions (and their
    KL rows), each sequence cut at this many tokens (zerotrain/data/preference.py, unpaired.py); 0 for the others."""
    reader: DataReader = field(kw_only=True)
    """The reader of the task's data format that made the sets: its collator and loader rows."""
    chat_template: Optional[str] = None
    """The chat template the rows were rendered with (chat data), which a prepared directory's manifest records."""
    mixture: Optional[mix.Mixture] = None
    """--data-weights: train holds the sources one after another; train_loader mixes them (zerotrain/data/mixture.py)."""
    rows_tokenized: int = 0
    """Rows this process tokenized to make the sets (0 from datasets' cache or a prepared directory)."""
    processor: Any = None
    """Chats with images (IMAGE_CHAT): the model's processor, whose image side the collator runs on the decoded
    images (zerotrain/data/vision.py)."""

    @property
    def data_format(self) -> str:
        """The task's data format (zerotrain/tasks.py TaskSpec.data_format)."""
        return self.reader.data_format

    @property
    def epoch_rows(self) -> int:
        """Training rows in one epoch (a mixture's: until every source has been seen whole)."""
        return mix.epoch_length(self.mixture.sizes, self.mixture.weights) if self.mixture else len(self.train)

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return self.reader.collate(rows, self)

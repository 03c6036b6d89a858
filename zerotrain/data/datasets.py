"""Data: `datasets` -> validated -> tokenized (packed for causal LM) -> DistributedSampler loaders.

`prepare_data` runs on every rank before the process group exists, so a bad --data fails every rank
the same way. It looks up the reader of the task's data format (READERS: one per format, each beside its format's
module, zerotrain/data/reader.py) and runs its steps: refuse what the format cannot read, read each source (a
`zerotrain data prepare` directory is read as it is), mix the sources (--data-weights). Tokenizing happens once per
machine: the first rank to take a file lock tokenizes and writes the `datasets` cache (under an explicit
fingerprint); the others then load that cache.
Data order is a pure function of (--seed, epoch), and a loader can start mid-epoch (resume).
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from ..config.schema import RunConfig
from ..errors import UserError
from ..tasks import TaskSpec, task_spec
from . import mixture as mix
from . import prepared, preference, prompts, sft, text, unpaired, vision
from .reader import (MAP_PROCS, ROWS_TOKENIZED, TEXT_PACKING, DataReader, PreparedData, ReadRequest, load_raw,
                     tokenizer_hash)
from .text import label_names, real_tokens

__all__ = ["READERS", "TEXT_PACKING", "PreparedData", "eval_loader", "label_names", "load_raw", "prepare_data",
           "reader_for", "real_tokens", "train_loader"]
"""Callers outside data/ import these from here (label_names, load_raw: zerotrain/model/source.py; real_tokens:
the trainer), wherever they are defined."""

READERS: dict[str, DataReader] = {r.data_format: r for r in (text.READER, text.LABELLED_READER, preference.READER,
                                                               unpaired.READER, prompts.READER, vision.READER)}
"""A data format (tasks.TaskSpec.data_format) -> its reader. A new format: its reader beside its module, and here."""


def reader_for(data_format: str) -> DataReader:
    """The reader of a data format (what a training recipe chooses; prepare_data's default: the task's format)."""
    if data_format not in READERS:
        raise ValueError(f"no reader reads data format {data_format!r} (readers: {', '.join(READERS)})")
    return READERS[data_format]


def _locked(fn: Callable[[], Any], key: str) -> Any:
    """Run fn under a machine-wide lock: the first rank computes and caches, the others hit the cache."""
    from filelock import FileLock

    from ..assets.demo import cache_root

    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f"{key}.lock")):
        return fn()


def prepare_data(cfg: RunConfig, tokenizer, text_packing: int = TEXT_PACKING, processor: Any = None,
                 task: Optional[TaskSpec] = None, reader: Optional[DataReader] = None) -> PreparedData:
    """Load, validate, split and tokenize. Raises UserError with one line on bad input. text_packing: the
    TEXT_PACKING version to pack plain text with (a resumed run's own, from its checkpoint). processor: an
    image-text model's (its task's data format is IMAGE_CHAT: zerotrain/data/vision.py). task: the run's task as the
    model resolved it (RunPlan.task; None: model.task's). reader: the data format's reader (default: the task's,
    reader_for)."""
    spec_of_task = task or task_spec(cfg.model.task)
    d, task = cfg.data, spec_of_task.name
    reader = reader or reader_for(spec_of_task.data_format)
    if not d.path and reader.demo is None:
        raise UserError(reader.missing.format(task=task))
    reader.check(cfg)  # before anything is read
    spec = d.path or str(reader.demo)
    key = hashlib.sha256(str((spec, d.data_config, d.split)).encode()).hexdigest()[:16]
    if prepared.is_prepared(d.path):
        return _from_prepared(cfg, tokenizer, text_packing)
    sources = mix.split_sources(spec)
    weights = mix.parse_weights(spec, d.data_weights)
    if weights is not None and not reader.mixes:
        raise UserError(f"--data-weights: mixtures are built for causal-lm data (text, chat, prompt-completion); "
                        f"--task {task} reads one dataset (a comma list is concatenated); drop --data-weights")
    req = ReadRequest(cfg, spec_of_task, tokenizer, text_packing, processor)

    def build() -> PreparedData:
        before = ROWS_TOKENIZED["rows"]
        if weights is None:
            data = reader.read(req, spec, d.eval_path)
        else:  # each source tokenized (and packed) on its own: a row belongs to one source
            data = _mixed([reader.read(req, s, d.eval_path if i == 0 else None) for i, s in enumerate(sources)],
                          sources, weights)
        data.rows_tokenized = ROWS_TOKENIZED["rows"] - before
        if reader.counts_rows and MAP_PROCS["num_proc"] is None:  # a training run (prepare's maps count elsewhere)
            data.description += f"; {data.rows_tokenized} rows tokenized before step 1"
        return data

    return _locked(build, f"data-{key}-{text_packing}")


def _mixed(parts: list[PreparedData], sources: list[str], weights: list[float]) -> PreparedData:
    """The sources' sets one after another, with the Mixture that train_loader draws them by."""
    import datasets

    columns = {s: sorted(p.train.column_names) for s, p in zip(sources, parts)}
    if len({tuple(c) for c in columns.values()}) > 1:
        raise UserError(f"--data {','.join(sources)}: the sources of a mixture must be one kind of data (tokenized "
                        f"columns {'; '.join(f'{s}: {c}' for s, c in columns.items())}); mix text with text and chat "
                        "with chat")
    evals = [p.eval for p in parts if p.eval is not None]
    m = mix.Mixture(mix.source_names(sources), [len(p.train) for p in parts], weights)
    desc = f"{m.line()} [" + " | ".join(p.description for p in parts) + "]"
    return PreparedData(datasets.concatenate_datasets([p.train for p in parts]),
                        datasets.concatenate_datasets(evals) if evals else None, None, None, parts[0].pad_id, desc,
                        parts[0].text_packing, chat_template=parts[0].chat_template, mixture=m,
                        reader=parts[0].reader)


def data_settings(cfg: RunConfig, tokenizer: Any, text_packing: int, chat_template: Optional[str]) -> dict[str, Any]:
    """What makes a prepared directory's rows (zerotrain/data/prepared.py): the manifest records it, a run that
    reads the directory must have the same. chat_template: the template the chat rows were rendered with."""
    d = cfg.data
    out = {"tokenizer": tokenizer_hash(tokenizer), "task": cfg.model.task, "seq_len": d.seq_len, "pack": d.pack,
           "packing": d.packing, "format": d.format, "text_column": d.text_column,
           "train_on_prompt": d.train_on_prompt, "truncation": d.truncation, "eval_split": d.eval_split,
           "text_packing": text_packing}
    if chat_template is not None:
        out["chat_template"] = hashlib.sha256(chat_template.encode()).hexdigest()[:16]
    if d.eval_split > 0:  # the held-out rows follow the seed
        out["seed"] = cfg.run.seed
    return out


def setting_flags() -> dict[str, str]:
    """data_settings' keys -> the flag a user sets them by (the refusals name it)."""
    from ..config.flags import run_flags

    by_key = {f.dotted.rsplit(".", 1)[-1]: f.flag for f in run_flags() if f.dotted.startswith(("data.", "run.seed"))}
    return {**by_key, "task": "--task", "text_packing": "the checkpoint's text packing (TEXT_PACKING)"}


def _from_prepared(cfg: RunConfig, tokenizer: Any, text_packing: int) -> PreparedData:
    """A directory of `zerotrain data prepare`, checked against this run's tokenizer and settings; nothing is
    tokenized."""
    d, path = cfg.data, cfg.data.path
    manifest = prepared.read(path)
    template = None
    if "chat_template" in manifest["settings"]:
        template = sft.chat_template(tokenizer, d.chat_template)
    prepared.check(manifest, data_settings(cfg, tokenizer, text_packing, template), setting_flags(), path)
    if d.eval_path:
        raise UserError(f"--eval-data with a prepared --data {path}: pass --eval-data to `zerotrain data prepare` "
                        "instead (its eval set is prepared with the training set)")
    train, evals = prepared.load(path)
    sources, weights = manifest["sources"], manifest["weights"]
    if d.data_weights is not None:  # the same rows, weighted anew: nothing to tokenize
        if len(sources) < 2:  # prepared as one dataset (a comma list concatenated): no sources to weigh
            raise UserError(f"--data-weights {d.data_weights}: --data {d.path} was prepared as one dataset (its files "
                            "concatenated); prepare it again with --data-weights to keep its sources apart")
        weights = mix.parse_weights(",".join(s["path"] for s in sources), d.data_weights)
    mixture = mix.Mixture([s["name"] for s in sources], [s["rows"] for s in sources], weights) if weights else None
    desc = f"{path} (prepared: {manifest['description']})" + (
        f"; weighted anew: {mixture.line()}" if mixture and d.data_weights is not None else "") + \
        "; 0 rows tokenized before step 1"
    return PreparedData(train, evals, None, None, tokenizer.pad_token_id, desc, manifest["settings"]["text_packing"],
                        chat_template=template, mixture=mixture, reader=text.READER)


# ------------------------------------------------------------------------------------------------
# loaders

class ResumableSampler(DistributedSampler):
    """DistributedSampler (shuffled by seed + epoch, equal share per rank) that can skip a prefix."""

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.skip = 0
        """Samples of this rank's share to skip at the start of the current epoch (resume)."""

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def steps_per_epoch(n_samples: int, world: int, micro_batch: int, grad_accum: int) -> int:
    """Optimizer steps in one pass (each rank sees n // world samples; partial accumulations are dropped)."""
    return (n_samples // world) // micro_batch // grad_accum


def train_loader(data: PreparedData, rank: int, world: int, micro_batch: int, seed: int,
                 epoch: int, skip_micro_batches: int = 0, global_batch: int = 0, workers: int = 0) -> DataLoader:
    """This rank's micro-batches for `epoch`, starting after `skip_micro_batches` (deterministic). global_batch:
    the rows of one optimizer step over every rank (KTO's rows carry KL partners from their global batch,
    zerotrain/data/unpaired.py). workers: loader processes reading ahead (data.loader_workers; the same batches
    in the same order)."""
    rows, collate = data.train, data.collate
    if data.mixture is not None:  # the mixture's own order (seeded, global batch by global batch): not shuffled again
        rows = data.mixture.rows(data.train, seed, epoch, global_batch or world * micro_batch)
        n = len(data.mixture.sizes)

        def collate(batch_rows: list[dict]) -> dict[str, torch.Tensor]:
            return {**data.collate(batch_rows), mix.SOURCE_COUNTS: mix.count_sources(batch_rows, n)}
    sampler = ResumableSampler(rows, world, rank, seed, shuffle=data.mixture is None)
    sampler.set_epoch(epoch)
    sampler.skip = skip_micro_batches * micro_batch
    rows = data.reader.train_rows(rows, world, seed, epoch, global_batch)
    ahead = {"num_workers": workers, "prefetch_factor": 2, "worker_init_fn": _one_thread} if workers else {}
    return DataLoader(rows, batch_size=micro_batch, sampler=sampler, collate_fn=collate, drop_last=True,
                      pin_memory=torch.cuda.is_available(), **ahead)  # pinned: the copy to the GPU runs asynchronously


def _one_thread(worker_id: int) -> None:
    """A loader worker reads and collates rows: one intra-op thread, not a share of the training ranks' cores."""
    torch.set_num_threads(1)


class EvalSampler(Sampler[int]):
    """Every rank gets the same number of indices (ZeRO-3 needs equal forward calls); padding repeats
    early indices and is marked invalid so it does not count."""

    def __init__(self, n: int, world: int, rank: int, micro_batch: int):
        per = world * micro_batch
        total = math.ceil(n / per) * per
        self.indices = [(i % n, i < n) for i in range(total)][rank::world]

    def __iter__(self):
        return iter(range(len(self.indices)))

    def __len__(self) -> int:
        return len(self.indices)


def eval_loader(data: PreparedData, rank: int, world: int, micro_batch: int, split: str = "eval") -> DataLoader:
    """Micro-batches of the eval set (split "train": of the training set, in order) for this rank, each with a
    `valid` mask over its rows."""
    ds = data.eval if split == "eval" else data.train
    sampler = EvalSampler(len(ds), world, rank, micro_batch)
    ds = data.reader.eval_rows(ds)

    def fetch(rows: list[int]) -> dict[str, torch.Tensor]:
        pairs = [sampler.indices[i] for i in rows]
        batch = data.collate([ds[idx] for idx, _ in pairs])
        batch["valid"] = torch.tensor([ok for _, ok in pairs], dtype=torch.bool)
        return batch

    return DataLoader(list(range(len(sampler))), batch_size=micro_batch, shuffle=False, collate_fn=fetch)

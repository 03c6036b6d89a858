"""Data: `datasets` -> validated -> tokenized (packed for causal LM) -> DistributedSampler loaders.

`prepare_data` runs on every rank before the process group exists, so a bad --data fails every rank
the same way. Tokenizing happens once per machine: the first rank to take a file lock tokenizes and
writes the `datasets` cache (under an explicit fingerprint); the others then load that cache.
Data order is a pure function of (--seed, epoch), and a loader can start mid-epoch (resume).
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from ..config.schema import RunConfig
from ..errors import UserError, first_line
from ..tasks import IMAGE_CHAT, LABELLED_TEXT, PAIR_SCORE, PREFERENCE_PAIRS, PROMPTS, TEXT, UNPAIRED, TaskSpec, task_spec
from ..util import hub_offline
from . import mixture as mix
from . import prepared, preference, prompts, sft, unpaired, vision

_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text", ".parquet": "parquet"}
_FORMAT_VERSION = "2"  # bump when tokenization changes, so old caches are not reused


def _is_local(spec: str) -> bool:
    first = spec.split(",")[0].strip()
    return (os.path.splitext(first)[1].lower() in _BUILDERS or os.path.isabs(first) or first.startswith((".", "~"))
            or os.path.exists(first))


def load_raw(spec: str, flag: str, data_config: Optional[str] = None, split: str = "train"):
    """A `datasets.Dataset` from local files (comma-separated, one format) or a hub dataset id."""
    import datasets

    if MAP_PROCS["num_proc"] is None:  # training ranks print no bars; `zerotrain data prepare` shows datasets' own
        datasets.disable_progress_bars()
    if _is_local(spec):
        files = [str(Path(f.strip()).expanduser()) for f in spec.split(",") if f.strip()]
        for f in files:
            if not os.path.isfile(f):
                raise UserError(f"{flag} {f}: no such file; pass an existing .json/.jsonl/.csv/.txt/.parquet file")
            if not os.access(f, os.R_OK):
                raise UserError(f"{flag} {f}: file is not readable (permissions)")
        exts = {os.path.splitext(f)[1].lower() for f in files}
        if len(exts) != 1 or next(iter(exts)) not in _BUILDERS:
            raise UserError(f"{flag} {spec}: expected files of one type among {', '.join(_BUILDERS)} (got {sorted(exts)})")
        builder = _BUILDERS[exts.pop()]
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


def _check_columns(ds, flag: str, spec: str, columns: list[tuple[str, str]]) -> None:
    if len(ds) == 0:
        raise UserError(f"{flag} {spec}: the dataset is empty; pass data with rows")
    for option, col in columns:
        if col not in ds.column_names:
            raise UserError(f"{flag} {spec}: no column '{col}' (columns: {', '.join(ds.column_names)}); "
                            f"pass {option} NAME")


def label_names(ds, column: str, num_labels: Optional[int]) -> tuple[int, Optional[dict[int, str]]]:
    """(num_labels, id2label) from the label column: ClassLabel names, sorted strings, or ints 0..n-1."""
    feat = ds.features[column]
    names = getattr(feat, "names", None)
    if names:
        n = len(names)
        id2label = dict(enumerate(names))
    else:
        values = ds.unique(column)
        if any(v is None for v in values):
            raise UserError(f"--label-column {column}: some rows have no label; drop them or fill them in")
        if all(isinstance(v, str) for v in values):
            id2label = dict(enumerate(sorted(values)))
            n = len(id2label)
        elif all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            if min(values) < 0:
                raise UserError(f"--label-column {column}: integer labels must be 0..N-1 (found {min(values)})")
            n, id2label = max(values) + 1, None
        else:
            raise UserError(f"--label-column {column}: labels must be all strings or all integers")
    if num_labels is not None:
        if num_labels < n:
            raise UserError(f"--num-labels {num_labels} is smaller than the {n} labels in the data; "
                            f"use --num-labels {n} or drop --num-labels")
        n = num_labels
    if n < 2:
        raise UserError(f"--label-column {column}: the data has a single class; seq-cls needs at least 2")
    return n, id2label


def _tokenizer_hash(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else f"{tokenizer.name_or_path}:{len(tokenizer)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _fingerprint(ds, *parts: Any) -> str:
    h = hashlib.sha256(str((_FORMAT_VERSION, ds._fingerprint, *parts)).encode())
    return h.hexdigest()[:16]


ROWS_TOKENIZED = {"rows": 0}
"""Rows this process has put through the tokenizer (a hit of datasets' cache, or a directory of `zerotrain data
prepare`, puts none): prepare_data reports the rows of its own call (PreparedData.rows_tokenized, the banner)."""
MAP_PROCS: dict[str, Optional[int]] = {"num_proc": None}
"""Processes of the tokenizing maps (`zerotrain data prepare` takes every core; training ranks one each). Only maps
whose rows are tokenized one by one take it: packing's batches must not depend on how the rows were split."""


def _counted(fn: Callable[..., dict]) -> Callable[..., dict]:
    """fn (a batched map function) that adds its batch's rows to ROWS_TOKENIZED (in this process)."""
    def counted(batch, *args):
        ROWS_TOKENIZED["rows"] += len(next(iter(batch.values())))
        return fn(batch, *args)
    return counted


def _locked(fn: Callable[[], Any], key: str) -> Any:
    """Run fn under a machine-wide lock: the first rank computes and caches, the others hit the cache."""
    from filelock import FileLock

    from ..assets.demo import cache_root

    lock_dir = cache_root() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock_dir / f"{key}.lock")):
        return fn()


TEXT_PACKING = 2
"""How plain text is packed into seq_len blocks (recorded in every checkpoint, so a resumed run keeps its data):
2 = the whole dataset's token stream cut into blocks (pack_blocks); 1 = each batch of 1000 texts packed on its
own, its remainder dropped (zerotrain before 2026-11-26: with long blocks that lost most of the data), kept only
to resume the runs that started with it."""


def tokenize(ds, tokenizer, task: str, text_column: str, seq_len: int, pack: bool,
             label_column: Optional[str] = None, label2id: Optional[dict[str, int]] = None,
             text_packing: int = TEXT_PACKING):
    """Tokenized columns only: input_ids (+ labels for seq-cls). Causal LM packs to seq_len blocks."""
    tok_hash = _tokenizer_hash(tokenizer)
    eos = tokenizer.eos_token_id

    if task_spec(task).data_format == LABELLED_TEXT:
        def fn(batch):
            texts = [t if isinstance(t, str) else "" for t in batch[text_column]]
            out = {"input_ids": tokenizer(texts, truncation=True, max_length=seq_len,
                                          add_special_tokens=True)["input_ids"]}
            labels = batch[label_column]
            out["labels"] = [label2id[v] if label2id and isinstance(v, str) else int(v) for v in labels]
            return out
        fp = _fingerprint(ds, tok_hash, task, text_column, label_column, seq_len, sorted((label2id or {}).items()))
    elif pack and text_packing == 1:
        def fn(batch):
            ids: list[int] = []
            for t in batch[text_column]:
                if isinstance(t, str) and t:
                    ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
                    if eos is not None:
                        ids.append(eos)
            n = len(ids) // seq_len * seq_len
            return {"input_ids": [ids[i:i + seq_len] for i in range(0, n, seq_len)]}
        fp = _fingerprint(ds, tok_hash, task, text_column, seq_len, "pack")
    elif pack:
        def fn(batch):
            return {"input_ids": document_ids(tokenizer, batch[text_column])}
        fp = _fingerprint(ds, tok_hash, task, text_column, "pack-texts")
        texts = ds.map(_counted(fn), batched=True, batch_size=1000, remove_columns=ds.column_names,
                       new_fingerprint=fp, desc="tokenizing", **MAP_PROCS)
        return pack_blocks(texts, seq_len, _fingerprint(texts, seq_len, "pack"))
    else:
        def fn(batch):
            return {"input_ids": truncated_ids(tokenizer, batch[text_column], seq_len)}
        fp = _fingerprint(ds, tok_hash, task, text_column, seq_len, "truncate")
    per_row = task_spec(task).data_format == LABELLED_TEXT or not pack  # text_packing 1 packs per batch
    return ds.map(_counted(fn), batched=True, batch_size=1000, remove_columns=ds.column_names, new_fingerprint=fp,
                  desc="tokenizing", **(MAP_PROCS if per_row else {}))


def document_ids(tokenizer, texts: list) -> list[list[int]]:
    """Plain-text documents' token ids for packing, each followed by EOS (the document boundary inside a packed
    block); a text that is not a non-empty string is left out (tokenize, and zerotrain/data/streaming.py)."""
    texts = [t for t in texts if isinstance(t, str) and t]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    tail = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [x + tail for x in ids]


def truncated_ids(tokenizer, texts: list, seq_len: int) -> list[list[int]]:
    """Plain-text documents' token ids unpacked: the tokenizer's special tokens, cut at seq_len; a text that is not a
    non-empty string is left out (tokenize, and zerotrain/data/streaming.py)."""
    texts = [t for t in texts if isinstance(t, str) and t]
    return tokenizer(texts, truncation=True, max_length=seq_len)["input_ids"] if texts else []


def pack_blocks(texts, seq_len: int, fingerprint: str):
    """The texts' token ids (a column input_ids, one row per text) concatenated in order and cut into seq_len
    blocks; only the final partial block is dropped (the run's token count says so). Streams the texts in
    batches, carrying each batch's remainder into the next, so a block may span any number of texts."""
    import numpy as np
    import pyarrow as pa
    from datasets import Dataset
    from datasets.table import InMemoryTable

    blocks, carry = [], np.zeros(0, dtype=np.int64)
    for batch in texts.iter(batch_size=1000):
        flat = np.concatenate([carry, *(np.asarray(x, dtype=np.int64) for x in batch["input_ids"])])
        n = len(flat) // seq_len * seq_len
        if n:
            blocks.append(flat[:n])
        carry = flat[n:]
    values = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
    offsets = np.arange(0, len(values) + 1, seq_len, dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    return Dataset(InMemoryTable(pa.table({"input_ids": column})), fingerprint=fingerprint)


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
    data_format: str = TEXT
    """The task's data format (zerotrain/tasks.py TaskSpec.data_format): picks the collator (COLLATORS)."""
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
    def epoch_rows(self) -> int:
        """Training rows in one epoch (a mixture's: until every source has been seen whole)."""
        return mix.epoch_length(self.mixture.sizes, self.mixture.weights) if self.mixture else len(self.train)

    def collate(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return COLLATORS[self.data_format](rows, self)


REAL_TOKENS = "real_tokens"
"""A packed batch's count of real (not padding) tokens: packed batches carry no attention_mask."""


def _padded(rows: list[dict], key: str, width: int, fill: int) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, :len(r[key])] = torch.as_tensor(r[key], dtype=torch.long)
    return out


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row. Causal LM: labels = input_ids with padding at -100 (chat data:
    its own token labels). Packed rows (position_ids) get no attention_mask: transformers then masks
    attention per document from the restarting position ids (zerotrain/data/sft.py)."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = _padded(rows, "input_ids", width, pad_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        mask[i, :len(r["input_ids"])] = 1
    if "position_ids" in rows[0]:
        # use_cache=False: with a KV cache transformers skips the packed-sequence mask (masking_utils
        # _preprocess_mask_arguments), and HF models build one by default even in training.
        return {"input_ids": ids, "position_ids": _padded(rows, "position_ids", width, 0),
                "labels": _padded(rows, "labels", width, -100), REAL_TOKENS: mask.sum(), "use_cache": False}
    batch = {"input_ids": ids, "attention_mask": mask}
    if "labels" in rows[0] and isinstance(rows[0]["labels"], list):
        batch["labels"] = _padded(rows, "labels", width, -100)
    elif "labels" in rows[0]:
        batch["labels"] = torch.as_tensor([r["labels"] for r in rows], dtype=torch.long)
    else:
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    return batch


COLLATORS: dict[str, Callable[[list[dict], PreparedData], dict[str, torch.Tensor]]] = {
    TEXT: lambda rows, data: collate(rows, data.pad_id),
    LABELLED_TEXT: lambda rows, data: collate(rows, data.pad_id),
    PREFERENCE_PAIRS: lambda rows, data: preference.collate_pairs(rows, data.pad_id, data.pair_len),
    PROMPTS: lambda rows, data: prompts.collate_prompts(rows, data.pad_id),
    UNPAIRED: lambda rows, data: unpaired.collate_unpaired(rows, data.pad_id, data.pair_len),
    IMAGE_CHAT: lambda rows, data: vision.collate_images(rows, data.pad_id, data.processor),
}
"""A task's data format (tasks.TaskSpec.data_format) -> its micro-batch collator (PreparedData.collate)."""


def prepare_pairs(raw: Any, raw_eval: Optional[Any], tokenizer: Any, cfg: RunConfig, spec: str) -> PreparedData:
    """Preference pairs (zerotrain/data/preference.py) of the train and eval rows."""
    d = cfg.data
    preference.check_columns(raw)
    if raw_eval is not None:
        preference.check_columns(raw_eval, "--eval-data")
    template = sft.chat_template(tokenizer, d.chat_template) if preference.conversational(raw) else None
    task = task_spec(cfg.model.task)
    drop_long = task.objective == PAIR_SCORE  # a reward model scores each sequence whole (TRL drops longer pairs)
    keys = (_tokenizer_hash(tokenizer), template, d.seq_len, cfg.pref.max_prompt_len, drop_long, "pairs")
    train, stats = preference.tokenize_pairs(raw, tokenizer, template, d.seq_len, cfg.pref.max_prompt_len,
                                             _fingerprint(raw, *keys), drop_long)
    evals = None
    if raw_eval is not None:
        evals = preference.tokenize_pairs(raw_eval, tokenizer, template, d.seq_len, cfg.pref.max_prompt_len,
                                          _fingerprint(raw_eval, *keys), drop_long)[0]
    fix = "pass a larger --seq-len" + ("" if drop_long else " or --max-prompt-len")
    if len(train) == 0:
        raise UserError(f"--data {spec}: every pair is dropped at --seq-len {d.seq_len} ({stats.line(d.seq_len)}); "
                        f"{fix}")
    if evals is not None and len(evals) == 0:
        raise UserError(f"--eval-data: every eval pair is dropped at --seq-len {d.seq_len}; {fix}")
    desc = f"{spec} (preference pairs): {stats.line(d.seq_len)}" + (f" / {len(evals)} eval" if evals is not None else "")
    return PreparedData(train, evals, task.head_labels, None, tokenizer.pad_token_id, desc, pair_len=d.seq_len,
                        data_format=PREFERENCE_PAIRS)


def prepare_unpaired(raw: Any, raw_eval: Optional[Any], tokenizer: Any, cfg: RunConfig, spec: str) -> PreparedData:
    """KTO's rows (zerotrain/data/unpaired.py): paired data unpaired by rule, labels checked, tokenized as TRL."""
    d = cfg.data
    unpaired.check_columns(raw)
    if raw_eval is not None:
        unpaired.check_columns(raw_eval, "--eval-data")
    raw = unpaired.unpair(raw, _fingerprint(raw, "unpair"))
    raw_eval = unpaired.unpair(raw_eval, _fingerprint(raw_eval, "unpair")) if raw_eval is not None else None
    unpaired.check_labels(raw, "--data", both=True)
    if raw_eval is not None:
        unpaired.check_labels(raw_eval, "--eval-data", both=False)
    template = sft.chat_template(tokenizer, d.chat_template) if unpaired.conversational(raw) else None
    keys = (_tokenizer_hash(tokenizer), template, d.seq_len, cfg.pref.max_prompt_len, "unpaired")
    train, stats = unpaired.tokenize_rows(raw, tokenizer, template, d.seq_len, cfg.pref.max_prompt_len,
                                          _fingerprint(raw, *keys))
    evals = None
    if raw_eval is not None:
        evals = unpaired.tokenize_rows(raw_eval, tokenizer, template, d.seq_len, cfg.pref.max_prompt_len,
                                       _fingerprint(raw_eval, *keys))[0]
    if len(train) == 0 or evals is not None and len(evals) == 0:
        raise UserError(f"{'--data ' + spec if len(train) == 0 else '--eval-data'}: every row's prompt fills --seq-len "
                        f"{d.seq_len}; pass a larger --seq-len or --max-prompt-len")
    unpaired.check_labels(train, "--data (after dropping rows whose prompt fills --seq-len)", both=True)
    desc = f"{spec} (unpaired completions): {stats.line(d.seq_len)}" + \
        (f" / {len(evals)} eval" if evals is not None else "")
    return PreparedData(train, evals, None, None, tokenizer.pad_token_id, desc, pair_len=d.seq_len,
                        data_format=UNPAIRED)


def prepare_prompts(raw: Any, tokenizer: Any, cfg: RunConfig, spec: str) -> PreparedData:
    """Online RL's prompts (zerotrain/data/prompts.py): rendered with the chat template and its generation prompt
    where they are messages, cut to their last --max-prompt-len tokens."""
    prompts.check_prompt_columns(raw)
    template = sft.chat_template(tokenizer, cfg.data.chat_template) if prompts.conversational(raw) else None
    keys = (_tokenizer_hash(tokenizer), template, cfg.pref.max_prompt_len, "prompts")
    train, stats = prompts.tokenize_prompts(raw, tokenizer, template, cfg.pref.max_prompt_len, _fingerprint(raw, *keys))
    if len(train) == 0:
        raise UserError(f"--data {spec}: no prompt has a token ({stats.line()}); pass prompts with text")
    return PreparedData(train, None, None, None, tokenizer.pad_token_id, f"{spec} (prompts): {stats.line()}",
                        data_format=PROMPTS)


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of a host batch that are not padding; takes a packed batch's count out of it (the model
    must not see that key)."""
    if REAL_TOKENS in batch:
        return int(batch.pop(REAL_TOKENS))
    return int(batch["attention_mask"].sum())


def prepare_data(cfg: RunConfig, tokenizer, text_packing: int = TEXT_PACKING, processor: Any = None,
                 task: Optional[TaskSpec] = None) -> PreparedData:
    """Load, validate, split and tokenize. Raises UserError with one line on bad input. text_packing: the
    TEXT_PACKING version to pack plain text with (a resumed run's own, from its checkpoint). processor: an
    image-text model's (its task's data format is IMAGE_CHAT: zerotrain/data/vision.py). task: the run's task as the
    model resolved it (RunPlan.task; None: model.task's)."""
    from ..assets.demo import CORPUS, SENTIMENT

    spec_of_task = task or task_spec(cfg.model.task)
    d, task, form = cfg.data, spec_of_task.name, spec_of_task.data_format
    spec = d.path or str(SENTIMENT if form == LABELLED_TEXT else CORPUS)  # pairs have no demo set: refused below
    flag = "--data"
    key = hashlib.sha256(str((spec, d.data_config, d.split)).encode()).hexdigest()[:16]

    if form == PREFERENCE_PAIRS and not d.path:
        raise UserError(f"--task {task} trains on preference pairs; pass --data FILE.jsonl with prompt, chosen and "
                        "rejected columns")
    if form == UNPAIRED and not d.path:
        raise UserError(f"--task {task} trains on completions labelled desirable or not; pass --data FILE.jsonl with "
                        "prompt, completion and label (true/false) columns, or chosen/rejected pairs")
    if form == PROMPTS and not d.path:
        raise UserError(f"--task {task} samples completions of prompts; pass --data FILE.jsonl with a prompt column "
                        "(a string or chat messages; its other columns reach the reward functions)")
    if form == PROMPTS and (d.eval_path or d.eval_split > 0):
        raise UserError(f"--task {task} with {'--eval-data' if d.eval_path else '--eval-split'}: evaluation of online "
                        "RL (generating and scoring held-out prompts) is not built yet; drop it")

    if form == IMAGE_CHAT:
        if not d.path:
            raise UserError("an image-text model trains on chats with images; pass --data FILE.jsonl in TRL's vision "
                            "format (messages with {\"type\": \"image\"} parts, an images column of paths)")
        vision.check_settings(cfg)
        if prepared.is_prepared(d.path):
            raise UserError(f"--data {d.path}: a directory of `zerotrain data prepare` holds text rows; pass the "
                            "image chats' JSONL (their images are read as the run trains)")
    if prepared.is_prepared(d.path):
        return _from_prepared(cfg, tokenizer, text_packing)
    sources = mix.split_sources(spec)
    weights = mix.parse_weights(spec, d.data_weights)
    if weights is not None and form != TEXT:
        raise UserError(f"--data-weights: mixtures are built for causal-lm data (text, chat, prompt-completion); "
                        f"--task {task} reads one dataset (a comma list is concatenated); drop --data-weights")

    def work(spec: str, eval_path: Optional[str]) -> PreparedData:
        raw = load_raw(spec, flag, d.data_config, d.split)
        pairs = form in (PREFERENCE_PAIRS, UNPAIRED)
        if form == PROMPTS:
            return prepare_prompts(load_raw(spec, flag, d.data_config, d.split), tokenizer, cfg, spec)
        fmt = "text" if form != TEXT else sft.detect_format(raw.column_names, d.text_column, d.format,
                                                                          spec)
        cols = [("--text-column", d.text_column)] if fmt == "text" and not pairs and form != IMAGE_CHAT else []
        if form == LABELLED_TEXT:
            cols.append(("--label-column", d.label_column))
        _check_columns(raw, flag, spec, cols)
        raw_eval = None
        if eval_path:
            raw_eval = load_raw(eval_path, "--eval-data", d.data_config, d.split)
            _check_columns(raw_eval, "--eval-data", eval_path, cols)
            if form == TEXT:
                sft.detect_format(raw_eval.column_names, d.text_column, fmt, eval_path)
        elif d.eval_split > 0:
            n_eval = math.ceil(len(raw) * d.eval_split)
            if n_eval >= len(raw):
                raise UserError(f"--eval-split {d.eval_split}: leaves no training rows out of {len(raw)}; use a smaller fraction")
            parts = raw.train_test_split(test_size=n_eval, seed=cfg.run.seed, shuffle=True)
            raw, raw_eval = parts["train"], parts["test"]

        if form == UNPAIRED:
            return prepare_unpaired(raw, raw_eval, tokenizer, cfg, spec)
        if form == IMAGE_CHAT:
            template = sft.chat_template(processor, d.chat_template)
            train, evals, desc = vision.prepare(cfg, processor, raw, raw_eval, spec, template,
                                                lambda ds, *keys: _fingerprint(ds, _tokenizer_hash(tokenizer), *keys))
            return PreparedData(train, evals, None, None, tokenizer.pad_token_id, desc, data_format=IMAGE_CHAT,
                                chat_template=template, processor=processor)
        if pairs:
            return prepare_pairs(raw, raw_eval, tokenizer, cfg, spec)
        num_labels = id2label = label2id = None
        if form == LABELLED_TEXT:
            num_labels, id2label = label_names(raw, d.label_column, cfg.model.num_labels)
            label2id = {v: k for k, v in id2label.items()} if id2label else None
            if raw_eval is not None:
                _check_eval_labels(raw_eval, d.label_column, label2id, num_labels)

        if form == TEXT and (fmt != "text" or d.packing != "off"):
            template = sft.chat_template(tokenizer, d.chat_template) if fmt == "chat" else None
            train, stats = tokenize_samples(raw, tokenizer, fmt, template, cfg)
            evals = tokenize_samples(raw_eval, tokenizer, fmt, template, cfg)[0] if raw_eval is not None else None
            if len(train) == 0:
                raise UserError(f"{flag} {spec}: no sample has a token to learn within --seq-len {d.seq_len} "
                                f"({stats}); pass a larger --seq-len or --truncation truncate")
            desc = f"{spec} ({fmt}): {len(train)} train" + (f" / {len(evals)} eval" if evals is not None else "") + \
                f" rows of <= {d.seq_len} tokens; {stats}"
            return PreparedData(train, evals, None, None, tokenizer.pad_token_id, desc, chat_template=template)
        args = (tokenizer, task, d.text_column, d.seq_len, d.pack, d.label_column, label2id, text_packing)
        train = tokenize(raw, *args)
        evals = tokenize(raw_eval, *args) if raw_eval is not None else None
        if len(train) == 0:
            what = (f"fewer than --seq-len {d.seq_len} tokens in all" if form == TEXT and d.pack
                    else "no non-empty texts")
            raise UserError(f"{flag} {spec}: {what}; pass more data or a smaller --seq-len")
        if evals is not None and len(evals) == 0:
            raise UserError("--eval-data: the evaluation set is empty after tokenizing; pass more eval data")
        packed = form == TEXT and d.pack
        desc = f"{spec}: {len(train)} train" + (f" / {len(evals)} eval" if evals is not None else "") + \
            (f" blocks of {d.seq_len} tokens" if packed else " samples")
        if packed and text_packing != TEXT_PACKING:
            desc += ("; packed per 1000-text batch as when this run started (its checkpoint predates whole-dataset "
                     "packing, which new runs use)")
        return PreparedData(train, evals, num_labels, id2label, tokenizer.pad_token_id, desc, text_packing,
                            data_format=form)

    def build() -> PreparedData:
        before = ROWS_TOKENIZED["rows"]
        if weights is None:
            data = work(spec, d.eval_path)
        else:  # each source tokenized (and packed) on its own: a row belongs to one source
            data = _mixed([work(s, d.eval_path if i == 0 else None) for i, s in enumerate(sources)], sources, weights)
        data.rows_tokenized = ROWS_TOKENIZED["rows"] - before
        if form == TEXT and MAP_PROCS["num_proc"] is None:  # a training run's (prepare's maps count in subprocesses)
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
                        parts[0].text_packing, chat_template=parts[0].chat_template, mixture=m)


def data_settings(cfg: RunConfig, tokenizer: Any, text_packing: int, chat_template: Optional[str]) -> dict[str, Any]:
    """What makes a prepared directory's rows (zerotrain/data/prepared.py): the manifest records it, a run that
    reads the directory must have the same. chat_template: the template the chat rows were rendered with."""
    d = cfg.data
    out = {"tokenizer": _tokenizer_hash(tokenizer), "task": cfg.model.task, "seq_len": d.seq_len, "pack": d.pack,
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
                        chat_template=template, mixture=mixture)


def tokenize_samples(ds, tokenizer, fmt: str, template: Optional[str], cfg: RunConfig) -> tuple[Any, str]:
    """Chat / prompt-completion / per-document text samples -> input_ids + token labels (sft.encode),
    packed into rows with restarting position_ids under --packing. Returns (dataset, one-line stats:
    truncated and dropped samples, packing efficiency)."""
    d = cfg.data
    keys = (_tokenizer_hash(tokenizer), fmt, template, d.seq_len, d.train_on_prompt, d.truncation, d.text_column)

    def fn(batch, idx):
        enc = sft.encode(batch, fmt, tokenizer, template, d.seq_len, d.train_on_prompt, d.truncation,
                         d.text_column, first_row=idx[0])
        # one status row per kept sample, plus one empty row per cut sample (filtered out below)
        n_cut = enc.dropped
        return {"input_ids": enc.input_ids + [[]] * n_cut, "labels": enc.labels + [[]] * n_cut,
                "truncated": [i < enc.truncated for i in range(len(enc.input_ids))] + [False] * n_cut}

    samples = ds.map(_counted(fn), batched=True, batch_size=1000, with_indices=True, remove_columns=ds.column_names,
                     new_fingerprint=_fingerprint(ds, *keys, "samples"), desc="tokenizing", **MAP_PROCS)
    n_in, truncated = len(samples), sum(samples["truncated"])
    samples = samples.filter(lambda r: len(r) > 0, input_columns="input_ids",
                             new_fingerprint=_fingerprint(ds, *keys, "kept"))
    dropped = n_in - len(samples)
    samples = samples.remove_columns("truncated")
    stats = f"{len(samples)} samples ({truncated} truncated, {dropped} dropped at --seq-len {d.seq_len})"
    if d.packing == "off":
        return samples, stats
    real = sum(len(x) for x in samples["input_ids"])
    packed = samples.map(lambda b: sft.pack(b["input_ids"], b["labels"], d.seq_len), batched=True, batch_size=1000,
                         remove_columns=samples.column_names, new_fingerprint=_fingerprint(ds, *keys, "packed"),
                         desc="packing")
    efficiency = real / max(1, len(packed) * d.seq_len)
    return packed, f"{stats}; packed into {len(packed)} rows, efficiency {100 * efficiency:.1f}% (real tokens / row tokens)"


def _check_eval_labels(ds, column: str, label2id: Optional[dict[str, int]], num_labels: int) -> None:
    for v in ds.unique(column):
        if label2id is not None and v not in label2id:
            raise UserError(f"--eval-data: label {v!r} does not occur in the training data; fix the eval labels")
        if label2id is None and not (isinstance(v, int) and 0 <= v < num_labels):
            raise UserError(f"--eval-data: label {v!r} is outside 0..{num_labels - 1}; fix the eval labels")


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
    if data.data_format == UNPAIRED:
        if global_batch < 1:
            raise ValueError("train_loader: KTO's rows need the global batch to pair their KL rows")
        order = unpaired.global_order(len(rows), world, seed, epoch)
        rows = unpaired.WithPartners(rows, unpaired.rotated_partners(order, global_batch))
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
    if data.data_format == UNPAIRED:  # each row's KL partner: the previous row of the set, in its order
        ds = unpaired.WithPartners(ds, [(i - 1) % len(ds) for i in range(len(ds))])

    def fetch(rows: list[int]) -> dict[str, torch.Tensor]:
        pairs = [sampler.indices[i] for i in rows]
        batch = data.collate([ds[idx] for idx, _ in pairs])
        batch["valid"] = torch.tensor([ok for _, ok in pairs], dtype=torch.bool)
        return batch

    return DataLoader(list(range(len(sampler))), batch_size=micro_batch, shuffle=False, collate_fn=fetch)

"""Text data and its readers: causal-LM text (TEXT: plain text packed into --seq-len blocks or cut at it, or chat /
prompt-completion / per-document samples through zerotrain/data/sft.py) and labelled text (LABELLED_TEXT: seq-cls),
and the padded micro-batches both make (collate).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..assets.demo import CORPUS, SENTIMENT
from ..errors import UserError
from ..tasks import LABELLED_TEXT, TEXT
from . import sft
from .reader import (MAP_PROCS, TEXT_PACKING, DataReader, PreparedData, ReadRequest, counted, fingerprint_of, load_raw,
                     tokenizer_hash, with_eval)


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


def _check_eval_labels(ds, column: str, label2id: Optional[dict[str, int]], num_labels: int) -> None:
    for v in ds.unique(column):
        if label2id is not None and v not in label2id:
            raise UserError(f"--eval-data: label {v!r} does not occur in the training data; fix the eval labels")
        if label2id is None and not (isinstance(v, int) and 0 <= v < num_labels):
            raise UserError(f"--eval-data: label {v!r} is outside 0..{num_labels - 1}; fix the eval labels")


def _tokenized(ds, fn: Callable[[dict], dict], fp: str, per_row: bool = True):
    """ds mapped by fn (a batched tokenizing function) under the cache fingerprint fp; per_row: its rows are
    tokenized one by one (MAP_PROCS's processes may split them)."""
    return ds.map(counted(fn), batched=True, batch_size=1000, remove_columns=ds.column_names, new_fingerprint=fp,
                  desc="tokenizing", **(MAP_PROCS if per_row else {}))


def tokenize_labelled(ds, tokenizer, task: str, text_column: str, seq_len: int, label_column: str,
                      label2id: Optional[dict[str, int]]):
    """Labelled text's columns input_ids (cut at seq_len) and labels (the class index)."""
    def fn(batch):
        texts = [t if isinstance(t, str) else "" for t in batch[text_column]]
        out = {"input_ids": tokenizer(texts, truncation=True, max_length=seq_len, add_special_tokens=True)["input_ids"]}
        labels = batch[label_column]
        out["labels"] = [label2id[v] if label2id and isinstance(v, str) else int(v) for v in labels]
        return out
    return _tokenized(ds, fn, fingerprint_of(ds, tokenizer_hash(tokenizer), task, text_column, label_column, seq_len,
                                             sorted((label2id or {}).items())))


def tokenize_text(ds, tokenizer, task: str, text_column: str, seq_len: int, pack: bool,
                  text_packing: int = TEXT_PACKING):
    """Plain text's column input_ids: packed into seq_len blocks (pack; as TEXT_PACKING's version says), or each
    text cut at seq_len."""
    tok_hash = tokenizer_hash(tokenizer)
    eos = tokenizer.eos_token_id
    if pack and text_packing == 1:
        def fn(batch):
            ids: list[int] = []
            for t in batch[text_column]:
                if isinstance(t, str) and t:
                    ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
                    if eos is not None:
                        ids.append(eos)
            n = len(ids) // seq_len * seq_len
            return {"input_ids": [ids[i:i + seq_len] for i in range(0, n, seq_len)]}
        # packs per batch: its rows are not split between processes
        return _tokenized(ds, fn, fingerprint_of(ds, tok_hash, task, text_column, seq_len, "pack"), per_row=False)
    if pack:
        texts = _tokenized(ds, lambda batch: {"input_ids": document_ids(tokenizer, batch[text_column])},
                           fingerprint_of(ds, tok_hash, task, text_column, "pack-texts"))
        return pack_blocks(texts, seq_len, fingerprint_of(texts, seq_len, "pack"))
    return _tokenized(ds, lambda batch: {"input_ids": truncated_ids(tokenizer, batch[text_column], seq_len)},
                      fingerprint_of(ds, tok_hash, task, text_column, seq_len, "truncate"))


def document_ids(tokenizer, texts: list) -> list[list[int]]:
    """Plain-text documents' token ids for packing, each followed by EOS (the document boundary inside a packed
    block); a text that is not a non-empty string is left out (tokenize_text, and zerotrain/data/streaming.py)."""
    texts = [t for t in texts if isinstance(t, str) and t]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    tail = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [x + tail for x in ids]


def truncated_ids(tokenizer, texts: list, seq_len: int) -> list[list[int]]:
    """Plain-text documents' token ids unpacked: the tokenizer's special tokens, cut at seq_len; a text that is not a
    non-empty string is left out (tokenize_text, and zerotrain/data/streaming.py)."""
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


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens of a host batch that are not padding; takes a packed batch's count out of it (the model
    must not see that key)."""
    if REAL_TOKENS in batch:
        return int(batch.pop(REAL_TOKENS))
    return int(batch["attention_mask"].sum())


def _collate(rows: list[dict], data: PreparedData) -> dict[str, torch.Tensor]:
    return collate(rows, data.pad_id)


def _sets(req: ReadRequest, spec: str, train: Any, evals: Optional[Any], packed: bool, reader: DataReader,
          num_labels: Optional[int] = None, id2label: Optional[dict[int, str]] = None) -> PreparedData:
    """Plain or labelled text's sets, refused when tokenizing left no row, with the banner's line."""
    d = req.cfg.data
    if len(train) == 0:
        what = f"fewer than --seq-len {d.seq_len} tokens in all" if packed else "no non-empty texts"
        raise UserError(f"--data {spec}: {what}; pass more data or a smaller --seq-len")
    if evals is not None and len(evals) == 0:
        raise UserError("--eval-data: the evaluation set is empty after tokenizing; pass more eval data")
    desc = f"{spec}: {len(train)} train" + (f" / {len(evals)} eval" if evals is not None else "") + \
        (f" blocks of {d.seq_len} tokens" if packed else " samples")
    if packed and req.text_packing != TEXT_PACKING:
        desc += ("; packed per 1000-text batch as when this run started (its checkpoint predates whole-dataset "
                 "packing, which new runs use)")
    return PreparedData(train, evals, num_labels, id2label, req.tokenizer.pad_token_id, desc, req.text_packing,
                        reader=reader)


def read_text(req: ReadRequest, spec: str, eval_path: Optional[str]) -> PreparedData:
    """Causal-LM data: plain text packed into --seq-len blocks (--pack) or cut at it; chat, prompt-completion and
    --packing'd plain text as samples (sft.tokenize_samples)."""
    d, tokenizer = req.cfg.data, req.tokenizer
    raw = load_raw(spec, "--data", d.data_config, d.split)
    fmt = sft.detect_format(raw.column_names, d.text_column, d.format, spec)
    raw, raw_eval = with_eval(req, spec, eval_path, [("--text-column", d.text_column)] if fmt == "text" else [],
                              lambda ev: sft.detect_format(ev.column_names, d.text_column, fmt, eval_path), raw)
    if fmt == "text" and d.packing == "off":
        args = (tokenizer, req.cfg.model.task, d.text_column, d.seq_len, d.pack, req.text_packing)
        train = tokenize_text(raw, *args)
        evals = tokenize_text(raw_eval, *args) if raw_eval is not None else None
        return _sets(req, spec, train, evals, d.pack, READER)
    template = sft.chat_template(tokenizer, d.chat_template) if fmt == "chat" else None
    train, stats = sft.tokenize_samples(raw, tokenizer, fmt, template, req.cfg)
    evals = sft.tokenize_samples(raw_eval, tokenizer, fmt, template, req.cfg)[0] if raw_eval is not None else None
    if len(train) == 0:
        raise UserError(f"--data {spec}: no sample has a token to learn within --seq-len {d.seq_len} "
                        f"({stats}); pass a larger --seq-len or --truncation truncate")
    desc = f"{spec} ({fmt}): {len(train)} train" + (f" / {len(evals)} eval" if evals is not None else "") + \
        f" rows of <= {d.seq_len} tokens; {stats}"
    return PreparedData(train, evals, None, None, tokenizer.pad_token_id, desc, chat_template=template, reader=READER)


def read_labelled(req: ReadRequest, spec: str, eval_path: Optional[str]) -> PreparedData:
    """seq-cls data: texts and their labels (label_names: the classes), each text cut at --seq-len."""
    d = req.cfg.data
    raw, raw_eval = with_eval(req, spec, eval_path, [("--text-column", d.text_column),
                                                     ("--label-column", d.label_column)])
    num_labels, id2label = label_names(raw, d.label_column, req.cfg.model.num_labels)
    label2id = {v: k for k, v in id2label.items()} if id2label else None
    if raw_eval is not None:
        _check_eval_labels(raw_eval, d.label_column, label2id, num_labels)
    args = (req.tokenizer, req.cfg.model.task, d.text_column, d.seq_len, d.label_column, label2id)
    train = tokenize_labelled(raw, *args)
    evals = tokenize_labelled(raw_eval, *args) if raw_eval is not None else None
    return _sets(req, spec, train, evals, False, LABELLED_READER, num_labels, id2label)


READER = DataReader(TEXT, read_text, _collate, demo=CORPUS, mixes=True, counts_rows=True)
"""Causal-LM text (text, chat, prompt-completion); the embedded corpus without --data."""
LABELLED_READER = DataReader(LABELLED_TEXT, read_labelled, _collate, demo=SENTIMENT)
"""Labelled text (seq-cls); the embedded sentiment set without --data."""

"""KTO's data: completions judged one by one, tokenized as TRL 1.16's KTOTrainer does, and their batches.

Rows (TRL's unpaired preference format):
  {"prompt": ..., "completion": ..., "label": true|false}   strings, or message lists rendered with the chat template
                                                            (the prompt with the generation prompt)
  {"prompt"?, "chosen": ..., "rejected": ...}               paired data, unpaired by rule as TRL's
                                                            unpair_preference_dataset does: per 1000-row batch, every
                                                            chosen (label true) then every rejected (label false); an
                                                            implicit prompt is extracted first (TRL's extract_prompt)
EOS is appended to a string completion (unless it ends with it); prompt and prompt+completion are tokenized as the
tokenizer does by default; the completion starts where the two diverge (TRL's common prefix). --max-prompt-len first
keeps the prompt's last tokens; a row whose prompt alone fills --seq-len is dropped; the rest is cut at --seq-len
keeping the start (TRL's max_length, keep_start).

The KL estimate pairs each row's prompt with ANOTHER row's completion: the previous row of the same global batch in
data order, rotated (TRL rotates by +1 within each per-device batch of a sequentially read set; zerotrain's data
order is shuffled per epoch and spans the ranks, so the pairing is over the global batch: the split over ranks and
micro-batches never changes it, and one process with the whole batch is TRL's own pairing). In evaluation the
partner is the previous row of the eval set.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..config.schema import RunConfig
from ..errors import UserError
from ..tasks import UNPAIRED
from .preference import PairStats, _common_prefix, _conversational, extract_prompt, padded_rows
from .reader import DataReader, PreparedData, ReadRequest, check_sets, fingerprint_of, tokenizer_hash, with_eval
from .sft import chat_ids, chat_template

COLUMNS = ("prompt", "completion", "label")
"""The unpaired format's columns (paired data: chosen and rejected instead of completion and label)."""
UNPAIR_BATCH = 1000
"""Rows per batch when unpairing pairs (TRL's datasets.map default): each batch's chosen, then its rejected."""


def check_columns(ds: Any, flag: str = "--data") -> None:
    """Refuse (one line) a dataset that is neither unpaired (prompt, completion, label) nor paired (chosen, rejected)."""
    cols = set(ds.column_names)
    if {"chosen", "rejected"} <= cols:
        return
    missing = [c for c in COLUMNS if c not in cols]
    if missing:
        raise UserError(f"{flag}: kto reads rows of prompt, completion and label (true: desirable, false: not), or "
                        f"chosen/rejected pairs it unpairs; missing {', '.join(repr(c) for c in missing)} (columns: "
                        f"{', '.join(ds.column_names)})")


def unpair(ds: Any, fingerprint: str) -> Any:
    """Paired rows -> unpaired rows as TRL's unpair_preference_dataset (an implicit prompt extracted first); an
    unpaired set as it is."""
    if not {"chosen", "rejected"} <= set(ds.column_names):
        return ds

    def fn(batch: dict[str, list]) -> dict[str, list]:
        prompts, chosen, rejected = [], [], []
        for j in range(len(batch["chosen"])):
            c, r = batch["chosen"][j], batch["rejected"][j]
            p = batch["prompt"][j] if "prompt" in batch else None
            if p is None:
                p, c, r = extract_prompt(c, r)
            prompts.append(p)
            chosen.append(c)
            rejected.append(r)
        return {"prompt": prompts + prompts, "completion": chosen + rejected,
                "label": [True] * len(chosen) + [False] * len(rejected)}

    return ds.map(fn, batched=True, batch_size=UNPAIR_BATCH, remove_columns=ds.column_names,
                  new_fingerprint=fingerprint + "-unpaired", desc="unpairing pairs")


def check_labels(ds: Any, flag: str, both: bool) -> tuple[int, int]:
    """(desirable, undesirable) row counts; a label that is not a boolean is refused naming the row, and with `both`
    a set holding one class only (KTO's loss needs both, and TRL's weights are set from their balance)."""
    labels = ds["label"]
    for i, v in enumerate(labels):
        if not isinstance(v, bool):
            raise UserError(f"{flag} row {i + 1}: 'label' is {v!r}; kto's label is true (a desirable completion) or "
                            "false (an undesirable one)")
    good = sum(labels)
    if both and (good == 0 or good == len(labels)):
        only = "desirable (true)" if good else "undesirable (false)"
        raise UserError(f"{flag}: every row is {only}; kto weighs desirable against undesirable completions, so it "
                        "needs rows of both labels")
    return good, len(labels) - good


def tokenize_row(prompt: Any, completion: Any, n: int, tokenizer: Any, template: Optional[str]) -> tuple[list, list]:
    """(prompt_ids, completion_ids) of one row, as TRL 1.16 KTOTrainer._prepare_dataset builds them."""
    conv = _conversational(completion)
    if conv != _conversational(prompt) or not conv and not (isinstance(prompt, str) and isinstance(completion, str)):
        raise UserError(f"--data row {n}: 'prompt' and 'completion' must both be strings or both lists of "
                        "{role, content} messages")
    if conv:
        prompt_ids = chat_ids(tokenizer, template, prompt, n, generation=True)
        full = chat_ids(tokenizer, template, prompt + completion, n)
    else:
        eos = tokenizer.eos_token or ""
        completion = completion if completion.endswith(eos) else completion + eos
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        full = tokenizer(text=prompt + completion)["input_ids"]
    cut = _common_prefix(prompt_ids, full)
    return prompt_ids[:cut], full[cut:]


def conversational(ds: Any) -> bool:
    """Whether the rows are message lists (rendered with a chat template)."""
    row = ds[0]
    return _conversational(row["completion"] if "completion" in row else row["chosen"])


def tokenize_rows(ds: Any, tokenizer: Any, template: Optional[str], seq_len: int, max_prompt_len: Optional[int],
                  fingerprint: str) -> tuple[Any, PairStats]:
    """The tokenized rows (prompt_ids, completion_ids, label, index) of an unpaired datasets.Dataset and their stats."""

    def fn(batch: dict[str, list], idx: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "label": [], "index": [], "truncated": [],
                                "prompt_cut": []}
        for j, i in enumerate(idx):
            prompt, completion = tokenize_row(batch["prompt"][j], batch["completion"][j], i + 1, tokenizer, template)
            cut = max_prompt_len is not None and len(prompt) > max_prompt_len
            if cut:
                prompt = prompt[len(prompt) - max_prompt_len:]
            out["prompt_ids"].append(prompt)
            out["completion_ids"].append(completion)
            out["label"].append(bool(batch["label"][j]))
            out["index"].append(i)
            out["truncated"].append(len(prompt) + len(completion) > seq_len)
            out["prompt_cut"].append(cut)
        return out

    rows = ds.map(fn, batched=True, batch_size=1000, with_indices=True, remove_columns=ds.column_names,
                  new_fingerprint=fingerprint, desc="tokenizing rows")
    n_in = len(rows)
    kept = rows.filter(lambda p: len(p) < seq_len, input_columns="prompt_ids", new_fingerprint=fingerprint + "-kept")
    # the kept rows are renumbered: a row's index is its position in the set the loaders and tables address
    kept = kept.remove_columns("index").add_column("index", list(range(len(kept))),
                                                   new_fingerprint=fingerprint + "-index")
    good = sum(kept["label"])
    stats = PairStats(kept=len(kept), truncated=sum(kept["truncated"]), dropped=n_in - len(kept),
                      prompt_cut=sum(rows["prompt_cut"]), unit="rows",
                      classes=f"{good} desirable, {len(kept) - good} undesirable; ")
    return kept.remove_columns(["truncated", "prompt_cut"]), stats


# --- the KL partners ----------------------------------------------------------------------------------------
def rotated_partners(order: list[int], window: int) -> dict[int, int]:
    """Each row's KL partner: the previous row of its window of `window` consecutive rows of `order` (the first
    takes the window's last; a trailing partial window rotates within itself)."""
    partner = {}
    for start in range(0, len(order), window):
        part = order[start:start + window]
        for j, i in enumerate(part):
            partner[i] = part[j - 1]
    return partner


def global_order(n: int, world: int, seed: int, epoch: int) -> list[int]:
    """The epoch's rows in data order over every rank: rank r's sampler (data/datasets.py ResumableSampler, a
    DistributedSampler) takes positions r, r + world, ..., so interleaving the ranks' lists gives the global order."""
    from torch.utils.data import DistributedSampler

    per_rank = []
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=seed, drop_last=True)
        s.set_epoch(epoch)
        per_rank.append(list(s))
    return [per_rank[r][k] for k in range(len(per_rank[0])) for r in range(world)]


class WithPartners(torch.utils.data.Dataset):
    """An unpaired set whose rows carry their KL partner's completion (kl_completion_ids, kl_index)."""

    def __init__(self, rows: Any, partner: Any):
        self.rows, self.partner = rows, partner

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = dict(self.rows[i])
        j = self.partner[i]
        row["kl_completion_ids"], row["kl_index"] = self.rows[j]["completion_ids"], j
        return row


def collate_unpaired(rows: list[dict], pad_id: int, seq_len: int) -> dict[str, torch.Tensor]:
    """B rows -> input_ids, attention_mask, completion_mask [B, T], label (bool) and row_index [B], and the KL rows
    (each prompt + its partner's completion): kl_input_ids, kl_attention_mask, kl_completion_mask, kl_index."""
    prompts = [r["prompt_ids"] for r in rows]
    ids, mask, cmask = padded_rows(prompts, [r["completion_ids"] for r in rows], seq_len, pad_id)
    batch = {"input_ids": ids, "attention_mask": mask, "completion_mask": cmask,
             "label": torch.as_tensor([bool(r["label"]) for r in rows], dtype=torch.bool),
             "row_index": torch.as_tensor([int(r["index"]) for r in rows], dtype=torch.long)}
    if "kl_completion_ids" in rows[0]:
        kl_ids, kl_mask, kl_cmask = padded_rows(prompts, [r["kl_completion_ids"] for r in rows], seq_len, pad_id)
        batch.update(kl_input_ids=kl_ids, kl_attention_mask=kl_mask, kl_completion_mask=kl_cmask,
                     kl_index=torch.as_tensor([int(r["kl_index"]) for r in rows], dtype=torch.long))
    return batch


def prepare_unpaired(raw: Any, raw_eval: Optional[Any], tokenizer: Any, cfg: RunConfig, spec: str) -> PreparedData:
    """KTO's rows: paired data unpaired by rule, labels checked, tokenized as TRL."""
    d = cfg.data
    check_sets(check_columns, raw, raw_eval)
    raw = unpair(raw, fingerprint_of(raw, "unpair"))
    raw_eval = unpair(raw_eval, fingerprint_of(raw_eval, "unpair")) if raw_eval is not None else None
    check_labels(raw, "--data", both=True)
    if raw_eval is not None:
        check_labels(raw_eval, "--eval-data", both=False)
    template = chat_template(tokenizer, d.chat_template) if conversational(raw) else None
    keys = (tokenizer_hash(tokenizer), template, d.seq_len, cfg.pref.max_prompt_len, "unpaired")
    train, stats = tokenize_rows(raw, tokenizer, template, d.seq_len, cfg.pref.max_prompt_len,
                                 fingerprint_of(raw, *keys))
    evals = None
    if raw_eval is not None:
        evals = tokenize_rows(raw_eval, tokenizer, template, d.seq_len, cfg.pref.max_prompt_len,
                              fingerprint_of(raw_eval, *keys))[0]
    if len(train) == 0 or evals is not None and len(evals) == 0:
        raise UserError(f"{'--data ' + spec if len(train) == 0 else '--eval-data'}: every row's prompt fills --seq-len "
                        f"{d.seq_len}; pass a larger --seq-len or --max-prompt-len")
    check_labels(train, "--data (after dropping rows whose prompt fills --seq-len)", both=True)
    desc = f"{spec} (unpaired completions): {stats.line(d.seq_len)}" + \
        (f" / {len(evals)} eval" if evals is not None else "")
    return PreparedData(train, evals, None, None, tokenizer.pad_token_id, desc, pair_len=d.seq_len, reader=READER)


def _read(req: ReadRequest, spec: str, eval_path: Optional[str]) -> PreparedData:
    return prepare_unpaired(*with_eval(req, spec, eval_path), req.tokenizer, req.cfg, spec)


def _collate(rows: list[dict], data: PreparedData) -> dict[str, torch.Tensor]:
    return collate_unpaired(rows, data.pad_id, data.pair_len)


def _train_rows(rows: Any, world: int, seed: int, epoch: int, global_batch: int) -> WithPartners:
    """Each row with its KL partner: the previous row of its global batch in the epoch's order over every rank."""
    if global_batch < 1:
        raise ValueError("train_loader: KTO's rows need the global batch to pair their KL rows")
    return WithPartners(rows, rotated_partners(global_order(len(rows), world, seed, epoch), global_batch))


def _eval_rows(rows: Any) -> WithPartners:
    """Each row with its KL partner: the previous row of the set, in its order."""
    return WithPartners(rows, [(i - 1) % len(rows) for i in range(len(rows))])


READER = DataReader(UNPAIRED, _read, _collate, train_rows=_train_rows, eval_rows=_eval_rows,
                    missing="--task {task} trains on completions labelled desirable or not; pass --data FILE.jsonl "
                    "with prompt, completion and label (true/false) columns, or chosen/rejected pairs")
"""KTO's unpaired completions (or pairs unpaired by rule); no demo set."""

"""Preference data: {prompt, chosen, rejected} pairs tokenized as TRL 1.16's DPOTrainer does, and their batches.

Rows (TRL's conventions):
  strings            {"prompt": "...", "chosen": "...", "rejected": "..."}: EOS is appended to chosen and
                     rejected (unless they end with it); each of prompt, prompt+chosen, prompt+rejected is
                     tokenized as the tokenizer does by default (with its special tokens).
  conversational     chosen/rejected as message lists, with the prompt turns in "prompt" or shared at the
                     start of both (extracted as TRL's extract_prompt does); rendered with the chat template,
                     the prompt with the generation prompt.
The completion starts where the tokenized prompt and prompt+completion diverge (TRL's common prefix), the
loss counts completion tokens only. --seq-len truncates prompt+completion keeping the start (TRL's
max_length, keep_start); a pair whose prompt alone fills --seq-len is dropped; --max-prompt-len (zerotrain's
own) first keeps only the prompt's last tokens.

A batch of B pairs is 2B rows, the B chosen then the B rejected (one concatenated forward), right-padded, with
a completion_mask and each pair's index in the dataset (precomputed reference log-probs are looked up by it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config.schema import RunConfig
from ..errors import UserError
from ..tasks import PREFERENCE_PAIRS, TaskSpec
from .reader import DataReader, PreparedData, ReadRequest, check_sets, fingerprint_of, tokenizer_hash, with_eval
from .sft import chat_ids, chat_template

COLUMNS = ("chosen", "rejected")
"""Required in every row; "prompt" may be implicit (shared leading turns or text)."""
MARGIN = "margin"
"""An optional column of reward-model pairs: how much better chosen is (TRL's RewardTrainer subtracts it inside the
Bradley-Terry loss, Llama 2's margin)."""


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) for a row without a prompt: the longest shared prefix of turns (or characters,
    a space before the split point going with the completion), as TRL's extract_prompt."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def _conversational(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def _check_row(row: dict[str, Any], n: int) -> tuple[Any, Any, Any, bool]:
    """(prompt, chosen, rejected, conversational) of a row, or a one-line UserError naming the row (1-based)."""
    chosen, rejected = row.get("chosen"), row.get("rejected")
    conv = _conversational(chosen) or _conversational(rejected)
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        if conv and not _conversational(value) or not conv and not isinstance(value, str):
            raise UserError(f"--data row {n}: '{name}' must be a string, or a list of {{role, content}} messages "
                            "like the other completion")
    prompt = row.get("prompt")
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    elif conv and not _conversational(prompt) or not conv and not isinstance(prompt, str):
        raise UserError(f"--data row {n}: 'prompt' must be {'a list of messages' if conv else 'a string'} like "
                        "chosen and rejected")
    if chosen == rejected:
        raise UserError(f"--data row {n}: chosen and rejected are the same, so the pair teaches nothing; fix or "
                        "drop the row")
    if not chosen or not rejected:
        raise UserError(f"--data row {n}: chosen or rejected is empty after the shared prompt; fix the row")
    return prompt, chosen, rejected, conv


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(row: dict[str, Any], n: int, tokenizer: Any, template: Optional[str]) -> dict[str, list[int]]:
    """prompt_ids, chosen_ids, rejected_ids of one row, as TRL 1.16 DPOTrainer._prepare_dataset builds them."""
    prompt, chosen, rejected, conv = _check_row(row, n)
    if conv:
        prompt_ids = chat_ids(tokenizer, template, prompt, n, generation=True)
        with_chosen, with_rejected = chat_ids(tokenizer, template, prompt + chosen, n), \
            chat_ids(tokenizer, template, prompt + rejected, n)
    else:
        eos = tokenizer.eos_token or ""
        chosen = chosen if chosen.endswith(eos) else chosen + eos
        rejected = rejected if rejected.endswith(eos) else rejected + eos
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        with_chosen = tokenizer(text=prompt + chosen)["input_ids"]
        with_rejected = tokenizer(text=prompt + rejected)["input_ids"]
    cut = min(_common_prefix(prompt_ids, with_chosen), _common_prefix(prompt_ids, with_rejected))
    return {"prompt_ids": prompt_ids[:cut], "chosen_ids": with_chosen[cut:], "rejected_ids": with_rejected[cut:]}


@dataclass
class PairStats:
    """What tokenizing did to the pairs (the start banner's data line)."""

    kept: int = 0
    truncated: int = 0
    """Pairs whose chosen or rejected sequence is cut at --seq-len."""
    dropped: int = 0
    """Pairs whose prompt alone fills --seq-len (nothing of the completion would remain)."""
    prompt_cut: int = 0
    """Pairs whose prompt --max-prompt-len shortened."""
    dropped_why: str = "prompt fills"
    """Why pairs were dropped: their prompt fills --seq-len, or (reward models) they are longer than it."""
    unit: str = "pairs"
    """What was counted: pairs, or KTO's single rows (zerotrain/data/unpaired.py)."""
    classes: str = ""
    """KTO: "N desirable, M undesirable; " (the line shows the class balance)."""

    def line(self, seq_len: int) -> str:
        cut = f", {self.prompt_cut} prompts cut to --max-prompt-len" if self.prompt_cut else ""
        return (f"{self.kept} {self.unit} ({self.classes}{self.truncated} truncated, {self.dropped} dropped: "
                f"{self.dropped_why} --seq-len {seq_len}{cut})")


def check_columns(ds: Any, flag: str = "--data") -> None:
    """Refuse (one line) a dataset without the chosen and rejected columns."""
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise UserError(f"{flag}: preference rows need 'chosen' and 'rejected' (and 'prompt' unless it is shared at "
                        f"their start); missing {', '.join(repr(c) for c in missing)} (columns: "
                        f"{', '.join(ds.column_names)})")


def conversational(ds: Any) -> bool:
    """Whether the pairs are message lists (rendered with a chat template) rather than strings."""
    return _conversational(ds[0]["chosen"])


def _margin(row: dict[str, Any], n: int) -> float:
    value = row[MARGIN]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise UserError(f"--data row {n}: '{MARGIN}' is {value!r}; a pair's margin is a number (how much better "
                        "chosen is than rejected; 0 for none)")
    return float(value)


def tokenize_pairs(ds: Any, tokenizer: Any, template: Optional[str], seq_len: int,
                   max_prompt_len: Optional[int], fingerprint: str, drop_long: bool = False) -> tuple[Any, PairStats]:
    """The tokenized pairs (prompt_ids, chosen_ids, rejected_ids, index, and margin where the data has that column)
    of a datasets.Dataset and their stats. drop_long: a pair longer than seq_len is dropped rather than cut (reward
    models score a sequence whole: TRL's RewardTrainer filters them). Raises a one-line UserError on a missing column
    or a bad row."""
    check_columns(ds)
    margins = MARGIN in ds.column_names

    def fn(batch: dict[str, list], idx: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "index": [],
                                "truncated": [], "prompt_cut": [], **({MARGIN: []} if margins else {})}
        for j, i in enumerate(idx):
            row = {k: batch[k][j] for k in batch}
            enc = tokenize_pair(row, i + 1, tokenizer, template)
            if margins:
                out[MARGIN].append(_margin(row, i + 1))
            prompt = enc["prompt_ids"]
            cut = max_prompt_len is not None and len(prompt) > max_prompt_len
            if cut:
                prompt = prompt[len(prompt) - max_prompt_len:]
            out["prompt_ids"].append(prompt)
            out["chosen_ids"].append(enc["chosen_ids"])
            out["rejected_ids"].append(enc["rejected_ids"])
            out["index"].append(i)
            longest = len(prompt) + max(len(enc["chosen_ids"]), len(enc["rejected_ids"]))
            out["truncated"].append(longest > seq_len)
            out["prompt_cut"].append(cut)
        return out

    pairs = ds.map(fn, batched=True, batch_size=1000, with_indices=True, remove_columns=ds.column_names,
                   new_fingerprint=fingerprint, desc="tokenizing pairs")
    n_in = len(pairs)
    if drop_long:
        kept = pairs.filter(lambda t: not t, input_columns="truncated", new_fingerprint=fingerprint + "-whole")
    else:
        kept = pairs.filter(lambda p: len(p) < seq_len, input_columns="prompt_ids",
                            new_fingerprint=fingerprint + "-kept")
    stats = PairStats(kept=len(kept), truncated=sum(kept["truncated"]), dropped=n_in - len(kept),
                      prompt_cut=sum(pairs["prompt_cut"]), dropped_why="longer than" if drop_long else "prompt fills")
    return kept.remove_columns(["truncated", "prompt_cut"]), stats


def padded_rows(prompts: list, completions: list, seq_len: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """input_ids, attention_mask, completion_mask (1 on completion tokens) of prompt + completion rows cut at seq_len
    keeping the start, right-padded (preference pairs' rows, KTO's rows and their KL rows)."""
    seqs = [(list(p) + list(c))[:seq_len] for p, c in zip(prompts, completions)]
    marks = [([0] * len(p) + [1] * len(c))[:seq_len] for p, c in zip(prompts, completions)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    cmask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, c) in enumerate(zip(seqs, marks)):
        ids[i, :len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
        cmask[i, :len(c)] = torch.as_tensor(c, dtype=torch.long)
    return ids, mask, cmask


def collate_pairs(rows: list[dict], pad_id: int, seq_len: int) -> dict[str, torch.Tensor]:
    """B pairs -> 2B rows (chosen then rejected) cut at seq_len keeping the start, right-padded:
    input_ids, attention_mask, completion_mask (1 on completion tokens), pair_index [B] and, where the data has a
    margin column (reward models), margin [B]."""
    sides = ("chosen_ids", "rejected_ids")
    ids, mask, cmask = padded_rows([r["prompt_ids"] for _ in sides for r in rows],
                                   [r[side] for side in sides for r in rows], seq_len, pad_id)
    batch = {"input_ids": ids, "attention_mask": mask, "completion_mask": cmask,
             "pair_index": torch.as_tensor([int(r["index"]) for r in rows], dtype=torch.long)}
    if MARGIN in rows[0]:
        batch[MARGIN] = torch.as_tensor([float(r[MARGIN]) for r in rows], dtype=torch.float32)
    return batch


def prepare_pairs(raw: Any, raw_eval: Optional[Any], tokenizer: Any, cfg: RunConfig, spec: str,
                  task: TaskSpec) -> PreparedData:
    """Preference pairs of the train and eval rows (task: the run's, RunPlan.task)."""
    d = cfg.data
    check_sets(check_columns, raw, raw_eval)
    template = chat_template(tokenizer, d.chat_template) if conversational(raw) else None
    drop_long = task.reward_model is not None  # a reward model scores each sequence whole (TRL drops longer pairs)
    keys = (tokenizer_hash(tokenizer), template, d.seq_len, cfg.pref.max_prompt_len, drop_long, "pairs")
    train, stats = tokenize_pairs(raw, tokenizer, template, d.seq_len, cfg.pref.max_prompt_len,
                                  fingerprint_of(raw, *keys), drop_long)
    evals = None
    if raw_eval is not None:
        evals = tokenize_pairs(raw_eval, tokenizer, template, d.seq_len, cfg.pref.max_prompt_len,
                               fingerprint_of(raw_eval, *keys), drop_long)[0]
    fix = "pass a larger --seq-len" + ("" if drop_long else " or --max-prompt-len")
    if len(train) == 0:
        raise UserError(f"--data {spec}: every pair is dropped at --seq-len {d.seq_len} ({stats.line(d.seq_len)}); "
                        f"{fix}")
    if evals is not None and len(evals) == 0:
        raise UserError(f"--eval-data: every eval pair is dropped at --seq-len {d.seq_len}; {fix}")
    desc = f"{spec} (preference pairs): {stats.line(d.seq_len)}" + (f" / {len(evals)} eval" if evals is not None else "")
    return PreparedData(train, evals, task.head_labels, None, tokenizer.pad_token_id, desc, pair_len=d.seq_len,
                        reader=READER)


def _read(req: ReadRequest, spec: str, eval_path: Optional[str]) -> PreparedData:
    return prepare_pairs(*with_eval(req, spec, eval_path), req.tokenizer, req.cfg, spec, req.task)


def _collate(rows: list[dict], data: PreparedData) -> dict[str, torch.Tensor]:
    return collate_pairs(rows, data.pad_id, data.pair_len)


READER = DataReader(PREFERENCE_PAIRS, _read, _collate, missing="--task {task} trains on preference pairs; pass --data "
                    "FILE.jsonl with prompt, chosen and rejected columns")
"""Preference pairs (DPO, SimPO, ORPO, reward models); no demo set."""

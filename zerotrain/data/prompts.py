"""GRPO's prompt set (--task grpo): TRL 1.16's prompt format tokenized as GRPOTrainer._tokenize_prompts does.

Rows (TRL's conventions):
  strings            {"prompt": "...", ...}: tokenized as the tokenizer does by default (with its special tokens),
                     tokenizer(text=prompt).
  conversational     {"prompt": [{"role": ..., "content": ...}, ...], ...}: rendered with the chat template and its
                     generation prompt and tokenized in one call, apply_chat_template(..., add_generation_prompt=True,
                     tokenize=True).
Every other column is kept as it is: TRL passes each to the reward functions as a keyword argument (a list, one
value per completion). --max-prompt-len keeps a prompt's LAST tokens (TRL's left truncation side); a prompt of no
token is dropped (nothing to generate from) and counted. Each row keeps its index in the dataset ("prompt_index"),
which sampling seeds and logs name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..config.schema import RunConfig
from ..errors import UserError
from ..tasks import PROMPTS
from .reader import DataReader, PreparedData, ReadRequest, fingerprint_of, load_raw, tokenizer_hash
from .sft import chat_ids, chat_template

ADDED = ("prompt_ids", "prompt_index")
"""The columns tokenize_prompts adds (a dataset may not hold them already)."""


def _messages(value: Any) -> bool:
    """TRL's is_conversational on one prompt: a list whose first item is a dict with a role."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def check_prompt_columns(ds: Any, flag: str = "--data") -> None:
    """Refuse (one line) a dataset without a "prompt" column, or one holding a column tokenize_prompts adds."""
    if "prompt" not in ds.column_names:
        raise UserError(f"{flag}: --task grpo rows need a 'prompt' column (a string, or a list of {{role, content}} "
                        f"messages); columns found: {', '.join(ds.column_names) or 'none'}")
    taken = [c for c in ADDED if c in ds.column_names]
    if taken:
        raise UserError(f"{flag}: the column {taken[0]!r} is zerotrain's own for --task grpo; rename it")
    if len(ds) == 0:
        raise UserError(f"{flag}: no rows; --task grpo needs prompts")


def conversational(ds: Any) -> bool:
    """Whether the prompts are message lists (rendered with a chat template) rather than strings (TRL's
    is_conversational, read on the first row)."""
    return _messages(ds[0]["prompt"])


@dataclass
class PromptStats:
    """What tokenizing did to the prompts (the start banner's data line)."""

    rows: int = 0
    """Prompts kept."""
    longest: int = 0
    """Tokens of the longest kept prompt (after the cut)."""
    max_prompt_len: Optional[int] = None
    """--max-prompt-len (None: prompts are not cut)."""
    truncated: int = 0
    """Prompts --max-prompt-len cut (their first tokens dropped)."""
    dropped: int = 0
    """Prompts of no token (dropped: nothing to generate from)."""

    def line(self) -> str:
        cut = f", {self.truncated} cut to --max-prompt-len {self.max_prompt_len}" if self.max_prompt_len else ""
        return f"{self.rows} prompts (longest {self.longest} tokens{cut}, {self.dropped} empty dropped)"


def prompt_ids(prompt: Any, row: int, conv: bool, tokenizer: Any, template: Optional[str]) -> list[int]:
    """The token ids of one prompt as TRL 1.16 GRPOTrainer._tokenize_prompts makes them, or a one-line UserError
    naming the row (1-based)."""
    if conv:
        if not isinstance(prompt, list) or not prompt or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and m.get("content") is not None
                for m in prompt):  # datasets fills a key another row has with None: check the values
            raise UserError(f"--data row {row}: 'prompt' must be a list of {{role, content}} messages like the first "
                            "row's")
        return chat_ids(tokenizer, template, prompt, row, generation=True)
    if not isinstance(prompt, str):
        raise UserError(f"--data row {row}: 'prompt' must be a string like the first row's (or every row a list "
                        "of {role, content} messages)")
    return list(tokenizer(text=prompt)["input_ids"])


def tokenize_prompts(ds: Any, tokenizer: Any, template: Optional[str], max_prompt_len: Optional[int],
                     fingerprint: str) -> tuple[Any, PromptStats]:
    """The rows of a datasets.Dataset with "prompt_ids" and "prompt_index" added (every column kept), prompts of
    no token dropped, and their stats. template: the chat template of conversational prompts (data/sft.py
    chat_template; None for string prompts). Raises a one-line UserError on a missing column or a bad row."""
    check_prompt_columns(ds)
    conv = conversational(ds)
    if max_prompt_len is not None and max_prompt_len < 1:
        raise UserError(f"--max-prompt-len {max_prompt_len}: keep at least 1 token (or leave it unset)")

    def fn(batch: dict[str, list], idx: list[int]) -> dict[str, list]:
        out: dict[str, list] = {"prompt_ids": [], "prompt_index": [], "_cut": []}
        for j, i in enumerate(idx):
            ids = prompt_ids(batch["prompt"][j], i + 1, conv, tokenizer, template)
            cut = max_prompt_len is not None and len(ids) > max_prompt_len
            out["prompt_ids"].append(ids[len(ids) - max_prompt_len:] if cut else ids)
            out["prompt_index"].append(i)
            out["_cut"].append(cut)
        return out

    rows = ds.map(fn, batched=True, batch_size=1000, with_indices=True, new_fingerprint=fingerprint,
                  desc="tokenizing prompts")
    kept = rows.filter(lambda p: len(p) > 0, input_columns="prompt_ids", new_fingerprint=fingerprint + "-kept")
    lengths = [len(p) for p in kept["prompt_ids"]]
    stats = PromptStats(rows=len(kept), dropped=len(rows) - len(kept), truncated=sum(kept["_cut"]),
                        longest=max(lengths, default=0), max_prompt_len=max_prompt_len)
    if not len(kept):
        raise UserError("--data: every prompt tokenized to no token; give prompts with text")
    return kept.remove_columns(["_cut"]), stats


def collate_prompts(rows: list[dict], pad_id: int) -> dict[str, Any]:
    """A batch of prompts for the rollout loop: "prompt_ids" (one unpadded LongTensor each), "input_ids" and
    "attention_mask" (left-padded with pad_id, as TRL pads prompts for generation), "prompt_index" (LongTensor),
    "prompt" (the raw values, what reward functions get as prompts=) and "columns" (every other dataset column as
    a list: the reward functions' keyword arguments)."""
    ids = [torch.as_tensor(list(r["prompt_ids"]), dtype=torch.long) for r in rows]
    width = max((len(t) for t in ids), default=0)
    padded = torch.full((len(ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, t in enumerate(ids):
        if len(t):
            padded[i, width - len(t):] = t
            mask[i, width - len(t):] = 1
    names = [k for k in (rows[0] if rows else {}) if k not in ADDED and k != "prompt"]
    return {"prompt_ids": ids, "input_ids": padded, "attention_mask": mask,
            "prompt_index": torch.as_tensor([int(r["prompt_index"]) for r in rows], dtype=torch.long),
            "prompt": [r["prompt"] for r in rows], "columns": {k: [r[k] for r in rows] for k in names}}


def prepare_prompts(raw: Any, tokenizer: Any, cfg: RunConfig, spec: str) -> PreparedData:
    """Online RL's prompts: rendered with the chat template and its generation prompt where they are messages, cut
    to their last --max-prompt-len tokens."""
    check_prompt_columns(raw)
    template = chat_template(tokenizer, cfg.data.chat_template) if conversational(raw) else None
    keys = (tokenizer_hash(tokenizer), template, cfg.pref.max_prompt_len, "prompts")
    train, stats = tokenize_prompts(raw, tokenizer, template, cfg.pref.max_prompt_len, fingerprint_of(raw, *keys))
    if len(train) == 0:
        raise UserError(f"--data {spec}: no prompt has a token ({stats.line()}); pass prompts with text")
    return PreparedData(train, None, None, None, tokenizer.pad_token_id, f"{spec} (prompts): {stats.line()}",
                        reader=READER)


def _read(req: ReadRequest, spec: str, eval_path: Optional[str]) -> PreparedData:
    """The prompts alone: _check refused evaluation (eval_path is None, no --eval-split)."""
    d = req.cfg.data
    return prepare_prompts(load_raw(spec, "--data", d.data_config, d.split), req.tokenizer, req.cfg, spec)


def _collate(rows: list[dict], data: PreparedData) -> dict[str, Any]:
    return collate_prompts(rows, data.pad_id)


def _check(cfg: RunConfig) -> None:
    d = cfg.data
    if d.eval_path or d.eval_split > 0:
        raise UserError(f"--task {cfg.model.task} with {'--eval-data' if d.eval_path else '--eval-split'}: evaluation "
                        "of online RL (generating and scoring held-out prompts) is not built yet; drop it")


READER = DataReader(PROMPTS, _read, _collate, check=_check,
                    missing="--task {task} samples completions of prompts; pass --data FILE.jsonl with a prompt column "
                    "(a string or chat messages; its other columns reach the reward functions)")
"""Online RL's prompts (GRPO); no demo set, no evaluation."""

"""Instruction and chat data: formats, the chat template, assistant-only labels, document-separated packing.

Formats (`--data-format`, auto by columns):
  chat               {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
  prompt-completion  {"prompt": "...", "completion": "..."}, or Alpaca {"instruction", "input", "output"}
  text               {"text": "..."} (text_column)

A chat sample is rendered with the tokenizer's own chat template (or --chat-template); its labels are
the token ids inside assistant turns (each turn's end-of-turn tokens included: the model learns to
stop) and -100 elsewhere. Turn boundaries are found in characters, not tokens: assistant turn i spans
render(messages[:i], add_generation_prompt=True) .. render(messages[:i+1]), and the tokenizer's offsets
say which tokens fall inside, so no assumption about how the template tokenizes is needed.
Prompt-completion samples are prompt tokens + completion tokens + EOS, labels on the completion.

Packing (`--packing`): samples are laid into rows of seq_len in order (a sample that does not fit opens
a new row); position ids restart at 0 for each sample, and the batch carries no attention_mask, which
makes transformers build a block-diagonal causal mask from the position ids
(masking_utils.find_packed_sequence_indices), so attention never crosses a sample. The first token of
each packed sample gets label -100: nothing is predicted across a boundary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config.schema import RunConfig
from ..errors import UserError
from .reader import MAP_PROCS, counted, fingerprint_of, tokenizer_hash

IGNORE = -100
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
"""The ChatML template (--chat-template chatml), for tokenizers without one of their own."""
ROLES = ("system", "user", "assistant", "tool")


def detect_format(columns: list[str], text_column: str, asked: str, spec: str) -> str:
    """The data format: the asked one (checked against the columns) or, for auto, the one the columns show."""
    has = set(columns)
    found = ("chat" if "messages" in has else
             "prompt-completion" if {"prompt", "completion"} <= has or {"instruction", "output"} <= has else
             "text" if text_column in has else None)
    need = {"chat": "'messages' column", "prompt-completion": "'prompt' and 'completion' (or Alpaca "
            "'instruction' and 'output') columns", "text": f"'{text_column}' column (--text-column)"}
    if asked == "auto":
        return found or "text"  # plain text is the default: a missing column is then named with --text-column
    ok = {"chat": "messages" in has, "text": text_column in has,
          "prompt-completion": {"prompt", "completion"} <= has or {"instruction", "output"} <= has}[asked]
    if not ok:
        raise UserError(f"--data-format {asked}: --data {spec} has no {need[asked]} (columns: {', '.join(columns)})")
    return asked


def chat_template(tokenizer: Any, option: Optional[str]) -> str:
    """The Jinja template chat data is rendered with: --chat-template (chatml or a file), else the tokenizer's."""
    if option:
        if option.lower() == "chatml":
            return CHATML
        p = Path(option).expanduser()
        if not p.is_file():
            raise UserError(f"--chat-template {option}: no such file; pass a Jinja template file or 'chatml'")
        return p.read_text()
    own = getattr(tokenizer, "chat_template", None)
    if not own:
        raise UserError("chat data needs a chat template and the tokenizer has none; pass --chat-template chatml "
                        "or --chat-template FILE.jinja")
    return own if isinstance(own, str) else own.get("default", next(iter(own.values())))


@dataclass
class Encoded:
    """Token ids and labels of the samples of one map batch, and what was cut or dropped."""

    input_ids: list[list[int]] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)
    truncated: int = 0
    dropped: int = 0


def _check_messages(messages: Any, row: int) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise UserError(f"--data row {row}: 'messages' must be a non-empty list of {{role, content}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"--data row {row}: message {i} lacks a 'role' or 'content' key; every message needs both")
        if m["role"] not in ROLES:
            raise UserError(f"--data row {row}: message {i} has role {m['role']!r}; use one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise UserError(f"--data row {row}: message {i} content is not a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"--data row {row}: no assistant message; a chat sample needs at least one to learn from")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _render(tokenizer: Any, template: Optional[str], messages: list[dict], row: int, generation: bool = False,
            tokenize: bool = False) -> Any:
    """The conversation rendered with the chat template (text; tokenize: its token ids, as apply_chat_template
    tokenizes them), or a one-line UserError naming the row."""
    try:
        out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=tokenize,
                                            add_generation_prompt=generation, **({"return_dict": True} if tokenize else {}))
    except Exception as e:  # noqa: BLE001 - jinja errors of every kind are the template's
        raise UserError(f"--data row {row}: the chat template failed to render it ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); fix the row or pass another --chat-template") from None
    return list(out["input_ids"]) if tokenize else out


def chat_ids(tokenizer: Any, template: Optional[str], messages: list[dict], row: int,
             generation: bool = False) -> list[int]:
    """The token ids of a conversation as TRL 1.16 makes them (apply_chat_template with tokenize=True: the template's
    own special tokens, none added again), with the generation prompt when `generation`; one-line UserError naming
    the row when the template fails (preference pairs and online RL's prompts)."""
    return _render(tokenizer, template, messages, row, generation, tokenize=True)


def render_chat(tokenizer: Any, template: str, messages: list[dict], row: int) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, the character spans of its assistant turns)."""
    text = _render(tokenizer, template, messages, row)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, template, messages[:i], row, generation=True) if i else ""
        through = _render(tokenizer, template, messages[:i + 1], row)
        if not text.startswith(through) or not through.startswith(before):
            raise UserError(f"--data row {row}: the chat template does not render a conversation as a prefix of "
                            "its continuation, so assistant turns cannot be located; pass --chat-template chatml")
        spans.append((len(before), len(through)))
    return text, spans


def _char_mask_to_labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    def inside(a: int, b: int) -> bool:
        return b > a and any(s <= a and b <= e for s, e in spans)

    return [t if inside(a, b) else IGNORE for t, (a, b) in zip(ids, offsets)]


def encode(batch: dict[str, list], fmt: str, tokenizer: Any, template: Optional[str], seq_len: int,
           train_on_prompt: bool, truncation: str, text_column: str, first_row: int = 0) -> Encoded:
    """Token ids + labels of one map batch of rows in format fmt (truncated or dropped at seq_len)."""
    out = Encoded()
    eos = tokenizer.eos_token_id
    n = len(next(iter(batch.values())))
    for j in range(n):
        row = first_row + j + 1  # 1-based, as a user counts lines
        if fmt == "chat":
            messages = _check_messages(batch["messages"][j], row)
            text, spans = render_chat(tokenizer, template, messages, row)
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = enc["input_ids"]
            labels = list(ids) if train_on_prompt else _char_mask_to_labels(ids, enc["offset_mapping"], spans)
        elif fmt == "prompt-completion":
            if "prompt" in batch:
                prompt, completion = batch["prompt"][j], batch["completion"][j]
            else:
                extra = batch["input"][j] if "input" in batch else ""
                prompt = batch["instruction"][j] + (f"\n\n{extra}" if extra else "") + "\n\n"
                completion = batch["output"][j]
            if not isinstance(prompt, str) or not isinstance(completion, str):
                raise UserError(f"--data row {row}: prompt and completion must be strings")
            p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            c = tokenizer(completion, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
            ids = p + c
            labels = list(ids) if train_on_prompt else [IGNORE] * len(p) + list(c)
        else:
            t = batch[text_column][j]
            if not isinstance(t, str) or not t:
                continue
            ids = tokenizer(t, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
            labels = list(ids)
        if len(ids) > seq_len:
            if truncation == "drop":
                out.dropped += 1
                continue
            ids, labels = ids[:seq_len], labels[:seq_len]
            out.truncated += 1
        if sum(lab != IGNORE for lab in labels[1:]) == 0:  # nothing left to learn (e.g. the answer was cut off)
            out.dropped += 1
            continue
        out.input_ids.append(ids)
        out.labels.append(labels)
    return out


def pack(input_ids: list[list[int]], labels: list[list[int]], seq_len: int) -> dict[str, list[list[int]]]:
    """Lay samples into rows of at most seq_len tokens, in order; per-sample position ids restart at 0 and
    each sample's first label is -100 (nothing is predicted across a boundary)."""
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    cur_pos: list[int] = []
    for ids, labs in zip(input_ids, labels):
        if cur_ids and len(cur_ids) + len(ids) > seq_len:
            rows["input_ids"].append(cur_ids)
            rows["labels"].append(cur_labels)
            rows["position_ids"].append(cur_pos)
            cur_ids, cur_labels, cur_pos = [], [], []
        cur_ids = cur_ids + list(ids)
        cur_labels = cur_labels + [IGNORE] + list(labs[1:])
        cur_pos = cur_pos + list(range(len(ids)))
    if cur_ids:
        rows["input_ids"].append(cur_ids)
        rows["labels"].append(cur_labels)
        rows["position_ids"].append(cur_pos)
    return rows


def tokenize_samples(ds, tokenizer, fmt: str, template: Optional[str], cfg: RunConfig) -> tuple[Any, str]:
    """Chat / prompt-completion / per-document text samples -> input_ids + token labels (encode),
    packed into rows with restarting position_ids under --packing. Returns (dataset, one-line stats:
    truncated and dropped samples, packing efficiency)."""
    d = cfg.data
    keys = (tokenizer_hash(tokenizer), fmt, template, d.seq_len, d.train_on_prompt, d.truncation, d.text_column)

    def fn(batch, idx):
        enc = encode(batch, fmt, tokenizer, template, d.seq_len, d.train_on_prompt, d.truncation,
                     d.text_column, first_row=idx[0])
        # one status row per kept sample, plus one empty row per cut sample (filtered out below)
        n_cut = enc.dropped
        return {"input_ids": enc.input_ids + [[]] * n_cut, "labels": enc.labels + [[]] * n_cut,
                "truncated": [i < enc.truncated for i in range(len(enc.input_ids))] + [False] * n_cut}

    samples = ds.map(counted(fn), batched=True, batch_size=1000, with_indices=True, remove_columns=ds.column_names,
                     new_fingerprint=fingerprint_of(ds, *keys, "samples"), desc="tokenizing", **MAP_PROCS)
    n_in, truncated = len(samples), sum(samples["truncated"])
    samples = samples.filter(lambda r: len(r) > 0, input_columns="input_ids",
                             new_fingerprint=fingerprint_of(ds, *keys, "kept"))
    dropped = n_in - len(samples)
    samples = samples.remove_columns("truncated")
    stats = f"{len(samples)} samples ({truncated} truncated, {dropped} dropped at --seq-len {d.seq_len})"
    if d.packing == "off":
        return samples, stats
    real = sum(len(x) for x in samples["input_ids"])
    packed = samples.map(lambda b: pack(b["input_ids"], b["labels"], d.seq_len), batched=True, batch_size=1000,
                         remove_columns=samples.column_names, new_fingerprint=fingerprint_of(ds, *keys, "packed"),
                         desc="packing")
    efficiency = real / max(1, len(packed) * d.seq_len)
    return packed, f"{stats}; packed into {len(packed)} rows, efficiency {100 * efficiency:.1f}% (real tokens / row tokens)"


def supports_packing(model_class: type) -> bool:
    """Whether the model builds its causal mask through transformers' masking_utils, which turns
    restarting position ids (and no attention_mask) into a block-diagonal mask."""
    import sys

    module = sys.modules.get(model_class.__module__)
    return module is not None and hasattr(module, "create_causal_mask")

"""Chats with images for image-text models (tasks.py's image-text entry): TRL's vision format -> token ids, labels, and
the images' paths; the pixels are decoded per micro-batch in the loader (its workers under --loader-workers).

A row is TRL's: `messages` whose contents are strings or lists of parts ({"type": "image"}, {"type": "text", "text":
...}) and `images`, the image files in the order of the image parts (a path absolute or relative to the data file's
folder).

Tokens, before training (cached by datasets like the text paths): the conversation is rendered with the processor's
chat template and run through the processor itself, so every image placeholder is expanded exactly as the model
expects (LLaVA's <image> repeats, Qwen2-VL's grid-sized <|image_pad|> runs, Gemma 3's boi + soft tokens + eoi). The
number of an image's tokens depends only on its size (read from the file header: nothing is decoded here), so the
processor is given blank images of those sizes. The processor's per-token outputs other than the ids (Gemma 3's
token_type_ids, Qwen2-VL's mm_token_type_ids) are kept as columns; its pixel outputs are not.

Labels: the assistant turns' tokens, found in characters as the text SFT path finds them (zerotrain/data/sft.py):
the template's {% generation %} spans where it has them (transformers' own renderer), else the prefix rule
(render(messages[:i], generation prompt) .. render(messages[:i+1])); the spans are moved past each expanded image
placeholder by the processor's text_replacement_offsets and matched against the token offsets. An image's tokens
are never labelled (--train-on-prompt labels every other token).

--truncation: drop drops a sample longer than --seq-len; truncate cuts it at --seq-len unless the cut falls inside
or before an image's tokens (the model needs each image's tokens whole): such a sample is dropped and counted.

Collating (collate_images): the ids, labels and per-token columns right-padded; the images opened and run through
the processor's image side (pixel_values; image_grid_thw for Qwen2-VL).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Optional

import torch

from ..config.schema import RunConfig
from ..errors import UserError
from ..tasks import IMAGE_CHAT
from . import prepared
from .reader import DataReader, PreparedData, ReadRequest, fingerprint_of, tokenizer_hash, with_eval
from .sft import IGNORE, chat_template, render_chat

TEXT_KEYS = ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets")
"""Processor outputs that are not kept as per-token columns (the ids are kept as input_ids; the mask is rebuilt)."""


def check_settings(cfg: Any) -> None:
    """The settings an image-text run refuses (one line each): packing (an image's tokens would share a row with
    another sample's), --data-weights (one dataset), a text --data-format."""
    d = cfg.data
    if d.packing != "off":
        raise UserError(f"--packing {d.packing} with an image-text model: packing samples with images is not built "
                        "yet; pass --packing off")
    if d.data_weights is not None:
        raise UserError(f"--data-weights {d.data_weights} with an image-text model: mixtures of image chats are not "
                        "built yet; drop --data-weights")
    if d.format not in ("auto", "chat"):
        raise UserError(f"--data-format {d.format} with an image-text model: it trains on chats with images "
                        "(TRL's vision format: messages + images); drop --data-format")


def check_columns(ds: Any, flag: str, spec: str) -> None:
    if len(ds) == 0:
        raise UserError(f"{flag} {spec}: the dataset is empty; pass data with rows")
    missing = [c for c in ("messages", "images") if c not in ds.column_names]
    if missing:
        raise UserError(f"{flag} {spec}: no column {' or '.join(repr(c) for c in missing)} (columns: "
                        f"{', '.join(ds.column_names)}); an image-text model trains on TRL's vision format: messages "
                        "with {\"type\": \"image\"} / {\"type\": \"text\"} parts and an images column of paths")


def _messages(messages: Any, row: int, flag: str) -> tuple[list[dict], int]:
    """The row's messages (checked) and how many image parts they hold."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{flag} row {row}: 'messages' must be a non-empty list of {{role, content}}")
    n_images, out = 0, []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"{flag} row {row}: message {i} lacks a 'role' or 'content' key; every message needs both")
        content = m["content"]
        if isinstance(content, list):
            parts = []
            for p in content:
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "image":
                    n_images += 1
                    parts.append({"type": "image"})
                elif kind == "text" and isinstance(p.get("text"), str):
                    parts.append({"type": "text", "text": p["text"]})
                else:
                    raise UserError(f"{flag} row {row}: message {i} has a content part that is neither "
                                    "{\"type\": \"image\"} nor {\"type\": \"text\", \"text\": STRING}")
            content = parts
        elif not isinstance(content, str):
            raise UserError(f"{flag} row {row}: message {i} content is neither a string nor a list of parts")
        out.append({"role": m["role"], "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise UserError(f"{flag} row {row}: no assistant message; a chat sample needs at least one to learn from")
    return out, n_images


def image_paths(images: Any, n_parts: int, row: int, flag: str, base: Optional[Path]) -> list[str]:
    """The row's image files (absolute), checked to exist, as many as its image parts."""
    images = [] if images is None else images if isinstance(images, list) else [images]
    if n_parts == 0:  # refused rather than run through a dummy image: nothing of it would be learned, at a tower pass
        raise UserError(f"{flag} row {row}: no image part in its messages; a micro-batch without an image skips the "
                        "image tower, whose sharded parameters (ZeRO-3, FSDP2) every rank must gather together, so "
                        "the run would hang; give every chat an image, or drop the text-only rows")
    if len(images) != n_parts:
        raise UserError(f"{flag} row {row}: {len(images)} image(s) in 'images' but {n_parts} image part(s) in its "
                        "messages; give one image per {\"type\": \"image\"} part")
    out = []
    for p in images:
        if not isinstance(p, str):
            raise UserError(f"{flag} row {row}: an 'images' entry is not a path ({type(p).__name__}); give image "
                            "file paths")
        path = Path(p).expanduser()
        if not path.is_absolute() and base is not None:
            path = base / path
        if not path.is_file():
            raise UserError(f"{flag} row {row}: image {p} does not exist; fix the path (relative paths are read from "
                            "the data file's folder)")
        out.append(str(path))
    return out


def _image_size(path: str, row: int, flag: str) -> tuple[int, int]:
    """(width, height) from the file header (nothing decoded); one line naming the row when it is no image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return im.size
    except (UnidentifiedImageError, OSError) as e:
        raise UserError(f"{flag} row {row}: image {path} cannot be read ({type(e).__name__}); fix or drop it") from None


def has_markers(template: str) -> bool:
    """Whether a chat template marks the assistant's tokens with {% generation %} (transformers' own check)."""
    import re

    return re.search(r"\{\%-?\s*generation\s*-?\%\}", template) is not None


def _spans(processor: Any, template: str, messages: list[dict], row: int) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, its assistant spans in characters): the template's {% generation %} spans where it
    has them, else sft.render_chat's prefix rule."""
    tok = processor.tokenizer
    if not has_markers(template):
        return render_chat(tok, template, messages, row)
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, indices = render_jinja_template(conversations=[messages], chat_template=template,
                                                  return_assistant_tokens_mask=True, **tok.special_tokens_map)
    except Exception as e:  # noqa: BLE001 - jinja errors of every kind are the template's
        raise UserError(f"--data row {row}: the chat template failed to render it ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); fix the row or pass another --chat-template") \
            from None
    return rendered[0], [tuple(s) for s in indices[0]]


FATES = ("kept", "truncated", "dropped", "image_cut")
"""What encoding does to a row: kept whole, cut at --seq-len, dropped (longer than --seq-len under --truncation drop,
or nothing left to learn), dropped because the cut would split an image's tokens."""


def stats_line(fates: list[str], seq_len: int) -> str:
    """The banner's account of the rows' fates."""
    n = {f: fates.count(f) for f in FATES}
    return (f"{n['kept'] + n['truncated']} samples ({n['truncated']} truncated, {n['dropped']} dropped at --seq-len "
            f"{seq_len}, {n['image_cut']} dropped because the cut would split an image's tokens)")


def encode_row(processor: Any, template: str, messages: list[dict], paths: list[str], row: int, seq_len: int,
               train_on_prompt: bool, truncation: str, flag: str = "--data") -> tuple[Optional[dict], str]:
    """One row's columns (input_ids, labels, the processor's per-token columns, images) and its fate: "kept",
    "truncated", "dropped" or "image_cut" (the columns None for the last two)."""
    from PIL import Image

    text, spans = _spans(processor, template, messages, row)
    blanks = [Image.new("RGB", _image_size(p, row, flag)) for p in paths]
    try:
        out = processor(text=[text], images=[blanks] if blanks else None, add_special_tokens=False,
                        return_offsets_mapping=True, return_text_replacement_offsets=True)
    except (ValueError, TypeError) as e:
        raise UserError(f"{flag} row {row}: the processor refused it ({str(e).splitlines()[0]}); check that the "
                        "row's image parts match its images") from None
    ids = list(out["input_ids"][0])
    offsets = [tuple(o) for o in out["offset_mapping"][0]]
    replaced = (out.get("text_replacement_offsets") or [[]])[0]
    ends = [r["span"][1] for r in replaced]
    gained = [r["new_span"][1] - r["span"][1] for r in replaced]

    def moved(char: int) -> int:
        """A rendered-text position in the processor's expanded text."""
        return char + sum(g for end, g in zip(ends, gained) if end <= char)

    spans = [(moved(a), moved(b)) for a, b in spans]
    images = [tuple(r["new_span"]) for r in replaced if r.get("type", "image") == "image"]
    image_id = getattr(processor, "image_token_id", None)

    def overlaps(i: int, spans: list[tuple[int, int]], whole: bool) -> bool:
        a, b = offsets[i]
        if whole:  # the token lies inside a span (a zero-width token: none)
            return b > a and any(s <= a and b <= e for s, e in spans)
        return any((s < b and a < e) if b > a else s <= a < e for s, e in spans)

    image_tok = [ids[i] == image_id or overlaps(i, images, whole=False) for i in range(len(ids))]
    labels = [IGNORE if image_tok[i] or not (train_on_prompt or overlaps(i, spans, whole=True)) else t
              for i, t in enumerate(ids)]
    columns = {"input_ids": ids, "labels": labels}
    for key, value in out.items():
        if key not in TEXT_KEYS and key not in _image_keys(processor) and len(value[0]) == len(ids):
            columns[key] = [int(v) for v in value[0]]
    fate = "kept"
    if len(ids) > seq_len:
        if truncation == "drop":
            return None, "dropped"
        if any(image_tok[seq_len - 1:]):  # the cut would split an image's tokens (or leave nothing after it)
            return None, "image_cut"
        columns = {k: v[:seq_len] for k, v in columns.items()}
        fate = "truncated"
    if sum(lab != IGNORE for lab in columns["labels"][1:]) == 0:
        return None, "dropped"
    columns["images"] = paths
    return columns, fate


def _image_keys(processor: Any) -> set[str]:
    return set(getattr(processor.image_processor, "model_input_names", None) or ["pixel_values"])


def tokenize(ds: Any, processor: Any, template: str, cfg: Any, flag: str, base: Optional[Path],
             fingerprint: str) -> tuple[Any, str]:
    """Every row encoded (encode_row), in one datasets map cached under `fingerprint`; (dataset, stats_line)."""
    d = cfg.data

    def fn(batch: dict[str, list], idx: list[int]) -> dict[str, list]:
        encoded, fates = [], []
        for j in range(len(idx)):
            row = idx[j] + 1  # 1-based, as a user counts lines
            messages, n_images = _messages(batch["messages"][j], row, flag)
            paths = image_paths(batch["images"][j], n_images, row, flag, base)
            enc, fate = encode_row(processor, template, messages, paths, row, d.seq_len, d.train_on_prompt,
                                   d.truncation, flag)
            encoded.append(enc)
            fates.append(fate)
        # a dropped row stays as an empty placeholder (a map batch keeps its length) and is filtered out below
        keys = dict.fromkeys(k for enc in encoded if enc for k in enc) or {"input_ids": None}
        return {**{k: [enc[k] if enc else [] for enc in encoded] for k in keys}, "fate": fates}

    rows = ds.map(fn, batched=True, batch_size=256, with_indices=True, remove_columns=ds.column_names,
                  new_fingerprint=fingerprint, desc="tokenizing")
    stats = stats_line(rows["fate"], d.seq_len)
    rows = rows.filter(lambda f: f in ("kept", "truncated"), input_columns="fate",
                       new_fingerprint=hashlib.sha256((fingerprint + "kept").encode()).hexdigest()[:16])
    return rows.remove_columns("fate"), stats


def _open(path: str):
    """An image file decoded (RGB), its file closed."""
    from PIL import Image

    with Image.open(path) as im:
        return im.convert("RGB")


def collate_images(rows: list[dict], pad_id: int, processor: Any) -> dict[str, torch.Tensor]:
    """Right-padded ids, attention mask, labels and per-token columns, and the rows' images decoded and run through
    the processor's image side (pixel_values, image_grid_thw, ...)."""
    width = max(len(r["input_ids"]) for r in rows)
    keys = [k for k in rows[0] if k not in ("input_ids", "labels", "images")]
    batch = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
             "labels": torch.full((len(rows), width), IGNORE, dtype=torch.long),
             **{k: torch.zeros((len(rows), width), dtype=torch.long) for k in keys}}
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = torch.as_tensor(r["input_ids"])
        batch["attention_mask"][i, :n] = 1
        batch["labels"][i, :n] = torch.as_tensor(r["labels"])
        for k in keys:
            batch[k][i, :n] = torch.as_tensor(r[k])
    images = [[_open(p) for p in r["images"]] for r in rows]
    if any(images):
        pixels = processor(images=[im for im in images if im], return_tensors="pt")
        batch.update({k: v for k, v in pixels.items() if k in _image_keys(processor)})
    return batch


def prepare(cfg: Any, processor: Any, raw: Any, raw_eval: Optional[Any], spec: str, template: str,
            fingerprint: Any) -> tuple[Any, Optional[Any], str]:
    """(train rows, eval rows, the banner's line) of an image-text run; fingerprint(ds, *keys) -> a datasets
    fingerprint (zerotrain/data/reader.py fingerprint_of's)."""
    d = cfg.data
    check_columns(raw, "--data", spec)
    keys = (template, d.seq_len, d.train_on_prompt, d.truncation, processor.__class__.__name__,
            repr(sorted(processor.image_processor.to_dict().items())), "image-chat")
    first = spec.split(",")[0].strip()
    base = Path(first).expanduser().resolve().parent if os.path.exists(first) else None
    train, stats = tokenize(raw, processor, template, cfg, "--data", base, fingerprint(raw, *keys))
    evals = None
    if raw_eval is not None:
        check_columns(raw_eval, "--eval-data", d.eval_path or spec)
        ebase = Path(d.eval_path).expanduser().resolve().parent if d.eval_path and os.path.exists(d.eval_path) \
            else base
        evals = tokenize(raw_eval, processor, template, cfg, "--eval-data", ebase, fingerprint(raw_eval, *keys))[0]
    if len(train) == 0:
        raise UserError(f"--data {spec}: no sample has a token to learn within --seq-len {d.seq_len} "
                        f"({stats}); pass a larger --seq-len")
    if evals is not None and len(evals) == 0:
        raise UserError(f"--eval-data: no eval sample has a token to learn within --seq-len {d.seq_len}; pass a "
                        "larger --seq-len")
    desc = (f"{spec} (chats with images, {type(processor).__name__}): {len(train)} train"
            + (f" / {len(evals)} eval" if evals is not None else "") + f" rows of <= {d.seq_len} tokens; "
            + stats + "; images decoded in the loader")
    return train, evals, desc


def _read(req: ReadRequest, spec: str, eval_path: Optional[str]) -> PreparedData:
    raw, raw_eval = with_eval(req, spec, eval_path)
    template = chat_template(req.processor, req.cfg.data.chat_template)
    train, evals, desc = prepare(req.cfg, req.processor, raw, raw_eval, spec, template,
                                 lambda ds, *keys: fingerprint_of(ds, tokenizer_hash(req.tokenizer), *keys))
    return PreparedData(train, evals, None, None, req.tokenizer.pad_token_id, desc, chat_template=template,
                        processor=req.processor, reader=READER)


def _collate(rows: list[dict], data: PreparedData) -> dict[str, torch.Tensor]:
    return collate_images(rows, data.pad_id, data.processor)


def _check(cfg: RunConfig) -> None:
    """The settings check_settings refuses, a prepared directory (text rows)."""
    d = cfg.data
    check_settings(cfg)
    if prepared.is_prepared(d.path):
        raise UserError(f"--data {d.path}: a directory of `zerotrain data prepare` holds text rows; pass the "
                        "image chats' JSONL (their images are read as the run trains)")


READER = DataReader(IMAGE_CHAT, _read, _collate, check=_check,
                    missing="an image-text model trains on chats with images; pass --data FILE.jsonl in TRL's vision "
                    "format (messages with {{\"type\": \"image\"}} parts, an images column of paths)")
"""Chats with images (an image-text model); no demo set."""

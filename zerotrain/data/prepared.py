"""A tokenized data directory (`zerotrain data prepare`): tokenize once, train on many nodes.

The directory holds datasets' Arrow shards (save_to_disk: train/, and eval/ when there is eval data) and a
manifest (MANIFEST, JSON) of what made them: the tokenizer's fingerprint, the settings that change tokenizing or
packing, the rows and the sources with their weights. `train --data DIR` reads the shards as they are (memory-
mapped, nothing tokenized) after checking the run's own tokenizer and settings against the manifest: a mismatch is
refused in one line naming the setting and the prepared value.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

from ..errors import UserError

MANIFEST = "zerotrain-data.json"
"""The manifest's file name inside a prepared directory."""
VERSION = 1
"""The manifest layout; a directory of another version is refused (prepare it again)."""


def is_prepared(path: Optional[str]) -> bool:
    return bool(path) and "," not in path and os.path.isfile(os.path.join(os.path.expanduser(path), MANIFEST))


def write(out: Path, train: Any, evals: Any, settings: dict[str, Any], sources: list[dict[str, Any]],
          weights: Optional[list[float]], description: str, num_proc: int) -> dict[str, Any]:
    """Save the tokenized sets as Arrow shards and the manifest (last: a directory without one is no prepared
    data, so an interrupted prepare is never read)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    shards = max(1, min(num_proc, len(train) // 1000 or 1))
    train.save_to_disk(str(out / "train"), num_shards=shards)
    if evals is not None:
        evals.save_to_disk(str(out / "eval"))
    manifest = {"version": VERSION, "settings": settings, "sources": sources, "weights": weights,
                "train_rows": len(train), "eval_rows": len(evals) if evals is not None else 0,
                "columns": list(train.column_names), "description": description}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read(path: str) -> dict[str, Any]:
    try:
        manifest = json.loads((Path(path).expanduser() / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--data {path}: cannot read its {MANIFEST} ({e}); prepare it again") from None
    if manifest.get("version") != VERSION:
        raise UserError(f"--data {path}: prepared by another zerotrain (manifest version {manifest.get('version')}, "
                        f"this one reads {VERSION}); run `zerotrain data prepare` again")
    return manifest


def check(manifest: dict[str, Any], settings: dict[str, Any], flags: dict[str, str], path: str) -> None:
    """Refuse the first setting of this run that differs from the one the directory was prepared with."""
    prepared = manifest["settings"]
    for key, value in settings.items():
        if key not in prepared or prepared[key] == value:
            continue
        if key == "tokenizer":
            raise UserError(f"--model: its tokenizer (fingerprint {value}) is not the one --data {path} was prepared "
                            f"with (fingerprint {prepared[key]}, from {prepared.get('model')}); pass that --model or "
                            "prepare the data again with this one")
        flag = flags.get(key, key)
        raise UserError(f"{flag} {_shown(value)}: --data {path} was prepared with {flag} {_shown(prepared[key])}; "
                        f"pass {flag} {_shown(prepared[key])} or prepare the data again")


def _shown(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def load(path: str) -> tuple[Any, Optional[Any]]:
    """The train (and eval) sets, memory-mapped from the shards."""
    import datasets

    root = Path(path).expanduser()
    train = datasets.load_from_disk(str(root / "train"))
    evals = datasets.load_from_disk(str(root / "eval")) if (root / "eval").is_dir() else None
    return train, evals

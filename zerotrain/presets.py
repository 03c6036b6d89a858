"""Named ZeRO presets, each derived from one base run config.

ds_configs/ holds the JSON these generate (`zerotrain config --all ds_configs`);
tests/test_presets.py fails when a shipped file drifts from them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from .config import RunConfig
from .ds_config import build_ds_config


def base() -> RunConfig:
    """What every preset shares: bf16 off (fp32 runs anywhere), AdamW, micro-batch 4."""
    return RunConfig()


def _with(**zero) -> Callable[[], RunConfig]:
    def make() -> RunConfig:
        cfg = base()
        for k, v in zero.items():
            setattr(cfg.zero, k, v)
        return cfg
    return make


PRESETS: dict[str, Callable[[], RunConfig]] = {
    "zero0": _with(stage=0),
    "zero1": _with(stage=1),
    "zero2": _with(stage=2),
    "zero2_offload": _with(stage=2, offload_optimizer="cpu"),
    "zero3": _with(stage=3),
    "zero3_offload": _with(stage=3, offload_optimizer="cpu", offload_param="cpu"),
}


def preset_files() -> dict[str, dict]:
    """Relative path -> DeepSpeed dict for every shipped file (resolved and HF-auto flavours)."""
    files = {}
    for name, make in PRESETS.items():
        files[f"{name}.json"] = build_ds_config(make())
        files[f"hf/{name}.json"] = build_ds_config(make(), hf_auto=True)
    return files


def dumps(ds: dict) -> str:
    return json.dumps(ds, indent=2) + "\n"


def write_presets(out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    written = []
    for rel, ds in preset_files().items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dumps(ds))
        written.append(path)
    return written

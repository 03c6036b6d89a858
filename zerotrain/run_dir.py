"""The one owner of a run's output layout: what goes where under `--output`.

    runs/demo/
      run_config.yaml    the resolved run config (loads back with --config)
      ds_config.json     the exact DeepSpeed config (DeepSpeed runs)
      metrics.jsonl      one line per logged optimizer step and per evaluation
      tensorboard/       event files (--tensorboard)
      checkpoints/       resumable checkpoints (zerotrain/checkpoint.py describes their layout)
      final/             the trained model in HF form (save_pretrained + tokenizer)
      merged/            other forms of the model live beside final/ in named folders: a LoRA
      quantized-<scheme>/  run's merged model, a quantized export

Every module that writes into the output dir asks a RunDir for the path, so a new kind of output
gets its name here, once.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import CHECKPOINTS_DIR


@dataclass(frozen=True)
class RunDir:
    root: Path
    """The run's --output directory."""

    RUN_FILES = (CHECKPOINTS_DIR, "final", "metrics.jsonl", "run_config.yaml", "ds_config.json", "tensorboard")
    """What a run leaves in its output dir; a fresh start refuses to write over any of it."""

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def final(self) -> Path:
        """The trained model in HF form (for a LoRA run, the adapter directory peft loads)."""
        return self.root / "final"

    @property
    def merged(self) -> Path:
        """A LoRA run's base model with the adapter merged in, in HF form."""
        return self.root / "merged"

    def quantized(self, scheme: str) -> Path:
        """The model exported with a quantization scheme (e.g. int8-dynamic)."""
        return self.root / f"quantized-{scheme}"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def run_config(self) -> Path:
        return self.root / "run_config.yaml"

    @property
    def backend_config(self) -> Path:
        """The DeepSpeed JSON the engine was given."""
        return self.root / "ds_config.json"

    def previous_run(self) -> list[str]:
        """Names of another run's outputs present here (empty directories do not count)."""
        found = []
        for name in self.RUN_FILES:
            p = self.root / name
            if p.exists() and not (p.is_dir() and not any(p.iterdir())):
                found.append(name)
        return found

    def clear(self) -> None:
        """Remove another run's outputs (--overwrite); nothing else in the directory is touched."""
        for name in self.RUN_FILES:
            p = self.root / name
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)

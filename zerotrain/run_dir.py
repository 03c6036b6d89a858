"""The one owner of a run's output layout: what goes where under `--output`.

    runs/demo/
      run_config.yaml    the resolved run config (loads back with --config)
      ds_config.json     the exact DeepSpeed config (DeepSpeed runs)
      metrics.jsonl      one line per logged optimizer step and per evaluation
      tensorboard/       event files (--report-to tensorboard / --tensorboard)
      mlflow.db          the MLflow store (--report-to mlflow without MLFLOW_TRACKING_URI), mlflow_run_id
      wandb/             W&B's offline run files (--report-to wandb)
      checkpoints/       resumable checkpoints (zerotrain/checkpoint.py describes their layout)
      final/             the trained model in HF form (save_pretrained + tokenizer); a LoRA run: the
        merged/          peft adapter, and with --merge-lora the base with it merged in
      quantized-<scheme>/  other forms of the model live beside final/ in named folders

Every module that writes into the output dir asks a RunDir for the path, so a new kind of output
gets its name here, once.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .checkpoint import CHECKPOINTS_DIR


class RunDir:
    """The paths of one run's outputs."""

    RUN_FILES = (CHECKPOINTS_DIR, "final", "metrics.jsonl", "run_config.yaml", "ds_config.json", "tensorboard",
                 "mlflow.db", "mlflow_run_id", "wandb")
    """What a run leaves in its output dir; a fresh start refuses to write over any of it."""

    def __init__(self, root: str | Path):
        self.root = Path(root)  # the run's --output directory
        self.checkpoints = self.root / CHECKPOINTS_DIR
        self.final = self.root / "final"  # the trained model in HF form (a LoRA run: the adapter dir)
        self.merged = self.final / "merged"  # a LoRA run's base model with the adapter merged in (lora.MERGED_DIR)
        self.metrics = self.root / "metrics.jsonl"
        self.tensorboard = self.root / "tensorboard"
        self.mlflow_db = self.root / "mlflow.db"  # MLflow's SQLite store when MLFLOW_TRACKING_URI is unset
        self.mlflow_run_id = self.root / "mlflow_run_id"  # a resumed run logs into the same MLflow run
        self.run_config = self.root / "run_config.yaml"
        self.backend_config = self.root / "ds_config.json"  # the DeepSpeed JSON the engine was given

    def quantized(self, scheme: str) -> Path:
        """The model exported with a quantization scheme (e.g. int8-dynamic), beside final/."""
        return self.root / f"quantized-{scheme}"

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

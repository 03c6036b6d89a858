"""The paths of a run's outputs: what goes where under `--output`.

    runs/demo/
      run_config.yaml    the resolved run config (loads back with --config)
      ds_config.json     the exact DeepSpeed config (DeepSpeed runs)
      metrics.jsonl      one line per logged optimizer step and per evaluation
      tensorboard/       event files (--report-to tensorboard / --tensorboard)
      mlflow.db          the MLflow store (--report-to mlflow without MLFLOW_TRACKING_URI), mlflow_run_id
      wandb/             W&B's offline run files (--report-to wandb)
      checkpoints/       resumable checkpoints (zerotrain/checkpoint/store.py describes their layout)
      final/             the trained model in HF form (save_pretrained + tokenizer); a LoRA run: the
                         peft adapter
        merged/          --merge-lora: the base with the adapter merged in (lora.MERGED_DIR)
        quantized-<scheme>/  --qat: the converted model (quant.convert_qat_final), beside
                         zerotrain_qat.json (quant.QAT_FILE)
      model_state/       a `zerotrain compare` / `tune` trial's per-rank measurements

Who spells which path: the trainer, metrics.py, trackers.py and preflight.py take the top-level paths
above from a RunDir (wandb/ is W&B's own name under the root; model_state/ is not one of them); the name
checkpoints/ is store.CHECKPOINTS_DIR, which checkpoint/store.py also uses to find checkpoints under an
output dir. What goes inside final/ is not a run-dir path: Engine.save_hf writes merged/ and
quantized-<scheme>/ into whatever model directory it is given (`zerotrain export` of a LoRA checkpoint
writes merged/ into its OUT too), so lora.py and quant.py name them. model_state/ (RunDir.model_state) is chosen by trials.py,
which passes it to the run as $ZEROTRAIN_MODEL_STATE_DIR; measure.py writes model_state_rank<R>.json and
peak_rank<R>.json into whatever directory that variable names. trials.py and commands/tune.py take a trial's
metrics.jsonl, model_state/, checkpoints/ and final/ from a RunDir too.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .store import CHECKPOINTS_DIR


class RunDir:
    """The paths of one run's outputs."""

    RUN_FILES = (CHECKPOINTS_DIR, "final", "metrics.jsonl", "run_config.yaml", "ds_config.json", "tensorboard",
                 "mlflow.db", "mlflow_run_id", "wandb")
    """What a run leaves in its output dir; a fresh start refuses to write over any of it."""

    def __init__(self, root: str | Path):
        self.root = Path(root)  # the run's --output directory
        self.checkpoints = self.root / CHECKPOINTS_DIR
        self.final = self.root / "final"  # the trained model in HF form (a LoRA run: the adapter dir)
        self.metrics = self.root / "metrics.jsonl"
        self.tensorboard = self.root / "tensorboard"
        self.mlflow_db = self.root / "mlflow.db"  # MLflow's SQLite store when MLFLOW_TRACKING_URI is unset
        self.mlflow_run_id = self.root / "mlflow_run_id"  # a resumed run logs into the same MLflow run
        self.run_config = self.root / "run_config.yaml"
        self.backend_config = self.root / "ds_config.json"  # the DeepSpeed JSON the engine was given
        self.model_state = self.root / "model_state"  # a compare / tune trial's per-rank measurements

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

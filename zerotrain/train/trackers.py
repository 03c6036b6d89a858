"""Experiment trackers (`--report-to tensorboard,mlflow,wandb`): the metrics.jsonl records and the run config.

Rank 0 only. A tracker that fails (not installed, store unreachable, disk full) prints one warning line
and is switched off; the run and metrics.jsonl go on. MLflow logs to $MLFLOW_TRACKING_URI, else to a
SQLite store in the output dir (MLflow 3 refuses a plain file store), experiment $MLFLOW_EXPERIMENT_NAME
or "zerotrain"; a resumed run continues the same MLflow run (its id is kept in the output dir). W&B runs
offline when no WANDB_API_KEY is set.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Optional

from ..checkpoint.run_dir import RunDir
from ..errors import os_error_line


def _warn(name: str, what: str, e: BaseException) -> None:
    if isinstance(e, OSError):  # the machine's fault (a full disk): rank, path, the OS's text
        print("zerotrain: warning: " + os_error_line(e, 0, f"--report-to {name}: {what}",
                                                     kept="training and metrics.jsonl go on without this tracker"),
              file=sys.stderr, flush=True)
        return
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    print(f"zerotrain: warning: --report-to {name}: {what} failed ({type(e).__name__}: {msg}); "
          "continuing without it", file=sys.stderr, flush=True)


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers; a list of numbers (a mixture of experts' expert_tokens) as one scalar per
    entry, "expert_tokens/3"."""
    flat: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, list):
            flat.update({f"{k}/{i}": x for i, x in enumerate(v)})
        else:
            flat[k] = v
    return {k: float(v) for k, v in flat.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(float(v))}


def flat_params(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The run config as dotted key -> string (trackers' parameter tables)."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def _cell(value: Any) -> Any:
    """A table cell: numbers as they are, anything else (a chat completion's messages) as its text."""
    return value if isinstance(value, (int, float)) else json.dumps(value) if isinstance(value, (list, dict)) \
        else str(value)


class Tracker:
    """One tracker: start(params), log(record), close(); each wrapped so a failure only disables it."""

    name = "base"

    def start(self, params: dict[str, str]) -> None: ...

    def log(self, record: dict[str, Any]) -> None: ...

    def table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """Rows of one table at a step (online RL's sampled completions); trackers without tables skip it."""

    def close(self) -> None: ...


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: RunDir, resume_step: Optional[int]):
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(log_dir=str(run_dir.tensorboard), purge_step=resume_step)

    def start(self, params: dict[str, str]) -> None:
        self._tb.add_text("run_config", "\n".join(f"    {k}: {v}" for k, v in params.items()))

    def log(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for k, v in _scalars(record).items():
            self._tb.add_scalar(("eval/" if k.startswith("eval_") else "train/") + k, v, step)

    def close(self) -> None:
        self._tb.close()


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, run_dir: RunDir, resume_step: Optional[int]):
        from mlflow.tracking import MlflowClient

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run_dir.mlflow_db.resolve()}"
        self._client = MlflowClient(tracking_uri=self.uri)
        self._id_file = run_dir.mlflow_run_id
        run_id = self._id_file.read_text().strip() if resume_step is not None and self._id_file.is_file() else ""
        if not run_id:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "zerotrain")
            exp = self._client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(name)
            run_id = self._client.create_run(exp_id, run_name=run_dir.root.resolve().name).info.run_id
            self._id_file.write_text(run_id + "\n")
        self.run_id = run_id
        self._resumed = resume_step is not None

    def start(self, params: dict[str, str]) -> None:
        if self._resumed:  # the parameters were logged by the first part of the run (MLflow refuses changes)
            return
        from mlflow.entities import Param

        items = [Param(k[:250], v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit
            self._client.log_batch(self.run_id, params=items[i:i + 100])

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        ts, step = int(time.time() * 1000), int(record["step"])
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v in _scalars(record).items()])

    def table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """Appended to the run's `<name>.json` table artifact (MLflow appends rows to an existing table)."""
        columns = ["step", *dict.fromkeys(k for r in rows for k in r)]
        data = {c: [step if c == "step" else _cell(r.get(c)) for r in rows] for c in columns}
        self._client.log_table(self.run_id, data=data, artifact_file=f"{name}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, run_dir: RunDir, resume_step: Optional[int]):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "zerotrain"), dir=str(run_dir.root),
                               name=run_dir.root.resolve().name, mode=mode, resume="allow" if resume_step else None)

    def start(self, params: dict[str, str]) -> None:
        self._run.config.update(params, allow_val_change=True)

    def log(self, record: dict[str, Any]) -> None:
        self._run.log({("eval/" if k.startswith("eval_") else "train/") + k: v for k, v in _scalars(record).items()},
                      step=int(record["step"]))

    def table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        import wandb

        columns = list(dict.fromkeys(k for r in rows for k in r))
        self._run.log({name: wandb.Table(columns=columns, data=[[_cell(r.get(c)) for c in columns] for r in rows])},
                      step=step)

    def close(self) -> None:
        self._run.finish()


_KINDS = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker, "wandb": WandbTracker}


class Trackers:
    """The run's trackers (rank 0): each call is guarded; a failing tracker is dropped after one warning."""

    def __init__(self, names: list[str], run_dir: RunDir, resume_step: Optional[int]):
        self._live: list[Tracker] = []
        for name in dict.fromkeys(names):
            try:
                self._live.append(_KINDS[name](run_dir, resume_step))
            except ImportError as e:
                _warn(name, f"import ({name} is not installed: pip install {name})", e)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                _warn(name, "start", e)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self._live]

    def _each(self, what: str, fn) -> None:
        for t in list(self._live):
            try:
                fn(t)
            except Exception as e:  # noqa: BLE001 - a tracker never stops the run
                _warn(t.name, what, e)
                self._live.remove(t)

    def start(self, params: dict[str, str]) -> None:
        self._each("logging the run config", lambda t: t.start(params))

    def log(self, record: dict[str, Any]) -> None:
        self._each("logging metrics", lambda t: t.log(record))

    def table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        self._each("logging a table", lambda t: t.table(name, rows, step))

    def close(self) -> None:
        self._each("closing", lambda t: t.close())
        self._live = []

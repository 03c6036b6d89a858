"""Shared by the benchmarks that launch one `torchrun` per trial (long_context.py, moe.py): the model directory
their trials load (written once, atomically), the launched ranks' pids and memory, killing a trial's whole process
tree, and the root-cause line of a failed trial's log.

torch elastic starts each rank in a session of its own, so a trial is stopped by killing every descendant of the
launcher as well as the launcher's own process group."""
from __future__ import annotations

import os
import re
import signal
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Optional

ERR_RE = re.compile(r"^(?:\[rank\d+\]:?\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*|zerotrain train: error:.*)$")
"""A log line that names an exception (or zerotrain's one-line error), behind torchrun's [rankN]: prefix."""


def free_port() -> int:
    """A free port on 127.0.0.1 for a trial's torchrun (zerotrain.util's: the scripts put the repo on sys.path first)."""
    from zerotrain.util import free_port as free

    return free()


def launch(cmd: list[str], log: Path, timeout: float, env: dict, cwd: Path,
           every_second: Optional[Callable[[], Any]] = None) -> dict:
    """Run cmd in its own session, its output into log; on timeout kill its whole tree and process group.
    every_second() runs about once a second meanwhile (a sampler of what else uses the cores)."""
    t0 = time.monotonic()
    killed, ticks = None, 0
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout:
                killed = "timeout"
                kill_tree(proc)
                break
            time.sleep(0.25)
            ticks += 1
            if every_second is not None and ticks % 4 == 0:
                every_second()
    return {"rc": proc.returncode, "killed": killed, "wall_s": round(time.monotonic() - t0, 1)}


def offline_workdir(workdir: str | Path, repo: Path) -> Path:
    """The driver's own process made ready: its work folder created, the hub offline, the repo importable."""
    import sys

    path = Path(workdir)
    path.mkdir(parents=True, exist_ok=True)
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    sys.path.insert(0, str(repo))
    return path


def trial_env(repo: Path, state_dir: Optional[Path] = None, **extra: str) -> dict:
    """A launched trial's environment: offline hub, one thread per rank, quiet transformers, repo importable, no
    inherited $ZEROTRAIN_MODEL_STATE_DIR (state_dir sets it: model_state_rank{R}.json + peak_rank{R}.json)."""
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", **extra)
    e["PYTHONPATH"] = os.pathsep.join([str(repo), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.pop("ZEROTRAIN_MODEL_STATE_DIR", None)
    if state_dir is not None:
        e["ZEROTRAIN_MODEL_STATE_DIR"] = str(state_dir)
    return e


def save_model_dir(out: Path, model_cls: Any, hf_config: Any, tokenizer: Any) -> Path:
    """model_cls(hf_config) with random init (seed 0) and the tokenizer, saved into out through a temporary sibling
    renamed at the end, so a killed build never leaves a half-written model that looks complete."""
    import torch

    torch.manual_seed(0)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model_cls(hf_config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def llama_dir(out: Path, **config: Any) -> Path:
    """A random-init Llama of `config` (LlamaConfig keys) with zerotrain's embedded tokenizer, its EOS as bos, eos and
    pad, built once into out (save_model_dir) and reused while out holds a config and a tokenizer."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerotrain.assets.demo import build_tokenizer

    tok = build_tokenizer()
    eos = tok.eos_token_id
    return save_model_dir(out, LlamaForCausalLM, LlamaConfig(**config, bos_token_id=eos, eos_token_id=eos,
                                                             pad_token_id=eos), tok)


def software(versions: dict[str, str], *packages: str) -> str:
    """"torch 2.x, deepspeed 0.x, ...": the packages a results page names, in the order given."""
    return ", ".join(f"{p} {versions[p]}" for p in packages)


def run_span(res: dict, rounds: bool = False) -> str:
    """"Run <date>, <minutes> min[, <n> rounds]": when a benchmark ran and for how long (its raw file's date, wall_s
    and rounds)."""
    return f"Run {res['date']}, {res['wall_s'] / 60:.1f} min" + (f", {res['rounds']} rounds" if rounds else "")


def descendants(root: int) -> list[int]:
    """Every descendant pid of root, read from /proc."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss_bytes(pid: int) -> Optional[int]:
    """A process's resident set (VmRSS), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL every descendant of proc and proc's process group, then reap proc."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def step_records(metrics_jsonl: Path) -> list[dict]:
    """A trial run's training records (metrics.jsonl lines with a step time; a line cut by a kill skipped)."""
    import json

    recs = []
    if metrics_jsonl.is_file():
        for line in metrics_jsonl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step_time_s" in rec:
                recs.append(rec)
    return recs


def first_error(lines: list[str]) -> str:
    """The first exception line (the root cause; torchrun's ChildFailedError summary skipped), or ""."""
    return next((m.group(1)[:500] for ln in lines if (m := ERR_RE.match(ln.strip()))
                 and "ChildFailedError" not in ln and "Traceback" not in ln), "")

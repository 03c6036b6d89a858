"""Walk the task from the CLI to the first step, as it runs: `python -m tests.support.task_walk [train flags]`, or
`--every-kind` for one run of each training kind on tiny local models (causal-lm, seq-cls, dpo, kto, reward,
grpo, image-text).

Runs `zerotrain train` in this process (one rank, the embedded demo model unless the flags name another) under a
profile hook that records every call receiving the run's TaskSpec as an argument (the task resolved once, then
handed on), from the CLI until the engine's first train step. A module's visit is a run of such calls in it, ended
by a call in another module; the walk prints the visits in order and each module's count. Issue 65 asks that no
module be visited more than twice (`--max-visits 2` exits 1 where one is).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional

import zerotrain
from zerotrain.tasks import TaskSpec

PACKAGE = Path(zerotrain.__file__).resolve().parent


class _FirstStep(Exception):
    """Raised inside the engine's first train step: the walk ends there."""


@functools.lru_cache(maxsize=None)
def _module_of(filename: str) -> Optional[str]:
    path = Path(filename).resolve()
    return str(path.relative_to(PACKAGE)) if path.is_relative_to(PACKAGE) else None


def _holds_task(frame) -> bool:
    """The call was handed the task (not a question the task answers itself: its own methods and properties)."""
    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return any(isinstance(frame.f_locals.get(n), TaskSpec) for n in names if n != "self")


def walk(train_args: list[str]) -> list[tuple[str, str]]:
    """(module, function) of each call that received the task, in order, until the first train step."""
    from zerotrain import cli

    calls: list[tuple[str, str]] = []

    def hook(frame, event, _arg):
        if event != "call":
            return
        module = _module_of(frame.f_code.co_filename)
        if module is None:
            return
        if frame.f_code.co_name == "train_step" and module.startswith("backends/"):
            raise _FirstStep
        if _holds_task(frame):
            calls.append((module, frame.f_code.co_qualname))

    sys.setprofile(hook)
    try:
        rc = cli.main(["train", *train_args])
    except _FirstStep:
        return calls
    finally:
        sys.setprofile(None)
    raise RuntimeError(f"zerotrain train {' '.join(train_args)} ended (exit {rc}) before its first step")


def visits(calls: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Consecutive calls in one module folded into one visit: (module, its functions)."""
    out: list[tuple[str, list[str]]] = []
    for module, function in calls:
        if out and out[-1][0] == module:
            if function not in out[-1][1]:
                out[-1][1].append(function)
        else:
            out.append((module, [function]))
    return out


def every_kind(root: Path) -> dict[str, list[str]]:
    """The train flags of one run per training kind, on tiny models and data written under root."""
    from tests.support.make_pref_data import pairs, tiny_model, write_pairs
    from tests.support.vision import make_vl_dataset, make_vl_model_dir

    llama = str(tiny_model("llama", root / "llama"))
    pref = str(write_pairs(root / "pairs.jsonl", 8))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"]}) + "\n" for r in pairs(8, seed=3)))
    rewards = f"{Path(__file__).parent / 'grpo_rewards.py'}:known_words"
    image_text = ["--model", str(make_vl_model_dir("llava", root / "llava")),
                  "--data", str(make_vl_dataset(root / "chats.jsonl", 8, root / "images"))]
    return {"causal-lm": [], "seq-cls": ["--task", "seq-cls"],
            **{k: ["--task", k, "--model", llama, "--data", pref] for k in ("dpo", "kto", "reward")},
            "grpo": ["--task", "grpo", "--model", llama, "--data", str(prompts), "--reward-funcs", rewards,
                     "--num-generations", "4", "--max-completion-len", "8", "--global-batch", "8"],
            "image-text": [*image_text, "--global-batch", "4"]}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-visits", type=int, default=None, help="exit 1 where a module is visited more often")
    p.add_argument("--every-kind", action="store_true", help="walk one run of each training kind (every_kind)")
    a, train_args = p.parse_known_args(argv)
    over: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs = every_kind(Path(tmp)) if a.every_kind else {"the flags": train_args}
        for kind, flags in runs.items():
            route = visits(walk([*flags, "--output", str(Path(tmp) / "out" / kind), "--overwrite", "--max-steps", "1"]))
            print(f"# {kind}")
            for i, (module, functions) in enumerate(route, 1):
                print(f"{i:3d}. {module}: {', '.join(functions)}")
            counts = Counter(module for module, _ in route)
            print("visits per module:", ", ".join(f"{m} {n}" for m, n in counts.most_common()), flush=True)
            if a.max_visits is not None and max(counts.values()) > a.max_visits:
                over[kind] = {m: n for m, n in counts.items() if n > a.max_visits}
    if over:
        print(f"over {a.max_visits} visits: {over}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())

"""The guides' walk-throughs as steps a test runs (tests/unit/test_guides.py, tests/multirank/test_guides.py).

Which fenced blocks form a guide's walk-through is said in the guide, by an HTML comment (invisible when rendered)
on the line right before the block:

    <!-- walkthrough: run -->            the next ```bash block runs, in order, in the walk-through's directory
    <!-- walkthrough: file NAME -->      the next fenced block (any language) is written to NAME there first
    <!-- walkthrough: none, REASON -->   anywhere: the guide has no runnable walk-through, and why

Every other block is an example and is not run (its `zerotrain ...` lines are still parsed by
tests/unit/test_docs_commands.py). A guide says one or the other: run steps, or none with a reason.

The walk-through runs as a user would from a checkout: in a fresh directory holding links to the repository's
top-level files (hostfile.example, constraints-cpu.txt, ...), with `zerotrain`, `python`, `torchrun` and `deepspeed`
from the test's own environment first on PATH, offline (HF_HUB_OFFLINE=1). One rewrite, because CI already runs in
the environment the guide would build: a block's leading `python3 -m venv .venv && .venv/bin/pip install ... && `
is dropped and `.venv` there is a link to the test's environment (running `python3 -m venv` over it would rewrite
that environment). Nothing else is changed: the commands run as written.
"""
from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from zerotrain.launch.subprocess_run import run_with_timeout

REPO = Path(__file__).resolve().parents[2]

MARKER = re.compile(r"^\s*<!--\s*walkthrough:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^\s*(```|~~~)\s*([\w.+-]*)")
INSTALL = re.compile(r"^python3 -m venv \.venv && \.venv/bin/pip install [^&]*&& ")
"""The quick start's set-up prefix: the test's environment stands in for it (module docstring)."""
NOT_LINKED = {".git", ".venv", "runs", "mlruns", "__pycache__", ".pytest_cache"}
"""Top-level entries the walk-through's directory does not link: its own outputs, or the environment (`.venv`)."""


class GuideError(ValueError):
    """A guide's walk-through markers are malformed (file:line and what is wrong)."""


@dataclass
class Step:
    where: str  # file:line of the block's first line
    kind: str  # "run" or "file"
    text: str  # the block's content (for "run", with the install prefix dropped)
    name: str = ""  # for "file": the path it is written to


@dataclass
class Walkthrough:
    guide: str  # path relative to the repository
    steps: list[Step]
    none: str | None  # the reason a guide gives for having no walk-through


def guide_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def parse(path: Path, root: Path = REPO) -> Walkthrough:
    """The walk-through a guide declares; GuideError on a marker that is unknown, not followed by the block it
    needs, or a guide with both run steps and `none` (or neither)."""
    rel = str(path.relative_to(root))
    lines = path.read_text().splitlines()
    steps: list[Step] = []
    none: str | None = None
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if not m:
            i += 1
            continue
        where, spec = f"{rel}:{i + 1}", m.group(1)
        if spec.startswith("none"):
            reason = spec.removeprefix("none").lstrip(" ,:")
            if len(reason) < 20:
                raise GuideError(f"{where}: `walkthrough: none` needs a reason (why the guide has nothing to run)")
            none = reason
            i += 1
            continue
        kind, _, name = spec.partition(" ")
        if kind not in ("run", "file") or (kind == "file") != bool(name.strip()):
            raise GuideError(f"{where}: unknown marker {spec!r} (run | file NAME | none, REASON)")
        fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if not fence or (kind == "run" and fence.group(2) != "bash"):
            raise GuideError(f"{where}: `walkthrough: {spec}` must be followed by a "
                             f"{'```bash' if kind == 'run' else 'fenced'} block on the next line")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip().startswith(fence.group(1))), None)
        if end is None:
            raise GuideError(f"{where}: the block after the marker is never closed")
        body = "\n".join(lines[i + 2:end]) + "\n"
        if kind == "run":
            body = "\n".join(INSTALL.sub("", ln) for ln in body.splitlines()) + "\n"
        steps.append(Step(f"{rel}:{i + 3}", kind, body, name.strip()))
        i = end + 1
    if steps and none is not None:
        raise GuideError(f"{rel}: has run steps and says `walkthrough: none`")
    if not any(s.kind == "run" for s in steps) and none is None:
        raise GuideError(f"{rel}: no walk-through declared: mark its blocks `<!-- walkthrough: run -->` or say "
                         f"`<!-- walkthrough: none, REASON -->`")
    return Walkthrough(rel, steps, none)


def prepare_dir(work: Path, root: Path = REPO) -> Path:
    """A fresh directory with links to the repository's top-level entries and `.venv` -> the test's environment."""
    work.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.name not in NOT_LINKED and not (work / entry.name).exists():
            (work / entry.name).symlink_to(entry)
    (work / ".venv").symlink_to(sys.prefix)
    return work


def env() -> dict:
    """Offline, the worktree's zerotrain importable (the ranks inherit it), the test's environment first on PATH."""
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), e.get("PATH", "")])
    return e


def run(walk: Walkthrough, work: Path, timeout: float = 600) -> list[str]:
    """Write its files and run its blocks in order in `work` (prepared by prepare_dir), each block one
    `bash -euo pipefail` under a hard timeout that kills everything it started. AssertionError on the first block
    that fails or times out, with the block and its output. Returns each block's output."""
    outputs = []
    for step in walk.steps:
        if step.kind == "file":
            (work / step.name).parent.mkdir(parents=True, exist_ok=True)
            (work / step.name).write_text(step.text)
            continue
        res = run_with_timeout(["bash", "-euo", "pipefail", "-c", step.text], timeout, env=env(), cwd=work,
                               merge_stderr=True)
        if res.timed_out or res.returncode != 0:
            what = f"timed out after {timeout:.0f} s" if res.timed_out else f"exit {res.returncode}"
            raise AssertionError(f"{step.where}: the walk-through's block failed ({what}):\n{step.text}\n"
                                 f"--- output (last 6000 characters) ---\n{res.stdout[-6000:]}")
        outputs.append(res.stdout)
    return outputs

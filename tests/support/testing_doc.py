"""Generate docs/testing.md's feature table and CI time from tests/features.yaml (tests/features.py) and the committed CI log.

    python -m tests.support.testing_doc            # rewrite docs/testing.md below its GENERATED line
    python -m tests.support.testing_doc --check    # exit 1 if docs/testing.md is not the generated text

Everything above the GENERATED line is written by hand and kept as is; everything below it is this module's
output, so it is idempotent. Times come only from benchmarks/results/ci_run.txt (a clean-clone run of `.ci/run`):
its first line (the commit, "whole script N s"), pytest's summary line and its `--durations=0` list. A new log
committed there changes the doc on the next run; tests/unit/test_ci_coverage.py fails until it is regenerated.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from tests import features

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "testing.md"
LOG = REPO / "benchmarks" / "results" / "ci_run.txt"
LOG_REL = "benchmarks/results/ci_run.txt"
GENERATED = ("<!-- generated below this line by `python -m tests.support.testing_doc` from tests/features.yaml and "
             "benchmarks/results/ci_run.txt: edit those, not the text below -->")


@dataclass
class CiLog:
    commit: str
    summary: str  # pytest's counts, as it printed them ("1406 passed, 220 deselected")
    passed: int
    pytest_s: str  # as printed, e.g. "2241.23"
    script_s: str  # "whole script N s" on the log's first line
    durations: dict[str, list[tuple[str, str]]]  # node id -> [(seconds as printed, phase)]


def read_log(text: str) -> CiLog:
    first = text.splitlines()[0]
    commit = re.search(r"\bat ([0-9a-f]{7,40})\b", first)
    script = re.search(r"whole script (\d+) s", first)
    summary = re.findall(r"^=+ (.*\d+ passed.*) in ([0-9.]+)s(?: \([0-9:]+\))? =+$", text, re.M)
    if not (commit and script and summary):
        raise ValueError(f"{LOG_REL}: no commit / 'whole script N s' on its first line, or no pytest summary line")
    counts, seconds = summary[-1]
    counts = ", ".join(c for c in counts.split(", ") if "warning" not in c)
    durations: dict[str, list[tuple[str, str]]] = {}
    for s, phase, node in re.findall(r"^([0-9.]+)s (call|setup|teardown) +(\S.*)$", text, re.M):
        durations.setdefault(node.strip(), []).append((s, phase))
    return CiLog(commit.group(1), counts, int(re.search(r"(\d+) passed", counts).group(1)), seconds,
                 script.group(1), durations)


def _cell_seconds(log: CiLog, node: str) -> str:
    return " + ".join(s if phase == "call" else f"{s} ({phase})" for s, phase in log.durations.get(node, [])) or "-"


def _code(nodes) -> str:
    return " ".join(f"`{n}`" for n in nodes)


def generated(log: CiLog) -> str:
    slowest = min((float(s) for v in log.durations.values() for s, _ in v), default=0.0)
    smallest = next(s for v in log.durations.values() for s, _ in v if float(s) == slowest) if log.durations else "-"
    out = [GENERATED, "", "## CI time", "",
           f"From the committed clean-clone CI log, {LOG_REL} (commit {log.commit}): {log.summary} in {log.pytest_s} s "
           f"of pytest, {log.script_s} s for the whole script (`.ci/run`: the venv install and the two-host set-up "
           "included). Issue 66's budget is 40 minutes for the whole script. The log's `--durations=0` list gives "
           "the seconds each CI cell below took in that run.", "",
           "## Which feature each CI cell proves", "",
           "CI (`pytest`, `-m 'not slow'`) proves every feature below with the cells of its second column; the last "
           "column names the test functions whose other cells are `slow` (the rest of that feature's matrix). The "
           f"third column is each CI cell's seconds in {LOG_REL}, in the order of the second; `-`: not in its "
           f"list (pytest leaves out what took under 0.005 s; the shortest listed: {smallest} s) or not in that run. The table is tests/features.yaml; "
           "`tests/unit/test_ci_coverage.py` checks it against `pytest --collect-only`.", "",
           "| Feature | CI cells | Seconds in the CI log | Slow: the rest of the matrix |",
           "| --- | --- | --- | --- |"]
    gaps = [f for f in features.FEATURES if f.name in features.PENDING]
    for f in features.FEATURES:
        if f.name not in features.PENDING:
            out.append(f"| {f.name} | {_code(f.ci)} | {', '.join(_cell_seconds(log, n) for n in f.ci)} | "
                       f"{_code(f.slow)} |")
    out += ["", "### Known gaps", "",
            "Features whose only cells are `slow` today (tests/features.yaml pending, emptied as the cells move into "
            "CI); run them with `-m slow` before closing an issue that touches them.", "",
            "| Feature | Its slow cells |", "| --- | --- |"]
    out += [f"| {f.name} | {_code(f.ci)} |" for f in gaps] or ["| (none) | |"]
    out += ["", "### Proven only by the slow pass", "",
            "Slow tests no feature needs in CI, and what CI proves instead.", "",
            "| Slow test | Why it is not in CI |", "| --- | --- |"]
    out += [f"| `{name}` | {why} |" for name, why in features.SLOW_ONLY.items()]
    return "\n".join(out) + "\n"


def render(doc_text: str, log_text: str) -> str:
    """The whole doc: its hand-written part (up to the GENERATED line) and the generated rest."""
    if GENERATED not in doc_text:
        raise ValueError(f"{DOC.name} has no GENERATED line: put it where the generated part starts")
    return doc_text.split(GENERATED, 1)[0] + generated(read_log(log_text))


def main(argv: list[str]) -> int:
    new = render(DOC.read_text(), LOG.read_text())
    if "--check" in argv:
        if DOC.read_text() != new:
            print(f"{DOC.relative_to(REPO)} is not the generated text: run python -m tests.support.testing_doc")
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Comments and docstrings name only files that exist (issue 48): a `.py` path in a comment or docstring of the
package is a file of this repository, or of an installed package it names (deepspeed/..., trl/...)."""
from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zerotrain"
PATH = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*[\w-]+\.py)\b")
SEARCHED = ("zerotrain", "tests", "benchmarks", "scripts", "docs", "ds_configs")
"""The repository's own folders (not .venv/ or build outputs)."""
EXAMPLES = {"my_loop.py", "train.py", "script.py", "rewards.py"}
"""File names a usage example invents for the user's own script (`python my_loop.py`), not files of this repo."""


def _texts(source: str):
    """(line, text) of every comment and string statement (docstrings, attribute docstrings) of a module."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield node.lineno, node.value.value


def _installed(ref: str) -> bool:
    """A path inside an installed package: deepspeed/runtime/zero/stage3.py."""
    top = ref.split("/")[0]
    if "/" not in ref or not top.isidentifier():
        return False
    spec = importlib.util.find_spec(top)
    return bool(spec and spec.submodule_search_locations
                and any((Path(loc).parent / ref).exists() for loc in spec.submodule_search_locations))


def _exists(ref: str, module: Path) -> bool:
    if ref in EXAMPLES:
        return True
    if "/" not in ref:  # a bare module name: some file of that name in the repository
        return (ROOT / ref).exists() or any(any((ROOT / d).glob(f"**/{ref}")) for d in SEARCHED)
    return (any(base.joinpath(ref).exists() for base in (ROOT, PACKAGE, module.parent))
            or any(PACKAGE.glob(f"**/{ref}")) or _installed(ref))


def missing_paths(source: str, module: Path) -> list[str]:
    return sorted({f"{line}: {m.group(1)}" for line, text in _texts(source) for m in PATH.finditer(text)
                   if not _exists(m.group(1), module)})


def test_comments_name_only_existing_files():
    offenders = [f"{p.relative_to(ROOT)}:{hit}" for p in sorted(PACKAGE.rglob("*.py"))
                 for hit in missing_paths(p.read_text(), p)]
    assert not offenders, "comments/docstrings name files that do not exist:\n" + "\n".join(offenders)


def test_the_check_can_fail():
    code = ('"""See backends/registry.py and plan/registry.py."""\n'
            "# the JSON is built in memory.py; deepspeed/runtime/zero/stage3.py is DeepSpeed's\n"
            'X = 1\n"""and zerotrain/nowhere.py too"""\n')
    assert missing_paths(code, PACKAGE / "plan" / "x.py") == ["1: backends/registry.py", "2: memory.py",
                                                                "4: zerotrain/nowhere.py"]

"""docs/architecture.md lists every module of the package under its folder (issue 48: five modules were missing)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zerotrain"
PER_COMMAND = "commands"
"""commands/ is described as a whole ("one module per subcommand"), named after the subcommands the CLI lists."""


def folder_entries(doc: str) -> dict[str, str]:
    """The layout block's text per top-level unit ("model" -> its lines), from the ```-fenced tree."""
    block = doc.split("```")[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        top = re.match(r"^  (\S+?)(/|\.py)?\s", line + " ")
        if top and not line.startswith("   "):
            current = top.group(1)
        if current:
            entries[current] = entries.get(current, "") + line + "\n"
    return entries


def unlisted(doc: str) -> list[str]:
    entries = folder_entries(doc)
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py" or rel.parts[0] == PER_COMMAND:
            continue
        unit = rel.parts[0].removesuffix(".py")
        name = "/".join(rel.parts[1:]) or rel.name  # model/router.py -> "router.py"; engine.py -> "engine.py"
        text = entries.get(unit, "")
        if not re.search(rf"(?<![\w/]){re.escape(name)}", text) and not (unit == "__main__" and "__main__.py" in doc):
            missing.append(rel.as_posix())
    return missing


def test_every_module_is_listed_under_its_folder():
    missing = unlisted((ROOT / "docs" / "architecture.md").read_text())
    assert not missing, "docs/architecture.md does not list: " + ", ".join(missing)


def test_the_check_can_fail():
    doc = "```\nzerotrain/\n  model/           facts.py: ModelFacts\n  engine.py        build_engine\n```\n"
    missing = unlisted(doc)
    assert "model/router.py" in missing and "model/facts.py" not in missing and "engine.py" not in missing

"""Every `zerotrain ...` command line in README.md and docs/**/*.md parses with the real CLI parser.

A command line is a line of a fenced code block that runs zerotrain: it starts with `zerotrain`
(or a path ending in /zerotrain), or runs the module under a launcher or Python (`torchrun ... -m
zerotrain ...`, `deepspeed ... --module zerotrain ...`, `python -m zerotrain ...`; the part after the
module name is taken). Backslash-continued lines are joined, `# comments` stripped, the line split
with shlex; shell-only parts (pipes, `&&`, `;`, redirections, leading `VAR=value`) are dropped and
`...` placeholders removed. `zerotrain launch ... -- ARGS` parses ARGS as the rank command too.
A line printed by zerotrain (`zerotrain launch: host node2: ...`) is output, not a command.

The parser exits with SystemExit on an unknown flag or a bad value (prefix matching is off);
exit 0 (`--help`) is fine. No ranks, no model: seconds.
"""
from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^\s*(```|~~~)")
SEPARATORS = {"|", "||", "&&", ";", "&"}
REDIRECTS = {">", ">>", "<", "<<", ">&", "&>", "<&", ">|"}
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDERS = {"...", "\u2026"}
OUTPUT_LINE = re.compile(r"^(\S*/)?zerotrain( [\w-]+)?:")  # `zerotrain launch: lost host ...` (what it prints)


class Command(NamedTuple):
    where: str  # file:line of the command's first line
    text: str  # the joined line as written
    argv: list[str]  # what zerotrain's parser gets


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def code_lines(markdown: str) -> Iterator[tuple[int, str]]:
    """(line number of its first line, logical line) for each line inside fenced code blocks, with
    backslash continuations joined."""
    in_block, pending, start = False, "", 0
    for number, line in enumerate(markdown.splitlines(), 1):
        if FENCE.match(line):
            if pending:
                yield start, pending
            in_block, pending = not in_block, ""
            continue
        if not in_block:
            continue
        if not pending:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        yield start, pending + stripped
        pending = ""
    if pending:
        yield start, pending


def _tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def _segments(tokens: list[str]) -> Iterator[list[str]]:
    """Split on pipes, `&&`, `;`; drop redirections and their target."""
    segment: list[str] = []
    skip_next = False
    for tok in tokens:
        if skip_next:
            skip_next = False
            continue
        if tok in SEPARATORS:
            yield segment
            segment = []
        elif tok in REDIRECTS or (tok[:1] in "<>" and set(tok) <= set("<>&|")):
            skip_next = True
            if segment and segment[-1].isdigit():  # 2>/dev/null: the fd number belongs to the redirection
                segment.pop()
        else:
            segment.append(tok)
    yield segment


def zerotrain_argv(segment: list[str]) -> Optional[list[str]]:
    """The arguments zerotrain gets from one shell command, or None when it does not run zerotrain."""
    while segment and ENV_ASSIGN.match(segment[0]):
        segment = segment[1:]
    if not segment:
        return None
    if segment[0].rsplit("/", 1)[-1] == "zerotrain":
        argv = segment[1:]
    else:
        for i, tok in enumerate(segment[:-1]):
            if tok in ("-m", "--module") and segment[i + 1] == "zerotrain":
                argv = segment[i + 2:]
                break
        else:
            return None
    return [a for a in argv if a not in PLACEHOLDERS]


def commands_in(text: str, name: str) -> list[Command]:
    found = []
    for number, line in code_lines(text):
        stripped = line.strip()
        if stripped.startswith("$ "):
            stripped = stripped[2:]
        if OUTPUT_LINE.match(stripped):
            continue
        if "zerotrain" not in stripped:
            continue
        try:
            tokens = _tokens(stripped)
        except ValueError:  # unbalanced quotes: not shell (python code, output)
            continue
        for segment in _segments(tokens):
            argv = zerotrain_argv(segment)
            if argv is not None:
                found.append(Command(f"{name}:{number}", stripped, argv))
    return found


def all_commands(root: Path = ROOT) -> list[Command]:
    found = []
    for path in doc_files(root):
        if path.is_file():
            found += commands_in(path.read_text(encoding="utf-8"), str(path.relative_to(root)))
    return found


def parse_error(argv: list[str]) -> Optional[str]:
    """None when `zerotrain ARGV` parses (exit 0 counts: --help), else the parser's message."""
    from zerotrain.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as e:
        if e.code in (0, None):
            return None
        return err.getvalue().strip() or f"exit {e.code}"
    if getattr(args, "command", None) == "launch":  # `-- train ...`: the rank command, parsed too
        rest = list(args.rest)
        if rest[:1] == ["--"]:
            rest = rest[1:]
        if rest:
            return parse_error(rest)
    return None


COMMANDS = all_commands()


def test_docs_have_command_lines():
    """The extraction finds the commands (a change in how docs are written cannot empty this test)."""
    assert len(COMMANDS) >= 20, [c.where for c in COMMANDS]
    assert any(c.where.startswith("README.md:") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_doc_command_parses(command: Command):
    error = parse_error(command.argv)
    assert error is None, f"{command.where}: `{command.text}` does not parse: {error}"


def test_a_bad_command_is_rejected():
    """The same extraction and parse fail a made-up flag, a wrong value and a bad flag after launch's `--`."""
    markdown = "\n".join([
        "text zerotrain train --no-such-flag 1 outside a block",
        "```bash",
        "zerotrain train --no-such-flag 1",
        "torchrun --nproc_per_node 2 -m zerotrain train \\",
        "    --stage seven --output runs/x   # a comment",
        "zerotrain launch --hostfile hostfile -- train --no-such-flag 1",
        "zerotrain --help",
        "zerotrain launch: host node2: not reachable over passwordless ssh",
        "```",
    ])
    found = commands_in(markdown, "made-up.md")
    assert [c.where for c in found] == ["made-up.md:3", "made-up.md:4", "made-up.md:6", "made-up.md:7"]
    assert found[1].argv == ["train", "--stage", "seven", "--output", "runs/x"]
    bad, wrong_value, after_launch, help_ = (parse_error(c.argv) for c in found)
    assert bad and "--no-such-flag" in bad
    assert wrong_value
    assert after_launch and "--no-such-flag" in after_launch
    assert help_ is None


def test_shell_parts_are_dropped():
    line = "HF_HUB_OFFLINE=1 zerotrain estimate --model-config tiny-gpt2 --json 2>/dev/null | jq . > out.json && echo ok"
    (command,) = commands_in(f"```\n{line}\n```\n", "x.md")
    assert command.argv == ["estimate", "--model-config", "tiny-gpt2", "--json"]
    assert parse_error(command.argv) is None


def zerotrain_imports(root: Path = ROOT) -> list[tuple[str, str]]:
    """(file:line, statement) of every `from zerotrain... import ...` / `import zerotrain...` line in a
    fenced code block of README.md and docs/: the public API paths the docs promise."""
    found = []
    for path in doc_files(root):
        for number, line in code_lines(path.read_text()):
            stripped = line.strip()
            if re.match(r"^(from zerotrain(\.\w+)* import [\w, ]+|import zerotrain(\.\w+)*)$", stripped):
                found.append((f"{path.relative_to(root)}:{number}", stripped))
    return found


def test_the_documented_python_imports_work():
    """README's engine API (`zerotrain.config.build_config`, `zerotrain.engine.build_engine`, `zerotrain.dist`)
    imports from the paths the docs show."""
    found = zerotrain_imports()
    assert {s for _, s in found} >= {"from zerotrain.config import build_config",
                                     "from zerotrain.engine import build_engine", "from zerotrain import dist"}
    for where, statement in found:
        namespace: dict = {}
        exec(statement, namespace)  # an ImportError names the statement in the traceback
        assert len(namespace) > 1, where

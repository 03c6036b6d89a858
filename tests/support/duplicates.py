"""The project's own duplicate-code check (stdlib only; tests/unit/test_duplicates.py runs it).

    python -m tests.support.duplicates zerotrain tests      # one line a pair; nothing when clean

It reads every *.py file under a folder (leaving out `fixtures`, `__pycache__` and dot folders) and
lists the pairs of places that share a run of `min_lines` (6) or more lines that are the same, or of
the same shape. It mirrors the `duplicates` command of the development machine:

- Lines are read with `tokenize`, so white space is folded and comments drop out. Passed over (they
  neither count nor break a run): blank and comment lines, lines of lone punctuation (`)`, `],`,
  `):`), every line of an import statement, and a line that holds only a string (a docstring).
- Two lines are the same when their tokens are; they are of the same shape when they are the same
  once every identifier (not a keyword) reads NAME, every string STR and every number NUM.
- A run of lines that stands in more than 8 places is too common to list and is left out.
- Windows of `min_lines` kept lines that match are joined into runs, one run a reported pair:
  `zerotrain/a.py:10-24 ~ zerotrain/b.py:40-54`, with ` (same shape)` where no line of the run
  matches to the letter.

Exemption (the only one): a window of same-shape lines is boilerplate, and does not count, when its
lines are thin: fewer than 4 tokens a line on average (MIN_TOKENS: dataclass field ladders,
`name: int` + docstring, 37 pairs on zerotrain/ without it), or more than 60% punctuation and keywords
(THIN_SHARE: parametrize tables of `("text", "needle"),` rows, 1 pair on tests/ without it). Lines that
are the same to the letter always count, and so do same-shape calls such as `p.add_argument("--x",
type=int, default=1)` (14 tokens, half of them names and values).
"""
from __future__ import annotations

import io
import keyword
import sys
import tokenize
from collections import defaultdict
from pathlib import Path

TOO_COMMON = 8
"""A run of lines found in more places than this is left out (too common to list)."""
MIN_TOKENS = 4
"""A same-shape window with fewer tokens than this a line, on average, is boilerplate."""
THIN_SHARE = 0.6
"""A same-shape window whose thin tokens (punctuation, keywords) are more than this share of its
tokens is boilerplate."""
SKIPPED_DIRS = {"fixtures", "__pycache__"}
PUNCTUATION = set("()[]{},:;.")
_LAYOUT = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT,
           tokenize.ENCODING, tokenize.ENDMARKER}
_FSTRING_START = getattr(tokenize, "FSTRING_START", None)  # Python 3.12+: f-strings come in pieces
_FSTRING_END = getattr(tokenize, "FSTRING_END", None)


class Line:
    """One kept source line: its number, its text (tokens joined by one space) and its shape."""

    def __init__(self, number: int, text: str, shape: str, thin: int, count: int):
        self.number, self.text, self.shape, self.thin, self.count = number, text, shape, thin, count


def _word(tok: tokenize.TokenInfo) -> tuple[str, bool]:
    """(a token's shape word, whether it is thin)."""
    if tok.type == tokenize.NAME:
        return (tok.string, True) if keyword.iskeyword(tok.string) else ("NAME", False)
    if tok.type == tokenize.STRING:
        return "STR", False
    if tok.type == tokenize.NUMBER:
        return "NUM", False
    return tok.string, True


def _statements(source: str) -> list[list[tokenize.TokenInfo]]:
    """The file's tokens, one list a logical line (a statement, or a clause header), layout dropped;
    an f-string's pieces (3.12+) are joined into one STRING token."""
    out: list[list[tokenize.TokenInfo]] = [[]]
    fstring: list[tokenize.TokenInfo] = []
    depth = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if _FSTRING_START is not None and (tok.type == _FSTRING_START or depth):
            depth += (tok.type == _FSTRING_START) - (tok.type == _FSTRING_END)
            fstring.append(tok)
            if depth == 0:
                text = source_text(source, fstring[0].start, fstring[-1].end)
                out[-1].append(tokenize.TokenInfo(tokenize.STRING, text, fstring[0].start, fstring[-1].end, ""))
                fstring = []
            continue
        if tok.type == tokenize.NEWLINE:
            out.append([])
        elif tok.type not in _LAYOUT:
            out[-1].append(tok)
    return [s for s in out if s]


def source_text(source: str, start: tuple[int, int], end: tuple[int, int]) -> str:
    """The text between two (row, column) positions of `source`."""
    rows = source.splitlines(keepends=True)[start[0] - 1:end[0]]
    if len(rows) == 1:
        return rows[0][start[1]:end[1]]
    return rows[0][start[1]:] + "".join(rows[1:-1]) + rows[-1][:end[1]]


def kept_lines(source: str) -> list[Line]:
    """The lines of a Python source that count, in order (see the module docstring for what is passed over)."""
    lines = []
    for statement in _statements(source):
        first = statement[0].string
        if first == "import" or (first == "from" and any(t.string == "import" for t in statement)):
            continue
        by_row: dict[int, list[tokenize.TokenInfo]] = defaultdict(list)
        for tok in statement:
            by_row[tok.start[0]].append(tok)  # a token spanning rows (a long string) belongs to its first
        if len(by_row) == 1 and all(t.type == tokenize.STRING for t in statement):
            continue  # a docstring, or a string standing alone
        for row, toks in sorted(by_row.items()):
            if all(t.type == tokenize.OP and t.string in PUNCTUATION for t in toks):
                continue
            words = [_word(t) for t in toks]
            lines.append(Line(row, " ".join(t.string for t in toks), " ".join(w for w, _ in words),
                              sum(thin for _, thin in words), len(words)))
    return lines


def python_files(root: Path) -> list[Path]:
    """Every *.py file under root, sorted, outside SKIPPED_DIRS and dot folders."""
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in SKIPPED_DIRS or part.startswith(".") for part in p.relative_to(root).parts[:-1]))


def _windows(files: dict[str, list[Line]], min_lines: int):
    """(exact, shape) indexes: a window's key -> its places (file, index of its first kept line)."""
    exact: dict[tuple, list] = defaultdict(list)
    shaped: dict[tuple, list] = defaultdict(list)
    for name, lines in files.items():
        for i in range(len(lines) - min_lines + 1):
            window = lines[i:i + min_lines]
            exact[tuple(ln.text for ln in window)].append((name, i))
            shaped[tuple(ln.shape for ln in window)].append((name, i))
    return exact, shaped


def _thin(window: list[Line]) -> bool:
    """Whether a window is too thin to count by shape alone (the module docstring's exemption)."""
    count = sum(ln.count for ln in window)
    return count < MIN_TOKENS * len(window) or sum(ln.thin for ln in window) > THIN_SHARE * count


def duplicate_pairs(root: Path, min_lines: int = 6) -> list[str]:
    """One line a pair of places under `root` sharing a run of `min_lines` or more same or same-shape
    lines (`root/a.py:10-24 ~ root/b.py:40-54`), longest first; an empty list when there are none."""
    root = Path(root)
    files = {}
    for path in python_files(root):
        name = path.relative_to(root.parent).as_posix()
        files[name] = kept_lines(path.read_text(encoding="utf-8"))
    exact, shaped = _windows(files, min_lines)
    # (file a, file b) -> {(index in a, index in b): same to the letter}
    hits: dict[tuple[str, str], dict[tuple[int, int], bool]] = defaultdict(dict)
    for same, index in ((True, exact), (False, shaped)):
        for places in index.values():
            if len(places) < 2 or len(places) > TOO_COMMON:
                continue
            for j, (fa, ia) in enumerate(places):
                for fb, ib in places[j + 1:]:
                    if fa == fb and ib < ia + min_lines:
                        continue  # a window overlapping itself
                    if not same and _thin(files[fa][ia:ia + min_lines]):
                        continue
                    found = hits[fa, fb]
                    found[ia, ib] = found.get((ia, ib), False) or same
    rows = []
    for (fa, fb), found in hits.items():
        for ia, ib, last, same in _runs(found):
            a, b = files[fa], files[fb]
            end = last + min_lines - 1
            span = end - ia + 1
            rows.append((-span, fa, a[ia].number, f"{fa}:{a[ia].number}-{a[end].number} ~ "
                         f"{fb}:{b[ib].number}-{b[ib + end - ia].number}" + ("" if same else " (same shape)")))
    return [row for *_, row in sorted(rows)]


def _runs(found: dict[tuple[int, int], bool]) -> list[tuple[int, int, int, bool]]:
    """Matching windows joined into runs along each diagonal: (first index in a, first in b, last window
    index in a, whether any window is the same to the letter)."""
    runs: list[list] = []
    for ia, ib in sorted(found, key=lambda p: (p[1] - p[0], p[0])):
        run = runs[-1] if runs else None
        if run and run[1] - run[0] == ib - ia and run[2] + 1 == ia:
            run[2], run[3] = ia, run[3] or found[ia, ib]
        else:
            runs.append([ia, ib, ia, found[ia, ib]])
    return [tuple(r) for r in runs]


if __name__ == "__main__":
    for folder in sys.argv[1:] or ["zerotrain", "tests"]:
        for line in duplicate_pairs(Path(folder)):
            print(line)

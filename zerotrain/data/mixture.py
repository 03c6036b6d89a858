"""Mixtures of several data sources (--data a.jsonl,b.parquet --data-weights 0.7,0.3).

A weight is a source's share of the training rows (samples after tokenizing and packing): packed plain text
has seq_len tokens in every row, so there it is also the share of tokens; chat / prompt-completion rows differ
in length and the logs report both shares (source_tokens/<name>, source_samples/<name> in metrics.jsonl).
Rows, not tokens: the order is then a pure function of (the sources' row counts, the weights, --seed, epoch)
and needs no row to be read, and the same rule holds for a streamed source (datasets.interleave_datasets'
probabilities are per example too).

A source that runs out restarts (a new seeded permutation of its rows: oversampling, datasets'
stopping_strategy="all_exhausted"); an epoch of the mixture ends when every source has been seen whole at
least once, so no row is left out and a small source with a large weight repeats. A mixture of streams
(--streaming, zerotrain/data/streaming.py MixedStream) takes the same windows one after another for as long as
the run lasts (--max-steps): each source restarts by itself on each rank (its own epoch, its shuffle buffer
reseeded by seed + epoch) and the mixture never ends.

The order is stratified, not drawn row by row: every window of `window` positions (the global batch, one
optimizer step over every rank) takes each source's share to within one row (largest remainder), and the
window's positions are shuffled by the seed. Row-by-row draws (interleave_datasets) miss a 0.7 share by
about sqrt(0.21 / n): 6% over a 64-row run; the stratified order holds it at every step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..errors import UserError

SOURCE = "source"
"""A mixture row's source index (the row dicts MixtureRows hands out; collate_sources counts them)."""
SOURCE_COUNTS = "source_counts"
"""A mixture micro-batch's [2, sources] tensor: real tokens and rows per source (the trainer pops it: the model
must not see it)."""


def parse_weights(spec: str, weights: Optional[str]) -> Optional[list[float]]:
    """The weights of --data's comma list, normalized to sum 1; None: no mixture (a comma list concatenates).
    Refuses weights without a comma list, a count mismatch and non-positive weights in one line."""
    if weights is None:
        return None
    sources = split_sources(spec)
    try:
        values = [float(w) for w in weights.split(",") if w.strip()]
    except ValueError:
        raise UserError(f"--data-weights {weights}: expected a comma list of numbers, one per --data source") from None
    if len(sources) < 2:
        raise UserError(f"--data-weights {weights}: a mixture needs a comma list of sources in --data (got {spec}); "
                        "pass --data a.jsonl,b.parquet or drop --data-weights")
    if len(values) != len(sources):
        raise UserError(f"--data-weights {weights}: {len(values)} weights for {len(sources)} --data sources; "
                        "pass one weight per source")
    if any(not math.isfinite(v) or v <= 0 for v in values):
        raise UserError(f"--data-weights {weights}: every weight must be a positive number")
    total = sum(values)
    return [v / total for v in values]


def split_sources(spec: str) -> list[str]:
    return [s.strip() for s in spec.split(",") if s.strip()]


def source_names(sources: list[str]) -> list[str]:
    """Short names for the logs (file names without their extension), made unique by their index."""
    names = [os.path.splitext(os.path.basename(s.rstrip("/")))[0] or s for s in sources]
    return [n if names.count(n) == 1 else f"{i}-{n}" for i, n in enumerate(names)]


def epoch_length(sizes: list[int], weights: list[float]) -> int:
    """Rows in one epoch of the mixture: until every source has been seen whole (all_exhausted)."""
    return max(math.ceil(n / w - 1e-9) for n, w in zip(sizes, weights))


def _targets(w: np.ndarray, end: int) -> np.ndarray:
    """Each source's rows among the first `end` positions: its share, rounded by largest remainder (ties to the
    earlier source), summing to `end`."""
    ideal = w * end
    target = np.floor(ideal).astype(np.int64)
    short = end - int(target.sum())
    if short > 0:
        target[np.argsort(-(ideal - target), kind="stable")[:short]] += 1
    return target


def schedule_window(weights: list[float], k: int, window: int, seed: int, epoch: int) -> np.ndarray:
    """The sources of positions [k * window, (k + 1) * window): each source's count makes its cumulative count its
    share to within one row, shuffled by (seed, epoch, k). Addressable by k alone, so a streamed mixture can take
    window after window of the same schedule."""
    w = np.asarray(weights, dtype=np.float64)
    take = np.maximum(_targets(w, (k + 1) * window) - _targets(w, k * window), 0)
    while take.sum() > window:  # a tiny weight's rounding can overshoot by a row: the largest count gives it back
        take[np.argmax(take)] -= 1
    block = np.repeat(np.arange(len(w)), take)
    np.random.default_rng([seed, epoch, k, 0x6D6978]).shuffle(block)
    return block


def source_schedule(weights: list[float], length: int, window: int, seed: int, epoch: int) -> np.ndarray:
    """Which source each of the first `length` positions of an epoch draws from (schedule_window's windows)."""
    n = -(-length // window)
    return np.concatenate([schedule_window(weights, k, window, seed, epoch) for k in range(n)])[:length] \
        if n else np.zeros(0, dtype=np.int64)


def mixture_order(sizes: list[int], weights: list[float], seed: int, epoch: int, window: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(source, row) for every position of one epoch: a pure function of its arguments (exact resume). Each
    source's rows come in a seeded permutation, a new one each time the source runs out."""
    length = epoch_length(sizes, weights)
    src = source_schedule(weights, length, max(1, window), seed, epoch)
    rows = np.empty(length, dtype=np.int64)
    for s, n in enumerate(sizes):
        at = np.flatnonzero(src == s)
        rng = np.random.default_rng([seed, epoch, s, 0x726F77])
        cycles = math.ceil(len(at) / n) if n else 0
        perm = np.concatenate([rng.permutation(n) for _ in range(cycles)]) if cycles else np.zeros(0, np.int64)
        rows[at] = perm[:len(at)]
    return src, rows


@dataclass
class Mixture:
    """The sources of a mixed training set: the tokenized rows are their concatenation, source by source."""

    names: list[str]
    """Each source's short name (source_names)."""
    sizes: Optional[list[int]]
    """Each source's tokenized rows; None: streamed sources (--streaming), whose rows are not counted ahead."""
    weights: list[float]
    """Each source's share of the rows (sum 1)."""

    @property
    def offsets(self) -> list[int]:
        return [int(x) for x in np.cumsum([0, *self.sizes[:-1]])]

    def rows(self, data: Any, seed: int, epoch: int, window: int) -> "MixtureRows":
        return MixtureRows(data, self, *mixture_order(self.sizes, self.weights, seed, epoch, window))

    def record(self) -> dict[str, Any]:
        """What a checkpoint records of the mixture (a resume must mix the same rows the same way)."""
        return {"names": self.names, "sizes": self.sizes, "weights": self.weights}

    def line(self) -> str:
        if self.sizes is None:
            return "mixture of streams " + ", ".join(f"{n} {w:.3g}" for n, w in zip(self.names, self.weights))
        return "mixture " + ", ".join(f"{n} {w:.3g} of {s} rows" for n, w, s in zip(self.names, self.weights,
                                                                                   self.sizes))


def resume_check(recorded: Optional[dict[str, Any]], now: Optional["Mixture"]) -> None:
    """Refuse a resume whose mixture (or its absence) is not the checkpoint's: its order would differ."""
    if recorded == (now.record() if now is not None else None):
        return

    def said(rec: Optional[dict[str, Any]]) -> str:
        return "no mixture" if rec is None else Mixture(rec["names"], rec["sizes"], rec["weights"]).line()
    raise UserError(f"--data-weights: the checkpoint's run trained on {said(recorded)}, this run on "
                    f"{said(now.record() if now is not None else None)}; resume with the same --data and --data-weights")


class MixtureRows:
    """One epoch of the mixture as a map-style dataset: position i -> that source's row, with its source index."""

    def __init__(self, data: Any, mix: Mixture, src: np.ndarray, rows: np.ndarray):
        self.data, self.src = data, src
        self.index = rows + np.asarray(mix.offsets, dtype=np.int64)[src]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict:
        return {**self.data[int(self.index[i])], SOURCE: int(self.src[i])}


def count_sources(rows: list[dict], n_sources: int):
    """[2, n_sources] float64 tensor: each source's real tokens and rows in these rows."""
    import torch

    out = torch.zeros((2, n_sources), dtype=torch.float64)
    for r in rows:
        out[0, r[SOURCE]] += len(r["input_ids"])
        out[1, r[SOURCE]] += 1
    return out


def share_figures(names: list[str], sums: list[float]) -> dict[str, float]:
    """metrics.jsonl's per-source figures from the step's summed [tokens..., rows...] (StepFigures)."""
    n = len(names)
    out = {f"source_tokens/{k}": sums[i] for i, k in enumerate(names)}
    out.update({f"source_samples/{k}": sums[n + i] for i, k in enumerate(names)})
    return out


def shares_line(totals: dict[str, float]) -> str:
    """The run summary's line from share_figures' keys summed over steps: each source's share of tokens and rows."""
    tokens = {k.split("/", 1)[1]: v for k, v in totals.items() if k.startswith("source_tokens/")}
    rows = {k.split("/", 1)[1]: v for k, v in totals.items() if k.startswith("source_samples/")}
    t, r = max(sum(tokens.values()), 1.0), max(sum(rows.values()), 1.0)
    return "sources: " + ", ".join(f"{k} {100 * tokens[k] / t:.1f}% of tokens / {100 * rows.get(k, 0.0) / r:.1f}% "
                                   "of samples" for k in tokens)

"""Verifiable toy rewards for the grpo tests and the TRL comparison, with TRL's reward-function signature
(loaded by path: --reward-funcs tests/support/grpo_rewards.py:known_words,...).

- known_words: the share of a completion's tokens that are words of the tiny tokenizer (ids below
  KNOWN_IDS; tests/support/make_pref_data.py): a random-init model samples them ~15% of the time over its 1024-id
  vocabulary, so the reward is dense and learnable in a few dozen steps.
- says_target: 1.0 when the completion's text holds the row's `target` column (a dataset column reaching the
  function as a keyword argument, as in TRL), else 0.0; None for a row without a target (TRL: skipped).
"""
from __future__ import annotations


def _known_ids() -> int:
    from tests.support.make_pref_data import SPECIAL, WORDS

    return len(SPECIAL) + len(WORDS)


KNOWN_IDS = _known_ids()


def known_words(prompts, completions, completion_ids, **kwargs):
    return [sum(1 for t in ids if 4 <= t < KNOWN_IDS) / max(len(ids), 1) for ids in completion_ids]


def _text(completion) -> str:
    return completion[-1]["content"] if isinstance(completion, list) else completion


def says_target(prompts, completions, target=None, **kwargs):
    targets = target if target is not None else [None] * len(completions)
    return [None if t is None else float(t in _text(c).split()) for c, t in zip(completions, targets)]


def fails_on_sun(prompts, completions, target=None, **kwargs):
    """Raises for rows whose target is "sun" (the error test: one rank's reward function fails)."""
    if target is not None and "sun" in target:
        raise ValueError("no reward for the sun")
    return [0.0] * len(completions)

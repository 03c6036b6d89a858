"""The pieces preference tasks use under sequence parallelism (zerotrain/train/preference.py), in one process: the
cut of the shifted labels and completion mask, the sum of the shards' row sums, and the loss whose gradient is
scaled by sp. The 2-rank runs against one process are tests/multirank/test_preference_sp.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zerotrain.config.load import build_config
from zerotrain.errors import ConfigError
from zerotrain.model import sequence_parallel as seqpar
from zerotrain.train.preference import IGNORE, shifted_labels, sp_gradient, token_logps


def test_the_shards_sum_to_the_whole_rows_as_shard_batch_cuts_them():
    torch.manual_seed(0)
    rows, seq, vocab = 3, 11, 7  # 11 tokens: padded to 12 for sp 2, 12 for sp 3, 12 for sp 4
    ids = torch.randint(0, vocab, (rows, seq))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding
    completion = torch.zeros_like(ids)
    completion[:, 5:] = 1
    completion[1, 8:] = 0
    logits = torch.randn(rows, seq, vocab)
    labels = shifted_labels(ids, mask)
    whole = token_logps(logits, labels)
    want_completion = (whole[:, :-1] * completion[:, 1:]).sum(1)
    in_completion = torch.cat([completion[:, 1:], completion.new_zeros((rows, 1))], dim=1)
    for sp in (2, 3, 4):
        got_c, got_s = torch.zeros(rows), torch.zeros(rows)
        for rank in range(sp):
            g = seqpar.SequenceGroup(None, sp, rank)
            cut = seqpar.shard_batch({"input_ids": ids}, g)  # the engine's cut of the input ids
            local_logits = _shard3(logits, g)
            local_labels = seqpar.cut(labels, g, IGNORE)
            assert cut["input_ids"].shape == local_labels.shape
            per_token = token_logps(local_logits, local_labels)
            got_c += (per_token * seqpar.cut(in_completion, g, 0)).sum(1)
            got_s += per_token.sum(1)
        assert torch.allclose(got_c, want_completion, rtol=1e-6), sp
        assert torch.allclose(got_s, whole.sum(1), rtol=1e-6), sp


def _shard3(x: torch.Tensor, g: seqpar.SequenceGroup) -> torch.Tensor:
    """A [rows, seq, vocab] tensor's shard, padded like sequence_parallel.cut (what the model's local logits are)."""
    s = x.shape[1]
    width = -(-s // g.size) * g.size
    x = torch.nn.functional.pad(x, (0, 0, 0, width - s))
    return x[:, g.rank * width // g.size:(g.rank + 1) * width // g.size]


def test_sp_gradient_keeps_the_value_and_scales_the_gradient():
    w = torch.tensor(2.0, requires_grad=True)
    loss = sp_gradient(w ** 2, SimpleNamespace(size=4))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(4.0) and float(w.grad) == pytest.approx(4 * 4.0)
    plain = torch.tensor(3.0)
    assert sp_gradient(plain, None) is plain


def test_grpo_with_sp_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"--task grpo with --sp 2: online RL under sequence parallelism is not "
                                          r"built .*; pass --sp 1"):
        build_config(overrides={"model.task": "grpo", "parallel.sp": 2, "rl.reward_funcs": "x.py:f"})

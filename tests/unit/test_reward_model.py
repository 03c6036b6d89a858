"""The reward model's loss and metrics (zerotrain/train/reward_model.py) on hand-made scores against TRL 1.16's
RewardTrainer.compute_loss formulas, written out here as TRL writes them; the micro-batch sums reduce to the whole
batch's figures however the batch is split; and --task reward's refusals (in-process `zerotrain train`)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from zerotrain.train.metrics import _local
from zerotrain.train.reward_model import RewardObjective, batch_loss, metrics_from_sums, pair_losses, pair_sums

CHOSEN = torch.tensor([0.7, -0.2, 1.5, 0.1, -1.1, 0.4])
REJECTED = torch.tensor([0.3, 0.5, -0.8, 0.1, -2.0, 0.9])
MARGIN = torch.tensor([0.5, 0.0, 1.0, -0.25, 0.0, 0.3])


def trl_loss(c, r, margin=None, coef=None):
    """trl/trainer/reward_trainer.py compute_loss, verbatim."""
    if margin is not None:
        loss = -F.logsigmoid(c - r - margin).mean()
    else:
        loss = -F.logsigmoid(c - r).mean()
    if coef is not None:
        loss += coef * torch.mean((c + r) ** 2)
    return loss


def trl_metrics(c, r):
    logits = torch.cat([c, r])
    return {"min_reward": logits.min().item(), "mean_reward": logits.mean().item(), "max_reward": logits.max().item(),
            "accuracy": (c > r).float().mean().item(), "margin": (c - r).mean().item()}


@pytest.mark.parametrize("margin", [None, MARGIN], ids=["plain", "margin"])
@pytest.mark.parametrize("coef", [None, 0.01], ids=["uncentred", "centred"])
def test_loss_equals_trl(margin, coef):
    assert batch_loss(CHOSEN, REJECTED, margin, coef) == trl_loss(CHOSEN, REJECTED, margin, coef)  # bit for bit
    assert pair_losses(CHOSEN, REJECTED, margin, coef).mean() == pytest.approx(
        float(trl_loss(CHOSEN, REJECTED, margin, coef)), rel=1e-6)
    # the margin and the centring term really change it
    assert float(trl_loss(CHOSEN, REJECTED, MARGIN, None)) != pytest.approx(float(trl_loss(CHOSEN, REJECTED)))
    assert float(trl_loss(CHOSEN, REJECTED, None, 0.5)) > float(trl_loss(CHOSEN, REJECTED))


class FakeEngine:
    """Scores rows by a fixed table (the head's one logit), as the engine's forward returns them."""

    def __init__(self, scores, aux=None):
        self.scores, self.aux = scores, aux

    def __call__(self, input_ids, attention_mask, use_cache):
        assert use_cache is False and input_ids.shape == attention_mask.shape
        out = {"logits": self.scores[input_ids[:, 0]].unsqueeze(1), "aux_loss": self.aux}

        class Out(dict):
            logits = out["logits"]

        return Out(out)


def batch_of(rows: slice, margin=None):
    n = len(CHOSEN)
    idx = torch.arange(n)[rows]
    ids = torch.cat([idx, idx + n]).unsqueeze(1).repeat(1, 3)
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if margin is not None:
        b["margin"] = margin[rows]
    return b


def test_micro_batch_sums_give_the_whole_batch_figures():
    """Three micro-batches of 2 pairs, reduced as StepFigures does (sums, *_min by min, *_max by max), give TRL's
    metrics over the 6 pairs; the router loss is added with its coefficient."""
    table = torch.cat([CHOSEN, REJECTED])
    objective = RewardObjective(0.01, router_coef=0.5)
    outs = [objective(FakeEngine(table, aux=torch.tensor(0.2)), batch_of(slice(i, i + 2), MARGIN))
            for i in range(0, 6, 2)]
    for i, out in enumerate(outs):
        rows = slice(2 * i, 2 * i + 2)
        expected = trl_loss(CHOSEN[rows], REJECTED[rows], MARGIN[rows], 0.01) + 0.5 * 0.2
        assert float(out.loss) == pytest.approx(float(expected), rel=1e-6) and float(out.aux_loss) == pytest.approx(0.2)
    totals = {k: _local(k, [float(o.sums[k]) for o in outs], 1.0) for k in outs[0].sums}
    got, want = objective.finish(totals), trl_metrics(CHOSEN, REJECTED)
    assert set(got) == set(objective.metric_names) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
    # a tie (pair 3: 0.1 vs 0.1) is not counted as correct, as TRL's strict >
    assert got["accuracy"] == pytest.approx(3 / 6)


def test_eval_sums_mask_padding_rows():
    valid = torch.tensor([1, 1, 1, 1, 0, 0])  # the last two repeat earlier pairs (eval_loader's padding)
    sums = pair_sums(CHOSEN, REJECTED, valid)
    want = trl_metrics(CHOSEN[:4], REJECTED[:4])
    got = metrics_from_sums({k: float(v) for k, v in sums.items()})
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
    assert sums["pairs"] == 4 and sums["scores"] == 8


# --- refusals (in-process `zerotrain train`, before any rank starts) ------------------------------------------
@pytest.fixture(scope="module")
def model_and_pairs(tmp_path_factory):
    from tests.support.make_pref_data import tiny_model, write_pairs

    root = tmp_path_factory.mktemp("reward_rules")
    rows = [json.loads(line) for line in write_pairs(root / "pairs.jsonl", 4).read_text().splitlines()]
    rows[2]["margin"] = "big"
    (root / "bad_margin.jsonl").write_text("".join(json.dumps({**r, "margin": r.get("margin", 1.0)}) + "\n"
                                                   for r in rows))
    return str(tiny_model("gpt2", root / "gpt2")), str(root / "pairs.jsonl"), root


@pytest.mark.parametrize("args,needle", [
    (("--beta", 0.2), "pref.beta"),
    (("--max-prompt-len", 8), "pref.max_prompt_len"),
    (("--num-labels", 3), "--num-labels 3"),
    (("--data", "{root}/bad_margin.jsonl"), "margin"),
])
def test_reward_refusals_are_one_line(model_and_pairs, tmp_path, capsys, args, needle):
    from zerotrain.cli import main

    model, data, root = model_and_pairs
    args = [str(a).format(root=root) for a in args]
    if "--data" not in args:
        args = ["--data", data, *args]
    code = main(["train", "--task", "reward", "--model", model, "--output", str(tmp_path / "out"), "--max-steps", "1",
                 *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and err, err
    last = err[-1]
    assert needle in last and "Traceback" not in "\n".join(err), err

"""KTO's loss and metrics (zerotrain/train/kto.py) against TRL 1.16's own KTOTrainer._compute_loss, on hand-made
log-probs: TRL's method runs on a stand-in trainer whose "model" returns per-token log-probs that sum to the
chosen values (precomputed reference log-probs in the batch, as TRL's precompute_ref_log_probs path reads them).
Also: the KL clamp, a class absent from a batch (TRL leaves its figures out: so does zerotrain, no NaN), the
global KL over micro-batches and ranks, the class-balance warning's ranges (TRL's numbers)."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from zerotrain.train.kto import KTOLoss, balance_warning, metrics_of, row_sums

T = 5  # tokens per row: the stand-in model puts a row's whole log-prob on its first predicted token


def _trl(policy, ref, kl_policy, kl_ref, label, beta, w_d, w_u):
    """(TRL's loss, TRL's metrics) for one batch on one process."""
    from trl.trainer.kto_trainer import KTOTrainer

    rows = len(label)
    ids, kl_ids = torch.ones((rows, T), dtype=torch.long), torch.ones((rows, T), dtype=torch.long)
    mask = torch.ones((rows, T), dtype=torch.long)

    def model(input_ids, labels, **_):
        values = kl_policy if input_ids is kl_ids else policy
        log_probs = torch.zeros((rows, T - 1))
        log_probs[:, 0] = torch.tensor(values)
        return SimpleNamespace(log_probs=log_probs, entropy=torch.zeros((rows, T - 1)),
                               mean_logits=torch.zeros((rows, T - 1)))

    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x),
        precompute_ref_logps=True, calculate_KL=True, loss_type="kto", beta=beta, desirable_weight=w_d,
        undesirable_weight=w_u, _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1,
        aux_loss_enabled=False)
    trainer._compute_kl_logps = lambda m, b: KTOTrainer._compute_kl_logps(trainer, m, b)
    batch = {"input_ids": ids, "attention_mask": mask, "completion_mask": mask, "KL_input_ids": kl_ids,
             "KL_attention_mask": mask, "KL_completion_mask": mask, "label": torch.tensor(label),
             "ref_logps": torch.tensor(ref), "ref_KL_logps": torch.tensor(kl_ref)}
    loss = KTOTrainer._compute_loss(trainer, model, batch, False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _ours(policy, ref, kl_policy, kl_ref, label, beta, w_d, w_u):
    spec = KTOLoss(beta, w_d, w_u)
    kl = max(sum(p - r for p, r in zip(kl_policy, kl_ref)) / len(kl_policy), 0.0)
    logps, label_t = torch.tensor(policy), torch.tensor(label)
    logratio = logps - torch.tensor(ref)
    loss = spec.row_losses(logratio, label_t, kl).mean()
    sums = {k: float(v) for k, v in row_sums(spec, logratio, logps, label_t).items()}
    return float(loss), metrics_of({**sums, "kl_max": kl})


CASES = {
    # policy, reference, KL rows' policy and reference, labels, beta, desirable and undesirable weights
    "mixed": ([-12.0, -8.5, -20.25, -5.0], [-11.0, -9.0, -19.0, -6.5], [-14.0, -10.0, -18.0, -9.0],
              [-13.0, -10.5, -18.5, -8.0], [True, False, True, False], 0.1, 1.0, 1.0),
    "weighted": ([-12.0, -8.5, -20.25, -5.0, -7.0], [-11.0, -9.0, -19.0, -6.5, -7.5],
                 [-14.0, -10.0, -18.0, -9.0, -6.0], [-13.0, -10.5, -18.5, -8.0, -7.0],
                 [True, False, True, True, False], 0.5, 1.5, 0.75),
    "kl-clamped": ([-12.0, -8.5, -20.25], [-11.0, -9.0, -19.0], [-16.0, -12.0, -19.0], [-13.0, -10.5, -18.5],
                   [False, True, False], 0.1, 1.0, 1.33),
    "only-desirable": ([-12.0, -8.5], [-11.0, -9.0], [-10.0, -8.0], [-11.0, -9.0], [True, True], 0.2, 1.0, 1.0),
    "only-undesirable": ([-12.0, -8.5], [-11.0, -9.0], [-10.0, -8.0], [-11.0, -9.0], [False, False], 0.2, 1.0, 1.0),
}


@pytest.mark.parametrize("case", CASES)
def test_loss_and_metrics_equal_trls_compute_loss(case):
    args = CASES[case]
    trl_loss, trl_metrics = _trl(*args)
    loss, metrics = _ours(*args)
    assert loss == pytest.approx(trl_loss, rel=1e-6), case
    names = {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"}
    assert set(metrics) == names & set(trl_metrics), (metrics, trl_metrics)  # a class absent: left out by both
    for k, v in metrics.items():
        assert v == pytest.approx(trl_metrics[k], rel=1e-6, abs=1e-7), (case, k)
        assert math.isfinite(v)
    if case == "kl-clamped":
        assert metrics["kl"] == 0.0  # the KL rows' mean log-ratio is negative: clamped to 0 as TRL does
    if case.startswith("only"):
        assert "rewards/margins" not in metrics and len(metrics) == 3, metrics


def test_step_sums_over_micro_batches_and_ranks_give_one_batch_figures():
    """The metrics from sums over four pieces of a batch (2 micro-batches x 2 ranks, some without a class) equal
    the whole batch's; the loss: the mean of the pieces' means (the engines') is the batch mean, with one kl."""
    policy, ref, _, _, label, beta, w_d, w_u = CASES["weighted"]
    policy, ref, label = policy + [-3.0, -4.0, -9.0], ref + [-3.5, -3.0, -9.25], label + [True, True, False]
    spec, kl = KTOLoss(beta, w_d, w_u), 0.37
    logps, label_t = torch.tensor(policy), torch.tensor(label)
    logratio = logps - torch.tensor(ref)
    whole = {k: float(v) for k, v in row_sums(spec, logratio, logps, label_t).items()}
    totals = defaultdict(float)
    losses = []
    for part in torch.arange(8).chunk(4):
        for k, v in row_sums(spec, logratio[part], logps[part], label_t[part]).items():
            totals[k] += float(v)
        losses.append(spec.row_losses(logratio[part], label_t[part], kl).mean())
    assert metrics_of({**totals, "kl_max": kl}) == pytest.approx(metrics_of({**whole, "kl_max": kl}))
    assert float(torch.stack(losses).mean()) == pytest.approx(float(spec.row_losses(logratio, label_t, kl).mean()))


@pytest.mark.parametrize("desirable, undesirable, w_d, w_u, warned", [
    (10, 10, 1.0, 1.0, False),   # balanced: no warning
    (10, 30, 1.0, 1.0, True),    # 1:3 with equal weights: TRL recommends desirable in [3.0, 3.99]
    (10, 30, 3.5, 1.0, False),
    (30, 10, 1.0, 2.5, False),   # undesirable weight in [2.26, 3.0]
    (30, 10, 1.0, 1.0, True),
])
def test_balance_warning_ranges_are_trls(desirable, undesirable, w_d, w_u, warned):
    line = balance_warning(desirable, undesirable, w_d, w_u)
    assert (line is not None) == warned, line
    if warned:
        assert "--desirable-weight" in line and "--undesirable-weight" in line and "\n" not in line
        if undesirable > desirable:
            assert "--desirable-weight in [3.0, 3.99]" in line and "--undesirable-weight in [0.25, 0.33]" in line

"""A step trains on the global per-token mean loss (Engine.train_step's num_items_in_batch), however the
label tokens fall across micro-batches and ranks: 2 ranks x grad-accum 2 with prompt-like -100 prefixes of
different lengths per row, against one process that runs the whole global batch in ONE forward (HF's own
mean over every label token), fp32, 1e-5; the mean of per-micro-batch means differs from it (the test can
fail). Llama on DeepSpeed ZeRO-2 and FSDP2 stage 3."""
from __future__ import annotations

import json

import pytest
import torch

import tests.support.families as families
import tests.support.reference as ref
from tests.support.launch import torchrun


def whole_batch_reference(model_dir) -> dict:
    """One process, one forward per step over the whole global batch: the per-token mean by definition."""
    from zerotrain.config.load import build_config
    from zerotrain.plan.schedule import make_scheduler

    model = ref.load_model(model_dir).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=ref.LR, weight_decay=ref.WD)
    cfg = build_config(overrides={"schedule.warmup_steps": ref.WARMUP, "optimizer.lr": ref.LR})
    sched = make_scheduler(opt, cfg, ref.STEPS)
    n = ref.WORLD * ref.ACCUM * ref.MICRO
    data = ref.global_batches(ref.STEPS, n, ref.DEFAULT_SEQ, model.config.vocab_size)
    losses, norms, mean_of_means = [], [], None
    for s in range(ref.STEPS):
        x = data[s]
        labels = families.masked_labels(x)
        if s == 0:
            with torch.no_grad():  # what a mean of micro-batch means would have reported instead
                mean_of_means = sum(float(model(input_ids=x[i:i + ref.MICRO], labels=labels[i:i + ref.MICRO]).loss)
                                    for i in range(0, n, ref.MICRO)) / (n // ref.MICRO)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        losses.append(float(loss))
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, ref.CLIP)))
        opt.step()
        sched.step()
    return {"losses": losses, "grad_norms": norms, "mean_of_means": mean_of_means}


@pytest.mark.multirank
@pytest.mark.parametrize("backend,stage", [("deepspeed", 2), ("fsdp", 3)])
def test_step_loss_is_the_global_token_mean(tmp_path, backend, stage):
    llama = families.make_model_dir("llama", tmp_path / "llama")
    expected = whole_batch_reference(llama)
    assert abs(expected["mean_of_means"] - expected["losses"][0]) > 1e-4 * expected["losses"][0]  # 10x the tolerance
    out = tmp_path / "run.json"
    torchrun(ref.engine_worker_args(llama, out, "--backend", backend, "--stage", stage, "--whole-step",
                                    "--masked-labels"), timeout=300)
    result = json.loads(out.read_text())
    loss_d = ref.max_rel(ref.series(result, "loss"), expected["losses"])
    norm_d = ref.max_rel(ref.series(result, "grad_norm"), expected["grad_norms"])
    print(f"TOKEN-MEAN {backend} z{stage}: loss max rel diff {loss_d:.2e}, grad-norm {norm_d:.2e}")
    assert loss_d <= 1e-5 and norm_d <= 1e-5, (ref.series(result, "loss"), expected["losses"])

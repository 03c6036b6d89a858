"""Single-process plain-PyTorch reference for engine parity tests, and the shared test fixtures.

The reference trains the same model on the same global batches with torch.optim.AdamW, the same
LambdaLR (zerotrain.plan.schedule) and the same clipping, so any engine (DeepSpeed stage 0-3, FSDP2)
must reproduce its per-step losses and gradient norms.

Data layout (what every rank of a worker sees): step s has a global batch of
world * grad_accum * micro samples; rank r takes the contiguous block r*(accum*micro) ..., and its
micro-step m takes `micro` samples of that block. Every sample has the same token count, so the
mean of micro-batch mean losses is the global mean loss.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

DEFAULT_SEQ = 32

# The engine tests' shared run (tests/support/engine_worker.py on 2 ranks vs reference_run): 6 optimizer
# steps of 2 micro-batches of 2 on each of 2 ranks, AdamW lr 1e-3 with weight decay, clipping at
# 1.0 (active in the first steps) and 2 warm-up steps, so lr, clipping and accumulation all show.
STEPS, ACCUM, MICRO, WORLD, LR, WD, CLIP, WARMUP = 6, 2, 2, 2, 1e-3, 0.01, 1.0, 2
ENGINE_WORKER = str(Path(__file__).with_name("engine_worker.py"))


def engine_worker_args(model_dir: str | Path, out: str | Path, *args: Any, accum: int = ACCUM) -> list:
    """The engine worker's command line for the shared run, plus `args` (backend, stage, ...).

    A flag repeated in `args` (e.g. --timeout) wins: argparse keeps the last value."""
    return [ENGINE_WORKER, "--model-dir", model_dir, "--out", out, "--steps", STEPS, "--grad-accum", accum,
            "--micro", MICRO, "--lr", LR, "--weight-decay", WD, "--clip", CLIP, "--warmup", WARMUP,
            "--timeout", 120, *args]


MP_GLOBAL_MICRO_BATCHES, MP_CLIP = 4, 0.5
"""Model-parallel tests (tp/pp): 4 micro-batches per step over the data-parallel replicas (the same global
batch at dp 1 and 2); clip 0.5, below every family model's norms, so clipping is exercised."""


def mp_micro(dp: int) -> int:
    """Micro-batch per replica that keeps the model-parallel tests' global batch at data-parallel size dp."""
    return MICRO * MP_GLOBAL_MICRO_BATCHES // (ACCUM * dp)


def mp_worker(model_dir: str | Path, out: Path, *args: Any, nproc: int, dp: int) -> dict:
    """tests/support/engine_worker.py on nproc ranks (launch.ranks) for a tp/pp run (`args` name backend, stage, --tp/--pp)."""
    import json

    from tests.support.launch import ranks

    ranks(engine_worker_args(model_dir, out, "--clip", MP_CLIP, "--micro", mp_micro(dp), *args), nproc=nproc,
          timeout=400)
    return json.loads(Path(out).read_text())


def mp_reference(model_dir: str | Path, dp: int) -> dict:
    """The one-process run with the same global batch as a tp/pp run at data-parallel size dp."""
    return reference_run(model_dir, steps=STEPS, world=dp, grad_accum=ACCUM, micro=mp_micro(dp), lr=LR,
                         weight_decay=WD, clip=MP_CLIP, warmup=WARMUP)

def engine_reference(model_dir: str | Path) -> dict[str, Any]:
    """reference_run for the shared engine run."""
    return reference_run(model_dir, steps=STEPS, world=WORLD, grad_accum=ACCUM, micro=MICRO, lr=LR,
                         weight_decay=WD, clip=CLIP, warmup=WARMUP)


def make_model_dir(path: str | Path, seed: int = 0, preset: str = "tiny-gpt2") -> Path:
    """A tiny HF GPT-2 (dropout 0) with seeded random weights, saved with save_pretrained (fp32)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from zerotrain.assets.demo import TINY_PRESETS

    kw = dict(TINY_PRESETS[preset])
    kw.pop("model_type")
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**kw, bos_token_id=0, eos_token_id=0))
    path = Path(path)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def load_model(model_dir: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)


def global_batches(steps: int, global_batch: int, seq_len: int = DEFAULT_SEQ, vocab: int = 1024,
                   seed: int = 1234) -> torch.Tensor:
    """[steps, global_batch, seq_len] synthetic token ids, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, global_batch, seq_len), generator=g)


def micro_batch(batches: torch.Tensor, step: int, rank: int, micro_step: int, micro: int, grad_accum: int) -> torch.Tensor:
    start = rank * grad_accum * micro + micro_step * micro
    return batches[step, start:start + micro]


def probe_input(vocab: int = 1024, seq_len: int = DEFAULT_SEQ) -> torch.Tensor:
    """A fixed input for comparing logits of exported models."""
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, vocab, (2, seq_len), generator=g)


def reference_run(model_dir: str | Path, *, steps: int, world: int, grad_accum: int, micro: int, lr: float,
                  weight_decay: float, clip: float, schedule: str = "cosine", warmup: int = 0,
                  min_lr_ratio: float = 0.0, seq_len: int = DEFAULT_SEQ, betas=(0.9, 0.999),
                  eps: float = 1e-8, task: str = "causal-lm", build=None, make_optimizer=None,
                  make_scheduler=None, router_aux_coef: Optional[float] = None) -> dict[str, Any]:
    """Train in one process; returns per-step losses, pre-clip grad norms, LRs and the final state dict.

    task/build: the model family's task (families.model_inputs) and a model factory (default
    load_model(model_dir)); a seq-cls head must come from the same seeded factory as the engine's.
    make_optimizer(params) / make_scheduler(optimizer): other than torch AdamW (lr, betas, eps,
    weight_decay) and zerotrain's schedule (tests/multirank/test_optimizers.py builds both from torch/transformers)."""
    from tests.support.families import model_inputs
    from zerotrain.config.load import build_config
    from zerotrain.plan.schedule import make_scheduler as zerotrain_scheduler

    cfg = build_config(overrides={"schedule.name": schedule, "schedule.warmup_steps": warmup,
                                  "schedule.min_lr_ratio": min_lr_ratio, "optimizer.lr": lr})
    model = build() if build is not None else load_model(model_dir)
    model.train()
    router_loss(model, router_aux_coef)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params) if make_optimizer is not None else \
        torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    sched = make_scheduler(opt) if make_scheduler is not None else zerotrain_scheduler(opt, cfg, steps)
    data = global_batches(steps, world * grad_accum * micro, seq_len, model.config.vocab_size)
    losses, norms, lrs = [], [], []
    n = world * grad_accum
    for s in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(world):
            for m in range(grad_accum):
                x = micro_batch(data, s, r, m, micro, grad_accum)
                loss = model(**model_inputs(x, task)).loss
                (loss / n).backward()
                total += loss.item()
        losses.append(total / n)
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        norms.append(float(norm))
        opt.step()
        sched.step()
    return {"losses": losses, "grad_norms": norms, "lrs": lrs,
            "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def router_loss(model: torch.nn.Module, coef: Optional[float] = None) -> None:
    """A mixture of experts trains with its own router load-balancing loss, as zerotrain does by default (coef
    None: the config's router_aux_loss_coef; 0: off): transformers adds it inside each forward, so the
    reference computes it on each (rank, micro-batch) slice, as every rank does."""
    cfg = model.config
    if getattr(cfg, "router_aux_loss_coef", None) is None or not hasattr(cfg, "output_router_logits"):
        return
    coef = cfg.router_aux_loss_coef if coef is None else coef
    cfg.output_router_logits = coef > 0
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    causal_lm.router_aux_loss_coef = coef


def series(result: dict, key: str, start: int = 0, steps: int = STEPS) -> list[float]:
    """One per-step figure of an engine_worker result, in step order."""
    return [result["steps"][str(s)][key] for s in range(start, steps)]


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def assert_parity(result: dict, reference: dict, rtol_loss: float, rtol_norm: float, label: str, *,
                  steps: int = STEPS, clip: float = CLIP) -> None:
    """Per-step loss, grad norm and lr of a launched run equal the single-process reference."""
    import torch

    loss_d = max_rel(series(result, "loss", steps=steps), reference["losses"])
    norm_d = max_rel(series(result, "grad_norm", steps=steps), reference["grad_norms"])
    print(f"PARITY {label}: loss max rel diff {loss_d:.2e}, grad-norm max rel diff {norm_d:.2e}")
    torch.testing.assert_close(series(result, "lr", steps=steps), reference["lrs"], rtol=1e-12, atol=0)
    assert loss_d <= rtol_loss, (label, series(result, "loss", steps=steps), reference["losses"])
    assert norm_d <= rtol_norm, (label, series(result, "grad_norm", steps=steps), reference["grad_norms"])
    # Clipping must be active in at least one step (norm > clip), or its parity proves nothing,
    # and the run must learn, or loss equality proves little.
    assert max(reference["grad_norms"]) > clip
    assert reference["losses"][-1] < reference["losses"][0]


def load_safetensors(d: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(d) / "model.safetensors"))


def assert_same_weights(a: dict, b: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    common = sorted(set(a) & set(b))
    assert len(common) >= len(b) - 1, (sorted(a), sorted(b))  # lm_head may be tied away
    for k in common:
        torch.testing.assert_close(a[k].float(), b[k].float(), rtol=rtol, atol=atol, msg=k)


def whole_batch_reference(model_dir) -> dict:
    """One process, one forward per step over the whole global batch: the per-token mean by definition."""
    import tests.support.families as families
    from zerotrain.config.load import build_config
    from zerotrain.plan.schedule import make_scheduler

    model = load_model(model_dir).train()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD)
    cfg = build_config(overrides={"schedule.warmup_steps": WARMUP, "optimizer.lr": LR})
    sched = make_scheduler(opt, cfg, STEPS)
    n = WORLD * ACCUM * MICRO
    data = global_batches(STEPS, n, DEFAULT_SEQ, model.config.vocab_size)
    losses, norms, mean_of_means = [], [], None
    for s in range(STEPS):
        x = data[s]
        labels = families.masked_labels(x)
        if s == 0:
            with torch.no_grad():  # what a mean of micro-batch means would have reported instead
                mean_of_means = sum(float(model(input_ids=x[i:i + MICRO], labels=labels[i:i + MICRO]).loss)
                                    for i in range(0, n, MICRO)) / (n // MICRO)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        losses.append(float(loss))
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, CLIP)))
        opt.step()
        sched.step()
    return {"losses": losses, "grad_norms": norms, "mean_of_means": mean_of_means}

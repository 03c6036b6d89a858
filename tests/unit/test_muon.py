"""--optimizer muon (issue 68, first slice): zerotrain/optim/muon.py's MuonAdamW over a tiny GPT-2 and Llama equals an
independent loop of torch.optim.Muon (the 2-D matrices of the blocks, picked here by parameter name) + torch.optim.AdamW
(the rest) over the same batches, LR schedule included (1e-5); its state dict resumes exactly; the split names its
counts; the plan refuses the layouts where the update is not yet exact."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.support.families import FAMILIES
from zerotrain.optim.muon import lr_factor, make_muon_adamw, split_params

LR, WD, BETAS, EPS, MOMENTUM, STEPS, WARMUP = 2e-2, 0.1, (0.9, 0.95), 1e-8, 0.9, 5, 2
BLOCKS = {"gpt2": "transformer.h.", "llama": "model.layers."}


def _model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[family].config()).float().train()


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))


def _reference_optimizer(model: torch.nn.Module, family: str, adjust: str) -> list[torch.optim.Optimizer]:
    """torch.optim.Muon + AdamW built from parameter names; a GPT-2 Conv1D weight, stored (in, out), gets the lr of
    its (out, in) matrix under 'original' (torch reads the shape as (out, in))."""
    from torch.optim._muon import _adjust_lr

    muon_groups, rest = [], []
    for name, p in model.named_parameters():
        if name.startswith(BLOCKS[family]) and p.ndim == 2:
            f = 1.0
            if family == "gpt2" and adjust == "original":
                fan_in, fan_out = p.shape
                f = math.sqrt(max(1, fan_out / fan_in)) / _adjust_lr(1.0, adjust, p.shape)
            muon_groups.append({"params": [p], "lr": LR * f, "weight_decay": WD / f})
        else:
            rest.append(p)
    return [torch.optim.AdamW(rest, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
            torch.optim.Muon(muon_groups, lr=LR, weight_decay=WD, momentum=MOMENTUM, nesterov=True,
                             adjust_lr_fn=adjust)]


def _train(model, optimizers, scheds, batches, start: int = 0, stop: int = STEPS) -> list[float]:
    losses = []
    for s in range(start, stop):
        for o in optimizers:
            o.zero_grad(set_to_none=True)
        loss = model(input_ids=batches[s], labels=batches[s]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in optimizers:
            o.step()
        for sch in scheds:
            sch.step()
        losses.append(loss.item())
    return losses


def _composite(model, adjust):
    return make_muon_adamw(model, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, momentum=MOMENTUM, adjust_lr=adjust)


@pytest.mark.parametrize("family,adjust", [("gpt2", "original"), ("gpt2", "match_rms_adamw"),
                                           ("llama", "match_rms_adamw"), ("llama", "original")])
def test_muon_equals_torch_muon_plus_adamw(family, adjust):
    batches = torch.randint(0, 1024, (1, 2, 16), generator=torch.Generator().manual_seed(1)).expand(STEPS, 2, 16)
    ours, theirs = _model(family), _model(family)
    opt = _composite(ours, adjust)
    ref = _reference_optimizer(theirs, family, adjust)
    got = _train(ours, [opt], [_schedule(opt)], batches)
    want = _train(theirs, ref, [_schedule(o) for o in ref], batches)
    assert want[-1] < want[0], want  # it trained
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) <= 1e-5, (got, want)
    for (n, a), b in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)
    assert len(opt.muon.param_groups[0]["params"]) + sum(len(g["params"]) for g in opt.muon.param_groups[1:]) == \
        sum(len(g["params"]) for g in ref[1].param_groups)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_split_and_banner(family):
    model = _model(family)
    split = split_params(model)
    blocks = BLOCKS[family]
    assert [n for n, _, _ in split.muon] == [n for n, p in model.named_parameters()
                                              if n.startswith(blocks) and p.ndim == 2]
    assert all(not n.startswith(blocks) or p.ndim != 2 for n, p in split.adamw)
    assert any("embed" in n or "wte" in n for n, _ in split.adamw)
    assert all(t == (family == "gpt2") for _, _, t in split.muon)  # GPT-2's Conv1D: stored (in, out)
    per_block = 4 if family == "gpt2" else 7  # c_attn, c_proj, c_fc, mlp.c_proj | q, k, v, o, gate, up, down
    assert len(split.muon) == 2 * per_block
    assert split.banner().startswith(f"muon: {2 * per_block} block matrices (")
    assert f"{len(split.adamw)} other tensors" in split.banner()


def test_conv1d_lr_factor():
    assert lr_factor((64, 256), True, "original") == 2.0  # c_fc: in 64, out 256 -> sqrt(256/64) as a Linear
    assert lr_factor((256, 64), True, "original") == 0.5  # mlp.c_proj: torch would give 2, a Linear (64, 256) 1
    assert lr_factor((64, 256), False, "original") == 1.0
    assert lr_factor((64, 256), True, "match_rms_adamw") == 1.0


def test_state_dict_resumes_exactly():
    batches = torch.randint(0, 1024, (1, 2, 16), generator=torch.Generator().manual_seed(2)).expand(STEPS, 2, 16)
    whole = _model("gpt2")
    opt = _composite(whole, "original")
    straight = _train(whole, [opt], [sched := _schedule(opt)], batches)
    part = _model("gpt2")
    opt1 = _composite(part, "original")
    sched1 = _schedule(opt1)
    first = _train(part, [opt1], [sched1], batches, stop=3)
    saved = copy.deepcopy((part.state_dict(), opt1.state_dict(), sched1.state_dict()))
    resumed = _model("gpt2")
    resumed.load_state_dict(saved[0])
    opt2 = _composite(resumed, "original")
    sched2 = _schedule(opt2)  # as an engine resumes: built, then both states loaded
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    assert opt2.muon.state and opt2.adamw.state and opt2.muon.param_groups[0] is opt2.param_groups[1]
    rest = _train(resumed, [opt2], [sched2], batches, start=3)
    assert first + rest == straight
    assert sched.get_last_lr() == sched2.get_last_lr()


@pytest.mark.parametrize("overrides,backend,named", [
    ({}, "deepspeed", "--backend deepspeed"),
    ({"zero.stage": 0, "lora.r": 8}, "fsdp", "--lora-r 8"),
    ({"zero.stage": 3, "parallel.tp": 2}, "fsdp", "--tp 2"),
    ({"zero.stage": 3, "zero.offload_optimizer": "cpu", "zero.offload_param": "cpu"}, "fsdp",
     "--offload-optimizer cpu"),
])
def test_plan_refuses_muon_where_not_exact(overrides, backend, named):
    from zerotrain.config.load import build_config
    from zerotrain.errors import UserError
    from zerotrain.plan.run_plan import build_plan

    cfg = build_config(overrides={"optimizer.name": "muon", **overrides})
    with pytest.raises(UserError, match=f"^--optimizer muon with {named}: not yet supported \\(issue 68"):
        build_plan(cfg, 2, backend=backend, device="cpu", total_steps=10)


@pytest.mark.parametrize("stage", [0, 3])
def test_plan_takes_muon_on_fsdp(stage):
    from zerotrain.backends.fsdp.engine import optimizer_arguments
    from zerotrain.config.load import build_config
    from zerotrain.plan.run_plan import build_plan

    cfg = build_config(overrides={"optimizer.name": "muon", "zero.stage": stage, "optimizer.muon_momentum": 0.9})
    plan = build_plan(cfg, 2, backend="fsdp", device="cpu", total_steps=10)
    name, kwargs = optimizer_arguments(plan)
    assert name == "MuonAdamW" and kwargs["momentum"] == 0.9 and kwargs["adjust_lr"] == "match_rms_adamw"


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_estimate_counts_muons_one_buffer_on_the_block_matrices(family):
    """The estimate's optimizer states under --optimizer muon (FSDP2 stage 0, one rank) equal the bytes the composite
    really holds after a step: AdamW's two fp32 buffers on the rest, Muon's one on the block matrices (the step
    scalars left out, as for AdamW); and AdamW's estimate is the larger by 4 bytes per block-matrix element."""
    from zerotrain.config.load import build_config
    from zerotrain.memory.estimate import Setup, estimate, setup_plan
    from zerotrain.model.facts import facts_of

    model = _model(family)
    opt = make_muon_adamw(model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum=0.95,
                          adjust_lr="match_rms_adamw")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    held = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t) and t.numel() > 1)
    facts = facts_of(model, model.config)
    states = {}
    for name in ("muon", "adamw"):
        cfg = build_config(overrides={"model.from_config": "tiny-llama", "optimizer.name": name})
        plan = setup_plan(cfg, Setup("fsdp", 0), 1, facts=facts, device="cpu")
        states[name] = estimate(plan).by_category()["optimizer_states"]
    matrices = sum(p.numel() for _, p, _ in opt.split.muon)
    assert states["muon"] == held and states["adamw"] - states["muon"] == 4 * matrices > 0, (states, held)


def test_resume_refuses_another_optimizer():
    """The optimizer is part of a checkpoint's identity (CheckpointMeta.extra, from the plan): a resume with another
    --optimizer is refused in one line naming the one to resume with; a checkpoint written before the optimizer was
    recorded resumes as before."""
    from zerotrain.checkpoint import store as ck
    from zerotrain.errors import UserError

    now = ck.RunIdentity(backend="fsdp", format="dcp", world_size=2, zero_stage=3, dtype="fp32", tp=1, pp=1,
                         nvme_optimizer=False, model_id=("M", "h"), optimizer="muon")
    saved = ck.RunIdentity(**{**now.__dict__, "optimizer": "adamw"}).meta(2)
    assert saved.extra == {"optimizer": "adamw"}
    with pytest.raises(UserError, match=r"^--resume ck/global_step2: the checkpoint holds adamw's optimizer state, "
                                        r"this run's --optimizer is muon; resume with --optimizer adamw"):
        ck.check_resume(saved, "ck/global_step2", now)
    ck.check_resume(now.meta(2), "ck", now)
    ck.check_resume(ck.CheckpointMeta(**{**saved.__dict__, "extra": {}}), "ck", now)  # written before the record

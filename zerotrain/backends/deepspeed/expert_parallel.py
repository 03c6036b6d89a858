"""Expert parallelism on DeepSpeed: DeepSpeed 0.19.8's AutoEP (the config's "expert_parallel" section,
plan/ds_config.py, for the families of capabilities.AUTOEP_PRESETS) on the HF model itself, with its router loss
and expert load kept.

AutoEP swaps each MoE block (Mixtral's / Qwen3-MoE's `mlp`) for an AutoEPMoELayer holding 1/ep of the experts as
fused w1 (gate), w3 (up), w2 (down) tensors, a TokenChoiceTopKRouter whose `gate` Linear carries the HF router's
weight, and an all-to-all token dispatch; its ZeRO 1-2 optimizer reduces the expert gradients over the
expert-data-parallel group only. Its model preset retargets transformers' `router_logits` output recorder to
that `router.gate` (on the model instance), so `output_router_logits=True` makes the HF forward add the model's
own load-balancing loss (load_balancing_loss_func over every block's logits), as in one process, and
model/router.py finds the new routers (the expert load) from the same recorder. In DeepSpeed 0.19.8 that
retargeting calls transformers 5's recorder registry (transformers.utils.output_capturing._CanRecordRegistry,
whose get() takes a model, not a key) like a plain dict and fails in deepspeed.initialize
(benchmarks/results/autoep_probe/REPORT.md): registry_as_dict() gives the registry a dict-compatible
get/__setitem__ for string keys for the duration of initialize, which is the whole fix (docs/moe.md).

final/ and `zerotrain export` put the experts back in HF layout (hf_state_dict): gate_up_proj = [w1 | w3] on the
intermediate dimension, down_proj = w2, the router as `gate.weight`.
"""
from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Iterator

import torch


@contextlib.contextmanager
def registry_as_dict() -> Iterator[None]:
    """transformers' output-recorder registry answering DeepSpeed's dict-style calls (get(key, default) and
    item assignment with a class-name string) inside the block, its own model-keyed calls as before."""
    from transformers.utils import output_capturing

    registry = output_capturing._CAN_RECORD_REGISTRY
    own = type(registry)

    class DictCompatible(own):
        def get(self, key, default=None):
            return dict.get(self, key, default) if isinstance(key, str) else own.get(self, key)

        def __setitem__(self, key, value):
            if isinstance(key, str):
                dict.__setitem__(self, key, value)
            else:
                own.__setitem__(self, key, value)

    registry.__class__ = DictCompatible
    try:
        yield
    finally:
        registry.__class__ = own


def autoep_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The AutoEPMoELayer modules of `model` by path, in model order."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, AutoEPMoELayer)]


_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<w>w[123])$")


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict of an AutoEP model with every expert's weights present ([experts, ...] per w1/w2/w3) in HF
    layout: `<block>.experts.gate_up_proj` [E, 2I, H] = w1 (gate) then w3 (up), `<block>.experts.down_proj` = w2,
    `<block>.gate.weight` = AutoEP's `<block>.router.gate.weight` (its `<block>.gate` alias dropped)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        m = _EXPERT.match(key)
        if m:
            experts.setdefault(m["block"], {})[m["w"]] = value
        elif key.endswith(".router.gate.weight"):
            out[key[:-len(".router.gate.weight")] + ".gate.weight"] = value
        elif not key.endswith(".gate.gate.weight"):
            out[key] = value
    for block, w in experts.items():
        out[f"{block}.experts.gate_up_proj"] = torch.cat([w["w1"], w["w3"]], dim=1)
        out[f"{block}.experts.down_proj"] = w["w2"]
    return out


def gathered_experts(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every block's w1/w2/w3 with all experts, gathered over its expert-parallel group (every rank calls it;
    DeepSpeed's group, whose ranks hold consecutive expert ranges in group-rank order)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    out = {}
    for name, layer in autoep_layers(model):
        group = groups._get_expert_parallel_group(layer.ep_group_name)
        for w in ("w1", "w2", "w3"):
            local = getattr(layer.experts, w).detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local, group=group)
            out[f"{name}.experts.{w}"] = torch.cat(parts).cpu()
    return out


def is_autoep_checkpoint(path: Path) -> bool:
    """Whether a DeepSpeed checkpoint dir holds AutoEP's per-expert files (ZeRO 0-2)."""
    return any(path.glob("layer_*_expert_*_mp_rank_00_model_states.pt"))


def checkpoint_state(path: Path) -> dict[str, torch.Tensor]:
    """The HF-layout weights of an AutoEP checkpoint (ZeRO 0-2) in one process: the module of the model-states
    file (dense weights; its experts are rank 0's alone) with each block's experts rebuilt from DeepSpeed's
    per-global-expert files (layer_<L>_expert_<G>_...), converted by hf_state_dict. The weights are the
    engine's module weights (fp32 in an fp32 run; a bf16 run's bf16 weights upcast)."""
    from ..checkpointing import read_file

    states = read_file(path / "mp_rank_00_model_states.pt")
    state = {k: v for k, v in states["module"].items() if not _EXPERT.match(k)}
    for info in states["ds_autoep_layers"]:
        prefix, layer = info["expert_key_prefix"], info["moe_layer_id"]
        files = [read_file(path / f"layer_{layer}_expert_{g}_mp_rank_00_model_states.pt")
                 for g in range(info["num_experts"])]
        for w in ("w1", "w2", "w3"):
            state[f"{prefix}.{w}"] = torch.stack([f[f"{prefix}.{w}.{g}"] for g, f in enumerate(files)])
    return {k: v.float() if v.is_floating_point() else v for k, v in hf_state_dict(state).items()}


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The global L2 gradient norm of an AutoEP model at ZeRO 0 after DeepSpeed's reduction (every rank calls it):
    the dense gradients are the same on every rank, each expert's on the ranks holding it, so the experts' squares
    are summed over the expert-parallel group. (DeepSpeed's own stage-0 clip_grad_norm_ averages each rank's local
    norm instead, which is not the one-process norm.)"""
    import torch.distributed as dist
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.utils import groups

    from ...distributed.collectives import comm_device

    # on the group's device (NCCL takes no CPU tensor), one sync at the end
    device = comm_device()
    dense, experts = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
    for p in model.parameters():
        if p.grad is not None:
            sq = p.grad.detach().double().pow(2).sum().to(device)
            if is_moe_param(p):
                experts += sq
            else:
                dense += sq
    names = {layer.ep_group_name for _, layer in autoep_layers(model)}
    for name in names:  # one group: DeepSpeed's AutoEP checkpointing refuses mixed ep sizes
        dist.all_reduce(experts, group=groups._get_expert_parallel_group(name))
    return (dense + experts).sqrt().float().cpu()

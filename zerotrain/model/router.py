"""The router of a mixture-of-experts model: its load-balancing loss, freezing it, and the expert load it routes.

    router.configure(model, aux_coef, freeze)   # ModelPreparation.apply, both engines, before sharding
    load = ExpertLoad.attach(model)             # None for a dense model; counts tokens per expert per block
    with load.counting(): out = model(...)      # counts this forward's routing, not a checkpoint's recompute

The load-balancing loss is the model's own (transformers adds `router_aux_loss_coef x aux_loss` to the LM loss
when the forward gets `output_router_logits=True`, forward_kwargs): it is nonlinear in the batch, so it is defined per rank per micro-batch, as
HF computes it inside one forward; the one-process reference of the tests computes it on the same slices
(docs/moe.md). The gate modules of Mixtral, Qwen3-MoE and DeepSeek-V3 all return (logits, weights, indices);
the expert load is read from those indices.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from .lora import unwrapped

if TYPE_CHECKING:
    from torch import nn


def num_experts_of(hf_config) -> int:
    """Routed experts per MoE block as the HF config names them (0: a dense model)."""
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(hf_config, name, None):
            return int(getattr(hf_config, name))
    return 0


def router_aux_coef_of(hf_config) -> float | None:
    """ModelFacts.router_aux_coef: the config's router_aux_loss_coef on a mixture of experts whose HF causal LM
    adds the loss when output_router_logits is set (every such config carries both)."""
    coef = getattr(hf_config, "router_aux_loss_coef", None)
    if coef is None or not hasattr(hf_config, "output_router_logits") or not num_experts_of(hf_config):
        return None
    return float(coef)


def moe_blocks(model: "nn.Module") -> list["nn.Module"]:
    """The sparse MoE blocks: modules holding both a `gate` (the router) and `experts`."""
    return [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")
            and isinstance(getattr(m, "gate"), torch.nn.Module)]


LOSS_FLAG = "_zerotrain_router_loss"
"""Set on the HF model by configure: whether its forward adds the router loss (forward_kwargs passes it on)."""


def configure(model: "nn.Module", aux_coef: Optional[float], freeze: bool) -> Optional[float]:
    """Set the model's router loss (aux_coef None: its config's router_aux_loss_coef; 0: off) and freeze its
    gates. Returns the coefficient that trains (None: no router loss). The model's config is left as it is (so
    final/ saves it unchanged): the engine asks for the router logits in every forward (forward_kwargs). The rules
    layer has refused an explicit coefficient the model cannot take (plan/parallel_rules.py _check_router)."""
    hf = unwrapped(model)
    own = router_aux_coef_of(hf.config)
    coef = own if aux_coef is None else aux_coef
    on = bool(coef) and own is not None
    if own is not None:
        setattr(hf, LOSS_FLAG, on)
    if on:
        hf.router_aux_loss_coef = float(coef)  # what the causal LM's forward multiplies aux_loss by
    if freeze:
        for block in moe_blocks(hf):
            block.gate.requires_grad_(False)
    return float(coef) if on else None


def forward_kwargs(model: "nn.Module") -> dict[str, bool]:
    """What every forward of a configured model passes: {"output_router_logits": whether the loss trains}
    (its HF forward then adds router_aux_loss_coef x aux_loss); {} for a model without a router loss."""
    flag = getattr(unwrapped(model), LOSS_FLAG, None)
    return {} if flag is None else {"output_router_logits": flag}


def trained_coef(model: "nn.Module") -> Optional[float]:
    """The router loss weight a configured model trains with (None: no router loss)."""
    hf = unwrapped(model)
    return float(hf.router_aux_loss_coef) if getattr(hf, LOSS_FLAG, False) else None


class ExpertLoad:
    """Tokens routed to each expert of each MoE block, counted from the gates' top-k indices (forward hooks)
    while `counting()` is on: a checkpointed block recomputed in backward is not counted twice."""

    def __init__(self, gates: list["nn.Module"], num_experts: int):
        self.num_experts, self.blocks = num_experts, len(gates)
        self.counts: Optional[torch.Tensor] = None
        """[blocks, experts] on the routing's device (allocated by the first count), read once per step."""
        self._on = False
        self._hooks = [gate.register_forward_hook(self._hook(i)) for i, gate in enumerate(gates)]

    @classmethod
    def attach(cls, model: "nn.Module") -> Optional["ExpertLoad"]:
        """A counter on every MoE block of `model`; None for a dense model."""
        hf = unwrapped(model)
        blocks, n = moe_blocks(hf), num_experts_of(hf.config)
        return cls([b.gate for b in blocks], n) if blocks and n else None

    def _hook(self, index: int):
        def count(module, args, output) -> None:
            if not self._on or not isinstance(output, tuple) or len(output) < 3:
                return
            chosen = output[2].detach().reshape(-1).to(torch.int64)
            if self.counts is None:
                self.counts = torch.zeros(self.blocks, self.num_experts, dtype=torch.float64, device=chosen.device)
            # index_add_ with a validity weight: no boolean indexing, so no device-to-host sync per block
            valid = ((chosen >= 0) & (chosen < self.num_experts)).to(torch.float64)
            self.counts[index].index_add_(0, chosen.clamp(0, self.num_experts - 1), valid)
        return count

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the routing of the forward run inside."""
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def take(self) -> torch.Tensor:
        """The counts since the last take ([blocks, experts], float64, on the host), and a fresh start."""
        out = self.counts.cpu() if self.counts is not None else torch.zeros(self.blocks, self.num_experts,
                                                                            dtype=torch.float64)
        self.counts = None
        return out


def load_figures(counts: torch.Tensor) -> dict[str, object]:
    """metrics.jsonl's expert-load fields from the step's summed counts [blocks, experts]: tokens per expert
    (summed over blocks) and the worst block's max/mean imbalance (1.0 = perfectly balanced)."""
    per_block_mean = counts.mean(dim=1).clamp_min(1e-12)
    imbalance = (counts.amax(dim=1) / per_block_mean).max() if counts.numel() else torch.tensor(0.0)
    return {"expert_tokens": [int(x) for x in counts.sum(dim=0).tolist()],
            "expert_imbalance": round(float(imbalance), 4)}

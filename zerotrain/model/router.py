"""The router of a mixture-of-experts model: finding it, its load-balancing loss, freezing it, and the expert load.

    blocks = moe_blocks(model)                  # [] for a dense model; UserError for a declared but unfound MoE
    router.configure(model, aux_coef, freeze)   # ModelPreparation.apply, both engines, before sharding
    load = ExpertLoad.attach(model)             # None for a dense model; counts tokens per expert per block
    with load.counting(): out = model(...)      # counts this forward's routing, not a checkpoint's recompute

The routers and experts are found as transformers finds them, from the model's own declarations, not from attribute
names (Mixtral's router is `gate`, gpt-oss's and Phi-MoE's `router`): the routers are the modules of the class its
output recorder declares for `router_logits` (`_can_record_outputs`, the hooks `output_router_logits=True`
collects the load-balancing loss's logits with), the experts the modules its expert-parallel plan dispatches
(`ep_plan`, "ep_dispatch_experts"), and a MoE block is the module that holds a router and its experts.

The load-balancing loss is the model's own (transformers adds `router_aux_loss_coef x aux_loss` to the LM loss
when the forward gets `output_router_logits=True`, forward_kwargs): it is nonlinear in the batch, so it is defined
per rank per micro-batch, as HF computes it inside one forward; the one-process reference of the tests computes it
on the same slices (docs/moe.md). The routers of every family here return (logits, weights, indices); the expert
load is read from those indices (top-k of the logits where a router returns its logits alone).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch

from ..errors import UserError
from .lora import unwrapped

if TYPE_CHECKING:
    from torch import nn


def num_experts_of(hf_config) -> int:
    """Routed experts per MoE block as the HF config names them (0: a dense model)."""
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(hf_config, name, None):
            return int(getattr(hf_config, name))
    return 0


def experts_per_token_of(hf_config) -> int:
    """Experts each token is routed to (top-k) as the HF config names it (0: a dense model)."""
    for name in ("num_experts_per_tok", "moe_topk"):
        if getattr(hf_config, name, None) is not None:
            return int(getattr(hf_config, name))
    return 0


def router_aux_coef_of(hf_config) -> float | None:
    """ModelFacts.router_aux_coef: the config's router_aux_loss_coef on a mixture of experts whose HF causal LM
    adds the loss when output_router_logits is set (every such config carries both)."""
    coef = getattr(hf_config, "router_aux_loss_coef", None)
    if coef is None or not hasattr(hf_config, "output_router_logits") or not num_experts_of(hf_config):
        return None
    return float(coef)


EP_DISPATCH = "ep_dispatch_experts"
"""The expert-parallel plan's style for a module of routed experts (transformers/distributed/expert_parallel.py)."""


@dataclass(frozen=True)
class MoeBlock:
    """One mixture-of-experts block of a model, as its declarations name it."""

    name: str
    """The block's module path in the HF model (e.g. "model.layers.0.mlp")."""
    module: "nn.Module"
    """The block: the module holding the router and its experts."""
    router: "nn.Module"
    """The module of the class the model records `router_logits` from (Mixtral's `gate`, gpt-oss's `router`)."""
    experts: Optional["nn.Module"]
    """The routed experts the expert-parallel plan dispatches to; None for a model without such a plan (DBRX,
    Llama 4), whose experts are then not told apart from the block's other parameters."""
    logits_index: int
    """Where the router's output holds its logits (the recorder's index)."""


def router_recorders(model: "nn.Module") -> list:
    """The OutputRecorder specs every transformers model in `model` declares for `router_logits`, normalised as
    transformers' install_all_output_capturing_hooks does (a bare class records index 1, a string is a class name
    suffix)."""
    from transformers.utils.output_capturing import OutputRecorder

    specs = []
    for sub in unwrapped(model).modules():
        # the instance's own first: DeepSpeed's AutoEP retargets it to its router's gate (backends/deepspeed/)
        declared = (getattr(sub, "_can_record_outputs", None) or {}).get("router_logits")
        for spec in declared if isinstance(declared, list) else [declared] if declared is not None else []:
            if not isinstance(spec, OutputRecorder):
                spec = OutputRecorder(target_class=None if isinstance(spec, str) else spec, index=1,
                                      class_name=spec if isinstance(spec, str) else None)
            if spec not in specs:
                specs.append(spec)
    return specs


def _is_router(spec, name: str, module: "nn.Module") -> bool:
    """transformers' recursively_install_hooks match of one recorder against one module."""
    hit = ((spec.target_class is not None and isinstance(module, spec.target_class))
           or (spec.class_name is not None and name.endswith(spec.class_name)))
    return hit and (spec.layer_name is None or f".{spec.layer_name.strip('.')}." in f".{name}.")


def expert_modules(model: "nn.Module") -> dict[str, "nn.Module"]:
    """The modules the model's expert-parallel plan dispatches tokens to, by path ({} without a plan)."""
    hf = unwrapped(model)
    plan = dict(getattr(hf, "ep_plan", None) or {})
    if EP_DISPATCH not in plan.values():
        return {}
    expanded = hf._expand_parallel_plan(plan)
    return {n: m for n, m in hf.named_modules() if expanded.get(n) == EP_DISPATCH}


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def moe_blocks(model: "nn.Module") -> list[MoeBlock]:
    """The model's mixture-of-experts blocks from its declarations: each router (the recorder's class) with the
    lowest enclosing module that holds one of the plan's expert modules (without a plan: the router's parent).
    [] for a model that declares neither or builds none of the modules it declares; a UserError (one line) for one that declares routers or an expert plan
    whose blocks cannot be found, which would otherwise train as a dense model."""
    hf = unwrapped(model)
    specs, experts = router_recorders(hf), expert_modules(hf)
    declares_plan = EP_DISPATCH in (getattr(hf, "ep_plan", None) or {}).values()
    if not specs and not declares_plan:
        return []
    modules = dict(hf.named_modules())
    routers = [(n, m, s.index) for n, m in modules.items() for s in specs if _is_router(s, n, m)]
    if not routers and not experts:  # built with none of its MoE modules: a MoE class configured dense (Qwen3-MoE
        return []                    # with mlp_only_layers covering every block), which trains as it is
    blocks, used = [], set()
    for name, router, index in routers:
        block = _parent(name)
        if experts:  # the lowest ancestor of the router that also holds some expert module of the plan
            while block and not any(e.startswith(block + ".") for e in experts):
                block = _parent(block)
            mine = [e for e in experts if e.startswith(block + ".")] if block else []
            if len(mine) != 1:
                blocks = None
                break
            used.add(mine[0])
        blocks.append(MoeBlock(block, modules[block] if block else hf, router,
                               modules[mine[0]] if experts else None, index))
    missing = ("the router class its _can_record_outputs['router_logits'] declares" if specs and not routers
               else "a router class (_can_record_outputs['router_logits'])" if not specs
               else "the expert modules its expert-parallel plan (ep_plan) names" if declares_plan and not experts
               else "one router and one expert module per block" if blocks is None or used != set(experts)
               else None)
    if missing:
        raise UserError(f"{type(hf).__name__} declares a mixture of experts, but zerotrain found no module for "
                        f"{missing}; it will not train it as a dense model (a modified or unsupported MoE class)")
    return blocks


def routers(model: "nn.Module") -> list["nn.Module"]:
    """Every router module of the model (none for a dense one)."""
    return [b.router for b in moe_blocks(model)]


LOSS_FLAG = "_zerotrain_router_loss"
"""Set on the HF model by configure: whether its forward adds the router loss (forward_kwargs passes it on)."""


def configure(model: "nn.Module", aux_coef: Optional[float], freeze: bool) -> Optional[float]:
    """Set the model's router loss (aux_coef None: its config's router_aux_loss_coef; 0: off) and freeze its
    routers (every parameter of each, gpt-oss's bias included). Returns the coefficient that trains (None: no router loss). The model's config is left as it is (so
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
        for r in routers(hf):
            r.requires_grad_(False)
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
    """Tokens routed to each expert of each MoE block, counted from the routers' top-k indices (forward hooks)
    while `counting()` is on: a checkpointed block recomputed in backward is not counted twice."""

    def __init__(self, blocks: list[MoeBlock], num_experts: int, top_k: int):
        self.num_experts, self.top_k, self.blocks = num_experts, top_k, len(blocks)
        self.counts: Optional[torch.Tensor] = None
        """[blocks, experts] on the routing's device (allocated by the first count), read once per step."""
        self._on = False
        self._hooks = [b.router.register_forward_hook(self._hook(i, b.logits_index)) for i, b in enumerate(blocks)]

    @classmethod
    def attach(cls, model: "nn.Module") -> Optional["ExpertLoad"]:
        """A counter on every MoE block of `model`; None for a dense model."""
        hf = unwrapped(model)
        blocks, n = moe_blocks(hf), num_experts_of(hf.config)
        return cls(blocks, n, experts_per_token_of(hf.config)) if blocks and n else None

    def _chosen(self, output, logits_index: int) -> Optional[torch.Tensor]:
        """The experts each token was routed to: the router's own indices (the third output of the routers of
        Mixtral, Qwen3-MoE, DeepSeek-V3, GLM-4-MoE, Qwen3-Next, gpt-oss and Phi-MoE, after logits and weights);
        for a router that returns its logits alone, their top-k by the config's experts per token (the softmax
        top-k routing of Mixtral-style models; a family that routes otherwise returns its indices)."""
        if isinstance(output, (tuple, list)) and len(output) >= 3 and isinstance(output[2], torch.Tensor) \
                and not output[2].is_floating_point():
            return output[2]
        logits = output[logits_index] if isinstance(output, (tuple, list)) else output
        if not isinstance(logits, torch.Tensor) or not self.top_k or logits.shape[-1] != self.num_experts:
            return None
        return logits.detach().topk(self.top_k, dim=-1).indices

    def _hook(self, index: int, logits_index: int):
        def count(module, args, output) -> None:
            if not self._on:
                return
            chosen = self._chosen(output, logits_index)
            if chosen is None:
                return
            chosen = chosen.detach().reshape(-1).to(torch.int64)
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

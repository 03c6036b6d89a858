"""Tensor parallelism for the FSDP2 backend: DTensor's parallelize_module with the model's own HF plan.

Every transformer block's linear layers are split as its HF config's `base_model_tp_plan` says
("colwise": output features split, "rowwise": input features split, the partial sums reduced), on
the tensor-parallel dimension of a 2-D (dp, tp) device mesh; FSDP2 then shards the blocks over the
data-parallel dimension (torchtitan's 2-D layout). Embeddings, norms and the LM head stay whole.
HF attention reshapes with -1 heads, so a block computes on its local heads unchanged.

A LoRA-adapted layer (peft's lora.Linear: base_layer + lora_A/lora_B, output base(x) + B(A(drop(x))) * scaling)
is split so each rank adds its slice of the same update: colwise -> base_layer and lora_B colwise (their output
features split; lora_A whole, its gradient the all-reduced sum ColwiseParallel's replicated input gives), rowwise
-> base_layer and lora_A rowwise (input features split, A's partial output all-reduced to the r ranks; lora_B
whole on the summed r-vector). Every rank then holds base(x)'s and B(A(x))'s same slice (or whole sum).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
from torch import nn

from ...model.facts import transformer_blocks


def apply_tensor_parallel(model: nn.Module, tp_mesh, block_plan: tuple[tuple[str, str], ...]) -> None:
    """Split every transformer block in place by the (submodule, style) plan over tp_mesh (a LoRA-adapted
    submodule by lora_plan)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in transformer_blocks(model):
        plan: dict[str, object] = {}
        for sub, style in block_plan:  # other styles were refused (plan/parallel_rules.py)
            plan.update(lora_plan(sub, style, block.get_submodule(sub)))
        parallelize_module(block, tp_mesh, plan)


def lora_plan(sub: str, style: str, module: nn.Module) -> dict[str, object]:
    """The DTensor styles that split `module` (at `sub` in its block) as the model's plan says: the module
    itself, or for peft's LoRA layer its base layer and the adapter factor on the split side (module docstring)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    adapters = getattr(module, "lora_A", None)
    if adapters is None or not hasattr(module, "base_layer"):
        return {sub: styles[style]()}
    split = "lora_B" if style == "colwise" else "lora_A"  # the factor whose features the base layer splits too
    plan: dict[str, object] = {f"{sub}.base_layer": styles[style]()}
    for name in adapters:
        plan[f"{sub}.{split}.{name}"] = styles[style]()
    return plan


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the gradients before clipping (a tensor on the gradients' device: not read here, so the
    step does not wait for the device), clipped to max_norm (0 = no clipping).

    torch.nn.utils.clip_grad_norm_ stacks the per-tensor norms, which DTensor refuses when they live
    on different meshes (tensor-parallel blocks on the 2-D mesh, the rest on the data-parallel one):
    each mesh's norm is taken on its own, made a plain tensor, and the squares summed."""
    params = [p for p in params if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        by_mesh[getattr(p.grad, "device_mesh", None)].append(p.grad)
    if len(by_mesh) <= 1:  # one mesh (no tensor parallelism): torch's own clip, as without TP
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        # clip_grads_with_norm_'s rule; a Python number: DTensor gradients refuse a plain tensor factor (a read)
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for grads in by_mesh.values():
            torch._foreach_mul_(grads, coef)
    return total

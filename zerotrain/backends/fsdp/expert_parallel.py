"""Expert parallelism for the FSDP2 backend: transformers' expert-parallel dispatch, then FSDP2 per mesh.

Layout (torchtitan's, and transformers/distributed/fsdp.py): every rank reads its own batch; the dense
parameters are sharded over all ranks (the "dp" mesh), each MoE block's routed experts are split into ep
groups of neighbouring ranks (1/ep of the experts each, a DTensor Shard(0) on the "ep" mesh dimension) and
FSDP-sharded over the world / ep ranks holding the same experts (the "efsdp" dimension). The experts' forward
is transformers' AllToAllEP: each (token, expert) pair goes to its expert's rank with an all-to-all and back
with a second one, so no rank ever gathers another rank's experts.

Gradients: an expert's gradient arrives summed over the tokens of its ep group (the all-to-all's backward) and
is reduced over efsdp, so it covers every rank's batch once; dividing it by the world size (as the dense
parameters' mean) gives the one-process gradient of the global batch (tests/multirank/test_moe.py checks it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from torch import nn

if TYPE_CHECKING:
    from ...distributed.mesh import ParallelMeshes


def host_warning(ep: int, ranks_per_host: int) -> Optional[str]:
    """A warning when expert-parallel groups (ep neighbouring ranks) would cross hosts: every MoE block's two
    all-to-alls then go over the network (ranks_per_host 0: the launcher did not say)."""
    if not ranks_per_host or ranks_per_host % ep == 0:
        return None
    return (f"--ep {ep} with {ranks_per_host} ranks per host: expert-parallel groups span hosts, so every MoE block's "
            "token all-to-all crosses the network; an ep that divides the ranks per host keeps it inside one")


def expert_plan(model: nn.Module) -> dict[str, str]:
    """The model's HF expert-parallel plan with the layer numbers filled in, e.g.
    {"model.layers.0.mlp.experts": "ep_dispatch_experts", "model.layers.0.mlp.experts.gate_up_proj": "grouped_gemm"}."""
    return model._expand_parallel_plan(dict(model.ep_plan))


def apply_expert_parallel(model: nn.Module, meshes: ParallelMeshes, world: int, ep: int, fsdp_kwargs: dict[str, Any]):
    """Split `model`'s (the HF model's, not a peft wrapper's) experts over ep groups and FSDP-shard them over
    the ranks holding the same ones (the dense blocks are the caller's to shard). Returns the
    dense parameters' data-parallel mesh: a 1-D view of the world whose tensor-parallel sibling (size 1) the
    dispatch needs."""
    from torch.distributed.fsdp import fully_shard
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    dense, experts = meshes.get("ep")  # zerotrain/distributed/mesh.py
    plan = expert_plan(model)
    # all_to_all, not transformers' default "auto": that one switches to an all-reduce of partial outputs
    # without gradients, which needs every rank of the group to hold the same batch (ours each hold their own).
    apply_expert_parallelism(model, experts["ep"], dense["tp"], plan, "all_to_all")
    for name, module in model.named_modules():
        if plan.get(name) != "ep_dispatch_experts":
            continue
        fully_shard(module, **{**fsdp_kwargs, "mesh": experts["efsdp"]})
        module.set_gradient_divide_factor(float(world))
        if experts["efsdp"].size() > 1:
            # A divide factor other than the group's size is a PREMUL_SUM, which gloo lacks: sum, then divide.
            # (With one copy per expert FSDP2 reduces nothing and divides by the factor itself.)
            module.set_force_sum_reduction_for_comms(True)
    return dense["dp"]

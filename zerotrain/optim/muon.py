"""--optimizer muon: torch.optim.Muon on every 2-D weight matrix inside the transformer blocks (attention and MLP
projections), torch.optim.AdamW on the rest (embeddings, output head, norms, biases), the Muon / Moonlight recipe.

The blocks are the ones the model declares (model/facts.py transformer_blocks: its HF `_no_split_modules` stack),
never attribute names. torch.optim.Muon takes only 2-D parameters, so the run's optimizer is MuonAdamW: one
torch.optim.Optimizer whose param_groups are AdamW's then Muon's (the same dicts), so the LR scheduler, the logged
lr (param_groups[0]: AdamW's, unscaled) and checkpoints see every group.

GPT-2's Conv1D stores its weight (in, out), the transpose of nn.Linear's (out, in). Newton-Schulz orthogonalises a
matrix and its transpose alike, but torch's adjust_lr_fn="original" reads the shape as (out, in):
sqrt(max(1, A/B)). A Conv1D matrix therefore gets its own group whose lr is scaled by the ratio of the right factor
to the one torch computes, and whose weight decay by the inverse (torch decays by lr * weight_decay, unchanged);
"match_rms_adamw" (0.2 * sqrt(max(A, B))) is symmetric and needs no such group.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerotrain.errors import UserError
from zerotrain.model.facts import block_matrices

ADJUST_LR = ("original", "match_rms_adamw")
"""torch.optim.Muon's adjust_lr_fn values (the --muon-adjust-lr choices)."""


@dataclass
class MuonSplit:
    """Which trainable parameters go to Muon and which to AdamW."""
    muon: list[tuple[str, nn.Parameter, bool]] = field(default_factory=list)
    """(name, parameter, stored transposed: a Conv1D weight (in, out)) of each 2-D matrix inside a block."""
    adamw: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    """(name, parameter) of every other trainable parameter."""

    def banner(self) -> str:
        """The banner's line: counts of tensors and elements on each side."""
        m = sum(p.numel() for _, p, _ in self.muon)
        a = sum(p.numel() for _, p in self.adamw)
        return (f"muon: {len(self.muon)} block matrices ({m:,} params) on Muon, {len(self.adamw)} other tensors "
                f"({a:,} params: embeddings, head, norms, biases) on AdamW")


def _transposed(module: nn.Module) -> bool:
    """A module storing its weight (in, out): transformers' Conv1D (GPT-2)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def split_params(model: nn.Module) -> MuonSplit:
    """The trainable parameters of `model` (an HF model, unwrapped) split Muon / AdamW, in model order."""
    in_block = {id(p): _transposed(module) for p, module in block_matrices(model)}
    split, seen = MuonSplit(), set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in in_block:
            split.muon.append((name, p, in_block[id(p)]))
        else:
            split.adamw.append((name, p))
    return split


def lr_factor(shape: tuple[int, int], transposed: bool, adjust_lr: str) -> float:
    """What a matrix stored transposed needs its group lr multiplied by so that torch's adjust_lr_fn, which reads
    the shape as (out, in), yields the factor of the (out, in) matrix; 1.0 for nn.Linear's layout."""
    if not transposed or adjust_lr != "original":
        return 1.0
    fan_in, fan_out = shape
    return math.sqrt(max(1.0, fan_out / fan_in)) / math.sqrt(max(1.0, fan_in / fan_out))


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW and torch.optim.Muon stepped as one optimizer (one state dict, AdamW's groups first)."""

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon, split: MuonSplit):
        self.adamw, self.muon, self.split = adamw, muon, split
        super().__init__([{"params": list(g["params"])} for g in [*adamw.param_groups, *muon.param_groups]], {})
        self.param_groups = [*adamw.param_groups, *muon.param_groups]
        self._share()

    def _share(self) -> None:
        """Point both parts at this optimizer's group dicts and one state (their parameters are disjoint)."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = self.param_groups[:n], self.param_groups[n:]
        state: defaultdict = defaultdict(dict, self.state)
        self.state = self.adamw.state = self.muon.state = state

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.adamw.step()
        self.muon.step()
        return loss

    def describe(self) -> list[str]:
        """The start banner's lines (backends/base.py Engine.describe)."""
        return [self.split.banner()]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # replaces self.state and the group dicts: share them again
        self._share()


def make_muon_adamw(model: nn.Module, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                    momentum: float, adjust_lr: str) -> MuonAdamW:
    """The composite optimizer over `model`'s trainable parameters (its .split says which went where)."""
    split = split_params(model)
    if not split.muon:
        raise UserError(f"--optimizer muon: {type(model).__name__} has no 2-D matrix inside a transformer block "
                        "(its `_no_split_modules` stack); use --optimizer adamw")
    groups: dict[float, list[nn.Parameter]] = {}
    for _, p, transposed in split.muon:
        groups.setdefault(lr_factor(tuple(p.shape), transposed, adjust_lr), []).append(p)
    muon = torch.optim.Muon([{"params": ps, "lr": lr * f, "weight_decay": weight_decay / f}
                             for f, ps in groups.items()], lr=lr, weight_decay=weight_decay, momentum=momentum,
                            nesterov=True, adjust_lr_fn=adjust_lr)
    adamw = torch.optim.AdamW([p for _, p in split.adamw], lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    return MuonAdamW(adamw, muon, split)

"""The fused linear + cross-entropy loss: a causal LM's output head and its cross-entropy computed together,
chunk by chunk of tokens, with the gradients of the hidden states and the head's weight worked out in the
forward (as Liger-Kernel's FusedLinearCrossEntropy does), so the [tokens, vocab] logits never exist whole and
nothing is recomputed in backward.

    loss_sum = fused_linear_cross_entropy(hidden, head.weight, head.bias, labels, chunk_tokens)  # [n, h], [n]

Plain HF computes the logits in the model's dtype, upcasts them to fp32 for the loss and keeps both for
backward, then materialises the fp32 gradient of the logits: about 10 bytes per token x vocab entry at bf16
(transformers' ForCausalLMLoss). Here one chunk of fp32 logits (chunk_tokens x vocab) exists at a time and is
turned in place into its gradient; what backward keeps is the gradient of the hidden states ([n, h], the size
of the hidden states themselves) and of the head's weight (an fp32 [vocab, h] buffer, which the weight's own
gradient would need anyway).

It is called through the head module (`head(hidden, fused_labels=...)`, see install_on_head) so ZeRO-3 and
FSDP2 gather the head's weight in their hooks as for any forward and reduce its gradient as for any backward.
On a CUDA device with Liger-Kernel installed, Liger's Triton kernel does the same work (same result).
memory_reducers.chunked_lm_loss is the one caller; it keeps the recomputing chunk for heads that are not a
plain nn.Linear (QAT's fake-quantized head, a LoRA-wrapped head), whose forward must run as it is.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from .sequence_parallel import IGNORE

CHUNK_LOGITS = 64 * 1024 * 1024
"""Default chunk size in logits entries (tokens x vocab): 256 MiB of fp32 logits per chunk (2048 tokens at a 32k
vocabulary, 512 at 128k). On the H100 (benchmarks/RESULTS_GPU.md) 16M-entry chunks (512 tokens at 32k) cost 6% of
a 1.1B Llama's step against the plain loss; fewer, larger chunks keep the matmuls large."""


def auto_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk for a vocabulary: CHUNK_LOGITS entries, a power of two, at least 64."""
    tokens = max(64, CHUNK_LOGITS // max(vocab_size, 1))
    return 1 << (tokens.bit_length() - 1)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum over counted tokens of cross_entropy(hidden @ weight.T + bias, labels); gradients made in forward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
        want_h, want_w = hidden.requires_grad, weight.requires_grad
        want_b = bias is not None and bias.requires_grad
        grad_hidden = torch.zeros_like(hidden) if want_h else None
        # fp32 accumulation over chunks: one autograd matmul over all tokens would accumulate in fp32 too
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            part = slice(start, start + chunk_tokens)
            y = labels[part]
            counted = y != IGNORE
            if not hidden.is_cuda and not bool(counted.any()):  # on a GPU the test would wait for the device
                continue
            h = hidden[part]
            logits = torch.nn.functional.linear(h, weight, bias).float()
            lse = torch.logsumexp(logits, dim=-1)
            safe = torch.where(counted, y, torch.zeros_like(y))
            picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
            total += torch.where(counted, lse - picked, torch.zeros_like(lse)).sum()
            if not (want_h or want_w or want_b):
                continue
            # d(sum CE)/d logits = softmax - one_hot, zero on ignored rows: built in the logits' own storage
            grad = logits.sub_(lse.unsqueeze(1)).exp_()
            grad[torch.arange(grad.shape[0], device=grad.device), safe] -= 1.0
            grad.masked_fill_(~counted.unsqueeze(1), 0.0)
            if want_b:
                grad_bias += grad.sum(0)
            grad = grad.to(weight.dtype)
            if want_h:
                grad_hidden[part] = grad @ weight
            if want_w:
                if grad.dtype == torch.float32:
                    grad_weight.addmm_(grad.t(), h.float())
                else:
                    grad_weight += (grad.t() @ h.to(grad.dtype)).float()
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        # scaled in place (backward runs once): an fp32 weight's gradient is the buffer itself, no second copy
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        scale = grad_total.float()
        gh = grad_hidden.mul_(scale.to(grad_hidden.dtype)) if grad_hidden is not None else None
        gw = grad_weight.mul_(scale).to(ctx.weight_dtype) if grad_weight is not None else None
        gb = grad_bias.mul_(scale).to(ctx.weight_dtype) if grad_bias is not None else None
        return gh, gw, gb, None, None


def _liger() -> Optional[Callable[..., Any]]:
    """Liger-Kernel's fused linear cross-entropy (CUDA, Triton) where it is installed, else None."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except Exception:  # not installed, or no Triton: zerotrain's own
        return None
    return liger_fused_linear_cross_entropy


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                               labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """The summed cross-entropy of the counted tokens of hidden [n, h] through weight [vocab, h] (+ bias)
    against labels [n] (IGNORE: not counted), in fp32. Liger's kernel on CUDA where installed."""
    liger = _liger() if hidden.is_cuda else None
    if liger is not None:
        return liger(hidden, weight, labels, bias=bias, ignore_index=IGNORE, reduction="sum").float()
    return _FusedLinearCrossEntropy.apply(hidden, weight, bias, labels, chunk_tokens)


def kernel_name(device: torch.device) -> str:
    """Which implementation a run on `device` uses (the banner says it)."""
    return "Liger-Kernel" if device.type == "cuda" and _liger() is not None else "zerotrain's own (torch)"


def _head_forward(head: torch.nn.Linear, forward: Callable[..., Any], hidden: torch.Tensor,
                  fused_labels: Optional[torch.Tensor] = None, chunk_tokens: int = 0) -> torch.Tensor:
    if fused_labels is None:
        return forward(hidden)
    return fused_linear_cross_entropy(hidden, head.weight, head.bias, fused_labels, chunk_tokens)


def install_on_head(head: torch.nn.Linear) -> None:
    """Let the head module compute the fused loss when called as head(hidden, fused_labels=..., chunk_tokens=...)
    (a plain call still returns its logits), so the engines' hooks around the head's forward and backward run."""
    if not getattr(head, "_zt_fused", False):
        head.forward = functools.partial(_head_forward, head, head.forward)
        head._zt_fused = True


def carries_fused(head: torch.nn.Module) -> bool:
    """The head is a plain Linear (weight and bias as they are), which the fused loss computes itself; a
    subclass (QAT's fake-quantized Linear) or a wrapper (a LoRA head) must run its own forward."""
    return type(head) is torch.nn.Linear

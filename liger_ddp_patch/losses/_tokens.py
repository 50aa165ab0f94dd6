"""Which tokens carry a loss (only those are projected through the head), and per-row sums over them."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["Selection", "needs_grad", "select_tokens", "sequence_sums"]


class Selection(NamedTuple):
    """The tokens that carry a loss: ``hidden2d`` ``(B L, H)``, their flat ``positions``, ``labels`` and batch
    ``rows`` (``(N,)`` each, row-major), and ``counts`` ``(B,)``, the non-ignored tokens per row."""

    hidden2d: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    rows: torch.Tensor
    counts: torch.Tensor


def select_tokens(hidden, target, ignore_index) -> Selection:
    """Only the non-ignored positions are projected: an ignored position carries no loss and no gradient."""
    if hidden.dim() != 3 or target.dim() != 2 or hidden.shape[:2] != target.shape:
        raise ValueError(
            f"expected hidden states of shape (B, L, H) and target of shape (B, L); got {tuple(hidden.shape)} "
            f"and {tuple(target.shape)}"
        )
    B, L, H = hidden.shape
    mask = target != ignore_index
    positions = mask.reshape(-1).nonzero().squeeze(1)
    labels = target.reshape(-1).index_select(0, positions)
    rows = torch.div(positions, L, rounding_mode="floor") if L > 0 else positions
    return Selection(hidden.reshape(B * L, H), positions, labels, rows, mask.sum(dim=1))


def sequence_sums(logp, rows, batch_size):
    """Differentiable per-row sums of per-token values (in their dtype: fp32, fp64 for fp64 inputs)."""
    return torch.zeros(batch_size, dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)


def needs_grad(hidden, weight, bias) -> bool:
    needs = hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return torch.is_grad_enabled() and needs

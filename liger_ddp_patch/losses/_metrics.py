"""The metrics' logit sums, without a GEMM: Liger reports the mean of the policy logits over every position."""

from __future__ import annotations

import torch

from ._plan import math_dtype, no_autocast

__all__ = ["row_logit_sums"]

COLUMN_SUM_TILE_BYTES = 8 << 20


def _column_sums(weight):
    """``weight.sum(0)`` in fp32 (fp64 for an fp64 weight).  A half-precision ``sum(dim=0, dtype=float32)``
    converts the whole ``(V, H)`` weight to fp32 first (a hidden ``4 V H``-byte temporary): sum blocks of at most
    8 MiB in fp32 and V / 8 rows instead (larger blocks fall out of cache, issue #22)."""
    if weight.dtype in (torch.float32, torch.float64):
        return weight.sum(dim=0)
    block = max(1, min(COLUMN_SUM_TILE_BYTES // (4 * max(1, weight.shape[1])), -(-weight.shape[0] // 8)))
    out = torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device)
    for v0 in range(0, weight.shape[0], block):
        out += weight[v0 : v0 + block].float().sum(dim=0)
    return out


def row_logit_sums(hidden, weight, bias):
    """``sum_{t, v} logits[b, t, v]`` for every row ``b`` over *all* positions, without a GEMM.

    ``sum_v (h_t . W_v + b_v) = h_t . (sum_v W_v) + sum_v b_v``, so the row total is
    ``(sum_t h_t) . (sum_v W_v) + L * sum_v b_v`` -- O((B L + V) H) work instead of a (B L) x H x V GEMM.
    Computed in fp32 (fp64 when the hidden states and the weight are fp64; no gradient), autocast or not.
    """
    with torch.no_grad(), no_autocast(hidden.device):
        L = hidden.shape[1]
        dtype = math_dtype(torch.promote_types(hidden.dtype, weight.dtype))
        hsum = hidden.sum(dim=1, dtype=dtype)  # (B, H)
        out = hsum @ _column_sums(weight).to(dtype)
        if bias is not None:
            out = out + L * bias.sum(dtype=dtype)
    return out

"""The ``(chunk, V)`` sweep of a half-precision CPU chunk, on row tiles that stay in cache (issue #22).

On CPU the GEMM writes the chunk's logits in its own half dtype.  Converting the whole block to fp32 and sweeping it
(fused log-softmax, exp, the target entry, the row factor, the cast back) moves ~40 bytes per logit through memory,
more than the GEMMs cost once they run on native bf16 (AVX-512 BF16, AMX).  Here the half block is read twice and
written once, a few rows at a time into one small fp32 tile, as the Triton kernels of ``_triton.py`` do on a GPU:

    row_lse:  tile <- x[rows] (fp32); the target logit; log-softmax in place; logp, lse = tgt - logp
    grad_:    tile <- x[rows]; exp(tile - lse); the target entry expm1(logp); * mult; x[rows] <- tile (half)

Same interface as ``_triton`` (``row_lse``, ``grad_``), plain torch ops, so it runs inside DDP's forward like any.
"""

from __future__ import annotations

import torch

__all__ = ["TILE_BYTES", "grad_", "row_lse", "tile_rows"]

TILE_BYTES = 1 << 20  # fp32 bytes of one tile: about a core's L2


def tile_rows(vocab: int) -> int:
    return max(1, TILE_BYTES // (4 * max(1, vocab)))


def _tiles(x: torch.Tensor):
    n, V = x.shape
    rows = tile_rows(V)
    buf = torch.empty(min(n, rows) * V, dtype=torch.float32, device=x.device)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        yield s, e, buf[: (e - s) * V].view(e - s, V).copy_(x[s:e])


def row_lse(x: torch.Tensor, labels: torch.Tensor):
    """``(logp, lse)`` (fp32 ``(n,)``) of the targets ``labels`` (``(n, 1)``) in the half ``(n, V)`` logits ``x``,
    which are left as they are."""
    n = x.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty_like(logp)
    for s, e, t in _tiles(x):
        lab = labels[s:e]
        tgt = t.gather(1, lab).squeeze(1)
        torch._log_softmax(t, 1, False, out=t)
        torch.gather(t, 1, lab, out=logp[s:e].unsqueeze(1))
        torch.sub(tgt, logp[s:e], out=lse[s:e])
    return logp, lse


def grad_(x: torch.Tensor, labels, lse, logp, mult, out: torch.Tensor) -> torch.Tensor:
    """``out <- mult * (softmax(x) - onehot(labels))`` row by row in ``out``'s dtype (``out`` may be ``x``)."""
    target = torch.expm1(logp).mul_(mult).unsqueeze(1)
    mult, lse = mult.unsqueeze(1), lse.unsqueeze(1)
    for s, e, t in _tiles(x):
        t.sub_(lse[s:e]).exp_().mul_(mult[s:e])
        t.scatter_(1, labels[s:e], target[s:e])
        out[s:e].copy_(t)
    return out

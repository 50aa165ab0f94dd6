"""The ``(chunk, V)`` sweep of a half-precision CPU chunk on row tiles: the half block is the only block (issue #22).

On CPU the GEMM writes a chunk's logits in its own half dtype.  Converting the whole block to an fp32 block costs
4 more bytes per logit of the memory budget (a bf16 chunk held 699 tokens at V=32,000, an fp32 one 1,048), and a
chunk that ends inside a pair (a "long" pair) costs a ``(V, H)`` sum and smaller GEMMs (``_onepass``).  Here a few
rows at a time are copied into one fp32 tile that stays in cache, so a chunk holds ~3x the tokens for the same
budget; as the Triton kernels of ``_triton.py``, same interface:

    row_lse:  tile <- x[rows] (fp32); the target logit; log-softmax in place; logp, lse = tgt - logp
    grad_:    tile <- x[rows]; exp(tile - lse); the target entry expm1(logp); * mult; out[rows] <- tile (half)

All fp32 (the softmax, its target entry, the row factor), one rounding to the half dtype at the end, as the block
sweep.  Plain torch ops: it runs inside DDP's forward like any.
"""

from __future__ import annotations

import torch

from ._workspace import scratch

__all__ = ["TILE_BYTES", "grad_", "row_lse", "tile_rows"]

TILE_BYTES = 8 << 20  # fp32 bytes of one tile: within a CPU's L3 (bench_sweeps.py: 2-16 MiB tiles time alike)


def tile_rows(vocab: int) -> int:
    return max(1, TILE_BYTES // (4 * max(1, vocab)))


def _tiles(x: torch.Tensor):
    """``(start, end, fp32 copy of x[start:end])`` over row tiles, all in one buffer."""
    n, V = x.shape
    rows = tile_rows(V)
    buf = scratch("tile", min(n, rows) * V, torch.float32, x.device)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        yield s, e, buf[: (e - s) * V].view(e - s, V).copy_(x[s:e])


def row_lse(x: torch.Tensor, labels: torch.Tensor):
    """``(logp, lse)`` (fp32, ``(n,)``) of the targets ``labels`` (``(n, 1)``) in the half ``(n, V)`` logits ``x``,
    which are left as they are."""
    n = x.shape[0]
    logp = torch.empty(n, dtype=torch.float32, device=x.device)
    lse = torch.empty_like(logp)
    for s, e, t in _tiles(x):
        lab = labels[s:e]
        tgt = t.gather(1, lab).squeeze(1)
        torch._log_softmax(t, 1, False, out=t)
        logp[s:e] = t.gather(1, lab).squeeze(1)
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

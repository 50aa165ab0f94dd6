"""A candidate for issue #22: the bf16 head loss's sweep over a ``(chunk, V)`` fp32 logits block as two Triton kernels.

What the package's accelerator branch does eagerly in about ten passes over the block (max, subtract, exp, sum, the
target entry, the row factor, the cast), done in three: one read for each row's log-sum-exp (a running max and sum
over vocabulary tiles), one read and one bf16 write for the gradient

    g[t, v] = mult[t] * (exp(x[t, v] - lse[t]) - [v == y_t]),   the target entry as mult[t] * expm1(logp[t])

(``expm1``: no cancellation when the target's probability is near 1, as ``_onepass._softmax_minus_onehot_``).  Not
used by the package: ``bench_sweeps.py --device cuda`` times it beside the eager sweep and ``torch.compile``'s, so
that a lent GPU decides which one is built into the loss.  ``TRITON_INTERPRET=1`` runs it on CPU tensors (slowly):
how its results are checked without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _row_lse(x_ptr, lab_ptr, lse_ptr, tgt_ptr, V, stride, BLOCK: tl.constexpr):
    """One program per row: its log-sum-exp (one exponential per logit, rescaled per tile) and its target logit."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    m = -float("inf")
    s = 0.0
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=-float("inf"))
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    tl.store(lse_ptr + row, m + tl.log(s))
    tl.store(tgt_ptr + row, tl.load(base + tl.load(lab_ptr + row)))


@triton.jit
def _row_grad(x_ptr, lab_ptr, lse_ptr, tgt_ptr, mult_ptr, out_ptr, V, stride, out_stride, BLOCK: tl.constexpr):
    """Program ``(row, tile)``: ``mult * (softmax - onehot)`` of one vocabulary tile, written in the output dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < V
    x = tl.load(x_ptr + row * stride + cols, mask=keep, other=0.0)
    g = tl.exp(x - tl.load(lse_ptr + row))
    g = tl.where(cols == tl.load(lab_ptr + row), tl.load(tgt_ptr + row), g) * tl.load(mult_ptr + row)
    rounded = g.to(
        out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"
    )  # as a cast in torch (the interpreter truncates)
    tl.store(out_ptr + row * out_stride + cols, rounded, mask=keep)


def sweep(x: torch.Tensor, labels: torch.Tensor, mult: torch.Tensor, out: torch.Tensor, block: int = 4096):
    """``out <- mult * (softmax(x) - onehot(labels))`` row by row; returns ``(logp, lse)`` of the targets (fp32).

    ``x``: the fp32 ``(n, V)`` block (rows contiguous); ``labels``: ``(n,)`` or ``(n, 1)`` int64; ``mult``: ``(n,)``
    fp32, the loss derivative of each token's row; ``out``: ``(n, V)`` in the GEMM dtype (bf16).
    """
    n, V = x.shape
    labels = labels.reshape(n).contiguous()
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    tgt = torch.empty_like(lse)
    _row_lse[(n,)](x, labels, lse, tgt, V, x.stride(0), BLOCK=block)
    logp = tgt - lse
    target = torch.expm1(logp)
    _row_grad[(n, triton.cdiv(V, block))](
        x, labels, lse, target, mult.float().contiguous(), out, V, x.stride(0), out.stride(0), BLOCK=block
    )
    return logp, lse

"""The ``(chunk, V)`` sweep as two Triton kernels: ``sweep="triton"`` (issue #22), imported only when selected.

The eager sweep of an accelerator (``_softmax.softmax_`` and the one-pass scaling) makes about ten passes over the
fp32 logits block a chunk's GEMM wrote (max, subtract, exp, sum, the target entry, the row factor, the cast).  Here
it is three: one read for each row's log-sum-exp (a running max and sum over vocabulary tiles), then, once the
loss has turned the log-probs into each row's factor ``mult``, one read and one write in the GEMM dtype:

    g[t, v] = mult[t] * (exp(x[t, v] - lse[t]) - [v == y_t]),   the target entry mult[t] * expm1(logp[t])

(``expm1``: no cancellation when the target's probability is near 1, as the eager path).  No ``torch.compile``,
no ``torch.func``: two kernel launches per chunk, which run inside ``DistributedDataParallel.forward`` like any op.
``TRITON_INTERPRET=1`` (set before this module is imported) runs them on CPU tensors, slowly: how the tests check them.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["grad_", "row_lse"]

BLOCK = 4096  # vocabulary columns per tile


@triton.jit
def _row_lse(x_ptr, lab_ptr, lse_ptr, tgt_ptr, V, stride, BLOCK: tl.constexpr):
    """One program per row: its log-sum-exp (one exponential per logit, rescaled per tile) and its target logit."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    # fp32 tensors from the start, not Python floats: the loop carries one type whatever Triton infers for a literal
    m = tl.max(tl.full([BLOCK], -float("inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), axis=0)
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
    """Program ``(row, tile)``: ``mult * (softmax - onehot)`` of one vocabulary tile, written in the output dtype
    (``out`` may be ``x`` itself: each program reads its tile before it writes it)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < V
    x = tl.load(x_ptr + row * stride + cols, mask=keep, other=0.0)
    g = tl.exp(x - tl.load(lse_ptr + row))
    g = tl.where(cols == tl.load(lab_ptr + row), tl.load(tgt_ptr + row), g) * tl.load(mult_ptr + row)
    # to nearest even on a GPU, as torch casts (Triton's CPU interpreter truncates)
    tl.store(out_ptr + row * out_stride + cols, g.to(out_ptr.dtype.element_ty), mask=keep)


def _on(x: torch.Tensor):
    """Triton launches on the *current* CUDA device: make it ``x``'s (a rank may hold tensors on another)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def row_lse(x: torch.Tensor, labels: torch.Tensor):
    """``(logp, lse)`` (fp32 ``(n,)``) of the targets ``labels`` (``(n,)`` or ``(n, 1)``) in the fp32 ``(n, V)``
    logits ``x`` (rows contiguous), in one read; ``x`` is left as it is."""
    n, V = x.shape
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    tgt = torch.empty_like(lse)
    if n:
        with _on(x):
            _row_lse[(n,)](x, labels.reshape(n).contiguous(), lse, tgt, V, x.stride(0), BLOCK=BLOCK)
    return tgt.sub_(lse), lse


def grad_(x: torch.Tensor, labels, lse, logp, mult, out: torch.Tensor) -> torch.Tensor:
    """``out <- mult * (softmax(x) - onehot(labels))`` row by row (``lse``, ``logp``: :func:`row_lse`'s; ``mult``:
    ``(n,)``, each token's row factor); ``out``: ``(n, V)`` in the GEMM dtype, or ``x`` itself.  Returns ``out``."""
    n, V = x.shape
    if n:
        target = torch.expm1(logp).float().contiguous()
        with _on(x):
            _row_grad[(n, triton.cdiv(V, BLOCK))](
                x, labels.reshape(n).contiguous(), lse.float().contiguous(), target, mult.float().contiguous(), out,
                V, x.stride(0), out.stride(0), BLOCK=BLOCK,
            )  # fmt: skip
    return out

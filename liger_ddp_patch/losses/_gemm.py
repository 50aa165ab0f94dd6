"""The head's GEMMs: a chunk's ``(chunk, V)`` logits in reused buffers, and products accumulated in fp32.

Where torch can multiply half-precision matrices into an fp32 output (``torch.addmm(..., out_dtype=torch.float32)``:
CUDA, the ``aten::addmm.dtype`` overload of torch >= 2.8, PR #150812, with an fp32 ``self`` from torch 2.10,
PR #167931; not on CPU), the logits and the gradient tiles are written in fp32 directly with no product tile
(``Plan.fast``); elsewhere the product is formed in the compute dtype and converted or added.  On a CPU planned as an
accelerator (``_plan.simulated_accelerator``) those fp32-output GEMMs are emulated: the product in blocks of at most
:data:`EMULATED_BLOCK_BYTES` (:func:`_emulated_product`, the only allocations the GPU would not make), each written or
added into the fp32 result.
"""

from __future__ import annotations

import torch

from . import _plan
from ._plan import Plan
from ._workspace import scratch

__all__ = ["EMULATED_BLOCK_BYTES", "LogitsBuffers", "add_product", "mm_fp32"]

EMULATED_BLOCK_BYTES = 32 << 20  # one emulated product block (half precision), and its fp32 copy in ``add_``


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 ``a @ b`` from half-precision ``a, b``, written in fp32 by the GEMM (``Plan.fast``)."""
    if _plan.simulated(a.device) is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    _emulated_product(out, a, b, accumulate=False)
    return out


def _emulated_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out = a @ b`` (``accumulate``: ``+=``) for an fp32 ``out`` from half ``a, b`` on CPU, as CUDA's fp32-output
    GEMM computes it but in blocks along ``out``'s longer side (GEMMs of hundreds of rows or columns), each at most
    :data:`EMULATED_BLOCK_BYTES` in the half dtype: what a simulated accelerator allocates beyond the GPU's."""
    n, m = out.shape
    along_rows = n > m
    step = max(1, EMULATED_BLOCK_BYTES // (a.element_size() * max(1, m if along_rows else n)))
    for s in range(0, n if along_rows else m, step):
        e = min(n if along_rows else m, s + step)
        part = a[s:e] @ b if along_rows else a @ b[:, s:e]
        dst = out[s:e] if along_rows else out[:, s:e]
        dst.add_(part) if accumulate else dst.copy_(part)


def _logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fast: bool) -> torch.Tensor:
    """Fresh fp32 (fp64 for fp64) ``(c, Vb)`` logits of a chunk; ``h`` and ``w`` are in the compute dtype."""
    if h.dtype in (torch.float32, torch.float64):
        return h @ w.t() if bias is None else torch.addmm(bias.to(h.dtype), h, w.t())
    logits = mm_fp32(h, w.t()) if fast else (h @ w.t()).float()
    if bias is not None:
        logits += bias
    return logits


class LogitsBuffers:
    """The ``(chunk, V)`` buffers of one pass, reused by every chunk where that pays (and by the passes of one loss
    call: ``_workspace``): on CPU a fresh multi-MB tensor per chunk costs its page faults again (glibc hands large
    blocks back to the OS); on an accelerator the caching allocator already reuses memory, and the fp32-output GEMM
    writes a fresh tensor.  One fp32 (fp64) logits block, plus the half-precision GEMM output when the GEMM cannot
    write fp32 itself; ``half_only`` (a forward pass of a ``"tiles"`` plan): the GEMM output alone, which
    :meth:`logits` then returns as it is."""

    def __init__(self, rows: int, vocab: int, plan: Plan, device: torch.device, half_only: bool = False):
        self.fast = plan.fast
        self.reuse = _plan.device_kind(device) == "cpu" and not plan.fast and rows > 0
        self.half_only = half_only and self.reuse and plan.cdtype != plan.mdtype
        full = self.reuse and not self.half_only
        self.full = scratch("full", rows * vocab, plan.mdtype, device) if full else None
        half = self.reuse and plan.cdtype != plan.mdtype
        self.half = scratch("half", rows * vocab, plan.cdtype, device) if half else None

    @staticmethod
    def _block(buf, rows, cols):  # a contiguous (rows, cols) view at the start of the buffer
        return buf[: rows * cols].view(rows, cols)

    def logits(self, h, w, bias):
        """fp32 (fp64) ``h @ w.T + b`` (``half_only``: in the compute dtype); ``h``, ``w`` in the compute dtype."""
        if not self.reuse:
            return _logits(h, w, bias, self.fast)
        if self.half_only:  # no bias here (tiles_sweep)
            return torch.mm(h, w.t(), out=self._block(self.half, h.shape[0], w.shape[0]))
        out = self._block(self.full, h.shape[0], w.shape[0])
        if self.half is None:
            torch.mm(h, w.t(), out=out) if bias is None else torch.addmm(bias.to(h.dtype), h, w.t(), out=out)
            return out
        out.copy_(torch.mm(h, w.t(), out=self._block(self.half, h.shape[0], w.shape[0])))
        if bias is not None:
            out += bias
        return out

    def lowp_out(self, grad_logits, cdtype):
        """Where ``grad_logits`` goes in the compute dtype: itself (same dtype), the half buffer (whose logits are
        no longer needed) or a fresh tensor."""
        if grad_logits.dtype == cdtype:
            return grad_logits
        if self.half is None:
            return torch.empty(grad_logits.shape, dtype=cdtype, device=grad_logits.device)
        return self._block(self.half, *grad_logits.shape)

    def lowp(self, grad_logits, cdtype):
        """``grad_logits`` in the compute dtype (a copy into :meth:`lowp_out`)."""
        out = self.lowp_out(grad_logits, cdtype)
        return out if out is grad_logits else out.copy_(grad_logits)


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fast: bool) -> None:
    """``acc += a @ b`` with ``acc`` fp32/fp64 and ``a, b`` in the compute dtype, without an ``acc``-sized copy
    when torch can write fp32 from half inputs (else one product tile in the compute dtype)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif fast and _plan.simulated(acc.device) is not None:
        _emulated_product(acc, a, b, accumulate=True)
    elif fast:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(a @ b)

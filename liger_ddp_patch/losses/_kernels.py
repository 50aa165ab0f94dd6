"""The shared head kernels: the bottom layer of the losses (imports only ``_tiles`` and ``_workspace``).

What both paths (``_twopass``, ``_onepass``) need: the :class:`Plan` of a call (token chunk, compute dtype,
memory budget), the ``(chunk, V)`` logits buffers, the in-place softmax, the GEMM that accumulates in fp32, the
selection of the tokens that carry a loss, and the GEMM-free logit sums the metrics report.

Memory: one budget (:func:`logits_budget_bytes`: 128 MiB on CPU, 1 GiB on an accelerator) bounds every
temporary: the default token chunk is ``budget / (V * bytes per logit)`` (on CPU in half precision the half block
alone, its sweep on an fp32 tile of ``_tiles.TILE_BYTES`` taken from the budget), and in half precision the two-pass
backward walks the vocabulary in blocks of at most ``V / 4`` rows and ``budget / (4 H)`` rows
(:func:`vocab_block_rows`), so that the fp32 accumulator of the weight gradient is one ``(block, H)`` tile.
Where torch can multiply half-precision matrices into an fp32 output (``torch.addmm(..., out_dtype=torch.float32)``:
CUDA, the ``aten::addmm.dtype`` overload of torch >= 2.8, PR #150812, with an fp32 ``self`` from torch 2.10,
PR #167931; not on CPU), the tile is accumulated in place with no product tile; elsewhere the product is formed in
the compute dtype and added.

Precision: the GEMMs run in the *compute dtype*: the autocast dtype when ``torch.autocast`` is on for the inputs'
device (as autocast would run ``F.linear``; fp64 inputs are left alone, as autocast does), else the inputs' dtype.
Both paths run with autocast off (:func:`no_autocast`), so a recomputed softmax is the one whose log-sum-exp was
stored.  The log-sum-exp, the softmax, the per-token log-probs and their row sums, all reductions and the gradient
accumulators are fp32, and fp64 for fp64 inputs (:attr:`Plan.mdtype`: fp64 inputs are fp64 throughout).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import warnings
from typing import NamedTuple

import torch

from . import _tiles
from ._workspace import scratch

__all__ = [
    "DEFAULT_MAX_CHUNK_ELEMENTS",
    "LOGITS_BUDGET_BYTES",
    "LogitsBuffers",
    "Plan",
    "SWEEPS",
    "Selection",
    "add_product",
    "check_reference",
    "compute_dtype",
    "fp32_output_gemm",
    "fused_log_softmax",
    "logits_budget_bytes",
    "needs_grad",
    "no_autocast",
    "resolve_token_chunk_size",
    "row_logit_sums",
    "select_tokens",
    "sequence_sums",
    "softmax_",
    "sweep_of",
    "tiles_sweep",
    "vocab_block_rows",
]

# Bytes one token chunk may spend on its logits (and, in half precision, the weight-gradient tile).  CPU: 128 MiB
# (fp32: chunk * V <= 2**25).  Accelerators: 1 GiB, so that at Qwen's V = 151,936 a chunk is ~1,700 rows (an
# H100/H200 GEMM wants well over ~220 rows) while staying a small slice of an 80-141 GB device.
LOGITS_BUDGET_BYTES = {"cpu": 128 << 20, "accelerator": 1 << 30}
DEFAULT_MAX_CHUNK_ELEMENTS = LOGITS_BUDGET_BYTES["cpu"] // 4  # kept for compatibility: the CPU fp32 budget
MAX_DEFAULT_CHUNK = 8192


def logits_budget_bytes(device=None) -> int:
    """The default per-chunk memory budget for ``device`` (a ``torch.device``, a type string, or None = CPU)."""
    kind = "cpu" if device is None else torch.device(device).type
    return LOGITS_BUDGET_BYTES["cpu" if kind == "cpu" else "accelerator"]


@functools.cache
def fp32_output_gemm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(fp32_acc, a, b, out_dtype=torch.float32, out=fp32_acc)`` works for half ``a, b`` here.

    Probed once per (device type, dtype) on 2x2 tensors, result checked: CUDA with torch >= 2.10 says yes,
    CPU (no kernel) and older torch say no, and then the callers fall back to a product in the compute dtype.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device_type)
        acc = torch.ones(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        logits = torch.mm(a, a, out_dtype=torch.float32)
        return bool((acc == 3).all()) and logits.dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError, ValueError, AssertionError):
        return False


def fp32_out(device, dtype) -> bool:
    """Whether the GEMMs of ``dtype`` on ``device`` write fp32 themselves (never on CPU)."""
    kind = "cpu" if device is None else torch.device(device).type
    return kind != "cpu" and fp32_output_gemm(kind, dtype)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError, ValueError):  # torch < 2.4, or a device type autocast does not know
        pass
    return None


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMM dtype: autocast's when it is on for this device (fp64 excepted, as autocast does), else the inputs'."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    auto = _autocast_dtype(hidden.device.type)
    return auto if auto is not None and dtype != torch.float64 else dtype


def no_autocast(device: torch.device):
    """Our GEMMs cast explicitly to the compute dtype: autocast must not re-cast them (nor the fp32 math)."""
    if _autocast_dtype(device.type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def math_dtype(cdtype: torch.dtype) -> torch.dtype:
    """The dtype of the softmax, the reductions and the accumulators: fp64 for fp64, else fp32."""
    return torch.float64 if cdtype == torch.float64 else torch.float32


def tiles_sweep(device, cdtype: torch.dtype, bias=None) -> bool:
    """Whether a chunk's sweep runs on row tiles of its half-precision block (``_tiles``): on CPU (the GEMM writes
    the half dtype), in half precision, without a bias (whose gradient is summed from the fp32 block)."""
    kind = "cpu" if device is None else torch.device(device).type
    return kind == "cpu" and cdtype in (torch.float16, torch.bfloat16) and bias is None


def resolve_token_chunk_size(
    token_chunk_size: int | None,
    vocab_size: int,
    device=None,
    compute_dtype: torch.dtype = torch.float32,
    budget_bytes: int | None = None,
    tiles: bool | None = None,
) -> int:
    """Number of (non-ignored) tokens projected at once.

    ``None`` fits one chunk's logits into :func:`logits_budget_bytes` of ``device``: ``budget // (V * b)``
    tokens, clipped to ``[1, 8192]``, with ``b`` = 4 bytes per fp32 logit, plus the half-precision GEMM output
    when the GEMM cannot write fp32 itself; with ``tiles`` (default: :func:`tiles_sweep` without a bias) ``b`` is
    the half logit alone and the fp32 tile comes off the budget.  At ``V = 32000`` on CPU: 1048 tokens in fp32,
    1966 in bf16; an accelerator in bf16 at ``V = 151,936``: 1766 tokens (1177 without an fp32-output GEMM).
    """
    if token_chunk_size is None:
        budget = logits_budget_bytes(device) if budget_bytes is None else int(budget_bytes)
        per_logit = math_dtype(compute_dtype).itemsize
        if tiles if tiles is not None else tiles_sweep(device, compute_dtype):
            per_logit, budget = compute_dtype.itemsize, max(0, budget - _tiles.TILE_BYTES)
        elif compute_dtype.itemsize < per_logit and not fp32_out(device, compute_dtype):
            per_logit += compute_dtype.itemsize
        return max(1, min(MAX_DEFAULT_CHUNK, budget // (per_logit * max(1, int(vocab_size)))))
    if isinstance(token_chunk_size, bool) or int(token_chunk_size) != token_chunk_size or token_chunk_size < 1:
        raise ValueError(f"token_chunk_size must be a positive integer or None (auto), got {token_chunk_size!r}")
    return int(token_chunk_size)


def vocab_block_rows(vocab_size: int, hidden_size: int, budget_bytes: int) -> int:
    """Rows of the vocabulary per backward block in half precision: <= V/4 and <= budget / (4 H)."""
    return max(1, min(-(-vocab_size // 4), budget_bytes // (4 * max(1, hidden_size))))


SWEEPS = ("eager", "triton")


def sweep_of(sweep: str, device: torch.device, cdtype: torch.dtype, bias) -> str:
    """The sweep over each ``(chunk, V)`` block a call runs: ``"triton"`` (``_triton.py``), else ``"tiles"``
    (``_tiles.py``, :func:`tiles_sweep`) or ``"eager"``, with the reason when ``"triton"`` was asked for and cannot
    run here (warned once per reason)."""
    default = "tiles" if tiles_sweep(device, cdtype, bias) else "eager"
    if sweep == "eager":
        return default
    why = _triton_unavailable(device.type)
    if why is None and cdtype == torch.float64:
        why = "fp64 inputs"
    if why is None and bias is not None:
        why = "an LM head with a bias"
    if why is None:
        return "triton"
    _warn_once(f"sweep='triton' asked for, but {why}: the {default} sweep runs instead")
    return f"{default} (triton: {why})"


@functools.cache
def _triton_unavailable(device_type: str) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"a {device_type} tensor (Triton runs on CUDA, or on CPU with TRITON_INTERPRET=1)"
    return None


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=2)


class Plan(NamedTuple):
    """How one call runs: ``chunk`` tokens per GEMM, the GEMM dtype ``cdtype``, the accumulation dtype ``mdtype``,
    the per-chunk memory ``budget`` (bytes), ``fast`` (the GEMM writes fp32 from half inputs) and ``sweep``
    (:func:`sweep_of`: ``"triton"`` or ``"tiles"`` when the block's softmax and gradient run as the row sweeps of
    ``_triton.py`` or ``_tiles.py``)."""

    chunk: int
    cdtype: torch.dtype
    mdtype: torch.dtype
    budget: int
    fast: bool
    sweep: str = "eager"

    @classmethod
    def of(cls, hidden, weight, token_chunk_size: int | None, sweep: str = "eager", bias=None) -> Plan:
        cdtype = compute_dtype(hidden, weight)
        budget = logits_budget_bytes(hidden.device)
        how = sweep_of(sweep, hidden.device, cdtype, bias)
        tiles = how.startswith("tiles")
        chunk = resolve_token_chunk_size(token_chunk_size, weight.shape[0], hidden.device, cdtype, budget, tiles)
        return cls(chunk, cdtype, math_dtype(cdtype), budget, fp32_out(hidden.device, cdtype), how)

    @property
    def rows(self):
        """The module whose ``row_lse`` / ``grad_`` sweep each half block (``_triton``, ``_tiles``), or None: the
        block is converted to fp32 and swept with :func:`softmax_` (imported on first use: Triton only if asked)."""
        if self.sweep == "triton":
            from . import _triton

            return _triton
        return _tiles if self.tiles else None

    @property
    def tiles(self) -> bool:
        """The ``_tiles`` sweep: a forward pass keeps the GEMM's half block as its only ``(chunk, V)`` block."""
        return self.sweep.startswith("tiles")

    def block_rows(self, weight: torch.Tensor) -> int:
        """Vocabulary rows per block where the weight gradient needs an fp32 tile (half precision, or a weight of
        another dtype than the GEMMs'); the whole vocabulary otherwise."""
        V, H = weight.shape
        blocked = self.cdtype.itemsize < self.mdtype.itemsize or weight.dtype != self.cdtype
        return vocab_block_rows(V, H, self.budget) if blocked else V


def check_reference(use_ref_model, ref_input, ref_weight) -> None:
    """With ``use_ref_model`` the reference tensors are required.

    Exception types mirror what the fused Liger/TRL losses end up raising for the same mistake
    (``TypeError`` for a missing ``ref_input`` -- from ``torch.chunk(None)`` -- and ``AttributeError`` for a
    missing ``ref_weight`` -- from ``None.t()``), but with a clear message.
    """
    if not use_ref_model:
        return
    if ref_input is None:
        raise TypeError("use_ref_model=True but ref_input is None: pass the reference model's hidden states")
    if ref_weight is None:
        raise AttributeError("use_ref_model=True but ref_weight is None: pass the reference model's LM-head weight")


def needs_grad(hidden, weight, bias) -> bool:
    needs = hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return torch.is_grad_enabled() and needs


def _logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fast: bool) -> torch.Tensor:
    """Fresh fp32 (fp64 for fp64) ``(c, Vb)`` logits of a chunk; ``h`` and ``w`` are in the compute dtype."""
    if h.dtype in (torch.float32, torch.float64):
        return h @ w.t() if bias is None else torch.addmm(bias.to(h.dtype), h, w.t())
    logits = torch.mm(h, w.t(), out_dtype=torch.float32) if fast else (h @ w.t()).float()
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
        self.reuse = device.type == "cpu" and not plan.fast and rows > 0
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


def fused_log_softmax(device: torch.device) -> bool:
    """Whether :func:`softmax_` takes torch's fused in-place row kernels (CPU: ``_softmax``, ``_log_softmax``) or the
    max / exp / sum steps with a row scale left to the caller (elsewhere).  A function, so that the tests can run the
    second branch on CPU."""
    return device.type == "cpu"


def softmax_(logits: torch.Tensor, labels: torch.Tensor, probs: bool = True):
    """In place: ``logits`` becomes ``softmax(logits) * scale`` (``scale`` None: 1); returns the target log-probs,
    the log-sum-exps and ``scale`` (per row).  ``probs=False``: only the first two are wanted (``logits`` becomes
    the log-softmax on CPU).

    CPU: one fused in-place kernel, each row in cache for its max, sum and write, one ``exp`` per logit.  With
    ``probs`` it is ``_softmax``, and the log-sum-exp comes from the identity ``max_v softmax_v = exp(m - lse)``
    (``m`` the row's largest logit): that entry is never below ``1 / V``, so its log is as exact as a log-softmax
    (issue #22: one exponential and one write pass fewer than ``_log_softmax`` then ``exp_``).
    Elsewhere: max, ``sub_``, ``exp_``, sum, with ``1 / sum`` returned as the scale for the caller to fold in."""
    tgt = logits.gather(1, labels).squeeze(1)
    if fused_log_softmax(logits.device):
        if probs:
            m = logits.amax(dim=1)
            torch._softmax(logits, 1, False, out=logits)
            lse = m.sub_(logits.amax(dim=1).log_())
            return tgt - lse, lse, None
        torch._log_softmax(logits, 1, False, out=logits)
        logp = logits.gather(1, labels).squeeze(1)
        return logp, tgt - logp, None
    m = logits.amax(dim=1, keepdim=True)
    logits.sub_(m).exp_()
    sumexp = logits.sum(dim=1)
    lse = sumexp.log().add_(m.squeeze(1))
    return tgt - lse, lse, sumexp.reciprocal_()


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fast: bool) -> None:
    """``acc += a @ b`` with ``acc`` fp32/fp64 and ``a, b`` in the compute dtype, without an ``acc``-sized copy
    when torch can write fp32 from half inputs (else one product tile in the compute dtype)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif fast:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(a @ b)


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

"""Token-chunked "linear layer -> log-prob of the target token" core, in plain PyTorch autograd.

This module is the shared engine behind :class:`ChunkedDPOLoss` and :class:`ChunkedKTOLoss`.  It never
calls ``torch.func`` or ``torch.compile``: the only custom piece is an ordinary
:class:`torch.autograd.Function` with a hand-written backward, so it runs unchanged inside
``DistributedDataParallel.forward`` (where the ``torch.func.grad_and_value`` + ``torch.compile`` path of the
Liger / TRL fused losses crashes with ``Cannot access storage of TensorWrapper``).

Two paths
---------
* **One pass** (``_onepass``; taken by :meth:`ChunkedLinearLoss.one_pass` whenever a gradient is needed): the
  loss gradients are formed while each chunk's logits are in memory -- three GEMMs and one sweep per policy
  token; the backward only scales the stored gradients.
* **Two passes** (this module's :class:`TokenLogProbs`; when the one-pass path is switched off, ``one_pass=False``):
  the forward keeps one log-sum-exp per token and the backward recomputes the logits -- four GEMMs per policy
  token, no ``(V, H)`` tensor held between forward and backward.
* No gradient (eval, ``no_grad``, the reference model): one GEMM per token.

Design
------
* Only the *non-ignored* positions (``target != ignore_index``) are gathered before any GEMM: an ignored
  position carries no loss and no gradient, so prompt tokens cost nothing (the fused Liger/TRL losses
  project every position, prompt included).
* Forward loops over chunks of ``token_chunk_size`` selected tokens.  Per chunk it forms the ``(chunk, V)``
  logits ``h @ W.T (+ b)`` in fp32, takes the target logit and the log-sum-exp, and keeps only the
  log-sum-exp (one fp32 scalar per token) for backward.  On CPU the ``(chunk, V)`` buffers are reused across
  chunks (:class:`LogitsBuffers`) and the softmax is one fused in-place ``log_softmax`` (:func:`softmax_`).
* Backward recomputes the logits and turns them in place into ``grad_logits = g * (onehot(target) - softmax)``,
  then ``grad_h = grad_logits @ W``, ``grad_W += grad_logits.T @ h``, ``grad_b += grad_logits.sum(0)``.

Memory: one budget (:func:`logits_budget_bytes`: 128 MiB on CPU, 1 GiB on an accelerator) bounds every
temporary: the default token chunk is ``budget / (V * bytes per logit)``, and in half precision the backward
walks the vocabulary in blocks of at most ``V / 4`` rows and ``budget / (4 H)`` rows, so that the fp32
accumulator of the weight gradient is one ``(block, H)`` tile, written into the half-precision result when the
block is done.  The weight gradient then costs its own result (``2 V H`` bytes in bf16) plus at most ``V H`` for
the fp32 tile and ``V H / 2`` for a product tile: under ``4 V H`` (Liger: a bf16 accumulator plus one bf16
chunk gradient, ``4 V H``), and no ``(V, H)``-sized tensor is made per chunk.  Where torch can multiply
half-precision matrices into an fp32 output (``torch.addmm(..., out_dtype=torch.float32)``: CUDA, the
``aten::addmm.dtype`` overload of torch >= 2.8, PR #150812, with an fp32 ``self`` from torch 2.10, PR #167931;
not on CPU), the tile is accumulated in place with no product tile at all; elsewhere the product is formed in
the compute dtype and added.  fp32 inputs take the plain path (no blocks, ``addmm_`` into the result).

Precision: the GEMMs run in the *compute dtype*: the autocast dtype when ``torch.autocast`` is on for the
inputs' device (as autocast would run ``F.linear``; fp64 inputs are left alone, as autocast does), else the
inputs' dtype.  Forward and backward use the same compute dtype (saved on the autograd context) and both run
with autocast off, so the recomputed softmax is the one whose log-sum-exp was stored.  The log-sum-exp, the
softmax, all reductions and the gradient accumulators are fp32 (fp64 for fp64 inputs); per-token log-probs are
returned in fp32 (as the fused losses' ``log_softmax(logits.float())``).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from . import _onepass

__all__ = [
    "ChunkedLinearLoss",
    "DEFAULT_MAX_CHUNK_ELEMENTS",
    "LOGITS_BUDGET_BYTES",
    "compute_dtype",
    "fp32_output_gemm",
    "logits_budget_bytes",
    "resolve_token_chunk_size",
    "TokenLogProbs",
    "token_logprobs",
    "row_logit_sums",
]

# Bytes one token chunk may spend on its logits (and, in half precision, the weight-gradient tile).  CPU: the
# 128 MiB this package always used (fp32: chunk * V <= 2**25).  Accelerators: 1 GiB, so that at Qwen's
# V = 151,936 a chunk is ~1,700 rows (an H100/H200 GEMM wants well over ~220 rows) while staying a small slice
# of an 80-141 GB device.
LOGITS_BUDGET_BYTES = {"cpu": 128 << 20, "accelerator": 1 << 30}
DEFAULT_MAX_CHUNK_ELEMENTS = LOGITS_BUDGET_BYTES["cpu"] // 4  # kept for compatibility: the CPU fp32 budget
_MAX_DEFAULT_CHUNK = 8192


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


def _no_autocast(device: torch.device):
    """Our GEMMs cast explicitly to the compute dtype: autocast must not re-cast them (nor the fp32 math)."""
    if _autocast_dtype(device.type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def _math_dtype(cdtype: torch.dtype) -> torch.dtype:
    return torch.float64 if cdtype == torch.float64 else torch.float32


def resolve_token_chunk_size(
    token_chunk_size: int | None,
    vocab_size: int,
    device=None,
    compute_dtype: torch.dtype = torch.float32,
    budget_bytes: int | None = None,
) -> int:
    """Number of (non-ignored) tokens projected at once.

    ``None`` fits one chunk's logits into :func:`logits_budget_bytes` of ``device``: ``budget // (V * b)``
    tokens, clipped to ``[1, 8192]``, with ``b`` = 4 bytes per fp32 logit, plus the half-precision GEMM output
    when the GEMM cannot write fp32 itself.  CPU fp32 at ``V = 32000``: 1048 tokens; an accelerator in bf16 at
    ``V = 151,936``: 1766 tokens (1177 without an fp32-output GEMM).
    """
    if token_chunk_size is None:
        budget = logits_budget_bytes(device) if budget_bytes is None else int(budget_bytes)
        per_logit = _math_dtype(compute_dtype).itemsize
        if compute_dtype.itemsize < per_logit and not _fp32_out(device, compute_dtype):
            per_logit += compute_dtype.itemsize
        return max(1, min(_MAX_DEFAULT_CHUNK, budget // (per_logit * max(1, int(vocab_size)))))
    token_chunk_size = int(token_chunk_size)
    if token_chunk_size < 1:
        raise ValueError(f"token_chunk_size must be a positive integer, got {token_chunk_size}")
    return token_chunk_size


def _fp32_out(device, dtype) -> bool:
    kind = "cpu" if device is None else torch.device(device).type
    return kind != "cpu" and fp32_output_gemm(kind, dtype)


def vocab_block_rows(vocab_size: int, hidden_size: int, budget_bytes: int) -> int:
    """Rows of the vocabulary per backward block in half precision: <= V/4 and <= budget / (4 H)."""
    return max(1, min(-(-vocab_size // 4), budget_bytes // (4 * max(1, hidden_size))))


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


def _logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, fast: bool) -> torch.Tensor:
    """Fresh fp32 (fp64 for fp64) ``(c, Vb)`` logits of a chunk; ``h`` and ``w`` are in the compute dtype."""
    if h.dtype in (torch.float32, torch.float64):
        return h @ w.t() if bias is None else torch.addmm(bias.to(h.dtype), h, w.t())
    logits = torch.mm(h, w.t(), out_dtype=torch.float32) if fast else (h @ w.t()).float()
    if bias is not None:
        logits += bias
    return logits


class LogitsBuffers:
    """The ``(chunk, V)`` buffers of one call, reused by every chunk where that pays: on CPU a fresh multi-MB tensor
    per chunk costs its page faults again (glibc hands large blocks back to the OS); on an accelerator the caching
    allocator already reuses memory, and the fp32-output GEMM writes a fresh tensor.  Same bytes as before: one
    fp32 (fp64) logits block, plus the half-precision GEMM output when the GEMM cannot write fp32 itself."""

    def __init__(self, rows: int, vocab: int, cdtype: torch.dtype, device: torch.device, fast: bool):
        self.fast = fast
        self.reuse = device.type == "cpu" and not fast and rows > 0
        mdtype = _math_dtype(cdtype)
        self.full = torch.empty(rows * vocab, dtype=mdtype, device=device) if self.reuse else None
        self.half = torch.empty(rows * vocab, dtype=cdtype, device=device) if self.reuse and cdtype != mdtype else None

    @staticmethod
    def _block(buf, rows, cols):  # a contiguous (rows, cols) view at the start of the buffer
        return buf[: rows * cols].view(rows, cols)

    def logits(self, h, w, bias):
        """fp32 (fp64) ``h @ w.T + b``; ``h``, ``w`` in the compute dtype."""
        if not self.reuse:
            return _logits(h, w, bias, self.fast)
        out = self._block(self.full, h.shape[0], w.shape[0])
        if self.half is None:
            torch.mm(h, w.t(), out=out) if bias is None else torch.addmm(bias.to(h.dtype), h, w.t(), out=out)
            return out
        out.copy_(torch.mm(h, w.t(), out=self._block(self.half, h.shape[0], w.shape[0])))
        if bias is not None:
            out += bias
        return out

    def lowp(self, grad_logits, cdtype):
        """``grad_logits`` in the compute dtype (into the half buffer, whose logits are no longer needed)."""
        if grad_logits.dtype == cdtype:
            return grad_logits
        if self.half is None:
            return grad_logits.to(cdtype)
        return self._block(self.half, *grad_logits.shape).copy_(grad_logits)


def fused_log_softmax(device: torch.device) -> bool:
    """Whether :func:`softmax_` takes one fused in-place ``log_softmax`` (CPU) or the max / exp / sum steps with a
    row scale left to the caller (elsewhere).  A function, so that the tests can run the second branch on CPU."""
    return device.type == "cpu"


def softmax_(logits: torch.Tensor, labels: torch.Tensor, probs: bool = True):
    """In place: ``logits`` becomes ``softmax(logits) * scale`` (``scale`` None: 1); returns the target log-probs,
    the log-sum-exps and ``scale`` (per row).  ``probs=False``: only the first two are wanted.

    CPU: one fused in-place ``log_softmax`` (each row stays in cache for its max, sum and write) and ``exp_``.
    Elsewhere: max, ``sub_``, ``exp_``, sum, with ``1 / sum`` returned as the scale for the caller to fold in."""
    tgt = logits.gather(1, labels).squeeze(1)
    if fused_log_softmax(logits.device):
        torch._log_softmax(logits, 1, False, out=logits)
        logp = logits.gather(1, labels).squeeze(1)
        if probs:
            logits.exp_()
        return logp, tgt - logp, None
    m = logits.amax(dim=1, keepdim=True)
    logits.sub_(m).exp_()
    sumexp = logits.sum(dim=1)
    lse = sumexp.log().add_(m.squeeze(1))
    return tgt - lse, lse, sumexp.reciprocal_()


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fast: bool) -> None:
    """``acc += a @ b`` with ``acc`` fp32/fp64 and ``a, b`` in the compute dtype, without an ``acc``-sized copy
    when torch can write fp32 from half inputs (else one product tile in the compute dtype)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif fast:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(a @ b)


def _forward_chunks(hidden2d, weight, bias, positions, labels, chunk, cdtype):
    """Returns (target log-prob, log-sum-exp), both fp32 of shape (N,)."""
    n = positions.numel()
    logp = torch.empty(n, dtype=torch.float32, device=hidden2d.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden2d.device)
    fast = _fp32_out(hidden2d.device, cdtype)
    w = weight.to(cdtype)  # no copy unless autocast (or mixed inputs) asks for another dtype
    bufs = LogitsBuffers(min(n, chunk), weight.shape[0], cdtype, hidden2d.device, fast)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        logits = bufs.logits(hidden2d.index_select(0, positions[s:e]).to(cdtype), w, bias)
        logp[s:e], lse[s:e], _ = softmax_(logits, labels[s:e].unsqueeze(1), probs=False)
        del logits
    return logp, lse


class TokenLogProbs(torch.autograd.Function):
    """``log softmax(h_t @ W.T + b)[y_t]`` for the selected flat positions ``t`` (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, positions, labels, chunk, cdtype, budget):
        with _no_autocast(hidden2d.device):
            logp, lse = _forward_chunks(hidden2d, weight, bias, positions, labels, chunk, cdtype)
        ctx.chunk, ctx.cdtype, ctx.budget = chunk, cdtype, budget
        ctx.has_bias = bias is not None
        saved_bias = bias if bias is not None else weight.new_empty(0)
        ctx.save_for_backward(hidden2d, weight, saved_bias, positions, labels, lse)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden2d, weight, bias, positions, labels, lse = ctx.saved_tensors
        with _no_autocast(hidden2d.device):
            grads = _backward_chunks(
                hidden2d,
                weight,
                bias if ctx.has_bias else None,
                positions,
                labels,
                lse,
                grad_logp,
                ctx.chunk,
                ctx.cdtype,
                ctx.budget,
                ctx.needs_input_grad[:3],
            )
        return (*grads, None, None, None, None, None)


def _backward_chunks(hidden2d, weight, bias, positions, labels, lse, grad_logp, chunk, cdtype, budget, needs):
    need_h, need_w, need_b = needs
    V, H = weight.shape
    n = positions.numel()
    device = hidden2d.device
    mdtype = _math_dtype(cdtype)
    fast = _fp32_out(device, cdtype)
    g_all = grad_logp.to(mdtype).unsqueeze(1)
    grad_h = torch.zeros_like(hidden2d) if need_h else None
    grad_w = torch.zeros_like(weight) if need_w else None  # the result: the only (V, H) tensor made here
    grad_b = torch.zeros(V, dtype=mdtype, device=device) if need_b else None
    # Half precision (or a weight that must be cast): walk the vocabulary in blocks, so the fp32 tile, the cast
    # weight and any product tile are block-sized.  fp32: one block, gradients straight into the results.
    blocked = cdtype.itemsize < mdtype.itemsize or weight.dtype != cdtype
    block = vocab_block_rows(V, H, budget) if blocked else V
    tile = None
    if need_w and grad_w.dtype != mdtype:
        tile = torch.empty(min(block, V), H, dtype=mdtype, device=device)
    gh = torch.zeros(n, H, dtype=mdtype, device=device) if need_h and block < V else None
    bufs = LogitsBuffers(min(n, chunk), min(block, V), cdtype, device, fast)
    # one block over the whole vocabulary on CPU: the softmax is recomputed by one fused in-place kernel
    fused_softmax = block >= V and fused_log_softmax(device)
    for v0 in range(0, V, block):
        v1 = min(V, v0 + block)
        w = weight[v0:v1].to(cdtype)
        b = None if bias is None else bias[v0:v1]
        acc = None
        if need_w:
            acc = grad_w[v0:v1] if tile is None else tile[: v1 - v0].zero_()
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            pos = positions[s:e]
            g = g_all[s:e]
            h = hidden2d.index_select(0, pos).to(cdtype)
            gl = bufs.logits(h, w, b)
            # gl <- g * (onehot(y) - exp(logits - lse)), in place; targets outside this block add 0
            if fused_softmax:
                torch._softmax(gl, 1, False, out=gl)
            else:
                gl.sub_(lse[s:e].unsqueeze(1)).exp_()
            gl.mul_(-g)
            lab = labels[s:e] - v0
            inside = (lab >= 0) & (lab < v1 - v0)
            gl.scatter_add_(1, lab.clamp(0, v1 - v0 - 1).unsqueeze(1), g * inside.unsqueeze(1))
            if need_b:
                grad_b[v0:v1] += gl.sum(dim=0)
            glc = bufs.lowp(gl, cdtype)
            del gl
            if need_h:
                if gh is None:
                    grad_h.index_copy_(0, pos, (glc @ w).to(grad_h.dtype))
                else:
                    _add_product(gh[s:e], glc, w, fast)
            if need_w:
                _add_product(acc, glc.t(), h, fast)
            del glc
        if tile is not None:
            grad_w[v0:v1].copy_(acc)
    if gh is not None:
        grad_h.index_copy_(0, positions, gh.to(grad_h.dtype))
    return grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype)


def select_tokens(hidden, target, ignore_index):
    """``(hidden2d, positions, labels, rows, counts)``: the non-ignored flat positions, their labels and batch rows,
    and the number of non-ignored tokens per row (see :func:`token_logprobs`)."""
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
    return hidden.reshape(B * L, H), positions, labels, rows, mask.sum(dim=1)


def _chunking(hidden, weight, token_chunk_size):
    cdtype = compute_dtype(hidden, weight)
    budget = logits_budget_bytes(hidden.device)
    chunk = resolve_token_chunk_size(token_chunk_size, weight.shape[0], hidden.device, cdtype, budget)
    return chunk, cdtype, budget


def _needs_grad(hidden, weight, bias) -> bool:
    needs = hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    return torch.is_grad_enabled() and needs


def token_logprobs(hidden, weight, bias, target, ignore_index, token_chunk_size=None):
    """Per-token target log-probs of the non-ignored positions.

    Args:
        hidden: ``(B, L, H)`` (any strides) hidden states.
        weight: ``(V, H)`` LM-head weight.  bias: ``(V,)`` or ``None``.
        target: ``(B, L)`` integer labels; positions equal to ``ignore_index`` are skipped.

    Returns:
        ``(logp, rows, counts)``: ``logp`` fp32 ``(N,)`` (differentiable w.r.t. hidden/weight/bias when
        grad mode is on), ``rows`` int64 ``(N,)`` the batch row of every selected token, ``counts``
        int64 ``(B,)`` the number of non-ignored tokens per row.
    """
    hidden2d, positions, labels, rows, counts = select_tokens(hidden, target, ignore_index)
    chunk, cdtype, budget = _chunking(hidden, weight, token_chunk_size)
    if _needs_grad(hidden, weight, bias):
        logp = TokenLogProbs.apply(hidden2d, weight, bias, positions, labels, chunk, cdtype, budget)
    else:
        with torch.no_grad(), _no_autocast(hidden.device):
            logp, _ = _forward_chunks(hidden2d, weight, bias, positions, labels, chunk, cdtype)
    return logp, rows, counts


def sequence_sums(logp, rows, batch_size):
    """Differentiable per-row sums of per-token values (fp32)."""
    return torch.zeros(batch_size, dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)


def _column_sums(weight):
    """``weight.sum(0)`` in fp32.  A half-precision ``sum(dim=0, dtype=float32)`` converts the whole ``(V, H)``
    weight to fp32 first (a hidden ``4 V H``-byte temporary): sum blocks of <= 8192 and <= V / 8 rows instead."""
    if weight.dtype == torch.float32:
        return weight.sum(dim=0)
    block = max(1, min(8192, -(-weight.shape[0] // 8)))
    out = torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device)
    for v0 in range(0, weight.shape[0], block):
        out += weight[v0 : v0 + block].sum(dim=0, dtype=torch.float32)
    return out


def row_logit_sums(hidden, weight, bias):
    """``sum_{t, v} logits[b, t, v]`` for every row ``b`` over *all* positions, without a GEMM.

    ``sum_v (h_t . W_v + b_v) = h_t . (sum_v W_v) + sum_v b_v``, so the row total is
    ``(sum_t h_t) . (sum_v W_v) + L * sum_v b_v`` -- O((B L + V) H) work instead of a (B L) x H x V GEMM.
    Computed in fp32 (no gradient), autocast or not.
    """
    with torch.no_grad(), _no_autocast(hidden.device):
        L = hidden.shape[1]
        hsum = hidden.sum(dim=1, dtype=torch.float32)  # (B, H)
        wsum = _column_sums(weight)  # (H,)
        out = hsum @ wsum
        if bias is not None:
            out = out + L * bias.sum(dtype=torch.float32)
    return out


class ChunkedLinearLoss(torch.nn.Module):
    """The shared base of the chunked losses: the options every one of them has, and per-sequence log-probs."""

    def __init__(
        self, ignore_index, beta, compiled, use_ref_model, average_log_prob, chunk_size, token_chunk_size, one_pass=True
    ):
        super().__init__()
        if token_chunk_size is not None:
            resolve_token_chunk_size(token_chunk_size, 1)  # validate early
        self.ignore_index = ignore_index
        self.beta = beta
        self.compiled = compiled  # accepted for drop-in compatibility; nothing here is compiled
        self.use_ref_model = use_ref_model
        self.average_log_prob = average_log_prob
        self.chunk_size = chunk_size  # accepted for drop-in compatibility; token_chunk_size bounds memory
        self.token_chunk_size = token_chunk_size
        # the one-pass path (``_onepass``) when a gradient is needed; False: the two-pass path, which holds no
        # gradient between forward and backward (and no (V, H) accumulator for a pair longer than a chunk)
        self.allow_one_pass = bool(one_pass)

    def averaged(self, sums, counts):
        """Per-sequence log-probs from the per-row sums: ÷ token count with ``average_log_prob``."""
        return sums / counts if self.average_log_prob else sums  # 0/0 -> NaN for a fully ignored row, as in Liger

    def sequence_logps(self, hidden, weight, bias, target):
        """``(per-sequence log-prob, per-token log-probs, their rows, non-ignored tokens per row)``."""
        logp, rows, counts = token_logprobs(hidden, weight, bias, target, self.ignore_index, self.token_chunk_size)
        return self.averaged(sequence_sums(logp, rows, target.shape[0]), counts), logp, rows, counts

    def one_pass(self, hidden, weight, bias, target, group_of_row, loss_of_sums):
        """``(loss, per-row sums S, counts)`` with the gradients made in the forward (``_onepass``), or ``None``.

        ``loss_of_sums(S, counts)`` is the loss as a function of the raw per-row sums of token log-probs; it must be
        a sum of terms each reading only the rows of one group (``group_of_row``, ``(B,)`` int64).  ``None`` (the
        caller takes the two-pass path) when no gradient is needed or the one-pass path is switched off.
        """
        if not (self.allow_one_pass and _needs_grad(hidden, weight, bias)):
            return None
        hidden2d, positions, labels, rows, counts = select_tokens(hidden, target, self.ignore_index)
        cfg = _chunking(hidden, weight, self.token_chunk_size)
        plan = _onepass.group_chunks(rows, group_of_row, counts, cfg[0])
        loss, sums = _onepass.OnePassLoss.apply(
            hidden2d, weight, bias, positions, labels, rows, *plan, target.shape[0],
            lambda s: loss_of_sums(s, counts), cfg,
        )  # fmt: skip
        return loss, sums, counts

"""Token-chunked "linear layer -> log-prob of the target token" core, in plain PyTorch autograd.

This module is the shared engine behind :class:`ChunkedDPOLoss` and :class:`ChunkedKTOLoss`.  It never
calls ``torch.func`` or ``torch.compile``: the only custom piece is an ordinary
:class:`torch.autograd.Function` with a hand-written backward, so it runs unchanged inside
``DistributedDataParallel.forward`` (where the ``torch.func.grad_and_value`` + ``torch.compile`` path of the
Liger / TRL fused losses crashes with ``Cannot access storage of TensorWrapper``).

Design
------
* Only the *non-ignored* positions (``target != ignore_index``) are gathered before any GEMM: an ignored
  position carries no loss and no gradient, so prompt tokens cost nothing (the fused Liger/TRL losses
  project every position, prompt included).
* Forward loops over chunks of ``token_chunk_size`` selected tokens.  Per chunk it forms the logits
  ``h @ W.T (+ b)`` in fp32, takes the target logit and the log-sum-exp, and keeps only the log-sum-exp
  (one fp32 scalar per token) for backward; the ``(chunk, V)`` logits buffer is reused in place.
* Backward recomputes each chunk's logits, turns them in place into
  ``grad_logits = g * (onehot(target) - softmax)``, and emits
  ``grad_h = grad_logits @ W`` (written straight into the rows of the full hidden-state gradient),
  ``grad_W += grad_logits.T @ h`` (fp32 accumulator) and ``grad_b += grad_logits.sum(0)``.
* Peak extra memory is therefore ``~ token_chunk_size * V * 4`` bytes for the logits buffer (plus, for
  half-precision inputs, one half-precision copy of it), the fp32 weight-gradient accumulator and the
  hidden-state gradient -- independent of sequence length apart from the unavoidable ``grad_h``.

Precision: the GEMMs run in the input dtype (bf16/fp16 GEMMs on bf16/fp16 inputs), while the
log-sum-exp, the softmax, all reductions and the weight/bias-gradient accumulation run in fp32.
Per-token log-probs are returned in fp32 (as the fused losses' ``log_softmax(logits.float())``).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "ChunkedLinearLoss",
    "DEFAULT_MAX_CHUNK_ELEMENTS",
    "resolve_token_chunk_size",
    "TokenLogProbs",
    "token_logprobs",
    "row_logit_sums",
]

# chunk * V <= 2**25 elements -> ~128 MiB for the fp32 logits buffer of one chunk.
DEFAULT_MAX_CHUNK_ELEMENTS = 1 << 25
_MAX_DEFAULT_CHUNK = 4096


def resolve_token_chunk_size(token_chunk_size: Optional[int], vocab_size: int) -> int:
    """Number of (non-ignored) tokens projected at once.

    ``None`` picks ``min(4096, 2**25 // V)`` (at least 1), i.e. a ~128 MiB fp32 logits buffer; for
    ``V = 32000`` that is 1048 tokens.
    """
    if token_chunk_size is None:
        return max(1, min(_MAX_DEFAULT_CHUNK, DEFAULT_MAX_CHUNK_ELEMENTS // max(1, int(vocab_size))))
    token_chunk_size = int(token_chunk_size)
    if token_chunk_size < 1:
        raise ValueError(f"token_chunk_size must be a positive integer, got {token_chunk_size}")
    return token_chunk_size


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


def _logits_fp32(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """Fresh fp32 ``(c, V)`` logits for a chunk; the GEMM runs in the input dtype."""
    if h.dtype == torch.float32 and weight.dtype == torch.float32:
        if bias is not None:
            return torch.addmm(bias.float(), h, weight.t())
        return h @ weight.t()
    logits = (h @ weight.t()).float()
    if bias is not None:
        logits += bias.float()
    return logits


def _forward_chunks(hidden2d, weight, bias, positions, labels, chunk):
    """Returns (target log-prob, log-sum-exp), both fp32 of shape (N,)."""
    n = positions.numel()
    logp = torch.empty(n, dtype=torch.float32, device=hidden2d.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden2d.device)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        pos = positions[s:e]
        lab = labels[s:e].unsqueeze(1)
        logits = _logits_fp32(hidden2d.index_select(0, pos), weight, bias)
        tgt = logits.gather(1, lab).squeeze(1)
        m = logits.amax(dim=1, keepdim=True)
        # in place: logits <- exp(logits - max); one (c, V) buffer for the whole chunk
        logits.sub_(m).exp_()
        chunk_lse = logits.sum(dim=1).log_().add_(m.squeeze(1))
        lse[s:e] = chunk_lse
        logp[s:e] = tgt - chunk_lse
        del logits
    return logp, lse


class TokenLogProbs(torch.autograd.Function):
    """``log softmax(h_t @ W.T + b)[y_t]`` for the selected flat positions ``t`` (see module docstring)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, positions, labels, chunk):
        logp, lse = _forward_chunks(hidden2d, weight, bias, positions, labels, chunk)
        ctx.chunk = chunk
        ctx.has_bias = bias is not None
        saved_bias = bias if bias is not None else weight.new_empty(0)
        ctx.save_for_backward(hidden2d, weight, saved_bias, positions, labels, lse)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden2d, weight, bias, positions, labels, lse = ctx.saved_tensors
        if not ctx.has_bias:
            bias = None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        chunk = ctx.chunk
        n = positions.numel()
        grad_logp = grad_logp.float()
        grad_h = torch.zeros_like(hidden2d) if need_h else None
        grad_w32 = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b32 = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        half_gemm = weight.dtype != torch.float32 or hidden2d.dtype != torch.float32
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            pos = positions[s:e]
            g = grad_logp[s:e].unsqueeze(1)
            h = hidden2d.index_select(0, pos)
            gl = _logits_fp32(h, weight, bias)
            # gl <- g * (onehot(y) - exp(logits - lse)), in place
            gl.sub_(lse[s:e].unsqueeze(1)).exp_().mul_(-g)
            gl.scatter_add_(1, labels[s:e].unsqueeze(1), g)
            if need_b:
                grad_b32 += gl.sum(dim=0)
            if half_gemm:
                gl_lp = gl.to(weight.dtype)
                del gl
                if need_h:
                    grad_h.index_copy_(0, pos, (gl_lp @ weight).to(grad_h.dtype))
                if need_w:
                    grad_w32 += (gl_lp.t() @ h.to(weight.dtype)).float()
                del gl_lp
            else:
                if need_h:
                    grad_h.index_copy_(0, pos, gl @ weight)
                if need_w:
                    grad_w32.addmm_(gl.t(), h)
                del gl
        grad_w = None if grad_w32 is None else grad_w32.to(weight.dtype)
        grad_b = None if grad_b32 is None else grad_b32.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None


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
    if hidden.dim() != 3 or target.dim() != 2 or hidden.shape[:2] != target.shape:
        raise ValueError(
            f"expected hidden states of shape (B, L, H) and target of shape (B, L); got {tuple(hidden.shape)} "
            f"and {tuple(target.shape)}"
        )
    B, L, H = hidden.shape
    chunk = resolve_token_chunk_size(token_chunk_size, weight.shape[0])
    mask = target != ignore_index
    flat_mask = mask.reshape(-1)
    positions = flat_mask.nonzero().squeeze(1)
    labels = target.reshape(-1).index_select(0, positions)
    rows = torch.div(positions, L, rounding_mode="floor") if L > 0 else positions
    counts = mask.sum(dim=1)
    hidden2d = hidden.reshape(B * L, H)
    needs_grad = hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and needs_grad:
        logp = TokenLogProbs.apply(hidden2d, weight, bias, positions, labels, chunk)
    else:
        with torch.no_grad():
            logp, _ = _forward_chunks(hidden2d, weight, bias, positions, labels, chunk)
    return logp, rows, counts


def sequence_sums(logp, rows, batch_size):
    """Differentiable per-row sums of per-token values (fp32)."""
    return torch.zeros(batch_size, dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)


def row_logit_sums(hidden, weight, bias):
    """``sum_{t, v} logits[b, t, v]`` for every row ``b`` over *all* positions, without a GEMM.

    ``sum_v (h_t . W_v + b_v) = h_t . (sum_v W_v) + sum_v b_v``, so the row total is
    ``(sum_t h_t) . (sum_v W_v) + L * sum_v b_v`` -- O((B L + V) H) work instead of a (B L) x H x V GEMM.
    Computed in fp32 (no gradient).
    """
    with torch.no_grad():
        L = hidden.shape[1]
        hsum = hidden.sum(dim=1, dtype=torch.float32)  # (B, H)
        wsum = weight.sum(dim=0, dtype=torch.float32)  # (H,)
        out = hsum @ wsum
        if bias is not None:
            out = out + L * bias.sum(dtype=torch.float32)
    return out


class ChunkedLinearLoss(torch.nn.Module):
    """The shared base of the chunked losses: the options every one of them has, and per-sequence log-probs."""

    def __init__(self, ignore_index, beta, compiled, use_ref_model, average_log_prob, chunk_size, token_chunk_size):
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

    def sequence_logps(self, hidden, weight, bias, target):
        """``(per-sequence log-prob, per-token log-probs, their rows, non-ignored tokens per row)``."""
        logp, rows, counts = token_logprobs(hidden, weight, bias, target, self.ignore_index, self.token_chunk_size)
        seq = sequence_sums(logp, rows, target.shape[0])
        if self.average_log_prob:
            seq = seq / counts  # 0/0 -> NaN for a fully ignored row, as in Liger
        return seq, logp, rows, counts

"""Two passes over the head: per-token target log-probs whose backward recomputes the logits.

The forward keeps one log-sum-exp per token; the backward recomputes each chunk's logits and turns them in place into
``grad_logits = g * (onehot(target) - softmax)``, then ``grad_h = grad_logits @ W``, ``grad_W += grad_logits.T @ h``,
``grad_b += grad_logits.sum(0)``: four GEMMs per policy token, no ``(V, H)`` tensor held between forward and
backward.  Taken with ``one_pass=False``, for a loss that is not a sum over groups, and (forward only: one GEMM per
token) without a gradient.  The only custom piece is an ordinary :class:`torch.autograd.Function`, so it runs
unchanged inside ``DistributedDataParallel.forward``.
"""

from __future__ import annotations

import torch

from . import _gemm, _softmax, _tokens
from ._gemm import LogitsBuffers
from ._plan import Plan, no_autocast
from ._softmax import softmax_
from ._tokens import Selection, needs_grad

__all__ = ["TokenLogProbs", "backward_chunks", "forward_chunks", "sequence_logprob_sums", "token_logprobs"]


def forward_chunks(sel: Selection, weight, bias, plan: Plan):
    """Returns (target log-prob, log-sum-exp), both of shape (N,) in ``plan.mdtype`` (fp32; fp64 for fp64)."""
    n, device = sel.positions.numel(), sel.hidden2d.device
    logp = torch.empty(n, dtype=plan.mdtype, device=device)
    lse = torch.empty(n, dtype=plan.mdtype, device=device)
    w = weight.to(plan.cdtype)  # no copy unless autocast (or mixed inputs) asks for another dtype
    step = -(-n // max(1, -(-n // plan.chunk)))  # as many chunks as plan.chunk needs, of equal size: no small last
    bufs = LogitsBuffers(min(n, step), weight.shape[0], plan, device, half_only=plan.tiles)
    for s in range(0, n, step or 1):
        e = min(n, s + step)
        logits = bufs.logits(sel.hidden2d.index_select(0, sel.positions[s:e]).to(plan.cdtype), w, bias)
        if plan.rows is not None:  # one read of the block (Triton), or of one tile at a time
            logp[s:e], lse[s:e] = plan.rows.row_lse(logits, sel.labels[s:e].unsqueeze(1))
        else:
            logp[s:e], lse[s:e], _ = softmax_(logits, sel.labels[s:e].unsqueeze(1), probs=False)
        del logits
    return logp, lse


class TokenLogProbs(torch.autograd.Function):
    """``log softmax(h_t @ W.T + b)[y_t]`` for the selected tokens ``t`` (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, sel: Selection, plan: Plan):
        with no_autocast(hidden2d.device):
            logp, lse = forward_chunks(sel, weight, bias, plan)
        ctx.sel, ctx.plan, ctx.has_bias = sel._replace(hidden2d=None), plan, bias is not None
        ctx.save_for_backward(hidden2d, weight, bias if bias is not None else weight.new_empty(0), lse)
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        hidden2d, weight, bias, lse = ctx.saved_tensors
        sel = ctx.sel._replace(hidden2d=hidden2d)
        with no_autocast(hidden2d.device):
            grads = backward_chunks(
                sel, weight, bias if ctx.has_bias else None, lse, grad_logp, ctx.plan, ctx.needs_input_grad[:3]
            )
        return (*grads, None, None)


class _Grads:
    """The results of one backward and the fp32 accumulators behind them (only those ``needs`` asks for)."""

    def __init__(self, sel: Selection, weight, bias, plan: Plan, block: int, needs):
        need_h, need_w, need_b = needs
        V, H = weight.shape
        device, n = sel.hidden2d.device, sel.positions.numel()
        self.h = torch.zeros_like(sel.hidden2d) if need_h else None
        self.w = torch.zeros_like(weight) if need_w else None  # the result: the only (V, H) tensor made here
        self.b = torch.zeros(V, dtype=plan.mdtype, device=device) if need_b else None
        # an fp32 tile per vocabulary block where the result is not fp32; fp32 grad-input rows when blocked
        tile = need_w and self.w.dtype != plan.mdtype
        self.tile = torch.empty(min(block, V), H, dtype=plan.mdtype, device=device) if tile else None
        self.h_rows = torch.zeros(n, H, dtype=plan.mdtype, device=device) if need_h and block < V else None

    def weight_block(self, v0, v1):
        if self.w is None:
            return None
        return self.w[v0:v1] if self.tile is None else self.tile[: v1 - v0].zero_()

    def results(self, sel: Selection, bias):
        if self.h_rows is not None:
            self.h.index_copy_(0, sel.positions, self.h_rows.to(self.h.dtype))
        return self.h, self.w, None if self.b is None else self.b.to(bias.dtype)


def backward_chunks(sel: Selection, weight, bias, lse, grad_logp, plan: Plan, needs):
    """``(grad_hidden2d, grad_weight, grad_bias)`` (None where not needed) of ``sum_t grad_logp[t] * logp[t]``.

    Half precision (or a weight that must be cast): the vocabulary is walked in blocks, so the fp32 tile, the cast
    weight and any product tile are block-sized.  fp32: one block, gradients straight into the results."""
    V = weight.shape[0]
    block = plan.block_rows(weight)
    grads = _Grads(sel, weight, bias, plan, block, needs)
    step = _Step(sel, lse, grad_logp, plan, grads, min(block, V), whole=block >= V)
    for v0 in range(0, V, block):
        v1 = min(V, v0 + block)
        acc = grads.weight_block(v0, v1)
        w, b = weight[v0:v1].to(plan.cdtype), None if bias is None else bias[v0:v1]
        for s in range(0, sel.positions.numel(), plan.chunk):
            step(s, min(sel.positions.numel(), s + plan.chunk), v0, w, b, acc)
        if grads.tile is not None:
            grads.w[v0:v1].copy_(acc)
    return grads.results(sel, bias)


class _Step:
    """One chunk of tokens against one vocabulary block: recompute, form grad_logits in place, three GEMMs."""

    def __init__(self, sel: Selection, lse, grad_logp, plan: Plan, grads: _Grads, block: int, whole: bool):
        self.sel, self.lse, self.plan, self.grads = sel, lse, plan, grads
        self.g = grad_logp.to(plan.mdtype).unsqueeze(1)
        self.bufs = LogitsBuffers(min(sel.positions.numel(), plan.chunk), block, plan, sel.hidden2d.device)
        # one block over the whole vocabulary on CPU: the softmax is recomputed by one fused in-place kernel
        self.fused = whole and _softmax.fused_log_softmax(sel.hidden2d.device)

    def __call__(self, s, e, v0, w, b, acc):
        sel, plan, grads, g = self.sel, self.plan, self.grads, self.g[s:e]
        rows = w.shape[0]
        pos = sel.positions[s:e]
        h = sel.hidden2d.index_select(0, pos).to(plan.cdtype)
        gl = self.bufs.logits(h, w, b)
        # gl <- g * (onehot(y) - exp(logits - lse)), in place; targets outside this block add 0
        if self.fused:
            torch._softmax(gl, 1, False, out=gl)
        else:
            gl.sub_(self.lse[s:e].unsqueeze(1)).exp_()
        gl.mul_(-g)
        lab = sel.labels[s:e] - v0
        inside = (lab >= 0) & (lab < rows)
        gl.scatter_add_(1, lab.clamp(0, rows - 1).unsqueeze(1), g * inside.unsqueeze(1))
        if grads.b is not None:
            grads.b[v0 : v0 + rows] += gl.sum(dim=0)
        glc = self.bufs.lowp(gl, plan.cdtype)
        del gl
        if grads.h is not None:
            if grads.h_rows is None:
                grads.h.index_copy_(0, pos, (glc @ w).to(grads.h.dtype))
            else:
                _gemm.add_product(grads.h_rows[s:e], glc, w, plan.fast)
        if acc is not None:
            _gemm.add_product(acc, glc.t(), h, plan.fast)


def token_logprobs(hidden, weight, bias, target, ignore_index, token_chunk_size=None, sweep="eager"):
    """Per-token target log-probs of the non-ignored positions.

    Args:
        hidden: ``(B, L, H)`` (any strides) hidden states.
        weight: ``(V, H)`` LM-head weight.  bias: ``(V,)`` or ``None``.
        target: ``(B, L)`` integer labels; positions equal to ``ignore_index`` are skipped.

    Returns:
        ``(logp, rows, counts)``: ``logp`` fp32 (fp64 for fp64 inputs) ``(N,)`` (differentiable w.r.t.
        hidden/weight/bias when grad mode is on), ``rows`` int64 ``(N,)`` the batch row of every selected token,
        ``counts`` int64 ``(B,)`` the number of non-ignored tokens per row.
    """
    sel = _tokens.select_tokens(hidden, target, ignore_index)
    plan = Plan.of(hidden, weight, token_chunk_size, sweep, bias)
    return selected_logprobs(sel, weight, bias, plan), sel.rows, sel.counts


def sequence_logprob_sums(hidden, weight, bias, target, ignore_index=-100, token_chunk_size=None, sweep="eager"):
    """``(B,)`` per-row sums of the non-ignored tokens' target log-probs (fp32; fp64 for fp64 inputs), never more than
    a ``(chunk, V)`` block of logits at a time; differentiable when grad mode is on (see :func:`token_logprobs`)."""
    logp, rows, _ = token_logprobs(hidden, weight, bias, target, ignore_index, token_chunk_size, sweep)
    return _tokens.sequence_sums(logp, rows, target.shape[0])


def selected_logprobs(sel: Selection, weight, bias, plan: Plan):
    """The log-probs of ``sel``'s tokens: differentiable when a gradient is needed, else one GEMM per token."""
    if needs_grad(sel.hidden2d, weight, bias):
        return TokenLogProbs.apply(sel.hidden2d, weight, bias, sel, plan)
    with torch.no_grad(), no_autocast(sel.hidden2d.device):
        return forward_chunks(sel, weight, bias, plan)[0]

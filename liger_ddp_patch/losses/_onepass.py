"""One pass over the head: the loss gradients are formed while each chunk's logits are still in memory.

A DPO pair's loss (a KTO row's) depends only on that pair's per-sequence log-probs and on batch constants known
before the policy pass (reference log-probs, KTO's detached ``kl``, the number of pairs, the chosen-token count of
the NLL term).  So when a token chunk holds *whole* groups (pairs, rows), the chunk's per-sequence sums are
complete once its logits are, and with them ``dL/dS_row`` (``S`` = raw per-row sum of token log-probs):

    grad_logits[t] = dL/dS[row(t)] * (onehot(y_t) - softmax(logits_t))

is formed in place of the logits, multiplied into grad-input and the weight gradient, and the logits are dropped:
three GEMMs and one elementwise sweep per policy token instead of four GEMMs and two sweeps (the two-pass core in
``_core`` recomputes the logits in its backward).  ``dL/dS`` comes from plain autograd on the small ``(B,)``
tensor of sums (the loss formula, evaluated on the sums known so far; rows of later groups hold 0 and cannot reach
this group's derivative because the loss is a sum over groups).  The backward only scales the stored gradients.

Memory: the same token budget as the two-pass core; grad-input (the size of the hidden states) and the weight /
bias gradients live from the forward to the backward, no logits do.  In half precision the weight gradient is the
result itself, updated in place by one GEMM per token chunk (``addmm_``: fp32 accumulation inside the GEMM, one
rounding to the half dtype per chunk; Liger rounds its bf16 accumulator once per *pair*); no ``(V, H)``-sized
temporary is made.  Under autocast (fp32 weight, half GEMMs) the fp32 result is updated one vocabulary block at a
time (``_core.vocab_block_rows``), so the half-precision product tile is block-sized.

When it applies: a gradient is needed and every group fits one token chunk.  All ten DPO loss types and KTO are sums
over groups (``dpo.ONE_PASS_DPO_LOSS_TYPES``).  A group longer than the chunk keeps the two-pass path: its rows'
``dL/dS`` is not known before its last token, and deferring the weight gradient would need one ``(V, H)``
accumulator per pending row (at the CPU budget, fp32 / bf16 at V = 32,000: pairs of more than 1,048 / 699 loss
tokens; on an accelerator with an fp32-output GEMM at V = 151,936: more than 1,766).

Not supported (clear errors): double backward.  ``retain_graph`` works: a second backward recomputes the gradients
with the two-pass core from the saved inputs (exact, no extra memory kept).
"""

from __future__ import annotations

import torch

from . import _core

__all__ = ["group_chunks", "OnePassLoss"]


def group_chunks(rows: torch.Tensor, group_of_row: torch.Tensor, chunk: int):
    """Token order and chunk bounds such that every chunk holds whole groups and at most ``chunk`` tokens.

    Returns ``(order, bounds)``: ``order`` permutes the selected tokens so that each group's tokens are contiguous
    (within a group: row by row, in position order), ``bounds`` lists ``(start, end)`` in that order; ``None`` when
    one group alone has more than ``chunk`` tokens (the caller then keeps the two-pass path).
    """
    grp = group_of_row.index_select(0, rows)
    order = torch.argsort(grp, stable=True)
    sizes = torch.bincount(grp, minlength=int(group_of_row.max()) + 1 if group_of_row.numel() else 0).tolist()
    if sizes and max(sizes) > chunk:
        return None
    bounds, start, size = [], 0, 0
    for s in sizes:
        if size + s > chunk:
            bounds.append((start, start + size))
            start, size = start + size, 0
        size += s
    if size:
        bounds.append((start, start + size))
    return order, bounds


def _d_loss_d_sums(loss_of_sums, sums: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        s = sums.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(loss_of_sums(s), s, allow_unused=True)
    return torch.zeros_like(sums) if grad is None else grad


def _weight_grad_update(grad_w, glc, h, block, fast):
    """``grad_w += glc.T @ h``.  Same dtypes (fp32, or a half-precision result): one in-place GEMM, which accumulates
    in fp32 and rounds the result once per token chunk (no tile, no product).  An fp32 result with half GEMM inputs
    (autocast): one vocabulary block at a time, so a product tile is block-sized."""
    if glc.dtype == grad_w.dtype:
        grad_w.addmm_(glc.t(), h)
        return
    for v0 in range(0, grad_w.shape[0], block):
        v1 = min(grad_w.shape[0], v0 + block)
        _core._add_product(grad_w[v0:v1], glc[:, v0:v1].t(), h, fast)


class OnePassLoss(torch.autograd.Function):
    """``(loss, S)`` of a group-separable loss of the per-row sums ``S``; gradients made in the forward.

    ``loss_of_sums(S) -> scalar`` must be a sum over groups of terms that each read only their own rows of ``S``
    (DPO: a pair = rows ``i`` and ``i + P``; KTO: a row).  ``S`` is returned without gradient.
    """

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, positions, labels, rows, order, bounds, batch, loss_of_sums, cfg):
        chunk, cdtype, budget = cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with _core._no_autocast(hidden2d.device):
            out = _one_pass(
                hidden2d, weight, bias, positions, labels, rows, order, bounds, batch, loss_of_sums, cdtype, budget,
                (need_h, need_w, need_b),
            )  # fmt: skip
        loss, sums, grads, pos_p, lab_p, lse_p, g_tok = out
        ctx.grads = grads
        ctx.cfg = cfg
        ctx.has_bias = bias is not None
        ctx.save_for_backward(hidden2d, weight, bias if bias is not None else weight.new_empty(0), pos_p, lab_p, lse_p)
        ctx.g_tok = g_tok
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through ChunkedDPOLoss/ChunkedKTOLoss is not supported: their "
                "gradients are computed without building a graph; backward once, without create_graph"
            )
        grads, ctx.grads = ctx.grads, None  # hand the tensors over (no copy into .grad)
        if grads is None:  # a second backward (retain_graph=True): recompute with the two-pass core
            hidden2d, weight, bias, pos_p, lab_p, lse_p = ctx.saved_tensors
            chunk, cdtype, budget = ctx.cfg
            with _core._no_autocast(hidden2d.device):
                grads = _core._backward_chunks(
                    hidden2d, weight, bias if ctx.has_bias else None, pos_p, lab_p, lse_p, ctx.g_tok,
                    chunk, cdtype, budget, ctx.needs_input_grad[:3],
                )  # fmt: skip
        if not bool(grad_loss == 1):
            grads = tuple(None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads)
        return (*grads, None, None, None, None, None, None, None, None)


def _one_pass(
    hidden2d, weight, bias, positions, labels, rows, order, bounds, batch, loss_of_sums, cdtype, budget, needs
):
    need_h, need_w, need_b = needs
    V, H = weight.shape
    device = hidden2d.device
    mdtype = _core._math_dtype(cdtype)
    fast = _core._fp32_out(device, cdtype)
    pos_p, lab_p, rows_p = positions[order], labels[order], rows[order]
    n = pos_p.numel()
    sums = torch.zeros(batch, dtype=torch.float32, device=device)  # fp32, as the two-pass log-probs
    lse_p = torch.empty(n, dtype=mdtype, device=device)
    g_tok = torch.zeros(n, dtype=mdtype, device=device)
    grad_h = torch.zeros_like(hidden2d) if need_h else None
    grad_w = torch.empty_like(weight) if need_w else None  # the result: the only (V, H) tensor made here
    grad_b = torch.zeros(V, dtype=mdtype, device=device) if need_b else None
    w = weight.to(cdtype)
    block = _core.vocab_block_rows(V, H, budget) if need_w and grad_w.dtype != cdtype else V
    bufs = _core.LogitsBuffers(max((e - s for s, e in bounds), default=0), V, cdtype, device, fast)
    w_written = False  # grad_w is written by the first chunk's GEMM (no zero-fill pass) unless blocks add into it
    for s, e in bounds:
        pos, lab, r = pos_p[s:e], lab_p[s:e].unsqueeze(1), rows_p[s:e]
        h = hidden2d.index_select(0, pos).to(cdtype)
        logits = bufs.logits(h, w, bias)
        logp, lse_p[s:e], scale = _core.softmax_(logits, lab)  # logits <- softmax / scale, in place
        sums.index_add_(0, r, logp.float())
        g = _d_loss_d_sums(loss_of_sums, sums).to(mdtype).index_select(0, r)  # this chunk's rows are complete
        g_tok[s:e] = g
        # logits <- g * (onehot(y) - softmax), in place
        logits.mul_((-g if scale is None else -g * scale.to(mdtype)).unsqueeze(1))
        logits.scatter_add_(1, lab, g.unsqueeze(1).to(logits.dtype))
        if need_b:
            grad_b += logits.sum(dim=0)
        glc = bufs.lowp(logits, cdtype)
        del logits
        if need_h:
            gh = torch.mm(glc, w, out_dtype=torch.float32) if fast else glc @ w
            grad_h.index_copy_(0, pos, gh.to(grad_h.dtype))
            del gh
        if need_w:
            if not w_written and glc.dtype == grad_w.dtype:
                torch.mm(glc.t(), h, out=grad_w)
            else:
                if not w_written:
                    grad_w.zero_()
                _weight_grad_update(grad_w, glc, h, block, fast)
            w_written = True
        del glc
    if need_w and not w_written:
        grad_w.zero_()
    with torch.no_grad():
        loss = loss_of_sums(sums)
    grads = (grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype))
    return loss, sums, grads, pos_p, lab_p, lse_p, g_tok

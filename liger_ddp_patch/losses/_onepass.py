"""One pass over the head: the loss gradients are formed while each chunk's logits are still in memory.

A DPO pair's loss (a KTO row's) depends only on that pair's per-sequence log-probs and on batch constants known
before the policy pass (reference log-probs, KTO's detached ``kl``, the number of pairs, the chosen-token count of
the NLL term).  So once a group's (pair's, row's) last token has been through the head, its per-row sums ``S``
are complete, and with them ``a = dL/dS_row`` (plain autograd on the small ``(B,)`` tensor of sums; rows of
later groups hold 0 and cannot reach this group's derivative because the loss is a sum over groups):

    grad_logits[t] = a[row(t)] * (onehot(y_t) - softmax(logits_t))

is formed in place of the logits (fp32: the softmax, the target entry set to ``expm1(logp)``, one scaling
sweep, one cast to the compute dtype), multiplied into grad-input and the weight gradient, and dropped: three
GEMMs per policy token, against four in the two-pass core (``_core``, whose backward recomputes the logits and
sweeps them again).  The backward only scales the stored gradients.

Groups that fit a token chunk are packed whole into chunks.  A group longer than the chunk (a long pair) is split
over consecutive chunks; until its last chunk its rows' ``a`` is unknown, so those chunks use ``a = 1`` and add
``grad_logits.T @ h`` into one ``(V, H)`` sum per row, scaled by the true ``a`` and added to the weight gradient
when the group ends (likewise the bias and the ``(tokens, H)`` grad-input rows).  Two choices keep those sums
few: the last chunk of a long group takes its last rows whole when they fit (they need no sum: a pair whose rows
each fit a chunk keeps one, for its chosen row), and long groups go first, so that the first one's first sum is
the weight gradient itself.  Extra ``(V, H)`` tensors, reused from one long group to the next: DPO with rows that
fit a chunk 0 for the first long pair, 1 from the second; with longer rows 1, then 2; KTO 0, then 1; none with a
frozen head (LoRA).

Memory: the same token budget as the two-pass core; grad-input (the size of the hidden states) and the weight /
bias gradients live from the forward to the backward, no logits do.  In half precision the weight gradient is the
result itself, updated in place by one GEMM per token chunk (``addmm_``: fp32 accumulation inside the GEMM, one
rounding to the half dtype per chunk; Liger rounds its bf16 accumulator once per *pair*).  Under autocast (fp32
weight, half GEMMs) the fp32 result is updated one vocabulary block at a time (``_core.vocab_block_rows``).

It applies whenever a gradient is needed (all ten DPO loss types and KTO are sums over groups:
``dpo.ONE_PASS_DPO_LOSS_TYPES``); ``one_pass=False`` forces the two-pass path.  Not supported (clear
error): double backward.  ``retain_graph`` works: a second backward recomputes the gradients with the two-pass
core from the saved inputs (exact, no extra memory kept).
"""

from __future__ import annotations

import torch

from . import _core

__all__ = ["group_chunks", "OnePassLoss"]


def group_chunks(rows: torch.Tensor, group_of_row: torch.Tensor, counts: torch.Tensor, chunk: int):
    """Token order and chunk plan: ``(order, plan)``.

    ``order`` permutes the selected tokens (``rows``: their batch rows, row-major) so that each group's tokens are
    contiguous, row by row; groups longer than ``chunk`` first.  ``plan`` lists ``(start, end, pending, finish)``
    in that order: ``pending`` is ``None`` for a chunk of complete groups, else the ``(a, b, row)`` segments of a
    long group whose end comes later; ``finish`` lists the pending segments of the long group this chunk ends
    (whose last tokens open it; complete groups may follow them in it).
    """
    grp_of_row, cnt = group_of_row.tolist(), counts.tolist()
    members: dict[int, list[tuple[int, int]]] = {}
    for r, (g, c) in enumerate(zip(grp_of_row, cnt)):
        if c:
            members.setdefault(g, []).append((r, c))
    size = {g: sum(c for _, c in m) for g, m in members.items()}
    ranked = sorted(members, key=lambda g: (size[g] <= chunk, g))
    rank = torch.full((max(grp_of_row, default=-1) + 1,), len(ranked), dtype=torch.long)
    rank[ranked] = torch.arange(len(ranked))
    order = torch.argsort(rank.to(rows.device)[group_of_row.index_select(0, rows)], stable=True)

    plan, start, end, finish = [], 0, 0, []  # the open chunk of complete groups: [start, end), ending ``finish``
    for g in ranked:
        n = size[g]
        if n > chunk or end + n - start > chunk:
            if end > start:
                plan.append((start, end, None, finish))
            start, finish = end, []
        if n > chunk:
            tail = _tail(members[g], n, chunk)
            segs = _segments(members[g], end, end + n - tail)
            for s in range(end, end + n - tail, chunk):
                e = min(s + chunk, end + n - tail)
                plan.append((s, e, [(max(a, s), min(b, e), r) for a, b, r in segs if a < e and b > s], []))
            start, finish = end + n - tail, segs
        end += n
    if end > start:
        plan.append((start, end, None, finish))
    return order, plan


def _tail(members, n, chunk):
    """Tokens of a long group that go into its last chunk: its last rows when they fit whole (those rows then need
    no accumulator: a DPO pair of two rows that each fit a chunk holds one, for the chosen row), else the rest."""
    tail = 0
    for _, c in reversed(members):
        if tail + c > chunk:
            break
        tail += c
    return tail or (n - 1) % chunk + 1


def _segments(members, a, b):
    """``(start, end, row)`` of each row's tokens within ``[a, b)`` of a group laid out row by row from ``a``."""
    out, s = [], a
    for r, c in members:
        if s >= b:
            break
        out.append((s, min(b, s + c), r))
        s += c
    return out


def _d_loss_d_sums(loss_of_sums, sums: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        s = sums.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(loss_of_sums(s), s, allow_unused=True)
    return torch.zeros_like(sums) if grad is None else grad


class _Accumulator:
    """A ``(V, H)`` gradient sum ``+= q.T @ h``: written by the first GEMM (no zero-fill pass) where the dtypes
    allow.  Same dtypes (fp32, or a half-precision result): one in-place GEMM, fp32 accumulation inside it and one
    rounding per chunk.  An fp32 sum with half GEMM inputs (autocast): one vocabulary block at a time."""

    def __init__(self, tensor, block, fast):
        self.t, self.block, self.fast, self.written = tensor, block, fast, False

    def add(self, q, h):
        if q.dtype == self.t.dtype:
            if self.written:
                self.t.addmm_(q.t(), h)
            else:
                torch.mm(q.t(), h, out=self.t)
            self.written = True
            return
        if not self.written:
            self.t.zero_()
            self.written = True
        for v0 in range(0, self.t.shape[0], self.block):
            v1 = min(self.t.shape[0], v0 + self.block)
            _core._add_product(self.t[v0:v1], q[:, v0:v1].t(), h, self.fast)

    def result(self):
        return self.t if self.written else self.t.zero_()


def _softmax_minus_onehot_(logits, lab):
    """In place, in fp32: ``logits`` -> ``(softmax - onehot) / k`` per row; returns the target log-probs, the
    log-sum-exps and ``k`` (None: 1; the row scale of the non-fused softmax, for the caller to fold in).  The
    target entry is set to ``expm1(logp)``: no cancellation."""
    logp, lse, k = _core.softmax_(logits, lab)  # CPU: logits <- softmax; else exp(x - max), softmax = logits * k
    tgt = torch.expm1(logp)
    logits.scatter_(1, lab, (tgt if k is None else tgt / k).unsqueeze(1).to(logits.dtype))
    return logp, lse, k


class OnePassLoss(torch.autograd.Function):
    """``(loss, S)`` of a group-separable loss of the per-row sums ``S``; gradients made in the forward.

    ``loss_of_sums(S) -> scalar`` must be a sum over groups of terms that each read only their own rows of ``S``
    (DPO: a pair = rows ``i`` and ``i + P``; KTO: a row).  ``S`` is returned without gradient.
    """

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, positions, labels, rows, order, plan, batch, loss_of_sums, cfg):
        chunk, cdtype, budget = cfg
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        with _core._no_autocast(hidden2d.device):
            out = _one_pass(
                hidden2d, weight, bias, positions, labels, rows, order, plan, batch, loss_of_sums, cdtype, budget,
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


def _one_pass(hidden2d, weight, bias, positions, labels, rows, order, plan, batch, loss_of_sums, cdtype, budget, needs):
    need_h, need_w, need_b = needs
    V, H = weight.shape
    device = hidden2d.device
    mdtype = _core._math_dtype(cdtype)
    fast = _core._fp32_out(device, cdtype)
    pos_p, lab_p, rows_p = positions[order], labels[order], rows[order]
    n = pos_p.numel()
    sums = torch.zeros(batch, dtype=torch.float32, device=device)  # fp32, as the two-pass log-probs
    lse_p = torch.empty(n, dtype=mdtype, device=device)
    g_tok = torch.zeros(n, dtype=mdtype, device=device)  # dL/dS of each token's row (a second backward reads it)
    grad_h = torch.zeros_like(hidden2d) if need_h else None
    grad_b = torch.zeros(V, dtype=mdtype, device=device) if need_b else None
    w = weight.to(cdtype)
    block = _core.vocab_block_rows(V, H, budget) if need_w and weight.dtype != cdtype else V
    grad_w = _Accumulator(torch.empty_like(weight), block, fast) if need_w else None  # the result
    long = _LongGroups(grad_w)
    bufs = _core.LogitsBuffers(max((e - s for s, e, *_ in plan), default=0), V, cdtype, device, fast)
    for s, e, pending, finish in plan:
        pos, lab, r = pos_p[s:e], lab_p[s:e].unsqueeze(1), rows_p[s:e]
        h = hidden2d.index_select(0, pos).to(cdtype)
        gl = bufs.logits(h, w, bias)
        logp, lse_p[s:e], k = _softmax_minus_onehot_(gl, lab)
        sums.index_add_(0, r, logp.float())
        if pending is None:  # every row here is complete: its factor is known
            g = _d_loss_d_sums(loss_of_sums, sums).to(mdtype)
            g_tok[s:e] = g.index_select(0, r)
            if finish:
                long.finish(finish, g, g_tok, pos_p, grad_h, grad_b)
            mult = -g_tok[s:e]
        else:  # a long group's rows: factor -1 until it ends
            mult = torch.full((e - s,), -1.0, dtype=mdtype, device=device)
        # gl <- mult * (softmax - onehot) = grad_logits, in fp32 (one sweep), then one cast to the compute dtype
        # (half-precision mul(out=), scatter_ and exp(out=) are slow paths on CPU: 28-56 ms per 699 x 32,000
        # block against 2-9 ms in fp32 plus a 6-10 ms cast)
        gl.mul_((mult if k is None else mult * k).unsqueeze(1))
        glc = bufs.lowp(gl, cdtype)
        gh = None
        if need_h:
            gh = torch.mm(glc, w, out_dtype=torch.float32) if fast else glc @ w
        if pending is not None:
            long.add(pending, s, e, glc, gl if need_b else None, h if need_w else None, gh)
            continue
        if need_h:
            grad_h.index_copy_(0, pos, gh.to(grad_h.dtype))
        if need_w:
            grad_w.add(glc, h)
        if need_b:
            grad_b += gl.sum(dim=0)
        del gl, glc, gh
    with torch.no_grad():
        loss = loss_of_sums(sums)
    grads = (grad_h, None if grad_w is None else grad_w.result(), None if grad_b is None else grad_b.to(bias.dtype))
    return loss, sums, grads, pos_p, lab_p, lse_p, g_tok


class _LongGroups:
    """What the chunks of a long group add before its rows' factors are known: one weight-gradient sum and one bias
    sum per row, and the grad-input rows; scaled and added to the results when the group ends.  The first long
    group's first row sums into the (still unwritten) weight gradient itself; the other sums are reused."""

    def __init__(self, grad_w):
        self.grad_w, self.spare, self.w, self.b, self.h = grad_w, [], {}, {}, []

    def add(self, segments, s, e, glc, gl, h, gh):
        """A pending chunk ``[s, e)``: its gradient block in the compute dtype (``glc``) and fp32 (``gl``, for the
        bias), hidden states and grad-input rows, all with the row factor -1 (or the softmax scale) only."""
        for a, b, r in segments:
            if h is not None:
                self._sum(r).add(glc[a - s : b - s], h[a - s : b - s])
            if gl is not None:
                self.b.setdefault(r, gl.new_zeros(gl.shape[1])).add_(gl[a - s : b - s].sum(dim=0))
        if gh is not None:
            self.h.append((s, e, gh.float() if gh.dtype.itemsize < 4 else gh))

    def _sum(self, row):
        if row not in self.w:
            if not self.grad_w.written:  # long groups go first: only the first one's first row finds it so
                self.w[row] = self.grad_w
            elif self.spare:
                self.w[row] = self.spare.pop()
            else:
                self.w[row] = _Accumulator(torch.empty_like(self.grad_w.t), self.grad_w.block, self.grad_w.fast)
        return self.w[row]

    def finish(self, segments, g, g_tok, pos_p, grad_h, grad_b):
        """The group ended: ``g`` holds its rows' factors."""
        for a, b, r in segments:
            g_tok[a:b] = g[r]
        result = self.grad_w
        for r, p in self.w.items():  # the result itself may hold a row's sum: scale it before adding the others
            if p is result:
                result.t.mul_(g[r].to(result.t.dtype))
        for r, p in self.w.items():
            if p is result:
                continue
            result.t.add_(p.t, alpha=g[r].item())  # one pass over (V, H); one host sync per long group
            p.written = False
            self.spare.append(p)
        for r, bias_sum in self.b.items():
            grad_b.add_(bias_sum * g[r])
        for s, e, gh in self.h:
            grad_h.index_copy_(0, pos_p[s:e], (gh * g_tok[s:e].unsqueeze(1)).to(grad_h.dtype))
        self.w, self.b, self.h = {}, {}, []

"""One pass over the head: the loss gradients are formed while each chunk's logits are still in memory.

The base (``_base``) builds every loss as a sum of per-group terms, each a function of its own group's per-row sums
``S`` (a DPO pair: rows ``i`` and ``i + P``; a KTO row) and of batch constants known before the policy pass
(reference log-probs, KTO's detached ``kl``, the number of pairs, the chosen-token count of the NLL term).  So once
a group's last token has been through the head, its sums are complete, and with them ``a = dL/dS_row`` of its rows
(plain autograd on that group's term alone):

    grad_logits[t] = a[row(t)] * (onehot(y_t) - softmax(logits_t))

is formed in place of the logits (fp32: the softmax, the target entry set to ``expm1(logp)``, one scaling sweep,
one cast to the compute dtype), multiplied into grad-input and the weight gradient, and dropped: three GEMMs per
policy token, against four on the two-pass path (``_twopass``).  The backward only scales the stored gradients
(in fp16 they are stored at GradScaler's scale, :class:`LossScale`).

Groups that fit a token chunk are packed whole into chunks.  A group longer than the chunk (a long pair) is split
over consecutive chunks; until its last chunk its rows' ``a`` is unknown, so those chunks use ``a = 1`` and add
``grad_logits.T @ h`` into one ``(V, H)`` sum per row, scaled by the true ``a`` and added to the weight gradient
when the group ends (likewise the bias and the ``(tokens, H)`` grad-input rows).  Two choices keep those sums
few: the last chunk of a long group takes its last rows whole when they fit (they need no sum: a pair whose rows
each fit a chunk keeps one, for its chosen row), and long groups go first, so that the first one's first sum is
the weight gradient itself.  Extra ``(V, H)`` tensors, reused from one long group to the next: DPO with rows that
fit a chunk 0 for the first long pair, 1 from the second; with longer rows 1, then 2; KTO 0, then 1; none with a
frozen head (LoRA).  They live during the forward only, beside the weight gradient; by default the base
(``_base``), where they and a cast weight would exceed ``_plan.held_budget_bytes``, widens the chunk to the
longest row or group when that needs no sum and holds less (``ChunkedLinearLoss.widened``), and takes the two-pass
path where even that would exceed it (:func:`extra_sums` counts the sums from the plan); ``one_pass=False``
(``LIGER_DDP_PATCH_LOSS=one_pass=0``) always avoids them, ``one_pass=True`` always takes them.

Memory: the same token budget as the two-pass path; grad-input (the size of the hidden states) and the weight /
bias gradients live from the forward to the backward, no logits do.  The saved inputs (``hidden2d``, the selected
positions, one log-sum-exp and one factor per token) are kept as well, only so that a second backward
(``retain_graph=True``) can recompute the gradients with the two-pass path: with the stored gradients they set this
path's peak.  In half precision the weight gradient is the result itself, updated in place by one GEMM per token
chunk (``addmm_``: fp32 accumulation inside the GEMM, one rounding to the half dtype per chunk; Liger rounds its
bf16 accumulator once per *pair*).  Under autocast (fp32 weight, half GEMMs) the fp32 result is updated one
vocabulary block at a time (``_plan.vocab_block_rows``).  Not supported (clear error): double backward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _gemm, _twopass
from ._gemm import LogitsBuffers
from ._plan import Plan, no_autocast
from ._softmax import softmax_
from ._tokens import Selection

__all__ = ["Chunk", "LossScale", "OnePassLoss", "extra_sums", "group_chunks", "scale_of"]


class LossScale:
    """fp16: the power of two at which the one-pass forward stores the gradients it forms (issue 31).

    fp16 keeps magnitudes ~6e-5 to 65504 (subnormals down to 6e-8, with fewer bits), and a loss's gradients are
    small (a row's factor ``a = dL/dS`` ~ beta / B, times softmax entries ~1 / V): GradScaler multiplies the loss by
    a scale (2**16 at first, halved on overflow) which the backward receives as its incoming gradient.  The one-pass
    forward runs before that scale exists; at scale 1 it flushed 94,195 weight-gradient entries to zero at
    V = 151,936, H = 16 (the two-pass path: 9; Liger 0.8.5 as we did: 91,425).  So in fp16 it stores them at ``value``
    times their size -- ``value``: the incoming gradient of the same loss object's previous fp16 one-pass backward
    (one scale per loss, :func:`scale_of`) rounded down to a power of two (GradScaler's scale; its initial 2**16
    before the first) -- and the backward multiplies by
    ``grad_output / value``, a power of two under GradScaler: exact.  A long group's sums (its factor unknown until
    it ends) are stored at ``value * factor``, ``factor`` the largest row factor of the previous call.  Where the
    stored gradients are not all finite (GradScaler just halved its scale, or this batch's gradients are larger),
    the backward recomputes them from ``grad_output`` as the two-pass path does: only time is lost.

    Chosen over sending fp16 to the two-pass path, measured (``tests/test_losses_precision.py``, an fp64 truth,
    scale 2**13): both at the two-pass path's error on the non-target rows, 2.9e-4 (a long pair's sums, rounded
    twice more: 4.8e-4), and this keeps the one-pass path's three GEMMs per token instead of four (0.77x the
    two-pass time on a GPU, ``benchmarks/README.md``).  bf16, fp32 and fp64 have fp32's exponent range: their
    gradients are stored at scale 1, as before."""

    INITIAL = 2.0**16
    # about a DPO pair's beta / (2 P) at beta = 0.1, P = 4 (KTO: beta / (4 B), B = 2), rounded down
    INITIAL_FACTOR = 2.0**-7
    LIMIT = 2.0**64  # a grad_output of 0, inf or beyond this leaves the value as it is

    def __init__(self):
        self.value, self.factor = self.INITIAL, self.INITIAL_FACTOR

    def of(self, plan: Plan) -> float | None:
        """The scale a forward of ``plan`` stores its gradients at; None: as they are (not fp16)."""
        return self.value if plan.cdtype == torch.float16 else None

    def saw_factors(self, largest: float) -> None:
        """Follow the largest row factor ``|dL/dS|`` of an fp16 one-pass forward (the next one's long groups)."""
        if 1.0 / self.LIMIT <= largest <= self.LIMIT:
            self.factor = 2.0 ** math.floor(math.log2(largest))

    def saw(self, grad_output: float) -> None:
        """Follow the incoming gradient of an fp16 one-pass backward (GradScaler's current scale)."""
        g = abs(grad_output)
        if 1.0 / self.LIMIT <= g <= self.LIMIT:
            self.value = 2.0 ** math.floor(math.log2(g))


def scale_of(owner) -> LossScale:
    """The :class:`LossScale` of ``owner`` (a loss object), made at its first call: each loss follows the GradScaler
    of the job it is trained in, so a second fp16 run in the process (another trainer, another loss) never starts
    from the first's scale, and two losses never move one scale."""
    scale = vars(owner).get("_liger_ddp_patch_loss_scale")
    if scale is None:
        scale = vars(owner)["_liger_ddp_patch_loss_scale"] = LossScale()
    return scale


class Chunk(NamedTuple):
    """Tokens ``[start, end)`` of the group-ordered tokens.  ``pending``: ``None`` for a chunk of complete groups,
    else the ``(a, b, row)`` segments of a long group whose end comes later; ``finish``: the pending segments of the
    long group this chunk ends (whose last tokens open it); ``groups``: the groups whose last token is here."""

    start: int
    end: int
    pending: list | None
    finish: list
    groups: tuple = ()


def group_chunks(rows: torch.Tensor, group_of_row: torch.Tensor, counts: torch.Tensor, chunk: int):
    """Token order and chunk plan: ``(order, chunks)``.

    ``order`` permutes the selected tokens (``rows``: their batch rows, row-major) so that each group's tokens are
    contiguous, row by row; groups longer than ``chunk`` first.  ``chunks`` lists the :class:`Chunk` in that order.
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

    plan, start, end, finish, done = [], 0, 0, [], []  # the open chunk of complete groups: [start, end)
    for g in ranked:
        n = size[g]
        if n > chunk or end + n - start > chunk:
            if end > start:
                plan.append(Chunk(start, end, None, finish, tuple(done)))
            start, finish, done = end, [], []
        if n > chunk:
            tail = _tail(members[g], n, chunk)
            segs = _segments(members[g], end, end + n - tail)
            for s in range(end, end + n - tail, chunk):
                e = min(s + chunk, end + n - tail)
                plan.append(Chunk(s, e, [(max(a, s), min(b, e), r) for a, b, r in segs if a < e and b > s], []))
            start, finish = end + n - tail, segs
        done.append(g)
        end += n
    if end > start:
        plan.append(Chunk(start, end, None, finish, tuple(done)))
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


def extra_sums(chunks, need_w: bool = True) -> int:
    """How many ``(V, H)`` sums beside the weight gradient the plan ``chunks`` of :func:`group_chunks` holds at once
    (as :class:`_LongGroups` takes them): the first long group's first row sums into the unwritten weight gradient,
    every other row of a long group needs its own, reused from one long group to the next; none without ``need_w``."""
    if not need_w:
        return 0
    most, rows, first = 0, [], True
    for c in chunks:
        if c.pending is not None:
            rows += [r for _, _, r in c.pending if r not in rows]
        elif rows:  # the chunk that ends the open long group
            most, rows, first = max(most, len(rows) - first), [], False
        else:
            first = False  # a chunk of complete groups wrote the weight gradient
    return max(most, len(rows) - first) if rows else most


class _Accumulator:
    """A ``(V, H)`` gradient sum ``+= q.T @ h``: written by the first GEMM (no zero-fill pass) where the dtypes
    allow.  Same dtypes (fp32, or a half-precision result): one in-place GEMM, fp32 accumulation inside it and one
    rounding per chunk.  An fp32 sum with half GEMM inputs (autocast): one vocabulary block at a time."""

    def __init__(self, tensor, block, fast):
        self.t, self.block, self.fast, self.written = tensor, block, fast, False

    def like(self):
        """A fresh, unwritten sum of the same shape and dtype."""
        return _Accumulator(torch.empty_like(self.t), self.block, self.fast)

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
            _gemm.add_product(self.t[v0:v1], q[:, v0:v1].t(), h, self.fast)

    def scale_into(self, result, factor):
        """``result += factor * self``, and ``self`` is unwritten again (reusable)."""
        result.t.add_(self.t, alpha=factor.item())  # one pass over (V, H); one host sync per long group
        self.written = False

    def result(self):
        return self.t if self.written else self.t.zero_()


def _softmax_minus_onehot_(logits, lab):
    """In place, in fp32: ``logits`` -> ``(softmax - onehot) / k`` per row; returns the target log-probs, the
    log-sum-exps and ``k`` (None: 1; the row scale of the non-fused softmax, for the caller to fold in).  The
    target entry is set to ``expm1(logp)``: no cancellation."""
    logp, lse, k = softmax_(logits, lab)  # CPU: logits <- softmax; else exp(x - max), softmax = logits * k
    tgt = torch.expm1(logp)
    logits.scatter_(1, lab, (tgt if k is None else tgt / k).unsqueeze(1).to(logits.dtype))
    return logp, lse, k


class OnePassLoss(torch.autograd.Function):
    """``(loss, S)`` of a per-group loss of the per-row sums ``S``; gradients made in the forward.

    ``grouped`` is the base's sum over groups: ``grouped(S)`` the loss, ``grouped.gradient(S, groups)`` the
    derivative of the named groups' terms (each reads only its own rows).  ``S`` is returned without gradient.
    """

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, sel: Selection, plan: Plan, schedule, grouped, scales: LossScale):
        run = _Run(sel, weight, bias, plan, schedule, ctx.needs_input_grad[:3], scales)
        with no_autocast(hidden2d.device):
            for chunk in schedule[1]:
                run.chunk(chunk, grouped)
            with torch.no_grad():
                loss = grouped(run.sums)
        ctx.grads, ctx.plan, ctx.has_bias, ctx.scale = run.results(bias), plan, bias is not None, run.scale
        ctx.scales = scales
        if run.largest is not None:  # fp16
            scales.saw_factors(float(run.largest))
        ctx.sel = run.ordered._replace(hidden2d=None)  # the integer index tensors; hidden2d is saved below
        ctx.save_for_backward(hidden2d, weight, bias if bias is not None else weight.new_empty(0), run.lse, run.g_tok)
        ctx.mark_non_differentiable(run.sums)
        return loss, run.sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "double backward (create_graph=True) through ChunkedDPOLoss/ChunkedKTOLoss is not supported: their "
                "gradients are computed without building a graph; backward once, without create_graph"
            )
        grads, ctx.grads = ctx.grads, None  # hand the tensors over (no copy into .grad)
        factor = float(grad_loss)  # a Python float: a half-precision gradient is scaled in fp32, rounded once
        if ctx.scale is not None:  # fp16: stored at the loss's LossScale value
            ctx.scales.saw(factor)
            if grads is not None and not _finite(grads):
                grads = None  # overflowed at that scale: recompute as the two-pass path would, below
        if grads is None:  # a second backward (retain_graph=True), or fp16 overflow: recompute with the two-pass path
            hidden2d, weight, bias, lse, g_tok = ctx.saved_tensors
            if ctx.scale is not None:  # fp16: form them at the incoming scale, as the two-pass path does
                g_tok, factor = g_tok * factor, 1.0
            with no_autocast(hidden2d.device):
                grads = _twopass.backward_chunks(
                    ctx.sel._replace(hidden2d=hidden2d), weight, bias if ctx.has_bias else None, lse, g_tok,
                    ctx.plan, ctx.needs_input_grad[:3],
                )  # fmt: skip
        elif ctx.scale is not None:
            factor /= ctx.scale  # a power of two: exact
        if factor != 1.0:
            grads = tuple(None if g is None else g.mul_(factor) for g in grads)
        return (*grads, None, None, None, None, None)


def _finite(grads) -> bool:
    """Whether every stored gradient is finite: one fp32 sum each (no tensor of their size; a sum of finite fp16
    entries cannot overflow fp32), one host sync."""
    sums = [g.sum(dtype=torch.float32) for g in grads if g is not None]
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())


class _Run:
    """The state of one forward: the group-ordered tokens, the per-row sums, and the gradients made so far, stored
    at ``scale`` times their size (``scales.of(plan)``, :class:`LossScale`; None: as they are, but in fp16)."""

    def __init__(self, sel: Selection, weight, bias, plan: Plan, schedule, needs, scales: LossScale):
        need_h, need_w, need_b = needs
        scale = scales.of(plan)
        order = schedule[0]
        V, device = weight.shape[0], sel.hidden2d.device
        self.ordered = sel._replace(positions=sel.positions[order], labels=sel.labels[order], rows=sel.rows[order])
        self.plan, self.bias, self.scale = plan, bias, scale
        # fp16: a long group's sums are stored at the scale times the previous call's largest row factor (its own is
        # not known until it ends), and their largest factor is recorded for the next call
        self.pending = 1.0 if scale is None else scale * scales.factor
        self.largest = None
        n = self.ordered.positions.numel()
        self.sums = torch.zeros(sel.counts.shape[0], dtype=plan.mdtype, device=device)  # as two-pass
        self.lse = torch.empty(n, dtype=plan.mdtype, device=device)
        self.g_tok = torch.zeros(n, dtype=plan.mdtype, device=device)  # dL/dS of each token's row
        self.grad_h = torch.zeros_like(sel.hidden2d) if need_h else None
        self.grad_b = torch.zeros(V, dtype=plan.mdtype, device=device) if need_b else None
        self.w = weight.to(plan.cdtype)
        block = plan.block_rows(weight) if weight.dtype != plan.cdtype else V
        self.grad_w = _Accumulator(torch.empty_like(weight), block, plan.fast) if need_w else None  # the result
        self.long = _LongGroups(self.grad_w)
        rows = max((c.end - c.start for c in schedule[1]), default=0)
        self.bufs = LogitsBuffers(rows, V, plan, device, half_only=plan.tiles)

    def chunk(self, c: Chunk, grouped):
        """Project tokens ``[c.start, c.end)``, form their gradients and add them (or hold them, if pending)."""
        s, e, plan, sel = c.start, c.end, self.plan, self.ordered
        pos, lab, r = sel.positions[s:e], sel.labels[s:e].unsqueeze(1), sel.rows[s:e]
        h = sel.hidden2d.index_select(0, pos).to(plan.cdtype)
        gl = self.bufs.logits(h, self.w, self.bias)
        if plan.rows is not None:  # one read now; the gradient below, once the factors are known (read, write)
            logp, self.lse[s:e] = plan.rows.row_lse(gl, lab)
            k = None
        else:
            logp, self.lse[s:e], k = _softmax_minus_onehot_(gl, lab)
        self.sums.index_add_(0, r, logp.to(self.sums.dtype))
        if c.pending is None:  # every group here is complete: its rows' factors are known
            g = grouped.gradient(self.sums, c.groups).to(plan.mdtype)
            if self.scale is not None:
                big = g.abs().max()
                self.largest = big if self.largest is None else torch.maximum(self.largest, big)
            self.g_tok[s:e] = g.index_select(0, r)
            if c.finish:
                self.long.finish(c.finish, g, self)
            mult = -self.g_tok[s:e] if self.scale is None else self.g_tok[s:e] * -self.scale
        else:  # a long group's rows: factor -1 until it ends
            mult = torch.full((e - s,), -self.pending, dtype=plan.mdtype, device=gl.device)
        # gl <- mult * (softmax - onehot) = grad_logits, in fp32 (one sweep), then one cast to the compute dtype
        # (half-precision mul(out=), scatter_ and exp(out=) are slow paths on CPU); Triton: both in one kernel;
        # tiles: both on one fp32 tile of rows at a time, from and into the half block
        if plan.rows is not None:
            glc = plan.rows.grad_(gl, lab, self.lse[s:e], logp, mult, self.bufs.lowp_out(gl, plan.cdtype))
        else:
            gl.mul_((mult if k is None else mult * k).unsqueeze(1))
            glc = self.bufs.lowp(gl, plan.cdtype)
        gh = None
        if self.grad_h is not None:
            gh = _gemm.mm_fp32(glc, self.w) if plan.fast else glc @ self.w
        if c.pending is not None:
            self.long.add(c.pending, s, e, glc, gl if self.grad_b is not None else None, h, gh)
            return
        if gh is not None:
            self.grad_h.index_copy_(0, pos, gh.to(self.grad_h.dtype))
        if self.grad_w is not None:
            self.grad_w.add(glc, h)
        if self.grad_b is not None:
            self.grad_b += gl.sum(dim=0)

    def results(self, bias):
        grad_w = None if self.grad_w is None else self.grad_w.result()
        return self.grad_h, grad_w, None if self.grad_b is None else self.grad_b.to(bias.dtype)


class _LongGroups:
    """What the chunks of a long group add before its rows' factors are known: one weight-gradient sum and one bias
    sum per row, and the grad-input rows; scaled and added to the results when the group ends.  The first long
    group's first row sums into the (still unwritten) weight gradient itself; the other sums are reused."""

    def __init__(self, grad_w: _Accumulator | None):
        self.grad_w, self.spare, self.w, self.b, self.h = grad_w, [], {}, {}, []

    def add(self, segments, s, e, glc, gl, h, gh):
        """A pending chunk ``[s, e)``: its gradient block in the compute dtype (``glc``) and fp32 (``gl``, for the
        bias), hidden states and grad-input rows, all with the row factor -1 (or the softmax scale) only."""
        for a, b, r in segments:
            if self.grad_w is not None:
                self._sum(r).add(glc[a - s : b - s], h[a - s : b - s])
            if gl is not None:
                self.b.setdefault(r, gl.new_zeros(gl.shape[1])).add_(gl[a - s : b - s].sum(dim=0))
        if gh is not None:
            self.h.append((s, e, gh.float() if gh.dtype.itemsize < 4 else gh))

    def _sum(self, row):
        if row not in self.w:
            if not self.grad_w.written:  # long groups go first: only the first one's first row finds it so
                self.w[row] = self.grad_w
            else:
                self.w[row] = self.spare.pop() if self.spare else self.grad_w.like()
        return self.w[row]

    def finish(self, segments, g, run: _Run):
        """The group ended: ``g`` holds its rows' factors."""
        for a, b, r in segments:
            run.g_tok[a:b] = g[r]
        if run.scale is not None:  # the sums hold the factor -pending: scale them to the stored gradients' scale
            g = g * (run.scale / run.pending)
        result = self.grad_w
        for r, p in self.w.items():  # the result itself may hold a row's sum: scale it before adding the others
            if p is result:
                result.t.mul_(g[r].item())  # in fp32: the factor is not rounded to a half dtype
        for r, p in self.w.items():
            if p is not result:
                p.scale_into(result, g[r])
                self.spare.append(p)
        for r, bias_sum in self.b.items():
            run.grad_b.add_(bias_sum * g[r])
        for s, e, gh in self.h:
            pos, g_h = run.ordered.positions[s:e], run.g_tok[s:e]
            g_h = g_h if run.scale is None else g_h * (run.scale / run.pending)
            run.grad_h.index_copy_(0, pos, (gh * g_h.unsqueeze(1)).to(run.grad_h.dtype))
        self.w, self.b, self.h = {}, {}, []

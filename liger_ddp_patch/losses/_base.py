"""The base of the chunked losses: a loss is a sum of per-group terms, and the base does the summing.

A loss module (``dpo.py``, ``kto.py``) says which rows form a group (:meth:`ChunkedLinearLoss.group_of_row`: a DPO
pair is rows ``i`` and ``i + P``, a KTO row is its own group), its batch constants (:meth:`ChunkedLinearLoss.batch_of`),
the loss of *one* group (:meth:`ChunkedLinearLoss.group_loss`) from that group's per-row sums of token log-probs,
its token counts and the batch constants, and its metrics (:meth:`ChunkedLinearLoss.metrics`); its ``forward`` calls
:meth:`ChunkedLinearLoss.run`, the skeleton every loss shares.  The base evaluates each group's term on that group's
values alone and adds the terms, so a loss that couples groups (a batch mean, a ranking) cannot be written through
this interface: that is what makes the one-pass path (``_onepass``, which forms a group's gradient as soon as its last
token has passed) exact by construction, like Liger's chunked base whose subclasses return the loss of one chunk of
pairs.

A loss that is not a sum over groups overrides :meth:`ChunkedLinearLoss.batch_loss` instead; it always takes the
two-pass path, and :attr:`ChunkedLinearLoss.last_path` says why.
"""

from __future__ import annotations

import functools

import torch

from . import _onepass, _plan, _tokens, _twopass
from ._metrics import row_logit_sums
from ._plan import Plan, resolve_token_chunk_size
from ._tokens import needs_grad
from ._workspace import workspace

__all__ = ["ChunkedLinearLoss", "GroupedLoss", "check_reference", "one_workspace"]

ONE_PASS, TWO_PASS, NO_GRAD = "one-pass", "two-pass", "forward only"
NOT_A_SUM = "the loss is not a sum over groups (batch_loss): one pass would be wrong"


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


def one_workspace(forward):
    """For a loss's ``forward``: its passes over the head (reference, policy) share one set of ``(chunk, V)``
    buffers (``_workspace.workspace``), freed when it returns."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with workspace():
            return forward(*args, **kwargs)

    return wrapped


class GroupedLoss:
    """``sum_g term(S[rows_g], counts[rows_g], g, batch)``: every term sees its own group's rows only."""

    def __init__(self, term, group_of_row: torch.Tensor, counts: torch.Tensor, batch):
        self.term, self.counts, self.batch, self.group_of_row = term, counts, batch, group_of_row
        ids = group_of_row.tolist()
        self.rows = {
            g: torch.tensor([r for r, x in enumerate(ids) if x == g], device=counts.device) for g in dict.fromkeys(ids)
        }

    def terms(self, sums: torch.Tensor, groups) -> torch.Tensor:
        parts = []
        for g in groups:
            part = self.term(sums[self.rows[g]], self.counts[self.rows[g]], g, self.batch)
            if part.dim() != 0:
                raise ValueError(f"group_loss must return a scalar (the loss of one group), got shape {part.shape}")
            parts.append(part)
        return torch.stack(parts).sum() if parts else sums.new_zeros(())

    def __call__(self, sums: torch.Tensor) -> torch.Tensor:
        return self.terms(sums, self.rows)

    def gradient(self, sums: torch.Tensor, groups) -> torch.Tensor:
        """``d/dS`` of the named groups' terms (zero on the other rows), at ``sums``."""
        with torch.enable_grad():
            s = sums.detach().clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(self.terms(s, groups), s, allow_unused=True)
        return torch.zeros_like(sums) if grad is None else grad


class ChunkedLinearLoss(torch.nn.Module):
    """The options every chunked loss has, per-sequence log-probs, and the policy loss as a sum over groups."""

    def __init__(
        self, ignore_index, beta, compiled, use_ref_model, average_log_prob, chunk_size, token_chunk_size,
        one_pass=None, sweep="eager",
    ):  # fmt: skip
        super().__init__()
        if token_chunk_size is not None:
            resolve_token_chunk_size(token_chunk_size, 1)  # validate early
        if sweep not in _plan.SWEEPS:
            raise ValueError(f"sweep must be one of {', '.join(map(repr, _plan.SWEEPS))}, got {sweep!r}")
        self.ignore_index = ignore_index
        self.beta = beta
        self.compiled = compiled  # accepted for drop-in compatibility; nothing here is compiled
        self.use_ref_model = use_ref_model
        self.average_log_prob = average_log_prob
        self.chunk_size = chunk_size  # accepted for drop-in compatibility; token_chunk_size bounds memory
        self.token_chunk_size = token_chunk_size
        # None (default): the one-pass path (gradients formed in the forward, ``_onepass``), unless it would hold more
        # than the two-pass path beyond ``_plan.held_budget_bytes`` (long groups' (V, H) sums, a cast weight) even with
        # its auto chunk widened to the longest row (:meth:`widened`), then the two-pass path; True:
        # always one pass; False: always the two-pass path, which holds no gradient between forward and backward
        self.one_pass = None if one_pass is None else bool(one_pass)
        self.sweep = sweep  # "triton": the (chunk, V) sweep as Triton kernels where they run (_plan.sweep_of)
        self.last_path, self.last_chunk, self.last_sweep = None, None, None  # what the last forward did
        self.last_held = None  # what its one-pass plan would hold beyond the two-pass path (:meth:`held`)

    # ------------------------------------------------------------------------------------- what a loss provides

    def group_of_row(self, batch_size: int, device) -> torch.Tensor:
        """``(B,)`` int64: the group of every row (default: every row is its own group)."""
        return torch.arange(batch_size, device=device)

    def group_loss(self, sums: torch.Tensor, counts: torch.Tensor, group: int, batch) -> torch.Tensor:
        """The loss of one group (a scalar): ``sums``/``counts`` are its rows' raw sums of token log-probs and
        non-ignored token counts, in row order; ``batch`` holds the batch constants the forward passed."""
        raise NotImplementedError

    def batch_loss(self, sums: torch.Tensor, counts: torch.Tensor, batch) -> torch.Tensor | None:
        """Override only for a loss that is *not* a sum over groups (it then always takes the two-pass path)."""
        return None

    def batch_of(self, target: torch.Tensor, ref_logps: torch.Tensor | None, device, **constants):
        """The batch constants of one call (:meth:`group_loss` reads them) from the targets, the reference's
        per-sequence log-probs (``None`` without ``use_ref_model``) and the loss's own forward arguments."""
        raise NotImplementedError

    def metrics(self, logps, sums, batch, row_sums, target, weight) -> tuple:
        """The loss's detached metrics from the policy's per-sequence log-probs ``logps`` (averaged as asked), its
        raw per-row sums, the batch constants and every row's sum of logits over all positions."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------- the forward

    def run(self, hidden, weight, bias, target, ref_input, ref_weight, ref_bias, **constants):
        """What every loss's ``forward`` does: the reference's log-probs (no gradient), the batch constants, the
        policy loss as a sum over groups, and the metrics (no gradient). Returns ``(loss, metrics)``."""
        check_reference(self.use_ref_model, ref_input, ref_weight)
        ref_logps = None
        if self.use_ref_model:
            with torch.no_grad():
                ref_logps = self.sequence_logps(ref_input, ref_weight, ref_bias, target)
        batch = self.batch_of(target, ref_logps, hidden.device, **constants)
        loss, sums, counts = self.policy_loss(hidden, weight, bias, target, batch)
        with torch.no_grad():
            row_sums = row_logit_sums(hidden, weight, bias)
            return loss, self.metrics(self.averaged(sums, counts), sums, batch, row_sums, target, weight)

    # ------------------------------------------------------------------------------------------- shared pieces

    def averaged(self, sums, counts):
        """Per-sequence log-probs from the per-row sums: ÷ token count with ``average_log_prob``."""
        return sums / counts if self.average_log_prob else sums  # 0/0 -> NaN for a fully ignored row, as in Liger

    def sequence_logps(self, hidden, weight, bias, target):
        """Per-sequence log-probs (the reference model's, or a forward without gradient)."""
        logp, rows, counts = _twopass.token_logprobs(
            hidden, weight, bias, target, self.ignore_index, self.token_chunk_size, self.sweep
        )
        return self.averaged(_tokens.sequence_sums(logp, rows, target.shape[0]), counts)

    def policy_loss(self, hidden, weight, bias, target, batch):
        """``(loss, per-row sums S (detached), counts)`` of the policy: the one-pass path when a gradient is needed
        and the loss is a sum over groups (unless ``one_pass=False``, or by default where it would hold more than
        :func:`_plan.held_budget_bytes` beyond the two-pass path: :meth:`held`), else the two-pass path; recorded in
        :attr:`last_path` / :attr:`last_chunk` / :attr:`last_sweep` / :attr:`last_held`."""
        sel = _tokens.select_tokens(hidden, target, self.ignore_index)
        plan = Plan.of(hidden, weight, self.token_chunk_size, self.sweep, bias)
        path, loss_of = self._path(needs_grad(hidden, weight, bias), sel, batch)
        path, one, schedule, held = self._choose(path, sel, loss_of, weight, plan, hidden.device)
        self.last_held = held
        self.last_path, self.last_chunk, self.last_sweep = path, one.chunk, one.sweep
        if path == ONE_PASS:
            loss, sums = _onepass.OnePassLoss.apply(
                sel.hidden2d, weight, bias, sel, one, schedule, loss_of, _onepass.scale_of(self)
            )
            return loss, sums, sel.counts
        sums = _tokens.sequence_sums(_twopass.selected_logprobs(sel, weight, bias, plan), sel.rows, target.shape[0])
        return loss_of(sums), sums.detach(), sel.counts

    def planned(self, hidden, weight, target, bias=None) -> dict:
        """What the policy pass of a call with these inputs (a gradient needed) would do, without running it:
        ``path``, ``chunk`` (tokens per GEMM), ``sweep`` and ``held`` (:meth:`held`, None off the one-pass path),
        as :meth:`policy_loss` would record them.  Only shapes, dtypes, the device and the targets are read (inside
        ``_plan.simulated_accelerator`` a CPU call is planned as on an accelerator): the tests pin plans with it."""
        sel = _tokens.select_tokens(hidden, target, self.ignore_index)
        plan = Plan.of(hidden, weight, self.token_chunk_size, self.sweep, bias)
        path, loss_of = self._path(True, sel, None)
        path, one, _schedule, held = self._choose(path, sel, loss_of, weight, plan, hidden.device)
        return dict(path=path, chunk=one.chunk, sweep=one.sweep, held=held)

    def _choose(self, path, sel, loss_of, weight, plan: Plan, device):
        """``(path, plan, one-pass schedule or None, held or None)``: on the one-pass path, the schedule of ``plan``'s
        chunk, or of a widened one (:meth:`widened`) or, on an accelerator, a narrowed one (:meth:`narrowed`), or the
        two-pass path where the default's one pass would hold more than :func:`_plan.held_budget_bytes` beyond it."""
        if path != ONE_PASS:
            return path, plan, None, None
        schedule = _onepass.group_chunks(sel.rows, loss_of.group_of_row, sel.counts, plan.chunk)
        held = self.held(schedule[1], weight, plan)
        rows = max((c.end - c.start for c in schedule[1]), default=0)  # the largest chunk: fewer tokens than a chunk
        budget = _plan.held_budget_bytes(device, weight.numel(), plan._replace(chunk=rows).chunk_bytes(weight.shape[0]))
        one = plan
        if self.one_pass is None and self.token_chunk_size is None and held["extra_bytes"] > budget:
            one, schedule, held = self.widened(sel, loss_of.group_of_row, weight, plan, schedule, held)
            if held["extra_bytes"] > budget and _plan.device_kind(device) == "accelerator":
                one, schedule, held = self.narrowed(
                    sel, loss_of.group_of_row, weight, plan, budget, one, schedule, held
                )
        if self.one_pass is None and held["extra_bytes"] > budget:
            path = (f"{TWO_PASS}: one pass would hold {held['extra_bytes'] / 2**20:.0f} MiB more "
                    f"(> {budget / 2**20:.0f} MiB)")  # fmt: skip
            return path, plan, None, held
        return path, one, schedule, held

    @staticmethod
    def held(chunks, weight, plan: Plan, chunk_bytes: int = 0) -> dict:
        """What the one-pass plan ``chunks`` holds during its forward beyond the two-pass path's peak, in bytes:
        ``vh_sums`` extra ``(V, H)`` sums of its long groups (``vh_sums_bytes``), where the GEMMs cast the weight
        (fp32 weights under autocast) the cast weight (``cast_bytes``), both beside the weight gradient, and a
        chunk's logits beyond the two-pass path's (``chunk_bytes``, :meth:`widened`)."""
        n = _onepass.extra_sums(chunks, weight.requires_grad)
        sums = n * weight.numel() * weight.element_size()
        cast = weight.numel() * plan.cdtype.itemsize if weight.dtype != plan.cdtype else 0
        return dict(vh_sums=n, vh_sums_bytes=sums, cast_bytes=cast, chunk_bytes=chunk_bytes,
                    extra_bytes=sums + cast + chunk_bytes)  # fmt: skip

    def widened(self, sel, group_of_row, weight, plan: Plan, schedule, held):
        """Where ``plan``'s one pass would hold more than the budget: ``(plan, schedule, held)`` with the token chunk
        widened to the longest row, or group, where that leaves no long group needing a ``(V, H)`` sum and its
        logits hold less than the sums; else ``plan``'s.  A pair of 1.2x a chunk (fp32, Qwen2.5-0.5B's head,
        L=512) then holds 22 MB more logits instead of a 519 MiB sum and takes one pass, not two (issue 39).  Only
        then: where the sums fit the budget, a widened chunk (bf16) took 1.02-1.11x their step time for no lower
        peak (benchmarks/README.md, "What the held budget changed")."""
        V, groups = weight.shape[0], torch.zeros_like(sel.counts).index_add_(0, group_of_row, sel.counts)
        for chunk in sorted({int(sel.counts.max()), int(groups.max())}):
            if chunk <= plan.chunk or chunk > _plan.MAX_DEFAULT_CHUNK:
                continue
            wide = plan._replace(chunk=chunk)
            wide_schedule = _onepass.group_chunks(sel.rows, group_of_row, sel.counts, chunk)
            if _onepass.extra_sums(wide_schedule[1], weight.requires_grad) == 0:
                wide_held = self.held(wide_schedule[1], weight, wide, wide.chunk_bytes(V) - plan.chunk_bytes(V))
                if wide_held["extra_bytes"] < held["extra_bytes"]:
                    return wide, wide_schedule, wide_held
                break
        return plan, schedule, held

    def narrowed(self, sel, group_of_row, weight, plan: Plan, budget: int, one: Plan, schedule, held):
        """On an accelerator, where neither ``plan``'s chunk nor a widened one fits ``budget``: ``(plan, schedule,
        held)`` with the token chunk narrowed so that its long groups' sums and its smaller blocks fit, if that chunk
        holds at least :data:`_plan.MIN_ONE_PASS_ROWS` tokens (a GEMM still compute-bound); else ``one``'s.  At
        Qwen2.5-7B's bf16 head a DPO pair of 4,096-token rows then takes one pass in 1,194-token chunks holding one
        bf16 sum, its sum and chunk within the 4 bytes per weight element of an fp32 accumulator, where the budget
        alone would send it to two passes: three GEMMs per token instead of four (issue 45)."""
        V = weight.shape[0]
        per_row = plan.chunk_bytes(V) // max(1, plan.chunk)
        first = self.held(schedule[1], weight, plan)["vh_sums"]
        each = weight.numel() * weight.element_size()
        cast = held["cast_bytes"]
        for sums in (first, first + 1):  # a narrower chunk holds at least the sums of the default's
            chunk = min(plan.chunk - 1, plan.chunk + (budget - sums * each - cast) // max(1, per_row))
            if chunk < _plan.MIN_ONE_PASS_ROWS:
                break
            narrow = plan._replace(chunk=chunk)
            narrow_schedule = _onepass.group_chunks(sel.rows, group_of_row, sel.counts, chunk)
            narrow_held = self.held(narrow_schedule[1], weight, narrow, narrow.chunk_bytes(V) - plan.chunk_bytes(V))
            if narrow_held["vh_sums"] <= sums and narrow_held["extra_bytes"] <= budget:
                return narrow, narrow_schedule, narrow_held
        return one, schedule, held

    def _path(self, grad: bool, sel, batch):
        """``(the path, the loss as a function of the per-row sums)``."""
        if type(self).batch_loss is not ChunkedLinearLoss.batch_loss:  # a whole-batch loss: never one pass
            return (f"{TWO_PASS}: {NOT_A_SUM}" if grad else NO_GRAD), lambda sums: self.batch_loss(
                sums, sel.counts, batch
            )
        group_of_row = self.group_of_row(sel.counts.shape[0], sel.counts.device)
        loss_of = GroupedLoss(self.group_loss, group_of_row, sel.counts, batch)
        if not grad:
            return NO_GRAD, loss_of
        return (f"{TWO_PASS}: one_pass=False" if self.one_pass is False else ONE_PASS), loss_of

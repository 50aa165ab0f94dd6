"""One loss call's scratch memory: its passes over the head take their ``(chunk, V)`` buffers from here (issue #22).

A fresh CPU buffer of that size costs its page faults on every first touch (glibc maps and unmaps blocks this
large), on the order of the sweep of a chunk itself.  The reference pass and the policy pass of one call
run one after the other, so they can share one buffer per slot; every request is within the loss's per-chunk
budget (``_plan.logits_budget_bytes``) or, for a one-pass chunk widened to a long row, what the held budget allowed
(``_base.ChunkedLinearLoss.widened``), so holding the largest of them holds no more than that.  Per thread and per
call (a context variable, freed on exit): nothing is held between calls.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["scratch", "workspace"]

_WORKSPACE: contextvars.ContextVar[dict | None] = contextvars.ContextVar("liger_ddp_patch_workspace", default=None)


@contextlib.contextmanager
def workspace():
    """The scope of one loss call (``_base.one_workspace``)."""
    token = _WORKSPACE.set({})
    try:
        yield
    finally:
        _WORKSPACE.reset(token)


def scratch(slot: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat tensor of ``numel`` elements: the open :func:`workspace`'s ``slot`` (grown when a pass needs more),
    else a fresh one.  A slot serves one live buffer at a time."""
    ws = _WORKSPACE.get()
    if ws is None:
        return torch.empty(numel, dtype=dtype, device=device)
    key = (slot, dtype, device)
    buf = ws.get(key)
    if buf is None or buf.numel() < numel:
        ws[key] = None  # let the smaller one go first
        buf = ws[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]

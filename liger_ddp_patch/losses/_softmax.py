"""The in-place softmax of a ``(chunk, V)`` logits block: target log-probs and log-sum-exps in one sweep."""

from __future__ import annotations

import torch

from . import _plan

__all__ = ["fused_log_softmax", "softmax_"]


def fused_log_softmax(device: torch.device) -> bool:
    """Whether :func:`softmax_` takes torch's fused in-place row kernels (CPU: ``_softmax``, ``_log_softmax``) or the
    max / exp / sum steps with a row scale left to the caller (elsewhere).  A function, so that the tests can run the
    second branch on CPU; a simulated accelerator (``_plan.simulated_accelerator``) takes it too."""
    return device.type == "cpu" and _plan.simulated(device) is None


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

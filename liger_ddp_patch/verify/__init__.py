"""Runtime checks that DDP really keeps the ranks together: gradients before an optimizer step, weights at a checkpoint.

Every rank reduces each parameter's gradient (or weight) to a few float64 numbers, its *fingerprint*
(:mod:`.fingerprint`); one ``all_gather`` of the small ``[n_params, 5]`` table brings every rank's table to every rank
(:mod:`.collective`), and all ranks compare it with rank 0's. The callbacks (:mod:`.callbacks`) decide where a check
belongs (a DDP model; for the default check, on a Liger path) and what a disagreement does.

    trainer = DPOTrainer(...)
    liger_ddp_patch.verify_gradient_sync(trainer, every=100)   # or LIGER_DDP_PATCH_VERIFY=100 for every Trainer

This package imports torch and transformers; :mod:`liger_ddp_patch` imports it only when a Trainer exists anyway.
"""

from __future__ import annotations

from .callbacks import (
    DEFAULT_EVERY,
    FirstStepCheck,
    GradientDesyncError,
    GradientSyncVerifier,
    WeightDesyncError,
    likely_cause,
    uses_liger,
    verify_gradient_sync,
)
from .fingerprint import (
    ABS_SUM,
    COLUMNS,
    DEFAULT_RTOL,
    HINT,
    PRESENT,
    SAMPLED_DOT,
    SUM,
    SUM_SQ,
    compared,
    describe,
    disagreements,
    fingerprint,
    fingerprints,
    weight_fingerprint,
)

__all__ = [
    "ABS_SUM",
    "COLUMNS",
    "DEFAULT_EVERY",
    "DEFAULT_RTOL",
    "HINT",
    "PRESENT",
    "SAMPLED_DOT",
    "SUM",
    "SUM_SQ",
    "FirstStepCheck",
    "GradientDesyncError",
    "GradientSyncVerifier",
    "WeightDesyncError",
    "compared",
    "describe",
    "disagreements",
    "fingerprint",
    "fingerprints",
    "likely_cause",
    "uses_liger",
    "verify_gradient_sync",
    "weight_fingerprint",
]

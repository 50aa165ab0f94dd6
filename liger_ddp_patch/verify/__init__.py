"""Runtime checks that DDP really keeps the ranks together: gradients before an optimizer step, weights at a checkpoint.

Every rank reduces each parameter's gradient to a few float64 numbers, its *fingerprint*, and each weight to an
exact integer digest of its bits (:mod:`.fingerprint`); one ``all_gather`` of the small table brings every rank's
table, or why it could not build one, to every rank (:mod:`.collective`), and all ranks compare them. Where weights
differ, :mod:`.distance` measures how far apart (rounding, or training apart). The callbacks (:mod:`.callbacks`)
decide where a check belongs (a DDP model; for the default check, on a Liger path), what it compares (what DDP
synchronises) and what a disagreement does.

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
    digest,
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
    "digest",
    "disagreements",
    "fingerprint",
    "fingerprints",
    "likely_cause",
    "uses_liger",
    "verify_gradient_sync",
    "weight_fingerprint",
]

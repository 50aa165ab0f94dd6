"""The record that gives every transformers ``Trainer`` the cross-rank gradient check of :mod:`liger_ddp_patch.verify`.

``LIGER_DDP_PATCH_VERIFY`` unset: while the package is on (not ``LIGER_DDP_PATCH_DISABLE=1``), every Trainer gets
:class:`~liger_ddp_patch.verify.FirstStepCheck`, which acts only where the bug can live (a model under DDP, a Liger
path): at its first optimizer step and every checkpoint, and warns. ``=N``: any DDP model, at the first step and every
N after, raising, even with the patches disabled; ``0``: no check. The Trainer is transformers', not TRL's: every
release has its ``__init__``, so no version gates the record.
"""

from __future__ import annotations

from typing import Any

from .. import environment
from ..engine import Patch
from .trainers import SPECS

NAME = "gradient_sync_check"
# What says "this trainer runs a Liger path": use_liger_kernel, or a trainer's own flag (GKD's, Distillation's)
LIGER_FLAGS = tuple(dict.fromkeys(flag for spec in SPECS for flag in spec.liger_flags))


def gate(current: environment.Settings) -> tuple[str | None, str]:
    """``(why the check is off, or None; what it does)`` under ``current``."""
    every = current.verify_every
    if every > 0:
        return None, (
            f"{environment.VERIFY}={every}: for a model under DistributedDataParallel, at the first optimizer step and "
            f"every {every} after, and at every checkpoint, raising GradientDesyncError if the ranks differ"
        )
    if not current.check_first:
        return f"disabled by {environment.VERIFY}=0", ""
    if current.disable_all:
        return f"disabled by {environment.DISABLE} (with it, only {environment.VERIFY}=N checks gradients)", ""
    if current.strict:
        return None, (
            f"{environment.VERIFY} unset: for a Liger trainer under DistributedDataParallel, at the first optimizer "
            f"step and at every checkpoint, raising GradientDesyncError if the ranks differ ({environment.STRICT}=1)"
        )
    return None, (
        f"{environment.VERIFY} unset: for a Liger trainer under DistributedDataParallel, at the first optimizer step "
        "and at every checkpoint, a WARNING if the ranks differ"
    )


def check(original: Any) -> str | None:
    return None if callable(original) else f"Trainer.__init__ is a {type(original).__name__}, not a function"


def replace(original: Any, engine: Any) -> Any:
    """``Trainer.__init__``, then the check's callback on the new Trainer (this imports torch: the Trainer did)."""
    from ..verify import FirstStepCheck, GradientSyncVerifier, verify_gradient_sync

    every, strict = engine.settings.verify_every, engine.settings.strict

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if every:
            verify_gradient_sync(self, every)
        elif not any(isinstance(c, GradientSyncVerifier) for c in self.callback_handler.callbacks):
            self.add_callback(FirstStepCheck(self, strict, LIGER_FLAGS))

    return __init__


RECORD = Patch(
    name=NAME,
    module=("transformers.trainer",),
    attribute=("Trainer.__init__",),
    distribution="transformers",
    affected="",  # every release
    fixed_in=None,
    releases=(),
    check=check,
    replace=replace,
    summary="adds the cross-rank gradient and checkpoint check to every Trainer (it acts only under DDP)",
    gate=gate,
)

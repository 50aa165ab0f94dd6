"""Restore DDP gradient sync for TRL's Liger losses without upgrading TRL: DPO and KTO (TRL 1.0.0-1.13.0, and a
compiled model on 1.14.x), GKD, GOLD, Distillation and IW-OPD (the releases before their upstream fixes).

Import this module before (or after) TRL; the patches apply when TRL's trainer modules load. Nothing heavy is
imported here: torch, transformers and trl load only when TRL itself does.

    import liger_ddp_patch
    liger_ddp_patch.report()   # what was applied, and why anything was not
"""

from __future__ import annotations

from . import environment as _environment
from .engine import APPLIED, PENDING, Engine, PatchError, Status
from .patches import NAMES as _NAMES
from .patches import RECORDS as _RECORDS
from .patches.trainers import SPECS as _SPECS

__all__ = [
    "GradientDesyncError",
    "PatchError",
    "Status",
    "apply",
    "decisions",
    "report",
    "unpatch",
    "verify_gradient_sync",
    "__version__",
]
__version__ = "0.1.0"

_engine = Engine(_RECORDS, _environment.read(_NAMES))
_LOSS_SWAPS = frozenset(spec.chunked_loss_patch for spec in _SPECS)


def report(resolve: bool = False) -> list[Status]:
    """One :class:`Status` per patch: name, target, status, reason, detected TRL version, run-time decisions.

    ``resolve=True`` first imports every trainer module still pending, so "pending" becomes the answer a real run
    would get (``liger-ddp-patch status`` does this).
    """
    if resolve:
        _engine.resolve_pending()
    rows, loss = _engine.report(), _environment.loss_options()
    for row in rows:  # the options the DDP swap will give our loss (LIGER_DDP_PATCH_LOSS)
        if row.name in _LOSS_SWAPS and row.status in (APPLIED, PENDING):
            row.reason += f"; loss options ({_environment.LOSS}): {loss.describe()}"
    return rows


def decisions(trainer) -> dict[str, list[str]]:
    """What the patches decided at run time for this very ``trainer`` object, by patch name (``{}``: none saw it).

    :func:`report` groups those decisions by trainer class, which mixes two trainers of one class in a process."""
    return _engine.decisions(trainer)


def unpatch() -> None:
    """Restore every patched attribute to the very object it replaced (the gradient check's ``Trainer.__init__``
    too); later TRL imports stay unpatched."""
    _engine.unpatch()


def apply() -> None:
    """Re-enable patching after :func:`unpatch` (applies at once to trainer modules already imported)."""
    _engine.install()
    _engine.apply()


# Hooks the modules of every record the settings leave on: with LIGER_DDP_PATCH_DISABLE=1 only the gradient check's,
# and only under LIGER_DDP_PATCH_VERIFY=N (patches/verifier.py).
_engine.install()


def verify_gradient_sync(trainer, every: int = 100):
    """Raise :class:`GradientDesyncError` if ``trainer``'s gradients differ across ranks (step 0, then every N)."""
    from .verify import verify_gradient_sync

    return verify_gradient_sync(trainer, every)


def __getattr__(name: str):
    if name == "GradientDesyncError":  # lazy: importing liger_ddp_patch must not import torch
        from .verify import GradientDesyncError

        return GradientDesyncError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

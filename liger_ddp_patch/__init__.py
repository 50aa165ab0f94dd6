"""Restore DDP gradient sync for TRL's DPO/KTO Liger loss path (TRL 1.9.0-1.13.0), without upgrading TRL.

Import this module before (or after) TRL; the patches apply when TRL's trainer modules load. Nothing heavy is
imported here: torch, transformers and trl load only when TRL itself does.

    import liger_ddp_patch
    liger_ddp_patch.report()   # what was applied, and why anything was not
"""

from __future__ import annotations

import sys

from . import settings as _settings
from .engine import APPLIED, PENDING, Engine, PatchError, Status
from .patches import NAMES as _NAMES
from .patches import PATCHES as _PATCHES
from .patches.trainers import SPECS as _SPECS

__all__ = [
    "GradientDesyncError",
    "PatchError",
    "Status",
    "apply",
    "report",
    "unpatch",
    "verify_gradient_sync",
    "__version__",
]
__version__ = "0.1.0"

_engine = Engine(_PATCHES, _settings.read(_NAMES))
_LOSS_SWAPS = frozenset(spec.chunked_loss_patch for spec in _SPECS)


def report(resolve: bool = False) -> list[Status]:
    """One :class:`Status` per patch: name, target, status, reason, detected TRL version, run-time decisions.

    ``resolve=True`` first imports every trainer module still pending, so "pending" becomes the answer a real run
    would get (``liger-ddp-patch status`` does this).
    """
    if resolve:
        _engine.resolve_pending()
    rows, loss = _engine.report(), _settings.loss_options()
    for row in rows:  # the options the DDP swap will give our loss (LIGER_DDP_PATCH_LOSS)
        if row.name in _LOSS_SWAPS and row.status in (APPLIED, PENDING):
            row.reason += f"; loss options ({_settings.LOSS}): {loss.describe()}"
    return rows


def unpatch() -> None:
    """Restore every patched attribute to the very object it replaced; later TRL imports stay unpatched."""
    _engine.unpatch()
    if "liger_ddp_patch.verify" in sys.modules:  # LIGER_DDP_PATCH_VERIFY's Trainer.__init__ wrapper
        sys.modules["liger_ddp_patch.verify"].uninstall_trainer_hook()


def apply() -> None:
    """Re-enable patching after :func:`unpatch` (applies at once to trainer modules already imported)."""
    _engine.install()
    _engine.apply()


if not _engine.settings.disable_all:
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


def _verify_every_trainer(module) -> None:  # post-import hook on transformers.trainer (LIGER_DDP_PATCH_VERIFY)
    if _engine.enabled:  # not after unpatch()
        from .verify import install_trainer_hook

        install_trainer_hook(module, _engine.settings.verify_every, _engine.settings.strict)


# LIGER_DDP_PATCH_VERIFY=N: every Trainer checks its gradients every N steps, even with the patches disabled; unset:
# while the package is on, once at the first optimizer step of a DDP job (verify.FirstStepCheck); 0: never.
_settings_now = _engine.settings
if _settings_now.verify_every > 0 or (_settings_now.check_first and not _settings_now.disable_all):
    import wrapt

    wrapt.register_post_import_hook(_verify_every_trainer, "transformers.trainer")

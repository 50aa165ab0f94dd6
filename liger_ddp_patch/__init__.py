"""Restore DDP gradient sync for TRL's DPO/KTO Liger loss path (TRL 1.9.0-1.13.0), without upgrading TRL.

Import this module before (or after) TRL; the patches apply when TRL's trainer modules load. Nothing heavy is
imported here: torch, transformers and trl load only when TRL itself does.

    import liger_ddp_patch
    liger_ddp_patch.report()   # what was applied, and why anything was not
"""

from __future__ import annotations

from . import settings as _settings
from .engine import Engine, PatchError, Status
from .patches import NAMES as _NAMES, PATCHES as _PATCHES

__all__ = ["PatchError", "Status", "apply", "report", "unpatch", "__version__"]
__version__ = "0.1.0"

_engine = Engine(_PATCHES, _settings.read(_NAMES))


def report() -> list[Status]:
    """One :class:`Status` per patch: name, target, status, reason, detected TRL version."""
    return _engine.report()


def unpatch() -> None:
    """Restore every patched attribute to the very object it replaced; later TRL imports stay unpatched."""
    _engine.unpatch()


def apply() -> None:
    """Re-enable patching after :func:`unpatch` (applies at once to trainer modules already imported)."""
    _engine.install()
    _engine.apply()


if not _engine.settings.disable_all:
    _engine.install()

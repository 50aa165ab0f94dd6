"""The patch engine: declarative records in, post-import hooks and a status registry out.

A :class:`Patch` (``records``) says *what* to replace and *when*; :func:`decide` (``decide``) says, without side
effects, what to do with it given the installed version, the target found and its shape; :class:`Engine` (``hooks``)
registers one wrapt post-import hook per target module, carries the decision out (swaps the attribute, or for a record
without a replacement only *arms* it, for run-time code to consult through :meth:`Engine.original`), undoes it, and
keeps every decision as a :class:`Status`. Replacements record what they decide at run time with :meth:`Engine.note`:
by trainer class in the report, and by trainer object for :meth:`Engine.decisions`.
The engine knows nothing about any particular library; the records never see wrapt.
"""

from .decide import decide, decide_unimportable
from .hooks import Engine, installed_version
from .records import APPLIED, DISABLED, FAILED, NOT_NEEDED, PENDING, UNAVAILABLE, UNSUPPORTED, Patch, PatchError, Status

__all__ = ["APPLIED", "DISABLED", "FAILED", "NOT_NEEDED", "PENDING", "UNAVAILABLE", "UNSUPPORTED", "Engine", "Patch",
           "PatchError", "Status", "decide", "decide_unimportable", "installed_version"]  # fmt: skip

"""The records: what a patch is (:class:`Patch`), what became of it (:class:`Status`), and the words for that."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

# No dataclasses at import time: this module loads in every process the package reaches (benchmarks/README.md,
# "Startup cost").

APPLIED, PENDING, NOT_NEEDED, DISABLED, UNSUPPORTED, FAILED, UNAVAILABLE = (
    "applied",
    "pending",
    "not_needed",
    "disabled",
    "unsupported",
    "failed",
    "unavailable",  # the host's code for the patch cannot run here (its module fails to import, a dependency too old)
)


class PatchError(RuntimeError):
    """A patch could not be applied and ``LIGER_DDP_PATCH_STRICT`` asked for that to be fatal."""


class Patch(NamedTuple):
    """One declarative patch record.

    ``check(original)`` returns ``None`` when the original still looks like the code we fix, else the reason it does
    not. ``replace(original, engine)`` returns the function to run instead, with the original's signature (``engine``
    offers :meth:`Engine.original` and :meth:`Engine.note` to it at run time); the engine installs it inside a wrapt
    ``FunctionWrapper`` around the original, which carries the original's name, docstring and ``__wrapped__``.
    ``replace=None`` arms the record without installing anything. Undo is always "put the original back".
    """

    name: str
    module: tuple[str, ...]  # importing any of these modules triggers the patch (the class may move between releases)
    attribute: tuple[str, ...]  # dotted paths inside ``module``; the first one present is the target
    distribution: str  # the installed distribution whose version gates the patch
    affected: str  # PEP 440 specifier: releases known to carry the bug ("": no version gate, the shape check decides)
    fixed_in: str | None  # first release where upstream fixed it
    releases: tuple[str, ...]  # releases whose code we have read; any other version is "unknown": shape decides
    check: Callable[[Any], str | None]
    replace: Callable[[Any, Any], Any] | None  # (original, engine) -> replacement
    summary: str  # what the patch does, for the diagnostic
    # Modules without which the host never defines the target (it imports it only when they are importable):
    # a missing target is then "not needed", not "unsupported".
    requires: tuple[str, ...] = ()
    # Why a release before ``affected`` needs nothing from this record (a known release there is then "not needed", not
    # "unsupported"), e.g. "dpo_compute_loss handles it".
    before: str = ""
    # For a module of ``requires``: where the host keeps the lowest version of it that it imports the target with,
    # ``(module, "host.module:ATTRIBUTE")``, read at run time. A missing target with that module installed below the
    # minimum is then "unavailable" (the host left it undefined), not "unsupported".
    requires_min: tuple[tuple[str, str], ...] = ()
    # For a record the settings switch their own way (``LIGER_DDP_PATCH_DISABLE=1`` alone does not turn it off; naming
    # it does): ``gate(settings)`` is ``(why it is off, or None; what the settings make it do)``, the second part said
    # at the end of the applied reason.
    gate: Callable[[Any], tuple[str | None, str]] | None = None

    @property
    def target(self) -> str:
        return f"{'|'.join(self.module)}:{'|'.join(self.attribute)}"


class Status:
    """What happened to one patch: ``status`` is one of applied/pending/not_needed/disabled/unsupported/failed/
    unavailable.

    ``runtime`` holds what the installed patch decided while the program ran: per key (e.g. a trainer class), the
    distinct decisions in the order first seen.
    """

    __slots__ = ("name", "target", "status", "reason", "version", "runtime")

    def __init__(self, name: str, target: str, status: str, reason: str, version: str | None = None, runtime=None):
        self.name, self.target, self.status, self.reason, self.version = name, target, status, reason, version
        self.runtime: dict[str, list[str]] = {key: list(seen) for key, seen in (runtime or {}).items()}

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.__slots__}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Status) and self.as_dict() == other.as_dict()

    def __repr__(self) -> str:
        return "Status(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"


def describe(statuses: list[Status]) -> str:
    return "; ".join(f"{s.name} ({s.status}): {s.reason}" for s in statuses)


def summary(module: str, statuses: list[Status]) -> tuple[int, str]:
    """``(level, line)`` for the log once a module's patches are decided: DEBUG when every one went to plan
    (invisible by default), WARNING when one could not apply."""
    version = next((s.version for s in statuses if s.version), None)
    parts = [f"{s.name}={s.status}" + ("" if s.status == APPLIED else f" ({s.reason})") for s in statuses]
    bad = any(s.status in (UNSUPPORTED, FAILED) for s in statuses)
    return 30 if bad else 10, f"liger_ddp_patch: {module} imported (version {version}): {'; '.join(parts)}"

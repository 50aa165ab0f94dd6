"""The patch engine: declarative records in, post-import hooks and a status registry out.

A :class:`Patch` says *what* to replace and *when*; :class:`Engine` does the rest: it registers one wrapt post-import
hook per target module, gates each record on the installed version and on a shape check of the original, swaps the
attribute (or, for a record without a replacement, only *arms* it: checked, nothing installed, for run-time code to
consult through :meth:`Engine.original`), remembers the original for :meth:`Engine.unpatch`, and records every
decision as a :class:`Status`. Replacements may record what they decide at run time with :meth:`Engine.note`.
The engine knows nothing about any particular library; the records never see wrapt.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from . import log
from .settings import Settings

# No dataclasses and no logging at import time: this module loads in every process the package reaches, and those
# two cost more than the rest of the package together (see benchmarks/README.md, "Startup cost").

APPLIED, PENDING, NOT_NEEDED, DISABLED, UNSUPPORTED, FAILED = (
    "applied",
    "pending",
    "not_needed",
    "disabled",
    "unsupported",
    "failed",
)


MARK = "__liger_ddp_patch__"  # set on every replacement we install, so a second engine never wraps it again
ORIGINAL = "__liger_ddp_patch_original__"  # and the object it replaced, so a second engine can restore it


class PatchError(RuntimeError):
    """A patch could not be applied and ``LIGER_DDP_PATCH_STRICT`` asked for that to be fatal."""


class Patch(NamedTuple):
    """One declarative patch record.

    ``check(original)`` returns ``None`` when the original still looks like the code we fix, else the reason it does
    not. ``replace(original, engine)`` returns the object to install (``engine`` offers :meth:`Engine.original` and
    :meth:`Engine.note` to the replacement at run time); ``replace=None`` arms the record without installing
    anything. Undo is always "put the original back".
    """

    name: str
    module: tuple[str, ...]  # importing any of these modules triggers the patch (the class may move between releases)
    attribute: tuple[str, ...]  # dotted paths inside ``module``; the first one present is the target
    distribution: str  # the installed distribution whose version gates the patch
    affected: str  # PEP 440 specifier: releases known to carry the bug
    fixed_in: str | None  # first release where upstream fixed it
    releases: tuple[str, ...]  # releases whose code we have read; any other version is "unknown": shape decides
    check: Callable[[Any], str | None]
    replace: Callable[[Any, Engine], Any] | None
    summary: str  # what the patch does, for the diagnostic
    # Modules without which the host never defines the target (it imports it only when they are importable):
    # a missing target is then "not needed", not "unsupported".
    requires: tuple[str, ...] = ()

    @property
    def target(self) -> str:
        return f"{'|'.join(self.module)}:{'|'.join(self.attribute)}"


class Status:
    """What happened to one patch: ``status`` is one of applied/pending/not_needed/disabled/unsupported/failed.

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


class _Applied(NamedTuple):
    parent: Any
    attr: str
    original: Any
    replacement: Any  # None: armed only, nothing installed


def installed_version(distribution: str) -> str | None:
    """The installed version from package metadata, falling back to the imported module's ``__version__``."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return getattr(sys.modules.get(distribution), "__version__", None)


def _importable(module: str) -> bool:
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _resolve(module: Any, paths: Iterable[str]) -> tuple[Any, str, Any] | None:
    """``(parent, attribute, value)`` for the first dotted path present in ``module``."""
    for path in paths:
        *parents, attr = path.split(".")
        parent = module
        for part in parents:
            parent = getattr(parent, part, None)
            if parent is None:
                break
        else:
            # Read a class attribute from its own __dict__, so unpatch() restores the very same object.
            found = vars(parent).get(attr) if isinstance(parent, type) else getattr(parent, attr, None)
            if found is not None:
                return parent, attr, found
    return None


class Engine:
    """Applies a table of :class:`Patch` records through post-import hooks and keeps their :class:`Status`."""

    def __init__(self, records: Iterable[Patch], settings: Settings):
        self.records = {record.name: record for record in records}
        self.settings = settings
        self.enabled = True
        self._status = {name: self._initial(record) for name, record in self.records.items()}
        self._applied: dict[str, _Applied] = {}
        self._hooked: set[str] = set()
        self._lock = threading.RLock()

    # -- public -------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Hook every target module; a module that is already imported is patched at once."""
        import wrapt

        for module in self._modules():
            if module not in self._hooked:
                self._hooked.add(module)
                wrapt.register_post_import_hook(self._on_import, module)

    def apply(self) -> None:
        """(Re-)enable patching and patch every target module already imported."""
        with self._lock:
            self.enabled = True
            for name, record in self.records.items():
                if name not in self._applied and self._status[name].status != PENDING:
                    self._status[name] = self._initial(record)
            for module in self._modules():
                if module in sys.modules:
                    self._on_import(sys.modules[module])

    def unpatch(self) -> None:
        """Put every original back exactly as it was; later imports stay unpatched until :meth:`apply`."""
        with self._lock:
            self.enabled = False
            for name, done in reversed(list(self._applied.items())):
                if done.replacement is not None:
                    setattr(done.parent, done.attr, done.original)
                self._set(name, DISABLED, "removed by liger_ddp_patch.unpatch()")
            self._applied.clear()

    def report(self) -> list[Status]:
        with self._lock:
            return [Status(**s.as_dict()) for s in self._status.values()]

    def original(self, name: str) -> Any:
        """The object a patch replaced, or the target an armed patch checked (``None`` when it is not applied)."""
        done = self._applied.get(name)
        return done.original if done else None

    def note(self, name: str, key: str, decision: str) -> None:
        """Record a run-time decision of patch ``name`` (kept once per distinct text, in order; cheap when known)."""
        seen = self._status[name].runtime.get(key)
        if seen is not None and decision in seen:
            return
        with self._lock:
            self._status[name].runtime.setdefault(key, [])
            if decision not in self._status[name].runtime[key]:
                self._status[name].runtime[key].append(decision)

    def resolve_pending(self) -> None:
        """Import every target module still pending, so the report says what would happen in a real run."""
        import importlib

        errors: dict[str, str] = {}
        for module in self._modules():
            if not any(self._status[n].status == PENDING for n, r in self.records.items() if module in r.module):
                continue
            try:
                importlib.import_module(module)
            except PatchError:
                raise
            except ImportError as exc:
                errors[module] = f"{module} cannot be imported ({exc})"
            except Exception as exc:  # the host library itself failed to import
                errors[module] = f"importing {module} raised {type(exc).__name__}: {exc}"
        for name, record in self.records.items():
            if self._status[name].status == PENDING:
                why = "; ".join(errors.get(m, f"{m} was not imported") for m in record.module)
                self._set(name, NOT_NEEDED, f"{why}; nothing to patch")

    def _modules(self) -> list[str]:
        return list(dict.fromkeys(m for r in self.records.values() for m in r.module))

    # -- hook ---------------------------------------------------------------------------------------------
    def _on_import(self, module: Any) -> None:
        with self._lock:
            if not self.enabled:
                return
            names = [n for n, r in self.records.items() if module.__name__ in r.module]
            for name in names:
                if name not in self._applied and self._status[name].status != DISABLED:
                    self._patch_one(self.records[name], module)
            self._log_summary(module.__name__, names)
            if self.settings.strict:
                bad = [self._status[n] for n in names if self._status[n].status in (UNSUPPORTED, FAILED)]
                if bad:
                    raise PatchError(
                        "LIGER_DDP_PATCH_STRICT=1 and these patches could not be applied: "
                        + "; ".join(f"{s.name} ({s.status}): {s.reason}" for s in bad)
                    )

    def _patch_one(self, record: Patch, module: Any) -> None:
        try:
            self._decide_and_apply(record, module)
        except Exception as exc:  # a bug in a record or a library surprise: never break the host import
            self._set(record.name, FAILED, f"applying raised {type(exc).__name__}: {exc}")

    def _decide_and_apply(self, record: Patch, module: Any) -> None:
        from packaging.version import InvalidVersion, Version
        from packaging.specifiers import SpecifierSet

        raw = installed_version(record.distribution)
        dist = record.distribution
        self._status[record.name].version = raw
        try:
            version = Version(raw) if raw else None
        except InvalidVersion:
            version = None
        if version is None:
            return self._set(record.name, UNSUPPORTED, f"cannot read a valid {dist} version (got {raw!r}); left untouched")

        known = raw in record.releases or str(version) in record.releases
        fixed = Version(record.fixed_in) if record.fixed_in else None
        if known and version not in SpecifierSet(record.affected):
            if fixed is not None and version >= fixed:
                return self._set(record.name, NOT_NEEDED, f"fixed upstream in {dist} {record.fixed_in} (installed {raw})")
            return self._set(
                record.name, UNSUPPORTED, f"{dist} {raw} is outside the affected range {record.affected}; left untouched"
            )

        found = _resolve(module, record.attribute)
        if found is None:
            why = f"{record.target} not found in {dist} {raw}"
            absent = [m for m in record.requires if not _importable(m)]
            if absent:
                return self._set(record.name, NOT_NEEDED, f"{why}: {', '.join(absent)} is not installed, so it never is")
            if fixed is not None and version >= fixed:
                return self._set(record.name, NOT_NEEDED, f"{why}; upstream fixed this in {record.fixed_in}")
            return self._set(record.name, UNSUPPORTED, f"{why}; left untouched")
        parent, attr, original = found
        earlier = ""
        if getattr(original, MARK, None) == record.name:  # e.g. the package loaded twice (importlib.reload)
            original = getattr(original, ORIGINAL)  # replace afresh from the true original, so unpatch() restores it
            earlier = "; took over from an earlier load of the package"
        mismatch = record.check(original)
        if mismatch is not None:
            if not known and fixed is not None and version >= fixed:
                return self._set(
                    record.name,
                    NOT_NEEDED,
                    f"{dist} {raw} is not a release we have read, and {mismatch}: it looks fixed "
                    f"(upstream fixed this in {record.fixed_in})",
                )
            return self._set(record.name, UNSUPPORTED, f"shape check failed: {mismatch}; left untouched")

        replacement = None
        if record.replace is not None:
            replacement = record.replace(original, self)
            setattr(replacement, MARK, record.name)
            setattr(replacement, ORIGINAL, original)
            setattr(parent, attr, replacement)
        self._applied[record.name] = _Applied(parent, attr, original, replacement)
        where = f"{getattr(parent, '__name__', parent)}.{attr}"
        if known:
            reason = f"{record.summary} ({where}, {dist} {raw} is affected{earlier})"
        else:
            reason = (
                f"{record.summary} ({where}{earlier}); {dist} {raw} is not a release we have verified, "
                "applied because the shape check matched the affected code"
            )
        self._set(record.name, APPLIED, reason)

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _initial(self, record: Patch) -> Status:
        if self.settings.is_disabled(record.name):
            return Status(record.name, record.target, DISABLED, "disabled by LIGER_DDP_PATCH_DISABLE")
        return Status(record.name, record.target, PENDING, f"waiting for {' or '.join(record.module)} to be imported")

    def _set(self, name: str, status: str, reason: str) -> None:
        current = self._status[name]
        current.status, current.reason = status, reason

    def _log_summary(self, module: str, names: list[str]) -> None:
        """DEBUG when every patch went to plan (invisible by default); WARNING when one could not apply."""
        statuses = [self._status[n] for n in names]
        version = next((s.version for s in statuses if s.version), None)
        parts = [f"{s.name}={s.status}" + ("" if s.status == APPLIED else f" ({s.reason})") for s in statuses]
        bad = any(s.status in (UNSUPPORTED, FAILED) for s in statuses)
        message = "liger_ddp_patch: %s imported (version %s): %s"
        log.emit(30 if bad else 10, message, module, version, "; ".join(parts))  # logging.WARNING / DEBUG

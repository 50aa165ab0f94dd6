"""The engine: wrapt post-import hooks that swap (or arm) each record's target, undo it, and keep the statuses.

What to do with a record is :func:`~.decide.decide`'s call; this module only finds the target, runs the record's shape
check, carries out the decision, and remembers the original for :meth:`Engine.unpatch`. A replacement is installed
inside a wrapt ``FunctionWrapper`` around the original: the proxy answers for the original's name, docstring and
signature, keeps it as ``__wrapped__``, and carries our mark on itself, never on the original.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

from .. import log
from ..environment import DISABLE, STRICT, Settings
from .decide import decide, decide_unimportable
from .records import (
    APPLIED,
    DISABLED,
    FAILED,
    NOT_NEEDED,
    PENDING,
    UNSUPPORTED,
    Patch,
    PatchError,
    Status,
    describe,
    summary,
)

# The record name on every wrapper we install (wrapt keeps ``_self_`` attributes on the proxy, not on the original),
# so a second engine (``importlib.reload(liger_ddp_patch)``) restores its ``__wrapped__`` rather than wrapping it again.
MARK = "_self_liger_ddp_patch"


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


def _distribution_of(module: str) -> str:
    """The (normalised) name of the distribution that installs top-level ``module`` (``liger_kernel``: liger-kernel)."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    names = metadata.packages_distributions().get(module) or [module]
    return canonicalize_name(names[0])


def _below_minimum(record: Patch, version: str | None) -> list[str]:
    """For each module of ``record.requires_min`` installed below the minimum the host declares: what says so."""
    from packaging.version import InvalidVersion, Version

    found = []
    for module, where in record.requires_min:
        host, _, attribute = where.partition(":")
        minimum = getattr(sys.modules.get(host), attribute, None)  # the host imported it: no import of ours
        installed = installed_version(module)
        try:
            below = bool(minimum and installed) and Version(installed) < Version(str(minimum))
        except InvalidVersion:
            below = False
        if below:
            found.append(
                f"{_distribution_of(module)} {installed} is below {record.distribution} {version}'s minimum {minimum}"
            )
    return found


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during, outermost first."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    return seen


def _absent(module: str, exc: BaseException) -> bool:
    """Did importing ``module`` fail because it (or a package above it) does not exist, rather than raise inside?"""
    return any(
        isinstance(e, ModuleNotFoundError) and e.name and (module == e.name or module.startswith(e.name + "."))
        for e in _chain(exc)
    )


def _where(exc: BaseException, frames: int = 2) -> str:
    """The last ``frames`` frames of ``exc``'s traceback outside the import machinery, as ``path:line`` (``path``
    relative to its ``sys.path`` entry), innermost last."""
    import os
    import traceback

    wrapt_importer = getattr(sys.modules.get("wrapt.importer"), "__file__", None) or "<none>"  # our hooks' loader
    skip = (os.path.dirname(os.__file__) + os.sep + "importlib", os.path.dirname(__file__), wrapt_importer)
    roots = sorted((p for p in sys.path if p), key=len, reverse=True)
    shown = []
    for frame in traceback.extract_tb(exc.__traceback__):
        name = frame.filename
        if name.startswith("<") or name.startswith(skip):
            continue
        root = next((r for r in roots if name.startswith(r.rstrip(os.sep) + os.sep)), None)
        shown.append(f"{os.path.relpath(name, root) if root else name}:{frame.lineno}")
    return " <- ".join(reversed(shown[-frames:]))


def _import_error(module: str, version: str | None, distribution: str, exc: BaseException) -> str:
    """What to say about ``module``, installed, raising on import: the root exception and where it came from."""
    root = _chain(exc)[-1]
    text = " ".join(str(root).split()) or "(no message)"
    where = _where(root)
    return f"{module} is in {distribution} {version} but cannot be imported here: {type(root).__name__}: {text}" + (
        f" (raised at {where})" if where else ""
    )


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
        self._by_owner = log.ByObject()  # trainer -> {record name: its run-time decisions} (held weakly)

    # -- public -------------------------------------------------------------------------------------------
    def install(self) -> None:
        """Hook every target module of a record the settings leave on; a module already imported is patched at once."""
        modules = self._modules(live=True)
        if not modules:  # everything off (LIGER_DDP_PATCH_DISABLE=1): not even wrapt is imported
            return
        import wrapt

        for module in modules:
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

    def note(self, name: str, key: str, decision: str, owner: Any = None) -> None:
        """Record a run-time decision of patch ``name`` under ``key`` (a trainer class: :meth:`report` groups by it)
        and, given ``owner`` (the trainer object), for that object alone (:meth:`decisions`). Kept once per distinct
        text, in order; cheap when known."""
        if owner is not None:
            mine = self._by_owner.get(owner)
            if mine is None or decision not in mine.get(name, ()):
                with self._lock:
                    try:
                        said = self._by_owner.setdefault(owner, {}).setdefault(name, [])
                    except TypeError:  # takes no weak reference: kept by its class only
                        said = None
                    if said is not None and decision not in said:
                        said.append(decision)
        seen = self._status[name].runtime.get(key)
        if seen is not None and decision in seen:
            return
        with self._lock:
            self._status[name].runtime.setdefault(key, [])
            if decision not in self._status[name].runtime[key]:
                self._status[name].runtime[key].append(decision)

    def decisions(self, owner: Any) -> dict[str, list[str]]:
        """What the patches decided at run time for this very object (a trainer), by record name: ``{}`` when none
        saw it. :attr:`Status.runtime` groups by class, so it mixes two trainers of one class; this does not."""
        with self._lock:
            return {name: list(said) for name, said in (self._by_owner.get(owner) or {}).items()}

    def resolve_pending(self) -> None:
        """Import every target module still pending, so the report says what would happen in a real run."""
        import importlib

        errors: dict[str, BaseException] = {}
        for module in self._modules():
            if not any(self._status[n].status == PENDING for n, r in self.records.items() if module in r.module):
                continue
            try:
                importlib.import_module(module)
            except PatchError:
                raise
            except Exception as exc:  # absent, or present and raising (the host, or what it imports, is broken)
                errors[module] = exc
        for name, record in self.records.items():
            if self._status[name].status != PENDING:
                continue
            broken = [m for m in record.module if m in errors and not _absent(m, errors[m])]
            if broken:  # installed, but its import raises: the host's code cannot run here
                version = self._status[name].version = installed_version(record.distribution)
                error = _import_error(broken[0], version, record.distribution, errors[broken[0]])
                status, reason = decide_unimportable(record, version, error)
                if status != NOT_NEEDED:  # the traceback itself is not shown: say how to see it
                    reason += f" (the whole traceback: python -c 'import {broken[0]}')"
                self._set(name, status, reason)
                continue
            why = "; ".join(
                f"{m} cannot be imported ({errors[m]}): no such module installed" if m in errors
                else f"{m} was not imported"
                for m in record.module
            )  # fmt: skip
            self._set(name, NOT_NEEDED, f"{why}; nothing to patch")

    def _modules(self, live: bool = False) -> list[str]:
        """The target modules (``live``: of the records the settings leave on)."""
        records = [r for r in self.records.values() if not (live and self._off(r))]
        return list(dict.fromkeys(m for r in records for m in r.module))

    # -- hook ---------------------------------------------------------------------------------------------
    def _on_import(self, module: Any) -> None:
        with self._lock:
            if not self.enabled:
                return
            names = [n for n, r in self.records.items() if module.__name__ in r.module]
            for name in names:
                if name not in self._applied and self._status[name].status != DISABLED:
                    self._patch_one(self.records[name], module)
            statuses = [self._status[n] for n in names]
            log.emit(*summary(module.__name__, statuses))
            bad = [s for s in statuses if s.status in (UNSUPPORTED, FAILED)]
            if bad and self.settings.strict:
                raise PatchError(f"{STRICT}=1 and these patches could not be applied: " + describe(bad))

    def _patch_one(self, record: Patch, module: Any) -> None:
        try:
            self._decide_and_apply(record, module)
        except Exception as exc:  # a bug in a record or a library surprise: never break the host import
            self._set(record.name, FAILED, f"applying raised {type(exc).__name__}: {exc}")

    def _decide_and_apply(self, record: Patch, module: Any) -> None:
        version = self._status[record.name].version = installed_version(record.distribution)
        found = _resolve(module, record.attribute)
        parent = attr = target = mismatch = original = None
        taken_over = False
        if found is not None:
            parent, attr, original = found
            target = f"{getattr(parent, '__name__', parent)}.{attr}"
            taken_over = getattr(original, MARK, None) == record.name  # e.g. importlib.reload(liger_ddp_patch)
            if taken_over:
                original = original.__wrapped__  # start again from the true original, so unpatch() restores it
            mismatch = record.check(original)
        absent = [m for m in record.requires if not _importable(m)] if found is None else []
        too_old = _below_minimum(record, version) if found is None and not absent else []
        status, reason = decide(record, version, target, mismatch, absent, too_old)
        if status == APPLIED:
            self._swap(record, parent, attr, original)
            reason += "; took over from an earlier load of the package" if taken_over else ""
            reason += f"; {record.gate(self.settings)[1]}" if record.gate is not None else ""
        self._set(record.name, status, reason)

    def _swap(self, record: Patch, parent: Any, attr: str, original: Any) -> None:
        replacement = None
        if record.replace is not None:
            import wrapt

            function = record.replace(original, self)

            def call(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:  # a method gets its instance back
                return function(*args, **kwargs) if instance is None else function(instance, *args, **kwargs)

            replacement = wrapt.FunctionWrapper(original, call)
            setattr(replacement, MARK, record.name)
            setattr(parent, attr, replacement)
        self._applied[record.name] = _Applied(parent, attr, original, replacement)

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _off(self, record: Patch) -> str | None:
        """Why the settings turn ``record`` off (``None``: they leave it on)."""
        if record.gate is not None and record.name not in self.settings.disabled:
            return record.gate(self.settings)[0]
        return f"disabled by {DISABLE}" if self.settings.is_disabled(record.name) else None

    def _initial(self, record: Patch) -> Status:
        off = self._off(record)
        if off:
            return Status(record.name, record.target, DISABLED, off)
        return Status(record.name, record.target, PENDING, f"waiting for {' or '.join(record.module)} to be imported")

    def _set(self, name: str, status: str, reason: str) -> None:
        current = self._status[name]
        current.status, current.reason = status, reason

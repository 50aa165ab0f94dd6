"""The package logger: silent while things go to plan, one visible line when the fix takes effect for a trainer.

Users launch ``torchrun`` jobs without configuring :mod:`logging`, so an INFO record would vanish. Like Lightning's
start-up lines, the first use gives the ``liger_ddp_patch`` logger (only that one) a stderr handler when the program
has configured no logging at all, and level INFO unless the user set one. Everything is emitted on rank 0 only.
"""

from __future__ import annotations

import os
import weakref

NAME = "liger_ddp_patch"


class ByObject:
    """Values keyed by an object's identity and held weakly: per trainer (or loss) state that neither keeps it alive
    nor asks it for ``__hash__``/``__eq__`` (a class may define them; two trainers of one class are two keys)."""

    def __init__(self):
        self._items: dict[int, tuple] = {}  # id -> (weak reference, value)

    def get(self, obj: object, default=None):
        item = self._items.get(id(obj))
        return item[1] if item is not None and item[0]() is obj else default

    def setdefault(self, obj: object, value):
        """The value kept for ``obj``, else ``value`` kept from now on (``TypeError``: ``obj`` takes no weak
        reference, so it cannot be tracked)."""
        item = self._items.get(id(obj))
        if item is not None and item[0]() is obj:
            return item[1]
        key = id(obj)
        self._items[key] = (weakref.ref(obj, lambda ref: self._forget(key, ref)), value)
        return value

    def add(self, obj: object) -> bool:
        """Mark ``obj`` seen: whether it was new (``TypeError`` as :meth:`setdefault`)."""
        marker = object()
        return self.setdefault(obj, marker) is marker

    def _forget(self, key: int, ref) -> None:
        item = self._items.get(key)
        if item is not None and item[0] is ref:  # not a newer object that took the same id
            del self._items[key]

    def __len__(self) -> int:
        return len(self._items)


_announced = False  # the once-per-process announcement (no key)
_announced_for = ByObject()  # the trainers that have announced theirs
_warned: set = set()  # the keys warn_once has emitted in this process


def is_main_process() -> bool:
    """Rank 0, local rank 0, or not launched distributed at all (torchrun/accelerate set these variables)."""
    return all(os.environ.get(var) in (None, "", "0") for var in ("RANK", "LOCAL_RANK"))


def get():
    """The package logger, given a handler and a level the first time (``logging`` is imported only here)."""
    import logging

    logger = logging.getLogger(NAME)
    if not getattr(logger, "_liger_ddp_patch_ready", False):
        logger._liger_ddp_patch_ready = True
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        if not logger.handlers and not logging.getLogger().hasHandlers():
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.propagate = False
    return logger


def emit(level: int, message: str, *args: object) -> None:
    """Log on rank 0 only."""
    if is_main_process():
        get().log(level, message, *args)


def announce(message: str, *args: object, key: object = None) -> None:
    """The INFO line that says the fix took effect (rank 0 only): once per ``key`` object (a trainer: a second trainer
    in the process announces its own routing), once per process without one."""
    global _announced
    if key is None:
        if _announced:
            return
        _announced = True
    else:
        try:
            if not _announced_for.add(key):
                return
        except TypeError:  # takes no weak reference: once per class
            if ("announce", type(key)) in _warned:
                return
            _warned.add(("announce", type(key)))
    emit(20, message, *args)  # logging.INFO, without importing logging on the hot path


def warn_once(key: object, message: str, *args: object) -> None:
    """A WARNING line, once per process for each ``key`` (rank 0 only)."""
    if key in _warned:
        return
    _warned.add(key)
    emit(30, message, *args)  # logging.WARNING

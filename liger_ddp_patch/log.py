"""The package logger: silent while things go to plan, one visible line when the fix takes effect.

Users launch ``torchrun`` jobs without configuring :mod:`logging`, so an INFO record would vanish. Like Lightning's
start-up lines, the first use gives the ``liger_ddp_patch`` logger (only that one) a stderr handler when the program
has configured no logging at all, and level INFO unless the user set one. Everything is emitted on rank 0 only.
"""

from __future__ import annotations

import os

NAME = "liger_ddp_patch"
_announced = False
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


def announce(message: str, *args: object) -> None:
    """The one INFO line per process that says the fix took effect (rank 0 only)."""
    global _announced
    if _announced:
        return
    _announced = True
    emit(20, message, *args)  # logging.INFO, without importing logging on the hot path


def warn_once(key: object, message: str, *args: object) -> None:
    """A WARNING line, once per process for each ``key`` (rank 0 only)."""
    if key in _warned:
        return
    _warned.add(key)
    emit(30, message, *args)  # logging.WARNING

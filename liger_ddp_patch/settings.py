"""Environment parsing, in one place.

Every variable is read once, at import. A malformed value never breaks the host program: it produces a warning
that says what was expected and falls back to the default.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import NamedTuple

DISABLE = "LIGER_DDP_PATCH_DISABLE"
VERIFY = "LIGER_DDP_PATCH_VERIFY"
STRICT = "LIGER_DDP_PATCH_STRICT"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class SettingsWarning(UserWarning):
    """A liger_ddp_patch environment variable had a value we could not use."""


class Settings(NamedTuple):
    disable_all: bool = False
    disabled: frozenset[str] = frozenset()
    verify_every: int = 0  # 0: no runtime gradient-sync check
    strict: bool = False

    def is_disabled(self, name: str) -> bool:
        return self.disable_all or name in self.disabled


def _warn(message: str) -> None:
    warnings.warn(message, SettingsWarning, stacklevel=_outside_package())


def _outside_package() -> int:
    """The ``stacklevel`` of the first caller outside this package: the user's ``import`` line (or sitecustomize).

    Counted as ``warnings.warn`` counts: frames of the import machinery (``importlib._bootstrap``) do not count.
    """
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2  # _warn's caller, seen from warnings.warn
    while frame is not None:
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            frame = frame.f_back
            continue
        if not os.path.abspath(name).startswith(package):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def _parse_bool(var: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        _warn(f"{var}={raw!r} is not a boolean; use 1/0 (or true/false). Using the default: off.")
    return False


def _parse_verify(raw: str) -> int:
    value = raw.strip().lower()
    if value in _FALSE:
        return 0
    if value in _TRUE:
        return 100
    try:
        every = int(value)
    except ValueError:
        every = -1
    if every < 0:
        _warn(
            f"{VERIFY}={raw!r} is not understood; use 1 (check every 100 optimizer steps), "
            "a positive integer N (every N steps) or 0. Using the default: off."
        )
        return 0
    return every


def _parse_disable(raw: str, known: frozenset[str]) -> tuple[bool, frozenset[str]]:
    value = raw.strip().lower()
    if value in _FALSE:
        return False, frozenset()
    if value in _TRUE or value == "all":
        return True, frozenset()
    names = {part.strip() for part in value.split(",") if part.strip()}
    unknown = sorted(names - known)
    if unknown:
        _warn(
            f"{DISABLE} names unknown patch(es) {', '.join(unknown)}; valid names are "
            f"{', '.join(sorted(known))} (or 1/all to disable everything). Ignoring the unknown names."
        )
    return False, frozenset(names & known)


def read(known_patches: frozenset[str], environ: dict[str, str] | None = None) -> Settings:
    """Build the settings from the environment (``os.environ`` unless given)."""
    env = os.environ if environ is None else environ
    disable_all, disabled = _parse_disable(env.get(DISABLE, ""), known_patches)
    return Settings(
        disable_all=disable_all,
        disabled=disabled,
        verify_every=_parse_verify(env.get(VERIFY, "")),
        strict=_parse_bool(STRICT, env.get(STRICT, "")),
    )

"""Environment parsing, in one place.

Every variable is read once, at import. A malformed value never breaks the host program: it produces a warning
that says what was expected and falls back to the default.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import NamedTuple

DISABLE = "LIGER_DDP_PATCH_DISABLE"
VERIFY = "LIGER_DDP_PATCH_VERIFY"
STRICT = "LIGER_DDP_PATCH_STRICT"
LOSS = "LIGER_DDP_PATCH_LOSS"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


class SettingsWarning(UserWarning):
    """A liger_ddp_patch environment variable had a value we could not use."""


class LossOptions(NamedTuple):
    """What ``LIGER_DDP_PATCH_LOSS`` sets on the chunked losses the DDP swap builds (``None``: the loss's default)."""

    one_pass: bool | None = None
    token_chunk_size: int | None = None
    sweep: str | None = None
    autocast: bool | None = None  # the routed Liger path under the Trainer's mixed-precision autocast (default: on)

    def overrides(self) -> dict:
        """The keyword arguments of ``ChunkedDPOLoss`` / ``ChunkedKTOLoss`` that the variable sets."""
        return {k: v for k, v in self._asdict().items() if v is not None}

    def describe(self) -> str:
        one_pass = "auto (default)" if self.one_pass is None else str(int(self.one_pass))
        chunk = "auto (default)" if self.token_chunk_size is None else str(self.token_chunk_size)
        sweep = "eager (default)" if self.sweep is None else self.sweep
        autocast = "1 (default)" if self.autocast is None else str(int(self.autocast))
        return f"one_pass={one_pass}, token_chunk_size={chunk}, sweep={sweep}, autocast={autocast}"


class Settings(NamedTuple):
    disable_all: bool = False
    disabled: frozenset[str] = frozenset()
    verify_every: int = 0  # N > 0: check gradient sync at the first optimizer step and every N after, raising
    check_first: bool = True  # LIGER_DDP_PATCH_VERIFY unset: check once, at the first step, and warn (not raise)
    strict: bool = False
    loss: LossOptions = LossOptions()

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
    """N for the periodic check (1/true: 100); 0 for none, or for the default once-only check when unset."""
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
            "a positive integer N (every N steps) or 0 (no check at all). Using the default: one check at the first "
            "optimizer step."
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


_LOSS_USAGE = (
    f"expected comma-separated key=value: one_pass=0|1 (0: the two-pass loss, no gradient held from the forward to "
    f"the backward; 1: always one pass, a long pair's (V, H) sums whatever they cost; default: one pass within the "
    f"held budget, its chunk widened to a long row where the sums would not fit, else two), token_chunk_size=<positive "
    f"integer> (loss tokens per chunk), sweep=eager|triton (triton: "
    f"the softmax and gradient sweep as Triton kernels, CUDA only), autocast=0|1 (0: TRL's Liger path without the "
    f"Trainer's mixed-precision autocast, as TRL 1.9-1.13 run it), e.g. "
    f"{LOSS}=one_pass=0,token_chunk_size=1024"
)


@functools.lru_cache(maxsize=8)
def parse_loss(raw: str) -> LossOptions:
    """``LIGER_DDP_PATCH_LOSS``'s value; each malformed or unknown key warns once and keeps its default."""
    options: dict = {}
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        key, sep, value = (x.strip() for x in part.partition("="))
        key = key.lower()
        if not sep or key not in LossOptions._fields:
            _warn(f"{LOSS}={raw!r}: {part!r} is not a known key=value; {_LOSS_USAGE}. Ignoring {part!r}.")
        elif key in ("one_pass", "autocast") and value.lower() in _TRUE | _FALSE - {""}:
            options[key] = value.lower() in _TRUE
        elif key == "token_chunk_size" and value.isdigit() and int(value) > 0:
            options[key] = int(value)
        elif key == "sweep" and value.lower() in ("eager", "triton"):
            options[key] = value.lower()
        else:
            _warn(f"{LOSS}={raw!r}: {key}={value!r} is not valid; {_LOSS_USAGE}. Using the default for {key}.")
    return LossOptions(**options)


def loss_options(environ: dict[str, str] | None = None) -> LossOptions:
    """The loss options from the environment (``os.environ`` unless given), parsed (and warned about) once per
    distinct value: the DDP swap reads them when it builds a loss, ``status`` when it reports."""
    env = os.environ if environ is None else environ
    return parse_loss(env.get(LOSS, "").strip())


def read(known_patches: frozenset[str], environ: dict[str, str] | None = None) -> Settings:
    """Build the settings from the environment (``os.environ`` unless given)."""
    env = os.environ if environ is None else environ
    disable_all, disabled = _parse_disable(env.get(DISABLE, ""), known_patches)
    return Settings(
        disable_all=disable_all,
        disabled=disabled,
        verify_every=_parse_verify(env.get(VERIFY, "")),
        check_first=env.get(VERIFY, "").strip().lower() not in _FALSE - {""},
        strict=_parse_bool(STRICT, env.get(STRICT, "")),
        loss=loss_options(env),
    )

"""Small helpers for shape checks: read an original's source and say, in words, what no longer matches."""

from __future__ import annotations

import inspect
import re
from typing import Any


def source_of(obj: Any) -> str | None:
    """The object's source with all whitespace collapsed (``None`` when Python cannot find it)."""
    try:
        return re.sub(r"\s+", " ", inspect.getsource(obj))
    except (OSError, TypeError):
        return None


def parameters(func: Any) -> tuple[str, ...]:
    return tuple(inspect.signature(func).parameters)


def missing(source: str, required: dict[str, str]) -> str | None:
    """The description of the first required snippet absent from ``source``."""
    for snippet, description in required.items():
        if snippet not in source:
            return f"{description} is gone (looked for `{snippet}`)"
    return None

"""Is this a PEFT model? Asked without importing peft: a model cannot be one unless peft is already loaded."""

from __future__ import annotations

import sys
from typing import Any


def is_peft_model(model: Any) -> bool:
    """As TRL decides it (accelerate's ``is_peft_model``): a ``PeftModel`` (or ``PeftMixedModel``) instance."""
    peft = sys.modules.get("peft")
    kinds = tuple(getattr(peft, n) for n in ("PeftModel", "PeftMixedModel") if hasattr(peft, n)) if peft else ()
    return bool(kinds) and isinstance(model, kinds)

"""Say, once per setting, what TRL's Liger path is about to drop or compute differently (the facts:
:mod:`.liger_settings`).

The replacement wraps the trainer's ``__init__`` and reads the call's arguments *before* TRL's own ``__init__`` runs,
so the exo_pair warning comes before Liger's "label_smoothing must be > 0" error. It only reads: the trainer TRL
builds, its loss and every number it computes stay TRL's own, in every setup (one process, DDP, DeepSpeed, ...).
Reading a setting that fails is recorded and the original still runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ..log import warn_once
from . import _shape, liger_settings
from .trainers import TrainerSpec

_PARAMETERS = (
    "model",
    "args",
)  # what every reader needs from the call (ref_model/peft_config: where the trainer has them)


def checker(spec: TrainerSpec) -> Callable[[Any], str | None]:
    """The shape check: an ``__init__`` that takes the arguments we read and builds one of ``spec``'s fused losses."""

    def check(original: Any) -> str | None:
        if not callable(original):
            return f"__init__ is a {type(original).__name__}, not a function"
        missing = [p for p in _PARAMETERS if p not in _shape.parameters(original)]
        if missing:
            return f"{spec.trainer}.__init__ takes no {missing}"
        source = _shape.source_of(original)
        if source is None:
            return "the source of __init__ is not available, so what it builds cannot be verified"
        if not any(f"{name}(" in source for name in spec.fused):
            return f"{spec.trainer}.__init__ builds none of {list(spec.fused)} (the fused loss whose settings we check)"
        return None

    return check


def replacer(spec: TrainerSpec) -> Callable[[Any, Any], Any]:
    """The ``replace`` of ``spec``'s liger_settings record (``engine``: where the warnings are recorded)."""
    name = spec.liger_settings_patch

    def replace(original: Any, engine: Any) -> Any:
        from ..engine import installed_version

        signature = inspect.signature(original)
        trl, liger = installed_version("trl"), installed_version("liger-kernel")
        # the installed releases are fixed once the hook fires: keep only the facts true of them
        facts = [f for f in liger_settings.facts(spec.name) if liger_settings.dropped_in(f, trl, liger)]

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            trainer = type(self).__name__
            try:
                bound = signature.bind_partial(self, *args, **kwargs).arguments
                config = bound.get("args")
                if config is not None and getattr(config, "use_liger_kernel", False):
                    call = liger_settings.Call(
                        config, bound.get("model"), bound.get("ref_model"), bound.get("peft_config")
                    )
                    for fact in facts:
                        shown = fact.read(call)
                        if shown is not None:
                            text = liger_settings.message(fact, trainer, trl, shown)
                            engine.note(name, trainer, text, owner=self)
                            warn_once((trainer, fact.setting), text)
            except Exception as exc:  # never break the user's script over a warning
                said = f"settings not checked: reading them raised {type(exc).__name__}: {exc}"
                engine.note(name, trainer, said, owner=self)
            original(self, *args, **kwargs)

        return __init__

    return replace

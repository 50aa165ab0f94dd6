"""Find the ``DistributedDataParallel`` module a Trainer's model runs through, whatever is wrapped around it.

``compute_loss`` receives what ``accelerator.prepare`` returned. With ``torch_compile=True`` (or accelerate's dynamo
plugin) that is ``torch.compile(ddp)``, an ``OptimizedModule`` whose ``forward`` calls the DDP module; with regional
compilation (``use_regional_compilation``) it is a shallow copy of the DDP module whose repeated blocks are compiled.
Accelerate's ``unwrap_model(model)`` (``keep_torch_compile=True``, what TRL calls) re-seats a compiled model's
``_orig_mod`` on the innermost module and returns the compiled model itself, so TRL's ``model is not unwrapped_model``
(its 1.14 fix) is false and ``_orig_mod`` stops naming the DDP module after the first step. The ``forward`` that
``torch.compile`` bound at construction still calls it, so we read the DDP module from there.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

COMPILED = "compiled"  # torch.compile around the DDP module
REGIONS = "compiled regions"  # accelerate's regional compilation of the DDP module's blocks


class Found(NamedTuple):
    ddp: Any  # the DistributedDataParallel module the call must go through
    how: str  # "" (the model is the DDP module), COMPILED or REGIONS

    @property
    def inner(self) -> Any:
        """The module DDP wraps: what the loss runs on, inside DDP's forward."""
        return self.ddp.module


def _optimized_module() -> type | None:
    """``torch._dynamo``'s ``OptimizedModule``, only if something imported it (no model is compiled otherwise)."""
    module = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(module, "OptimizedModule", None)


def _callees(compiled: Any) -> list[Any]:
    """What an ``OptimizedModule`` calls: its ``_orig_mod``, then the objects its bound ``forward`` wraps."""
    found = [vars(compiled).get("_modules", {}).get("_orig_mod")]
    for name in ("forward", "_forward"):
        func = vars(compiled).get(name)
        for _ in range(8):  # functools.wraps chains: the dynamo context's wrapper, wrap_inline's
            if func is None:
                break
            found.append(getattr(func, "__self__", None))  # a bound ddp.__call__
            found.append(func)  # wrap_inline's wrapper wraps the module itself
            func = getattr(func, "__wrapped__", None)
    return found


def find(model: Any) -> Found | None:
    """The DDP module ``model``'s forward goes through, or ``None`` (not distributed by DDP: left to TRL)."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return Found(model, REGIONS if "_orig_mod" in vars(model) else "")
    compiled = _optimized_module()
    if compiled is None or not isinstance(model, compiled):
        return None
    for candidate in _callees(model):
        if isinstance(candidate, DistributedDataParallel):
            return Found(candidate, COMPILED)
    return None


def ignored(module: Any) -> frozenset[str]:
    """The parameter names a DDP module does not synchronise (its ``parameters_to_ignore``), or that a module asks
    DDP to leave alone (``_ddp_params_and_buffers_to_ignore``); empty for anything else."""
    names = getattr(module, "parameters_to_ignore", None)
    if names is None:
        names = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
    try:
        return frozenset(str(n) for n in names or ())
    except TypeError:
        return frozenset()

"""Route the Liger loss through the distributed wrapper's ``forward`` (TRL issue #7245).

TRL 1.9.0-1.13.0 call ``_compute_loss_liger`` on the unwrapped model unless ZeRO-3 or FSDP is on, so under plain
DDP ``DistributedDataParallel.forward()`` never runs, its reducer is never armed and gradients are never all-reduced.
Upstream's fix (TRL 1.14.0; PRs #7243 and #7247) redirects whenever ``model is not unwrapped_model``. We do the same,
by calling the *original* ``compute_loss`` inside the wrapper's forward: everything else it does (the non-Liger path,
the ZeRO-3/FSDP redirect, the re-raised image-token ``ValueError``) stays exactly TRL's own code.
"""

from __future__ import annotations

import functools
from typing import Any

from . import _shape

# What the 1.9.0-1.13.0 method looks like; each entry is one thing our replacement relies on.
_BROKEN_SHAPE = {
    "if self.use_liger_kernel:": "the `use_liger_kernel` branch",
    "unwrapped_model = self.accelerator.unwrap_model(model)": "the unwrap of the model",
    "if is_zero3 or self.is_fsdp_enabled:": "the ZeRO-3/FSDP-only redirect guard",
    "self._forward_redirection(": "the `_forward_redirection` call",
    "return self._compute_loss_liger(unwrapped_model, inputs, return_outputs)": "the unredirected Liger call",
}
_SIGNATURE = ("self", "model", "inputs", "return_outputs", "num_items_in_batch")


def check(original: Any) -> str | None:
    if not callable(original):
        return f"compute_loss is a {type(original).__name__}, not a function"
    if _shape.parameters(original) != _SIGNATURE:
        return f"compute_loss takes {_shape.parameters(original)}, expected {_SIGNATURE}"
    source = _shape.source_of(original)
    if source is None:
        return "the source of compute_loss is not available, so its shape cannot be verified"
    if "model is not unwrapped_model" in source:
        return "compute_loss already redirects when `model is not unwrapped_model` (upstream's fix)"
    return _shape.missing(source, _BROKEN_SHAPE)


def _is_sharded(trainer: Any) -> bool:
    """ZeRO-3 or FSDP: the original already redirects those itself."""
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return bool(trainer.is_fsdp_enabled) or (plugin is not None and plugin.zero_stage == 3)


def replace(original: Any) -> Any:
    from .chunked_loss import adopt_stale_loss

    @functools.wraps(original)
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if getattr(self, "use_liger_kernel", False):
            adopt_stale_loss(self)
            unwrapped = self.accelerator.unwrap_model(model)
            if model is not unwrapped and not _is_sharded(self):
                # Inside the wrapper's forward the original sees an unwrapped model and takes its plain Liger path.
                def run(unwrapped_model, inputs, return_outputs):
                    return original(self, unwrapped_model, inputs, return_outputs, num_items_in_batch)

                return self._forward_redirection(model, unwrapped, run, unwrapped, inputs, return_outputs)
        return original(self, model, inputs, return_outputs, num_items_in_batch)

    return compute_loss

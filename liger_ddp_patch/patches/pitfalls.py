"""Name a setup DDP itself rejects before its error does: with the package on, users would blame the package.

A ``PeftModel`` makes transformers' Trainer build DDP with ``find_unused_parameters=True`` (its default for a model
that is not a ``PreTrainedModel``). With *reentrant* gradient checkpointing, DDP then fails in backward with
``Expected to mark a variable ready only once`` -- with ``use_liger_kernel=False`` as well. TRL's unpatched Liger path
never enters ``DistributedDataParallel.forward``, so the same job "ran" without synchronising its gradients; routed
through the wrapper, it reaches DDP's check.
"""

from __future__ import annotations

from typing import Any

from ..log import warn_once
from ._peft import is_peft_model

MESSAGE = (
    "liger_ddp_patch: DistributedDataParallel will fail in backward with 'Expected to mark a variable ready only "
    "once': this PeftModel uses reentrant gradient checkpointing and DDP was built with find_unused_parameters=True "
    "(Trainer's default for a PeftModel). DDP rejects this combination with or without Liger (use_liger_kernel=False "
    "fails the same way); without this package TRL's Liger path never armed DDP, so its gradients were never "
    'synchronised. Fix: gradient_checkpointing_kwargs={"use_reentrant": False}, or ddp_find_unused_parameters=False.'
)
NOTE = "DDP will reject reentrant checkpointing of a PeftModel with find_unused_parameters=True (warned)"


def reentrant_checkpointing(model: Any) -> bool:
    """Whether a module of ``model`` checkpoints with torch's reentrant variant.

    transformers records the choice as the keywords of each checkpointing module's ``_gradient_checkpointing_func``
    (a ``functools.partial`` of ``torch.utils.checkpoint.checkpoint``; PEFT leaves the base model's modules as they
    are); torch treats a missing ``use_reentrant`` as reentrant.
    """
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) is True and func is not None:
            if (getattr(func, "keywords", None) or {}).get("use_reentrant", True) is not False:
                return True
    return False


def ddp_rejects(wrapper: Any, model: Any) -> bool:
    """The combination DDP cannot run: find_unused_parameters=True, a PeftModel, reentrant checkpointing."""
    return (
        getattr(wrapper, "find_unused_parameters", False) is True
        and is_peft_model(model)
        and reentrant_checkpointing(model)
    )


def warn(wrapper: Any, model: Any) -> str | None:
    """Warn once per process (rank 0) when DDP will reject this setup; the note for the report, else ``None``."""
    if not ddp_rejects(wrapper, model):
        return None
    warn_once(NOTE, MESSAGE)
    return NOTE

"""Give DDP trainers our chunked losses in place of the fused ones TRL built.

The fused DPO/KTO losses (Liger's ``LigerFusedLinear{DPO,KTO}Loss``; TRL 1.13's vendored
``trl.losses.FusedLinear{DPO,KTO}Loss``) run ``torch.func.grad_and_value`` under ``torch.compile``. Inside
``DistributedDataParallel.forward`` (where the compute_loss patch now runs them) that raises
``NotImplementedError: Cannot access storage of TensorWrapper`` once the vocabulary is real-size. Upstream moved DPO to
a chunked log-prob path for the same reason (TRL PR #7243).

Nothing is replaced at import: the record only checks the fused class and is *armed*; a trainer's loss object is swapped
(settings kept) the first time that trainer computes a loss under DistributedDataParallel (:func:`swap`, called by
the compute_loss patch). One process, DataParallel, DeepSpeed and FSDP keep TRL's own loss object.
"""

from __future__ import annotations

from typing import Any

from .. import environment
from . import _shape
from .trainers import TrainerSpec


def checker(spec: TrainerSpec):
    """The shape check of ``spec``'s fused loss: ours must accept every setting and the forward it is called with."""

    def check(original: Any) -> str | None:
        import torch

        if not (isinstance(original, type) and issubclass(original, torch.nn.Module)):
            return f"{original!r} is not an nn.Module class"
        ours = spec.loss_class()
        unknown = [p for p in _shape.parameters(original.__init__)[1:] if p not in _shape.parameters(ours.__init__)]
        if unknown:
            return f"{original.__name__}() takes {unknown}, which {ours.__name__} does not implement"
        theirs = _shape.parameters(original.forward)[1:]
        if _shape.parameters(ours.forward)[1 : len(theirs) + 1] != theirs:
            return f"{original.__name__}.forward{theirs} no longer matches {ours.__name__}.forward"
        return None

    return check


def swap(trainer: Any, fused: type | None, spec: TrainerSpec) -> str:
    """Give ``trainer`` our loss in place of its fused one (settings kept); say what happened, for the record.

    Called only when the trainer runs under DistributedDataParallel, so every other configuration keeps TRL's own
    loss object. ``fused`` is the class ``spec``'s chunked-loss record checked (``None`` when it is not applied). The
    fused loss has no ``one_pass`` / ``token_chunk_size``: ``LIGER_DDP_PATCH_LOSS`` sets them (read here, at the swap).
    """
    attribute = spec.loss_attribute(trainer)
    if attribute is None:
        return "no fused loss to swap"
    loss, ours, patch = getattr(trainer, attribute), spec.loss_class(), spec.chunked_loss_patch
    if isinstance(loss, ours):
        return getattr(loss, _SWAPPED, f"loss {ours.__name__}")
    if fused is None:
        return f"fused loss {type(loss).__name__} kept ({patch} is not applied)"
    if type(loss) is not fused:
        return f"loss {type(loss).__name__} kept (not the {fused.__name__} that {patch} checked)"
    accepted = _shape.parameters(ours.__init__)[1:]
    kept = {p: getattr(loss, p) for p in accepted if hasattr(loss, p)}
    options = {k: v for k, v in environment.loss_options().overrides().items() if k in accepted}
    replacement = ours(**kept, **options)
    said = f"fused loss {fused.__name__} → {ours.__name__}"
    if options:
        said += (
            f" ({environment.LOSS}: {', '.join(f'{k}={int(v) if type(v) is bool else v}' for k, v in options.items())})"
        )
    setattr(replacement, _SWAPPED, said)
    setattr(trainer, attribute, replacement)
    return said


_SWAPPED = "_liger_ddp_patch_swapped"  # what swap() said when it made this loss: later calls say the same

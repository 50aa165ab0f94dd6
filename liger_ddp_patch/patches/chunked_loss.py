"""Build our chunked losses where TRL builds Liger's fused ones.

The fused DPO/KTO losses (Liger's ``LigerFusedLinear{DPO,KTO}Loss``; TRL 1.13's vendored
``trl.losses.FusedLinear{DPO,KTO}Loss``) run ``torch.func.grad_and_value`` under ``torch.compile``. Inside
``DistributedDataParallel.forward`` (where the compute_loss patch now runs them) that raises
``NotImplementedError: Cannot access storage of TensorWrapper`` once the vocabulary is real-size. Upstream moved DPO to
a chunked log-prob path for the same reason (TRL PR #7243). We replace the name the trainer module constructs,
so trainers built afterwards get :mod:`liger_ddp_patch.losses`; a trainer built before is converted on its next
``compute_loss`` (see :func:`adopt_stale_loss`).
"""

from __future__ import annotations

from typing import Any

from . import _shape


def _ours(kind: str) -> type:
    from .. import losses

    return {"dpo": losses.ChunkedDPOLoss, "kto": losses.ChunkedKTOLoss}[kind]


def _checker(kind: str):
    def check(original: Any) -> str | None:
        import torch

        if not (isinstance(original, type) and issubclass(original, torch.nn.Module)):
            return f"{original!r} is not an nn.Module class"
        ours = _ours(kind)
        unknown = [p for p in _shape.parameters(original.__init__)[1:] if p not in _shape.parameters(ours.__init__)]
        if unknown:
            return f"{original.__name__}() takes {unknown}, which {ours.__name__} does not implement"
        theirs = _shape.parameters(original.forward)[1:]
        if _shape.parameters(ours.forward)[1 : len(theirs) + 1] != theirs:
            return f"{original.__name__}.forward{theirs} no longer matches {ours.__name__}.forward"
        return None

    return check


def _replacer(kind: str):
    def replace(original: Any) -> type:
        return _ours(kind)

    return replace


dpo_check, dpo_replace = _checker("dpo"), _replacer("dpo")
kto_check, kto_replace = _checker("kto"), _replacer("kto")


# Where each release keeps the fused loss it built: ``liger_loss`` (1.8.0+), ``liger_loss_fn`` (DPO before 1.8.0, KTO
# 1.6.0-1.7.1), ``kto_loss_fn`` (KTO 1.0.0-1.5.1). See trl_versions.LINES.
LOSS_ATTRIBUTES = ("liger_loss", "liger_loss_fn", "kto_loss_fn")


def adopt_stale_loss(trainer: Any) -> None:
    """Swap a fused loss built before the patch for ours, keeping its settings (cheap no-op otherwise)."""
    attribute = next((a for a in LOSS_ATTRIBUTES if getattr(trainer, a, None) is not None), None)
    if attribute is None:
        return
    loss = getattr(trainer, attribute)
    if type(loss).__module__.startswith("liger_ddp_patch."):
        return
    from .. import _engine

    for name, kind in (("dpo_chunked_loss", "dpo"), ("kto_chunked_loss", "kto")):
        original = _engine.original(name)
        if original is not None and type(loss) is original:
            ours = _ours(kind)
            settings = {p: getattr(loss, p) for p in _shape.parameters(ours.__init__)[1:] if hasattr(loss, p)}
            setattr(trainer, attribute, ours(**settings))
            import logging

            logging.getLogger("liger_ddp_patch").info("liger_ddp_patch: replaced the %s built before the patch with %s", original.__name__, ours.__name__)
            return

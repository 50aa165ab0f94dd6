"""The one table of what we patch. Each record is data; the modules beside this one hold the checks and fixes."""

from __future__ import annotations

from ..engine import Patch
from . import chunked_loss, compute_loss

TRL_DPO = ("trl.trainer.dpo_trainer",)
TRL_KTO = ("trl.trainer.kto_trainer",)

# Releases whose trainer code we have read (wheel by wheel). A version not listed is "unknown": the shape check decides.
TRL_RELEASES = (
    "1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0", "1.5.0", "1.5.1", "1.6.0", "1.7.0", "1.7.1", "1.8.0",
    "1.9.0", "1.9.1", "1.9.2", "1.10.0", "1.11.0", "1.12.0", "1.13.0",
    "1.14.0", "1.14.1", "1.14.2", "1.15.0", "1.16.0",
)  # fmt: skip
AFFECTED = ">=1.9.0,<1.14.0"  # the ZeRO-3/FSDP-only guard (introduced by TRL #6372, fixed by #7243/#7247)
FIXED_IN = "1.14.0"

_COMMON = dict(distribution="trl", affected=AFFECTED, fixed_in=FIXED_IN, releases=TRL_RELEASES)

PATCHES = (
    Patch(
        name="dpo_compute_loss",
        module=TRL_DPO,
        attribute=("DPOTrainer.compute_loss",),
        check=compute_loss.check,
        replace=compute_loss.replace,
        summary="Liger DPO loss routed through the DDP wrapper's forward",
        **_COMMON,
    ),
    Patch(
        name="kto_compute_loss",
        module=TRL_KTO,
        attribute=("KTOTrainer.compute_loss",),
        check=compute_loss.check,
        replace=compute_loss.replace,
        summary="Liger KTO loss routed through the DDP wrapper's forward",
        **_COMMON,
    ),
    Patch(
        name="dpo_chunked_loss",
        module=TRL_DPO,
        attribute=("LigerFusedLinearDPOLoss", "FusedLinearDPOLoss"),
        check=chunked_loss.dpo_check,
        replace=chunked_loss.dpo_replace,
        summary="fused DPO loss replaced by liger_ddp_patch.losses.ChunkedDPOLoss",
        **_COMMON,
    ),
    Patch(
        name="kto_chunked_loss",
        module=TRL_KTO,
        attribute=("LigerFusedLinearKTOLoss", "FusedLinearKTOLoss"),
        check=chunked_loss.kto_check,
        replace=chunked_loss.kto_replace,
        summary="fused KTO loss replaced by liger_ddp_patch.losses.ChunkedKTOLoss",
        **_COMMON,
    ),
)

NAMES = frozenset(p.name for p in PATCHES)

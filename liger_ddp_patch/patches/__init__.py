"""The one table of what we patch. Each record is data; the modules beside this one hold the checks and fixes."""

from __future__ import annotations

from ..engine import Patch
from . import chunked_loss, compute_loss, trl_versions

TRL_DPO = (trl_versions.DPO_MODULE,)
# KTOTrainer is defined in trl.experimental.kto.kto_trainer in 1.0.0-1.7.1 (trl.trainer.kto_trainer re-exports a
# subclass there) and in trl.trainer.kto_trainer from 1.8.0 (trl.experimental.kto re-exports it). Whichever defines the
# class is patched; in the other, the attribute is not the class's own and the record is already applied.
TRL_KTO = (trl_versions.KTO_STABLE, trl_versions.KTO_EXPERIMENTAL)

# Releases whose trainer code we have read (wheel by wheel), the affected range (1.0.0 up to the upstream fix:
# before 1.9.0 the DDP wrapper crashes the Liger path, 1.9.0-1.13.0 skip the all-reduce) and the fix: all from
# trl_versions, which the docs table and the version tests read too. Any other version is "unknown": shape decides.
_COMMON = dict(
    distribution="trl", affected=trl_versions.AFFECTED, fixed_in=trl_versions.FIXED_IN, releases=trl_versions.RELEASES
)

PATCHES = (
    Patch(
        name="dpo_compute_loss",
        module=TRL_DPO,
        attribute=("DPOTrainer.compute_loss",),
        check=compute_loss.check,
        replace=compute_loss.replacer("dpo_compute_loss", "dpo_chunked_loss", chunked_loss.dpo_ours),
        summary="routes the Liger DPO loss of trainers that run under DistributedDataParallel through the wrapper's "
        "forward; every other setup runs TRL's own code",
        **_COMMON,
    ),
    Patch(
        name="kto_compute_loss",
        module=TRL_KTO,
        attribute=("KTOTrainer.compute_loss",),
        check=compute_loss.check,
        replace=compute_loss.replacer("kto_compute_loss", "kto_chunked_loss", chunked_loss.kto_ours),
        summary="routes the Liger KTO loss of trainers that run under DistributedDataParallel through the wrapper's "
        "forward; every other setup runs TRL's own code",
        **_COMMON,
    ),
    Patch(
        name="dpo_chunked_loss",
        module=TRL_DPO,
        attribute=("LigerFusedLinearDPOLoss", "FusedLinearDPOLoss"),
        check=chunked_loss.dpo_check,
        replace=None,  # armed: the compute_loss patch swaps a DDP trainer's loss object at run time
        requires=("liger_kernel",),  # 1.0.0-1.12.0 import the fused loss only when liger-kernel is installed
        summary="swaps the fused loss of DPO trainers that run under DistributedDataParallel for ChunkedDPOLoss",
        **_COMMON,
    ),
    Patch(
        name="kto_chunked_loss",
        module=TRL_KTO,
        attribute=("LigerFusedLinearKTOLoss", "FusedLinearKTOLoss"),
        check=chunked_loss.kto_check,
        replace=None,  # armed: the compute_loss patch swaps a DDP trainer's loss object at run time
        requires=("liger_kernel",),  # 1.0.0-1.12.0 import the fused loss only when liger-kernel is installed
        summary="swaps the fused loss of KTO trainers that run under DistributedDataParallel for ChunkedKTOLoss",
        **_COMMON,
    ),
)

NAMES = frozenset(p.name for p in PATCHES)

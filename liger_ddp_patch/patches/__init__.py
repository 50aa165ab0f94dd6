"""The patch records, up to four per trainer spec: route its compute_loss under DDP, route a compiled DDP model in the
releases whose own redirect misses it (DPO/KTO 1.14.x), arm the swap of its fused loss (DPO/KTO), and say which of
the user's settings TRL's Liger path drops (a warning only). Beside them, the gradient check every transformers
Trainer gets (:mod:`.verifier`)."""

from __future__ import annotations

from ..engine import Patch
from . import chunked_loss, compute_loss, kl_logps, liger_settings, settings_warning, trl_versions, verifier
from .trainers import SPECS, TrainerSpec


def _record(spec: TrainerSpec, **fields) -> Patch:
    """A record on the spec's trainer modules.  Releases whose trainer code we have read, the spec's affected range
    and its fix (unless ``fields`` name their own): a release outside RELEASES is "unknown", and the shape check
    decides."""
    fields.setdefault("affected", spec.affected or trl_versions.AFFECTED)
    fields.setdefault("fixed_in", spec.fixed_in or trl_versions.FIXED_IN)
    return Patch(module=spec.hooked_modules, distribution="trl", releases=trl_versions.RELEASES, **fields)


def records(spec: TrainerSpec) -> tuple[Patch, ...]:
    """The spec's records: its compute_loss always; the 1.14.x compiled-model route and the loss swap (DPO/KTO) and the
    chunked KL log-probs (KTO) when it has them; the settings warning when some release of its Liger path drops or
    changes a setting (:mod:`.liger_settings`)."""
    label, ours = spec.name.upper().replace("_", "-"), spec.loss
    found = [
        _record(
            spec,
            name=spec.compute_loss_patch,
            attribute=(f"{spec.trainer}.compute_loss",),
            check=compute_loss.checker(spec),
            replace=compute_loss.replacer(spec),
            summary=f"routes the Liger {label} loss of trainers that run under DistributedDataParallel through the "
            "wrapper's forward; every other setup runs TRL's own code",
        )
    ]
    if spec.compiled_hole:
        affected, fixed_in = spec.compiled_hole
        found.append(
            _record(
                spec,
                name=spec.compiled_patch,
                attribute=(f"{spec.trainer}.compute_loss",),
                check=compute_loss.compiled_checker,
                replace=compute_loss.replacer(spec, compiled_only=True),
                summary=f"routes the Liger {label} loss of a compiled model (torch_compile=True) through the "
                "DistributedDataParallel module inside it; every other setup runs TRL's own code",
                affected=affected,
                fixed_in=fixed_in,
                before=f"{spec.compute_loss_patch} handles it",
            )
        )
    if spec.loss:
        found.append(
            _record(
                spec,
                name=spec.chunked_loss_patch,
                attribute=spec.fused,
                check=chunked_loss.checker(spec),
                replace=None,  # armed: the compute_loss patch swaps a DDP trainer's loss object at run time
                requires=("liger_kernel",),  # 1.0.0-1.12.0 import the fused loss only when liger-kernel is installed
                # ... and at least this version (0.7.0 in 1.0-1.1, 0.8.0 in 1.5-1.10, 0.8.2 from 1.12: read, not kept)
                requires_min=(("liger_kernel", "trl.import_utils:LIGER_KERNEL_MIN_VERSION"),),
                summary=f"swaps the fused loss of {label} trainers that run under DistributedDataParallel for {ours}",
            )
        )
    if spec.kl_rows:
        affected, fixed_in = spec.kl_rows
        found.append(
            _record(
                spec,
                name=spec.kl_logps_patch,
                attribute=(f"{spec.trainer}._compute_kl_logps",),
                check=kl_logps.check,
                replace=None,  # armed: the compute_loss patch gives a DDP trainer the chunked KL for each routed call
                summary=f"computes the KL rows' log-probs of {label} trainers that run under DistributedDataParallel "
                "through the chunked head, without their (B, L, V) logits, as TRL 1.14 does",
                affected=affected,
                fixed_in=fixed_in,
                before="its KL rows run the whole model, as with use_liger_kernel=False: nothing to chunk",
            )
        )
    if liger_settings.facts(spec.name):
        found.append(
            _record(
                spec,
                name=spec.liger_settings_patch,
                attribute=(f"{spec.trainer}.__init__",),
                check=settings_warning.checker(spec),
                replace=settings_warning.replacer(spec),
                summary=f"warns once per setting that TRL's Liger {label} loss drops or computes differently; changes "
                "nothing",
            )
        )
    return tuple(found)


PATCHES = tuple(record for spec in SPECS for record in records(spec))  # TRL's: one trainer spec's each
RECORDS = (*PATCHES, verifier.RECORD)  # what the engine runs: a row each in report() and `liger-ddp-patch status`
NAMES = frozenset(p.name for p in RECORDS)  # and what LIGER_DDP_PATCH_DISABLE accepts

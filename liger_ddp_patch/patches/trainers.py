"""One spec per TRL trainer we fix: where it lives, how its code is shaped release by release, which loss it builds.

The patch records (``patches/__init__.py``), the run-time loss swap, the docs table and the demo probe all loop over
:data:`SPECS`. Supporting one more trainer is one spec here, plus one loss module in :mod:`liger_ddp_patch.losses`
when its fused loss cannot run inside DDP's forward (DPO/KTO; the JSD loss of GKD, GOLD and Distillation can);
a release is placed by the first release of each range, so one more TRL release with a known shape is one entry in
:data:`liger_ddp_patch.patches.trl_versions.RELEASES`. Every fact was read from the released wheels.
"""

from __future__ import annotations

from typing import NamedTuple


def _at(table: tuple[tuple[str, str], ...], version: str) -> str:
    """The value of the last ``(first release, value)`` row at or before ``version``."""
    from packaging.version import Version

    rows = [value for first, value in table if Version(first) <= Version(version)]
    if not rows:
        raise KeyError(f"TRL {version} predates {table[0][0]}, the first release this spec describes")
    return rows[-1]


class TrainerSpec(NamedTuple):
    name: str  # short name, the prefix of its patch names: dpo -> dpo_compute_loss, dpo_chunked_loss
    trainer: str  # the class name in TRL
    config: str  # its config class, importable from the trainer's module
    # the TRL dataset type it trains on: "preference" (chosen/rejected), "unpaired" (completion/label) or "messages"
    # (a conversation; the distillation trainers, which also take a teacher model)
    dataset: str
    modules: tuple[tuple[str, str], ...]  # (first release, the module that defines the trainer class)
    shapes: tuple[tuple[str, str], ...]  # (first release, compute_loss shape: a key of compute_loss.SHAPES, or "fixed")
    fused: tuple[str, ...] = ()  # the names the trainer module gives the fused loss class (Liger's; TRL 1.13's own)
    loss_attributes: tuple[str, ...] = ()  # where the trainer keeps the fused loss object it built (any release)
    loss: str = ""  # our replacement, a class in liger_ddp_patch.losses ("": the fused loss runs in DDP's forward)
    # PEP 440 range of the releases with the bug, and the first release without it ("": the package's own range,
    # trl_versions.AFFECTED / FIXED_IN)
    affected: str = ""
    fixed_in: str = ""
    liger_flags: tuple[str, ...] = ("use_liger_kernel",)  # the first trainer attribute present says "Liger path on"
    # trainer attributes that, all set, send compute_loss down a path without the Liger loss (GOLD's ULD loss)
    not_liger_when: tuple[str, ...] = ()
    upstream: str = "TRL #7245"  # the upstream issue the rank-0 line cites
    # (PEP 440 range, first release without it) of the releases whose own DDP redirect misses a compiled model
    # (``torch_compile=True``): their compute_loss record routes that one only (compute_loss.replacer(compiled_only))
    compiled_hole: tuple[str, str] = ()
    # (PEP 440 range, first release without it) of the releases whose Liger path materialises the KTO KL rows'
    # whole-vocabulary logits: under DDP they go through the chunked head instead (patches/kl_logps.py)
    kl_rows: tuple[str, str] = ()

    @property
    def compute_loss_patch(self) -> str:
        return f"{self.name}_compute_loss"

    @property
    def compiled_patch(self) -> str:
        return f"{self.name}_compiled_ddp"

    @property
    def kl_logps_patch(self) -> str:
        return f"{self.name}_kl_logps"

    @property
    def chunked_loss_patch(self) -> str:
        return f"{self.name}_chunked_loss"

    @property
    def liger_settings_patch(self) -> str:
        return f"{self.name}_liger_settings"

    @property
    def hooked_modules(self) -> tuple[str, ...]:
        """Every module that defines the class in some release, newest first (a record hooks all of them)."""
        return tuple(dict.fromkeys(module for _, module in reversed(self.modules)))

    def module_at(self, version: str) -> str:
        return _at(self.modules, version)

    def shape_at(self, version: str) -> str:
        return _at(self.shapes, version)

    def loss_attribute(self, trainer: object) -> str | None:
        """Where ``trainer`` keeps its fused loss object (``None``: it built none)."""
        return next((a for a in self.loss_attributes if getattr(trainer, a, None) is not None), None)

    def loss_class(self) -> type:
        """Imported on first use: the losses import torch, which the package itself never does at import time."""
        from .. import losses

        return getattr(losses, self.loss)


# Upstream: the ZeRO-3/FSDP-only redirect guard arrived in 1.9.0 (TRL PR #6372), the fix in 1.14.0 (PRs #7243, #7247).
DPO = TrainerSpec(
    name="dpo",
    trainer="DPOTrainer",
    config="DPOConfig",
    dataset="preference",
    modules=(("1.0.0", "trl.trainer.dpo_trainer"),),
    shapes=(("1.0.0", "unredirected"), ("1.9.0", "guarded"), ("1.14.0", "fixed")),
    fused=("LigerFusedLinearDPOLoss", "FusedLinearDPOLoss"),
    loss_attributes=("liger_loss", "liger_loss_fn"),  # liger_loss_fn before 1.8.0
    loss="ChunkedDPOLoss",
    # 1.14.x redirect only when `model is not unwrapped_model`, which accelerate's unwrap of a compiled model defeats
    # (liger_ddp_patch/_ddp.py); 1.15.0 dropped the Liger loss path (the loss runs in the model's own forward)
    compiled_hole=(">=1.14.0,<1.15.0", "1.15.0"),
)

KTO = TrainerSpec(
    name="kto",
    trainer="KTOTrainer",
    config="KTOConfig",
    dataset="unpaired",
    # 1.0.0-1.7.1 define it in trl.experimental (trl.trainer.kto_trainer re-exports a subclass), 1.8.0+ the reverse.
    modules=(("1.0.0", "trl.experimental.kto.kto_trainer"), ("1.8.0", "trl.trainer.kto_trainer")),
    shapes=(("1.0.0", "batch_metrics"), ("1.5.0", "unredirected"), ("1.9.0", "guarded"), ("1.14.0", "fixed")),
    fused=("LigerFusedLinearKTOLoss", "FusedLinearKTOLoss"),
    loss_attributes=("liger_loss", "liger_loss_fn", "kto_loss_fn"),  # kto_loss_fn 1.0.0-1.5.1, liger_loss_fn 1.6-1.7.1
    loss="ChunkedKTOLoss",
    compiled_hole=(">=1.14.0,<1.15.0", "1.15.0"),
    # 1.9.0-1.13.0: `_compute_kl_logps` multiplies the backbone's output by `lm_head.weight` (before: the whole model,
    # as with Liger off); 1.14.0 computes them chunked (PR #7243)
    kl_rows=(">=1.9.0,<1.14.0", "1.14.0"),
)

# The distillation trainers (TRL issue #5282, fixed in 1.6.0 by PR #5934): 1.0.0-1.5.1 run the student's decoder on the
# unwrapped model and hand the head's weight to Liger's JSD loss ("decoder_unrouted": every rank trains its own
# student under DDP); 1.6.0-1.13.0 route the decoder but use the head outside the wrapper's forward ("head_outside":
# in sync, but DDP stops with "Expected to mark a variable ready only once" when find_unused_parameters=True and the
# head is untied and trainable). The JSD loss is Liger's torch.func path with compiled=False, which runs inside DDP's
# forward (shown at vocabulary 151,936 by tests/test_distill.py): no loss swap. 1.14.0 removed their Liger path.
_JSD = ("LigerFusedLinearJSDLoss", "FusedLinearJSDLoss")  # Liger's; TRL 1.13's vendored copy

GKD = TrainerSpec(
    name="gkd",
    trainer="GKDTrainer",
    config="GKDConfig",
    dataset="messages",
    modules=(("1.0.0", "trl.experimental.gkd.gkd_trainer"),),
    shapes=(("1.0.0", "decoder_unrouted"), ("1.6.0", "head_outside"), ("1.14.0", "fixed")),
    affected=">=1.0.0,<1.14.0",
    fixed_in="1.14.0",
    liger_flags=("use_liger_gkd_loss",),
    fused=_JSD,
    loss_attributes=("liger_jsd_loss", "liger_loss"),  # liger_loss from 1.6.0
    upstream="TRL #5282",
)

# GOLD: GKD's Liger path, in its own module; its ULD branch calls the model (the wrapper) itself.
GOLD = GKD._replace(
    name="gold",
    trainer="GOLDTrainer",
    config="GOLDConfig",
    modules=(("1.0.0", "trl.experimental.gold.gold_trainer"),),
    not_liger_when=("use_uld_loss", "teacher_tokenizer"),
)

# Added in 1.1.0 (trl.experimental); 1.10.0 promoted it to trl.trainer, where the whole loss is routed.
DISTILLATION = TrainerSpec(
    name="distillation",
    trainer="DistillationTrainer",
    config="DistillationConfig",
    dataset="messages",
    modules=(
        ("1.1.0", "trl.experimental.distillation.distillation_trainer"),
        ("1.10.0", "trl.trainer.distillation_trainer"),
    ),
    shapes=(("1.1.0", "decoder_unrouted"), ("1.6.0", "head_outside"), ("1.10.0", "fixed")),
    affected=">=1.1.0,<1.10.0",
    fixed_in="1.10.0",
    liger_flags=("use_liger_loss",),
    fused=_JSD,
    loss_attributes=("liger_jsd_loss", "liger_loss"),
    upstream="TRL #5282",
)

# 1.9.0 froze the pre-refactor DistillationTrainer as IWOPDTrainer (trl.experimental.iw_opd): the same Liger path as
# Distillation 1.6-1.9 ("head_outside"), on after distillation_objective="jsd" (IW-OPD itself refuses Liger).
# 1.14.0 removed its Liger path.
IW_OPD = TrainerSpec(
    name="iw_opd",
    trainer="IWOPDTrainer",
    config="IWOPDConfig",
    dataset="messages",
    modules=(("1.9.0", "trl.experimental.iw_opd.iw_opd_trainer"),),
    shapes=(("1.9.0", "head_outside"), ("1.14.0", "fixed")),
    affected=">=1.9.0,<1.14.0",
    fixed_in="1.14.0",
    liger_flags=("use_liger_loss",),
    fused=_JSD,
    loss_attributes=("liger_loss",),
    upstream="TRL #5282",
)

SPECS: tuple[TrainerSpec, ...] = (DPO, KTO, GKD, GOLD, DISTILLATION, IW_OPD)

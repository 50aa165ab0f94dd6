"""What TRL's Liger DPO/KTO path silently drops, release by release: one row per setting.

TRL builds its fused Liger loss from only some of the user's settings (``LigerFusedLinearDPOLoss(beta, loss_type)``
in 1.0.0-1.12.0; ``LigerFusedLinearKTOLoss(beta, use_ref_model=(self.ref_model is not None))``) and says nothing
about the rest, which its non-Liger path applies. Under DDP the package's loss swap keeps exactly TRL's Liger settings,
so these drops carry over, as they should (the package changes only what is broken); the ``*_liger_settings`` records
only say so, once per setting. Upstream: TRL PR #7062 (1.13.0: DPO label_smoothing/discopop_tau passed, KTO class
weights rejected, KTO reference kept under PEFT), tracking issue #7063; TRL 1.14.0 (PR #7243) computes the Liger
log-probs itself and runs its own loss code, so it drops nothing.

Every row was read from the released wheels (TRL 1.0.0-1.16.0; liger-kernel 0.7.0, 0.8.0-0.8.2, 0.8.5) and is proven
by a one-process run per release in ``tests/test_liger_settings.py`` (the JSD trainers' rows by 2-rank runs in
``tests/test_distill.py``). Nothing here imports torch or TRL; packaging only when a fact is matched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ._peft import is_peft_model


class Call(NamedTuple):
    """What the user handed to the trainer's ``__init__`` (``args``: the DPOConfig/KTOConfig)."""

    args: Any
    model: Any = None
    ref_model: Any = None
    peft_config: Any = None


class Dropped(NamedTuple):
    """One setting the Liger path of ``trainer`` drops in ``releases`` (with ``liger`` installed, where it matters)."""

    trainer: str  # a TrainerSpec name: "dpo" | "kto" | "gkd" | "distillation" | "iw_opd"
    setting: str  # the config field (or what the user did), as the docs show it
    read: Callable[[Call], str | None]  # "setting=value" when the user's value is one the non-Liger path acts on
    default: str  # the value that drops nothing
    releases: str  # PEP 440 specifier: the TRL releases whose Liger path drops it
    liger: str  # PEP 440 specifier of liger-kernel versions where it is dropped ("": any)
    lost: str  # what the Liger path computes instead
    applied: str  # what TRL's non-Liger path does with it
    later: str  # what later TRL releases do
    remedy: str  # one sentence: what the user can do
    upstream: str  # TRL / Liger issue or PR
    verb: str = "ignores"


def _loss_types(args: Any) -> list[str]:
    kinds = getattr(args, "loss_type", None)
    return [kinds] if isinstance(kinds, str) else list(kinds or [])


def config(name: str, *neutral: Any, loss_type: str | None = None) -> Callable[[Call], str | None]:
    """A reader of ``args.<name>``: shown unless it is one of the ``neutral`` values (or ``loss_type`` is not used)."""

    def read(call: Call) -> str | None:
        if loss_type is not None and loss_type not in _loss_types(call.args):
            return None
        value = getattr(call.args, name)
        return None if any(value == n for n in neutral) else f"{name}={value!r}"

    return read


def _f_divergence(call: Call) -> str | None:
    """Any divergence but reverse KL, for a loss that uses it (TRL's ``apo_zero`` never does; alpha 1.0 is KL)."""
    kind = getattr(call.args.f_divergence_type, "value", call.args.f_divergence_type)
    if kind == "reverse_kl" or _loss_types(call.args) == ["apo_zero"]:
        return None
    if kind == "alpha_divergence" and abs(getattr(call.args, "f_alpha_divergence_coef", 0.5) - 1.0) < 1e-6:
        return None
    return f"f_divergence_type={kind!r}"


def _peft_without_reference(call: Call) -> str | None:
    """A PEFT model (or ``peft_config``) and no ``ref_model``: TRL keeps ``self.ref_model = None``."""
    if call.ref_model is not None or getattr(call.args, "precompute_ref_log_probs", False):
        return None
    if call.peft_config is None and not is_peft_model(call.model):
        return None
    return "the reference model (PEFT model, no ref_model)"


_NO_LIGER = "Set use_liger_kernel=False to apply it."
_KTO_WEIGHTS = dict(
    read=None, default="1.0", releases=">=1.0.0,<1.13.0", liger="",
    lost="the Liger KTO loss has no class weights", later="TRL 1.13 rejects this combination",
    remedy=_NO_LIGER, upstream="TRL #7062",
)  # fmt: skip

# Not rows, because nothing is dropped silently: the Liger loss types TRL accepts but liger-kernel < 0.8.1 lacks
# (robust, exo_pair, discopop, ...) fail at build; KTO 1.0.0-1.7.1 reject a PEFT model with use_liger_kernel=True
# (PEFT support came in 1.8.0, TRL PR #6277); 1.10.0+ reject f_divergence_type, 1.13.0 the KTO class weights, 1.14.0
# use_weighting.
FACTS: tuple[Dropped, ...] = (
    Dropped(
        "dpo", "label_smoothing (loss_type='robust')", config("label_smoothing", 0.0, loss_type="robust"), "0.0",
        releases=">=1.0.0,<1.13.0", liger=">=0.8.1",
        lost="TRL does not pass it, so the Liger robust loss runs with label_smoothing=0 (plain sigmoid DPO)",
        applied="the robust (cDPO) loss corrects for that fraction of flipped labels",
        later="TRL 1.13 passes it", remedy="Upgrade to TRL 1.13, or set use_liger_kernel=False, to apply it.",
        upstream="TRL #7062",
    ),
    Dropped(
        "dpo", "label_smoothing (loss_type='exo_pair')", config("label_smoothing", 0.0, loss_type="exo_pair"), "0.0",
        releases=">=1.0.0,<1.13.0", liger=">=0.8.1", verb="does not pass",
        lost="Liger builds the exo_pair loss with label_smoothing=0, which fails with "
        "\"label_smoothing must be > 0 for loss_type='exo_pair'\" although you set it",
        applied="the EXO loss uses it as the preference distribution's epsilon",
        later="TRL 1.13 passes it", remedy="Upgrade to TRL 1.13, or set use_liger_kernel=False.",
        upstream="TRL #7062",
    ),
    Dropped(
        "dpo", "discopop_tau (loss_type='discopop')", config("discopop_tau", 0.05, loss_type="discopop"), "0.05",
        releases=">=1.0.0,<1.13.0", liger=">=0.8.1",
        lost="TRL does not pass it, so the Liger DiscoPOP loss uses its default tau 0.05",
        applied="the DiscoPOP loss uses it as the modulation temperature",
        later="TRL 1.13 passes it", remedy="Upgrade to TRL 1.13, or set use_liger_kernel=False, to apply it.",
        upstream="TRL #7062",
    ),
    Dropped(
        "dpo", "use_weighting", config("use_weighting", False), "False", releases=">=1.0.0,<1.14.0", liger="",
        lost="the Liger DPO loss has no WPO weights: every pair weighs the same",
        applied="each pair's loss is weighted by its length-normalised policy probability (WPO)",
        later="TRL 1.14 rejects this combination", remedy=_NO_LIGER, upstream="TRL #7243",
    ),
    Dropped(
        "dpo", "ld_alpha", config("ld_alpha", None, 1.0), "None", releases=">=1.0.0,<1.14.0", liger="",
        lost="the Liger DPO loss sums every completion token's log-probability, the tail beyond the shorter answer "
        "included",
        applied="log-probabilities past the shorter completion's length are scaled by it (LD-DPO)",
        later="TRL 1.14 applies it on its Liger path",
        remedy="Upgrade to TRL 1.14, or set use_liger_kernel=False, to apply it.", upstream="TRL #7243",
    ),
    Dropped(
        "dpo", "loss_weights", config("loss_weights", None, [1.0]), "None", releases=">=1.0.0,<1.14.0", liger="",
        lost="the Liger DPO loss is not scaled by it",
        applied="the loss is multiplied by the weight",
        later="TRL 1.14 applies it on its Liger path",
        remedy="Upgrade to TRL 1.14, or set use_liger_kernel=False, to apply it.", upstream="TRL #7243",
    ),
    Dropped(
        "dpo", "f_divergence_type", _f_divergence, "'reverse_kl'", releases=">=1.0.0,<1.10.0", liger="",
        lost="the Liger DPO loss always uses the reverse-KL (standard DPO) log-ratios",
        applied="the log-ratios go through the chosen f-divergence",
        later="TRL 1.10 rejects this combination", remedy=_NO_LIGER, upstream="TRL #7063",
    ),
    Dropped("kto", "desirable_weight", **{**_KTO_WEIGHTS, "read": config("desirable_weight", 1.0)},
            applied="the loss of desirable examples is multiplied by it"),
    Dropped("kto", "undesirable_weight", **{**_KTO_WEIGHTS, "read": config("undesirable_weight", 1.0)},
            applied="the loss of undesirable examples is multiplied by it"),
    Dropped(
        "kto", "reference under PEFT (no ref_model)", _peft_without_reference, "a ref_model, or no PEFT",
        releases=">=1.8.0,<1.13.0", liger="",
        lost="the Liger KTO loss is built with use_ref_model=False, so its rewards are the policy's log-probabilities "
        "instead of log-ratios against the reference (the adapter switched off, or its 'ref' copy; only the KL "
        "baseline uses it)",
        applied="rewards are log-ratios against that reference",
        later="TRL 1.13 uses the reference",
        remedy="Upgrade to TRL 1.13, pass a ref_model, or set use_liger_kernel=False.", upstream="TRL #7062, #7063",
    ),
)  # fmt: skip


def _always(what: str) -> Callable[[Call], str | None]:
    """A reader for what the Liger path changes whatever the user set."""
    return lambda call: what


# GKD, Distillation and IW-OPD (trl.experimental): their Liger JSD loss against their non-Liger generalized JSD loss.
_TOP_K = dict(  # Distillation's loss_top_k (default 1), which its Liger path ignores
    setting="loss_top_k",
    read=config("loss_top_k", 0),
    default="1",
    liger="",
    lost="the Liger JSD loss runs over the full vocabulary",
    applied="the non-Liger loss restricts both distributions to the top-k tokens (plus a tail bucket)",
    remedy="Set loss_top_k=0 (the full vocabulary, as the Liger loss), or use_liger_kernel=False.",
)
# Proven by the 2-rank runs of tests/test_distill.py (test_liger_path_facts).
FACTS += (
    Dropped(
        "gkd", "the loss", _always("the loss"), "pure JSD", releases=">=1.0.0,<1.4.0", liger="", verb="changes",
        lost="TRL builds Liger's JSD loss with Liger's defaults weight_hard_loss=0.5, weight_soft_loss=0.5, so the "
        "Liger loss is half the JSD plus half a cross-entropy on the completion tokens",
        applied="the loss is the generalized JSD alone",
        later="TRL 1.4 builds it with weight_hard_loss=0.0, weight_soft_loss=1.0",
        remedy="Upgrade to TRL 1.4, or set use_liger_kernel=False, for the pure JSD loss.", upstream="TRL 1.4.0",
    ),
    Dropped(
        "gkd", "temperature", config("temperature", 1.0), "0.9", releases=">=1.0.0,<1.4.0", liger="",
        verb="applies",
        lost="the Liger JSD loss divides the student's and the teacher's logits by it",
        applied="the non-Liger loss does not (the temperature only samples on-policy completions)",
        later="TRL 1.4 no longer passes it to the Liger loss",
        remedy="Upgrade to TRL 1.4, set temperature=1.0, or set use_liger_kernel=False, for the same loss both "
        "ways.", upstream="TRL 1.4.0",
    ),
    Dropped("distillation", releases=">=1.1.0,<1.9.0", later="TRL 1.9 removed the setting", upstream="TRL 1.9.0",
            **_TOP_K),
    # IW-OPD is Distillation's pre-1.9 code, frozen (its default loss_top_k is still 1)
    Dropped("iw_opd", releases=">=1.9.0,<1.14.0", later="TRL 1.14 removed IW-OPD's Liger path", upstream="TRL 1.14.0",
            **_TOP_K),
)  # fmt: skip


def facts(trainer: str) -> tuple[Dropped, ...]:
    return tuple(f for f in FACTS if f.trainer == trainer)


def judged_as(trl: str) -> str:
    """The release whose code ``trl`` is judged by: itself, or for a pre-release we have not read (TRL from git), the
    release before its base. As the engine judges one (:mod:`liger_ddp_patch.engine.decide`), a pre-release carries
    code from after that release up to its base, so no range may exclude it; its settings were still that release's
    if its Liger path is still there (the records act only where its shape matched: 1.14.0.dev0 may be 1.13's code)."""
    from packaging.version import InvalidVersion, Version

    from .trl_versions import RELEASES

    try:
        parsed = Version(trl)
    except InvalidVersion:
        return trl
    if not parsed.is_prerelease or trl in RELEASES:
        return trl
    base = Version(parsed.base_version)
    earlier = [r for r in RELEASES if Version(r) < base]
    return max(earlier, key=Version) if earlier else parsed.base_version


def dropped_in(fact: Dropped, trl: str, liger: str | None) -> bool:
    """Does TRL ``trl`` (with liger-kernel ``liger``; ``None``: not installed) drop ``fact``'s setting? A pre-release
    as :func:`judged_as` says."""
    from packaging.specifiers import SpecifierSet

    if judged_as(trl) not in SpecifierSet(fact.releases, prereleases=True):
        return False
    return not fact.liger or (liger is not None and liger in SpecifierSet(fact.liger, prereleases=True))


def message(fact: Dropped, trainer: str, trl: str, shown: str) -> str:
    """The warning a user reads, e.g. ``... ignores desirable_weight=3.0: ...; TRL 1.13 rejects this ...``."""
    judged = judged_as(trl)
    release = f"TRL {trl}" if judged == trl else f"TRL {trl}, a pre-release judged as {judged}"
    return (
        f"liger_ddp_patch: {trainer} ({release}, use_liger_kernel=True) {fact.verb} {shown}: {fact.lost}; "
        f"{fact.later}. {fact.remedy}"
    )

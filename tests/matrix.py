"""The TRL test plan: what each release does under DDP, what we observed, which releases CI runs, and docs/versions.md.

The runtime package keeps only what its decisions need (``patches.trl_versions``: the releases read and the fix;
``patches.trainers``: each trainer's modules and code shapes per release). This module adds what the tests check and
the docs show. Releases are placed by the first release of each :data:`LINES` range, like the specs place them.

    python tests/matrix.py versions > docs/versions.md     # the generated table (a test fails when it is stale)
    python tests/matrix.py ci-versions [--full]            # the releases .ci/trl_matrix.sh unpacks
    python tests/matrix.py liger-settings                  # README's "What TRL's Liger path ignores" table
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from liger_ddp_patch.patches import PATCHES, liger_settings
from liger_ddp_patch.patches import trl_versions as tv
from liger_ddp_patch.patches.compute_loss import SHAPES
from liger_ddp_patch.patches.trainers import SPECS


class Line(NamedTuple):
    """Releases from ``first`` up to the next line's: one behaviour under plain DDP with ``use_liger_kernel=True``."""

    first: str
    fused: str  # where the fused losses the trainers build come from
    broken: str  # what goes wrong, unpatched
    unpatched: str  # what the 2-rank probe shows unpatched: "unsynced" | "crash" | "synced"

    @property
    def versions(self) -> tuple[str, ...]:
        following = LINES[LINES.index(self) + 1].first if self is not LINES[-1] else None
        return tuple(
            v
            for v in tv.RELEASES
            if Version(self.first) <= Version(v) and (following is None or Version(v) < Version(following))
        )

    @property
    def patched(self) -> bool:
        return self.unpatched != "synced"


def _crash(attribute: str) -> str:
    return (
        "the DDP wrapper itself is passed into the Liger path, which crashes: "
        f"`AttributeError: 'DistributedDataParallel' object has no attribute '{attribute}'` (DPO and KTO)"
    )


_UNSYNCED = (
    "Liger loss runs on the unwrapped model unless ZeRO-3/FSDP (TRL #6372), so DDP never all-reduces the gradients "
    "(TRL #7245): every rank silently trains its own model"
)
_DEPRECATED = "none built (`use_liger_kernel` deprecated for the DPO/KTO losses)"

LINES: tuple[Line, ...] = (
    Line("1.0.0", "liger_kernel.chunked_loss", _crash("get_decoder"), "crash"),
    Line("1.6.0", "liger_kernel.chunked_loss", _crash("base_model"), "crash"),
    Line("1.9.0", "liger_kernel.chunked_loss", _UNSYNCED, "unsynced"),
    Line("1.13.0", "trl.losses (vendored; DPO also passes label_smoothing and discopop_tau)", _UNSYNCED, "unsynced"),
    Line("1.14.0", "none built: DPO and KTO compute chunked log-probs themselves (TRL #7243)",
         "nothing under plain DDP: the guard redirects whenever `model is not unwrapped_model` (TRL #7247); with "
         "`torch_compile=True` that test is false (accelerate unwraps a compiled model to itself) and every rank "
         "trains its own model (`tests/test_compile.py`)", "synced"),
    Line("1.15.0", _DEPRECATED,
         "nothing for this package (fixed upstream in TRL 1.14.0); on a CPU-only machine its Liger path stops in "
         "Liger's Triton kernels (`RuntimeError: 0 active drivers`), with or without the package", "synced"),
    Line("1.16.0", _DEPRECATED, "nothing (fixed upstream in TRL 1.14.0)", "synced"),
)  # fmt: skip


def line_of(version: str) -> Line:
    return next(line for line in LINES if version in line.versions)


def spec_of(patch: str):
    """The trainer spec a patch name belongs to (``gkd_compute_loss`` -> GKD)."""
    names = lambda s: (  # noqa: E731
        s.compute_loss_patch, s.compiled_patch, s.chunked_loss_patch, s.kl_logps_patch, s.liger_settings_patch
    )  # fmt: skip
    return next(s for s in SPECS if patch in names(s))


def exists_in(spec, version: str) -> bool:
    """Does ``version`` define the spec's trainer at all (Distillation arrived in 1.1.0)?"""
    return Version(spec.modules[0][0]) <= Version(version)


def expected_status(version: str, patch: str = "dpo_compute_loss") -> str:
    """What ``liger_ddp_patch.report()`` must say for ``patch`` under this release (stated from observation): DPO/KTO
    by :data:`LINES`; a trainer with its own range (GKD, GOLD, Distillation) by :data:`DISTILL_LINES`."""
    spec = spec_of(patch)
    if patch == spec.compiled_patch:  # its own range: the releases whose upstream redirect misses a compiled model
        return "applied" if version in SpecifierSet(spec.compiled_hole[0]) else "not_needed"
    if patch == spec.kl_logps_patch:  # its own range: the releases whose Liger path materialises the KL rows' logits
        return "applied" if version in SpecifierSet(spec.kl_rows[0]) else "not_needed"
    if not spec.affected:
        return "applied" if line_of(version).patched else "not_needed"
    return "applied" if distill_line(spec, version).patched else "not_needed"


# Measured with tests/test_matrix.py (liger-kernel 0.8.5, torch 2.13 CPU, transformers 5.24, accelerate 1.16):
# trainer -> (unpatched, patched); an int is "parameters whose gradients differ across ranks" (out of 25), a str is
# the exception the run ended with. Releases absent here have not been run yet. Runs of 2026-12-02.
_CRASH = {1: "AttributeError: get_decoder", 2: "AttributeError: base_model"}
OBSERVED: dict[str, dict[str, tuple[int | str, int | str]]] = {
    **{v: {"dpo": (_CRASH[1], 0), "kto": (_CRASH[1], 0)}
       for v in ("1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0", "1.5.0", "1.5.1")},
    **{v: {"dpo": (_CRASH[2], 0), "kto": (_CRASH[2], 0)} for v in ("1.6.0", "1.7.0", "1.7.1", "1.8.0")},
    **{v: {"dpo": (25, 0), "kto": (25, 0)}
       for v in ("1.9.0", "1.9.1", "1.9.2", "1.10.0", "1.11.0", "1.12.0", "1.13.0")},
    **{v: {"dpo": (0, 0), "kto": (0, 0)} for v in ("1.14.0", "1.14.1", "1.14.2", "1.16.0")},
    "1.15.0": {k: ("RuntimeError: 0 active drivers", "RuntimeError: 0 active drivers") for k in ("dpo", "kto")},
}  # fmt: skip

# ------------------------------------------------- GKD, GOLD, Distillation (their own ranges: TRL issue #5282)


class DistillLine(NamedTuple):
    """Releases from ``first`` on (until the spec's next line) for one distillation trainer, under plain DDP."""

    first: str
    broken: str  # what goes wrong with use_liger_kernel=True, unpatched
    unpatched: str  # "unsynced" | "crash (find_unused_parameters=True, untied trainable head)" | "synced" | "absent"
    does: str  # what the package does

    @property
    def patched(self) -> bool:
        return self.unpatched not in ("synced", "absent")


_DECODER = (
    "the student's decoder runs on the unwrapped model and its head's weight goes straight into Liger's JSD loss: "
    "DDP's forward never runs, so every rank silently trains its own student (TRL #5282; fixed in 1.6.0 by PR #5934)"
)
_HEAD = (
    "the decoder is routed, the head is used after DDP's forward: in sync by default; with "
    "`ddp_find_unused_parameters=True` and an untied trainable head DDP stops in backward with `RuntimeError: Expected "
    "to mark a variable ready only once` (Liger off trains)"
)
_ROUTE = (
    "under DDP only: runs TRL's own `compute_loss` on the unwrapped student inside the DDP wrapper's forward (TRL's "
    "JSD loss object kept; the teacher untouched); any other setup runs TRL's code"
)
_ROUTE_HEAD = (
    "under DDP with `find_unused_parameters=True` and an untied trainable head only: runs TRL's own `compute_loss` "
    "inside the wrapper's forward; tied or frozen heads, the default setting and every other setup run TRL's code"
)
_GONE = "nothing: its Liger path is gone (TRL 1.14 removed the JSD Liger loss of GKD and GOLD)"
DISTILL_LINES: dict[str, tuple[DistillLine, ...]] = {
    "gkd": (DistillLine("1.0.0", _DECODER, "unsynced", _ROUTE), DistillLine("1.6.0", _HEAD, "crash", _ROUTE_HEAD),
            DistillLine("1.14.0", "nothing (no Liger JSD path)", "synced", _GONE)),
    "gold": (DistillLine("1.0.0", _DECODER, "unsynced", _ROUTE), DistillLine("1.6.0", _HEAD, "crash", _ROUTE_HEAD),
             DistillLine("1.14.0", "nothing (no Liger JSD path)", "synced", _GONE)),
    "distillation": (
        DistillLine("1.0.0", "nothing: no DistillationTrainer before 1.1.0", "absent", "nothing"),
        DistillLine("1.1.0", _DECODER, "unsynced", _ROUTE), DistillLine("1.6.0", _HEAD, "crash", _ROUTE_HEAD),
        DistillLine("1.10.0", "nothing: promoted to `trl.trainer`, which routes the whole Liger loss through the "
                    "wrapper's forward", "synced", "nothing (`not_needed`: fixed upstream in 1.10.0)"),
    ),
    # IW-OPD: Distillation's pre-1.9 code, frozen in trl.experimental.iw_opd (Liger needs distillation_objective="jsd")
    "iw_opd": (
        DistillLine("1.0.0", "nothing: no IWOPDTrainer before 1.9.0", "absent", "nothing"),
        DistillLine("1.9.0", _HEAD, "crash", _ROUTE_HEAD),
        DistillLine("1.14.0", "nothing (no Liger JSD path)", "synced", "nothing: TRL 1.14 removed its Liger path"),
    ),
}  # fmt: skip


# Measured with tests/test_distill.py (2 ranks, CPU/gloo, 64-token tiny Qwen3, untied head; liger-kernel 0.8.5, torch
# 2.13): parameters whose gradients differ across ranks (of 25), unpatched -> patched; "crash" is DDP's "Expected to
# mark a variable ready only once" (find_unused_parameters=True, untied trainable head). Runs of 2026-12-03.
DISTILL_OBSERVED: dict[str, str] = {
    "1.0.0": "GKD 25 → 0, GOLD 25 → 0",
    "1.1.0": "GKD 25 → 0, GOLD 25 → 0, Distillation 25 → 0",
    "1.5.1": "GKD 25 → 0, GOLD 25 → 0, Distillation 25 → 0",
    "1.6.0": "find_unused_parameters=True: GKD, GOLD, Distillation crash → 0",
    "1.12.0": "find_unused_parameters=True: IW-OPD crash → 0",
}


def distill_line(spec, version: str) -> DistillLine:
    return [line for line in DISTILL_LINES[spec.name] if Version(line.first) <= Version(version)][-1]


# 2-rank runs on every CI run (one per kind of fix, ~2 torchrun launches each); the rest need
# LIGER_DDP_PATCH_FULL_MATRIX=1. 1.12.0 also runs always, with liger-kernel 0.8.2 (tests/test_matrix.py).
ALWAYS = ("1.8.0", "1.9.0", "1.13.0", "1.14.0")
# The engine-report test (one interpreter per release, ~20 s) always runs every release where something changes:
# a line starts, or a trainer's module or code shape does.
REPRESENTATIVES = tuple(
    v for v in tv.RELEASES
    if v in {line.first for line in LINES} | {first for s in SPECS for first, _ in (*s.modules, *s.shapes)}
)  # fmt: skip
# Releases whose code the fake-version tests borrow.
FAKE_SOURCES = ("1.12.0", "1.13.0", "1.14.0", "1.16.0")
# The distillation trainers' 2-rank runs (tests/test_distill.py): in every CI run, and with the full matrix.
DISTILL_ALWAYS = ("1.0.0", "1.5.1", "1.6.0", "1.12.0")
DISTILL_FULL = ("1.1.0", "1.9.2", "1.13.0")


def tier(version: str) -> str:
    """``always``: 2-rank runs in every CI run; ``report``: only the engine report always; ``full``: only with
    LIGER_DDP_PATCH_FULL_MATRIX=1."""
    return "always" if version in ALWAYS else "report" if version in REPRESENTATIVES else "full"


def ci_versions(full: bool) -> tuple[str, ...]:
    """The TRL releases .ci/trl_matrix.sh must unpack."""
    wanted = set(tv.RELEASES) if full else {*ALWAYS, *REPRESENTATIVES, *FAKE_SOURCES, *DISTILL_ALWAYS, "1.12.0"}
    return tuple(v for v in tv.RELEASES if v in wanted)


# ----------------------------------------------------------------------------------------------- docs/versions.md

_DOES = {
    "guarded": "under DDP only: runs TRL's own `compute_loss` inside the DDP wrapper's forward (gradients all-reduced "
    "again) and swaps the trainer's fused loss for our chunked one; any other setup runs TRL's code",
    "unredirected": "under DDP only: gives the Liger path the unwrapped model, inside the DDP wrapper's forward (no "
    "crash, gradients all-reduced; the inputs pass through the wrapper, as DDP with `device_ids` needs) and swaps the "
    "trainer's fused loss for our chunked one; any other setup (ZeRO-3/FSDP included) runs TRL's code",
    "batch_metrics": "as `unredirected`, for the Liger branch of its `get_batch_loss_metrics`",
    "fixed": "nothing, except on 1.14.0-1.14.2 with `torch_compile=True`, which `dpo_compiled_ddp` / "
    "`kto_compiled_ddp` route through the DDP module (TRL 1.14's own loss); every other patch reports `not_needed` "
    '("fixed upstream in trl 1.14.0")',
}


def _observed(version: str) -> str:
    runs = OBSERVED.get(version)
    if not runs:
        return "not run yet"

    def show(value: int | str) -> str:
        return f"{value}/25" if isinstance(value, int) else f"crash ({value})"

    return "; ".join(f"{kind.upper()} {show(before)} → {show(after)}" for kind, (before, after) in runs.items())


FUSED_SPECS = tuple(s for s in SPECS if s.loss)  # DPO, KTO: the trainers of the first table (their loss swapped)
DISTILL_SPECS = tuple(s for s in SPECS if not s.loss)  # GKD, GOLD, Distillation, IW-OPD


def _per_trainer(version: str, fact) -> str:
    values = {spec.name.upper(): fact(spec, version) for spec in FUSED_SPECS}
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    return "; ".join(f"{name}: {value}" for name, value in values.items())


def render_versions() -> str:
    names = " / ".join(spec.name.upper() for spec in FUSED_SPECS)
    rows = [
        "<!-- Generated by `python tests/matrix.py versions > docs/versions.md` from liger_ddp_patch/patches/"
        "(trl_versions.py, trainers.py) and tests/matrix.py; do not edit by hand. -->",
        "",
        "# TRL versions",
        "",
        f"Patches: {', '.join(f'`{p.name}`' for p in PATCHES)}. DPO/KTO: affected range `{tv.AFFECTED}`; fixed "
        f"upstream in TRL {tv.FIXED_IN}. A release not listed here is *unknown*: the shape check of each patch "
        "decides, and `liger-ddp-patch status` says what was checked. Code shapes the checks accept: "
        + ", ".join(f"`{s}`" for s in SHAPES)
        + ".",
        "",
        "Verified: `tests/test_versions.py::test_release_report[<version>]` (the engine's decision on the real "
        "wheel) and `tests/test_matrix.py::test_ddp_matrix[<version>]` (2 ranks, CPU/gloo, tiny Qwen3 with a "
        "151,936-token vocabulary; unpatched and patched). Gradients differing across ranks, unpatched → patched, "
        "out of 25 parameters:",
        "",
        f"| TRL | Trainer defined in | Fused losses | What is broken (unpatched, DDP) | What this package does "
        f"| Shape ({names}) | Verified (2-rank run) | CI |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for line in LINES:
        for version in line.versions:
            modules = _per_trainer(version, lambda s, v: f"`{s.module_at(v)}`")
            does = _per_trainer(version, lambda s, v: _DOES[s.shape_at(v)])
            shapes = " / ".join(spec.shape_at(version) for spec in FUSED_SPECS)
            rows.append(
                f"| {version} | {modules} | {line.fused} | {line.broken} | {does} | {shapes} | {_observed(version)} "
                f"| {tier(version)} |"
            )
    rows += [
        "",
        "CI: `always` rows run both tests on every CI run; `report` rows run the engine-report test always and the "
        "2-rank run only with `LIGER_DDP_PATCH_FULL_MATRIX=1`; `full` rows run both only with "
        "`LIGER_DDP_PATCH_FULL_MATRIX=1` (see `.ci/trl_matrix.sh`). TRL 1.12.0 also runs always with liger-kernel "
        "0.8.2 (`tests/test_matrix.py::test_liger_kernel_minimum`).",
        "",
        *render_distill(),
    ]
    return "\n".join(rows)


def _distill_cell(spec, version: str) -> str:
    status = expected_status(version, spec.compute_loss_patch)
    if not exists_in(spec, version):
        return f"{status} (no {spec.trainer} yet)"
    shape = spec.shape_at(version)
    return f"**{status}** (`{shape}`)" if status == "applied" else f"{status} (TRL fixed it in {spec.fixed_in})"


def render_distill() -> list[str]:
    """The second table: GKD, GOLD, Distillation and IW-OPD, each with its own range (TRL issue #5282)."""
    rows = [
        "## GKD, GOLD, Distillation and IW-OPD (`trl.experimental`)",
        "",
        "Patches: "
        + ", ".join(f"`{s.compute_loss_patch}` (affected `{s.affected}`, fixed in {s.fixed_in})" for s in DISTILL_SPECS)
        + ". Their Liger loss is Liger's `LigerFusedLinearJSDLoss` (TRL 1.13: `trl.losses.FusedLinearJSDLoss`) with "
        "`compiled=False`: it runs inside DDP's forward at the real 151,936-token vocabulary, so nothing is swapped. "
        "Shape `decoder_unrouted`: the student's decoder is called on the unwrapped model; `head_outside`: TRL routes "
        "the decoder, the head is used after DDP's forward. Verified by `tests/test_versions.py::test_release_report` "
        "(the engine's decision) and `tests/test_distill.py` (2 ranks: "
        + ", ".join(DISTILL_ALWAYS)
        + " always; "
        + ", ".join(DISTILL_FULL)
        + " with `LIGER_DDP_PATCH_FULL_MATRIX=1`).",
        "",
        "| TRL | " + " | ".join(s.trainer for s in DISTILL_SPECS) + " | Verified (2-rank run, differing of 25) | CI |",
        "|---|" + "---|" * len(DISTILL_SPECS) + "---|---|",
    ]
    for version in tv.RELEASES:
        ci = "always" if version in DISTILL_ALWAYS else "full" if version in DISTILL_FULL else "—"
        seen = DISTILL_OBSERVED.get(version, "not run yet")
        cells = " | ".join(_distill_cell(s, version) for s in DISTILL_SPECS)
        rows.append(f"| {version} | {cells} | {seen} | {ci} |")
    rows += ["", "What each shape means under plain DDP with `use_liger_kernel=True`, and what the package does:", ""]
    seen = set()
    for spec in DISTILL_SPECS:
        for line in DISTILL_LINES[spec.name]:
            if (line.broken, line.does) in seen:
                continue
            seen.add((line.broken, line.does))
            following = [x.first for x in DISTILL_LINES[spec.name] if Version(x.first) > Version(line.first)]
            span = f"{line.first}–" + (f"before {following[0]}" if following else "")
            rows.append(f"- {spec.trainer} {span}: {line.broken}. Package: {line.does}.")
    rows += [
        "",
        "What their Liger path computes differently from their non-Liger path (a WARNING line per row on rank 0 when "
        "such a trainer is built with `use_liger_kernel=True`; nothing changes; proven by "
        "`tests/test_distill.py::test_liger_path_facts`):",
        "",
        "| trainer | you set (default) | TRL releases | TRL without Liger | TRL's Liger path | later |",
        "|---|---|---|---|---|---|",
    ]
    names = {spec.name: spec.trainer for spec in SPECS}
    for f in liger_settings.FACTS:
        if f.trainer in {s.name for s in DISTILL_SPECS}:
            rows.append(
                f"| {names[f.trainer]} | `{f.setting}` ({f.default}) | {_span(f.releases)} | {f.applied} | {f.lost} "
                f"| {f.later} |"
            )
    return [*rows, ""]


# ------------------------------------------------------------------- README: what TRL's Liger path ignores

SETTINGS_BEGIN = "<!-- liger-settings table: generated by `python tests/matrix.py liger-settings`; do not edit -->"
SETTINGS_END = "<!-- end of liger-settings table -->"


def _span(specifier: str, among: tuple[str, ...] = tv.RELEASES) -> str:
    """``>=1.0.0,<1.13.0`` as the releases we have read: ``1.0.0–1.12.0``."""
    from packaging.specifiers import SpecifierSet

    inside = [v for v in among if v in SpecifierSet(specifier)]
    return f"{inside[0]}–{inside[-1]}" if len(inside) > 1 else inside[0]


def render_liger_settings(trainers: tuple[str, ...] = ("dpo", "kto")) -> str:
    """The README table, one row per fact (``liger_ddp_patch.patches.liger_settings.FACTS``) of ``trainers``, between
    markers (``liger-settings --distill``: the distillation trainers' rows, also in docs/versions.md)."""
    names = {spec.name: spec.trainer for spec in SPECS}
    rows = [
        SETTINGS_BEGIN,
        "| trainer | you set (default) | TRL releases that drop it | liger-kernel | TRL without Liger | TRL's Liger "
        "path | later | upstream |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in liger_settings.FACTS:
        if f.trainer not in trainers:
            continue
        rows.append(
            f"| {names[f.trainer]} | `{f.setting}` ({f.default}) | {_span(f.releases)} | {f.liger or 'any'} "
            f"| {f.applied} | {f.lost} | {f.later} | {f.upstream} |"
        )
    rows += [
        "",
        "A WARNING line per setting, on rank 0, once per process, when such a trainer is built with "
        "`use_liger_kernel=True` (any setup); nothing else changes. Each row is proven on each release's wheel by "
        "`tests/test_liger_settings.py::test_release[<version>]` (one process, fp32: TRL's Liger loss bit for bit "
        "unchanged by the setting, TRL's non-Liger loss moved; no warning where the release honours or rejects it).",
    ]
    return "\n".join([*rows, SETTINGS_END]) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["versions"]:
        print(render_versions(), end="")
    elif sys.argv[1:2] == ["liger-settings"]:
        distill = tuple(s.name for s in DISTILL_SPECS)
        print(render_liger_settings(distill if "--distill" in sys.argv else ("dpo", "kto")), end="")
    elif sys.argv[1:2] == ["ci-versions"]:
        print(*ci_versions(full="--full" in sys.argv))
    else:
        sys.exit("usage: python tests/matrix.py versions | ci-versions [--full] | liger-settings")

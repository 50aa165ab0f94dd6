"""Per-release facts about TRL's DPO/KTO Liger path: the one place the patch records, the tests and the docs table read.

Every fact here was read from the released wheel (``pip install --no-deps --target DIR trl==X``) and, where a run is
recorded in :data:`OBSERVED`, measured with ``tests/test_matrix.py`` (2 ranks, CPU/gloo, one step, tiny Qwen3 with a
151,936-token vocabulary). A release is grouped with others whose trainer code has the same *shape*; the shape names
are the keys of :data:`liger_ddp_patch.patches.compute_loss.SHAPES` and say which shape check accepts the code.

Upstream references: TRL issue #7245 (DDP gradients not synchronised), PR #6372 (introduced the ZeRO-3/FSDP-only
redirect guard in 1.9.0), PRs #7243/#7247 (fixed in 1.14.0).
"""

from __future__ import annotations

from typing import NamedTuple

KTO_STABLE = "trl.trainer.kto_trainer"
KTO_EXPERIMENTAL = "trl.experimental.kto.kto_trainer"  # the real KTOTrainer in 1.0.0-1.7.1; a shim module elsewhere
DPO_MODULE = "trl.trainer.dpo_trainer"

FIXED_IN = "1.14.0"


class Line(NamedTuple):
    """Consecutive releases that share one code shape (and so one bug, one fix and one way to verify it)."""

    versions: tuple[str, ...]
    dpo_shape: str  # compute_loss shape of DPOTrainer (see compute_loss.SHAPES), or "fixed"
    kto_shape: str  # compute_loss shape of KTOTrainer
    kto_module: str  # the module that defines KTOTrainer itself
    fused: str  # where the fused losses the trainer builds come from
    broken: str  # what goes wrong under plain DDP with use_liger_kernel=True, unpatched
    unpatched: str  # what the 2-rank probe shows unpatched: "unsynced" | "crash" | "synced"

    @property
    def patched(self) -> bool:
        return self.dpo_shape != "fixed"


def _crash(attribute: str) -> str:
    return (
        "the DDP wrapper itself is passed into the Liger path, which crashes: "
        f"`AttributeError: 'DistributedDataParallel' object has no attribute '{attribute}'` (DPO and KTO)"
    )


_UNSYNCED = (
    "Liger loss runs on the unwrapped model unless ZeRO-3/FSDP (TRL #6372), so DDP never all-reduces the gradients "
    "(TRL #7245): every rank silently trains its own model"
)

LINES: tuple[Line, ...] = (
    Line(("1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0"), "unredirected", "batch_metrics", KTO_EXPERIMENTAL,
         "liger_kernel.chunked_loss", _crash("get_decoder"), "crash"),
    Line(("1.5.0", "1.5.1"), "unredirected", "unredirected", KTO_EXPERIMENTAL,
         "liger_kernel.chunked_loss", _crash("get_decoder"), "crash"),
    Line(("1.6.0", "1.7.0", "1.7.1"), "unredirected", "unredirected", KTO_EXPERIMENTAL,
         "liger_kernel.chunked_loss", _crash("base_model"), "crash"),
    Line(("1.8.0",), "unredirected", "unredirected", KTO_STABLE,
         "liger_kernel.chunked_loss", _crash("base_model"), "crash"),
    Line(("1.9.0", "1.9.1", "1.9.2", "1.10.0", "1.11.0", "1.12.0"), "guarded", "guarded", KTO_STABLE,
         "liger_kernel.chunked_loss", _UNSYNCED, "unsynced"),
    Line(("1.13.0",), "guarded", "guarded", KTO_STABLE,
         "trl.losses (vendored; DPO also passes label_smoothing and discopop_tau)", _UNSYNCED, "unsynced"),
    Line(("1.14.0", "1.14.1", "1.14.2"), "fixed", "fixed", KTO_STABLE,
         "none built: DPO and KTO compute chunked log-probs themselves (TRL #7243)",
         "nothing: the guard redirects whenever `model is not unwrapped_model` (TRL #7247)", "synced"),
    Line(("1.15.0",), "fixed", "fixed", KTO_STABLE,
         "none built (`use_liger_kernel` deprecated for the DPO/KTO losses)",
         "nothing for this package (fixed upstream in TRL 1.14.0); on a CPU-only machine its Liger path stops in "
         "Liger's Triton kernels (`RuntimeError: 0 active drivers`), with or without the package",
         "synced"),
    Line(("1.16.0",), "fixed", "fixed", KTO_STABLE,
         "none built (`use_liger_kernel` deprecated for the DPO/KTO losses)", "nothing (fixed upstream in TRL 1.14.0)",
         "synced"),
)  # fmt: skip

# Which releases CI always runs in the 2-rank matrix (one per kind of fix, ~2 torchrun runs each); the rest need
# LIGER_DDP_PATCH_FULL_MATRIX=1. 1.12.0 also runs always, with liger-kernel 0.8.2 (tests/test_matrix.py).
ALWAYS = ("1.8.0", "1.9.0", "1.13.0", "1.14.0")

RELEASES: tuple[str, ...] = tuple(v for line in LINES for v in line.versions)
AFFECTED = f">={RELEASES[0]},<{FIXED_IN}"

# Measured with tests/test_matrix.py (liger-kernel 0.8.5, torch 2.13 CPU, transformers 5.24, accelerate 1.16):
# trainer -> (unpatched, patched); an int is "parameters whose gradients differ across ranks" (out of 25), a str is
# the exception the run ended with. Releases absent here have not been run yet. Runs of 2026-12-02.
OBSERVED: dict[str, dict[str, tuple[int | str, int | str]]] = {
    "1.0.0": {'dpo': ('AttributeError: get_decoder', 0), 'kto': ('AttributeError: get_decoder', 0)},
    "1.1.0": {'dpo': ('AttributeError: get_decoder', 0), 'kto': ('AttributeError: get_decoder', 0)},
    "1.2.0": {'dpo': ('AttributeError: get_decoder', 0), 'kto': ('AttributeError: get_decoder', 0)},
    "1.3.0": {'dpo': ('AttributeError: get_decoder', 0), 'kto': ('AttributeError: get_decoder', 0)},
    "1.4.0": {'dpo': ('AttributeError: get_decoder', 0), 'kto': ('AttributeError: get_decoder', 0)},
    "1.5.0": {'dpo': ('AttributeError: get_decoder', 0), 'kto': ('AttributeError: get_decoder', 0)},
    "1.5.1": {'dpo': ('AttributeError: get_decoder', 0), 'kto': ('AttributeError: get_decoder', 0)},
    "1.6.0": {'dpo': ('AttributeError: base_model', 0), 'kto': ('AttributeError: base_model', 0)},
    "1.7.0": {'dpo': ('AttributeError: base_model', 0), 'kto': ('AttributeError: base_model', 0)},
    "1.7.1": {'dpo': ('AttributeError: base_model', 0), 'kto': ('AttributeError: base_model', 0)},
    "1.8.0": {'dpo': ('AttributeError: base_model', 0), 'kto': ('AttributeError: base_model', 0)},
    "1.9.0": {'dpo': (25, 0), 'kto': (25, 0)},
    "1.9.1": {'dpo': (25, 0), 'kto': (25, 0)},
    "1.9.2": {'dpo': (25, 0), 'kto': (25, 0)},
    "1.10.0": {'dpo': (25, 0), 'kto': (25, 0)},
    "1.11.0": {'dpo': (25, 0), 'kto': (25, 0)},
    "1.12.0": {'dpo': (25, 0), 'kto': (25, 0)},
    "1.13.0": {'dpo': (25, 0), 'kto': (25, 0)},
    "1.14.0": {'dpo': (0, 0), 'kto': (0, 0)},
    "1.14.1": {'dpo': (0, 0), 'kto': (0, 0)},
    "1.14.2": {'dpo': (0, 0), 'kto': (0, 0)},
    "1.15.0": {'dpo': ('RuntimeError: 0 active drivers', 'RuntimeError: 0 active drivers'),
               'kto': ('RuntimeError: 0 active drivers', 'RuntimeError: 0 active drivers')},
    "1.16.0": {'dpo': (0, 0), 'kto': (0, 0)},
}


def line_of(version: str) -> Line | None:
    return next((line for line in LINES if version in line.versions), None)


def expected_status(version: str, patch: str) -> str:
    """What ``liger_ddp_patch.report()`` must say for ``patch`` under this release."""
    line = line_of(version)
    if line is None:
        raise KeyError(f"TRL {version} is not a release we have read")
    return "applied" if line.patched else "not_needed"


# The engine-report test (one interpreter per release, ~20 s) always runs the first release of every line.
REPRESENTATIVES = tuple(line.versions[0] for line in LINES)
# Releases whose code the fake-version tests borrow.
FAKE_SOURCES = ("1.12.0", "1.13.0", "1.14.0", "1.16.0")


def tier(version: str) -> str:
    """``always``: 2-rank runs in every CI run; ``report``: only the engine report always; ``full``: only with
    LIGER_DDP_PATCH_FULL_MATRIX=1."""
    return "always" if version in ALWAYS else "report" if version in REPRESENTATIVES else "full"


def ci_versions(full: bool) -> tuple[str, ...]:
    """The TRL releases .ci/trl_matrix.sh must unpack."""
    wanted = set(RELEASES) if full else {*ALWAYS, *REPRESENTATIVES, *FAKE_SOURCES, "1.12.0"}
    return tuple(v for v in RELEASES if v in wanted)

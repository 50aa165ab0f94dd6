"""The patch decision, table-driven: ``decide(record, version, target, mismatch)`` with no engine and no TRL around.

The first table is the generic gate (any library); the second runs every TRL release the package has read through
the real records, and compares with what the 2-rank runs showed (tests/matrix.py), stated independently of the
runtime data (RELEASES, AFFECTED, FIXED_IN).
"""

from __future__ import annotations

import matrix
import pytest
from test_engine import record

from liger_ddp_patch.engine import decide, decide_unimportable
from liger_ddp_patch.patches import PATCHES

FOUND, LOOKS_FIXED = "fakelib.Trainer.step", "step() no longer returns 'broken'"


@pytest.mark.parametrize(
    ("version", "target", "mismatch", "absent", "status", "reason"),  # absent: ("dep",); too old: ("dep 0.7 is ...",)
    [
        # a release we have read: its version decides
        ("1.12.0", FOUND, None, (), "applied", "step() fixed (fakelib.Trainer.step, fakelib 1.12.0 is affected)"),
        ("1.14.0", FOUND, LOOKS_FIXED, (), "not_needed", "fixed upstream in fakelib 1.14.0 (installed 1.14.0)"),
        ("1.14.0", FOUND, None, (), "not_needed", "fixed upstream in fakelib 1.14.0"),  # even if it still looked broken
        ("1.8.0", FOUND, None, (), "unsupported", "fakelib 1.8.0 is outside the affected range >=1.9.0,<1.14.0"),
        ("1.12.0", FOUND, LOOKS_FIXED, (), "unsupported", f"shape check failed: {LOOKS_FIXED}; left untouched"),
        ("1.12.0", None, None, (), "unsupported", "fakelib:Trainer.step not found in fakelib 1.12.0; left untouched"),
        ("1.12.0", None, None, ("optional_dep",), "not_needed", "optional_dep is not installed, so it never is"),
        (
            "1.12.0",
            None,
            None,
            ("optional-dep 0.7.0 is below fakelib 1.12.0's minimum 0.8.0",),
            "unavailable",
            "not found in fakelib 1.12.0: optional-dep 0.7.0 is below fakelib 1.12.0's minimum 0.8.0, so fakelib does "
            "not import it; nothing to patch",
        ),
        # a version we have not read: the code's shape decides
        ("1.13.1", FOUND, None, (), "applied", "fakelib 1.13.1 is not a release we have verified, applied because"),
        ("1.13.1", FOUND, LOOKS_FIXED, (), "unsupported", "shape check failed"),
        ("2.0.0", FOUND, None, (), "applied", "not a release we have verified"),
        (
            "2.0.0",
            FOUND,
            LOOKS_FIXED,
            (),
            "not_needed",
            f"fakelib 2.0.0 is not a release we have read, and {LOOKS_FIXED}",
        ),
        ("2.0.0", None, None, (), "not_needed", "not found in fakelib 2.0.0; upstream fixed this in 1.14.0"),
        # no usable version at all
        (None, FOUND, None, (), "unsupported", "cannot read a valid fakelib version (got None)"),
        ("not-a-version", FOUND, None, (), "unsupported", "cannot read a valid fakelib version (got 'not-a-version')"),
    ],
)
def test_gate(version, target, mismatch, absent, status, reason):
    too_old = [a for a in absent if " is below " in a]
    absent = [a for a in absent if a not in too_old]
    got = decide(record("fakelib"), version, target, mismatch, absent, too_old)
    assert got[0] == status and reason in got[1], got


def test_a_dependency_both_absent_and_too_old_reads_absent():
    """Only one of the two can be true at run time; absent is checked first (the engine asks for too_old only then)."""
    got = decide(record("fakelib"), "1.12.0", None, None, ("dep",), ("dep 0.7.0 is below fakelib 1.12.0's minimum",))
    assert got[0] == "not_needed", got


ERROR = "fakelib.trainer is in fakelib 1.12.0 but cannot be imported here: ModuleNotFoundError: No module named 'x'"


@pytest.mark.parametrize(
    ("version", "overrides", "status", "reason"),
    [
        ("1.12.0", {}, "unavailable", f"{ERROR}; nothing to patch until it imports"),  # affected: we would patch it
        ("1.13.1", {}, "unavailable", ERROR),  # not a release we have read: its shape would decide, it cannot run
        ("1.14.0", {}, "not_needed", "fixed upstream in fakelib 1.14.0 (installed 1.14.0)"),  # the version says so
        ("1.8.0", {}, "unavailable", ERROR),  # outside the range, not fixed: no patch to decide, and it cannot run
        (None, {}, "unavailable", ERROR),
    ],
)
def test_a_module_that_raises_on_import(version, overrides, status, reason):
    """Installed but raising on import: not needed only where the version alone says so, else unavailable."""
    got = decide_unimportable(record("fakelib", **overrides), version, ERROR)
    assert got[0] == status and reason in got[1], got


@pytest.mark.parametrize("version", matrix.ci_versions(full=True))
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_every_trl_release_gets_the_status_its_runs_call_for(patch, version):
    """Code as we read it in each release (found; shape as on the affected releases): status from the version alone."""
    if not matrix.exists_in(matrix.spec_of(patch.name), version):
        pytest.skip(f"no such trainer in TRL {version}: its module is never imported (tests/test_versions.py)")
    status, reason = decide(patch, version, "trl.trainer.x.Trainer.attr", None)
    assert status == matrix.expected_status(version, patch.name), reason


# A record that covers a later range, with an earlier one handling the releases before it (the 1.14.x compiled route).
LATER = dict(affected=">=1.14.0,<1.15.0", fixed_in="1.15.0", before="fix_step_old handles it")


@pytest.mark.parametrize(
    ("version", "overrides", "mismatch", "status", "reason"),
    [
        # past the fix by its base: its shape decides, and a shape we do not fix reads "looks fixed"
        ("1.15.0.dev0", LATER, None, "applied", "fakelib 1.15.0.dev0 is not a release we have verified, applied"),
        ("1.15.0.dev0", LATER, LOOKS_FIXED, "not_needed", "it looks fixed (upstream fixed this in 1.15.0)"),
        ("1.15.0rc1", LATER, None, "applied", "not a release we have verified"),  # any pre-release, not only .devN
        ("1.15.0a2", LATER, LOOKS_FIXED, "not_needed", "it looks fixed"),
        ("1.15.0.dev0+g1a2b3c", LATER, None, "applied", "not a release we have verified"),  # a git build's local tag
        # in the range by its base: the shape decides; the first range's pre-release may still be the code before it
        ("1.14.0.dev0", LATER, None, "applied", "fakelib 1.14.0.dev0 is not a release we have verified, applied"),
        (
            "1.14.0.dev0",
            LATER,
            LOOKS_FIXED,
            "not_needed",
            f"fakelib 1.14.0.dev0 is a pre-release of 1.14.0 and {LOOKS_FIXED}: its code may be from before "
            ">=1.14.0,<1.15.0 (fix_step_old handles it)",
        ),
        ("1.14.1.dev0", LATER, LOOKS_FIXED, "unsupported", "shape check failed"),  # 1.14.0 is out: past that code
        # before the range by its base: its code is older still, so the earlier record handles it
        ("1.13.0.dev0", LATER, None, "not_needed", "fakelib 1.13.0.dev0 (a pre-release of 1.13.0) is before >=1.14.0"),
        # the main record's range: its base past the fix, the shape decides
        ("1.14.0.dev0", {}, None, "applied", "fakelib 1.14.0.dev0 is not a release we have verified, applied"),
        ("1.14.0.dev0", {}, LOOKS_FIXED, "not_needed", "it looks fixed (upstream fixed this in 1.14.0)"),
        ("1.13.0.dev0", {}, None, "applied", "not a release we have verified"),
        ("1.13.0.dev0", {}, LOOKS_FIXED, "unsupported", "shape check failed"),
    ],
)
def test_a_pre_release_is_judged_by_its_code(version, overrides, mismatch, status, reason):
    """TRL installed from git (``1.15.0.dev0``) lies between releases: no range may exclude it (specifiers leave
    pre-releases out), so it is judged like any unknown version, by its base release and its code's shape."""
    got = decide(record("fakelib", **overrides), version, FOUND, mismatch)
    assert got[0] == status and reason in got[1], got

"""The patch decision, as a pure function: what to do with a record, given what the engine found.

Like ddtrace gating an integration on ``_supported_versions``, with one more input: the code itself. A release we
have read is judged by its version; any other version (a post-release, a future major, a pre-release such as TRL
installed from git) by the shape of its code.
"""

from __future__ import annotations

from collections.abc import Sequence

from .records import APPLIED, NOT_NEEDED, UNAVAILABLE, UNSUPPORTED, Patch


def decide(
    record: Patch,
    version: str | None,
    target: str | None,
    mismatch: str | None,
    absent: Sequence[str] = (),
    too_old: Sequence[str] = (),
) -> tuple[str, str]:
    """``(status, reason)`` for ``record``.

    ``version``: the installed version of ``record.distribution`` (``None``: unreadable). ``target``: where the
    attribute was found (``None``: nowhere). ``mismatch``: the shape check's objection to it (``None``: it looks like
    the code we fix). ``absent``: the modules of ``record.requires`` that are not installed. ``too_old``: for those
    installed below the host's minimum (``record.requires_min``), what says so.
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    dist = record.distribution
    if not record.affected:  # no version gate: code every release has; only the target and its shape decide
        if target is None:
            return UNSUPPORTED, f"{record.target} not found in {dist} {version}; left untouched"
        if mismatch is not None:
            return UNSUPPORTED, f"shape check failed: {mismatch}; left untouched"
        return APPLIED, f"{record.summary} ({target}, any {dist} version)"
    try:
        parsed = Version(version) if version else None
    except InvalidVersion:
        parsed = None
    if parsed is None:
        return UNSUPPORTED, f"cannot read a valid {dist} version (got {version!r}); left untouched"

    known = version in record.releases or str(parsed) in record.releases
    # A pre-release (TRL from git: 1.15.0.dev0) carries code from after the release before it up to its base release,
    # so no range may exclude it (specifiers skip pre-releases): it is judged by its base, and by its shape.
    dev = parsed.is_prerelease and not known
    judged = Version(parsed.base_version) if dev else parsed
    affected = SpecifierSet(record.affected)
    fixed = record.fixed_in is not None and judged >= Version(record.fixed_in)
    if record.before and not fixed and judged not in affected:
        of = f" (a pre-release of {judged})" if dev else ""
        return NOT_NEEDED, f"{dist} {version}{of} is before {record.affected}: {record.before}"
    if known and parsed not in affected:
        if fixed:
            return NOT_NEEDED, f"fixed upstream in {dist} {record.fixed_in} (installed {version})"
        return UNSUPPORTED, f"{dist} {version} is outside the affected range {record.affected}; left untouched"

    if target is None:
        why = f"{record.target} not found in {dist} {version}"
        if absent:
            return NOT_NEEDED, f"{why}: {', '.join(absent)} is not installed, so it never is"
        if too_old:  # the host imports the target only above that minimum: nothing of it runs here
            return UNAVAILABLE, f"{why}: {'; '.join(too_old)}, so {dist} does not import it; nothing to patch"
        if fixed:
            return NOT_NEEDED, f"{why}; upstream fixed this in {record.fixed_in}"
        return UNSUPPORTED, f"{why}; left untouched"

    if mismatch is not None:
        if not known and fixed:
            return NOT_NEEDED, (
                f"{dist} {version} is not a release we have read, and {mismatch}: it looks fixed "
                f"(upstream fixed this in {record.fixed_in})"
            )
        if dev and record.before and _may_predate(record, judged, affected):
            return NOT_NEEDED, (
                f"{dist} {version} is a pre-release of {judged} and {mismatch}: its code may be from before "
                f"{record.affected} ({record.before})"
            )
        return UNSUPPORTED, f"shape check failed: {mismatch}; left untouched"

    if known:
        return APPLIED, f"{record.summary} ({target}, {dist} {version} is affected)"
    return APPLIED, (
        f"{record.summary} ({target}); {dist} {version} is not a release we have verified, "
        "applied because the shape check matched the affected code"
    )


def _may_predate(record: Patch, base, affected) -> bool:
    """Whether a pre-release of ``base`` (in ``affected``) may still carry the code from before that range: no release
    we have read lies in the range below ``base`` (1.14.0.dev0 may be 1.13's code; 1.14.1.dev0 is past 1.14.0)."""
    from packaging.version import Version

    return not any(Version(r) < base and Version(r) in affected for r in record.releases)


def decide_unimportable(record: Patch, version: str | None, error: str) -> tuple[str, str]:
    """``(status, reason)`` for ``record`` when its module is installed but raised on import (``error`` says how).

    Not needed if the version alone says so (fixed upstream; another record covers the release); otherwise
    unavailable: the host's code cannot run in this environment, so nothing can reach the bug through it and there is
    nothing to patch until it imports (the hook decides then).
    """
    status, reason = decide(record, version, "(not imported)", None)  # as if found and shaped as we fix it
    if status == NOT_NEEDED:
        return status, reason
    return UNAVAILABLE, f"{error}; nothing to patch until it imports"

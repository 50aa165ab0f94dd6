"""The TRL releases the patch decisions know: every release whose trainer code we have read, and where the fix landed.

A release listed here is judged by its version (:func:`liger_ddp_patch.engine.decide`); any other version by the shape
of its code. Which shape each release has is in :mod:`.trainers`; what each release does under DDP, and which test
shows it, is the test plan's business (``tests/matrix.py``, which also writes docs/versions.md).

Upstream: TRL issue #7245 (DDP gradients not synchronised), PR #6372 (the ZeRO-3/FSDP-only redirect guard, 1.9.0),
PRs #7243/#7247 (fixed in 1.14.0).
"""

from __future__ import annotations

RELEASES: tuple[str, ...] = (
    "1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0", "1.5.0", "1.5.1", "1.6.0", "1.7.0", "1.7.1", "1.8.0",
    "1.9.0", "1.9.1", "1.9.2", "1.10.0", "1.11.0", "1.12.0", "1.13.0",
    "1.14.0", "1.14.1", "1.14.2", "1.15.0", "1.16.0",
)  # fmt: skip
FIXED_IN = "1.14.0"
AFFECTED = (
    f">={RELEASES[0]},<{FIXED_IN}"  # before 1.9.0 the DDP wrapper crashes the Liger path; 1.9-1.13 skip the all-reduce
)

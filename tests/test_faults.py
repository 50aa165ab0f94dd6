"""Bad environments, in real subprocesses: the host's import never breaks, and the diagnostic says why.

Each interpreter is bound by its imports on one core: all of them start in a module fixture, two at a time
(``harness.started_two_at_a_time``), and each test reads its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial

import pytest
from harness import started_two_at_a_time

REPORT = "import json\nprint(json.dumps([s.as_dict() for s in liger_ddp_patch.report()]))\n"


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})  # fmt: skip


def statuses(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {row["name"]: row for row in json.loads(proc.stdout.strip().splitlines()[-1])}


TRL_ABSENT = "import sys; sys.modules['trl'] = None\nimport liger_ddp_patch; liger_ddp_patch.report(resolve=True)\n"
LIGER_ABSENT = (
    "import sys; sys.modules['liger_kernel'] = None\nimport liger_ddp_patch\nfrom trl import DPOTrainer, KTOTrainer\n"
)
RELOAD = (
    "import importlib, liger_ddp_patch\nfrom trl import DPOTrainer, KTOTrainer\nfrom transformers import Trainer\n"
    "ours = [(DPOTrainer, 'compute_loss'), (KTOTrainer, 'compute_loss'), (Trainer, '__init__')]  # and the check\n"
    "trl_own = {(c, a): vars(c)[a].__wrapped__ for c, a in ours}\n"
    "assert all(f.__module__.startswith(('trl.', 'transformers.')) for f in trl_own.values())\n"
    "importlib.reload(liger_ddp_patch)\n"
    "assert all(vars(c)[a].__wrapped__ is f for (c, a), f in trl_own.items())  # not wrapped twice\n"
    "liger_ddp_patch.unpatch()\n"
    "assert all(vars(c)[a] is f for (c, a), f in trl_own.items()), 'unpatch() left our wrapper'\n"
)
NO_SHAPE = (
    "import liger_ddp_patch.patches.compute_loss as c\n"
    "c.SHAPES.clear()  # stands in for a TRL whose code changed shape\n"
    "import liger_ddp_patch\nfrom trl import DPOTrainer\nprint('imported')\n"
)


@pytest.fixture(scope="module")
def runs():
    calls = {
        "trl_absent": partial(python, TRL_ABSENT + REPORT),
        "liger_absent": partial(python, LIGER_ABSENT + REPORT, LIGER_DDP_PATCH_STRICT="1"),
        "reload": partial(python, RELOAD + REPORT),
        "strict": partial(python, NO_SHAPE, LIGER_DDP_PATCH_STRICT="1"),
        "relaxed": partial(python, NO_SHAPE),
    }
    with started_two_at_a_time(calls) as futures:
        yield futures


def test_trl_absent(runs):
    rows = statuses(runs["trl_absent"].result())
    assert rows.pop("gradient_sync_check")["status"] == "applied"  # transformers' Trainer: TRL or not
    for row in rows.values():
        assert row["status"] == "not_needed" and "cannot be imported" in row["reason"], row


def test_liger_kernel_absent_leaves_the_fused_loss_patches_not_needed_even_in_strict_mode(runs):
    rows = statuses(runs["liger_absent"].result())
    assert rows["dpo_compute_loss"]["status"] == rows["kto_compute_loss"]["status"] == "applied"
    for name in ("dpo_chunked_loss", "kto_chunked_loss"):
        assert rows[name]["status"] == "not_needed", rows[name]
        assert rows[name]["reason"].endswith("liger_kernel is not installed, so it never is")


def test_reload_then_unpatch_restores_trls_own_functions(runs):
    """``importlib.reload(liger_ddp_patch)``: the new engine takes over (never wraps twice) and can undo everything."""
    rows = statuses(runs["reload"].result())
    assert rows.pop("gradient_sync_check")["status"] == "disabled"
    ours = {name: row["status"] for name, row in rows.items() if name.startswith(("dpo_", "kto_"))}
    # every patch that was applied is removed; the 1.14.x records were never applied to this TRL (1.12)
    assert {s for name, s in ours.items() if not name.endswith("_compiled_ddp")} == {"disabled"}
    assert {s for name, s in ours.items() if name.endswith("_compiled_ddp")} == {"not_needed"}
    # GKD/GOLD/Distillation live in trl.experimental, which `from trl import DPOTrainer` never imports
    assert {row["status"] for name, row in rows.items() if not name.startswith(("dpo_", "kto_"))} == {"pending"}


def test_strict_mode_raises_from_the_trl_import_when_a_patch_cannot_apply(runs):
    """A TRL whose compute_loss no longer has the shape we fix: strict raises, non-strict imports fine."""
    strict = runs["strict"].result()
    assert strict.returncode != 0
    assert (
        "PatchError: LIGER_DDP_PATCH_STRICT=1 and these patches could not be applied: dpo_compute_loss (unsupported)"
        in strict.stderr
    )
    relaxed = runs["relaxed"].result()
    assert relaxed.returncode == 0 and "imported" in relaxed.stdout
    assert "dpo_compute_loss=unsupported (shape check failed: no known shape matches" in relaxed.stderr

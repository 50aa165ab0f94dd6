"""The one visible line: printed without any logging set up, once per process, on rank 0 only, at the user's level."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ANNOUNCE = "from liger_ddp_patch import log\nlog.announce('fix took effect %s', 1)\nlog.announce('again %s', 2)\n"


def stderr_of(setup: str, **env: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    full.update(PYTHONPATH=root, **env)
    proc = subprocess.run([sys.executable, "-c", setup + ANNOUNCE], capture_output=True, text=True, env=full)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


@pytest.mark.parametrize(
    ("setup", "env", "expected"),
    [
        ("", {}, "fix took effect 1\n"),  # no logging configured: our own handler, once per process
        ("", {"RANK": "1", "LOCAL_RANK": "1"}, ""),  # other ranks print nothing
        ("import logging\nlogging.getLogger('liger_ddp_patch').setLevel(logging.WARNING)\n", {}, ""),  # user's level
        ("import logging\nlogging.basicConfig(format='%(levelname)s %(name)s: %(message)s', level=logging.INFO)\n",
         {}, "INFO liger_ddp_patch: fix took effect 1\n"),  # the user's handlers, not a second copy of ours
    ],
    ids=["unconfigured", "rank-1", "user-level", "user-handlers"],
)  # fmt: skip
def test_announce(setup, env, expected):
    assert stderr_of(setup, **env) == expected

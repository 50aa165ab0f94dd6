"""How the package arrives in a process: import cost, sitecustomize chaining, PYTHONSTARTUP (all real subprocesses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "sitecustomize_example"


def python(code: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
        **kwargs,
    )


def test_import_loads_no_heavy_library():
    proc = python(
        "import sys, liger_ddp_patch; "
        "print([m for m in ('torch', 'transformers', 'trl', 'liger_kernel', 'packaging') if m in sys.modules])"
    )
    assert proc.stdout.strip() == "[]", proc.stderr


def test_sitecustomize_example_patches_and_chains_to_the_users_own(tmp_path):
    user = tmp_path / "user_site"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = '1'\n")
    env = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(user), os.environ.get("PYTHONPATH", "")])}
    proc = python(
        "import os, sys; print('liger_ddp_patch' in sys.modules, os.environ.get('USER_SITECUSTOMIZE_RAN'))", env
    )
    assert proc.stdout.split() == ["True", "1"], proc.stderr


def test_sitecustomize_without_the_package_warns_and_goes_on(tmp_path):
    shadow = tmp_path / "shadow"
    (shadow / "liger_ddp_patch").mkdir(parents=True)
    (shadow / "liger_ddp_patch" / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(EXAMPLE), str(shadow)])}
    proc = python("print('host ran')", env)
    assert proc.stdout.strip() == "host ran"
    assert "liger_ddp_patch is not importable (simulated: not installed); continuing unpatched" in proc.stderr


def test_pythonstartup_reaches_interactive_sessions_only():
    env = {"PYTHONSTARTUP": str(EXAMPLE / "pythonstartup.py")}
    code = "import sys; print('liger_ddp_patch' in sys.modules)\n"
    interactive = subprocess.run(
        [sys.executable, "-i", "-q"], input=code, capture_output=True, text=True, env={**os.environ, **env}, timeout=60
    )
    assert "True" in interactive.stdout
    assert python(code, env).stdout.strip() == "False"

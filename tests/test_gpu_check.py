"""benchmarks/gpu_check.py cannot rot before a GPU is lent: its --cpu-smoke runs every code path at tiny sizes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(SCRIPT.parent))

import gpu_check  # noqa: E402


@pytest.mark.ddp
def test_cpu_smoke_runs_both_parts(tmp_path):
    """(a) every arm runs and is close to the fp32 truth; (b) the 2-node DDP probe shows the bug and the fix."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(a) DPO head loss" in proc.stdout and "(b) DDP" in proc.stdout, proc.stdout
    report = json.loads((tmp_path / "gpu_check.json").read_text())

    rows_a = report["a"]
    assert {(r["arm"], r["prompt"]) for r in rows_a} == {(a, p) for a in gpu_check.ARMS_A for p in (0.5, 0.0)}
    for r in rows_a:
        assert "error" not in r, r
        assert r["ms"] > 0 and len(r["times_ms"]) == 2
        # bf16 against the fp32 truth: a few 1e-3 relative, as Liger; 5 % would mean a broken arm
        assert all(math.isfinite(e) and e < 5e-2 for e in r["err"].values()), r

    rows_b = {(r["trl"], r["trainer"], r["run"]): r for r in report["b"]}
    for trainer in ("dpo", "kto"):
        assert rows_b[("1.12.0", trainer, "unpatched")]["differing"] > 0  # TRL 1.9-1.13: silent desync
        assert "base_model" in rows_b[("1.8.0", trainer, "unpatched")]["error"]  # before 1.9: crash in DDP
        for version in gpu_check.DDP_TRL:
            patched = rows_b[(version, trainer, "patched")]
            assert (patched["differing"], patched["max_abs_diff"]) == (0, 0.0), patched
            assert patched["loss_class"].startswith("Chunked"), patched


def _fake_wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel (module ``name`` with VALUE = 42)."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def test_install_puts_missing_packages_in_common_and_each_trl_in_its_own_folder(tmp_path):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _fake_wheel(wheels, "liger_ddp_fakepkg", "0.1")
    _fake_wheel(wheels, "trl", "9.9.9")
    specs = [("liger-ddp-fakepkg", "0.1", "liger_ddp_fakepkg"), ("trl", "9.9.9", "trl"), ("pytest", "0.0", "pytest")]
    paths = gpu_check.install(wheels, tmp_path / "site", specs)  # pytest imports already: skipped, no wheel needed
    assert sorted(paths["installed"]) == ["liger_ddp_fakepkg-0.1-py3-none-any.whl", "trl-9.9.9-py3-none-any.whl"]
    assert (Path(paths["common"]) / "liger_ddp_fakepkg" / "__init__.py").exists()
    assert (Path(paths["trl-9.9.9"]) / "trl" / "__init__.py").exists()
    probe = subprocess.run(
        [sys.executable, "-c", "import liger_ddp_fakepkg as m; print(m.VALUE)"],
        text=True,
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=paths["common"]),
    )
    assert probe.stdout.strip() == "42", probe.stderr
    with pytest.raises(SystemExit, match="no wheel"):
        gpu_check.install(wheels, tmp_path / "site2", [("liger-ddp-absent", "1.0", "liger_ddp_absent")])


def test_wheel_list_is_what_gpu_wheels_sh_downloads():
    out = subprocess.run([sys.executable, str(SCRIPT), "--print-wheels"], capture_output=True, text=True, check=True)
    specs = out.stdout.split()
    assert specs == [f"{d}=={v}" for d, v, _ in gpu_check.WHEELS]
    assert {"trl==1.14.0", "trl==1.12.0", "trl==1.8.0", "liger-kernel==0.8.5"} <= set(specs)
    assert "--print-wheels" in (ROOT / "benchmarks" / "gpu_wheels.sh").read_text()

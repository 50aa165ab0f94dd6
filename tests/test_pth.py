"""The ``.pth`` activation, in a temporary site dir added with ``site.addsitedir`` (never the real site-packages)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from liger_ddp_patch import pth
from liger_ddp_patch.cli import main

PROBE = "import site, sys; site.addsitedir(sys.argv[1]); print('liger_ddp_patch' in sys.modules)"


def imported(site_dir, auto: str | None) -> bool:
    env = {k: v for k, v in os.environ.items() if k != pth.VARIABLE}
    if auto is not None:
        env[pth.VARIABLE] = auto
    out = subprocess.run([sys.executable, "-c", PROBE, str(site_dir)], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr
    return {"True": True, "False": False}[out.stdout.strip()]


def test_line_is_gated_before_any_import():
    assert pth.LINE.startswith("import os; ") and pth.LINE.count("\n") == 1
    assert 'os.environ.get("LIGER_DDP_PATCH_AUTO") == "1" and __import__("liger_ddp_patch")' in pth.LINE


def test_imports_only_with_the_variable(tmp_path):
    assert pth.install(tmp_path) == str(tmp_path / "liger_ddp_patch.pth")
    assert imported(tmp_path, "1") is True
    assert imported(tmp_path, None) is False
    assert imported(tmp_path, "0") is False
    assert pth.uninstall(tmp_path) == str(tmp_path / "liger_ddp_patch.pth")
    assert not (tmp_path / "liger_ddp_patch.pth").exists()
    assert imported(tmp_path, "1") is False
    assert pth.uninstall(tmp_path) is None  # nothing left: not an error


def test_default_site_dir_is_purelib():
    import sysconfig

    assert pth.path() == os.path.join(sysconfig.get_paths()["purelib"], "liger_ddp_patch.pth")


def test_missing_dir_is_a_clear_error(tmp_path):
    with pytest.raises(pth.PthError, match="is not an existing directory; pass --site-dir"):
        pth.install(tmp_path / "nope")


def test_unwritable_dir_is_a_clear_error(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        tmp_path.chmod(0o555)
    else:  # root writes anywhere: simulate the permission error

        def deny(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr("builtins.open", deny)
    try:
        with pytest.raises(
            pth.PthError, match=r"cannot write .*liger_ddp_patch\.pth: Permission denied; pass --site-dir"
        ):
            pth.install(tmp_path)
    finally:
        tmp_path.chmod(0o755)


def test_uninstall_leaves_a_foreign_file(tmp_path):
    (tmp_path / "liger_ddp_patch.pth").write_text("import something_else\n")
    with pytest.raises(pth.PthError, match="not written by liger_ddp_patch"):
        pth.uninstall(tmp_path)
    assert (tmp_path / "liger_ddp_patch.pth").exists()


def test_cli(tmp_path, capsys):
    assert main(["pth", "install", "--site-dir", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert f"wrote {tmp_path / 'liger_ddp_patch.pth'}" in out.out and "not read .pth files" in out.err
    assert main(["pth", "uninstall", "--site-dir", str(tmp_path)]) == 0
    assert f"removed {tmp_path / 'liger_ddp_patch.pth'}" in capsys.readouterr().out
    assert main(["pth", "uninstall", "--site-dir", str(tmp_path)]) == 0
    assert "nothing to remove" in capsys.readouterr().out
    assert main(["pth", "install", "--site-dir", str(tmp_path / "missing")]) == 1
    assert "liger-ddp-patch pth install: cannot install" in capsys.readouterr().err

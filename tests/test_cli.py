"""The command line, in real subprocesses (the CLI imports TRL, ~10 s each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "liger_ddp_patch", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_status_json_resolves_pending_and_reports_every_patch():
    """The pinned TRL (1.12.0) is affected and has the shapes we fix: all apply but Distillation's (TRL routes its
    whole loss since 1.10.0), exit code 0."""
    proc = cli("status", "--json")
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert set(rows) == {"dpo_compute_loss", "kto_compute_loss", "dpo_chunked_loss", "kto_chunked_loss",
                         "dpo_liger_settings", "kto_liger_settings", "gkd_compute_loss", "gold_compute_loss",
                         "distillation_compute_loss", "gkd_liger_settings", "distillation_liger_settings",
                         "iw_opd_compute_loss", "iw_opd_liger_settings"}  # fmt: skip
    import trl

    for name, row in rows.items():
        expected = "not_needed" if name.startswith("distillation_") else "applied"
        assert (row["status"], row["version"], row["runtime"]) == (expected, trl.__version__, {}), row
    assert proc.returncode == 0


def test_status_exits_1_when_a_patch_cannot_apply(tmp_path):
    """Metadata says 1.8.0 (affected) but the code is 1.16.0's: every patch is unsupported; the exit code says so."""
    from test_versions import fake_release

    from liger_ddp_patch.patches import NAMES

    proc = cli("status", env={"PYTHONPATH": str(fake_release(tmp_path, "1.8.0", "1.16.0"))})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.count("unsupported") == len(NAMES), proc.stdout


def test_status_table_says_disabled():
    proc = cli("status", env={"LIGER_DDP_PATCH_DISABLE": "1"})
    assert proc.returncode == 0
    lines = [line for line in proc.stdout.splitlines() if "disabled by LIGER_DDP_PATCH_DISABLE" in line]
    assert len(lines) == len(__import__("liger_ddp_patch.patches").patches.NAMES)


def test_status_json_single_name_disabled():
    rows = json.loads(cli("status", "--json", env={"LIGER_DDP_PATCH_DISABLE": "dpo_chunked_loss"}).stdout)
    statuses = {row["name"]: row["status"] for row in rows}
    assert statuses["dpo_chunked_loss"] == "disabled"
    assert statuses["dpo_compute_loss"] != "disabled"


def test_status_json_liger_settings_disabled_by_name():
    rows = json.loads(cli("status", "--json", env={"LIGER_DDP_PATCH_DISABLE": "kto_liger_settings"}).stdout)
    statuses = {row["name"]: row["status"] for row in rows}
    assert statuses["kto_liger_settings"] == "disabled"
    assert statuses["dpo_liger_settings"] == statuses["kto_compute_loss"] == "applied"


def test_run_puts_the_bootstrap_first_and_execs():
    probe = (
        "import sys, liger_ddp_patch.bootstrap as b; print('liger_ddp_patch' in sys.modules, sys.path[1] == b.FOLDER)"
    )
    proc = cli("run", "--", sys.executable, "-c", probe)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def test_run_without_a_command_explains_usage():
    proc = cli("run")
    assert proc.returncode == 2
    assert "usage: liger-ddp-patch run -- torchrun" in proc.stderr


def test_unknown_subcommand_is_rejected():
    proc = cli("frobnicate")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_demo_prints_the_before_after_table():
    """The README's main job, on a small vocabulary and one trainer to keep it under a minute."""
    proc = cli("demo", "--vocab-size", "64", "--trainers", "dpo")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("dpo ")]
    assert [row[1] for row in rows] == ["unpatched", "patched"]
    assert int(rows[0][3]) > 0 and rows[1][2:5] == ["25", "0", "0.000e+00"]  # every parameter counted
    assert "gradients in sync when patched" in proc.stdout


def test_status_shows_the_loss_options_and_says_what_is_wrong_with_them():
    """``LIGER_DDP_PATCH_LOSS``: the options the DDP swap will use, on the two chunked-loss rows (text and JSON); a bad
    value warns with what to write instead and falls back to the default."""
    proc = cli("status", env={"LIGER_DDP_PATCH_LOSS": "one_pass=0,token_chunk_size=512,sweep=triton"})
    lines = [line for line in proc.stdout.splitlines() if "LIGER_DDP_PATCH_LOSS" in line]
    assert [line.split()[0] for line in lines] == ["dpo_chunked_loss", "kto_chunked_loss"], proc.stdout
    said = "loss options (LIGER_DDP_PATCH_LOSS): one_pass=0, token_chunk_size=512, sweep=triton"
    assert all(line.endswith(said) for line in lines), proc.stdout
    proc = cli("status", "--json", env={"LIGER_DDP_PATCH_LOSS": "token_chunk_size=-1"})
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert rows["dpo_chunked_loss"]["reason"].endswith(
        "one_pass=1 (default), token_chunk_size=auto (default), sweep=eager (default)"
    )
    assert "SettingsWarning: LIGER_DDP_PATCH_LOSS='token_chunk_size=-1': token_chunk_size='-1' is not valid" in (
        proc.stderr
    )
    assert proc.returncode == 0

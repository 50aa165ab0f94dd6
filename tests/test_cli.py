"""The command line, in real subprocesses (the CLI imports TRL, ~10 s each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
from harness import two_at_a_time

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "liger_ddp_patch", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


# The CLI as if some distributions were not installed: Python's path finder, which finds both modules and their
# metadata, is swapped for one that skips them, so their import raises the very ModuleNotFoundError a missing package
# raises (from the import machinery, nothing of ours in the traceback) and importlib.metadata finds no version.
_HIDE = """
import sys
from importlib.machinery import PathFinder

args = sys.argv[1:]
hidden, rest = set(args[: args.index("--")]), args[args.index("--") + 1 :]


def shown(dist):
    return (dist.metadata["Name"] or "").replace("-", "_").lower() not in hidden


class Hiding(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in hidden else super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return filter(shown, PathFinder.find_distributions(*args, **kwargs))


sys.meta_path[:] = [Hiding if finder is PathFinder else finder for finder in sys.meta_path]
from liger_ddp_patch.cli import main

sys.exit(main(rest))
"""


def cli_without(hidden: tuple[str, ...], *args: str, pythonpath: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``liger-ddp-patch ARGS`` where the modules ``hidden`` (import names) are not installed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*pythonpath, str(ROOT)])}
    env = {k: v for k, v in env.items() if not k.startswith("LIGER_DDP_PATCH_")}
    return subprocess.run([sys.executable, "-c", _HIDE, *hidden, "--", *args], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip


def table(proc: subprocess.CompletedProcess) -> dict[str, tuple[str, str]]:
    """``{patch: (status, reason)}`` from the text table."""
    from liger_ddp_patch.patches import NAMES

    rows = [line.split(maxsplit=2) for line in proc.stdout.splitlines()]
    return {row[0]: (row[1], row[2]) for row in rows if len(row) == 3 and row[0] in NAMES}


@pytest.fixture(scope="module")
def status_runs(tmp_path_factory):
    """The plain ``status`` runs of the tests below, two at a time (each a fresh interpreter): label -> process."""
    from test_versions import fake_release, trl_dir

    calls = {
        "json": partial(cli, "status", "--json"),
        "one name": partial(cli, "status", "--json", env={"LIGER_DDP_PATCH_DISABLE": "dpo_chunked_loss"}),
        "settings by name": partial(cli, "status", "--json", env={"LIGER_DDP_PATCH_DISABLE": "kto_liger_settings"}),
    }
    if trl_dir("1.16.0") is not None:  # else its test skips, saying how to unpack it
        fake = fake_release(tmp_path_factory.mktemp("fake"), "1.8.0", "1.16.0")
        calls["fake 1.8.0"] = partial(cli, "status", env={"PYTHONPATH": str(fake)})
    return dict(zip(calls, two_at_a_time(*calls.values())))


def test_status_json_resolves_pending_and_reports_every_patch(status_runs):
    """The pinned TRL (1.12.0) is affected and has the shapes we fix: all apply but Distillation's (TRL routes its
    whole loss since 1.10.0), exit code 0."""
    from liger_ddp_patch.patches import NAMES

    proc = status_runs["json"]
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert set(rows) == NAMES
    assert NAMES >= {"dpo_compute_loss", "kto_compute_loss", "dpo_chunked_loss", "kto_chunked_loss",
                     "dpo_liger_settings", "kto_liger_settings", "gkd_compute_loss", "gold_compute_loss",
                     "distillation_compute_loss", "gkd_liger_settings", "distillation_liger_settings",
                     "iw_opd_compute_loss", "iw_opd_liger_settings"}  # fmt: skip
    import trl

    for name, row in rows.items():
        expected = "not_needed" if name.startswith("distillation_") else "applied"
        if name.endswith(("_compute_loss", "_chunked_loss", "_liger_settings")):
            assert (row["status"], row["version"], row["runtime"]) == (expected, trl.__version__, {}), row
        assert row["status"] in ("applied", "not_needed"), row
    assert proc.returncode == 0


def test_status_exits_1_when_a_patch_cannot_apply(status_runs):
    """Metadata says 1.8.0 (affected) but the code is 1.16.0's: every patch is unsupported; the exit code says so."""
    from test_versions import require

    from liger_ddp_patch.patches import NAMES

    require("1.16.0")
    proc = status_runs["fake 1.8.0"]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = table(proc)
    assert set(rows) == NAMES, proc.stdout
    spec_records = [n for n in NAMES if n.endswith(("_compute_loss", "_chunked_loss", "_liger_settings"))]
    assert len(spec_records) == 13 and all(rows[n][0] == "unsupported" for n in spec_records), proc.stdout


def test_status_table_says_disabled():
    proc = cli("status", env={"LIGER_DDP_PATCH_DISABLE": "1"})
    assert proc.returncode == 0
    lines = [line for line in proc.stdout.splitlines() if "disabled by LIGER_DDP_PATCH_DISABLE" in line]
    assert len(lines) == len(__import__("liger_ddp_patch.patches").patches.NAMES)


def test_status_json_single_name_disabled(status_runs):
    rows = json.loads(status_runs["one name"].stdout)
    statuses = {row["name"]: row["status"] for row in rows}
    assert statuses["dpo_chunked_loss"] == "disabled"
    assert statuses["dpo_compute_loss"] != "disabled"


def test_status_json_liger_settings_disabled_by_name(status_runs):
    rows = json.loads(status_runs["settings by name"].stdout)
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
    # the closing lines: the trainer's patches, no list of other trainers' pending records, what a user does next
    closing = proc.stdout.rstrip().splitlines()[-3:]
    assert closing[0].startswith("patches for dpo: dpo_compute_loss, dpo_chunked_loss, dpo_liger_settings applied")
    assert closing[2].startswith("in your job: `import liger_ddp_patch`") and "pending" not in proc.stdout, closing


def test_status_shows_the_loss_options_and_says_what_is_wrong_with_them():
    """``LIGER_DDP_PATCH_LOSS``: the options the DDP swap will use, on the two chunked-loss rows (text and JSON); a bad
    value warns with what to write instead and falls back to the default."""
    proc, bad = two_at_a_time(
        partial(cli, "status", env={"LIGER_DDP_PATCH_LOSS": "one_pass=0,token_chunk_size=512,sweep=triton,autocast=0"}),
        partial(cli, "status", "--json", env={"LIGER_DDP_PATCH_LOSS": "token_chunk_size=-1"}),
    )
    lines = [line for line in proc.stdout.splitlines() if "LIGER_DDP_PATCH_LOSS" in line]
    assert [line.split()[0] for line in lines] == ["dpo_chunked_loss", "kto_chunked_loss"], proc.stdout
    said = "loss options (LIGER_DDP_PATCH_LOSS): one_pass=0, token_chunk_size=512, sweep=triton, autocast=0"
    assert all(line.endswith(said) for line in lines), proc.stdout
    proc = bad
    rows = {row["name"]: row for row in json.loads(proc.stdout)}
    assert rows["dpo_chunked_loss"]["reason"].endswith(
        "one_pass=auto (default), token_chunk_size=auto (default), sweep=eager (default), autocast=1 (default)"
    )
    assert "SettingsWarning: LIGER_DDP_PATCH_LOSS='token_chunk_size=-1': token_chunk_size='-1' is not valid" in (
        proc.stderr
    )
    assert proc.returncode == 0


def test_help_names_every_trainer_without_importing_torch():
    """``--help`` says which trainers the package fixes, from the specs (one more spec, one more name), and stays
    cheap: no torch, no TRL."""
    from liger_ddp_patch.patches.trainers import SPECS

    code = (
        "import sys\nfrom liger_ddp_patch.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('LOADED', sorted(m for m in ('torch', 'trl', 'transformers') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    said = " ".join(proc.stdout.split())
    assert "TRL's Liger path of DPO, KTO, GKD, GOLD, Distillation and IW-OPD." in said, proc.stdout
    assert len(SPECS) == 6, "a new trainer: add its name above"
    assert "LOADED []" in said, proc.stdout


def test_status_header_names_liger_kernel_and_says_when_it_is_not_installed():
    """The header: TRL's and liger-kernel's versions. Without liger-kernel TRL never imports its fused losses: the
    two swaps are not needed (the bug needs TRL's Liger path), the header says "not installed", exit code 0."""
    from importlib.metadata import version

    import trl

    proc, without_liger, without_trl = two_at_a_time(
        partial(cli, "status"),
        partial(cli_without, ("liger_kernel",), "status"),
        partial(cli_without, ("trl",), "status"),
    )
    assert proc.stdout.splitlines()[0] == (
        f"liger_ddp_patch 0.1.0, TRL {trl.__version__}, liger-kernel {version('liger-kernel')}"
    ), proc.stdout
    proc = without_liger
    assert proc.stdout.splitlines()[0] == f"liger_ddp_patch 0.1.0, TRL {trl.__version__}, liger-kernel not installed"
    rows = table(proc)
    for name in ("dpo_chunked_loss", "kto_chunked_loss"):
        assert rows[name][0] == "not_needed", rows[name]
        assert rows[name][1].endswith("liger_kernel is not installed, so it never is"), rows[name]
    assert rows["dpo_compute_loss"][0] == "applied" and proc.returncode == 0, proc.stdout + proc.stderr
    proc = without_trl  # the gradient check's row has a version too: transformers', not TRL's
    assert proc.stdout.splitlines()[0].startswith("liger_ddp_patch 0.1.0, TRL not installed, "), proc.stdout
    assert table(proc)["gradient_sync_check"][0] == "applied", proc.stdout


def test_a_trainer_module_that_cannot_import_is_unavailable_with_its_error():
    """TRL 1.10.0 without ``requests`` (GOLD and IW-OPD import TRL's vLLM client): the trainer exists but cannot be
    imported. ``unavailable`` with the root error and where it was raised, and how to see the traceback (the reason
    does not promise one it does not show); Distillation is fixed upstream in 1.10.0 whatever its import does.
    Exit code 0: no job can run those trainers here, so none can reach the bug through them."""
    from test_versions import require

    trl_1_10 = (str(require("1.10.0")),)
    proc, as_json = two_at_a_time(
        partial(cli_without, ("requests",), "status", pythonpath=trl_1_10),
        partial(cli_without, ("requests",), "status", "--json", pythonpath=trl_1_10),
    )
    rows = table(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name, module in (("gold_compute_loss", "trl.experimental.gold.gold_trainer"),
                         ("iw_opd_compute_loss", "trl.experimental.iw_opd.iw_opd_trainer"),
                         ("iw_opd_liger_settings", "trl.experimental.iw_opd.iw_opd_trainer")):  # fmt: skip
        status, reason = rows[name]
        assert status == "unavailable", rows[name]
        assert reason.startswith(
            f"{module} is in trl 1.10.0 but cannot be imported here: ModuleNotFoundError: No module named 'requests' "
            "(raised at trl/generation/vllm_client.py:"
        ), reason
        assert reason.endswith(f"nothing to patch until it imports (the whole traceback: python -c 'import {module}')")
    for name in ("distillation_compute_loss", "distillation_liger_settings"):
        assert rows[name] == ("not_needed", "fixed upstream in trl 1.10.0 (installed 1.10.0)"), rows[name]
    assert {rows[n][0] for n in ("dpo_compute_loss", "kto_chunked_loss", "gkd_compute_loss")} == {"applied"}
    assert "look up" not in proc.stdout and "No module named 'requests'; nothing to patch" not in proc.stdout
    assert "\nunavailable: TRL code that cannot run in this environment" in proc.stdout, proc.stdout
    rows = {r["name"]: r for r in json.loads(as_json.stdout)}
    assert rows["gold_compute_loss"]["status"] == "unavailable" and rows["gold_compute_loss"]["version"] == "1.10.0"


def fake_liger_kernel(tmp_path: Path, version: str) -> Path:
    """A folder whose ``liger_kernel`` metadata says ``version`` (the installed code stays): what TRL's
    ``is_liger_kernel_available()`` reads, through importlib.metadata, first on PYTHONPATH."""
    info = tmp_path / f"liger-{version}" / f"liger_kernel-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: liger_kernel\nVersion: {version}\n")
    (info / "top_level.txt").write_text("liger_kernel\n")
    return info.parent


MINIMUM_CASES = {"1.10.0-below": ("1.10.0", "0.7.0", "0.8.0"), "1.12.0-below": ("1.12.0", "0.8.1", "0.8.2"),
                 "1.12.0-at-minimum": ("1.12.0", "0.8.2", None)}  # fmt: skip


@pytest.fixture(scope="module")
def minimum_runs(tmp_path_factory):
    """``status`` in each case below, two at a time (each a fresh interpreter): case -> the finished process."""
    from test_versions import trl_dir

    folder, calls = tmp_path_factory.mktemp("liger-minimum"), {}
    for case, (trl, liger, _) in MINIMUM_CASES.items():
        if (code := trl_dir(trl)) is not None:
            path = (str(fake_liger_kernel(folder / case, liger)), str(code))
            calls[case] = partial(cli_without, (), "status", pythonpath=path)
    return dict(zip(calls, two_at_a_time(*calls.values())))


@pytest.mark.parametrize("case", MINIMUM_CASES)
def test_a_liger_kernel_below_trls_minimum_is_named_as_the_cause(minimum_runs, case):
    """TRL imports its Liger fused losses only with liger-kernel at or above its own minimum (TRL's
    ``LIGER_KERNEL_MIN_VERSION``: 0.8.0 in 1.10.0, 0.8.2 in 1.12.0, read from TRL at run time): below it the swaps'
    target is missing because of that, which the row and the header say (``unavailable``, exit code 0: TRL refuses
    ``use_liger_kernel=True`` itself). The control: at the minimum, the swaps apply."""
    from test_versions import require

    trl, liger, minimum = MINIMUM_CASES[case]
    require(trl)
    proc = minimum_runs[case]
    header, rows = proc.stdout.splitlines()[0], table(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    below = f" (below TRL {trl}'s minimum {minimum})" if minimum else ""
    assert header == f"liger_ddp_patch 0.1.0, TRL {trl}, liger-kernel {liger}{below}", header
    for name in ("dpo_chunked_loss", "kto_chunked_loss"):
        status, reason = rows[name]
        if minimum is None:
            assert status == "applied", rows[name]
            continue
        assert status == "unavailable", rows[name]
        assert reason.endswith(
            f"not found in trl {trl}: liger-kernel {liger} is below trl {trl}'s minimum {minimum}, so trl does not "
            "import it; nothing to patch"
        ), reason
    assert rows["dpo_compute_loss"][0] == rows["kto_compute_loss"][0] == "applied"


def test_the_demos_closing_lines_say_what_ran_and_what_a_user_needs():
    """The probe imports only the trainers it runs, so the other trainers' records are still waiting for their import
    ("pending", as in a real job that never imports them): not listed. A patch of a trainer that ran is, whatever its
    status; a run out of sync says so instead of the advice."""
    from liger_ddp_patch.demo import closing

    report = [dict(name=n, status=s) for n, s in (
        ("dpo_compute_loss", "applied"), ("dpo_chunked_loss", "applied"), ("kto_compute_loss", "unsupported"),
        ("gkd_compute_loss", "pending"), ("iw_opd_compute_loss", "pending"), ("distillation_compute_loss", "pending"),
    )]  # fmt: skip
    lines = closing(report, ["dpo", "kto"], True, 95.2)
    assert lines == [
        "patches for dpo, kto: dpo_compute_loss, dpo_chunked_loss applied; kto_compute_loss unsupported",
        "took 95 s; gradients in sync when patched",
        "in your job: `import liger_ddp_patch` in the training script, or `liger-ddp-patch run -- torchrun ... "
        "train.py`; `liger-ddp-patch status` checks your TRL",
    ]
    lines = closing(report, ["dpo"], False, 95.2)
    assert lines[0] == "patches for dpo: dpo_compute_loss, dpo_chunked_loss applied"
    assert "PATCHED RUN NOT IN SYNC" in lines[1] and len(lines) == 2, lines

"""benchmarks/gpu_check.py cannot rot before a GPU is lent: its --cpu-smoke runs every code path at tiny sizes."""

from __future__ import annotations

import json
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

# (c) as the prepared GPU call runs it: TRL's float32 reference and a bf16 ref_model in one call (issue 32 item 4; the
# patched rows' ratios are against the patched row of the same reference). Three KTO launches (each 11-18 s on 2
# cores, 2026-12-07): Liger-off and the upgrades at TRL's own reference are the same launches as their bf16-reference
# arms but for the reference, and test_bench_step runs Liger-off already. The upgrade launched is the newest (TRL
# 1.16, issue 45), in place of TRL 1.14's: one code path with another TRL folder (bench_step.arm_env), bracketed by
# TRL 1.12's launches; part (a) runs both releases' heads, in a second process (7.5 CPU-s). That process is paid for
# by patched_onepass's launch, which at these sizes runs the very path of patched (every row fits a token chunk:
# "0.00 (one-pass)" for both); its setting, row check and target line are unit-tested below.
SMOKE_ARMS = "patched,patched+bf16ref,trl116+bf16ref"
# (b) on TRL 1.12.0 alone: its two-node launches are test_launchers' (the same harness function), and 1.8.0's crash
# in DDP is test_matrix's (real vocabulary, every CI run): two two-node launches, not the GPU call's four (~10 s less)
SMOKE_DDP_TRL = "1.12.0"


@pytest.mark.ddp
def test_cpu_smoke_runs_both_parts(tmp_path):
    """(a) every arm runs, ours takes the one-pass path (ours_long too, with pairs longer than a chunk), all
    within 1e-2 of the fp32 truth, each upgrade's head (TRL 1.14, 1.16) in a process of its release; (b) the 2-node
    DDP probe shows the bug and the fix with all 25 parameters counted; (c) TRL 1.16's step ran TRL 1.16.
    The row checks are gpu_check.check_rows, the ones the script's exit status comes from; a stale result in --out
    is deleted first; ``--memory``'s extra step is neither timed nor fatal where it cannot record."""
    (tmp_path / "gpu_check.json").write_text(json.dumps(dict(info={}, a=[], b=[])))
    (tmp_path / "ddp-1.12.0-patched").mkdir()
    (tmp_path / "ddp-1.12.0-patched" / "stale-from-an-earlier-run").write_text("{}")
    options = ["--cpu-smoke", "--out", str(tmp_path), "--memory", "--step-arms", SMOKE_ARMS, "--ddp-trl", SMOKE_DDP_TRL]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *options],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(a) DPO head loss" in proc.stdout and "(b) DDP" in proc.stdout, proc.stdout
    assert "(c) one whole DDP training step" in proc.stdout and "kto     patched" in proc.stdout, proc.stdout
    assert "x the GEMM floor" in proc.stdout and "(a floor)" in proc.stdout, proc.stdout  # (a): ours vs the floor
    assert "kto patched+bf16ref/trl116+bf16ref: time" in proc.stdout, proc.stdout
    assert "sim GiB" in proc.stdout and "peak/sim" in proc.stdout, proc.stdout  # (c): the simulated peak's column
    assert "all rows pass" in proc.stdout, proc.stdout[-3000:]
    # --memory: one more step per launch, not timed (the rows above still count 1 + 2 steps); on CPU the profiler's
    # allocation events are replayed (_memory.cpu_replay), so every arm's step reports its peak by site
    assert proc.stdout.count("memory: replayed peak") == len(SMOKE_ARMS.split(",")), proc.stdout[-3000:]
    assert "GiB (CPU); live there, by site:" in proc.stdout, proc.stdout[-3000:]
    assert not (tmp_path / "ddp-1.12.0-patched" / "stale-from-an-earlier-run").exists()
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert check_rows_strict(report) == []
    assert report["info"]["ddp_trl"] == [SMOKE_DDP_TRL] and {r["trl"] for r in report["b"]} == {SMOKE_DDP_TRL}
    settings = {r["arm"]: r.get("loss_setting") for r in report["c"]}
    assert settings["patched"] is None and settings["trl116+bf16ref"] is None, settings
    # issue 45: each upgrade's head ran in a process of its own release; TRL 1.16's step ran TRL 1.16.0
    assert {r["arm"] for r in report["a"]} >= set(gpu_check.UPGRADES), report["a"]
    assert sorted(p.name for p in tmp_path.glob("part_a-*.json")) == ["part_a-1.14.0.json", "part_a-1.16.0.json"]
    assert {r["arm"]: r["trl"] for r in report["c"]}["trl116+bf16ref"] == "1.16.0", report["c"]
    # issue 45 item 5: every step row carries its simulated peak (none at the smoke's V=512: nothing simulated there)
    assert all(r["sim_peak_gib"] is None for r in report["c"]), report["c"]
    # (b) runs after (c) now, where the budget leaves it time: here it did, and each part's seconds are recorded
    assert {"seconds_start", "seconds_a", "seconds_c", "seconds_b"} <= report["info"].keys(), report["info"]


def check_rows_strict(report):
    c, ddp_trl = report.get("c"), tuple(report.get("info", {}).get("ddp_trl", gpu_check.DDP_TRL))
    if c is None:
        return gpu_check.check_rows(report["a"], report["b"], reps=2, ddp_trl=ddp_trl)
    trainers, arms = tuple(dict.fromkeys(r["trainer"] for r in c)), tuple(dict.fromkeys(r["arm"] for r in c))
    references = {r["arm"]: r.get("reference") for r in c if "error" not in r}
    assert all((ref == "bf16") == arm.endswith(gpu_check.BF16_REF) for arm, ref in references.items()), references
    return gpu_check.check_rows(report["a"], report["b"], 2, ("a", "b", "c"), c, 2, trainers, arms, ddp_trl)


def _passing_report():
    rows_a = [
        dict(arm=a, prompt=p, ms=1.0, times_ms=[1.0, 1.0], err=dict(loss=1e-3, grad_h=1e-3, grad_w=1e-3),
             grad_fn="OnePassLossBackward" if a in ("ours", "ours_long", "ours_tri") else "DivBackward0")
        for a in gpu_check.ARMS_A for p in gpu_check.PROMPTS_A
    ]  # fmt: skip
    rows_b = []
    for trainer in ("dpo", "kto"):
        rows_b.append(dict(trl="1.12.0", trainer=trainer, run="unpatched", params=25, differing=3, max_abs_diff=0.1))
        rows_b.append(dict(trl="1.8.0", trainer=trainer, run="unpatched", error="AttributeError: base_model"))
        for version in gpu_check.DDP_TRL:
            rows_b.append(
                dict(trl=version, trainer=trainer, run="patched", params=25, differing=0, max_abs_diff=0.0,
                     loss_class="ChunkedDPOLoss")
            )  # fmt: skip
    rows_c = [
        dict(trainer=t, arm=a, s=1.0, tok_s=100.0, peak_gib=2.0, steps=[1.0], times=[[3, 1, 1], [3, 1, 1]],
             losses=["ChunkedDPOLoss"] if a.startswith("patched") else [],
             loss_setting=gpu_check.LOSS_SETTING.get(a), trl=gpu_check.release_of(a) or "1.12.0", sim_peak_gib=None)
        for t in gpu_check.STEP_TRAINERS for a in gpu_check.STEP_ARMS
    ]  # fmt: skip
    return dict(a=rows_a, b=rows_b, c=rows_c)


@pytest.mark.parametrize(
    "breakage",
    [
        "one parameter counted",
        "patched differs",
        "arm error 2e-2",
        "ours took two passes",
        "ours_long took two passes",
        "arm missing",
        "no desync unpatched",
        "1.8.0 did not crash",
        "step: patched failed",
        "step: patched ran Liger's loss",
        "step: an arm missing",
        "step: one measured step",
        "step: an arm failed silently",
        "step: one_pass=1 not set",
        "step: trl116 ran another TRL",
        "step: patched skipped by the budget",
        "step: no simulated peak beside the measured",
    ],
)
def test_check_rows_fails_each_broken_row(breakage):
    """The shared row checks pass a good report and catch each way a row can be wrong (so gpu_check exits 1); an
    arm other than patched that failed with a reason (e.g. Liger-off out of memory) is a result, not a failure."""
    report = _passing_report()
    assert check_rows_strict(report) == []
    a, b = report["a"], report["b"]
    patched = next(r for r in b if r["run"] == "patched")
    if breakage == "one parameter counted":
        patched["params"] = 1
    elif breakage == "patched differs":
        patched["differing"] = 1
    elif breakage == "arm error 2e-2":
        a[0]["err"]["grad_w"] = 2e-2
    elif breakage.endswith("took two passes"):
        next(r for r in a if r["arm"] == breakage.split()[0])["grad_fn"] = "AddBackward0"
    elif breakage == "arm missing":
        a.pop()
    elif breakage.startswith("step"):
        c = report["c"]
        patched = next(r for r in c if r["arm"] == "patched")
        if breakage == "step: patched failed":
            patched["error"] = "OutOfMemoryError: CUDA out of memory"
        elif breakage == "step: patched ran Liger's loss":
            patched["losses"] = ["LigerFusedLinearDPOLoss"]
        elif breakage == "step: an arm missing":
            c.pop()
        elif breakage == "step: one measured step":
            patched["times"][1] = [3, 1]
        elif breakage == "step: one_pass=1 not set":
            next(r for r in c if r["arm"] == "patched_onepass")["loss_setting"] = None
        elif breakage == "step: trl116 ran another TRL":  # e.g. its folder missing from PYTHONPATH: the installed one
            next(r for r in c if r["arm"] == "trl116")["trl"] = "1.12.0"
        elif breakage == "step: patched skipped by the budget":
            patched.clear()
            patched.update(trainer="dpo", arm="patched", error=gpu_check.NOT_RUN)
        elif breakage == "step: no simulated peak beside the measured":  # e.g. run_part_c no longer calls sim_peaks
            del next(r for r in c if r["arm"] == "trl116")["sim_peak_gib"]
        else:
            next(r for r in c if r["arm"] == "off")["error"] = ""
    elif breakage == "1.8.0 did not crash":  # checked where (b) ran 1.8.0 (the GPU call; not the CPU smoke)
        next(r for r in b if r["trl"] == "1.8.0" and r["run"] == "unpatched")["error"] = None
        assert gpu_check.check_rows(a, b, 2, ddp_trl=("1.12.0",)) == []
    else:
        next(r for r in b if r["run"] == "unpatched")["differing"] = 0
    assert check_rows_strict(report), breakage


def test_check_rows_accepts_an_arm_that_ran_out_of_memory():
    report = _passing_report()
    off = next(r for r in report["c"] if r["arm"] == "off")
    off.clear()
    off.update(trainer="dpo", arm="off", error="OutOfMemoryError: CUDA out of memory. Tried to allocate 9.3 GiB")
    assert check_rows_strict(report) == []
    assert any("dpo patched/off: no ratio (OutOfMemoryError" in line for line in gpu_check.targets(report["c"]))


H200_RESULTS = ROOT / "benchmarks" / "results" / "h200-2026-12-04" / "gpu_check.json"


def test_step_rows_get_the_simulated_peak_beside_the_measured_one():
    """Issue 45 item 5: the GPU checks the simulation. On 2026-12-04's H200 step rows (their base is the simulation's
    STEP_BASE) sim_peaks gives sim_gpu_peak --capacity's step at L=4,096 (11.88 GiB for the default and TRL 1.14,
    17.20 for Liger-off: results/sim-2026-12-07-gpu-peak/capacity_80gb.txt) and the measured / simulated ratio;
    a bf16 reference model keeps its arm's simulated step over its own base; KTO's two rows of L tokens compose the
    same step (its simulated lengths 4,096 and 8,192); a failed launch and the CPU smoke's shapes get none ("-")."""
    import sim_gpu_peak

    assert {a.removesuffix(gpu_check.BF16_REF) for a in gpu_check.DEFAULT_STEP_ARMS} <= gpu_check.SIM_ARM.keys()
    assert set(gpu_check.SIM_ARM.values()) <= sim_gpu_peak.CAPACITY_ARMS.keys()
    rows = [dict(r) for r in json.loads(H200_RESULTS.read_text())["c"]]
    bf16 = dict(next(r for r in rows if (r["trainer"], r["arm"]) == ("dpo", "patched")), arm="patched+bf16ref")
    bf16["base_gib"] -= 2.0  # a bf16 reference: half the float32 one's 4 GiB
    rows += [bf16, dict(trainer="dpo", arm="trl116", L=4096, V=151_936, H=3_584, error="OutOfMemoryError")]
    rows += [dict(rows[0], V=512, H=32)]
    found = {(r["trainer"], r["arm"], r["V"]): r for r in gpu_check.sim_peaks(rows)}
    patched, off, trl114 = (found[("dpo", arm, 151_936)] for arm in ("patched", "off", "trl114"))
    assert round(patched["sim_peak_gib"], 2) == round(trl114["sim_peak_gib"], 2) == 11.88, patched
    assert round(off["sim_peak_gib"], 2) == 17.20 and round(patched["peak_vs_sim"], 2) == 1.41, (off, patched)
    assert found[("dpo", "patched+bf16ref", 151_936)]["sim_peak_gib"] == patched["sim_peak_gib"] - 2.0
    assert all(r["sim_peak_gib"] is None for (t, a, v), r in found.items() if a == "trl116" or v == 512)
    assert round(found[("kto", "patched", 151_936)]["sim_peak_gib"], 2) == 11.88
    table = "\n".join(gpu_check.render_c(dict(device="cuda", ddp_device="cuda:0", step={}), rows))
    assert "   11.88     1.41" in table and "   17.20     1.28" in table, table  # sim GiB, peak/sim
    kto = next(line for line in table.splitlines() if line.startswith("kto     patched "))
    assert kto.split()[5] == "11.88", kto


def test_the_default_call_runs_every_arm_the_issue_lists():
    """Issue 45 item 5: the default GPU call's step arms are the table's (default, one_pass=1, Liger-off, TRL 1.14,
    TRL 1.16) then a bf16 reference model, its (a) the package eager and with the Triton sweep, TRL 1.16's head,
    Liger and the GEMM floor; (b) on TRL 1.12.0 alone, so that TRL 1.8.0's wheel is not even installed."""
    assert gpu_check.DEFAULT_STEP_ARMS == ("patched", "patched_onepass", "off", "trl114", "trl116", "patched+bf16ref")
    assert {"ours", "ours_tri", "trl116", "liger_c", "gemm"} <= set(gpu_check.ARMS_A)
    assert gpu_check.GPU_DDP_TRL == ("1.12.0",)
    assert ("trl", "1.8.0", "trl") not in gpu_check.needed_wheels(gpu_check.GPU_DDP_TRL)
    assert ("trl", "1.8.0", "trl") in gpu_check.needed_wheels(gpu_check.DDP_TRL)
    assert {w for w in gpu_check.needed_wheels(()) if w[0] == "trl"} == {("trl", "1.12.0", "trl")} | {
        ("trl", u.release, "trl") for u in gpu_check.UPGRADES.values()
    }


def test_part_b_runs_last_and_only_where_the_budget_leaves_it_time(tmp_path, capsys):
    """(b) is started after (c) and only with ``B_NEEDS`` seconds left: a spent budget says "not run" (and is not a
    failure), so that the step's arms keep the call's 10 minutes. The budget counts from the script's start."""
    assert gpu_check.main(["--cpu-smoke", "--parts", "b", "--budget", "0.001", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["b"] == [] and report["info"]["b_not_run"].startswith(gpu_check.NOT_RUN), report["info"]
    assert "not run: the time budget was spent" in capsys.readouterr().out


def test_the_triton_step_arm_is_checked_as_ours_and_reported_beside_patched():
    """``--step-arms patched,patched_triton,...``: its row must exist and run our loss; targets report its ratio to
    patched (not as a target)."""
    report = _passing_report()
    arms = ("patched", "patched_triton", *gpu_check.STEP_ARMS[1:])
    tri = [dict(r, arm="patched_triton", s=0.8, patched_time=1.25, patched_mem=1.0) for r in report["c"]
           if r["arm"] == "patched"]  # fmt: skip
    c = report["c"] + tri

    def check():
        return gpu_check.check_rows(report["a"], report["b"], 2, ("c",), c, 2, gpu_check.STEP_TRAINERS, arms)

    assert check() == []
    assert "dpo patched/patched_triton: time 1.25 (the Triton sweep faster), peak memory 1.00" in gpu_check.targets(c)
    tri[0]["losses"] = ["LigerFusedLinearDPOLoss"]
    assert any("not ours" in line for line in check())
    c.remove(tri[0])
    assert any("(c) rows" in line for line in check())


def test_the_budget_drops_the_last_arms_of_every_trainer_not_a_trainer():
    """(c) launches arm by arm (each for every trainer), so a spent budget skips the extra arms, said so and not a
    failure; the table's arms (patched, patched_onepass, off, trl114, trl116) come first for both trainers."""
    arms = (*gpu_check.STEP_ARMS, "patched+bf16ref")
    order = gpu_check.launch_order(arms, ("dpo", "kto"))
    assert order[:10] == [(a, t) for a in arms[:5] for t in ("dpo", "kto")] and len(order) == 12
    report = _passing_report()
    c = report["c"] + [dict(trainer=t, arm="patched+bf16ref", error=gpu_check.NOT_RUN) for t in ("dpo", "kto")]
    assert gpu_check.check_rows(report["a"], report["b"], 2, ("c",), c, 2, gpu_check.STEP_TRAINERS, arms) == []


def test_the_upgrades_are_one_table_every_comparison_reads():
    """Issue 45: "the upgrade" is every release in ``_upgrades.UPGRADES`` (TRL 1.14 and 1.16, the newest last): each
    is a default arm of the step with its own TRL folder, a peer of the verdict, and gpu_check's (a) and (c) run it."""
    import _arms
    import _upgrades
    import bench_step

    assert list(_upgrades.UPGRADES) == ["trl114", "trl116"] and _upgrades.NEWEST == "trl116"
    assert bench_step.UPGRADES == {"trl114": "1.14.0", "trl116": "1.16.0"}
    paths = bench_step.trl_dirs(type("Args", (), {"trl112_from_cache": False})())
    for arm, release in bench_step.UPGRADES.items():
        assert arm in bench_step.ARMS and bench_step.TRL_OF[arm] == release and paths[release].endswith(release)
        assert arm in _arms.ARMS and arm in gpu_check.ARMS_A and arm in gpu_check.STEP_ARMS, arm
        assert ("trl", release, "trl") in gpu_check.WHEELS, release
    assert _upgrades.UPGRADES["trl116"].label == "TRL 1.16"


def test_part_a_runs_each_release_in_a_process_of_its_own():
    """Two TRL releases cannot share a process (issue 45): (a) runs one process per upgrade's release, the arms that
    need no TRL in the first, and puts the rows back in ``ARMS_A``'s order."""
    groups = gpu_check.part_a_groups()
    assert groups == {"1.14.0": tuple(a for a in gpu_check.ARMS_A if a != "trl116"), "1.16.0": ("trl116",)}
    assert sorted(a for group in groups.values() for a in group) == sorted(gpu_check.ARMS_A)


def test_onepass_arm_runs_the_package_with_one_pass_set():
    """patched_onepass's ranks get ``LIGER_DDP_PATCH_LOSS=one_pass=1`` and the package (bench_step's arm), what
    check_rows expects of its row; targets() reports the default against it, not as a target (the line the CPU smoke
    checked while it launched the arm)."""
    import bench_step

    env = bench_step.arm_env("patched_onepass", 1, {}, {})
    assert env["LIGER_DDP_PATCH_LOSS"] == gpu_check.LOSS_SETTING["patched_onepass"] == "one_pass=1", env
    assert "LIGER_DDP_PATCH_DISABLE" not in env, env
    c = _passing_report()["c"]
    next(r for r in c if (r["trainer"], r["arm"]) == ("kto", "patched_onepass")).update(patched_time=1.05,
                                                                                       patched_mem=0.9)  # fmt: skip
    assert "kto patched/patched_onepass: time 1.05 (the default against one_pass=1), peak memory 0.90" in (
        gpu_check.targets(c)
    )


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
    assert {"trl==1.14.0", "trl==1.16.0", "trl==1.12.0", "trl==1.8.0", "liger-kernel==0.8.5"} <= set(specs)
    assert "--print-wheels" in (ROOT / "benchmarks" / "gpu_wheels.sh").read_text()


@pytest.mark.ddp
def test_gpu_profile_cpu_smoke(tmp_path):
    """benchmarks/gpu_profile.py's code paths on CPU: (a) every arm timed and one step of ours and of the floor
    profiled per row; (c) one step launch whose extra step is profiled on both ranks (``BENCH_STEP_PROFILE``) and
    left out of the timed steps."""
    script = ROOT / "benchmarks" / "gpu_profile.py"
    cmd = [sys.executable, str(script), "--cpu-smoke", "--out", str(tmp_path), "--reps", "1", "--trainers", "dpo",
           "--arms", "patched", "--budget", "900", "--timeout-c", "600"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_profile.json").read_text())
    assert {(r["kind"], r["prompt"]) for r in report["a"]} == {(k, p) for k in ("dpo", "kto") for p in (0.5, 0.0)}
    for row in report["a"]:
        assert all(row["ms"][arm] > 0 for arm in ("ours", "gemm", "mat")), row
        assert row["profile_ours"]["gemm_ms"] > 0 and row["profile_ours"]["other_ms"] > 0, row["profile_ours"]
    (step,) = report["c"]
    assert step["error"] is None and set(step["profile"]) == {"0", "1"}, step
    assert all(len(t) == 2 for t in step["times"]), step["times"]  # warm-up + 1 measured; the profiled one apart
    assert any("OnePassLoss" in op["op"] for op in step["profile"]["0"]["by_cpu"]), step["profile"]["0"]["by_cpu"]


def test_bench_sweeps_gpu_arm_set_runs_on_cpu():
    """benchmarks/bench_sweeps.py --device cuda is prepared, not yet run on a GPU: its arm set (--as-accelerator)
    runs here, every arm gets a row, and each sweep arm is compared with ``now`` (a number in its last column).
    Whether ``now`` itself is right is the next test's business (its own difference, 0 by construction, says
    nothing)."""
    script = ROOT / "benchmarks" / "bench_sweeps.py"
    cmd = [sys.executable, str(script), "--as-accelerator", "--vocab", "512", "--rounds", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    assert {"gemm_bf16", "gemm_fp32out", "restore", "now"} <= rows.keys(), proc.stdout
    for name, row in rows.items():
        if name == "arm":  # the header
            continue
        compared = row.rstrip(" |").rsplit("|", 1)[1].strip()
        assert (compared == "-") == (name.startswith("gemm") or name == "restore"), row
        if compared != "-":
            float(compared)


def test_bench_sweeps_reference_arm_is_the_true_gradient():
    """The reference every bench_sweeps arm is compared with (``now``: the package's accelerator branch of the
    softmax/gradient sweep, as a GPU runs it) against a float64 truth written here: ``mult * (softmax(x) -
    onehot(label))`` per row of the same logits block. Within bf16 rounding of the largest entry: bound 2^-8 of it,
    measured 2.1e-3 (2^-9, one bf16 rounding); a 1 % error in the sweep gives 1.1e-2, a dropped row factor ~200."""
    import bench_sweeps
    import torch

    V, hidden, rows = 512, 64, 16
    found, *_ = bench_sweeps.accelerator_arms(V, "cpu", hidden, False, rows)
    ours = found["now"]().double()
    h, w, labels, mult = bench_sweeps._block(V, hidden=hidden, rows=rows)  # the same seeded block
    x = torch.mm(h, w.t()).double()  # on CPU the GEMM's block is bf16, then fp32 (exact in float64)
    truth = (torch.softmax(x, 1) - torch.nn.functional.one_hot(labels[:, 0], V).double()) * mult.double()[:, None]
    scale = truth.abs().max().item()
    assert scale > 0 and ours.shape == truth.shape
    assert (ours - truth).abs().max().item() <= 2**-8 * scale, (ours - truth).abs().max().item() / scale

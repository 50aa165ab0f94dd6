"""benchmarks/bench_step.py: its smallest configuration runs, and its bookkeeping (estimates, ratios, verdicts,
rows that did not run) says what happened.  The numbers themselves come from running the benchmark, not from here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_step.py"
sys.path.insert(0, str(SCRIPT.parent))

import bench_step  # noqa: E402

GIB = bench_step.GIB


def _run(tmp_path, *extra, timeout=600):
    out = tmp_path / "step.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


@pytest.mark.ddp
def test_smallest_configuration_runs_patched_and_liger_off(tmp_path):
    """DPO, V=512, L=32, two 2-rank launches (~2 x 20 s, almost all start-up): each arm times a warm-up and two
    steps on both ranks, the patched arm trains through our loss, Liger-off through none, and the table row holds
    both arms and their ratio."""
    stdout, report = _run(tmp_path, "--trainers", "dpo", "--arms", "patched,off")
    runs = {r["arm"]: r for r in report["runs"]}
    assert set(runs) == {"patched", "off"}
    for arm, r in runs.items():
        assert "error" not in r, (arm, r.get("error"), r.get("log_tail"))
        assert len(r["ranks"]) == 2 and all(len(rank["times"]) == 3 for rank in r["ranks"]), r["ranks"]
        assert all(rank["peak"] >= rank["base"] > 0 for rank in r["ranks"])
        assert all(len(rank["cpu"]) == 3 and min(rank["cpu"]) > 0 for rank in r["ranks"])
    assert runs["patched"]["ranks"][0]["losses"] == ["ChunkedDPOLoss"]
    assert runs["off"]["ranks"][0]["losses"] == []
    (row,) = report["table"]
    assert row["tokens"] == 2 * 2 * 32 and row["ratios"]["time/off"] > 0
    assert "| DPO | fp32 | 50% | 32 | 128 |" in stdout, stdout


@pytest.mark.ddp
def test_one_process_launch_measures_an_arm_that_two_ranks_cannot_fit(tmp_path):
    """``--nproc 1`` (how Liger-off's L=2048 peak was measured: one process, no DDP) reports its one rank: times,
    base and peak."""
    _, report = _run(tmp_path, "--trainers", "dpo", "--arms", "off", "--nproc", "1", "--warmup", "0", "--steps", "1")
    (run,) = report["runs"]
    assert "error" not in run, (run.get("error"), run.get("log_tail"))
    (rank,) = run["ranks"]
    assert rank["world"] == 1 and len(rank["times"]) == 1 and rank["peak"] >= rank["base"] > 0, rank


def test_rows_over_the_memory_limit_are_reported_not_launched(tmp_path):
    """A memory limit below any estimate: nothing launches (seconds), and every arm's row says why, with the
    estimate, in the table and in the JSON."""
    stdout, report = _run(tmp_path, "--mem-limit-gib", "0.01", "--trainers", "dpo,kto", timeout=120)
    assert len(report["runs"]) == 2 * len(bench_step.ARMS)
    for r in report["runs"]:
        assert r["error"].startswith("not run here: memory (estimated") and "ranks" not in r, r
    assert stdout.count("* DPO fp32 50% L=32 ") == len(bench_step.ARMS), stdout  # the notes under the table
    assert "| DPO | fp32 | 50% | 32 | 128 | not run |" in stdout


def _launch(arm, L, peak, base=1 * GIB, times=(9.0, 2.0, 4.0), slower_rank=(9.0, 3.0, 3.0)):
    ranks = [dict(times=list(times), cpu=[t / 2 for t in times], base=base, peak=peak, losses=[], world=2, seqs=2),
             dict(times=list(slower_rank), cpu=[1.0] * 3, base=base, peak=peak - 1, losses=[], world=2,
                  seqs=2)]  # fmt: skip
    return dict(arm=arm, trainer="dpo", dtype="fp32", prompt=0.5, L=L, ranks=ranks, warmup=1)


def test_summary_takes_the_slower_rank_per_step_after_the_warm_up():
    s = bench_step.summarise("patched", [_launch("patched", 512, peak=3 * GIB)])
    assert s["steps"] == [3.5]  # per step max over ranks: 3.0, 4.0; warm-up (9.0) dropped; median 3.5
    assert s["tokens"] == 2 * 2 * 512 and s["tok_s"] == pytest.approx(2048 / 3.5)
    assert s["peak_gib"] == pytest.approx(3.0)  # the larger rank's high-water mark
    assert s["cpu_s"] == pytest.approx(1.5)  # the larger rank's median CPU seconds after the warm-up: 1.0 and 2.0
    assert bench_step.summarise("off", [dict(error="crashed (exit [1]): boom")]) == {
        "error": "crashed (exit [1]): boom"
    }


def test_ratios_and_targets_per_row():
    runs = {"patched": [_launch("patched", 2048, 3 * GIB)], "off": [_launch("off", 2048, 7 * GIB, times=(1, 4, 4))]}
    row = dict(L=2048, ratios={"time/off": bench_step.ratios(runs, "patched", "off", "s"),
                               "mem/off": bench_step.ratios(runs, "patched", "off", "peak_gib")})  # fmt: skip
    assert row["ratios"]["time/off"] == pytest.approx(3.5 / 4) and row["ratios"]["mem/off"] == pytest.approx(3 / 7)
    assert bench_step.verdict(row) == "ok time/off, ? time/trl114, ? time/trl116, ok mem/off"
    row["ratios"].update({"time/trl114": 1.05, "time/trl116": 0.9, "mem/off": 0.6})
    assert bench_step.verdict(row) == "ok time/off, MISS time/trl114, ok time/trl116, MISS mem/off"
    row["L"] = 512  # the memory target is for L >= 2048 only
    assert bench_step.verdict(row) == "ok time/off, MISS time/trl114, ok time/trl116"
    row["ratios"]["time/trl116"] = 1.01  # the newest upgrade is a peer as much as the first
    assert bench_step.verdict(row) == "ok time/off, MISS time/trl114, MISS time/trl116"


def test_the_held_sums_are_broken_out_per_arm():
    """Each package arm's row says what (V, H) sums its loss held and which path it took (the loss's own
    ``last_held``, the larger rank's): held on the one-pass path, nothing where the budget sent it to two passes."""
    vh = 0.5 * GIB
    one = dict(vh_sums=1, vh_sums_bytes=vh, cast_bytes=0, extra_bytes=vh, path="one-pass")
    two = dict(one, path="two-pass: one pass would hold 512 MiB more (> 384 MiB)")
    launches = {}
    for arm, held in (("patched", two), ("patched_onepass", one)):
        launches[arm] = _launch(arm, 2048, 3 * GIB)
        launches[arm]["ranks"][1]["held"] = held
        launches[arm]["ranks"][0]["held"] = dict(held, vh_sums_bytes=0)  # the other rank held less
    cells = {arm: bench_step.held_cell(bench_step.summarise(arm, [r])["held"]) for arm, r in launches.items()}
    assert cells == {"patched": "0.00 (two-pass; one pass: 0.50)", "patched_onepass": "0.50 (one-pass)"}
    assert bench_step.held_cell(None) == "-"  # an arm without the package's loss
    wide = dict(one, vh_sums=0, vh_sums_bytes=0, chunk_bytes=0.02 * GIB)  # a chunk widened to the longest row
    assert bench_step.held_cell(wide) == "0.00 (one-pass, wider chunk: +0.02)"
    table = [dict(trainer="dpo", dtype="mixed", prompt=0.5, L=2048, tokens=8192, verdict="",
                  arms={a: bench_step.summarise(a, [r]) for a, r in launches.items()}, ratios={})]  # fmt: skip
    text = bench_step.render(table, ["patched", "patched_onepass"], "h")
    assert "patched held (V,H) GiB, path | patched_onepass held (V,H) GiB, path |" in text
    assert "| 0.00 (two-pass; one pass: 0.50) | 0.50 (one-pass) |" in text, text


def test_memory_estimates_use_what_was_measured():
    size = bench_step.MODEL
    cfg = ("dpo", "fp32", 0.5, 2048)
    by_sizes, how = bench_step.estimate_gib("off", cfg, size, {})
    assert how.startswith("from sizes") and by_sizes > bench_step.estimate_gib("patched", cfg, size, {})[0]
    one = {("off", "dpo", "fp32", 0.5, 512): _launch("off", 512, peak=5 * GIB)}
    est, how = bench_step.estimate_gib("off", cfg, size, one)
    grow = bench_step._sizes_per_rank("off", "fp32", 2048, size) - bench_step._sizes_per_rank("off", "fp32", 512, size)
    assert how == "peak at L=512 + logits-sized growth" and est == pytest.approx(2 * (5 * GIB + grow) / GIB)
    two = {**one, ("off", "dpo", "fp32", 0.5, 128): _launch("off", 128, peak=4 * GIB)}
    est, how = bench_step.estimate_gib("off", cfg, size, two)  # the line through (128, 4) and (512, 5): 2048 -> 9
    assert how == "line through the peaks at L=128 and L=512" and est == pytest.approx(2 * 9)
    assert bench_step.estimate_gib("off", ("dpo", "fp32", 0.5, 128), size, two)[1].startswith("from sizes")


def test_machine_line_says_whether_bf16_gemms_are_native():
    """Every benchmark header names the CPU and whether its bf16 GEMMs are native: on an AVX2-only CPU torch emulates
    them and a bf16 row's ratio to the GEMM floor says nothing about the loss (benchmarks/_machine.py)."""
    import _machine

    assert _machine.bf16_gemm({"avx2", "avx512_bf16", "amx_bf16"}) == "AMX"
    assert _machine.bf16_gemm({"avx512f", "avx512_bf16"}) == "AVX-512 BF16"
    assert _machine.bf16_gemm({"avx2", "fma"}) == "emulated"
    assert "bf16 GEMM" in _machine.describe()


def test_each_arm_gets_its_package_setting():
    """patched: the package on, the loss's defaults; patched_triton: also ``sweep=triton``; the others: the package
    off (``LIGER_DDP_PATCH_DISABLE=1``), each with its own TRL first on ``PYTHONPATH``."""
    paths = {"1.12.0": "/trl-1.12", "1.14.0": "/trl-1.14", "1.16.0": "/trl-1.16", "common": "/common"}
    env = {arm: bench_step.arm_env(arm, 1, paths, environ={}) for arm in (*bench_step.ARMS, *bench_step.EXTRA_ARMS)}
    assert "LIGER_DDP_PATCH_DISABLE" not in env["patched"] and "LIGER_DDP_PATCH_LOSS" not in env["patched"]
    assert env["patched_triton"]["LIGER_DDP_PATCH_LOSS"] == "sweep=triton"
    assert "LIGER_DDP_PATCH_DISABLE" not in env["patched_triton"]
    assert env["patched_noautocast"]["LIGER_DDP_PATCH_LOSS"] == "autocast=0"  # the routed path before autocast
    assert "LIGER_DDP_PATCH_DISABLE" not in env["patched_noautocast"]
    assert env["patched_fullkl"]["LIGER_DDP_PATCH_DISABLE"] == "kto_kl_logps"  # KTO's KL rows before issue 32 item 3
    assert env["patched_onepass"]["LIGER_DDP_PATCH_LOSS"] == "one_pass=1"  # one pass whatever it holds (issue 39)
    assert "LIGER_DDP_PATCH_DISABLE" not in env["patched_onepass"]
    for arm in ("off", "trl114", "trl116", "unpatched"):
        assert env[arm]["LIGER_DDP_PATCH_DISABLE"] == "1" and "LIGER_DDP_PATCH_LOSS" not in env[arm], arm
    assert env["trl114"]["PYTHONPATH"].startswith("/trl-1.14") and env["off"]["PYTHONPATH"].startswith("/trl-1.12")
    assert env["trl116"]["PYTHONPATH"].startswith("/trl-1.16")


def _frames(*names):
    return [dict(filename=f, line=1, name=n) for f, n in names]


def test_memory_replay_finds_the_peak_and_who_holds_it():
    """``_memory.peak_sites`` (gpu_check ``--memory``): the allocator's trace replayed from the bytes live before it;
    a free of a block the trace never saw allocated leaves that base; live blocks at the peak summed by the innermost
    frame in a library of the step, else the innermost frame, else "no Python frame"."""
    import _memory

    loss = _frames(("/x/torch/nn/functional.py", "linear"), ("/r/liger_ddp_patch/losses/_onepass.py", "__init__"),
                   ("/s/trl/trainer/dpo_trainer.py", "compute_loss"))  # fmt: skip
    trl = _frames(("/s/site-packages/trl/trainer/dpo_trainer.py", "concatenated_forward"))
    events = [
        dict(action="alloc", addr=1, size=50, frames=loss),
        dict(action="alloc", addr=2, size=30, frames=trl),
        dict(action="free_requested", addr=9, size=20, frames=[]),  # not a replay event: free_completed is
        dict(action="free_completed", addr=9, size=20, frames=[]),  # a block from before the trace
        dict(action="alloc", addr=3, size=40, frames=[]),  # the peak: 100 + 50 + 30 - 20 + 40
        dict(action="free_completed", addr=1, size=50, frames=loss),
        dict(action="alloc", addr=4, size=45, frames=_frames(("/x/torch/optim/sgd.py", "step"))),
    ]
    got = _memory.peak_sites(events, base=100)
    assert got["peak"] == 200 and got["at_peak"] == []
    assert {s["site"]: s["bytes"] for s in got["sites"]} == {
        _memory.BEFORE: 80,
        "liger_ddp_patch/losses/_onepass.py:__init__": 50,
        _memory.NO_FRAME: 40,
        "trl/trainer/dpo_trainer.py:concatenated_forward": 30,
    }
    assert _memory.site(_frames(("/x/torch/optim/sgd.py", "step"))) == "optim/sgd.py:step"
    lines = _memory.render(dict(got, max_allocated=200))
    assert "replayed peak" in lines[0] and any("_onepass.py:__init__" in line for line in lines)
    assert _memory.summary(None, cuda=False)["error"].startswith("not recorded")


def test_cpu_memory_replay_peaks_where_the_most_is_live():
    """On CPU ``_memory.record`` / ``summary`` replay the profiler's allocation events (issue 39: which phase sets a
    DDP step's peak): 4 + 8 MiB live at once is the peak, not the 4 MiB allocated after both were freed."""
    import _memory
    import torch

    started = _memory.record(cuda=False)
    a = torch.ones(1 << 20)  # 4 MiB
    b = torch.ones(2 << 20)  # 8 MiB
    del a, b
    c = torch.ones(1 << 20)
    del c
    got = _memory.summary(started, cuda=False)
    mib = 1 << 20
    assert 12 * mib <= got["peak"] < 12 * mib + mib // 4, got
    assert got["sites"][0]["bytes"] == 12 * mib and got["sites"][0]["blocks"] == 2, got["sites"]
    assert "replayed peak 0.01 GiB (CPU)" in _memory.render(got)[0]

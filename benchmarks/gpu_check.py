#!/usr/bin/env python
"""The one prepared GPU check (issues #9, #22, #45): the loss head in bf16 at a real size, a whole DDP step per arm
with its measured peak beside the simulated one, and real GPU DDP, in one call of <= 10 minutes.

    bash benchmarks/gpu_wheels.sh                    # here, with network: wheels the GPU machine lacks -> .whl/
    python3 benchmarks/gpu_check.py --out $OUT       # there: one H200 or H100, no network (carry .whl); ~9.5 min
    python3 benchmarks/gpu_check.py --cpu-smoke      # anywhere: the same code paths at tiny sizes on CPU (a test)

(a) DPO head loss, bf16, V=151,936, H=3,584, B=16, L=512 (8 pairs: each pair fits one token chunk), 50 % and 0 %
    prompt: ours (one pass, eager sweep), ours with a token chunk of L / 2 (``ours_long``: every pair longer than a
    chunk, still one pass) vs ours with the one-pass path off (``ours_2p``) vs ours with ``sweep="triton"``
    (``ours_tri``) vs Liger fused (compiled=True) vs the upgrades' head paths (``_upgrades.UPGRADES``: TRL 1.14's
    chunked log-prob path, TRL 1.16's fused LM head, on a GPU its Triton kernels) vs materialised logits vs the GEMM
    floor (``gemm``: the head's three bf16 GEMMs alone, logits, grad-hidden, grad-weight); per arm the median step
    time (CUDA events), ``torch.cuda.max_memory_allocated`` over the step minus what was allocated before it, the
    relative error of loss, grad-hidden and grad-weight against an fp32 materialised reference on the same values,
    and the path the loss took (its ``grad_fn``).  Two TRL releases cannot share a process: one process per release,
    the arms that need no TRL in the first; on a GPU one after the other, in the CPU smoke at once.  No simulated
    peak beside these: ``sim_gpu_peak.py`` simulates (c)'s shapes (one pair of 4,096 tokens), not (a)'s.
(c) One whole DDP training step (benchmarks/bench_step.py's launches, issue #22): bf16, V=151,936, H=3,584 over 2
    Qwen2.5-7B-sized layers, L=4,096, 50 % prompt, one DPO pair / two KTO rows per rank, both ranks on cuda:0 as in
    (b); patched (the package's default) vs ``patched_onepass`` (``LIGER_DDP_PATCH_LOSS=one_pass=1``) vs Liger-off
    vs each upgrade (TRL 1.14, TRL 1.16 as a user who upgrades runs it) vs the package with a bf16 ``ref_model``
    (``patched+bf16ref``) per trainer: median step time, tokens/s, peak memory allocated per rank, the simulated
    peak beside it (``sim_peaks``: the launch's own measured base plus the step ``sim_gpu_peak.step_peak`` composes
    from results/sim-2026-12-07-gpu-peak, "-" where it has no line) and the ratios patched / arm.  Each arm for
    every trainer before the next arm; no launch starts once ``--budget`` is spent (nor one the time left could not
    finish: the longest launch so far).
(b) DDP with device_ids on the GPU: two one-process "nodes" on loopback (``torchrun --nnodes=2
    --nproc_per_node=1``), both on cuda:0 with ``ddp_backend="gloo"`` (NCCL refuses two ranks on one GPU), the
    repo's test probe (tests/harness/probe.py ``--device cuda``) running one DPO and one KTO step with Liger on
    the tiny Qwen3 with the real vocabulary; TRL 1.12.0 (``--ddp-trl 1.12.0,1.8.0`` adds 1.8.0: before 1.9 the
    unpatched trainer crashes in DDP), unpatched vs patched: parameters whose gradients differ across the ranks.
    Runs last, and only where the budget leaves it ``B_NEEDS`` seconds (else its row says "not run"; ``--parts b``
    runs it alone).

The default call's time, estimated from the H200 run of 2026-12-04 (results/h200-2026-12-04: 359 s for (b) on two
releases, (a) with six arms and six step launches; estimates, not measurements of this version):

    interpreter, torch, CUDA      ~5 s
    wheels (7, pip --no-deps)     ~8 s     (inside that run's part (b): not timed apart)
    (a)                          ~65 s     46.4 s for six arms; + ours_tri and gemm (~5 s: Triton JIT, the timed
                                           calls), + TRL 1.16's process (~20 s: interpreter, imports, inputs, the
                                           fp32 reference, its Triton JIT); 3 timed calls per arm, not 5 (-3 s)
    (c) drawing the model         ~3 s
    (c) 12 launches             ~480-505 s  measured per launch (DPO / KTO): patched 44.1 / 45.1, Liger-off 39.0 /
                                           39.4, TRL 1.14 37.1 / 36.8; not measured: patched_onepass and
                                           patched+bf16ref as patched, TRL 1.16 as TRL 1.14 + 5 s (Triton JIT); the
                                           low end takes ~4 s off each patched launch (the float32 reference's GEMMs
                                           that 2026-12-04's patched steps ran are under autocast now)
    in all                      ~560-585 s of the 580 s budget (from the script's start) and the call's 600 s

so (b) (~45-60 s: 68.7 s for two releases' four launches at once, with the wheels) does not fit after them: it runs
only when (c) ends early, and ``--parts b`` gives it in a second call (~1.5 minutes).  Where (c) runs long, the
budget drops the last launch (KTO's ``patched+bf16ref``), said so in its row.  Each part's seconds are recorded in
``gpu_check.json`` (``info.seconds_*``) and each launch's ``wall_s``, so that the next budget is measured.

Prints one table and writes ``gpu_check.json`` to ``--out`` (after deleting what an earlier run left there), then
checks every row (``check_rows``: the same checks as tests/test_gpu_check.py) and exits 1 when one fails.
Packages the GPU machine lacks (``WHEELS``) are installed from ``.whl/`` with ``pip install --no-index --no-deps
--target``: every TRL release the call runs into its own folder, the rest (only those not importable already) into a
common one.  ``--cpu-smoke`` takes TRL from ``.cache/trl/<version>`` (``.ci/trl_matrix.sh --prepare-only``) when
``.whl/`` is absent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

START = time.monotonic()  # --budget counts from here: the call's 10 minutes include torch's import
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the GPU machine has the checkout, not an installed liger_ddp_patch
sys.path.insert(0, str(HERE))  # _upgrades, _arms, bench_step, _memory: this folder's modules

from _upgrades import UPGRADES, release_of  # noqa: E402

WHEEL_DIR = ROOT / ".whl"
TRL_CACHE = Path(os.environ.get("LIGER_DDP_PATCH_TRL_DIRS", ROOT / ".cache" / "trl"))
# (distribution, version, import name).  What the H200 image lacks (its package list: trl, liger-kernel,
# datasets and two of datasets' needs); the versions are the ones CI runs with.
WHEELS = [
    *(("trl", upgrade.release, "trl") for upgrade in UPGRADES.values()),  # the upgrades: 1.14.0, 1.16.0
    ("trl", "1.12.0", "trl"),
    ("trl", "1.8.0", "trl"),
    ("liger-kernel", "0.8.5", "liger_kernel"),
    ("datasets", "5.2.0", "datasets"),
    ("dill", "0.4.1", "dill"),
    ("multiprocess", "0.70.19", "multiprocess"),
]
DDP_TRL = ("1.12.0", "1.8.0")
# (b)'s default: TRL 1.12.0, the bug and the fix; 1.8.0's crash in DDP is test_matrix's on CPU (and 2026-12-04's GPU)
GPU_DDP_TRL = ("1.12.0",)
B_NEEDS = 60.0  # seconds (b) is started with at the most (2026-12-04: ~60 s for four launches at once, less the wheels)
GPU_BUDGET = 580.0  # seconds from the script's start: the call's 600 s less the report and ~15 s of slack
# (c) the whole DDP step (benchmarks/bench_step.py): Qwen2.5-7B's head (V, H) over 2 of its layers, bf16
# the package's default beside one_pass=1 (issue 39 item 4: the README table's GPU row in one call), Liger-off, the
# upgrades (TRL 1.14, TRL 1.16)
STEP_ARMS = ("patched", "patched_onepass", "off", *UPGRADES)
# --step-arms may add bench_step's extra arms: patched_triton (the loss's Triton sweep), patched_noautocast (the routed
# path before autocast, issue 32), patched_fullkl (KTO's KL logits before issue 32 item 3); any arm + BF16_REF runs
# with a bf16 ref_model instead of TRL's own float32 reference (issue 32 item 4: both in one call)
EXTRA_STEP_ARMS = ("patched_triton", "patched_noautocast", "patched_fullkl")
# what an arm's ranks must have been given (bench_step.arm_env), checked per row: patched_onepass is one pass for
# every pair, the default before issue 39's held budget
LOSS_SETTING = {"patched_onepass": "one_pass=1"}
NOT_RUN = "not run: the time budget was spent"
BF16_REF = "+bf16ref"
# the default call's arms (issue 45 item 5): the table's, then the package with a bf16 reference model (the setup it
# recommends, and TRL 1.16's own reference dtype), last: the launch a long run drops
DEFAULT_STEP_ARMS = (*STEP_ARMS, "patched" + BF16_REF)
# the simulated head and body rows (sim_gpu_peak.py) that sim_peaks composes into a step's peak per arm
SIM_PEAKS = HERE / "results" / "sim-2026-12-07-gpu-peak" / "sim_gpu_peak.json"
STEP_TRAINERS = ("dpo", "kto")
SMOKE_STEP_TRAINERS = ("kto",)  # the CPU smoke: KTO's three launches (tests/test_bench_step.py launches DPO)
STEP_PROMPT = 0.5
GPU_STEP = dict(V=151_936, H=3_584, layers=2, intermediate=18_944, heads=28, kv_heads=4, head_dim=128, L=4_096)
SMOKE_STEP = dict(V=512, H=32, layers=2, intermediate=64, heads=2, kv_heads=1, head_dim=16, L=32)
ARMS_A = ("ours", "ours_long", "ours_2p", "ours_tri", "liger_c", *UPGRADES, "mat", "gemm")
FLOOR_A = "gemm"  # the head's GEMMs alone (_arms.py): a floor, not a loss (no error against the truth)
PROMPTS_A = (0.5, 0.0)
GPU_SIZE = dict(V=151_936, H=3_584, B=16, L=512)
SMOKE_SIZE = dict(V=512, H=64, B=2, L=64)


# ------------------------------------------------------------------------------------------------ wheels


def _wheel_file(wheel_dir: Path, dist: str, version: str) -> Path | None:
    stem = f"{dist.replace('-', '_')}-{version}-"
    return next((p for p in sorted(wheel_dir.glob("*.whl")) if p.name.lower().startswith(stem.lower())), None)


def install(wheel_dir: Path, site: Path, wheels=WHEELS) -> dict:
    """``pip install --no-index --no-deps --target``: ``site/trl-<v>`` per TRL release, ``site/common`` for the rest.

    A package that already imports is left alone (the image's own version wins).  Returns
    ``{"common": path, "trl-<v>": path, "installed": [...]}``.
    """
    paths = {"common": str(site / "common"), "installed": []}
    for dist, version, module in wheels:
        target = site / (f"trl-{version}" if dist == "trl" else "common")
        if dist == "trl":
            paths[f"trl-{version}"] = str(target)
            if (target / "trl" / "__init__.py").exists():
                continue
        elif importlib.util.find_spec(module) is not None or (target / module).exists():
            continue
        wheel = _wheel_file(wheel_dir, dist, version)
        if wheel is None:
            raise SystemExit(f"{dist}=={version}: no wheel in {wheel_dir} (run bash benchmarks/gpu_wheels.sh)")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--disable-pip-version-check",
                "--target",
                str(target),
                str(wheel),
            ],
            check=True,
        )
        paths["installed"].append(wheel.name)
    return paths


def needed_wheels(ddp_trl=DDP_TRL) -> list[tuple[str, str, str]]:
    """``WHEELS`` less the TRL releases the call does not run (1.8.0 unless (b) runs it): a pip process each."""
    trl = {"1.12.0", *ddp_trl, *(upgrade.release for upgrade in UPGRADES.values())}
    return [w for w in WHEELS if w[0] != "trl" or w[1] in trl]


def package_paths(smoke: bool, site: Path, ddp_trl=DDP_TRL) -> dict:
    wheels = needed_wheels(ddp_trl)
    if WHEEL_DIR.is_dir() and any(WHEEL_DIR.glob("*.whl")):
        return install(WHEEL_DIR, site, wheels)
    if not smoke:
        raise SystemExit(f"no wheels in {WHEEL_DIR}: run `bash benchmarks/gpu_wheels.sh` on a machine with network")
    paths = {"common": "", "installed": []}  # CI machine: datasets & liger-kernel installed, TRL unpacked
    for version in {v for d, v, _ in wheels if d == "trl"}:
        folder = TRL_CACHE / version
        if not (folder / "trl" / "__init__.py").exists():
            raise SystemExit(f"{folder} missing: bash .ci/trl_matrix.sh --prepare-only")
        paths[f"trl-{version}"] = str(folder)
    return paths


def _pythonpath(*first: str) -> str:
    return os.pathsep.join(p for p in (*first, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


# ------------------------------------------------------------------------------------ (a) the loss head


def time_ms(fn, cuda: bool) -> float:
    """Milliseconds of one ``fn()``: CUDA events on a GPU (after a synchronize), else the wall clock."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def part_a(device: str, size: dict, reps: int, out_json: Path, arms=ARMS_A) -> list[dict]:
    """Runs ``arms`` inside a process with their TRL release first on sys.path (``part_a_groups``); rewrites
    ``out_json`` after every arm."""
    import torch

    sys.path[:0] = [str(HERE), str(ROOT)]
    import _arms

    from liger_ddp_patch.losses import _plan

    cuda = device == "cuda"

    def timer(fn):
        return time_ms(fn, cuda)

    rows = []
    V, H, B, L = size["V"], size["H"], size["B"], size["L"]
    info = dict(
        fp32_output_gemm=_plan.fp32_output_gemm(device, torch.bfloat16),
        default_chunk=_plan.resolve_token_chunk_size(None, V, device, torch.bfloat16),
    )
    for frac in PROMPTS_A:
        x = _arms.make_inputs(B, L, H, V, frac, torch.bfloat16, device)
        ref = _arms.reference(x)
        if cuda:
            torch.cuda.empty_cache()
        for arm in arms:
            row = dict(arm=arm, prompt=frac, tokens=int((x["t"] != -100).sum()), **info)
            try:
                # ours_long: a token chunk of L / 2, so that every pair is longer than a chunk (pairs in flight)
                step = _arms.make_step("ours", x, L // 2) if arm == "ours_long" else _arms.make_step(arm, x)
                x["h"].grad = x["w"].grad = None
                loss = step()  # warm-up (compiles liger_c); its result is the one checked
                row["err"] = {} if arm == FLOOR_A else _arms.rel_errors(loss, x["h"].grad, x["w"].grad, ref)
                row["grad_fn"] = getattr(step, "grad_fn", None)
                times, peak = [], 0
                for _ in range(reps):
                    x["h"].grad = x["w"].grad = None
                    if cuda:
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                    times.append(timer(step))
                    if cuda:
                        peak = max(peak, torch.cuda.max_memory_allocated() - base)
                row.update(ms=sorted(times)[len(times) // 2], times_ms=times, peak_mib=peak / 2**20 if cuda else None)
            except Exception as exc:  # one arm failing must not lose the others
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            finally:
                x["h"].grad = x["w"].grad = None
                step = loss = None
                if cuda:
                    torch.cuda.empty_cache()
            rows.append(row)
            out_json.write_text(json.dumps(rows))
            print(json.dumps(row), file=sys.stderr, flush=True)
        del x, ref
    return rows


def part_a_groups(arms=ARMS_A) -> dict[str, tuple[str, ...]]:
    """Part (a)'s processes, ``{TRL release: arms}``: two releases of ``trl`` cannot share a process, so each
    upgrade's head runs with its own release first on sys.path, and the arms that need no TRL with the first."""
    first = next(iter(UPGRADES.values())).release
    groups: dict[str, list[str]] = {}
    for arm in arms:
        groups.setdefault(release_of(arm) or first, []).append(arm)
    return {release: tuple(group) for release, group in groups.items()}


def run_part_a(args, paths, out: Path) -> list[dict]:
    """``part_a_groups``' processes: on a GPU one after the other (no process's timings share the GPU with
    another's), in the CPU smoke at once (its timings are not results); the rows in ``ARMS_A``'s order."""

    def one(group):
        release, arms = group
        result = out / f"part_a-{release}.json"
        cmd = [sys.executable, __file__, "--part-a", str(result), "--arms-a", ",".join(arms), "--device", args.device,
               "--reps", str(args.reps), *(["--cpu-smoke"] if args.cpu_smoke else [])]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=_pythonpath(paths[f"trl-{release}"], paths["common"]), PYTHONUNBUFFERED="1")
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_a)
            log, why = proc.stdout + proc.stderr, f"exited {proc.returncode}"
        except subprocess.TimeoutExpired as exc:
            log, why = f"{exc.stdout or ''}{exc.stderr or ''}", f"timed out after {args.timeout_a:.0f} s"
            log = log.decode(errors="replace") if isinstance(log, bytes) else log
        (out / f"part_a-{release}.log").write_text(log)
        rows = json.loads(result.read_text()) if result.exists() else []
        if len(rows) < len(PROMPTS_A) * len(arms):
            rows.append(dict(arm="-", error=f"part (a), TRL {release}, {why}: {log[-1500:]}"))
        return rows

    groups = part_a_groups()
    with ThreadPoolExecutor(max_workers=len(groups) if args.cpu_smoke else 1) as pool:
        rows = [row for found in pool.map(one, groups.items()) for row in found]

    def order(row):  # a failed process's row last
        if row.get("arm") not in ARMS_A:
            return (len(PROMPTS_A), 0)
        return (PROMPTS_A.index(row["prompt"]), ARMS_A.index(row["arm"]))

    return sorted(rows, key=order)


# ------------------------------------------------------------------------------------------------- (b) DDP


def launch_two_nodes(trl_dir: str, common: str, assets: Path, patched: bool, device: str, out: Path, timeout: float):
    """torchrun --nnodes=2 --nproc_per_node=1 twice on loopback, the probe on ``device``; rank 0's JSON."""
    from harness import run_probe_two_nodes

    env = dict(
        os.environ,
        PROBE_PATCH="before" if patched else "none",
        OMP_NUM_THREADS="1",
        PYTHONPATH=_pythonpath(trl_dir, common),
    )
    if not patched:
        env["LIGER_DDP_PATCH_DISABLE"] = "1"
    extra = ("--device", device)
    result, logs = run_probe_two_nodes(assets, out, env, trainers="dpo,kto", extra=extra, timeout=timeout)
    (out / "log.txt").write_text(logs)
    return result if result is not None else {"error": f"no result: {logs[-1500:]}"}


def run_part_b(args, paths, out: Path) -> list[dict]:
    from liger_ddp_patch.demo.tiny import REAL_VOCAB, build

    sys.path.insert(0, str(ROOT / "tests"))  # the test harness (not in the package): the probe and its launcher
    assets = build(out / "tiny", vocab_size=64 if args.cpu_smoke else REAL_VOCAB)
    runs = [(version, patched) for version in args.ddp_trl for patched in (False, True)]

    def one(run):
        version, patched = run
        run_dir = out / f"ddp-{version}-{'patched' if patched else 'unpatched'}"
        run_dir.mkdir(parents=True, exist_ok=True)
        return launch_two_nodes(
            paths[f"trl-{version}"], paths["common"], assets, patched, args.device, run_dir, args.timeout_b
        )

    # 16 cores on the GPU machine: the four launches at once; 2 cores on CI: one after the other
    with ThreadPoolExecutor(max_workers=args.jobs or (1 if args.cpu_smoke else len(runs))) as pool:
        results = list(pool.map(one, runs))
    rows = []
    for (version, patched), res in zip(runs, results):
        for r in res.get("results", [{"trainer": "dpo,kto", "error": res.get("error")}]):
            rows.append(
                dict(
                    trl=res.get("trl", version),
                    liger=res.get("liger_kernel"),
                    run="patched" if patched else "unpatched",
                    **r,
                )
            )
    return rows


# ---------------------------------------------------------------------------------------- (c) the whole step


def step_setup(args, paths: dict):
    """The step model of (c), drawn and saved once: ``(size, L, assets, work folder, TRL folders per arm)``."""
    sys.path.insert(0, str(HERE))
    import bench_step

    size = dict(SMOKE_STEP if args.cpu_smoke else GPU_STEP)
    L = getattr(args, "step_length", None) or size["L"]
    size.pop("L")
    size["max_len"] = max(4096, L)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-step-"))  # not --out: the model is GBs, and --out comes back
    assets = bench_step.build_assets(work / "model", size, dtype="bfloat16", device=args.device)
    if args.device == "cuda":
        import torch

        torch.cuda.empty_cache()  # the parent's drawing buffers must not sit on the GPU the ranks measure
    trl = {"1.12.0": paths["trl-1.12.0"], "common": paths["common"]}
    trl.update({upgrade.release: paths[f"trl-{upgrade.release}"] for upgrade in UPGRADES.values()})
    return size, L, assets, work, trl


def launch_order(arms: tuple[str, ...], trainers: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(arm, trainer)`` launches: the arms in the order given, each for every trainer, so that a spent budget
    drops the last arms for all trainers rather than the last trainer's every arm (the table's arms come first)."""
    return [(arm, trainer) for arm in arms for trainer in trainers]


def run_part_c(args, paths, out: Path, deadline: float) -> list[dict]:
    """bench_step's launches on this device, two one-process nodes (both ranks on cuda:0), one row per trainer x
    arm; no launch starts after ``deadline`` (a row then says so).  Rewrites ``part_c.json`` after every launch."""
    import bench_step

    size, L, assets, work, trl = step_setup(args, paths)
    opts = argparse.Namespace(threads=1 if args.cpu_smoke else 4, nproc=2, nodes=2, device=args.device,
                              steps=args.reps_c, warmup=1, mem_kill_gib=float("inf"),
                              ref_same_dtype=args.ref_same_dtype)  # fmt: skip
    rows: list[dict] = []
    trainers = SMOKE_STEP_TRAINERS if args.cpu_smoke else STEP_TRAINERS
    longest = 30.0  # no launch starts with less left than the longest so far took (it would be cut short)
    for arm, trainer in launch_order(args.step_arms, trainers):  # every trainer's first arms before any extra arm
        row = dict(trainer=trainer, arm=arm, L=L, prompt=STEP_PROMPT, V=size["V"], H=size["H"])
        base, bf16_ref = arm.removesuffix(BF16_REF), arm.endswith(BF16_REF) or args.ref_same_dtype
        opts.ref_same_dtype = bf16_ref
        left = deadline - time.monotonic()
        if left < longest:
            row["error"] = NOT_RUN
        else:
            opts.timeout = min(args.timeout_c, left)
            prefix = out / f"memory-{trainer}-{arm.replace('+', '-')}"
            if args.memory:  # one more step, not timed: rank 0's peak by site (_memory.py)
                os.environ["BENCH_STEP_MEMORY"] = str(prefix)
            try:
                row["loss_setting"] = bench_step.arm_env(base, 1, {}).get("LIGER_DDP_PATCH_LOSS")
                res = bench_step.launch(base, (trainer, "bf16", STEP_PROMPT, L), opts, assets, work, trl)
            finally:
                os.environ.pop("BENCH_STEP_MEMORY", None)
            longest = max(longest, res["wall_s"])
            memory = Path(f"{prefix}.rank0.json")
            if memory.exists():
                row["memory"] = json.loads(memory.read_text())
                memory.unlink()
            res["warmup"] = 1
            row.update(bench_step.summarise(base, [res]), wall_s=round(res["wall_s"], 1), run=res)
            ref_dtype = next((rank.get("ref_dtype") for rank in res.get("ranks", [])), None)
            row["reference"] = "bf16" if bf16_ref else f"TRL's ({ref_dtype or 'not built'})"  # 1.16: the policy's dtype
            row["trl"] = res.get("trl")  # the release the ranks imported
            row["times"] = [rank["times"] for rank in res.get("ranks", [])]  # per rank: warm-up, measured
            if "error" in row:
                row["log_tail"] = res.get("log_tail", "")[-1500:]
        rows.append(row)
        (out / "part_c.json").write_text(json.dumps(rows, default=str))
        print(json.dumps({k: v for k, v in row.items() if k not in ("run", "log_tail")}), file=sys.stderr)
    rows.sort(key=lambda r: (trainers.index(r["trainer"]), args.step_arms.index(r["arm"])))
    for r in rows:  # patched / each arm with the same reference model, the question
        suffix = BF16_REF if r["arm"].endswith(BF16_REF) else ""
        mine = next((m for m in rows if m["trainer"] == r["trainer"] and m["arm"] == "patched" + suffix), None)
        if mine is not None and "error" not in r and "error" not in mine:
            r["patched_time"], r["patched_mem"] = mine["s"] / r["s"], mine["peak_gib"] / r["peak_gib"]
    return sim_peaks(rows)


# the simulated step arm (sim_gpu_peak.CAPACITY_ARMS) of each step arm: the default as the accelerator's plan at 80 GB
# free with the new held rule (an H200's 141 GB takes the same plan), one_pass=1, Liger-off, each upgrade
SIM_ARM = {"patched": "default", "patched_onepass": "one_pass=1", "off": "Liger-off",
           **{arm: upgrade.label for arm, upgrade in UPGRADES.items()}}  # fmt: skip


def sim_peaks(rows_c: list[dict], sim_json: Path = SIM_PEAKS) -> list[dict]:
    """Beside each launch's measured peak, the simulated one (issue 45: the simulation checked by the GPU).

    ``sim_gpu_peak.step_peak`` composes a step from CPU-simulated phases as bytes over the step's base; the base
    here is the launch's own measured ``base_gib`` (2026-12-04's was the simulation's ``STEP_BASE``; TRL 1.16 and a
    bf16 ``ref_model`` hold a bf16 reference, a smaller base).  ``sim_peak_gib`` stays None ("-") where the shapes
    are not the simulated ones, the arm has no simulated counterpart, or ``L`` is outside its simulated lengths
    (DPO and KTO: 4,096 and 8,192; Liger-off 2,048 and 4,096).  Reads JSON only: no torch."""
    import sim_gpu_peak

    sim_rows = None
    for r in rows_c:
        r.setdefault("sim_peak_gib", None)
        name = SIM_ARM.get(str(r.get("arm")).removesuffix(BF16_REF))
        if "error" in r or name is None or (r.get("V"), r.get("H")) != (sim_gpu_peak.V, sim_gpu_peak.H):
            continue
        if sim_rows is None:
            sim_rows = json.loads(sim_json.read_text())["rows"] if sim_json.exists() else []
        lines = sim_gpu_peak.step_peak(sim_rows, r["trainer"]).get(name)
        if not lines or not min(lines["lengths"]) <= r["L"] <= max(lines["lengths"]):
            continue
        over = sim_gpu_peak.at(lines, r["L"]) / sim_gpu_peak.GIB
        r.update(
            sim_over_base_gib=over,
            sim_peak_gib=r["base_gib"] + over,
            peak_vs_sim=r["peak_gib"] / (r["base_gib"] + over),
        )
    return rows_c


# ----------------------------------------------------------------------------------------------- checks

ERR_A = 1e-2  # bf16 against the fp32 truth: correct arms reach a few 1e-3 (dropping the reference model: ~5e-2)
PATCHED_PARAMS = 25  # the tiny Qwen3's parameters with a gradient: every one must be counted and agree
OUTPUTS = (
    "gpu_check.json",
    "part_c.json",
    "tiny",
)  # plus part_a-* (a process's rows and log) and ddp-*: what a run writes into --out


def check_rows(
    rows_a: list[dict],
    rows_b: list[dict],
    reps: int,
    parts=("a", "b"),
    rows_c=(),
    reps_c=2,
    trainers=STEP_TRAINERS,
    step_arms=STEP_ARMS,
    ddp_trl=DDP_TRL,
) -> list[str]:
    """Every way a row can be wrong, as messages (empty: all rows pass).  Used by main() and the CPU smoke test.

    (c): every trainer x arm has a row; the patched step ran (``reps_c`` measured steps, our chunked loss); another
    arm may have failed (running out of memory is an answer) but says why.  The speed and memory targets are
    reported (``targets``), not checked: a check must not fail on a measurement."""
    bad = []
    if "c" in parts:
        seen = {(r.get("trainer"), r.get("arm")) for r in rows_c}
        want = {(t, a) for t in trainers for a in step_arms}
        if seen != want:
            bad.append(f"(c) rows {sorted(map(str, seen))} != {sorted(map(str, want))}")
        for r in rows_c:
            tag = f"(c) {r.get('trainer')} {r.get('arm')}"
            if "error" in r:
                skipped = r["error"] == NOT_RUN and r.get("arm") != "patched"  # the budget's choice, said so
                if (str(r.get("arm")).startswith("patched") and not skipped) or not r["error"]:
                    bad.append(f"{tag} failed: {r['error'][:200]}")
                continue
            steps = r.get("steps") or []
            if not (len(steps) == 1 and r["s"] > 0 and r.get("peak_gib", 0) > 0):
                bad.append(f"{tag}: no step time or peak ({r.get('s')}, {r.get('peak_gib')})")
            if not r.get("times") or any(len(t) != reps_c + 1 for t in r["times"]):
                bad.append(f"{tag}: not {reps_c} measured steps after one warm-up")
            if "sim_peak_gib" not in r:  # None where nothing is simulated, but asked for (sim_peaks)
                bad.append(f"{tag}: no simulated peak beside the measured one")
            if str(r.get("arm")).startswith("patched") and not any(
                str(x).startswith("Chunked") for x in r.get("losses", [])
            ):
                bad.append(f"{tag}: loss {r.get('losses')}, not ours")
            release = release_of(str(r.get("arm")))
            if release and r.get("trl") != release:  # an upgrade arm that imported another TRL measured nothing
                bad.append(f"{tag}: ran TRL {r.get('trl')}, not {release}")
            want = LOSS_SETTING.get(str(r.get("arm")).removesuffix(BF16_REF))
            if want and r.get("loss_setting") != want:
                bad.append(f"{tag}: ran with LIGER_DDP_PATCH_LOSS={r.get('loss_setting')}, not {want}")
    if "a" in parts:
        seen = {(r.get("arm"), r.get("prompt")) for r in rows_a}
        want = {(a, p) for a in ARMS_A for p in PROMPTS_A}
        if seen != want:
            bad.append(f"(a) rows {sorted(map(str, seen))} != {sorted(map(str, want))}")
        for r in rows_a:
            if "error" in r:
                bad.append(f"(a) {r.get('arm')} failed: {r['error'][:200]}")
                continue
            tag = f"(a) {r['arm']} prompt {r['prompt']:.0%}"
            if not (r["ms"] > 0 and len(r["times_ms"]) == reps):
                bad.append(f"{tag}: times {r['times_ms']}")
            if not all(e == e and e < ERR_A for e in r["err"].values()):  # e == e: not NaN
                bad.append(f"{tag}: error against the fp32 truth {r['err']} (bound {ERR_A})")
            one_pass = "OnePassLoss" in str(r.get("grad_fn"))
            if r["arm"].startswith("ours") and one_pass != (r["arm"] != "ours_2p"):
                bad.append(f"{tag}: took {r.get('grad_fn')}")
    if "b" in parts:
        rows = {(r.get("trl"), r.get("trainer"), r.get("run")): r for r in rows_b}
        for trainer in ("dpo", "kto"):
            unpatched = rows.get(("1.12.0", trainer, "unpatched"), {})
            if not unpatched.get("differing", 0) > 0:  # TRL 1.9-1.13: silent desync
                bad.append(f"(b) 1.12.0 {trainer} unpatched shows no desync: {unpatched}")
            crashed = rows.get(("1.8.0", trainer, "unpatched"), {})
            if "1.8.0" in ddp_trl and "base_model" not in str(crashed.get("error")):  # before 1.9: crash in DDP
                bad.append(f"(b) 1.8.0 {trainer} unpatched did not crash on base_model: {crashed}")
            for version in ddp_trl:
                r = rows.get((version, trainer, "patched"), {})
                ok = (r.get("params"), r.get("differing"), r.get("max_abs_diff")) == (PATCHED_PARAMS, 0, 0.0)
                if not ok or not str(r.get("loss_class")).startswith("Chunked"):
                    bad.append(f"(b) {version} {trainer} patched: {r}")
    return bad


def clear_outputs(out: Path) -> None:
    """Delete what an earlier run wrote into ``out`` (only that), so that no stale result can be read back."""
    import shutil

    for path in [out / name for name in OUTPUTS] + sorted(out.glob("part_a*")) + sorted(out.glob("ddp-*")):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


# ----------------------------------------------------------------------------------------------- report


def targets(rows_c: list[dict]) -> list[str]:
    """The issue's targets per trainer: patched no slower than off and each upgrade, trl114 and trl116 (and its
    memory against each)."""
    lines = []
    arms = dict.fromkeys(r.get("arm") for r in rows_c)
    peers = [
        a for a in arms if a and a.removesuffix(BF16_REF) in ("patched_onepass", "patched_triton", "off", *UPGRADES)
    ]
    for trainer in dict.fromkeys(r.get("trainer") for r in rows_c):
        for peer in peers:
            r = next((r for r in rows_c if r.get("trainer") == trainer and r.get("arm") == peer), {})
            if "patched_time" in r:
                verdict = "met" if r["patched_time"] <= 1.0 else "MISSED"
                if peer.startswith("patched_triton"):  # not a target: the sweep's gain (> 1: Triton is faster)
                    verdict = "the Triton sweep faster" if r["patched_time"] > 1.0 else "the Triton sweep not faster"
                if peer.startswith("patched_onepass"):  # not a target: what the default costs or saves
                    verdict = "the default against one_pass=1"
                mine = "patched" + (BF16_REF if peer.endswith(BF16_REF) else "")
                lines.append(f"{trainer} {mine}/{peer}: time {r['patched_time']:.2f} ({verdict}), "
                             f"peak memory {r['patched_mem']:.2f}")  # fmt: skip
            elif any(r.get("arm") == peer for r in rows_c):
                lines.append(f"{trainer} patched/{peer}: no ratio ({(r.get('error') or 'patched failed')[:80]})")
    return lines


def render_c(info: dict, rows_c: list[dict]) -> list[str]:
    import _memory
    import bench_step

    c = info.get("step", {})
    lines = [
        "",
        f"(c) one whole DDP training step, bf16, V={c.get('V', 0):,} H={c.get('H', 0):,} {c.get('layers')} layers, "
        f"L={c.get('L', 0):,}, {c.get('prompt', 0):.0%} prompt, 2 ranks ({info['ddp_device']}, gloo), per rank a DPO "
        f"pair / 2 KTO rows; reference model {c.get('reference', '?')} (arms{BF16_REF}: bf16); peak = "
        f"{'max allocated' if info['device'] == 'cuda' else 'VmHWM'} per rank",
        f"{'trainer':7} {'arm':15} {'s/step':>8} {'tok/s':>9} {'peak GiB':>9} {'sim GiB':>8} {'peak/sim':>8} "
        f"{'patched/arm time':>17} {'patched/arm mem':>16}  loss, held (V,H) GiB (path)",
    ]
    for r in rows_c:
        head = f"{r.get('trainer', '-'):7} {r.get('arm', '-'):15}"
        if "error" in r:
            lines.append(f"{head} {'not run' if r['error'].startswith('not run') else 'failed'}: {r['error'][:90]}")
            continue
        nan, sim = float("nan"), r.get("sim_peak_gib")
        sim_cells = f"{sim:>8.2f} {r['peak_vs_sim']:>8.2f}" if sim else f"{'-':>8} {'-':>8}"
        lines.append(
            f"{head} {r['s']:>8.3f} {r['tok_s']:>9.0f} {r['peak_gib']:>9.2f} {sim_cells}"
            f" {r.get('patched_time', nan):>17.2f} {r.get('patched_mem', nan):>16.2f}"
            f"  {' '.join(r.get('losses', [])) or '-'}"
            f"{', held ' + bench_step.held_cell(r['held']) if r.get('held') else ''}"
        )
        if "memory" in r:
            lines += _memory.render(r["memory"])
    lines.append(
        f"sim GiB: the launch's measured base + the step sim_gpu_peak composes ({SIM_PEAKS.parent.name}); "
        "peak/sim: measured / simulated"
    )
    return [*lines, "targets (reported, not checked):", *(f"  {t}" for t in targets(rows_c))]


def render(info: dict, rows_a: list[dict], rows_b: list[dict], rows_c: list[dict] = ()) -> str:
    s = info["size"]
    lines = [
        f"(a) DPO head loss, bf16, V={s['V']:,} H={s['H']:,} B={s['B']} L={s['L']:,} on {info['device_name']} "
        f"(torch {info['torch']}; ours: default chunk {rows_a[0].get('default_chunk', '?')}, "
        f"fp32-output GEMM {rows_a[0].get('fp32_output_gemm', '?')})",
        f"{'prompt':>6} {'arm':8} {'median ms':>10} {'peak MiB':>9} {'err loss':>9} {'err g_h':>9} {'err g_w':>9}"
        "  path",
    ]
    for r in rows_a:
        if not r:
            continue
        if "error" in r:
            lines.append(f"{r.get('prompt', 0):>6.0%} {r['arm']:8} failed: {r['error'][:90]}")
            continue
        e = r["err"]
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        errs = " ".join(f"{e[k]:>9.1e}" for k in ("loss", "grad_h", "grad_w")) if e else f"{'(a floor)':>29}"
        floor = next((f for f in rows_a if f.get("arm") == FLOOR_A and f.get("prompt") == r["prompt"]), {})
        vs = f"  {r['ms'] / floor['ms']:.2f}x the GEMM floor" if floor.get("ms") and r["arm"] != FLOOR_A else ""
        lines.append(f"{r['prompt']:>6.0%} {r['arm']:8} {r['ms']:>10.1f} {peak:>9} {errs}  {r.get('grad_fn')}{vs}")
    lines += [
        "",
        f"(b) DDP, two one-process nodes on loopback, {info['ddp_device']}, gloo, tiny Qwen3 "
        f"(vocab {info['ddp_vocab']:,}), one DPO and one KTO step with Liger",
        f"{'TRL':8} {'trainer':7} {'run':10} {'params':>6} {'differing':>9} {'max|dgrad|':>11}  loss module",
        *([info["b_not_run"]] if info.get("b_not_run") else []),
    ]
    for r in rows_b:
        head = f"{r['trl']:8} {r['trainer']:7} {r['run']:10}"
        if r.get("error"):
            lines.append(f"{head} crashed: {r['error'].splitlines()[0][:80]}")
        else:
            lines.append(
                f"{head} {r.get('params', '-'):>6} {r.get('differing', '-'):>9} "
                f"{r.get('max_abs_diff', float('nan')):>11.3e}  {r.get('loss_class')}"
            )
    if rows_c:
        lines += render_c(info, rows_c)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: the same code paths, for the tests")
    ap.add_argument("--out", default=None, help="folder for gpu_check.json and logs (default: a temporary folder)")
    ap.add_argument("--parts", default="a,b,c", help="(a), then (c), then (b) where the budget leaves it time")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds from the start; no launch after (GPU {GPU_BUDGET:.0f}, CPU 3600)")  # fmt: skip
    ap.add_argument("--timeout-c", type=float, default=None, help="seconds per step launch (GPU 150, CPU 600)")
    ap.add_argument("--reps-c", type=int, default=2, help="(c): measured steps per launch, after one warm-up")
    ap.add_argument("--step-arms", default=",".join(DEFAULT_STEP_ARMS),
                    help="(c): arms in launch order, patched first (+bf16ref: with a bf16 ref_model)")  # fmt: skip
    ap.add_argument("--step-length", type=int, default=None, help="(c): sequence length (GPU 4096, CPU smoke 32)")
    ap.add_argument(
        "--memory",
        action="store_true",
        help="(c): one more step per launch, not timed: what is live at rank 0's peak, by site (CUDA)",
    )
    ap.add_argument("--ref-same-dtype", action="store_true",
                    help="(c): pass a bf16 reference model (default: TRL builds it, in float32)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=None, help="timed steps per arm (default 3 on GPU, 2 on CPU)")
    ap.add_argument("--timeout-a", type=float, default=None, help="seconds per part (a) process (GPU 150, CPU 900)")
    ap.add_argument("--timeout-b", type=float, default=None, help="seconds per DDP launch (GPU 240, CPU 900)")
    ap.add_argument("--ddp-trl", default=",".join(GPU_DDP_TRL),
                    help="(b): the TRL releases, 1.12.0 first (default 1.12.0 alone: tests/test_matrix.py runs 1.8.0's "
                    "crash; 1.12.0,1.8.0 both)")  # fmt: skip
    ap.add_argument("--jobs", type=int, default=None, help="DDP launches at once (default: all on GPU, 1 on CPU)")
    ap.add_argument("--print-wheels", action="store_true", help="the wheels gpu_wheels.sh downloads, one per line")
    ap.add_argument("--part-a", metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--arms-a", default=",".join(ARMS_A), help=argparse.SUPPRESS)  # one --part-a process's arms
    ap.add_argument("--device", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.step_arms = tuple(args.step_arms.split(","))
    args.ddp_trl = tuple(args.ddp_trl.split(","))
    if args.ddp_trl[0] != "1.12.0" or not set(args.ddp_trl) <= set(DDP_TRL):
        ap.error(f"--ddp-trl: 1.12.0 first, then any of {', '.join(DDP_TRL[1:])}")
    known = {a + ref for a in (*STEP_ARMS, *EXTRA_STEP_ARMS) for ref in ("", BF16_REF)}
    if args.step_arms[0] != "patched" or not set(args.step_arms) <= known:
        ap.error(f"--step-arms: patched first, then any of {', '.join((*STEP_ARMS[1:], *EXTRA_STEP_ARMS))}, each "
                 f"also with {BF16_REF} (a bf16 ref_model)")  # fmt: skip
    if args.print_wheels:
        print("\n".join(f"{d}=={v}" for d, v, _ in WHEELS))
        return 0
    args.device = args.device or ("cpu" if args.cpu_smoke else "cuda")
    args.reps = args.reps or (2 if args.cpu_smoke else 3)  # GPU: 3 calls' spread was < 4 % on 2026-12-04
    args.timeout_a = args.timeout_a or (900 if args.cpu_smoke else 150)  # GPU: ~45 s and ~20 s expected
    args.timeout_b = args.timeout_b or (900 if args.cpu_smoke else 240)
    args.timeout_c = args.timeout_c or (600 if args.cpu_smoke else 150)
    args.budget = args.budget or (3600 if args.cpu_smoke else GPU_BUDGET)
    size = SMOKE_SIZE if args.cpu_smoke else GPU_SIZE
    if args.part_a:
        part_a(args.device, size, args.reps, Path(args.part_a), tuple(args.arms_a.split(",")))
        return 0

    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --cpu-smoke")
    started = START  # the budget includes torch's import: the call's limit does
    deadline = started + args.budget
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    clear_outputs(out)
    parts = args.parts.split(",")
    ddp_trl = args.ddp_trl if "b" in parts else ()
    paths = package_paths(args.cpu_smoke, Path(tempfile.mkdtemp(prefix="gpu-check-site-")), ddp_trl)
    info = dict(device=args.device, device_name=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                torch=torch.__version__, size=size, smoke=args.cpu_smoke, installed=paths["installed"],
                ddp_device="cuda:0 (both ranks)" if args.device == "cuda" else "cpu", ddp_vocab=64 if args.cpu_smoke
                else 151_936, ddp_trl=args.ddp_trl, budget=args.budget)  # fmt: skip
    clock = [time.monotonic()]

    def lap(name):  # each part's seconds, for the next call's budget
        info[f"seconds_{name}"] = round(time.monotonic() - clock[0], 1)
        clock[0] = time.monotonic()

    info["seconds_start"] = round(clock[0] - started, 1)  # the interpreter, torch, the wheels
    rows_a = run_part_a(args, paths, out) if "a" in parts else [{}]
    lap("a")
    step = dict(SMOKE_STEP if args.cpu_smoke else GPU_STEP, prompt=STEP_PROMPT)
    step["L"] = args.step_length or step["L"]
    step["reference"] = (
        "bf16, passed as ref_model" if args.ref_same_dtype else "TRL's own (fp32; from 1.16 bf16, the policy's)"
    )
    info["step"] = step
    rows_c = run_part_c(args, paths, out, deadline) if "c" in parts else []
    lap("c")
    rows_b = []
    if "b" in parts:  # last: a correctness check, not a cell of the tables; started where the budget leaves it time
        left = deadline - time.monotonic()
        if left >= min(B_NEEDS, args.timeout_b):
            args.timeout_b = min(args.timeout_b, left)
            rows_b = run_part_b(args, paths, out)
        else:
            info["b_not_run"] = f"{NOT_RUN} ({left:.0f} s left, {B_NEEDS:.0f} needed; --parts b runs it alone)"
            parts = [p for p in parts if p != "b"]
    lap("b")
    info["seconds"] = round(time.monotonic() - started, 1)
    report = render(info, rows_a, rows_b, rows_c)
    slim_c = [{k: v for k, v in r.items() if k != "run"} for r in rows_c]
    (out / "gpu_check.json").write_text(json.dumps(dict(info=info, a=rows_a, b=rows_b, c=slim_c), indent=1))
    print(report)
    print(f"\n{info['seconds']:.0f} s in all from the script's start (start and wheels {info['seconds_start']:.0f} s, "
          f"part a {info['seconds_a']:.0f} s, c {info['seconds_c']:.0f} s, b {info['seconds_b']:.0f} s); JSON and logs "
          f"in {out}")  # fmt: skip
    trainers = SMOKE_STEP_TRAINERS if args.cpu_smoke else STEP_TRAINERS
    bad = check_rows(rows_a, rows_b, args.reps, parts, rows_c, args.reps_c, trainers, args.step_arms, args.ddp_trl)
    print("\n".join(["", f"FAILED ({len(bad)}):", *bad]) if bad else "\nall rows pass")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

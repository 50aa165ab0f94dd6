#!/usr/bin/env python
"""Where the GPU time goes behind gpu_check.py's numbers (issue #22): one prepared run, <= 4 minutes.

    python3 benchmarks/gpu_profile.py --out $OUT     # on the GPU machine (carry .whl, as for gpu_check.py)
    python3 benchmarks/gpu_profile.py --cpu-smoke    # anywhere: the same code paths at tiny sizes on CPU (a test)

(a) The head loss, bf16, gpu_check.py's size (V=151,936, H=3,584, B=16, L=512), DPO and KTO, 0 % and 50 % prompt:
    ``ours``, ``ours_tri`` (``sweep="triton"``: issue #22's "after"), ``gemm`` (the GEMMs no exact loss avoids: the
    floor) and ``mat`` (materialised logits), interleaved; median ms (CUDA events) and each of ours / floor; then one
    profiled step of ``ours``, ``ours_tri`` and ``gemm`` per row: GPU kernel time in GEMMs and in everything else,
    and the top kernels.
(c) gpu_check.py's whole DDP step (bench_step.py: Qwen2.5-7B's head over 2 of its layers, L=4,096, 50 % prompt, two
    one-process nodes on cuda:0, gloo), DPO and KTO, patched and Liger-off: one extra step of each launch profiled on
    both ranks (``BENCH_STEP_PROFILE``): wall time, GPU kernel time, the top ops by self CPU and by GPU time.

Writes ``gpu_profile.json`` to ``--out`` and prints a summary.  (c) starts no launch once ``--budget`` is spent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import gpu_check  # noqa: E402  (the wheels, the sizes and the step launches are gpu_check.py's)

ARMS = ("ours", "ours_tri", "gemm", "mat")
PROFILED = ("ours", "ours_tri", "gemm")
KINDS = ("dpo", "kto")
GEMM_NAMES = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "addmm", "mm")  # kernel (or CPU op) names of a GEMM


def _is_gemm(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in GEMM_NAMES[:-2]) or low in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")


def kernel_split(prof, top: int = 12) -> dict:
    """GPU kernel time (CPU op time when there is no GPU) in GEMMs and in the rest, and the top entries."""
    from bench_step import device_us, gpu_kernels

    events = prof.key_averages()
    kernels = gpu_kernels(events)

    def cost(e):
        return device_us(e) if kernels else e.self_cpu_time_total

    rows = kernels or list(events)
    gemm = sum(cost(e) for e in rows if _is_gemm(e.key)) / 1e3
    total = sum(cost(e) for e in rows) / 1e3
    ranked = sorted(rows, key=cost, reverse=True)[:top]
    return dict(gpu=bool(kernels), total_ms=total, gemm_ms=gemm, other_ms=total - gemm,
                top=[dict(name=e.key[:110], n=e.count, ms=cost(e) / 1e3) for e in ranked])  # fmt: skip


def part_a(device: str, size: dict, reps: int) -> list[dict]:
    import _arms
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"

    rows = []
    V, H, B, L = size["V"], size["H"], size["B"], size["L"]
    for kind in KINDS:
        for frac in gpu_check.PROMPTS_A:
            x = _arms.make_inputs(B, L, H, V, frac, torch.bfloat16, device)
            steps = {arm: _arms.make_step(arm, x, kind=kind) for arm in ARMS}
            times = {arm: [] for arm in ARMS}
            first = {arm: gpu_check.time_ms(steps[arm], cuda) for arm in ARMS}  # warm-up: ours_tri compiles
            for _ in range(reps):  # interleaved
                for arm in ARMS:
                    x["h"].grad = x["w"].grad = None
                    times[arm].append(gpu_check.time_ms(steps[arm], cuda))
            row = dict(kind=kind, prompt=frac, ms={a: sorted(t)[len(t) // 2] for a, t in times.items()}, first_ms=first)
            row["ours_over_floor"] = row["ms"]["ours"] / row["ms"]["gemm"]
            row["ours_tri_over_floor"] = row["ms"]["ours_tri"] / row["ms"]["gemm"]
            for arm in PROFILED:
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=acts) as prof:
                    x["h"].grad = x["w"].grad = None
                    steps[arm]()
                    if cuda:
                        torch.cuda.synchronize()
                row[f"profile_{arm}"] = kernel_split(prof)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), file=sys.stderr)
            x["h"].grad = x["w"].grad = None
            del x, steps
            if cuda:
                torch.cuda.empty_cache()
    return rows


def part_c(args, paths: dict, out: Path, deadline: float) -> list[dict]:
    import bench_step

    _, L, assets, work, trl = gpu_check.step_setup(args, paths)
    opts = argparse.Namespace(threads=1 if args.cpu_smoke else 4, nproc=2, nodes=2, device=args.device, steps=1,
                              warmup=1, mem_kill_gib=float("inf"), timeout=args.timeout_c,
                              ref_same_dtype=args.ref_same_dtype)  # fmt: skip
    rows = []
    for trainer in args.trainers.split(","):
        for arm in args.arms.split(","):
            row = dict(trainer=trainer, arm=arm, L=L)
            if deadline - time.monotonic() < 30:
                rows.append(dict(row, error="not run: the time budget was spent"))
                continue
            prefix = out / f"step-{trainer}-{arm}"
            os.environ["BENCH_STEP_PROFILE"] = str(prefix)
            try:
                res = bench_step.launch(arm, (trainer, "bf16", gpu_check.STEP_PROMPT, L), opts, assets, work, trl)
            finally:
                os.environ.pop("BENCH_STEP_PROFILE", None)
            row["times"] = [r["times"] for r in res.get("ranks", [])]
            row["error"] = res.get("error")
            row["profile"] = {}
            for rank in (0, 1):
                path = Path(f"{prefix}.rank{rank}.json")
                if path.exists():
                    row["profile"][rank] = json.loads(path.read_text())
                    path.unlink()
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), file=sys.stderr, flush=True)
    return rows


def render(rows_a: list[dict], rows_c: list[dict]) -> str:
    lines = ["(a) head loss, bf16: median ms; one profiled step: GEMM / other kernel ms, then ours' top kernels"]
    for r in rows_a:
        ms = "  ".join(f"{a} {v:.1f}" for a, v in r["ms"].items())
        split = "; ".join(f"{a} gemm {r[f'profile_{a}']['gemm_ms']:.1f} other {r[f'profile_{a}']['other_ms']:.1f}"
                          for a in PROFILED)  # fmt: skip
        lines.append(f"  {r['kind']} {r['prompt']:.0%}: {ms}  ours/floor {r['ours_over_floor']:.2f}  ours_tri/floor "
                     f"{r['ours_tri_over_floor']:.2f}  first call {r['first_ms']['ours_tri']:.0f} ms  | profiled: "
                     f"{split}")  # fmt: skip
        for arm in ("ours", "ours_tri"):
            lines += [
                f"      {arm:8} {t['ms']:8.2f} ms x{t['n']:<4} {t['name']}" for t in r[f"profile_{arm}"]["top"][:8]
            ]
    lines.append("(c) whole DDP step, profiled extra step per rank: wall, GPU kernel ms; top ops by GPU and CPU time")
    for r in rows_c:
        lines.append(f"  {r['trainer']} {r['arm']}: times {r.get('times')} {r.get('error') or ''}")
        for rank, p in sorted(r.get("profile", {}).items()):
            lines.append(f"    rank {rank}: wall {p['wall_s']:.2f} s, GPU kernels {p['dev_ms']:.0f} ms, "
                         f"CPU ops {p['cpu_ms']:.0f} ms")  # fmt: skip
            lines += [f"      gpu {t['dev_ms']:8.1f} ms x{t['n']:<4} {t['op']}" for t in p["by_dev"][:8]]
            lines += [f"      cpu {t['cpu_ms']:8.1f} ms x{t['n']:<4} {t['op']}" for t in p["by_cpu"][:8]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU: the same code paths, for the tests")
    ap.add_argument("--out", default=None, help="folder for gpu_profile.json (default: a temporary folder)")
    ap.add_argument("--parts", default="a,c")
    ap.add_argument("--reps", type=int, default=5, help="(a): timed steps per arm")
    ap.add_argument("--trainers", default="kto,dpo", help="(c): trainers, in launch order")
    ap.add_argument("--arms", default="patched,off", help="(c): arms, in launch order")
    ap.add_argument("--budget", type=float, default=200, help="seconds in all; (c) starts no launch after")
    ap.add_argument("--timeout-c", type=float, default=120, help="seconds per step launch")
    ap.add_argument("--ref-same-dtype", action="store_true", help="(c): a bf16 reference model (default: TRL's fp32)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.cpu_smoke else "cuda"
    started = time.monotonic()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    paths = gpu_check.package_paths(args.cpu_smoke, Path(tempfile.mkdtemp(prefix="gpu-profile-site-")))
    os.environ["PYTHONPATH"] = gpu_check._pythonpath()  # the step launches find the package (not the TRL: per arm)
    parts = args.parts.split(",")
    size = gpu_check.SMOKE_SIZE if args.cpu_smoke else gpu_check.GPU_SIZE
    rows_a = part_a(args.device, size, args.reps) if "a" in parts else []
    rows_c = part_c(args, paths, out, started + args.budget) if "c" in parts else []
    (out / "gpu_profile.json").write_text(json.dumps(dict(size=size, a=rows_a, c=rows_c), indent=1, default=str))
    print(render(rows_a, rows_c))
    print(f"\n{time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())

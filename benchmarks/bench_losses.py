#!/usr/bin/env python
"""Benchmark (CPU): our chunked DPO and KTO losses against their peers, forward + backward, fp32 and bf16, arms
interleaved.

    python benchmarks/bench_losses.py                   # full table: DPO + KTO x 2 dtypes x 2 sizes x {50 %, 0 %}
                                                        # prompt, 3 rounds
    python benchmarks/bench_losses.py --quick           # DPO + KTO, bf16 + fp32, (4, 512), 50 % prompt, 1 round
    python benchmarks/bench_losses.py --json out.json   # also keep every measurement

Setup: H=896, V=32000 (Qwen2-0.5B-like head, no bias), reference model on, sigmoid DPO loss / KTO loss; ``B``
counts sequences (DPO: chosen and rejected stacked, as TRL hands them to the loss; KTO: unpaired rows).  The first
``prompt`` fraction of every row is ignore_index.  The arms are described in ``_arms.py``: ours (the one-pass
path), ours_2p (the same with the one-pass path off: the two-pass path, "before"),
Liger fused (compiled=False and compiled=True:
inductor works on this CPU), the upgrades' head paths (``_upgrades.UPGRADES``, one arm per release, DPO and KTO:
``trl114``, TRL 1.14's chunked log-prob path, ``_ChunkedLogProbFunction`` in trl/trainer/utils.py; ``trl116``, TRL
1.16's fused LM head, ``add_fused_lm_head``, which on CPU runs its torch tiles over every position; each from the
unpacked wheel in ``$LIGER_DDP_PATCH_TRL_DIRS/<release>``, default .cache/trl/<release>), materialised
logits and the GEMM-only floor.  ``--prev DIR`` adds the arm ``prev``: ours from an
earlier checkout of the package (``git worktree add DIR <commit>``), so that a change's before and after come from
one interleaved run (``ours/prev``, and both against the floor in the last table).

Fairness: every measurement is a fresh process (``--worker``) doing one warm-up step (which also compiles) and then
``--reps`` timed steps (median); memory is the peak RSS over the timed steps (sampled every 2 ms) minus the RSS once
the inputs exist, before the warm-up (glibc keeps freed heap resident, so a base taken after the warm-up would hide
most of a step's memory; for ``liger_c`` the figure includes what compiling left resident). A round runs every arm
once per configuration, A, B, C, A, B, C, ...; the table gives each arm's median over rounds and, for the ratios,
the median of the per-round ratios (both arms of a ratio ran back to back in the same round, so machine drift
cancels).  Memory is the peak of a full step (forward + backward); ``ours/ours_2p mem`` shows what keeping the
gradients from the forward to the backward costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from _upgrades import UPGRADES

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
H, V = 896, 32000
SIZES = [(4, 512), (2, 2048)]
DTYPES = ["float32", "bfloat16"]
FRACS = [0.5, 0.0]
KINDS = ["dpo", "kto"]
ARMS = ["ours", "ours_2p", "liger", "liger_c", *UPGRADES, "mat", "gemm"]
PEERS = ["prev", "ours_2p", "liger", "liger_c", *UPGRADES, "mat", "gemm"]
MEM_PEERS = ["prev", "ours_2p", "liger", "liger_c", *UPGRADES, "mat"]
TRL_DIRS = os.environ.get("LIGER_DDP_PATCH_TRL_DIRS", os.path.join(ROOT, ".cache", "trl"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    def __init__(self, interval=0.002):
        self.interval, self.peak = interval, _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def worker(arm, dtype, B, L, frac, reps, token_chunk_size, threads, kind, prev=None):
    import gc

    import torch

    sys.path[:0] = [HERE, ROOT]
    if arm == "prev":  # the earlier checkout's package shadows this one
        sys.path.insert(0, os.path.abspath(prev))
    import _arms

    import liger_ddp_patch

    if threads:
        torch.set_num_threads(threads)
    x = _arms.make_inputs(B, L, H, V, frac, getattr(torch, dtype))
    step = _arms.make_step("ours" if arm == "prev" else arm, x, token_chunk_size, kind=kind)
    gc.collect()
    base = _rss_bytes()
    step()  # warm-up (and compile, for liger_c)
    times = []
    with PeakSampler() as sampler:
        for _ in range(reps):
            x["h"].grad = x["w"].grad = None
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    print(
        json.dumps(
            dict(
                arm=arm,
                kind=kind,
                dtype=dtype,
                B=B,
                L=L,
                frac=frac,
                time=statistics.median(times),
                times=times,
                mem_mb=(sampler.peak - base) / 2**20,
                tokens=int((x["t"] != -100).sum()),
                grad_fn=getattr(step, "grad_fn", None),
                threads=torch.get_num_threads(),
                package=os.path.dirname(liger_ddp_patch.__file__),
            )
        )
    )


def run_worker(arm, cfg, args):
    kind, dtype, B, L, frac = cfg
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        arm,
        dtype,
        str(B),
        str(L),
        str(frac),
        "--reps",
        str(args.reps),
        "--kind",
        kind,
    ]
    if args.token_chunk_size:
        cmd += ["--token-chunk-size", str(args.token_chunk_size)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if arm == "prev":
        cmd += ["--prev", args.prev]
    env = dict(os.environ)
    if arm in UPGRADES:  # that release's TRL first: the arm imports its head from it
        trl = os.path.join(TRL_DIRS, UPGRADES[arm].release)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (trl, env.get("PYTHONPATH")) if p)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(f"  [{arm} {cfg}] failed:\n{r.stderr[-1500:]}", file=sys.stderr)
        return None
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(
        f"  {kind} {arm:8s} {dtype:8s} B={B} L={L:5d} prompt={frac:.0%}: {res['time']:.2f} s  {res['mem_mb']:.0f} MB",
        file=sys.stderr,
        flush=True,
    )
    return res


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _stats(runs):
    """``(med, ratio)`` over one configuration's rounds: an arm's median, and the median of per-round ours/peer."""

    def med(arm, key):
        return _med([run[arm][key] if run.get(arm) else None for run in runs])

    def ratio(peer, key):
        both = [run for run in runs if run.get("ours") and run.get(peer) and run[peer][key]]
        return _med([run["ours"][key] / run[peer][key] for run in both])

    return med, ratio


def table(configs, rounds):
    """Markdown rows: per configuration, each arm's median time/memory and ours/peer median per-round ratios."""
    fmt = _fmt
    hdr = ["loss", "dtype", "prompt", "B x L", "tokens w/ loss", "ours s", "ours MB"]
    for p in PEERS:
        hdr += [f"{p} s", f"{p} MB"] if p != "gemm" else ["gemm s"]
    hdr += [f"ours/{p} time" for p in PEERS] + [f"ours/{p} mem" for p in MEM_PEERS]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for cfg in configs:
        kind, dtype, B, L, frac = cfg
        runs = [r.get(cfg, {}) for r in rounds]
        med, ratio = _stats(runs)
        tokens = next((run[a]["tokens"] for run in runs for a in run if run.get(a)), None)
        row = [
            kind.upper(),
            {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype),
            f"{frac:.0%}",
            f"{B} x {L}",
            fmt(tokens, "d"),
            fmt(med("ours", "time"), ".2f"),
            fmt(med("ours", "mem_mb"), ".0f"),
        ]
        for p in PEERS:
            row += [fmt(med(p, "time"), ".2f")] + ([fmt(med(p, "mem_mb"), ".0f")] if p != "gemm" else [])
        row += [fmt(ratio(p, "time"), ".2f") for p in PEERS]
        row += [fmt(ratio(p, "mem_mb"), ".2f") for p in MEM_PEERS]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def readme_table(configs, rounds):
    """The README's compact table: per row ours' memory against Liger's and the time ratios (medians of per-round
    ratios), ``ours/ours_2p`` being the one-pass gain ("after / before")."""
    cols = [("ours_2p", "ours/before"), ("liger", "ours/Liger"), ("liger_c", "ours/Liger compiled")]
    cols += [(arm, f"ours/{upgrade.label}") for arm, upgrade in UPGRADES.items()]  # ours/TRL 1.14, ours/TRL 1.16
    cols += [("mat", "ours/mat"), ("gemm", "ours/GEMM floor")]
    hdr = ["loss", "dtype", "prompt", "B x L", "path", "ours MB", "Liger MB", "ours/Liger mem", "ours/before mem"]
    hdr += [f"{name} time" for _, name in cols]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for cfg in configs:
        kind, dtype, B, L, frac = cfg
        runs = [r.get(cfg, {}) for r in rounds]
        med, ratio = _stats(runs)
        fmt = _fmt
        path = next((run["ours"].get("grad_fn") for run in runs if run.get("ours")), None)
        row = [kind.upper(), {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype), f"{frac:.0%}", f"{B} x {L}"]
        row += ["one" if path and "OnePassLoss" in path else "two", fmt(med("ours", "mem_mb"), ".0f")]
        row += [fmt(med("liger", "mem_mb"), ".0f"), fmt(ratio("liger", "mem_mb"), ".2f")]
        row += [fmt(ratio("ours_2p", "mem_mb"), ".2f")] + [fmt(ratio(p, "time"), ".2f") for p, _ in cols]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def floor_table(configs, rounds):
    """Time over the GEMM floor (medians of per-round ratios), ours and, where it ran, ``prev``: a change's before
    and after from one run."""
    lines = ["| loss | dtype | prompt | B x L | ours/GEMM floor | prev/GEMM floor | ours/prev |", "|" + "---|" * 7]
    for cfg in configs:
        kind, dtype, B, L, frac = cfg
        runs = [r.get(cfg, {}) for r in rounds]

        def over(a, b, runs=runs):
            return _med([run[a]["time"] / run[b]["time"] for run in runs if run.get(a) and run.get(b)])

        row = [kind.upper(), {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype), f"{frac:.0%}", f"{B} x {L}"]
        row += [_fmt(over(a, b), ".2f") for a, b in (("ours", "gemm"), ("prev", "gemm"), ("ours", "prev"))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=5, metavar=("ARM", "DTYPE", "B", "L", "FRAC"))
    ap.add_argument("--quick", action="store_true", help="(4, 512), 50%% prompt, fp32 + bf16, DPO + KTO, 1 round")
    ap.add_argument("--kinds", default=",".join(KINDS), help="dpo,kto")
    ap.add_argument("--kind", default="dpo", help=argparse.SUPPRESS)  # a worker's loss
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=1, help="timed steps per process (after one warm-up)")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--prompt-fracs", default=",".join(map(str, FRACS)))
    ap.add_argument("--sizes", default=",".join(f"{b}x{n}" for b, n in SIZES), help="e.g. 4x512,2x2048")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--token-chunk-size", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--prev", metavar="DIR", help="an earlier checkout of the package: adds the arm 'prev'")
    args = ap.parse_args()
    if args.worker:
        arm, dtype, B, L, frac = args.worker
        worker(
            arm,
            dtype,
            int(B),
            int(L),
            float(frac),
            args.reps,
            args.token_chunk_size,
            args.threads,
            args.kind,
            args.prev,
        )
        return
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    fracs = [float(f) for f in args.prompt_fracs.split(",")]
    if args.quick:
        sizes, fracs, args.rounds = [(4, 512)], [0.5], 1
    configs = [
        (k, d, B, L, f) for k in args.kinds.split(",") for d in args.dtypes.split(",") for f in fracs for B, L in sizes
    ]
    arms = args.arms.split(",")
    if args.prev and "prev" not in arms:
        arms.insert(1, "prev")
    elif "prev" in arms and not args.prev:
        ap.error("the arm 'prev' needs --prev DIR (an earlier checkout of the package)")
    import _machine
    import torch

    started = time.time()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M')}  {_machine.describe()}  {os.cpu_count()} CPUs  "
        f"torch {torch.__version__}  threads {args.threads or torch.get_num_threads()}  H={H} V={V}  "
        f"rounds={args.rounds} reps={args.reps}",
        file=sys.stderr,
    )
    rounds = []
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
        rounds.append({cfg: {arm: run_worker(arm, cfg, args) for arm in arms} for cfg in configs})
        if args.json:  # after every round, so that an interrupted run keeps what it measured
            with open(args.json, "w") as fh:
                json.dump([{"|".join(map(str, cfg)): v for cfg, v in rnd.items()} for rnd in rounds], fh, indent=1)
    print(table(configs, rounds))
    print()
    print(readme_table(configs, rounds))
    if "gemm" in arms:
        print()
        print(floor_table(configs, rounds))
    print(f"(total wall time {time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()

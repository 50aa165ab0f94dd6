#!/usr/bin/env python
"""Benchmark: ChunkedDPOLoss vs Liger's fused DPO loss vs materialised logits (forward + backward, CPU).

    python benchmarks/bench_losses.py            # full table (~10-15 min on 2 cores)
    python benchmarks/bench_losses.py --quick    # one small size, one rep (~1 min)

Setup: H=896, V=32000 (Qwen2-0.5B-like head, no bias), fp32, reference model on, sigmoid DPO loss.
``B`` is the number of *sequences* handed to the loss (chosen and rejected stacked, as TRL does), i.e.
B/2 pairs.  A fraction ``--prompt-frac`` of each row's leading positions is set to ignore_index (prompt);
the 0 %-prompt rows are printed too, because our loss skips ignored positions and the fused one does not.

Each (implementation, size, prompt fraction) runs in its own subprocess: one warm-up, then the median wall
time of ``--reps`` (default 3) forward+backward steps.  Memory = peak RSS (sampled every 2 ms by a thread)
minus the RSS after the inputs were created.

Implementations:
  ours   liger_ddp_patch.losses.ChunkedDPOLoss (default token chunk)
  liger  liger_kernel.chunked_loss.LigerFusedLinearDPOLoss(compiled=False)
  mat    materialised logits: h @ W.T, log_softmax, gather, same DPO loss, plain autograd
  gemm   only the GEMMs no exact loss can avoid, over the non-ignored tokens: policy logits GEMM,
         grad_input GEMM, grad_weight GEMM, reference logits GEMM (token-chunked like ours)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time

H, V = 896, 32000
SIZES = [(4, 512), (2, 2048), (2, 4096)]
IMPLS = ["ours", "liger", "mat", "gemm"]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakSampler:
    def __init__(self, interval=0.002):
        self.interval = interval
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss_bytes())


def _inputs(B, L, prompt_frac, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, L, H, generator=g)).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.02).requires_grad_(True)
    rh = torch.randn(B, L, H, generator=g)
    rw = torch.randn(V, H, generator=g) * 0.02
    t = torch.randint(0, V, (B, L), generator=g)
    t[:, : int(prompt_frac * L)] = -100
    return h, w, rh, rw, t


def _step_fn(impl, h, w, rh, rw, t, token_chunk_size):
    import torch
    import torch.nn.functional as F

    if impl == "ours":
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from liger_ddp_patch.losses import ChunkedDPOLoss

        loss_fn = ChunkedDPOLoss(token_chunk_size=token_chunk_size)

        def step():
            loss, _ = loss_fn(w, h, t, None, rh, rw, None)
            loss.backward()

    elif impl == "liger":
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        loss_fn = LigerFusedLinearDPOLoss(compiled=False)

        def step():
            loss, _ = loss_fn(w, h, t, None, rh, rw, None)
            loss.backward()

    elif impl == "mat":

        def seq_logps(hid, wt):
            logits = hid @ wt.t()
            lp = F.log_softmax(logits.float(), dim=-1)
            mask = t != -100
            tok = lp.gather(-1, t.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            return (tok * mask).sum(-1)

        def step():
            pol = seq_logps(h, w)
            with torch.no_grad():
                ref = seq_logps(rh, rw)
            n = t.shape[0] // 2
            d = 0.1 * ((pol[:n] - ref[:n]) - (pol[n:] - ref[n:]))
            loss = -F.logsigmoid(d).sum() / n
            loss.backward()

    elif impl == "gemm":
        from liger_ddp_patch.losses._core import resolve_token_chunk_size

        chunk = resolve_token_chunk_size(token_chunk_size, V)
        pos = (t != -100).reshape(-1).nonzero().squeeze(1)
        h2, rh2 = h.detach().reshape(-1, H), rh.reshape(-1, H)
        wd = w.detach()

        def step():
            gw = torch.zeros_like(wd)
            gh = torch.zeros_like(h2)
            buf = torch.empty(min(chunk, max(1, pos.numel())), V)
            for s in range(0, pos.numel(), chunk):
                p = pos[s : s + chunk]
                hc = h2.index_select(0, p)
                b = buf[: p.numel()]
                torch.mm(hc, wd.t(), out=b)  # policy logits
                gh.index_copy_(0, p, b @ wd)  # grad_input (b stands in for grad_logits)
                gw.addmm_(b.t(), hc)  # grad_weight
                torch.mm(rh2.index_select(0, p), rw.t(), out=b)  # reference logits

    else:
        raise SystemExit(f"unknown impl {impl}")
    return step


def worker(impl, B, L, prompt_frac, reps, token_chunk_size, threads):
    import gc

    import torch

    if threads:
        torch.set_num_threads(threads)
    h, w, rh, rw, t = _inputs(B, L, prompt_frac)
    step = _step_fn(impl, h, w, rh, rw, t, token_chunk_size)
    gc.collect()
    base = _rss_bytes()
    times = []
    with PeakSampler() as sampler:
        for i in range(reps + 1):
            h.grad = None
            w.grad = None
            t0 = time.perf_counter()
            step()
            dt = time.perf_counter() - t0
            if i > 0:
                times.append(dt)
    n_tok = int((t != -100).sum())
    print(json.dumps(dict(impl=impl, B=B, L=L, prompt_frac=prompt_frac, time=statistics.median(times),
                          times=times, mem_mb=(sampler.peak - base) / 2**20, tokens=n_tok,
                          threads=torch.get_num_threads())))


def run_one(impl, B, L, frac, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, str(B), str(L), str(frac),
           "--reps", str(args.reps)]
    if args.token_chunk_size:
        cmd += ["--token-chunk-size", str(args.token_chunk_size)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"[{impl} B={B} L={L} frac={frac}] failed:\n{r.stderr[-2000:]}", file=sys.stderr)
        return None
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"  {impl:6s} B={B} L={L:5d} prompt={frac:.0%}: {res['time']:.2f} s  {res['mem_mb']:.0f} MB", file=sys.stderr)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=4, metavar=("IMPL", "B", "L", "FRAC"))
    ap.add_argument("--quick", action="store_true", help="only (B=4, L=512), 50%% prompt, 1 rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt-fracs", default="0.5,0.0")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--token-chunk-size", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.worker:
        impl, B, L, frac = args.worker
        worker(impl, int(B), int(L), float(frac), args.reps, args.token_chunk_size, args.threads)
        return
    sizes = SIZES
    fracs = [float(x) for x in args.prompt_fracs.split(",")]
    if args.quick:
        sizes, fracs, args.reps = [(4, 512)], [0.5], 1
    impls = args.impls.split(",")
    import torch

    t_start = time.time()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {platform.processor() or platform.machine()}  "
          f"{os.cpu_count()} CPUs  torch {torch.__version__}  threads {args.threads or torch.get_num_threads()}  "
          f"H={H} V={V} fp32 ref-model on  reps={args.reps}", file=sys.stderr)
    res = {}
    for frac in fracs:
        for B, L in sizes:
            for impl in impls:
                res[(impl, B, L, frac)] = run_one(impl, B, L, frac, args)

    def g(impl, B, L, frac, key):
        r = res.get((impl, B, L, frac))
        return None if r is None else r[key]

    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    hdr = ("| prompt | B x L | tokens w/ loss | ours s | ours MB | Liger s | Liger MB | mat s | mat MB | GEMM-only s "
           "| ours/Liger time | ours/Liger mem | ours/GEMM time |")
    print(hdr)
    print("|" + "|".join(["---"] * (hdr.count("|") - 1)) + "|")
    for frac in fracs:
        for B, L in sizes:
            row = [f"{frac:.0%}", f"{B} x {L}", fmt(g("ours", B, L, frac, "tokens"), "d"),
                   fmt(g("ours", B, L, frac, "time"), ".2f"), fmt(g("ours", B, L, frac, "mem_mb"), ".0f"),
                   fmt(g("liger", B, L, frac, "time"), ".2f"), fmt(g("liger", B, L, frac, "mem_mb"), ".0f"),
                   fmt(g("mat", B, L, frac, "time"), ".2f"), fmt(g("mat", B, L, frac, "mem_mb"), ".0f"),
                   fmt(g("gemm", B, L, frac, "time"), ".2f"),
                   fmt(ratio(g("ours", B, L, frac, "time"), g("liger", B, L, frac, "time")), ".2f"),
                   fmt(ratio(g("ours", B, L, frac, "mem_mb"), g("liger", B, L, frac, "mem_mb")), ".2f"),
                   fmt(ratio(g("ours", B, L, frac, "time"), g("gemm", B, L, frac, "time")), ".2f")]
            print("| " + " | ".join(row) + " |")
    for frac in fracs:
        for impl in impls:
            m0, m1 = g(impl, 4, 512, frac, "mem_mb"), g(impl, 2, 4096, frac, "mem_mb")
            if m0 is not None and m1 is not None:
                print(f"memory growth L=512 -> 4096, {impl}, prompt {frac:.0%}: {m0:.0f} -> {m1:.0f} MB "
                      f"({(m1 / m0 - 1) * 100:+.0f}%)")
    print(f"(total benchmark wall time {time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()

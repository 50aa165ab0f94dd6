#!/usr/bin/env python
"""Where our loss step's time goes, next to the GEMM floor: one torch.profiler step per configuration (CPU).

    python benchmarks/profile_losses.py                       # DPO + KTO x fp32, bf16 x (4, 512), (2, 2048) x 50 %, 0 %
    python benchmarks/profile_losses.py --sizes 2x2048 --dtypes bfloat16
    python benchmarks/profile_losses.py --dtypes bfloat16 --package /tmp/prev   # an earlier checkout's loss ("before")

Same inputs and arms as ``bench_losses.py`` (``_arms.py``): per configuration one warm-up step, then one profiled
step of ``ours`` (the default path) and of ``gemm`` (the floor: only the GEMMs an exact loss needs).  The ops of our
step are put in buckets -- GEMMs (``mm``/``addmm``/``addmm_``), dtype conversions and buffer copies (``copy_``),
``log_softmax``, ``exp``, and the rest -- and each bucket is given in ms and as a share of the step.  ``GEMM excess``
is our GEMM time minus the floor's: what layout and chunking cost the GEMMs themselves.  Self CPU times of a single
step: read them as a breakdown, not as a benchmark (``bench_losses.py`` gives the timed ratios).  Gradients are
set to None before each step, as ``bench_losses.py`` and a training loop's ``zero_grad()`` do.  ``--package DIR``
imports ``liger_ddp_patch`` from an earlier checkout (the floor then takes that checkout's default token chunk).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

BUCKETS = {
    "GEMM": ("aten::mm", "aten::addmm", "aten::addmm_"),
    "copies": ("aten::copy_",),
    "log_softmax": ("aten::_log_softmax",),
    "exp": ("aten::exp_", "aten::exp"),
}


def profile_step(arm, kind, dtype, B, L, frac):
    """``(step ms, {bucket: ms})`` of one profiled step after one warm-up."""
    import _arms
    import torch
    from bench_losses import H, V
    from torch.profiler import ProfilerActivity, profile

    x = _arms.make_inputs(B, L, H, V, frac, dtype=getattr(torch, dtype))
    step = _arms.make_step(arm, x, kind=kind)
    step()
    x["h"].grad = x["w"].grad = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3
    out = {name: sum(e.self_cpu_time_total for e in events if e.key in ops) / 1e3 for name, ops in BUCKETS.items()}
    out["other"] = total - sum(out.values())
    return total, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="dpo,kto")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sizes", default="4x512,2x2048")
    ap.add_argument("--prompt-fracs", default="0.5,0.0")
    ap.add_argument("--package", metavar="DIR", help="import liger_ddp_patch from this checkout instead")
    args = ap.parse_args()
    if args.package:
        sys.path.insert(0, os.path.abspath(args.package))
    import _machine

    import liger_ddp_patch

    print(f"# {_machine.describe()}  package {os.path.dirname(liger_ddp_patch.__file__)}")
    hdr = ["loss", "dtype", "prompt", "B x L", "ours ms", "floor ms"]
    hdr += [f"{b} %" for b in (*BUCKETS, "other")] + ["GEMM excess %", "non-GEMM %"]
    print("| " + " | ".join(hdr) + " |\n|" + "---|" * len(hdr))
    for kind in args.kinds.split(","):
        for dtype in args.dtypes.split(","):
            for size in args.sizes.split(","):
                B, L = (int(v) for v in size.split("x"))
                for frac in (float(f) for f in args.prompt_fracs.split(",")):
                    total, parts = profile_step("ours", kind, dtype, B, L, frac)
                    floor, floor_parts = profile_step("gemm", kind, dtype, B, L, frac)
                    row = [kind.upper(), {"float32": "fp32", "bfloat16": "bf16"}[dtype], f"{frac:.0%}", f"{B} x {L}"]
                    row += [f"{total:.0f}", f"{floor:.0f}"] + [f"{100 * parts[b] / total:.0f}" for b in parts]
                    row += [f"{100 * (parts['GEMM'] - floor_parts['GEMM']) / total:.0f}"]
                    row += [f"{100 * (total - parts['GEMM']) / total:.0f}"]
                    print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()

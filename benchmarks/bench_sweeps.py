#!/usr/bin/env python
"""What the bf16 head loss spends beside its GEMMs, per ``(chunk, V)`` block, and what the alternatives would (CPU).

    python benchmarks/bench_sweeps.py                      # V=32,000 (bench_losses' head) and 151,936, 5 rounds
    python benchmarks/bench_sweeps.py --vocab 32000 --rounds 9 --compile

Issue #22 asks for the bf16 head loss at <= 1.2x the GEMM floor.  What stands between the two is the elementwise
work on each chunk's logits block (``bench_losses.py``/``profile_losses.py`` time whole steps); this script times
that work alone, next to the GEMM that makes the block, so that a candidate is judged before it is built.  One block
is the package's default bf16 chunk on CPU (``(budget - tile) / (2 V)`` rows since the tile sweep: 1,966 at V=32,000,
414 at V=151,936; before it ``budget / (6 V)``: 699 and 147), H=896.

Arms, interleaved (every round runs each once, in turn; the table gives medians over rounds):

  gemm_bf16  the block's GEMM in bf16 (what the floor pays per block, three times per policy token)
  gemm_fp32  the same GEMM in fp32
  now        the block sweep: ``LogitsBuffers`` (bf16 block -> fp32), ``_onepass._softmax_minus_onehot_``
             (fused softmax, the target entry), the row factor, the cast back to bf16 (what a bf16 CPU chunk ran
             before ``tiles``, and still runs with a biased head)
  tiled      the same ops on row tiles of ``--tile-bytes`` (each tile stays in cache between its ops)
  one_exp    tiled, and one exponential per logit instead of two: the package's accelerator branch of ``softmax_``
             (max, exp, sum; the softmax scaled, not recomputed), forced on CPU
  tiles      the package's CPU half-precision sweep (``losses/_tiles.py``): ``row_lse`` then ``grad_`` on fp32 row
             tiles of ``_tiles.TILE_BYTES`` copied from the bf16 block, written back into it (no fp32 block)
  compiled   (``--compile``) the whole sweep as one ``torch.compile(dynamic=True)`` function (inductor); its first call
             (the compilation) is reported apart

On a GPU (``--device cuda``; prepared for the next lent one, not yet run there) the GEMM writes the fp32 block itself,
so the arms are: ``gemm_bf16``, ``gemm_fp32out`` (the fp32-output GEMM the package runs), ``restore`` (copying the
saved fp32 block into the work buffer: subtract it from ``now``), ``now`` (restore, the package's accelerator branch
of ``_softmax_minus_onehot_`` with its row factor, the cast to bf16) and ``compiled`` (the same sweep as one
``torch.compile(dynamic=True)`` function, from the fp32 block to the bf16 gradient: 2-3 passes over the block where
eager makes about ten, issue #22's candidate for <= 1.2x the floor) and ``triton`` (the package's
``losses/_triton.py``, ``sweep="triton"``: the same sweep as two Triton kernels, three passes: a log-sum-exp read, a
gradient read and a bf16 write; where
Triton runs: a GPU, or its CPU interpreter with ``TRITON_INTERPRET=1``).  ``--as-accelerator`` runs that arm set on
CPU (a test of its code, not a measurement; ``--rows`` shrinks the block for the interpreter).

Every variant's bf16 output is checked against ``now`` (max abs difference, printed).  The printed header names the
CPU and whether its bf16 GEMMs are native (``_machine.py``): where they are emulated, the GEMM rows dwarf the sweeps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

H = 896


def _block(V: int, seed: int = 0, device: str = "cpu", hidden: int = H, rows: int | None = None):
    from liger_ddp_patch.losses import _plan

    rows = rows or _plan.resolve_token_chunk_size(None, V, device, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    w = (torch.randn(V, hidden, generator=g) * 0.05).to(torch.bfloat16)
    labels = torch.randint(0, V, (rows, 1), generator=g)
    mult = -torch.rand(rows, generator=g)
    return tuple(t.to(device) for t in (h, w, labels, mult))


def _sweep(x, lab, mult):
    """The whole sweep as one function of the fp32 (or bf16) block: ``(softmax - onehot) * mult`` in bf16."""
    xf = x.float()
    m = xf.amax(1, keepdim=True)
    e = torch.exp(xf - m)
    s = e.sum(1, keepdim=True)
    hit = torch.arange(x.shape[1], device=x.device).unsqueeze(0) == lab
    logp = torch.where(hit, xf, 0.0).sum(1, keepdim=True) - m - torch.log(s)
    g = torch.where(hit, torch.expm1(logp), e / s) * mult.unsqueeze(1)
    return g.to(torch.bfloat16)


def accelerator_arms(V: int, device: str, hidden: int, compile_: bool, rows: int | None = None):
    """The arm set of a GPU, where the GEMM writes the fp32 block (``--device cuda`` or ``--as-accelerator``)."""
    from liger_ddp_patch.losses import _onepass, _plan, _softmax

    h, w, labels, mult = _block(V, device=device, hidden=hidden, rows=rows)
    rows = h.shape[0]
    fp32_out = _plan.fp32_out(device, torch.bfloat16)
    half = torch.mm(h, w.t())
    block = torch.mm(h, w.t(), out_dtype=torch.float32) if fp32_out else half.float()  # the GEMM's fp32 block
    work = torch.empty_like(block)
    out = torch.empty_like(half)

    def now():
        # the package's accelerator branch (max, sub, exp, sum; the row scale folded into the factor), then bf16
        x = work.copy_(block)
        with mock.patch.object(_softmax, "fused_log_softmax", lambda device: False):
            _, _, k = _onepass._softmax_minus_onehot_(x, labels)
        x.mul_((mult if k is None else mult * k).unsqueeze(1))
        return out.copy_(x)

    found = {
        "gemm_bf16": lambda: torch.mm(h, w.t(), out=half),
        "gemm_fp32out": (lambda: torch.mm(h, w.t(), out_dtype=torch.float32)) if fp32_out else (lambda: h.float()),
        "restore": lambda: work.copy_(block),
        "now": now,
    }
    first = {}
    if compile_:
        compiled, first["compiled"] = _compiled(block, labels, mult, device)
        found["compiled"] = lambda: out.copy_(compiled(block, labels, mult))
    if fused := _fused():

        def triton_sweep():  # what ChunkedDPOLoss(sweep="triton") runs per chunk
            logp, lse = fused.row_lse(block, labels)
            return fused.grad_(block, labels, lse, logp, mult, out)

        started = time.perf_counter()
        triton_sweep()  # the first call compiles the two kernels
        _sync(device)
        first["triton"] = time.perf_counter() - started

        found["triton"] = triton_sweep
    return found, rows, rows, first


def _fused():
    """The package's ``losses/_triton.py`` where Triton can run it: a GPU, or its CPU interpreter
    (``TRITON_INTERPRET=1``); else None."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        return None
    try:
        from liger_ddp_patch.losses import _triton
    except ImportError:  # no triton
        return None
    return _triton


def _compiled(x, labels, mult, device: str = "cpu"):
    """``(the sweep compiled with dynamic shapes, seconds of its first call: the compilation)``."""
    compiled = torch.compile(_sweep, dynamic=True)
    started = time.perf_counter()
    compiled(x, labels, mult)
    _sync(device)
    return compiled, time.perf_counter() - started


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def arms(V: int, tile_bytes: int, compile_: bool, hidden: int = H):
    """``{name: step}`` over one shared block; each step returns the bf16 gradient block it made."""
    from liger_ddp_patch.losses import _gemm, _onepass, _plan, _softmax

    h, w, labels, mult = _block(V, hidden=hidden)
    rows = h.shape[0]
    plan = _plan.Plan(rows, torch.bfloat16, torch.float32, _plan.logits_budget_bytes("cpu"), False)
    bufs = _gemm.LogitsBuffers(rows, V, plan, torch.device("cpu"))
    half = torch.mm(h, w.t())  # the GEMM's bf16 block, made once (the sweeps must not pay for it)
    out = torch.empty_like(half)
    full = torch.empty(rows, V)
    tile = max(1, tile_bytes // (4 * V))
    hf, wf = h.float(), w.float()

    def now():
        gl = bufs._block(bufs.full, rows, V).copy_(half)  # LogitsBuffers.logits, less its GEMM
        _onepass._softmax_minus_onehot_(gl, labels)
        gl.mul_(mult.unsqueeze(1))
        return out.copy_(gl)

    def tiled():
        for s in range(0, rows, tile):
            e = min(rows, s + tile)
            x = full[s:e].copy_(half[s:e])
            _onepass._softmax_minus_onehot_(x, labels[s:e])
            x.mul_(mult[s:e].unsqueeze(1))
            out[s:e].copy_(x)
        return out

    def one_exp():
        # the package's own accelerator branch (max, exp, sum; the row scale folded into the factor), on CPU tiles
        with mock.patch.object(_softmax, "fused_log_softmax", lambda device: False):
            for s in range(0, rows, tile):
                e = min(rows, s + tile)
                x = full[s:e].copy_(half[s:e])
                _, _, k = _onepass._softmax_minus_onehot_(x, labels[s:e])
                x.mul_((mult[s:e] * k).unsqueeze(1))
                out[s:e].copy_(x)
        return out

    def tiles():
        from liger_ddp_patch.losses import _tiles

        logp, lse = _tiles.row_lse(half, labels)
        return _tiles.grad_(half, labels, lse, logp, mult, out)

    found = {
        "gemm_bf16": lambda: torch.mm(h, w.t(), out=half),
        "gemm_fp32": lambda: torch.mm(hf, wf.t(), out=full),
        "now": now,
        "tiled": tiled,
        "one_exp": one_exp,
        "tiles": tiles,
    }
    first = {}
    if compile_:
        compiled, first["compiled"] = _compiled(half, labels, mult)
        found["compiled"] = lambda: compiled(half, labels, mult)
    # the block every sweep starts from must be the GEMM's: gemm_bf16 rewrites `half` with the same values
    return found, rows, tile, first


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", default="32000,151936")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tile-bytes", type=int, default=4 << 20, help="bytes of fp32 logits per tile (default 4 MiB)")
    ap.add_argument(
        "--compile", action="store_true", help="also the torch.compile'd sweep (inductor; needs a C++ compiler)"
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the GPU arm set (see above)")
    ap.add_argument("--as-accelerator", action="store_true", help="the GPU arm set on CPU (a test of its code)")
    ap.add_argument("--hidden", type=int, default=H, help="hidden size (a GPU run: 3584, Qwen2.5-7B's)")
    ap.add_argument("--rows", type=int, default=None, help="GPU arm set: rows per block (default: the package's chunk)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import _machine

    where = torch.cuda.get_device_name(0) if args.device == "cuda" else _machine.describe()
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {where}  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  H={args.hidden}  rounds={args.rounds}")  # fmt: skip
    for V in (int(v) for v in args.vocab.split(",")):
        if args.device == "cuda" or args.as_accelerator:
            found, rows, tile, first = accelerator_arms(V, args.device, args.hidden, args.compile, args.rows)
        else:
            found, rows, tile, first = arms(V, args.tile_bytes, args.compile, args.hidden)
        reference = found["now"]().float().clone()
        errors = {  # every arm writes the same output tensor: compare each as it comes
            name: (f().float() - reference).abs().max().item()
            for name, f in found.items()
            if not name.startswith("gemm") and name != "restore"
        }
        for f in found.values():  # warm-up
            f()
        times: dict[str, list[float]] = {name: [] for name in found}
        for _ in range(args.rounds):
            for name, f in found.items():
                _sync(args.device)
                started = time.perf_counter()
                f()
                _sync(args.device)
                times[name].append(time.perf_counter() - started)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"\nV={V:,}: one block of {rows} x {V:,} logits (tiles of {tile} rows)")
        print("| arm | ms per block | / now | / gemm_bf16 | max abs diff vs now |\n|---|---|---|---|---|")
        for name, ms in med.items():
            err = f"{errors[name]:.1e}" if name in errors else "-"
            print(f"| {name} | {ms:.1f} | {ms / med['now']:.2f} | {ms / med['gemm_bf16']:.3f} | {err} |")
        for name, seconds in first.items():
            print(f"({name}: first call, the compilation included, {seconds:.1f} s)")


if __name__ == "__main__":
    main()

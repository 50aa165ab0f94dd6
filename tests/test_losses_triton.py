"""``sweep="triton"``: the ``(chunk, V)`` sweep as the two Triton kernels of ``losses/_triton.py`` (issue #22).

No GPU here: Triton's CPU interpreter (``TRITON_INTERPRET=1``, set before Triton is imported, hence subprocesses)
runs the very kernels on CPU tensors.  Checked: the kernels against the exact fp64 gradient; the losses against
the eager sweep (fp32: the same values to fp32 rounding; bf16: to bf16 rounding, which the interpreter truncates
where a GPU rounds to nearest); a real 2-rank DDP step at V=151,936; and, without Triton's interpreter on CPU, the
eager sweep with a warning (never a crash).  Its speed is a GPU question: ``benchmarks/bench_sweeps.py``,
``benchmarks/gpu_check.py``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss

ROOT = Path(__file__).resolve().parents[1]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def interpreted(code: str, timeout: int = 600) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@needs_triton
def test_the_kernels_are_the_gradient_within_bf16_rounding():
    """The kernels against the exact ``mult * (softmax - onehot)`` in fp64: every entry within bf16 rounding (plus
    fp32's 1e-6), a confident target (probability 0.97: its entry is ``mult * expm1(logp)``) and a masked second
    vocabulary tile included."""
    code = """
import torch
from liger_ddp_patch.losses import _triton
g = torch.Generator().manual_seed(0)
n, V = 6, 5000  # two vocabulary tiles of 4096, the second masked
x = torch.randn(n, V, generator=g) * 3
lab = torch.randint(0, V, (n,), generator=g)
x[0, lab[0]] = 17.0  # probability 0.97
mult = -torch.rand(n, generator=g) - 0.1
out = torch.empty(n, V, dtype=torch.bfloat16)
logp, lse = _triton.row_lse(x, lab)
_triton.grad_(x, lab, lse, logp, mult, out)
x64 = x.double()
exact = torch.softmax(x64, 1)
exact[torch.arange(n), lab] = torch.expm1(torch.log_softmax(x64, 1)[torch.arange(n), lab])
exact *= mult.double().unsqueeze(1)
rel = ((out.double() - exact).abs() - 1e-6).div(exact.abs()).max().item()  # fp32's 1e-6 apart
print(rel, (lse.double() - torch.logsumexp(x64, 1)).abs().max().item(), out[0, lab[0]].item(), exact[0, lab[0]].item())
"""
    rel, lse_err, target, exact_target = map(float, interpreted(code).split())
    # bf16 keeps 8 significant bits: rounded to nearest (torch, a GPU) within 2**-9, truncated within 2**-7 (Triton's
    # interpreter ignores fp_downcast_rounding="rtne" and truncates: measured with triton 3.9)
    assert rel <= 2**-7, (rel, target, exact_target)
    assert lse_err <= 1e-5 and target != 0.0, (lse_err, target)


AOT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from liger_ddp_patch.losses import _triton as T

common = {"lab_ptr": "*i64", "lse_ptr": "*fp32", "tgt_ptr": "*fp32", "V": "i32", "stride": "i32", "BLOCK": "constexpr"}
for arch in (80, 90):  # A100; H100 / H200
    target = GPUTarget("cuda", arch, 32)
    triton.compile(ASTSource(T._row_lse, dict(common, x_ptr="*fp32"), {"BLOCK": T.BLOCK}), target=target)
    for out in ("*bf16", "*fp16", "*fp32"):
        sig = dict(common, x_ptr="*fp32", mult_ptr="*fp32", out_ptr=out, out_stride="i32")
        kernel = triton.compile(ASTSource(T._row_grad, sig, {"BLOCK": T.BLOCK}), target=target)
        assert kernel.asm["cubin"], (arch, out)
print("compiled")
"""


@needs_triton
def test_the_kernels_compile_for_a_gpu_without_one():
    """Triton compiles both kernels down to a cubin for sm_80 and sm_90 (its bundled ``ptxas``) with no GPU here:
    what the interpreter cannot check (types the compiler infers, casts, the loop it carries) is checked so."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", AOT], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    if "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this Triton has no ptxas")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


LOSSES = """
import collections, json, torch
from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss, _triton

calls = collections.Counter()
for name in ("row_lse", "grad_"):  # count the kernels' launches: "triton" must mean they ran
    def counted(*args, _f=getattr(_triton, name), _name=name):
        calls[_name] += 1
        return _f(*args)
    setattr(_triton, name, counted)

def run(cls, sweep, dtype, chunk, one_pass):
    g = torch.Generator().manual_seed(0)
    B, L, H, V = 4, 24, 16, 5000
    h = torch.randn(B, L, H, generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype).requires_grad_(True)
    rh, rw = torch.randn(B, L, H, generator=g).to(dtype), (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    t = torch.randint(0, V, (B, L), generator=g)
    t[:, :8] = -100
    loss = cls(sweep=sweep, token_chunk_size=chunk, one_pass=one_pass, use_ref_model=True)
    if cls is ChunkedKTOLoss:
        out = loss(h, w, t, None, torch.tensor([True, False, True, False]), rh, rw, None, torch.tensor(0.1))
    else:
        out = loss(w, h, t, None, rh, rw)
    out[0].backward()
    return [out[0].detach().double(), h.grad.double(), w.grad.double()], loss.last_sweep

rows = []
for cls in (ChunkedDPOLoss, ChunkedKTOLoss):
    for dtype in (torch.float32, torch.bfloat16):
        for chunk, one_pass in ((None, True), (7, True), (None, False)):  # pairs in one chunk; longer; two-pass
            eager, _ = run(cls, "eager", dtype, chunk, one_pass)
            assert not calls
            ours, sweep = run(cls, "triton", dtype, chunk, one_pass)
            err = [((a - b).abs().max() / a.abs().max()).item() for a, b in zip(eager, ours)]
            rows.append(dict(loss=cls.__name__, dtype=str(dtype), chunk=chunk, one_pass=one_pass, sweep=sweep, err=err,
                             calls=dict(calls)))
            calls.clear()
print(json.dumps(rows))
"""


@needs_triton
def test_the_losses_match_the_eager_sweep():
    """DPO and KTO, the reference model on, fp32 and bf16: pairs that fit a token chunk, pairs longer than one (the
    long-group sums) and the two-pass path (whose forward and reference pass take the log-sum-exp kernel): loss,
    grad-input and weight gradient against the eager sweep's, relative to each tensor's largest entry."""
    rows = json.loads(interpreted(LOSSES))
    assert len(rows) == 12 and all(row["sweep"] == "triton" for row in rows), rows
    for row in rows:
        # one pass: both kernels on every policy chunk; two-pass: the log-sum-exp kernel (policy and reference)
        assert row["calls"].get("row_lse", 0) >= 2 and (row["calls"].get("grad_", 0) > 0) == row["one_pass"], row
        # fp32: the same math in another order (1e-6), tight enough to catch a 1 % slip; bf16: the interpreter
        # truncates each gradient entry where eager rounds to nearest, and the results are bf16 themselves (one ulp
        # of the largest entry is up to 2**-7 of it): two ulps
        bound = 2e-6 if row["dtype"] == "torch.float32" else 2**-6
        loss_bound = 2e-6 if row["dtype"] == "torch.float32" else 1e-5  # the loss is computed in fp32 either way
        assert row["err"][0] <= loss_bound and max(row["err"][1:]) <= bound, row


def test_where_triton_cannot_run_the_eager_sweep_runs_with_a_warning(monkeypatch):
    """CPU tensors without the interpreter: a warning that says why, ``last_sweep`` says it too, and the results
    are the eager sweep's, bit for bit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from liger_ddp_patch.losses import _plan

    _plan._triton_unavailable.cache_clear()
    _plan._warn_once.cache_clear()
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 6, 8, generator=g), torch.randn(50, 8, generator=g)
    t = torch.randint(0, 50, (2, 6), generator=g)

    def grads(sweep):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        loss = ChunkedKTOLoss(sweep=sweep)
        out = loss(hh, ww, t, None, torch.tensor([True, False]), kl=torch.tensor(0.0))
        out[0].backward()
        return loss.last_sweep, [out[0], hh.grad, ww.grad]

    with pytest.warns(RuntimeWarning, match=r"sweep='triton' asked for, but .*the eager sweep runs instead"):
        said, ours = grads("triton")
    assert said.startswith("eager (triton: ") and grads("eager")[0] == "eager", said
    assert all(torch.equal(a, b) for a, b in zip(ours, grads("eager")[1]))


@pytest.mark.parametrize("cls", [ChunkedDPOLoss, ChunkedKTOLoss])
def test_an_unknown_sweep_is_refused(cls):
    with pytest.raises(ValueError, match=r"sweep must be one of 'eager', 'triton', got 'fused'"):
        cls(sweep="fused")


@needs_triton
@pytest.mark.ddp
def test_a_ddp_step_at_real_vocabulary_runs_the_kernels_in_sync(tiny_real):
    """``LIGER_DDP_PATCH_LOSS=sweep=triton``: the kernels run inside ``DistributedDataParallel.forward`` at
    V=151,936 (2 CPU ranks, gloo, the interpreter), and every gradient is all-reduced."""
    from harness import run_probe

    env = {"LIGER_DDP_PATCH_LOSS": "sweep=triton", "TRITON_INTERPRET": "1"}
    result = run_probe(tiny_real, "before", env=env)
    for run in result["results"]:
        assert "error" not in run, run.get("trace", "") + result["log"][-3000:]
        assert run["params"] == 25 and (run["differing"], run["max_abs_diff"]) == (0, 0.0), run
        assert run["loss_saw"][f"Chunked{run['trainer'].upper()}Loss sweep"] == "triton", run["loss_saw"]
    assert {run["trainer"] for run in result["results"]} == {"dpo", "kto"}

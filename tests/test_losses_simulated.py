"""A CPU call planned as an accelerator's (``_plan.simulated_accelerator``, issue 45): the GPU's plan without a GPU.

Inside the context a loss call on CPU tensors takes the accelerator's rules for a stated free memory (its chunk
budget, the held budget of that free memory, no ``_tiles`` sweep, the non-fused softmax, fp32-output GEMMs emulated
in blocks), so a CPU run takes the chunk rows, the path and the held sums the GPU call takes, and allocates what it
allocates (``benchmarks/sim_gpu_peak.py``).  Checked here: the numbers are the CPU's own within rounding, the plan is
the accelerator's, and outside the context nothing changes.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss, _plan

V, H, B, L = 1_000, 32, 4, 64
GB = 10**9


def _inputs(dtype, seed=0, rows=B):
    g = torch.Generator().manual_seed(seed)
    x = dict(
        h=torch.randn(rows, L, H, generator=g).to(dtype).requires_grad_(True),
        w=(torch.randn(V, H, generator=g) * 0.02).to(dtype).requires_grad_(True),
        rh=torch.randn(rows, L, H, generator=g).to(dtype),
        rw=(torch.randn(V, H, generator=g) * 0.02).to(dtype),
        t=torch.randint(0, V, (rows, L), generator=g),
    )
    x["t"][:, : L // 2] = -100
    return x


def _run(kind, dtype, sim, **kw):
    x = _inputs(dtype)
    fn = ChunkedDPOLoss(beta=0.1, **kw) if kind == "dpo" else ChunkedKTOLoss(beta=0.1, use_ref_model=True, **kw)
    with _plan.simulated_accelerator(80 * GB) if sim else contextlib.nullcontext():
        if kind == "dpo":
            loss = fn(x["w"], x["h"], x["t"], None, x["rh"], x["rw"], None)[0]
        else:
            pref = torch.arange(B) % 2 == 0
            loss = fn(_input=x["h"], lin_weight=x["w"], target=x["t"], bias=None, preference_labels=pref,
                      ref_input=x["rh"], ref_weight=x["rw"], ref_bias=None, kl=torch.tensor(0.1))[0]  # fmt: skip
        loss.backward()
    return fn, [loss.detach(), x["h"].grad, x["w"].grad]


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_simulated_accelerator_computes_what_the_cpu_computes(kind, one_pass, dtype):
    """Same loss and gradients as the CPU's own plan, on the accelerator's sweep (measured, of each quantity's scale:
    bf16 at most 2.3e-4 (grad-input), 1.7e-5 (grad-weight), 4.8e-7 (loss); fp32 at most 1.6e-6); token_chunk_size=8
    makes every pair and row longer than a chunk, so the long groups' sums and the two-pass backward's vocabulary
    blocks run through the emulated fp32-output GEMMs too."""
    for chunk in (None, 8):
        cpu_fn, cpu = _run(kind, dtype, False, one_pass=one_pass, token_chunk_size=chunk)
        sim_fn, sim = _run(kind, dtype, True, one_pass=one_pass, token_chunk_size=chunk)
        assert sim_fn.last_sweep == "eager" and cpu_fn.last_sweep == ("tiles" if dtype == torch.bfloat16 else "eager")
        assert sim_fn.last_path == cpu_fn.last_path
        bound = 2e-3 if dtype == torch.bfloat16 else 1e-5
        for a, b in zip(sim, cpu):
            assert float((a.float() - b.float()).abs().max()) <= bound * float(b.float().abs().max())


def test_the_plan_is_the_accelerators_inside_the_context_and_the_cpus_outside():
    cpu = torch.device("cpu")
    assert _plan.device_kind(cpu) == "cpu" and _plan.simulated(cpu) is None
    before = (_plan.logits_budget_bytes(cpu), _plan.held_budget_bytes(cpu), _plan.fp32_out(cpu, torch.bfloat16),
              _plan.tiles_sweep(cpu, torch.bfloat16))  # fmt: skip
    assert before == (128 << 20, 384 << 20, False, True)
    with _plan.simulated_accelerator(80 * GB):
        assert _plan.device_kind(cpu) == "accelerator" and _plan.device_kind(None) == "accelerator"
        assert _plan.logits_budget_bytes(cpu) == 1 << 30
        assert _plan.held_budget_bytes(cpu) == 80 * GB // _plan.HELD_BUDGET_FREE_FRACTION
        assert _plan.fp32_out(cpu, torch.bfloat16) and not _plan.fp32_out(cpu, torch.float32)
        assert not _plan.tiles_sweep(cpu, torch.bfloat16)
        assert _plan.resolve_token_chunk_size(None, 151_936, cpu, torch.bfloat16) == 1766  # as on a GPU
        with _plan.simulated_accelerator(4 << 30, fp32_out=False):  # torch < 2.10: the GEMM writes bf16
            assert _plan.resolve_token_chunk_size(None, 151_936, cpu, torch.bfloat16) == 1177
    assert (_plan.logits_budget_bytes(cpu), _plan.held_budget_bytes(cpu), _plan.fp32_out(cpu, torch.bfloat16),
            _plan.tiles_sweep(cpu, torch.bfloat16)) == before  # fmt: skip
    with pytest.raises(ValueError):
        with _plan.simulated_accelerator(-1):
            pass


# ------------------------------------------------------------------ the plan at the GPU check's step (part (c))

# Qwen2.5-7B's head, as gpu_check.py part (c) runs it: bf16 weights and hidden states, one DPO pair or two KTO rows
# of L=4,096 tokens per rank, 50 % prompt (2,048 loss tokens a row: the hidden states the loss gets are L - 1 long);
# and at L=8,192 (rows of 4,096 loss tokens: too long to widen a chunk to)
V7, H7 = 151_936, 3_584
VH_BF16 = V7 * H7 * 2  # one bf16 (V, H) tensor: 1,089,077,248 B
ROW = V7 * 6  # what a chunk holds per token on a GPU: fp32 logits and the bf16 gradient block, 911,616 B
FREE = {"H100 80 GB": 80 * GB, "H200 141 GB": 141 * GB, "nearly full (4 GiB)": 4 << 30}
# (L, free memory) -> (chunk rows, path, extra (V, H) sums, held bytes beyond the two-pass path), DPO and KTO alike.
# The held budget: min(free / 16, 4 B x V x H - the 1,766-row chunk's 1,609,913,856 B = 568,240,640 B).  Before issue
# 45 (1/16 of free memory alone) L=4,096 held one bf16 sum in 1,766-row chunks at 80 and 141 GB (1,089,077,248 B),
# and widened to 2,048 rows at 4 GiB free (then counted as +171,383,808 B of fp32 logits alone).
PINNED = {
    (4_096, "H100 80 GB"): (2048, "one-pass", 0, (2048 - 1766) * ROW),
    (4_096, "H200 141 GB"): (2048, "one-pass", 0, (2048 - 1766) * ROW),
    (4_096, "nearly full (4 GiB)"): (2048, "one-pass", 0, (2048 - 1766) * ROW),
    (8_192, "H100 80 GB"): (1194, "one-pass", 1, VH_BF16 - (1766 - 1194) * ROW),
    (8_192, "H200 141 GB"): (1194, "one-pass", 1, VH_BF16 - (1766 - 1194) * ROW),
    (8_192, "nearly full (4 GiB)"): (865, "one-pass", 1, VH_BF16 - (1766 - 865) * ROW),
}


def _head_7b(rows, L):
    """Stand-ins of the 7B head's inputs that hold a few bytes (expanded scalars): the plan reads only shapes,
    dtypes, the device and the targets."""
    hidden = torch.empty((), dtype=torch.bfloat16, requires_grad=True).expand(rows, L - 1, H7)
    weight = torch.empty((), dtype=torch.bfloat16, requires_grad=True).expand(V7, H7)
    target = torch.ones(rows, L - 1, dtype=torch.long)
    target[:, : L // 2 - 1] = -100
    return hidden, weight, target


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize(("L", "free"), list(PINNED), ids=[f"L={L}-{free}" for L, free in PINNED])
def test_the_default_plan_at_the_7b_head_is_pinned(kind, L, free):
    """The default's plan at the GPU check's step for each stated free memory: a change to the accelerator's budget
    rules (``_plan``) or to the path choice (``_base``) fails here, on any machine.  What these plans allocate, and
    TRL 1.14's and 1.16's heads beside them: ``benchmarks/sim_gpu_peak.py``."""
    hidden, weight, target = _head_7b(2, L)
    assert int((target != -100).sum(1)[0]) == L // 2
    fn = ChunkedDPOLoss(beta=0.1) if kind == "dpo" else ChunkedKTOLoss(beta=0.1, use_ref_model=True)
    with _plan.simulated_accelerator(FREE[free]):
        got = fn.planned(hidden, weight, target)
    held = got["held"]
    chunk, path, sums, extra = PINNED[L, free]
    assert (got["chunk"], got["path"], got["sweep"]) == (chunk, path, "eager"), got
    assert (held["vh_sums"], held["extra_bytes"], held["cast_bytes"]) == (sums, extra, 0), held
    assert chunk >= _plan.MIN_ONE_PASS_ROWS


# (free bytes, accumulator bytes per weight element, fewest narrowed rows) -> the default's (path, chunk)
PLANNED = [
    ((80 * GB, 10**6, 512), ("one-pass", 24)),  # the sum (64,000 B) fits: held
    ((50_000 * 16, 10**6, 512), ("one-pass", 32)),  # 50,000 B free to hold: widened to a row (+48,000 B)
    ((1_000 * 16, 10**6, 512), ("two-pass", 24)),  # neither fits, a narrower chunk would be under 512 rows
    ((80 * GB, 5, 4), ("one-pass", 16)),  # 5 B a weight element less the chunk's 144,000 B: narrowed to 16 rows
]


@pytest.mark.parametrize(("budgets", "expected"), PLANNED, ids=["sum", "widened", "two-pass", "narrowed"])
@pytest.mark.parametrize("one_pass", [None, True, False], ids=["default", "one_pass=1", "one_pass=0"])
def test_planned_is_what_the_call_records(monkeypatch, budgets, expected, one_pass):
    """:meth:`planned` says what a call then does.  One pair of 32-token rows, a chunk of 24 tokens (6,000 B a row:
    fp32 logits and the bf16 gradient block): the pair is long, and the budgets make the default hold its sum, widen
    the chunk to a row, take two passes or narrow the chunk; ``one_pass=1`` / ``0`` are unmoved by them."""
    free, per_weight, rows = budgets
    monkeypatch.setitem(_plan.LOGITS_BUDGET_BYTES, "accelerator", 24 * V * 4)
    monkeypatch.setattr(_plan, "ACCUMULATOR_BYTES_PER_WEIGHT", per_weight)
    monkeypatch.setattr(_plan, "MIN_ONE_PASS_ROWS", rows)
    x = _inputs(torch.bfloat16, rows=2)
    fn = ChunkedDPOLoss(beta=0.1, one_pass=one_pass)
    with _plan.simulated_accelerator(free):
        want = fn.planned(x["h"], x["w"], x["t"])
        fn(x["w"], x["h"], x["t"], None, x["rh"], x["rw"], None)[0].backward()
    assert want == dict(path=fn.last_path, chunk=fn.last_chunk, sweep=fn.last_sweep, held=fn.last_held)
    got = (fn.last_path.split(":")[0], fn.last_chunk)
    assert got == {None: expected, True: ("one-pass", 24), False: ("two-pass", 24)}[one_pass], fn.last_path

"""GPU-readiness of the chunked losses, checked on CPU: half-precision memory, autocast, chunk sizing.

* bf16/fp16 weight gradient: no ``(V, H)``-sized temporary per token chunk (counted with a TorchDispatchMode);
* ``torch.autocast``: forward and backward see the same precision (autocast == casting the inputs by hand), and our
  error against the fp32 truth is at most 1.5x Liger's own error under the same autocast;
* the default token chunk is a memory budget per device type (CPU unchanged, big enough GEMMs on a GPU).
"""

from __future__ import annotations

import pytest
import torch
from _loss_cases import call_kto, fp64_dpo_truth, leaf_copies, load_reference
from torch.utils._python_dispatch import TorchDispatchMode

from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss, _onepass, _plan, _softmax

HALF = [torch.bfloat16, torch.float16]


class FreshAllocations(TorchDispatchMode):
    """Records the numel of every tensor an op allocates (outputs of ops that neither view nor write an input)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.sizes.append(t.numel())
        return out


def _dpo_inputs(dtype, batch=4, seq_len=24, hidden=96, vocab=300, w_scale=0.3, seed=0, prompt=6):
    g = torch.Generator().manual_seed(seed)
    x = dict(
        hidden=torch.randn(batch, seq_len, hidden, generator=g).to(dtype),
        weight=(torch.randn(vocab, hidden, generator=g) * w_scale).to(dtype),
        bias=(torch.randn(vocab, generator=g) * 0.5).to(dtype),
        ref_hidden=torch.randn(batch, seq_len, hidden, generator=g).to(dtype),
        ref_weight=(torch.randn(vocab, hidden, generator=g) * w_scale).to(dtype),
        ref_bias=(torch.randn(vocab, generator=g) * 0.5).to(dtype),
        target=torch.randint(0, vocab, (batch, seq_len), generator=g),
    )
    x["target"][:, :prompt] = -100
    return x


def _dpo(cls, x, **kw):
    loss, metrics = cls(**kw)(
        x["weight"], x["hidden"], x["target"], x["bias"], x["ref_hidden"], x["ref_weight"], x["ref_bias"]
    )
    return loss, metrics


def _vh_allocations_in_a_step(dtype, token_chunk_size, batch, one_pass, short_first=False):
    """(V, H)-sized allocations of one forward + backward, and the path that ran (the one-pass path makes its
    weight gradient in the forward).  ``short_first``: the first pair keeps 5 loss tokens per row."""
    x = _dpo_inputs(dtype, batch=batch)
    if short_first:
        x["target"][[0, batch // 2], :19] = -100
    x = leaf_copies(x)
    V, H = x["weight"].shape
    with FreshAllocations() as mode:
        loss, _ = _dpo(ChunkedDPOLoss, x, token_chunk_size=token_chunk_size, compute_nll_loss=True, one_pass=one_pass)
        loss.backward()
    assert x["weight"].grad.dtype == dtype and torch.isfinite(x["weight"].grad.float()).all()
    path = "one-pass" if "OnePassLoss" in loss.grad_fn.name() else "two-pass"
    return sum(1 for n in mode.sizes if n >= V * H), path


# 18 loss tokens per row, 36 per pair: (chunk, batch, one_pass[, short_first]) -> (V, H)-sized allocations expected
STEPS = {
    "one-pass, 1 chunk": ((1000, 4, True), 1),
    "one-pass, 4 chunks": ((36, 8, True), 1),
    "one-pass, 1 long pair in 5 chunks": ((8, 2, True), 2),
    "one-pass, a short pair, then a long one": ((20, 4, True, True), 1),
    "one-pass, 2 long pairs, rows fit a chunk": ((24, 4, True), 2),
    "one-pass, 2 long pairs in 10 chunks": ((8, 4, True), 3),
    "one-pass, 4 long pairs in 20 chunks": ((8, 8, True), 3),
    "two-pass, 9 chunks": ((8, 4, False), 1),
}


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_weight_gradient_has_no_per_chunk_vocab_by_hidden_temporary(dtype):
    """(V, H)-sized allocations in a forward + backward do not grow with the number of chunks: the returned
    gradient itself (handed to ``.grad`` without a copy), plus, for pairs longer than a chunk (one pass), one sum
    per row of a long pair that does not fit whole in the pair's last chunk -- the first long pair's first sum is
    the result itself (long pairs go first, so a short pair in front changes nothing), later long pairs reuse the
    spare sums: rows that fit a chunk 1, then 2 in all; longer rows 2, then 3, however many long pairs.

    Before the vocabulary blocks (bf16, two-pass): 1 chunk -> 4, 9 chunks -> 20 (per chunk a (V, H) product and its
    fp32 copy, plus the fp32 accumulator and the final cast): ~10 V H bytes at peak against Liger's ~4 V H.  Zero
    would mean the mode saw nothing (or no weight gradient was made), one more a copy or an extra accumulator.
    """
    seen, want = {}, {}
    for name, (args, expected) in STEPS.items():
        count, path = _vh_allocations_in_a_step(dtype, *args)
        assert path == name.split(",")[0], (name, path)
        seen[name], want[name] = count, expected
    print(f"{dtype}: (V, H)-sized allocations per step: {seen}")
    assert seen == want


# ------------------------------------------------------------------------------------------------- autocast


def _loss_and_grads(cls, x, autocast_dtype=None, **kw):
    x = leaf_copies(x)
    if autocast_dtype is None:
        loss, metrics = _dpo(cls, x, **kw)
    else:
        with torch.autocast("cpu", dtype=autocast_dtype):
            loss, metrics = _dpo(cls, x, **kw)
    loss.backward()
    return [loss, metrics[0], metrics[1], x["hidden"].grad, x["weight"].grad, x["bias"].grad]


NAMES = ("loss", "chosen_logps", "rejected_logps", "grad_hidden", "grad_weight", "grad_bias")


def _rounded(x, dtype):
    """The inputs rounded to ``dtype`` and back to fp32: autocast's casts are then exact."""
    return {k: (v.to(dtype).float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()}


# 18 loss tokens per row: 16 splits rows (one pass with pairs longer than a chunk, or two passes), 64 holds one
# pair per chunk (one pass)
PATH_CHUNKS = pytest.mark.parametrize(
    ("token_chunk_size", "one_pass"),
    [(16, False), (16, True), (64, True)],
    ids=["two-pass", "one-pass-long", "one-pass"],
)


@PATH_CHUNKS
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_autocast_is_the_same_as_casting_by_hand(dtype, token_chunk_size, one_pass):
    """Under autocast the loss must compute exactly what it computes on inputs cast to the autocast dtype.

    The old code stored the log-sum-exp of half-precision logits in forward and recomputed fp32 logits in backward
    (autocast is off there), so its softmax rows did not sum to one.
    """
    x = _rounded(_dpo_inputs(torch.float32, w_scale=1.5), dtype)  # logits ~ N(0, 10^2)
    kw = dict(token_chunk_size=token_chunk_size, compute_nll_loss=True, one_pass=one_pass)
    auto = _loss_and_grads(ChunkedDPOLoss, x, autocast_dtype=dtype, **kw)
    hand = _loss_and_grads(
        ChunkedDPOLoss,
        {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()},
        **kw,
    )
    for name, a, b in zip(NAMES, auto, hand):
        err = (a.double() - b.double()).abs().max().item()
        scale = b.double().abs().max().item()
        # the hand-cast gradients are rounded to `dtype` at the end, the autocast ones are fp32: allow that rounding
        assert err <= 2**-7 * scale + 1e-6, f"{name}: autocast vs hand-cast differ by {err:.3g} (scale {scale:.3g})"


def _max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@PATH_CHUNKS
def test_autocast_bf16_error_at_most_liger_s(token_chunk_size, one_pass):
    """torch.autocast("cpu", bf16), logit scale ~10: our error vs the fp32 truth <= 1.5x Liger's (same autocast)."""
    liger = load_reference("dpo", "liger")
    if liger is None:
        pytest.skip("liger-kernel not installed")
    x = _rounded(_dpo_inputs(torch.float32, w_scale=1.5), torch.bfloat16)
    kw = dict(compute_nll_loss=True)
    truth = _loss_and_grads(liger, x, compiled=False, **kw)
    ours = _loss_and_grads(
        ChunkedDPOLoss, x, torch.bfloat16, token_chunk_size=token_chunk_size, one_pass=one_pass, **kw
    )
    ref = _loss_and_grads(liger, x, torch.bfloat16, compiled=False, **kw)
    bad = []
    for name, o, r, t in zip(NAMES, ours, ref, truth):
        e_o, e_r, scale = _max_err(o, t), _max_err(r, t), t.double().abs().max().item()
        print(f"autocast bf16 {name:15s} ours {e_o:.3g} ({e_o / scale:.2%})  Liger {e_r:.3g} ({e_r / scale:.2%})")
        if e_o > 1.5 * e_r + 1e-6 * scale:
            bad.append(f"{name}: ours {e_o:.3g} > 1.5 x Liger {e_r:.3g}")
    assert not bad, "\n".join(bad)


@PATH_CHUNKS
def test_autocast_kto_forward_backward_consistent(token_chunk_size, one_pass):
    x = _rounded(_dpo_inputs(torch.float32, batch=4, w_scale=1.5), torch.bfloat16)
    labels = torch.tensor([True, False, True, False])

    def run(inp, autocast):
        inp = leaf_copies(inp)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
        with ctx:
            fn = ChunkedKTOLoss(use_ref_model=True, token_chunk_size=token_chunk_size, one_pass=one_pass)
            loss, _ = call_kto(fn, inp, labels)
        loss.backward()
        return loss, inp["hidden"].grad, inp["weight"].grad

    auto = run(x, True)
    hand = run({k: (v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()}, False)
    for a, b in zip(auto, hand):
        assert _max_err(a, b) <= 2**-7 * b.double().abs().max().item() + 1e-6


# -------------------------------------------------------------------------------------------- chunk sizing


def test_default_chunk_is_a_memory_budget_per_device():
    r = _plan.resolve_token_chunk_size
    assert r(None, 32_000) == 1048  # CPU, fp32: 128 MiB of fp32 logits, as before
    assert r(None, 32_000, device="cpu", compute_dtype=torch.float32) == 1048
    # CPU bf16 (no fp32-output GEMM): the bf16 GEMM output is the only block, swept on an 8 MiB fp32 tile taken
    # from the same 128 MiB (issue #22; before: fp32 logits + the bf16 output, (128 << 20) // (32_000 * 6) = 699)
    assert r(None, 32_000, device="cpu", compute_dtype=torch.bfloat16) == (120 << 20) // (32_000 * 2) == 1966
    # with a bias the block sweep runs (the bias gradient sums the fp32 block): fp32 logits + the bf16 output
    assert r(None, 32_000, device="cpu", compute_dtype=torch.bfloat16, tiles=False) == (128 << 20) // (32_000 * 6)
    big = r(None, 151_936, device="cuda", compute_dtype=torch.bfloat16)
    assert 1024 <= big <= 2048, big  # 1 GiB on an accelerator: GEMMs of >1000 rows at Qwen's vocabulary
    assert r(7, 151_936, device="cuda") == 7  # token_chunk_size still overrides
    with pytest.raises(ValueError):
        r(0, 10)


# ------------------------------------------------------------------- the accelerator branch, emulated on CPU


def _emulate_fp32_output_gemm(monkeypatch):
    """Force the accelerator branch on CPU: ``_plan.fp32_out`` says yes for half dtypes,
    ``torch.mm/addmm(..., out_dtype=torch.float32)`` run as CUDA's ``aten::mm.dtype``/``addmm.dtype`` do (half
    inputs, fp32 products and accumulation: exact here, a bf16 x bf16 product is exact in fp32; other calls pass
    through), and the softmax takes its non-fused steps (max, exp, sum, a row scale folded in by the caller).
    Returns the count of emulated calls per function."""
    calls = {"mm": 0, "addmm": 0}
    real_mm, real_addmm = torch.mm, torch.addmm

    def mm(a, b, *, out_dtype=None, **kw):
        if out_dtype is None:
            return real_mm(a, b, **kw)
        assert out_dtype == torch.float32 and a.dtype == b.dtype and a.dtype in HALF and not kw, (a.dtype, kw)
        calls["mm"] += 1
        return real_mm(a.float(), b.float())

    def addmm(acc, a, b, *, out_dtype=None, out=None, **kw):
        if out_dtype is None:
            return real_addmm(acc, a, b, **kw) if out is None else real_addmm(acc, a, b, out=out, **kw)
        assert out_dtype == acc.dtype == torch.float32 and a.dtype == b.dtype and a.dtype in HALF and not kw
        assert out is acc, "the losses accumulate in place"
        calls["addmm"] += 1
        return out.addmm_(a.float(), b.float())

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(_plan, "fp32_out", lambda device, dtype: dtype in HALF)
    monkeypatch.setattr(_softmax, "fused_log_softmax", lambda device: False)
    return calls


def _step(x, token_chunk_size, one_pass, autocast):
    x = leaf_copies(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, metrics = _dpo(
            ChunkedDPOLoss, x, token_chunk_size=token_chunk_size, compute_nll_loss=True, one_pass=one_pass
        )
    path = "one-pass" if "OnePassLoss" in loss.grad_fn.name() else "two-pass"
    loss.backward()
    return path, [loss, metrics[0], metrics[1], x["hidden"].grad, x["weight"].grad, x["bias"].grad]


FAST_BOUND = 2**-7


@pytest.mark.parametrize(("token_chunk_size", "one_pass"), [(8, False), (8, True), (36, True), (None, True)], ids=str)
def test_fp32_against_an_fp64_truth(token_chunk_size, one_pass):
    """fp32 inputs, both paths, chunks that split rows or hold pairs whole: every quantity within 1e-5 of its scale
    from the fp64 truth (materialised logits, plain autograd, the formula written out in the test).  Measured:
    up to 2.5e-6 (grad-input); a loss or gradient scaled by 1.01 -- or by 1.0001 -- is off by 1e-2 / 1e-4."""
    x = _dpo_inputs(torch.float32, w_scale=1.0)
    truth = fp64_dpo_truth(x, compute_nll_loss=True)
    ours = _loss_and_grads(
        ChunkedDPOLoss, x, token_chunk_size=token_chunk_size, one_pass=one_pass, compute_nll_loss=True
    )
    for name, o, t in zip(NAMES, ours, truth):
        err, scale = _max_err(o, t), t.double().abs().max().item()
        assert err <= 1e-5 * scale, f"{name}: {err / scale:.2e} of the scale from the fp64 truth"


@pytest.mark.parametrize(("token_chunk_size", "one_pass"), [(8, False), (8, True), (36, True), (None, True)], ids=str)
def test_fp64_against_an_fp64_truth(token_chunk_size, one_pass):
    """fp64 inputs are computed in fp64 throughout (``_plan.math_dtype``: log-sum-exps, per-token log-probs, row
    sums, accumulators), on both paths: the loss is fp64 and every quantity within 2.5e-15 of its scale from the
    fp64 truth (measured: up to 1.3e-15, grad-input on the one-pass path with long pairs).  Before, the per-token
    log-probs and row sums were fp32: the loss came back fp32, 2e-8 to 1.6e-7 off."""
    x = _dpo_inputs(torch.float64, w_scale=1.0)
    truth = fp64_dpo_truth(x, compute_nll_loss=True)
    ours = _loss_and_grads(
        ChunkedDPOLoss, x, token_chunk_size=token_chunk_size, one_pass=one_pass, compute_nll_loss=True
    )
    assert ours[0].dtype == torch.float64
    for name, o, t in zip(NAMES, ours, truth):
        err, scale = _max_err(o, t), t.double().abs().max().item()
        assert err <= 2.5e-15 * scale, f"{name}: {err / scale:.2e} of the scale from the fp64 truth"


@pytest.mark.parametrize("probs", [True, False], ids=["probs", "logp-only"])
@pytest.mark.parametrize("fused", [True, False], ids=["cpu-fused", "max-exp-sum"])
def test_softmax_kernel_against_fp64_where_target_probabilities_underflow(monkeypatch, probs, fused):
    """``softmax_``, the sweep under both paths, both branches: logits ~ N(0, 60^2), so that most targets'
    probabilities are below fp32's smallest number (``exp(-104)``).  The CPU branch (fused ``_softmax``, issue #22)
    takes the log-sum-exp from the row's largest probability (``>= 1 / V``), never from the target's: target
    log-probs and log-sum-exps within 1e-6 of the logits' scale from fp64, the probabilities (times the returned
    row scale) within 1e-6.  Broken on purpose, ``lse = tgt - log(p[target])`` gives -inf here, and a log-prob
    scaled by 1.01 is off by ~4e-3 of the scale."""
    monkeypatch.setattr(_softmax, "fused_log_softmax", lambda device: fused)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1000, generator=g) * 60
    lab = torch.randint(0, 1000, (64, 1), generator=g)
    truth = torch.log_softmax(x.double(), 1)
    assert (truth.gather(1, lab) < -104).float().mean() > 0.5  # the case under test: most targets underflow

    logits = x.clone()
    logp, lse, k = _softmax.softmax_(logits, lab, probs=probs)
    scale = x.abs().max().item()
    assert _max_err(logp, truth.gather(1, lab).squeeze(1)) <= 1e-6 * scale
    assert _max_err(lse, torch.logsumexp(x.double(), 1)) <= 1e-6 * scale
    if probs:
        p = logits if k is None else logits * k.unsqueeze(1)
        assert _max_err(p, truth.exp()) <= 1e-6


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
@pytest.mark.parametrize("block", [7, 64, 300], ids=lambda b: f"vblock{b}")
@pytest.mark.parametrize(
    ("token_chunk_size", "one_pass", "path"),
    [(8, False, "two-pass"), (8, True, "one-pass"), (36, True, "one-pass"), (None, True, "one-pass")],
    ids=["two-pass", "one-pass-long", "one-pass", "one-chunk"],
)
def test_fp32_output_gemm_branch_matches_the_plain_path(monkeypatch, token_chunk_size, one_pass, path, block, autocast):
    """The CUDA branch (fp32-output GEMMs, vocabulary blocks, fp32 weight-gradient tile) on CPU, against the plain
    bf16 path and the fp32 truth: 4 sequences of 18 loss tokens, V = 300 in blocks of 7 / 64 / 300 rows, token
    chunks that split rows (two-pass, or one-pass with long pairs), hold one pair (one-pass, 2 chunks) or everything
    (one-pass, 1 chunk).

    The branch keeps the logits and every product in fp32 where the plain path rounds them to bf16: seen here, the
    branch is within 4e-3 of each quantity's scale from the truth, the plain path within 1e-2.  Required: the branch
    within 2^-7 of the truth, within 2^-6 of the plain path, and at most 1.5x the plain path's error; a wrong block
    offset, a lost tile or a missed accumulation is off by O(1)."""
    x = _rounded(_dpo_inputs(torch.float32, w_scale=1.0), torch.bfloat16)
    half = {k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()}
    inputs = x if autocast else half
    truth = fp64_dpo_truth(x, compute_nll_loss=True)  # not the code under test
    plain_path, plain = _step(inputs, token_chunk_size, one_pass, autocast)
    calls = _emulate_fp32_output_gemm(monkeypatch)
    monkeypatch.setattr(_plan, "vocab_block_rows", lambda V, H, budget: block)
    fast_path, fast = _step(inputs, token_chunk_size, one_pass, autocast)
    assert plain_path == fast_path == path
    # the branch ran: fp32 logits and grad-input, and an fp32 weight-gradient tile except where the one-pass path
    # adds into a bf16 result in place (addmm_)
    assert calls["mm"] > 0 and (calls["addmm"] > 0) != (path == "one-pass" and not autocast), calls
    bad = []
    for name, f, p, t in zip(NAMES, fast, plain, truth):
        scale = t.double().abs().max().item()
        e_fp, e_f, e_p = _max_err(f, p), _max_err(f, t), _max_err(p, t)
        print(f"{name:15s} |fast - truth| {e_f / scale:.2e}  |plain - truth| {e_p / scale:.2e}  of the scale")
        if e_f > FAST_BOUND * scale or e_fp > 2**-6 * scale or e_f > 1.5 * e_p + 1e-6 * scale:
            bad.append(f"{name}: |fast - plain| {e_fp:.3g}, |fast - truth| {e_f:.3g}, |plain - truth| {e_p:.3g}")
    assert not bad, "\n".join(bad)


# ------------------------------------------------------------------------ fp16: what GradScaler keeps (issue 31)

GRAD_SCALE = 2.0**13  # GradScaler's 2**16 after three halvings: the incoming gradient of the loss's backward


def _fp16_inputs(vocab, hidden=16, seed=0):
    """B = 4, L = 8 (2 prompt tokens), an LM head initialised as LMs are (std 0.02): softmax entries ~1 / V, so the
    weight gradient's non-target rows are ~beta / B / V, far below fp16's smallest normal number at scale 1."""
    g = torch.Generator().manual_seed(seed)
    x = dict(
        hidden=torch.randn(4, 8, hidden, generator=g),
        weight=torch.randn(vocab, hidden, generator=g) * 0.02,
        bias=None,
        ref_hidden=torch.randn(4, 8, hidden, generator=g),
        ref_weight=torch.randn(vocab, hidden, generator=g) * 0.02,
        ref_bias=None,
        target=torch.randint(0, vocab, (4, 8), generator=g),
    )
    x["target"][:, :2] = -100
    return _rounded(x, torch.float16)


def _fp16_grads(x, autocast, **kw):
    """``(path, grad_hidden, grad_weight)`` of one fp16 step (fp16 tensors, or fp32 ones under CPU fp16 autocast)
    with the loss scaled by ``GRAD_SCALE``, unscaled as GradScaler does."""
    x = leaf_copies(
        x if autocast else {k: (v.half() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()}
    )
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss, _ = _dpo(ChunkedDPOLoss, x, **kw)
    (loss * GRAD_SCALE).backward()
    path = "one-pass" if "OnePassLoss" in loss.grad_fn.name() else "two-pass"
    return path, x["hidden"].grad.double() / GRAD_SCALE, x["weight"].grad.double() / GRAD_SCALE


@pytest.mark.parametrize("autocast", [False, True], ids=["fp16", "autocast-fp16"])
def test_fp16_one_pass_keeps_what_grad_scaler_keeps(monkeypatch, autocast):
    """fp16 at V = 151,936 against an fp64 truth, the loss scaled by 2**13: the one-pass path (whole pairs per
    chunk, and pairs longer than a chunk) within 2x the two-pass path's error on the weight gradient's non-target
    rows (relative norm) and on grad-input, with at most 2x its entries flushed to zero (+2).

    Measured (H = 16): two-pass 2.9e-4, 9 entries flushed; one-pass 2.9e-4, 10 (fp16) / 3 (autocast) on this first
    call at the initial 2**16; long pairs 4.8e-4, 12 (fp16: their sums are rounded twice more) / 2.8e-4, 0
    (autocast).  Before (the forward at scale 1): 0.105 and 94,195 entries flushed, grad-input 6x the two-pass
    error (Liger 0.8.5: 0.104, 91,425).  Broken on purpose -- ``LossScale.of`` returning 1, as before -- every
    case fails; long pairs' sums stored at scale 1 (``pending = 1``): 2.4e-3, 8x the two-pass error, fails."""
    scale = _onepass.LossScale()  # a fresh one: GradScaler's first step; one for the losses of this run
    monkeypatch.setattr(_onepass, "scale_of", lambda loss: scale)
    x = _fp16_inputs(151_936)
    truth = fp64_dpo_truth(x)
    nt = torch.ones(151_936, dtype=torch.bool)
    nt[x["target"][x["target"] >= 0]] = False  # rows of no target: only softmax entries reach them

    def errors(grads):
        gh, gw = grads
        rel = ((gw[nt] - truth[4][nt]).norm() / truth[4][nt].norm()).item()
        flushed = int(((gw[nt] == 0) & (truth[4][nt] != 0)).sum())
        return rel, flushed, _max_err(gh, truth[3]) / truth[3].abs().max().item()

    path, *two = _fp16_grads(x, autocast, one_pass=False)
    assert path == "two-pass"
    e_two = errors(two)
    bad = []
    for name, kw in (("one-pass", {}), ("one-pass, long pairs", dict(token_chunk_size=4))):
        path, *one = _fp16_grads(x, autocast, **kw)
        assert path == "one-pass"
        e_one = errors(one)
        print(f"{name}: non-target rows {e_one[0]:.3g} ({e_one[1]} flushed), grad-input {e_one[2]:.3g}; "
              f"two-pass {e_two[0]:.3g} ({e_two[1]} flushed), {e_two[2]:.3g}")  # fmt: skip
        if e_one[0] > 2 * e_two[0] or e_one[1] > 2 * e_two[1] + 2 or e_one[2] > 2 * e_two[2]:
            bad.append(f"{name}: {e_one} vs two-pass {e_two}")
    assert not bad, "\n".join(bad)
    assert scale.value == GRAD_SCALE  # the next forward stores at GradScaler's scale


def test_fp16_gradients_that_overflow_the_stored_scale_are_recomputed(monkeypatch):
    """A stored scale far above GradScaler's (as after a run of halvings): the one-pass gradients overflow fp16, so
    the backward recomputes them from the incoming gradient as the two-pass path does (once), and the next call
    stores at GradScaler's scale (no recompute)."""
    from liger_ddp_patch.losses import _twopass

    scale = _onepass.LossScale()
    scale.value = 2.0**40
    monkeypatch.setattr(_onepass, "scale_of", lambda loss: scale)
    calls = []
    real = _twopass.backward_chunks
    monkeypatch.setattr(_twopass, "backward_chunks", lambda *a: calls.append(1) or real(*a))
    x = _fp16_inputs(300, hidden=16)
    _, *two = _fp16_grads(x, False, one_pass=False, token_chunk_size=4)  # the two-pass path: one call
    assert len(calls) == 1
    for recomputed in (1, 0):  # overflow at 2**40: recomputed; then at 2**13: as stored
        before = len(calls)
        _, *one = _fp16_grads(x, False, token_chunk_size=4)
        for a, b in zip(one, two):
            assert torch.isfinite(a).all() and _max_err(a, b) <= 2**-9 * b.abs().max().item()
        assert len(calls) - before == recomputed and scale.value == GRAD_SCALE


def test_fp16_stored_scale_follows_the_incoming_gradient(monkeypatch):
    """The stored scale is the last fp16 backward's incoming gradient rounded down to a power of two, from any
    value (1: no GradScaler yet); a zero incoming gradient leaves it; bf16 stores at none."""
    scale = _onepass.LossScale()
    monkeypatch.setattr(_onepass, "scale_of", lambda loss: scale)
    x = _fp16_inputs(300, hidden=16)
    for before, incoming, after in ((1.0, GRAD_SCALE, GRAD_SCALE), (GRAD_SCALE, 3 * 2.0**10, 2.0**11), (4.0, 0.0, 4.0)):
        scale.value = before
        y = leaf_copies({k: (v.half() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()})
        loss, _ = _dpo(ChunkedDPOLoss, y)
        (loss * incoming).backward()
        assert scale.value == after, (before, incoming, scale.value)
    y = leaf_copies({k: (v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()})
    loss, _ = _dpo(ChunkedDPOLoss, y)
    (loss * GRAD_SCALE).backward()
    assert scale.value == 4.0 and _onepass.LossScale().of(_plan.Plan.of(y["hidden"], y["weight"], None)) is None

"""Parity of ChunkedDPOLoss / ChunkedKTOLoss with the fused losses they replace.

References (each part skips when its reference is not importable):
  * liger-kernel 0.8.5 ``LigerFusedLinearDPOLoss`` / ``LigerFusedLinearKTOLoss`` with ``compiled=False``;
  * TRL 1.13's vendored ``trl.losses.FusedLinearDPOLoss`` / ``FusedLinearKTOLoss``: CI pins trl 1.12.0, which has
    no ``trl.losses``, so the ``trl113`` cases skip in this process and ``test_trl_1_13_reference_cases`` reruns
    them (and the trl113 error-parity cases of test_losses_guard.py) in a subprocess with the 1.13.0 release that
    ``.ci/trl_matrix.sh --prepare-only`` unpacks first on ``PYTHONPATH``;
  * a materialised-logits reference written here (always runs).

fp32 tolerance: rtol = atol = 1e-5, atol scaled by the reference tensor's magnitude when that exceeds 1 (see
``_loss_cases.close``; only sppo_hard's O(10) gradients need it). Both sides evaluate the same fp32 math and differ
only in reduction order (chunked GEMMs, in-place log-sum-exp vs ``log_softmax``, ``index_add`` vs masked row sums,
one fp32 weight-grad accumulator vs per-chunk ``torch.func`` grads); with the O(1)-O(10) magnitudes used here those
differences are ~1e-7-1e-6 absolute, so 1e-5 is tight enough to catch any formula/normalisation/masking error (which
show up at >= 1e-3) while not flaking on summation order.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zlib

import pytest
import torch
from _loss_cases import DPO_LOSS_TYPES, IGNORE, call_kto, close, leaf_copies, load_reference, make_inputs, make_target

from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss
from liger_ddp_patch.losses._twopass import token_logprobs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL = ATOL = 1e-5
FP64_TOL = 5e-16  # fp64 inputs, fp64 math: about 2x the measured error (test_core_against_materialised_logits)
TINY_CHUNK = 4  # < L=13: every sequence is split across token chunks (one pass with long pairs / rows; two passes)
# >= the tokens of any pair (2 L) / row (L): whole pairs/rows per chunk, several chunks per batch (one-pass path)
PAIR_CHUNK, ROW_CHUNK = 2 * 13, 13

REFS = ["liger", "trl113"]
DPO_METRICS = (
    "chosen_logps",
    "rejected_logps",
    "chosen_logits_mean",
    "rejected_logits_mean",
    "nll_loss",
    "chosen_rewards",
    "rejected_rewards",
)
KTO_METRICS = (
    "chosen_logps_sum",
    "rejected_logps_sum",
    "chosen_logits_sum",
    "rejected_logits_sum",
    "chosen_rewards_sum",
    "rejected_rewards_sum",
)

MAX_ERR: dict = {}  # (reference, quantity) -> max |ours - ref| seen; printed by benchmarks/loss_errors.py


def _ref_cls(kind, which):
    cls = load_reference(kind, which)
    if cls is None:
        pytest.skip(f"{which} {kind} reference not importable")
    return cls


def _record(tag, name, err):
    key = (tag, name)
    MAX_ERR[key] = max(MAX_ERR.get(key, 0.0), err)


def _compare(tag, names, ours, ref, rtol=RTOL, atol=ATOL):
    bad = []
    for name, a, b in zip(names, ours, ref):
        if b is None and a is None:
            continue
        assert a is not None and b is not None, f"{name}: one side is None"
        if not torch.is_tensor(b):
            b = torch.tensor(b)
        ok, err = close(a, b, rtol, atol)
        _record(tag, name, err)
        if not ok:
            head = f"(ours {a.flatten()[:4].tolist()}, ref {b.flatten()[:4].tolist()})"
            bad.append(f"{name}: max abs err {err:.3g} {head}")
    assert not bad, "\n".join(bad)


def _run_dpo(cls, kwargs, inp, scale=1.0):  # kwargs may carry our own one_pass=False (two-pass path)
    x = leaf_copies(inp)
    loss_fn = cls(**kwargs)
    loss, metrics = loss_fn(
        x["weight"], x["hidden"], x["target"], x["bias"], x["ref_hidden"], x["ref_weight"], x["ref_bias"]
    )
    (loss * scale).backward()
    grads = (x["hidden"].grad, x["weight"].grad, None if x["bias"] is None else x["bias"].grad)
    return loss, metrics, grads


def _run_kto(cls, kwargs, inp, labels, kl):
    x = leaf_copies(inp)
    loss, metrics = call_kto(cls(**kwargs), x, labels, kl)
    loss.backward()
    grads = (x["hidden"].grad, x["weight"].grad, None if x["bias"] is None else x["bias"].grad)
    return loss, metrics, grads


def _dpo_kwargs(loss_type, **kw):
    out = dict(loss_type=loss_type, label_smoothing={"exo_pair": 1e-3, "robust": 0.1}.get(loss_type, 0.0), beta=0.2)
    out.update(kw)
    return out


def _path(loss):
    """Which path made the loss: "one-pass" (gradients in the forward, ``_onepass``) or "two-pass"."""
    return "one-pass" if "OnePassLoss" in loss.grad_fn.name() else "two-pass"


def _variants(token_chunk_size, whole):
    """``(token_chunk_size, one_pass)`` runs: the given chunk on both paths and, when that splits groups, whole
    groups per chunk (``whole`` tokens) on the one-pass path."""
    return dict.fromkeys(
        [(token_chunk_size, True), (token_chunk_size, False), (max(whole, token_chunk_size or 0), True)]
    )


def _check_dpo(which, kwargs, inp, token_chunk_size=TINY_CHUNK, scale=1.0, tag=None):
    """Ours against the reference at ``token_chunk_size`` on both paths (one pass, two passes) and, when that chunk
    splits pairs, at whole pairs per chunk, checking which path ran."""
    ref_cls = _ref_cls("dpo", which)
    ref = _run_dpo(ref_cls, dict(kwargs, compiled=False), inp, scale)
    tag = tag or f"dpo-{which}"
    pair_tokens = int((inp["target"] != kwargs.get("ignore_index", IGNORE)).sum(1).view(2, -1).sum(0).max())
    for tcs, one_pass in _variants(token_chunk_size, max(PAIR_CHUNK, pair_tokens)):
        ours = _run_dpo(ChunkedDPOLoss, dict(kwargs, token_chunk_size=tcs, one_pass=one_pass), inp, scale)
        assert _path(ours[0]) == ("one-pass" if one_pass else "two-pass"), (tcs, pair_tokens, ours[0].grad_fn)
        assert len(ours[1]) == len(ref[1]) == 7
        for a, b in zip(ours[1], ref[1]):
            assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
            assert not a.requires_grad
        assert ours[0].dtype == ref[0].dtype and ours[0].shape == ref[0].shape
        _compare(tag, ("loss",), (ours[0],), (ref[0],))
        _compare(tag, DPO_METRICS, ours[1], ref[1])
        _compare(tag, ("grad_hidden", "grad_weight", "grad_bias"), ours[2], ref[2])
    return ours, ref


# --------------------------------------------------------------------------------------------------- DPO


@pytest.mark.parametrize("which", REFS)
@pytest.mark.parametrize("mode", ["sum", "avg_nll"])
@pytest.mark.parametrize("use_ref", [True, False], ids=["ref", "noref"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_dpo_parity(loss_type, bias, use_ref, mode, which):
    avg = mode == "avg_nll"
    # average_log_prob on a fully-ignored row is 0/0 = NaN on both sides -> separate test below
    inp = make_inputs(
        bias=bias, fully_ignored_row=not avg, seed=zlib.crc32(f"{loss_type}{bias}{use_ref}".encode()) % 1000
    )
    kwargs = _dpo_kwargs(loss_type, use_ref_model=use_ref, average_log_prob=avg, compute_nll_loss=avg, alpha=0.7)
    _check_dpo(which, kwargs, inp)


@pytest.mark.parametrize("which", REFS)
@pytest.mark.parametrize("token_chunk_size", [1, 2, 5, 13, 64, None])
def test_dpo_token_chunk_sizes(token_chunk_size, which):
    inp = make_inputs(seed=7)
    kwargs = _dpo_kwargs("sigmoid", compute_nll_loss=True, alpha=0.5, label_smoothing=0.0)
    _check_dpo(which, kwargs, inp, token_chunk_size=token_chunk_size)


@pytest.mark.parametrize("which", REFS)
def test_dpo_nondefault_ignore_index_and_grad_scale(which):
    inp = make_inputs(seed=3, ignore_index=-1)
    kwargs = _dpo_kwargs("discopop", ignore_index=-1, discopop_tau=0.3, compute_nll_loss=True)
    _check_dpo(which, kwargs, inp, scale=2.5)  # upstream grad != 1 is honoured


@pytest.mark.parametrize("which", REFS)
def test_dpo_single_pair_and_larger_vocab(which):
    inp = make_inputs(batch=2, seq_len=9, vocab=211, hidden=24, seed=11, fully_ignored_row=False)
    _check_dpo(which, _dpo_kwargs("sigmoid", average_log_prob=True), inp, token_chunk_size=3)


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("token_chunk_size", [TINY_CHUNK, PAIR_CHUNK])
def test_dpo_average_fully_ignored_row_is_nan_like_liger(token_chunk_size, one_pass):
    ref_cls = _ref_cls("dpo", "liger")
    inp = make_inputs(seed=5, fully_ignored_row=True)
    kwargs = _dpo_kwargs("sigmoid", average_log_prob=True)
    ours = _run_dpo(ChunkedDPOLoss, dict(kwargs, token_chunk_size=token_chunk_size, one_pass=one_pass), inp)
    ref = _run_dpo(ref_cls, dict(kwargs, compiled=False), inp)
    _compare("dpo-liger-nan", ("loss",), (ours[0],), (ref[0],))
    _compare("dpo-liger-nan", DPO_METRICS, ours[1], ref[1])
    assert torch.isnan(ours[0])


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("token_chunk_size", [TINY_CHUNK, PAIR_CHUNK])
def test_dpo_only_weight_requires_grad_and_no_grad_mode(token_chunk_size, one_pass):
    ref_cls = _ref_cls("dpo", "liger")
    inp = make_inputs(seed=9)
    kwargs = _dpo_kwargs("sigmoid", compute_nll_loss=True)
    res = []
    ours_kw = dict(token_chunk_size=token_chunk_size, one_pass=one_pass)
    for cls, extra in ((ChunkedDPOLoss, ours_kw), (ref_cls, dict(compiled=False))):
        w = inp["weight"].clone().requires_grad_(True)
        loss, metrics = cls(**kwargs, **extra)(
            w, inp["hidden"], inp["target"], inp["bias"], inp["ref_hidden"], inp["ref_weight"], inp["ref_bias"]
        )
        loss.backward()
        with torch.no_grad():
            loss_ng, metrics_ng = cls(**kwargs, **extra)(
                w, inp["hidden"], inp["target"], inp["bias"], inp["ref_hidden"], inp["ref_weight"], inp["ref_bias"]
            )
        res.append((loss, metrics, w.grad, loss_ng, metrics_ng))
    (a, b) = res
    _compare("dpo-liger-wonly", ("loss", "grad_weight", "loss_nograd"), (a[0], a[2], a[3]), (b[0], b[2], b[3]))
    _compare("dpo-liger-wonly", DPO_METRICS, a[4], b[4])


@pytest.mark.parametrize(
    ("token_chunk_size", "one_pass"),
    [(TINY_CHUNK, False), (TINY_CHUNK, True), (PAIR_CHUNK, True), (None, True)],
    ids=["two-pass", "one-pass-long", "one-pass", "one-chunk"],
)
def test_bf16_dpo_against_fp32_truth(token_chunk_size, one_pass):
    """bf16 inputs: our result vs the fp32 truth (Liger fp32 on the same bf16-representable values).

    Tolerance: the GEMM inputs are bf16 (8-bit mantissa, unit round-off 2^-9 ~ 2e-3) and the per-chunk GEMM
    *outputs* are rounded to bf16 before the fp32 softmax/accumulation, so per-token log-probs carry relative
    errors of a few 1e-3 of the logit scale; summed over ~10 tokens and pushed through the loss we allow 3e-2
    relative (+3e-2 absolute for quantities near 0).  We also require our bf16 error to be no worse than 1.5x
    Liger's own bf16 error (Liger keeps logits and its weight-grad accumulator in bf16).
    """
    ref_cls = _ref_cls("dpo", "liger")
    inp32 = make_inputs(seed=21, bias=True)
    inp16 = {k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inp32.items()}
    inp32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inp16.items()}
    kwargs = _dpo_kwargs("sigmoid", compute_nll_loss=True)
    truth = _run_dpo(ref_cls, dict(kwargs, compiled=False), inp32)
    ours = _run_dpo(ChunkedDPOLoss, dict(kwargs, token_chunk_size=token_chunk_size, one_pass=one_pass), inp16)
    assert _path(ours[0]) == ("one-pass" if one_pass else "two-pass")
    liger16 = _run_dpo(ref_cls, dict(kwargs, compiled=False), inp16)
    assert ours[0].dtype == liger16[0].dtype == torch.float32
    for g_o, g_l in zip(ours[2], liger16[2]):
        assert g_o.dtype == g_l.dtype == torch.bfloat16
    names = ("loss",) + DPO_METRICS + ("grad_hidden", "grad_weight", "grad_bias")
    flat = lambda r: (r[0],) + tuple(r[1]) + tuple(r[2])  # noqa: E731
    _compare("dpo-bf16-vs-fp32", names, flat(ours), flat(truth), rtol=3e-2, atol=3e-2)
    for name, o, l_, t in zip(names, flat(ours), flat(liger16), flat(truth)):
        e_ours = (o.double() - t.double()).abs().max().item()
        e_lig = (l_.double() - t.double()).abs().max().item()
        scale = t.double().abs().max().item()
        print(f"bf16 {name}: ours {e_ours:.3g} liger-bf16 {e_lig:.3g} (|truth|max {scale:.3g})")
        assert e_ours <= 1.5 * e_lig + 1e-3 * scale, f"{name}: ours {e_ours:.3g} vs liger bf16 {e_lig:.3g}"


# --------------------------------------------------------------------------------------------------- KTO


def _kto_labels(batch):
    return torch.tensor([(i % 3) != 1 for i in range(batch)])


@pytest.mark.parametrize("which", REFS)
@pytest.mark.parametrize("kl_kind", ["none", "scalar", "one", "vector"])
@pytest.mark.parametrize("avg", [False, True], ids=["sum", "avg"])
@pytest.mark.parametrize("use_ref", [True, False], ids=["ref", "noref"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_kto_parity(bias, use_ref, avg, kl_kind, which):
    ref_cls = _ref_cls("kto", which)
    batch = 5
    inp = make_inputs(batch=batch, bias=bias, fully_ignored_row=not avg, seed=31 + bias + 2 * use_ref)
    labels = _kto_labels(batch)
    # "one": a (1,) kl, as Liger's own KTO tests pass it and TRL 1.12 builds it without a KL term (issue 31: taken
    # per row, rows 1+ lost their term on both paths)
    kl = {
        "none": None,
        "scalar": torch.tensor(0.37),
        "one": torch.tensor([0.37]),
        "vector": torch.linspace(-0.5, 0.5, batch),
    }[kl_kind]
    kwargs = dict(beta=0.3, use_ref_model=use_ref, average_log_prob=avg)
    variants = _variants(TINY_CHUNK, ROW_CHUNK)
    runs = [
        _run_kto(ChunkedKTOLoss, dict(kwargs, token_chunk_size=tcs, one_pass=one), inp, labels, kl)
        for tcs, one in variants
    ]
    assert [_path(r[0]) for r in runs] == ["one-pass", "two-pass", "one-pass"]
    # A per-row (B,) kl is not chunked by the fused losses: each row chunk broadcasts its (1,) log-ratio against
    # the whole (B,) kl, so their result depends on chunk_size.  TRL only ever passes a scalar kl.  We apply a
    # (B,) kl row-wise, which is what the fused losses compute when the whole batch is one chunk.
    ref_chunk = dict(chunk_size=batch) if kl_kind == "vector" else {}
    ref = _run_kto(ref_cls, dict(kwargs, compiled=False, **ref_chunk), inp, labels, kl)
    tag = f"kto-{which}"
    for ours in runs:
        assert len(ours[1]) == len(ref[1]) == 6
        for a, b in zip(ours[1], ref[1]):
            assert a.shape == b.shape and a.dtype == b.dtype
        _compare(tag, ("loss",), (ours[0],), (ref[0],))
        _compare(tag, KTO_METRICS, ours[1], ref[1])
        _compare(tag, ("grad_hidden", "grad_weight", "grad_bias"), ours[2], ref[2])


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
def test_kto_kl_of_one_element_is_one_value_for_every_row(one_pass):
    """A 0-dim, ``(1,)``, ``(1, 1)`` or Python-float kl is one value for every row: the same loss and gradients,
    and every row has a gradient (a ``(1,)`` kl sliced per row left rows 1+ at exactly 0, issue 31)."""
    inp = make_inputs(batch=5, seed=33, fully_ignored_row=False)
    labels = _kto_labels(5)
    kw = dict(beta=0.3, use_ref_model=True, token_chunk_size=ROW_CHUNK, one_pass=one_pass)
    runs = [
        _run_kto(ChunkedKTOLoss, kw, inp, labels, kl) for kl in (0.37, torch.tensor([0.37]), torch.full((1, 1), 0.37))
    ]
    base = _run_kto(ChunkedKTOLoss, kw, inp, labels, torch.tensor(0.37))
    assert _path(base[0]) == ("one-pass" if one_pass else "two-pass")
    assert all(base[2][0][r].abs().sum() > 0 for r in range(5))
    for run in runs:
        _compare(
            "kto-kl-forms", ("loss", "grad_hidden", "grad_weight", "grad_bias"), (run[0], *run[2]), (base[0], *base[2])
        )


@pytest.mark.parametrize("kl", [torch.zeros(2), torch.zeros(5, 1), torch.zeros(1, 5), torch.zeros(6)], ids=str)
def test_kto_kl_of_another_shape_is_refused(kl):
    """A kl that is neither one value nor one per row: a clear ValueError (the fused losses broadcast it against a
    chunk of rows and add up terms of the wrong rows)."""
    x = leaf_copies(make_inputs(batch=5, seed=33))
    with pytest.raises(ValueError, match=r"kl must be a scalar, a one-element tensor or a \(B,\) tensor with B = 5"):
        call_kto(ChunkedKTOLoss(use_ref_model=True), x, _kto_labels(5), kl)


@pytest.mark.parametrize("which", REFS)
def test_kto_noncontiguous_input_like_trl(which):
    """TRL's KTOTrainer passes ``last_hidden_state[:, :-1]`` (a non-contiguous view)."""
    ref_cls = _ref_cls("kto", which)
    inp = make_inputs(batch=4, seq_len=14, seed=41)
    for k in ("hidden", "ref_hidden"):
        inp[k] = inp[k][:, :-1]
    inp["target"] = make_target(4, 13, inp["weight"].shape[0], seed=41)
    labels = torch.tensor([True, False, False, True])
    ref = _run_kto(ref_cls, dict(use_ref_model=True, compiled=False), inp, labels, torch.tensor(0.1))
    for tcs, one in _variants(3, ROW_CHUNK):
        kw = dict(use_ref_model=True, token_chunk_size=tcs, one_pass=one)
        ours = _run_kto(ChunkedKTOLoss, kw, inp, labels, torch.tensor(0.1))
        assert _path(ours[0]) == ("one-pass" if one else "two-pass")
        _compare(f"kto-{which}", ("loss",) + KTO_METRICS, (ours[0],) + tuple(ours[1]), (ref[0],) + tuple(ref[1]))
        _compare(f"kto-{which}", ("grad_hidden", "grad_weight", "grad_bias"), ours[2], ref[2])


# ------------------------------------------------------------------------------------ core, no reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_core_against_materialised_logits(chunk, dtype):
    """Always runs (no Liger/TRL needed): per-token log-probs and all grads vs log_softmax on full logits.

    fp64 inputs are computed in fp64 throughout (log-sum-exps, per-token log-probs, accumulators): measured here
    within 2.3e-16 of the fp64 reference (``close``'s measure; up to 3.1e-16 over other draws of ``coef``), so the
    bound is 5e-16.  Before, the log-probs were stored in fp32 and were 3.3e-8 off, which this bound fails."""
    inp = make_inputs(seed=51, bias=True)
    target = inp["target"]
    h1 = inp["hidden"].to(dtype).requires_grad_(True)
    w1 = inp["weight"].to(dtype).requires_grad_(True)
    b1 = inp["bias"].to(dtype).requires_grad_(True)
    h2, w2, b2 = (t.detach().clone().requires_grad_(True) for t in (h1, w1, b1))
    coef = torch.randn(target.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tol = FP64_TOL if dtype == torch.float64 else 1e-5

    logp, rows, counts = token_logprobs(h1, w1, b1, target, IGNORE, chunk)
    (logp.double() * coef[rows]).sum().backward()

    mask = target != IGNORE
    lsm = torch.log_softmax((h2 @ w2.t() + b2).double(), dim=-1)
    tok = lsm.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    ((tok * mask) * coef[:, None]).sum().backward()

    assert torch.equal(counts, mask.sum(1))
    assert logp.dtype == dtype
    _compare("core", ("token_logp",), (logp,), (tok[mask],), rtol=tol, atol=tol)
    _compare(
        "core",
        ("grad_hidden", "grad_weight", "grad_bias"),
        (h1.grad, w1.grad, b1.grad),
        (h2.grad, w2.grad, b2.grad),
        rtol=tol,
        atol=tol,
    )
    assert torch.all(h1.grad[~mask] == 0)


# ------------------------------------------------------------------------------------------- TRL 1.13 in CI

TRL_DIRS = os.environ.get("LIGER_DDP_PATCH_TRL_DIRS", os.path.join(REPO_ROOT, ".cache", "trl"))


def test_trl_1_13_reference_cases():
    """The ``trl113`` cases against TRL 1.13's own ``trl.losses``, in a subprocess with that release first on the path.

    Fails (instead of skipping) when any case skips there, i.e. when TRL 1.13's losses did not import.
    """
    trl113 = os.path.join(TRL_DIRS, "1.13.0")
    if not os.path.isfile(os.path.join(trl113, "trl", "losses", "__init__.py")):
        if os.environ.get("CI"):
            pytest.fail(f"{trl113} missing: CI runs `bash .ci/trl_matrix.sh --prepare-only` before pytest")
        pytest.skip(f"{trl113} not unpacked (bash .ci/trl_matrix.sh --prepare-only)")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(p for p in (trl113, REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    )
    files = [os.path.join(REPO_ROOT, "tests", f) for f in ("test_losses_parity.py", "test_losses_guard.py")]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "trl113", *files],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=1800,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 120 and "skipped" not in summary, summary

"""The one-pass path of the chunked losses (``liger_ddp_patch/losses/_onepass.py``) beyond plain parity.

* which DPO loss types may take it (a loss that coupled pairs could not) and that they do, pairs longer than a
  token chunk included (``one_pass=False`` forces the two-pass path);
* ``grad_output`` other than 1, a loss called twice before one backward, ``retain_graph``, accumulation into an
  existing ``.grad`` -- all equal to the two-pass path, with whole pairs per chunk and with pairs longer than a
  chunk; double backward raises a clear error;
* the chunk plan of pairs longer than a chunk (long pairs first, each ends in a chunk of whole pairs);
* GEMM counts: three per policy token with a gradient (two with a frozen head), one without (eval / ``no_grad``);
* the accelerator branch (fp32-output GEMMs ``torch.mm/addmm(..., out_dtype=torch.float32)``, vocabulary blocks,
  the fp32 weight-gradient tile), forced on CPU with an emulation of ``out_dtype``, against the plain bf16 path.
"""

from __future__ import annotations

import pytest
import torch
from _loss_cases import DPO_LOSS_TYPES, IGNORE, call_kto, leaf_copies, make_inputs
from torch.utils._python_dispatch import TorchDispatchMode

from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss
from liger_ddp_patch.losses._onepass import group_chunks
from liger_ddp_patch.losses.dpo import ONE_PASS_DPO_LOSS_TYPES, dpo_preference_loss

LONG, WHOLE = 4, 26  # token chunks: every pair longer than a chunk / whole pairs of L=13 per chunk
SMOOTHING = {"exo_pair": 1e-3, "robust": 0.1}


def _path(loss):
    return "one-pass" if "OnePassLoss" in loss.grad_fn.name() else "two-pass"


def _dpo_loss(x, loss_type="sigmoid", **kw):
    fn = ChunkedDPOLoss(loss_type=loss_type, label_smoothing=SMOOTHING.get(loss_type, 0.0), beta=0.2, **kw)
    return fn(x["weight"], x["hidden"], x["target"], x["bias"], x["ref_hidden"], x["ref_weight"], x["ref_bias"])


def _grads(x):
    return [x[k].grad.clone() for k in ("hidden", "weight", "bias")]


def _assert_close(got, want, rtol=1e-5, what=""):
    for name, a, b in zip(("grad_hidden", "grad_weight", "grad_bias"), got, want):
        err = (a.double() - b.double()).abs().max().item()
        assert err <= rtol * max(1.0, b.double().abs().max().item()), f"{what} {name}: {err:.3g}"


# ----------------------------------------------------------------------------------------- which loss types


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_every_one_pass_loss_type_is_pair_separable(loss_type):
    """The one-pass path needs d loss / d logp of pair i to depend on pair i alone: move every other pair's
    log-probs (and the batch's other reference values) and pair 0's derivative must not change."""
    assert loss_type in ONE_PASS_DPO_LOSS_TYPES
    g = torch.Generator().manual_seed(DPO_LOSS_TYPES.index(loss_type))
    P = 5
    ref = torch.randn(2 * P, generator=g) * 3

    def d_pair0(seq):
        seq = seq.clone().requires_grad_(True)
        loss = dpo_preference_loss(
            seq[:P], seq[P:], ref[:P], ref[P:], P, 0.2, loss_type, SMOOTHING.get(loss_type, 0.0), 0.05
        )[0]
        (grad,) = torch.autograd.grad(loss, seq)
        return grad[[0, P]]

    seq = torch.randn(2 * P, generator=g) * 3
    base = d_pair0(seq)
    assert base.abs().sum() > 0 or loss_type == "hinge"
    for _ in range(3):
        moved = seq + torch.randn(2 * P, generator=g) * 5
        moved[[0, P]] = seq[[0, P]]
        assert torch.equal(d_pair0(moved), base), loss_type


@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)
def test_every_one_pass_loss_type_takes_it(loss_type):
    x = leaf_copies(make_inputs(seed=2))
    assert _path(_dpo_loss(x, loss_type, token_chunk_size=WHOLE)[0]) == "one-pass"
    assert _path(_dpo_loss(x, loss_type, token_chunk_size=LONG)[0]) == "one-pass"  # every pair > the chunk
    assert _path(_dpo_loss(x, loss_type, token_chunk_size=LONG, one_pass=False)[0]) == "two-pass"


def test_chunk_plan_puts_long_pairs_first_and_ends_each_in_a_chunk_of_its_own():
    """Pairs (rows 0 + 2, rows 1 + 3) of 11 and 3 loss tokens, chunk 4: the long pair goes first in two pending
    chunks (its rows' factors are not known yet), its last 3 tokens end it in a chunk that finishes it, and the
    short pair gets a chunk of its own (it does not fit beside them)."""
    counts = torch.tensor([5, 2, 6, 1])
    rows = torch.repeat_interleave(torch.arange(4), counts)
    order, plan = group_chunks(rows, torch.tensor([0, 1, 0, 1]), counts, 4)
    assert order.tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 5, 6, 13]
    assert plan == [
        (0, 4, [(0, 4, 0)], []),
        (4, 8, [(4, 5, 0), (5, 8, 2)], []),
        (8, 11, None, [(0, 5, 0), (5, 8, 2)]),
        (11, 14, None, []),
    ]
    _, whole = group_chunks(rows, torch.tensor([0, 1, 0, 1]), counts, 11)
    assert whole == [(0, 11, None, []), (11, 14, None, [])]


def test_chunk_plan_ends_a_long_pair_with_its_last_rows_whole_when_they_fit():
    """Pairs of 5 + 3 and 2 + 1 tokens, chunk 4: the rejected row (3) fits a chunk, so it is the long pair's last
    chunk and needs no sum; only the chosen row is pending (a chunk of 4, then of 1).  The short pair (3) does not
    fit beside it.  With chunk 6 the short pair (3) joins a last chunk of 3 (6 in all)."""
    counts = torch.tensor([5, 2, 3, 1])
    rows = torch.repeat_interleave(torch.arange(4), counts)
    _, plan = group_chunks(rows, torch.tensor([0, 1, 0, 1]), counts, 4)
    assert plan == [
        (0, 4, [(0, 4, 0)], []),
        (4, 5, [(4, 5, 0)], []),
        (5, 8, None, [(0, 5, 0)]),
        (8, 11, None, []),
    ]
    _, plan = group_chunks(rows, torch.tensor([0, 1, 0, 1]), counts, 6)
    assert plan == [(0, 5, [(0, 5, 0)], []), (5, 11, None, [(0, 5, 0)])]


# --------------------------------------------------------------------------------------- autograd contracts


def _two_pass_grads(seed, scale=1.0, **kw):
    x = leaf_copies(make_inputs(seed=seed))
    loss, _ = _dpo_loss(x, token_chunk_size=LONG, one_pass=False, **kw)
    (loss * scale).backward()
    return _grads(x)


CHUNKS = pytest.mark.parametrize("chunk", [WHOLE, LONG], ids=["whole-pairs", "long-pairs"])


@CHUNKS
def test_grad_output_other_than_one_and_accumulation(chunk):
    want = _two_pass_grads(1, compute_nll_loss=True)
    x = leaf_copies(make_inputs(seed=1))
    loss, _ = _dpo_loss(x, token_chunk_size=chunk, compute_nll_loss=True)
    assert _path(loss) == "one-pass"
    (loss * 2.5).backward()  # loss scaling
    _assert_close(_grads(x), [2.5 * w for w in want], what="x2.5")
    loss, _ = _dpo_loss(x, token_chunk_size=chunk, compute_nll_loss=True)
    (loss * -0.5).backward()  # accumulates into the existing .grad
    _assert_close(_grads(x), [2.0 * w for w in want], what="x2.5 - x0.5")


@CHUNKS
def test_loss_called_twice_before_one_backward(chunk):
    want = _two_pass_grads(4, compute_nll_loss=True)
    x = leaf_copies(make_inputs(seed=4))
    a, _ = _dpo_loss(x, token_chunk_size=chunk, compute_nll_loss=True)
    b, _ = _dpo_loss(x, token_chunk_size=None, compute_nll_loss=True)
    assert _path(a) == _path(b) == "one-pass"
    (a + 3 * b).backward()
    _assert_close(_grads(x), [4 * w for w in want], what="a + 3 b")


@CHUNKS
def test_retain_graph_backward_twice(chunk):
    want = _two_pass_grads(6)
    x = leaf_copies(make_inputs(seed=6))
    loss, _ = _dpo_loss(x, token_chunk_size=chunk)
    loss.backward(retain_graph=True)
    _assert_close(_grads(x), want, what="first")
    (2 * loss).backward()  # the stored gradients were handed over: recomputed by the two-pass core
    _assert_close(_grads(x), [3 * w for w in want], what="first + 2 x second")


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_double_backward_raises_a_clear_error(kind):
    x = leaf_copies(make_inputs(seed=8))
    if kind == "dpo":
        loss, _ = _dpo_loss(x, token_chunk_size=WHOLE)
    else:
        loss, _ = call_kto(ChunkedKTOLoss(token_chunk_size=13), x, torch.tensor([True, False] * 3))
    assert _path(loss) == "one-pass"
    with pytest.raises(RuntimeError, match="double backward.*create_graph"):
        torch.autograd.grad(loss, x["hidden"], create_graph=True)


# --------------------------------------------------------------------------------------------- GEMM counts


class CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.gemms = self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket
        if op in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[:2] if op is torch.ops.aten.mm else args[1:3]
            self.gemms += 1
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


def _count(x, grad, **kw):
    with CountGemms() as mode:
        if grad:
            loss, _ = _dpo_loss(x, **kw)
            loss.backward()
        else:
            with torch.no_grad():
                loss, _ = _dpo_loss(x, **kw)
    return mode.gemms, loss


@pytest.mark.parametrize(("frozen_weight", "grad", "per_chunk"), [(False, True, 3), (True, True, 2), (False, False, 1)])
def test_gemms_per_policy_chunk(frozen_weight, grad, per_chunk):
    """3 GEMMs per policy chunk with a gradient (logits, grad-input, grad-weight), 2 with a frozen head (LoRA),
    1 in eval; the reference model adds 1 per reference chunk.  Whole batch in one chunk: 1 + per_chunk."""
    x = leaf_copies(make_inputs(seed=12, bias=False))
    if frozen_weight:
        x["weight"].requires_grad_(False)
    gemms, loss = _count(x, grad, token_chunk_size=None)
    assert gemms == 1 + per_chunk, gemms
    if grad:
        assert _path(loss) == "one-pass"
        y = leaf_copies(make_inputs(seed=12, bias=False))
        y["weight"].requires_grad_(not frozen_weight)
        _dpo_loss(y, token_chunk_size=LONG, one_pass=False)[0].backward()
        assert (x["weight"].grad is None) == frozen_weight
        for k in ("hidden",) + (() if frozen_weight else ("weight",)):
            torch.testing.assert_close(x[k].grad, y[k].grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("frozen_weight", "per_token"), [(False, 3), (True, 2)])
def test_gemm_work_with_pairs_longer_than_a_chunk(frozen_weight, per_token):
    """Pairs longer than the chunk: the weight-gradient GEMM of a pending chunk is split by row, but the work is
    still 3 (frozen head: 2) token x V x H products per policy token, plus 1 per reference token."""
    x = leaf_copies(make_inputs(seed=13, bias=False))
    x["weight"].requires_grad_(not frozen_weight)
    tokens = int((x["target"] != IGNORE).sum())
    V, H = x["weight"].shape
    with CountGemms() as mode:
        loss, _ = _dpo_loss(x, token_chunk_size=LONG)
        loss.backward()
    assert _path(loss) == "one-pass"
    assert mode.flops == (per_token + 1) * 2 * tokens * V * H, (mode.flops, tokens, V, H)

"""The one-pass path of the chunked losses (``liger_ddp_patch/losses/_onepass.py``) beyond plain parity.

* the per-group interface (``_base``): every DPO loss type the code supports and KTO give a group's gradient that
  does not move when every other group's inputs move; a loss that couples groups cannot be written as per-group
  terms, and one written as a whole-batch loss takes the two-pass path, with the reason;
* every supported DPO loss type takes the one-pass path, pairs longer than a token chunk included
  (``one_pass=False`` forces the two-pass path);
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
from liger_ddp_patch.losses._base import ChunkedLinearLoss
from liger_ddp_patch.losses._onepass import group_chunks

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


def _moved(x, rows, g):
    """``x`` with the hidden states (policy and reference) of ``rows`` redrawn, larger."""
    y = {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in x.items()}
    for k in ("hidden", "ref_hidden"):
        y[k][rows] = torch.randn(y[k][rows].shape, generator=g) * 3
    return leaf_copies(y)


def _group_grad(run, x, rows):
    loss = run(x)
    loss.backward()
    return loss, x["hidden"].grad[rows].clone()


@pytest.mark.parametrize("token_chunk_size", [LONG, WHOLE], ids=["long-pairs", "whole-pairs"])
@pytest.mark.parametrize("loss_type", DPO_LOSS_TYPES)  # the code's own list: a new type is tested here too
def test_a_pairs_gradient_reads_only_its_own_pair(loss_type, token_chunk_size):
    """Through the loss the code runs (one pass, NLL term on), for every pair in turn (the one-pass path forms the
    first pairs' gradients before the later pairs' sums exist, the last ones after): redraw every other pair's policy
    and reference hidden states and this pair's gradient must not move; the batch constants (P, the chosen-token
    count) are the same.  Coupling pairs (a term that read the batch mean of the sums) would move it."""
    x = leaf_copies(make_inputs(seed=21, fully_ignored_row=False))
    P = x["target"].shape[0] // 2

    def run(inp):
        loss, _ = _dpo_loss(inp, loss_type, token_chunk_size=token_chunk_size, compute_nll_loss=True)
        assert _path(loss) == "one-pass"
        return loss

    g = torch.Generator().manual_seed(5)
    for pair in range(P):
        rows = [pair, pair + P]
        loss, base = _group_grad(run, leaf_copies(x), rows)
        assert base.abs().sum() > 0 or loss_type == "hinge"
        moved_loss, grad = _group_grad(run, _moved(x, [r for r in range(2 * P) if r not in rows], g), rows)
        assert not torch.isclose(moved_loss, loss), "the other pairs did not move"
        torch.testing.assert_close(grad, base, rtol=1e-5, atol=1e-7, msg=f"{loss_type}: pair {pair} moved")


@pytest.mark.parametrize("token_chunk_size", [4, 13], ids=["long-rows", "whole-rows"])
@pytest.mark.parametrize("kl", [None, 0.3], ids=["no-kl", "kl"])
def test_a_kto_rows_gradient_reads_only_its_own_row(token_chunk_size, kl):
    """KTO's twin, for every row in turn: redraw every other row's hidden states and flip their labels; this row's
    gradient must not move."""
    x = leaf_copies(make_inputs(seed=22, fully_ignored_row=False))
    B = x["target"].shape[0]
    labels = torch.tensor([True, False] * (B // 2))

    def run(inp, lab=labels):
        fn = ChunkedKTOLoss(use_ref_model=True, token_chunk_size=token_chunk_size, beta=0.5)
        loss, _ = call_kto(fn, inp, lab, None if kl is None else torch.tensor(kl))
        assert _path(loss) == "one-pass"
        return loss

    g = torch.Generator().manual_seed(6)
    for row in range(B):
        loss, base = _group_grad(run, leaf_copies(x), [row])
        assert base.abs().sum() > 0
        others = [r for r in range(B) if r != row]
        flipped = labels.clone()
        flipped[others] = ~flipped[others]
        moved_loss, grad = _group_grad(lambda inp, lab=flipped: run(inp, lab), _moved(x, others, g), [row])
        assert not torch.isclose(moved_loss, loss)
        torch.testing.assert_close(grad, base, rtol=1e-5, atol=1e-7, msg=f"row {row} moved with the others")


class _SoftplusOfSums(ChunkedLinearLoss):
    """A toy loss on per-row sums ``S``: ``softplus(S - mean(S))`` summed, written per pair (``group_loss``: the
    mean over the pair's rows)."""

    def __init__(self, token_chunk_size):
        super().__init__(IGNORE, 0.1, False, False, False, 1, token_chunk_size)

    def group_of_row(self, batch_size, device):
        return torch.arange(batch_size, device=device) % (batch_size // 2)

    def group_loss(self, sums, counts, group, batch):
        return torch.nn.functional.softplus(sums - sums.mean()).sum()  # sums: this pair's two rows only

    def forward(self, weight, hidden, target, bias=None):
        return self.policy_loss(hidden, weight, bias, target, None)[0]


class _CoupledSoftplus(_SoftplusOfSums):
    """The same written for the whole batch (``batch_loss``: the mean over every row couples the pairs)."""

    def batch_loss(self, sums, counts, batch):
        return torch.nn.functional.softplus(sums - sums.mean()).sum()


def _materialised_sums(x):
    logits = x["hidden"] @ x["weight"].t() + x["bias"]
    lp = logits.log_softmax(-1).gather(-1, x["target"].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(x["target"] != IGNORE, lp, torch.zeros_like(lp)).sum(-1)


@pytest.mark.parametrize("coupled", [False, True], ids=["per-pair", "whole-batch"])
def test_a_loss_that_couples_groups_takes_the_two_pass_path_and_says_why(coupled):
    """4-token chunks (every pair longer than a chunk).  Written per group, ``S - S.mean()`` is the pair's own
    mean: the one-pass path is exact (against plain autograd on materialised logits).  Written for the whole batch
    (``batch_loss``), it couples pairs: the one-pass path would be 90 % wrong, so the loss takes the two-pass path
    and ``last_path`` says why; the gradients are again exact."""
    x = leaf_copies(make_inputs(seed=23, fully_ignored_row=False))
    fn = (_CoupledSoftplus if coupled else _SoftplusOfSums)(LONG)
    loss = fn(x["weight"], x["hidden"], x["target"], x["bias"])
    loss.backward()
    if coupled:
        assert fn.last_path == "two-pass: the loss is not a sum over groups (batch_loss): one pass would be wrong"
        assert _path(loss) == "two-pass"
    else:
        assert fn.last_path == "one-pass" and _path(loss) == "one-pass"
    y = leaf_copies(make_inputs(seed=23, fully_ignored_row=False))
    sums = _materialised_sums(y)
    P = sums.shape[0] // 2
    if coupled:
        want = torch.nn.functional.softplus(sums - sums.mean()).sum()
    else:
        pairs = torch.stack([sums[:P], sums[P:]], 1)
        want = torch.nn.functional.softplus(pairs - pairs.mean(1, keepdim=True)).sum()
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    _assert_close(_grads(x), _grads(y), what="vs materialised")


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
    assert plan == [  # (start, end, pending, finish, the groups whose last token is in the chunk)
        (0, 4, [(0, 4, 0)], [], ()),
        (4, 8, [(4, 5, 0), (5, 8, 2)], [], ()),
        (8, 11, None, [(0, 5, 0), (5, 8, 2)], (0,)),
        (11, 14, None, [], (1,)),
    ]
    _, whole = group_chunks(rows, torch.tensor([0, 1, 0, 1]), counts, 11)
    assert whole == [(0, 11, None, [], (0,)), (11, 14, None, [], (1,))]


def test_chunk_plan_ends_a_long_pair_with_its_last_rows_whole_when_they_fit():
    """Pairs of 5 + 3 and 2 + 1 tokens, chunk 4: the rejected row (3) fits a chunk, so it is the long pair's last
    chunk and needs no sum; only the chosen row is pending (a chunk of 4, then of 1).  The short pair (3) does not
    fit beside it.  With chunk 6 the short pair (3) joins a last chunk of 3 (6 in all)."""
    counts = torch.tensor([5, 2, 3, 1])
    rows = torch.repeat_interleave(torch.arange(4), counts)
    _, plan = group_chunks(rows, torch.tensor([0, 1, 0, 1]), counts, 4)
    assert plan == [
        (0, 4, [(0, 4, 0)], [], ()),
        (4, 5, [(4, 5, 0)], [], ()),
        (5, 8, None, [(0, 5, 0)], (0,)),
        (8, 11, None, [], (1,)),
    ]
    _, plan = group_chunks(rows, torch.tensor([0, 1, 0, 1]), counts, 6)
    assert plan == [(0, 5, [(0, 5, 0)], [], ()), (5, 11, None, [(0, 5, 0)], (0, 1))]


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


@pytest.mark.parametrize("kind", ["dpo", "kto"])
@pytest.mark.parametrize("chunk", [WHOLE, LONG], ids=["whole-groups", "long-groups"])
def test_a_bf16_gradient_is_scaled_by_the_exact_upstream_factor(kind, chunk):
    """Gradient accumulation 3 (``loss / 3``) on bf16 weights: the stored gradients are scaled by 1/3 in fp32 and
    rounded once, i.e. exactly ``bf16(g1 / 3)`` where ``g1`` is the gradient for a factor of 1.  Rounding the
    factor to bf16 first (1/3 -> 0.333984375) put every entry +0.2 % off."""

    def grads(scale):
        x = make_inputs(seed=17, dtype=torch.bfloat16, fully_ignored_row=False)
        x = leaf_copies(x)
        if kind == "dpo":
            loss, _ = _dpo_loss(x, token_chunk_size=chunk)
        else:
            loss, _ = call_kto(ChunkedKTOLoss(token_chunk_size=chunk), x, torch.tensor([True, False] * 3))
        assert _path(loss) == "one-pass"
        (loss * scale).backward()
        return _grads(x)

    for name, g1, g3 in zip(("grad_hidden", "grad_weight", "grad_bias"), grads(1.0), grads(1 / 3)):
        assert g3.dtype == torch.bfloat16
        want = (g1.float() * (1 / 3)).to(torch.bfloat16)
        assert torch.equal(g3, want), (
            f"{name}: {((g3.float() - want.float()).abs().max() / want.float().abs().max()):.2e}"
        )

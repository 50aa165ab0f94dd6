"""The default loss holds a ``(V, H)`` sum only where the held budget allows it (issue 39 item 2).

A pair (or KTO row) longer than a token chunk makes the one-pass path add its chunks' weight gradients into an
extra ``(V, H)`` sum until the group's factor is known (``_onepass._LongGroups``).  By default the loss takes the
two-pass path where that (and a weight cast under autocast) would exceed ``_plan.held_budget_bytes``; with
``one_pass=True`` (``LIGER_DDP_PATCH_LOSS=one_pass=1``) it always takes one pass.  Retained tensors are *measured*
here -- every CPU allocation the profiler sees during forward and backward, replayed: how many ``(V, H)``-sized blocks
are live at once -- not read from the loss's own accounting, which is checked against that count.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _loss_cases import call_kto, leaf_copies, make_inputs
from torch.profiler import ProfilerActivity, profile

from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss, _plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _memory import cpu_allocations  # noqa: E402  (the replay mem_head.py uses too)

V, H, L, CHUNK = 512, 24, 24, 8  # rows of ~20 loss tokens: every pair and row is longer than a chunk


def _most_vh_blocks_live(run) -> int:
    """The most ``(V, H)`` fp32 blocks live at once while ``run()`` runs (allocations of exactly that size)."""
    size = V * H * 4
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = cpu_allocations(prof)
    live, most = set(), 0
    for e in events:
        f = e.extra_fields
        if f.alloc_size == size:
            live.add(f.ptr)
        elif f.alloc_size == -size:
            live.discard(f.ptr)
        most = max(most, len(live))
    return most


def _dpo(x, chunk=CHUNK, **kw):
    fn = ChunkedDPOLoss(beta=0.2, token_chunk_size=chunk, **kw)
    return fn, lambda: fn(x["weight"], x["hidden"], x["target"], None, x["ref_hidden"], x["ref_weight"], None)[0]


def _kto(x, **kw):
    fn = ChunkedKTOLoss(beta=0.2, use_ref_model=True, token_chunk_size=CHUNK, **kw)
    labels = torch.arange(x["target"].shape[0]) % 2 == 0
    return fn, lambda: call_kto(fn, x, labels, torch.tensor(0.1))[0]


def _inputs(pairs):
    return leaf_copies(make_inputs(batch=2 * pairs, seq_len=L, hidden=H, vocab=V, bias=False, fully_ignored_row=False))


@pytest.fixture
def budget(monkeypatch):
    """Set the CPU held budget (bytes) for the test."""

    def set_to(n):
        monkeypatch.setitem(_plan.HELD_BUDGET_BYTES, "cpu", n)

    return set_to


# (loss, pairs or rows / 2, extra sums one pass holds): DPO with rows longer than a chunk: 1 for the first pair,
# 2 from the second; KTO: 0 for the first long row, 1 from the second
CASES = [("dpo", 1, 1), ("dpo", 2, 2), ("kto", 1, 1)]


@pytest.mark.parametrize(("kind", "pairs", "sums"), CASES)
def test_default_holds_no_vh_sum_over_the_budget_and_one_pass_does(budget, kind, pairs, sums):
    budget(V * H * 4 - 1)  # less than one fp32 (V, H) sum: the rule says two passes
    got = {}
    for label, kw in (("default", {}), ("one_pass=1", dict(one_pass=True))):
        x = _inputs(pairs)
        fn, forward = (_dpo if kind == "dpo" else _kto)(x, **kw)
        most = _most_vh_blocks_live(lambda f=forward: f().backward())
        got[label] = (most, fn.last_path, fn.last_held, x["weight"].grad.clone())
    # the default: the weight gradient alone (made in the backward); one pass: it and the sums, during the forward
    assert got["default"][0] == 1 and got["default"][1].startswith("two-pass: one pass would hold"), got["default"][:3]
    assert got["one_pass=1"][0] == 1 + sums and got["one_pass=1"][1] == "one-pass", got["one_pass=1"][:3]
    # the loss's own accounting says what was measured
    assert got["default"][2]["vh_sums"] == got["one_pass=1"][2]["vh_sums"] == sums
    assert got["one_pass=1"][2]["vh_sums_bytes"] == sums * V * H * 4 and got["one_pass=1"][2]["cast_bytes"] == 0
    torch.testing.assert_close(got["default"][3], got["one_pass=1"][3], rtol=1e-5, atol=1e-6)


def test_default_takes_one_pass_where_the_budget_allows_the_sum(budget):
    budget(V * H * 4)  # exactly one fp32 sum
    x = _inputs(1)
    fn, forward = _dpo(x)
    assert _most_vh_blocks_live(lambda: forward().backward()) == 2 and fn.last_path == "one-pass"
    assert fn.last_held["extra_bytes"] == V * H * 4


def test_default_widens_the_chunk_to_a_long_row_where_that_holds_less_than_a_sum(monkeypatch, budget):
    """A pair a little longer than the default chunk (fp32 at L=512 with Qwen2.5-0.5B's head: rows of 256 tokens,
    chunks of 220) whose sum exceeds the held budget: the default takes one pass in a chunk widened to the longest
    row, which holds no ``(V, H)`` sum, only that row's extra logits; ``one_pass=1`` keeps the chunk and holds the
    sum (the control).  Where the sum fits: one pass in the default chunk.  Where even the wider logits exceed the
    budget: two passes.  The gradients agree."""
    default_chunk = 8
    monkeypatch.setitem(_plan.LOGITS_BUDGET_BYTES, "cpu", default_chunk * V * 4)
    budget(V * H * 4 - 1)  # less than one fp32 (V, H) sum
    got = {}
    for label, kw in (("default", {}), ("one_pass=1", dict(one_pass=True)), ("one_pass=0", dict(one_pass=False))):
        x = _inputs(1)
        fn, forward = _dpo(x, chunk=None, **kw)
        most = _most_vh_blocks_live(lambda f=forward: f().backward())
        got[label] = (most, fn.last_path, fn.last_chunk, fn.last_held, x["weight"].grad.clone())
    longest = int((x["target"] != -100).sum(1).max())
    assert longest > default_chunk
    assert got["default"][:3] == (1, "one-pass", longest), got["default"][:4]
    assert got["default"][3]["vh_sums"] == 0 and got["default"][3]["chunk_bytes"] == (longest - default_chunk) * V * 4
    assert got["one_pass=1"][:3] == (2, "one-pass", default_chunk), got["one_pass=1"][:4]
    torch.testing.assert_close(got["default"][4], got["one_pass=1"][4], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["default"][4], got["one_pass=0"][4], rtol=1e-5, atol=1e-6)
    budget(V * H * 4)  # the sum fits the budget: one pass in the default chunk, holding it
    x = _inputs(1)
    fn, forward = _dpo(x, chunk=None)
    assert _most_vh_blocks_live(lambda: forward().backward()) == 2
    assert (fn.last_path, fn.last_chunk, fn.last_held["vh_sums"]) == ("one-pass", default_chunk, 1), fn.last_held
    budget((longest - default_chunk) * V * 4 - 1)  # the wider logits no longer fit: two passes
    x = _inputs(1)
    fn, forward = _dpo(x, chunk=None)
    forward().backward()
    assert fn.last_path.startswith("two-pass: one pass would hold") and fn.last_chunk == default_chunk, fn.last_path


def test_a_cast_weight_counts_against_the_budget(budget):
    """fp32 weights under bf16 autocast: the one-pass forward keeps the bf16 cast beside the weight gradient."""
    budget(V * H * 2 - 1)  # less than the cast alone
    x = leaf_copies(make_inputs(batch=2, seq_len=4, hidden=H, vocab=V, bias=False, fully_ignored_row=False))
    fn, forward = _dpo(x)  # 4-token rows: no long pair, no sum
    with torch.autocast("cpu", dtype=torch.bfloat16):
        forward().backward()
    assert fn.last_held == dict(vh_sums=0, vh_sums_bytes=0, cast_bytes=V * H * 2, chunk_bytes=0, extra_bytes=V * H * 2)
    assert fn.last_path.startswith("two-pass: one pass would hold"), fn.last_path
    budget(V * H * 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        forward().backward()
    assert fn.last_path == "one-pass"


@pytest.mark.parametrize("weights", ["fp32 under autocast", "bf16"])
def test_a_backward_blocks_temporaries_fit_the_budget_together(monkeypatch, weights):
    """The two-pass backward in half precision walks the vocabulary in blocks; each block's temporaries -- its fp32
    weight-gradient tile, its weight rows cast to bf16 (fp32 weights under autocast), the bf16 product the CPU GEMM
    cannot write in fp32 and the fp32 copy of it that ``tile.add_(product)`` makes -- fit the per-chunk budget
    together.  Measured: the most bytes live at once in allocations of a block's sizes.  Sizing the tile alone to
    the budget (before issue 39) held 2.5x the budget here."""
    budget = 32 * 12 * H  # 32 rows of 12 bytes per hidden unit: under V / 4 = 128 rows
    monkeypatch.setitem(_plan.LOGITS_BUDGET_BYTES, "cpu", budget)
    x = _inputs(1)
    if weights == "bf16":
        x = {k: (v.detach().bfloat16().requires_grad_(v.requires_grad) if torch.is_tensor(v) and v.is_floating_point()
                 else v) for k, v in x.items()}  # fmt: skip
    fn = ChunkedDPOLoss(beta=0.2, one_pass=False)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights != "bf16"):
        loss = fn(x["weight"], x["hidden"], x["target"], None, x["ref_hidden"], x["ref_weight"], None)[0]
        block = _plan.Plan.of(x["hidden"], x["weight"], None).block_rows(x["weight"])
    sizes = {block * H * 4, block * H * 2}  # the tile and the product's copy; the cast rows and the product
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    live, most = {}, 0
    for e in cpu_allocations(prof):
        f = e.extra_fields
        if f.alloc_size > 0 and f.alloc_size in sizes:
            live[f.ptr] = f.alloc_size
        elif f.alloc_size < 0:
            live.pop(f.ptr, None)
        most = max(most, sum(live.values()))
    assert fn.last_path.startswith("two-pass"), fn.last_path
    assert 0 < most <= budget, f"{most} bytes of block temporaries live at once > the budget {budget} (block {block})"

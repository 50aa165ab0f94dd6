"""The CPU half-precision sweep on row tiles (``liger_ddp_patch/losses/_tiles.py``, issue #22).

* it is what a bf16 CPU call without a bias runs (``last_sweep == "tiles"``), and what it does not touch: fp32, an
  LM head with a bias (the block sweep: ``"eager"``);
* it computes what the block sweep computes, DPO and KTO, one pass (whole groups, groups longer than a chunk) and
  two passes, with one tile per chunk and with many (a last tile cut short): the loss and the sequence log-probs to
  fp32 rounding, the gradients to bf16 rounding;
* its default chunk holds ~3x the tokens of the block sweep's for the same memory (``test_losses_precision``).
"""

from __future__ import annotations

import pytest
import torch
from _loss_cases import call_kto, leaf_copies, make_inputs

from liger_ddp_patch.losses import ChunkedDPOLoss, ChunkedKTOLoss, _plan, _tiles

LABELS = torch.tensor([True, False] * 3)


def _run(kind, x, **kw):
    x = leaf_copies(x)
    if kind == "dpo":
        fn = ChunkedDPOLoss(beta=0.2, **kw)
        out = fn(x["weight"], x["hidden"], x["target"], x["bias"], x["ref_hidden"], x["ref_weight"], x["ref_bias"])
        logps = [out[1][0], out[1][1]]
    else:
        fn = ChunkedKTOLoss(beta=0.2, **kw)
        out = call_kto(fn, x, LABELS, kl=torch.tensor(0.05))
        logps = [out[1][0], out[1][1]]
    out[0].backward()
    return fn.last_sweep, [out[0], *logps], [x["hidden"].grad, x["weight"].grad]


def _inputs(dtype=torch.bfloat16, bias=False):
    return make_inputs(seed=5, dtype=dtype, bias=bias, fully_ignored_row=False)


@pytest.mark.parametrize(
    ("dtype", "bias", "sweep"),
    [(torch.bfloat16, False, "tiles"), (torch.float16, False, "tiles"), (torch.bfloat16, True, "eager"),
     (torch.float32, False, "eager")],
    ids=["bf16", "fp16", "bf16-bias", "fp32"],
)  # fmt: skip
def test_which_calls_take_the_tile_sweep(dtype, bias, sweep):
    assert _run("dpo", _inputs(dtype, bias))[0] == sweep


@pytest.mark.parametrize("tile_rows", [None, 3], ids=["one-tile", "3-row-tiles"])
@pytest.mark.parametrize(
    ("chunk", "one_pass"), [(26, True), (4, True), (8, False)], ids=["whole-groups", "long-groups", "two-pass"]
)
@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_tiles_compute_what_the_block_sweep_computes(monkeypatch, kind, chunk, one_pass, tile_rows):
    """Same chunks (``token_chunk_size`` fixed), tiles against the block sweep (forced by ``tiles_sweep`` -> False).
    Measured: loss and log-probs within 3e-7 of their scale, gradients within 1 bf16 ulp of theirs (differences
    from fp32 rounding that cross a bf16 rounding boundary).  Broken on purpose: gradients scaled by 1.01 are
    2.6 ulps off; the target entry left out of the tile (no ``scatter_``) moves them by far more."""
    x = _inputs()
    if tile_rows is not None:  # several tiles per chunk, the last one cut short
        V = x["weight"].shape[0]
        monkeypatch.setattr(_tiles, "TILE_BYTES", tile_rows * 4 * V)
    sweep, vals, grads = _run(kind, x, token_chunk_size=chunk, one_pass=one_pass)
    assert sweep == "tiles"
    monkeypatch.setattr(_plan, "tiles_sweep", lambda *a, **k: False)
    block_sweep, block_vals, block_grads = _run(kind, x, token_chunk_size=chunk, one_pass=one_pass)
    assert block_sweep == "eager"
    for i, (a, b) in enumerate(zip(vals, block_vals)):
        scale = b.detach().double().abs().max().item()
        err = (a.detach().double() - b.detach().double()).abs().max().item()
        assert err <= 1e-6 * scale, f"value {i}: {err / scale:.1e} of its scale"
    for name, a, b in zip(("grad_hidden", "grad_weight"), grads, block_grads):
        assert a.dtype == b.dtype == torch.bfloat16
        scale = b.double().abs().max().item()
        err = (a.double() - b.double()).abs().max().item()
        assert err <= 2**-8 * scale, f"{name}: {err / scale * 2**8:.2f} bf16 ulps of its scale"

"""Shared inputs and reference loaders for the loss parity tests (small shapes: CPU, seconds)."""

from __future__ import annotations

import importlib

import torch

DPO_LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
    "discopop",
)

# Small but awkward: odd sequence length, V not a multiple of anything, H small.
B_PAIRS, L, H, V = 3, 13, 16, 37
IGNORE = -100


def make_target(batch, seq_len, vocab, *, fully_ignored_row=True, seed=0, ignore_index=IGNORE):
    g = torch.Generator().manual_seed(seed + 1)
    target = torch.randint(0, vocab, (batch, seq_len), generator=g)
    # per-row prompt prefix of varying length (0 .. seq_len-1), plus a little right padding
    for i in range(batch):
        p = (3 * i + 1) % seq_len
        target[i, :p] = ignore_index
        if i % 2 == 1:
            target[i, seq_len - 2 :] = ignore_index
    if fully_ignored_row and batch > 1:
        target[batch - 1, :] = ignore_index  # one fully-ignored (rejected) row
    # keep the first chosen row non-empty so that the NLL denominator is never zero
    target[0, -1] = 1
    return target


def make_inputs(
    *,
    batch=2 * B_PAIRS,
    seq_len=L,
    hidden=H,
    vocab=V,
    dtype=torch.float32,
    bias=True,
    seed=0,
    fully_ignored_row=True,
    ignore_index=IGNORE,
):
    g = torch.Generator().manual_seed(seed)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    t = dict(
        hidden=rn(batch, seq_len, hidden),
        weight=rn(vocab, hidden, scale=0.3),
        bias=rn(vocab, scale=0.5) if bias else None,
        ref_hidden=rn(batch, seq_len, hidden),
        ref_weight=rn(vocab, hidden, scale=0.3),
        ref_bias=rn(vocab, scale=0.5) if bias else None,
    )
    t["target"] = make_target(
        batch, seq_len, vocab, fully_ignored_row=fully_ignored_row, seed=seed, ignore_index=ignore_index
    )
    return t


def leaf_copies(inp):
    """Fresh leaf tensors requiring grad for hidden/weight/bias (reference tensors stay frozen)."""
    out = dict(inp)
    for k in ("hidden", "weight", "bias"):
        if inp[k] is not None:
            out[k] = inp[k].detach().clone().requires_grad_(True)
    return out


def load_reference(kind: str, which: str):
    """Reference loss class: kind in {'dpo', 'kto'}, which in {'liger', 'trl113'}; None when unavailable."""
    try:
        if which == "liger":
            mod = importlib.import_module("liger_kernel.chunked_loss")
            return getattr(mod, "LigerFusedLinearDPOLoss" if kind == "dpo" else "LigerFusedLinearKTOLoss")
        mod = importlib.import_module("trl.losses")
        return getattr(mod, "FusedLinearDPOLoss" if kind == "dpo" else "FusedLinearKTOLoss")
    except Exception:  # not installed / older TRL without trl.losses
        return None


def close(a, b, rtol, atol):
    """|a-b| <= atol * max(1, max|b|) + rtol |b| elementwise, NaNs must match; returns (ok, max_abs_err)."""
    a = a.detach().double()
    b = b.detach().double()
    if a.shape != b.shape:
        return False, float("inf")
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False, float("nan")
    a = torch.where(nan_a, torch.zeros_like(a), a)
    b = torch.where(nan_b, torch.zeros_like(b), b)
    err = (a - b).abs()
    # atol is relative to the tensor's own scale (at least 1): a gradient whose entries are O(10) (sppo_hard's
    # squared loss) sums O(10)-sized fp32 terms, so its reduction-order noise is O(10) times larger too.
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    ok = bool((err <= atol * scale + rtol * b.abs()).all())
    return ok, float(err.max()) if err.numel() else 0.0


def call_kto(loss_fn, x, labels, kl=None):
    """A KTO loss called the way TRL's KTOTrainer calls it (keywords) on the tensors of ``make_inputs``."""
    return loss_fn(
        _input=x["hidden"],
        lin_weight=x["weight"],
        target=x["target"],
        bias=x["bias"],
        preference_labels=labels,
        ref_input=x["ref_hidden"],
        ref_weight=x["ref_weight"],
        ref_bias=x["ref_bias"],
        kl=kl,
    )

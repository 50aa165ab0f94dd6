"""Shared inputs and reference loaders for the loss parity tests (small shapes: CPU, seconds)."""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch
import torch.nn.functional as F

from liger_ddp_patch.losses.dpo import SUPPORTED_DPO_LOSS_TYPES

# Every type the code supports (not a hand-copied list): a new type is held to Liger and to the per-pair tests.
DPO_LOSS_TYPES = SUPPORTED_DPO_LOSS_TYPES

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


REFERENCES = {
    ("dpo", "liger"): ("liger_kernel.chunked_loss", "LigerFusedLinearDPOLoss"),
    ("kto", "liger"): ("liger_kernel.chunked_loss", "LigerFusedLinearKTOLoss"),
    ("dpo", "trl113"): ("trl.losses", "FusedLinearDPOLoss"),
    ("kto", "trl113"): ("trl.losses", "FusedLinearKTOLoss"),
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def load_reference(kind: str, which: str):
    """Reference loss class: kind in {'dpo', 'kto'}, which in {'liger', 'trl113'}; None when it is not installed
    (TRL before 1.13 has no ``trl.losses``).  An installed package whose import breaks raises (the parity tests fail
    instead of skipping), and so does a missing liger-kernel under CI (``CI=true``), which installs it."""
    module, name = REFERENCES[(kind, which)]
    top = module.partition(".")[0]
    if importlib.util.find_spec(top) is None:
        if which == "liger" and in_ci():
            raise RuntimeError("liger-kernel is not installed, but CI installs it (.[test]): the parity tests need it")
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name == module:  # the package is there, the module is not: a release without it
            return None
        raise


def fp64_dpo_truth(x, beta=0.1, compute_nll_loss=False, alpha=1.0, ignore_index=IGNORE):
    """``[loss, chosen_logps, rejected_logps, grad_hidden, grad_weight, grad_bias]`` of sigmoid DPO with a reference
    model (+ NLL) on materialised fp64 logits with plain autograd: the formula written out here, independently of the
    package, so a systematic error in the code under test cannot cancel out."""
    d = {k: (v.detach().double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()}
    for k in ("hidden", "weight", "bias"):
        if d[k] is not None:
            d[k].requires_grad_(True)
    target = d["target"]
    mask = target != ignore_index

    def token_logps(h, w, b):
        logits = h @ w.t() + (0 if b is None else b)
        lp = logits.log_softmax(-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return torch.where(mask, lp, torch.zeros_like(lp))

    tok = token_logps(d["hidden"], d["weight"], d["bias"])
    with torch.no_grad():
        ref = token_logps(d["ref_hidden"], d["ref_weight"], d["ref_bias"]).sum(-1)
    seq, P = tok.sum(-1), target.shape[0] // 2
    margin = beta * ((seq[:P] - ref[:P]) - (seq[P:] - ref[P:]))
    loss = -F.logsigmoid(margin).mean()
    if compute_nll_loss:
        loss = loss - alpha * tok[:P].sum() / mask[:P].sum()
    loss.backward()
    grads = [None if d[k] is None else d[k].grad for k in ("hidden", "weight", "bias")]
    return [loss.detach(), seq[:P].detach(), seq[P:].detach(), *grads]


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

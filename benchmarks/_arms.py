"""The DPO/KTO-loss implementations the benchmarks compare (CPU: bench_losses.py; GPU: gpu_check.py), device-agnostic.

Every DPO arm computes the same thing: sigmoid DPO loss, beta 0.1, reference model on, summed log-probs over the
non-ignored tokens, for ``B`` stacked sequences (chosen rows first), then ``loss.backward()`` into the policy hidden
states and LM-head weight.  A KTO arm (``kind="kto"``): the KTO loss, beta 0.1, reference model on, ``B`` unpaired
rows labelled desirable / undesirable alternately, a scalar ``kl`` of 0.1.  ``make_step(arm, x, kind=...)`` returns
``step() -> loss``.

  ours      liger_ddp_patch.losses.ChunkedDPOLoss / ChunkedKTOLoss (default token chunk unless told): the one-pass
            path (pairs / rows longer than a token chunk included)
  ours_2p   the same with the one-pass path switched off (``one_pass=False``): the two-pass path, "before"
  ours_tri  ``ours`` with ``sweep="triton"`` (the softmax and gradient sweep as two Triton kernels; a GPU arm: not
            in ``ARMS``, and where Triton cannot run it is ``ours`` again, with a warning)
  liger     liger_kernel.chunked_loss.LigerFusedLinearDPOLoss / LigerFusedLinearKTOLoss(compiled=False)
  liger_c   the same with compiled=True (torch.compile: inductor on CPU, Triton on a GPU)
  trl114,   the upgrades' own head paths, one arm per release (``_upgrades.UPGRADES``), DPO and KTO, each from its
  trl116    TRL release first on sys.path.  ``chunked_logprob`` (trl114: TRL 1.14.0, the path upstream replaced the
            fused loss with): ``_ChunkedLogProbFunction`` in trl/trainer/utils.py, called as DPOTrainer
            (dpo_trainer.py:1246) and KTOTrainer (kto_trainer.py:1301) call it: boolean-masked hidden states,
            vocabulary chunk ``_CHUNKED_LOGPROB_CHUNK_SIZE = 8192``.  ``fused_lm_head`` (trl116: TRL 1.15+, here
            1.16.0): a model forward patched by ``add_fused_lm_head`` (trl/trainer/utils.py:1548) with the outputs
            DPOTrainer / KTOTrainer ask of the policy (dpo_trainer.py:957-960, kto_trainer.py:967-970; of the
            reference: log-probs alone), called with ``fused_lm_head=True`` and the benchmark's targets as
            ``shift_labels`` (scored without a shift), the per-token log-probs summed per row as the trainers do.  Its
            tiles (trl/kernels/chunked_logprob.py) are Triton kernels over the completion tokens on CUDA/XPU, torch ops
            over every position elsewhere (trl/trainer/utils.py:1640-1648): on CPU it projects the prompt's positions
            too, as TRL 1.16 does there
  mat       materialised logits: h @ W.T, log_softmax in fp32, gather, plain autograd
  gemm      only the GEMMs no exact loss can avoid, over the tokens with loss (policy logits, grad-input,
            grad-weight, reference logits), token-chunked like ours, in the input dtype: a floor, not a loss
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from _upgrades import UPGRADES

IGNORE = -100
BETA = 0.1
TRL114_VOCAB_CHUNK = 8192  # trl 1.14.0, trl/trainer/dpo_trainer.py: _CHUNKED_LOGPROB_CHUNK_SIZE
KL = 0.1
ARMS = ("ours", "ours_2p", "liger", "liger_c", *UPGRADES, "mat", "gemm")
KTO_ARMS = ARMS
# fused_lm_head: the per-token outputs each trainer asks of its policy's head (TRL 1.16.0, dpo_trainer.py:957,
# kto_trainer.py:969); of the reference's head, log-probs alone (add_fused_lm_head's default)
FUSED_OUTPUTS = {
    "dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
    "kto": ("log_probs", "entropy", "mean_logits"),
}


def make_inputs(B, L, H, V, prompt_frac, dtype=torch.float32, device="cpu", seed=0, w_scale=0.02):
    """Policy (h, w) with grads, frozen reference (rh, rw), targets t with the first ``prompt_frac`` ignored."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    x = dict(
        h=rn(B, L, H).requires_grad_(True),
        w=rn(V, H, scale=w_scale).requires_grad_(True),
        rh=rn(B, L, H),
        rw=rn(V, H, scale=w_scale),
        t=torch.randint(0, V, (B, L), generator=g, device=device),
    )
    x["t"][:, : int(prompt_frac * L)] = IGNORE
    return x


def dpo_sigmoid(pol, ref):
    n = pol.shape[0] // 2
    d = BETA * ((pol[:n] - ref[:n]) - (pol[n:] - ref[n:]))
    return -F.logsigmoid(d).sum() / n


def kto_labels(B, device="cpu"):
    return torch.arange(B, device=device) % 2 == 0


def kto(pol, ref):
    sign = kto_labels(pol.shape[0], pol.device).to(pol.dtype) * 2 - 1
    return (1 - torch.sigmoid(BETA * (pol - ref - KL) * sign)).sum() / pol.shape[0]


def _with_backward(loss_fn):
    def step():
        loss = loss_fn()
        step.grad_fn = loss.grad_fn.name() if loss.grad_fn is not None else None  # which path our losses took
        loss.backward()
        return loss.detach()

    return step


def make_step(arm, x, token_chunk_size=None, kind="dpo"):
    h, w, rh, rw, t = x["h"], x["w"], x["rh"], x["rw"], x["t"]
    if arm in UPGRADES:
        return _upgrade_step(arm, x, kind)
    if kind == "kto" and arm in ("ours", "ours_tri", "ours_2p", "liger", "liger_c"):
        return _kto_step(arm, x, token_chunk_size)
    if arm in ("ours", "ours_tri", "ours_2p"):
        from liger_ddp_patch.losses import ChunkedDPOLoss

        fn = ChunkedDPOLoss(token_chunk_size=token_chunk_size, one_pass=arm != "ours_2p", sweep=_sweep(arm))
        return _with_backward(lambda: fn(w, h, t, None, rh, rw, None)[0])
    if arm in ("liger", "liger_c"):
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        fn = LigerFusedLinearDPOLoss(compiled=arm == "liger_c")
        return _with_backward(lambda: fn(w, h, t, None, rh, rw, None)[0])
    mask = t != IGNORE
    if arm == "mat":

        def seq_logps(hid, wt):
            logp = F.log_softmax((hid @ wt.t()).float(), dim=-1)
            return (logp.gather(-1, t.clamp_min(0).unsqueeze(-1)).squeeze(-1) * mask).sum(-1)

    elif arm == "gemm":
        return _gemm_floor(x, token_chunk_size)
    else:
        raise ValueError(f"unknown arm {arm!r}")

    def loss():
        with torch.no_grad():
            ref = seq_logps(rh, rw)
        return (kto if kind == "kto" else dpo_sigmoid)(seq_logps(h, w), ref)

    return _with_backward(loss)


def _upgrade_step(arm, x, kind):
    """An upgrade's own head path for the policy and the reference (``_upgrades.UPGRADES``), then the same loss as
    ``mat``; TRL is the release first on sys.path, which must be the arm's."""
    import trl

    release, head = UPGRADES[arm]
    if trl.__version__ != release:
        raise RuntimeError(f"{arm} needs TRL {release} first on sys.path, found TRL {trl.__version__} ({trl.__file__})")
    h, w, rh, rw, t = x["h"], x["w"], x["rh"], x["rw"], x["t"]
    if head == "chunked_logprob":
        pol = ref = _chunked_logprob(t)
    elif head == "fused_lm_head":
        pol, ref = _fused_lm_head(h, w, t, FUSED_OUTPUTS[kind]), _fused_lm_head(rh, rw, t, ("log_probs",))
    else:
        raise ValueError(f"{arm}: unknown head path {head!r}")

    def loss():
        with torch.no_grad():
            ref_logps = ref(rh, rw)
        return (kto if kind == "kto" else dpo_sigmoid)(pol(h, w), ref_logps)

    return _with_backward(loss)


def _chunked_logprob(t):
    """TRL 1.14: the completion tokens' hidden states through ``_ChunkedLogProbFunction``, summed per row."""
    from trl.trainer.utils import _ChunkedLogProbFunction

    mask = t != IGNORE
    rows, labels = mask.nonzero()[:, 0], t[mask]

    def seq_logps(hid, wt):
        logp, _ = _ChunkedLogProbFunction.apply(hid[mask], wt, None, labels, 1.0, TRL114_VOCAB_CHUNK, None, 1.0)
        return torch.zeros(t.shape[0], dtype=logp.dtype, device=logp.device).index_add(0, rows, logp)

    return seq_logps


class _HeadOnly:
    """What ``add_fused_lm_head`` reads of a causal LM: a config that is its own text config (no logit softcapping,
    no logit scale), a backbone (``base_model``) whose last hidden states are the benchmark's, and the output
    embedding (the benchmark's weight, no bias)."""

    def __init__(self, hidden, weight):
        self.config, self._hidden = self, hidden
        self._head = SimpleNamespace(weight=weight, bias=None)

    def get_text_config(self):
        return self

    def get_output_embeddings(self):
        return self._head

    def base_model(self, **_kwargs):
        return SimpleNamespace(last_hidden_state=self._hidden)

    def forward(self, **_kwargs):
        raise NotImplementedError("only the fused LM head (fused_lm_head=True) is benchmarked")


def _fused_lm_head(hidden, weight, t, outputs):
    """TRL 1.15+: a model's forward as the trainers patch it, called as they call it, summed per row."""
    from trl.trainer.utils import add_fused_lm_head

    model = _HeadOnly(hidden, weight)
    add_fused_lm_head(model, outputs=outputs)

    def seq_logps(hid, wt):
        assert hid is hidden and wt is weight  # the model was built on them
        return model.forward(fused_lm_head=True, shift_labels=t).log_probs.sum(-1)

    return seq_logps


def _sweep(arm):
    """``ours_tri``: the loss's Triton sweep (``sweep="triton"``; where Triton cannot run, eager with a warning)."""
    return "triton" if arm == "ours_tri" else "eager"


def _kto_step(arm, x, token_chunk_size):
    h, w, rh, rw, t = x["h"], x["w"], x["rh"], x["rw"], x["t"]
    labels, kl = kto_labels(t.shape[0], t.device), torch.tensor(KL, device=t.device)
    if arm in ("ours", "ours_tri", "ours_2p"):
        from liger_ddp_patch.losses import ChunkedKTOLoss

        fn = ChunkedKTOLoss(beta=BETA, use_ref_model=True, token_chunk_size=token_chunk_size,
                            one_pass=arm != "ours_2p", sweep=_sweep(arm))  # fmt: skip
    else:
        from liger_kernel.chunked_loss import LigerFusedLinearKTOLoss

        fn = LigerFusedLinearKTOLoss(beta=BETA, use_ref_model=True, compiled=arm == "liger_c")
    return _with_backward(
        lambda: fn(
            _input=h,
            lin_weight=w,
            target=t,
            bias=None,
            preference_labels=labels,
            ref_input=rh,
            ref_weight=rw,
            ref_bias=None,
            kl=kl,
        )[0]
    )


def _gemm_floor(x, token_chunk_size):
    from liger_ddp_patch.losses._plan import resolve_token_chunk_size

    h, w, rh, rw, t = x["h"], x["w"], x["rh"], x["rw"], x["t"]
    V, H = w.shape
    chunk = resolve_token_chunk_size(token_chunk_size, V, h.device, h.dtype)
    pos = (t != IGNORE).reshape(-1).nonzero().squeeze(1)
    h2, rh2, wd = h.detach().reshape(-1, H), rh.reshape(-1, H), w.detach()

    def step():
        gw = torch.zeros_like(wd)
        gh = torch.zeros_like(h2)
        buf = torch.empty(min(chunk, max(1, pos.numel())), V, dtype=wd.dtype, device=wd.device)
        for s in range(0, pos.numel(), chunk):
            p = pos[s : s + chunk]
            hc = h2.index_select(0, p)
            b = buf[: p.numel()]
            torch.mm(hc, wd.t(), out=b)  # policy logits
            gh.index_copy_(0, p, b @ wd)  # grad-input (b stands in for grad-logits)
            gw.addmm_(b.t(), hc)  # grad-weight
            torch.mm(rh2.index_select(0, p), rw.t(), out=b)  # reference logits
        return torch.zeros(())

    return step


def reference(x, kind="dpo"):
    """fp32 truth on the same (already rounded) values: materialised, fp32 everywhere, no autocast, no TF32."""
    y = {k: (v.detach().float().requires_grad_(k in ("h", "w")) if v.is_floating_point() else v) for k, v in x.items()}
    loss = make_step("mat", y, kind=kind)()
    return loss, y["h"].grad, y["w"].grad


def rel_errors(loss, gh, gw, ref):
    """max |a - b| / max |b| for the loss, grad-hidden and grad-weight."""

    def rel(a, b):
        return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))

    return {"loss": rel(loss, ref[0]), "grad_h": rel(gh, ref[1]), "grad_w": rel(gw, ref[2])}

r"""Token-chunked DPO loss on top of a linear LM head, in plain PyTorch autograd.

Drop-in replacement for ``liger_kernel.chunked_loss.LigerFusedLinearDPOLoss`` (liger-kernel 0.8.5) and
TRL 1.13's vendored ``trl.losses.FusedLinearDPOLoss``: same constructor keywords and defaults, same
``forward(lin_weight, _input, target, bias, ref_input, ref_weight, ref_bias)`` and the same
``(loss, (7 metrics))`` return value -- but no ``torch.func`` and no ``torch.compile``, so it works inside
``DistributedDataParallel.forward`` (upstream TRL issue #7245; TRL >= 1.14 replaced the fused path by its
own chunked log-prob path, PR #7243).

The batch holds ``2 P`` sequences: rows ``[0, P)`` are the chosen and rows ``[P, 2P)`` the rejected
completions (TRL stacks them that way).  With per-sequence log-probs

    logp(y) = sum_{t : y_t != ignore_index} log softmax(h_t W^T + b)[y_t]      (÷ #tokens if average_log_prob)

and ``r_w = logp(y_w) - logp_ref(y_w)``, ``r_l = logp(y_l) - logp_ref(y_l)`` (reference terms are 0 when
``use_ref_model=False``), ``d = beta (r_w - r_l)``, the per-pair losses are (``σ`` the logistic function,
``ε`` = label_smoothing, ``τ`` = discopop_tau):

    sigmoid   : -log σ(d)                                               (DPO, arXiv:2305.18290)
    hinge     : max(0, 1 - d)
    exo_pair  : σ(d) (log σ(d) - log(1-ε)) + σ(-d) (log σ(-d) - log ε)  (EXO, ε > 0)
    nca_pair  : -log σ(β r_w) - ½ log σ(-β r_w) - ½ log σ(-β r_l)
    robust    : (-(1-ε) log σ(d) + ε log σ(-d)) / (1 - 2ε)              (cDPO, 0 <= ε < 0.5)
    bco_pair  : -log σ(β r_w) - log σ(-β r_l)
    sppo_hard : (r_w - 1/(2β))² + (r_l + 1/(2β))²
    apo_zero  : 1 - σ(β r_w) + σ(β r_l)
    apo_down  : σ(β r_w) + 1 - σ(d)
    discopop  : -log σ(d) (1 - σ(d/τ)) + exp(-d) σ(d/τ)

    loss = (1/P) Σ_pairs loss_pair  +  alpha * NLL,
    NLL  = -(Σ_{chosen non-ignored tokens} log p(y_t)) / #(chosen non-ignored tokens)   (only if compute_nll_loss)

These formulas, the normalisation by the number of pairs, and the metric definitions below match
``liger_kernel.chunked_loss.dpo_loss`` / ``fused_linear_preference`` 0.8.5 (identical in TRL 1.13's
vendored copy); the code here is an independent implementation.

Metrics (all detached, fp32), in order:
    chosen_logps (P,), rejected_logps (P,),
    chosen_logits_mean (), rejected_logits_mean ()  -- mean of the policy logits over *all* positions of the
        chosen / rejected rows, ignored (prompt/padding) positions included, i.e. Σ logits / (P · L · V),
        as in Liger; computed without a GEMM (see ``_metrics.row_logit_sums``),
    nll_loss () -- the NLL term above (0 when compute_nll_loss=False), not multiplied by alpha,
    chosen_rewards (P,) = β r_w, rejected_rewards (P,) = β r_l.

The loss of one pair (``ChunkedDPOLoss.group_loss``, summed over pairs by the base, ``_base``) is
``loss_pair / P - alpha * S_w / N_w`` with ``S_w`` the pair's chosen-row sum of token log-probs and ``N_w`` the
batch's chosen-token count (a batch constant).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._base import ChunkedLinearLoss, one_workspace

__all__ = ["ChunkedDPOLoss", "dpo_preference_loss", "SUPPORTED_DPO_LOSS_TYPES"]

SUPPORTED_DPO_LOSS_TYPES = (
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


def _check_options(loss_type: str, label_smoothing: float) -> None:
    # Same exception types/conditions as LigerFusedLinearDPOLoss.__init__ (ValueError for all of them).
    if loss_type not in SUPPORTED_DPO_LOSS_TYPES:
        raise ValueError(
            f"Unsupported loss_type: {loss_type!r}. Supported types are: {', '.join(SUPPORTED_DPO_LOSS_TYPES)}"
            + (
                " ('ipo' needs per-sample completion lengths to length-normalise the squared margin and is not "
                "supported by the chunked/fused DPO losses)"
                if loss_type == "ipo"
                else ""
            )
        )
    if loss_type == "exo_pair" and label_smoothing <= 0.0:
        raise ValueError("label_smoothing must be > 0 for loss_type='exo_pair'. The EXO paper recommends 1e-3.")
    if loss_type == "robust" and not (0.0 <= label_smoothing < 0.5):
        raise ValueError(f"label_smoothing must lie in [0.0, 0.5) for loss_type='robust'. Got {label_smoothing}.")


def dpo_preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    n_pairs: int,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    discopop_tau: float = 0.05,
):
    """Pairwise preference loss on per-sequence log-probs (see the module docstring for the formulas).

    Returns ``(loss, chosen_rewards, rejected_rewards)``; ``loss`` is the sum of per-pair losses / n_pairs.
    """
    _check_options(loss_type, label_smoothing)
    r_w = chosen_logps if ref_chosen_logps is None else chosen_logps - ref_chosen_logps
    r_l = rejected_logps if ref_rejected_logps is None else rejected_logps - ref_rejected_logps
    rew_w = beta * r_w
    rew_l = beta * r_l
    d = beta * (r_w - r_l)
    logsig = F.logsigmoid
    if loss_type == "sigmoid":
        losses = -logsig(d)
    elif loss_type == "hinge":
        losses = torch.relu(1 - d)
    elif loss_type == "exo_pair":
        eps = float(label_smoothing)
        log_p_w = torch.log1p(torch.tensor(-eps, dtype=d.dtype, device=d.device))
        log_p_l = torch.log(torch.tensor(eps, dtype=d.dtype, device=d.device))
        losses = torch.sigmoid(d) * (logsig(d) - log_p_w) + torch.sigmoid(-d) * (logsig(-d) - log_p_l)
    elif loss_type == "nca_pair":
        losses = -logsig(rew_w) - 0.5 * logsig(-rew_w) - 0.5 * logsig(-rew_l)
    elif loss_type == "robust":
        eps = float(label_smoothing)
        losses = (-(1 - eps) * logsig(d) + eps * logsig(-d)) / (1 - 2 * eps)
    elif loss_type == "bco_pair":
        losses = -logsig(rew_w) - logsig(-rew_l)
    elif loss_type == "sppo_hard":
        half_inv_beta = 0.5 / beta
        losses = (r_w - half_inv_beta) ** 2 + (r_l + half_inv_beta) ** 2
    elif loss_type == "apo_zero":
        losses = (1 - torch.sigmoid(rew_w)) + torch.sigmoid(rew_l)
    elif loss_type == "apo_down":
        losses = torch.sigmoid(rew_w) + (1 - torch.sigmoid(d))
    else:  # discopop
        modulation = torch.sigmoid(d / discopop_tau)
        losses = -logsig(d) * (1 - modulation) + torch.exp(-d) * modulation
    return losses.sum() / n_pairs, rew_w, rew_l


class _Batch(NamedTuple):
    """The batch constants of one DPO call: what a pair's loss reads besides its own sums."""

    n_pairs: int
    ref_chosen: torch.Tensor | None  # (P,) reference log-probs, or None without a reference model
    ref_rejected: torch.Tensor | None
    chosen_tokens: torch.Tensor  # () the chosen rows' non-ignored tokens: the NLL denominator


class ChunkedDPOLoss(ChunkedLinearLoss):
    """Token-chunked linear + DPO loss (plain autograd; see the module docstring for formulas/metrics).

    Paths: with a gradient, every loss type takes the one-pass path (gradients formed in the forward,
    ``_onepass``; the loss is a sum of per-pair terms by construction, ``_base``; a long pair's ``(V, H)`` sums
    or, where they exceed the budget, a chunk widened to its longest row or, on an accelerator, narrowed) unless that
    would hold more than the two-pass path by a budget (``_plan.held_budget_bytes``, a weight cast under autocast
    included), then the two-pass path (``_twopass``); ``one_pass=True``: always one pass, chunk unchanged;
    ``one_pass=False``: always two; without a gradient, one GEMM per token.

    Args (same names/defaults as ``LigerFusedLinearDPOLoss`` 0.8.5 and TRL 1.13 ``FusedLinearDPOLoss``):
        ignore_index: label value that marks positions without loss (prompt, padding).
        beta, alpha, compute_nll_loss, use_ref_model, average_log_prob, loss_type, label_smoothing,
        discopop_tau: as in Liger.
        compiled: accepted for compatibility and **ignored** -- nothing here is ever compiled.
        chunk_size: accepted for compatibility and **ignored** -- Liger's chunk_size counts *pairs* per chunk
            and the result does not depend on it; our memory is bounded by ``token_chunk_size`` instead.
        token_chunk_size: (our own keyword) number of non-ignored tokens projected per chunk; ``None`` = auto:
            one chunk's logits fill a memory budget of 128 MiB on CPU and 1 GiB on an accelerator
            (``_plan.resolve_token_chunk_size``; 1048 tokens for fp32 on CPU at V=32000).
        one_pass: (our own keyword) ``None`` (default): one pass within the held budget (auto chunks widened to
            a long pair's row where its sums would not fit, or on an accelerator narrowed until they do), else two;
            ``True`` forces the one-pass path (up to two extra ``(V, H)`` sums during its forward for pairs longer
            than a chunk: ``_onepass``); ``False`` forces the two-pass path: one more GEMM per policy token, but no
            gradient held from the forward to the backward.
        sweep: (our own keyword) ``"triton"`` runs each ``(chunk, V)`` block's softmax and gradient as two Triton
            kernels (``_triton``: three passes over the block instead of about ten; CUDA, no bias, not fp64; else
            the eager sweep, with a warning); ``"eager"`` (default) plain torch ops.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        beta: float = 0.1,
        alpha: float = 1.0,
        compute_nll_loss: bool = False,
        compiled: bool = True,
        use_ref_model: bool = True,
        average_log_prob: bool = False,
        chunk_size: int = 1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        discopop_tau: float = 0.05,
        token_chunk_size: int | None = None,
        one_pass: bool | None = None,
        sweep: str = "eager",
    ):
        _check_options(loss_type, label_smoothing)
        super().__init__(
            ignore_index, beta, compiled, use_ref_model, average_log_prob, chunk_size, token_chunk_size, one_pass,
            sweep,
        )  # fmt: skip
        self.alpha = alpha
        self.compute_nll_loss = compute_nll_loss
        self.loss_type = loss_type
        self.label_smoothing = label_smoothing
        self.discopop_tau = discopop_tau

    def extra_repr(self) -> str:
        return (
            f"loss_type={self.loss_type!r}, beta={self.beta}, use_ref_model={self.use_ref_model}, "
            f"token_chunk_size={self.token_chunk_size}, one_pass={self.one_pass}, sweep={self.sweep!r}"
        )

    @one_workspace
    def forward(
        self,
        lin_weight: torch.Tensor,
        _input: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        ref_input: torch.Tensor | None = None,
        ref_weight: torch.Tensor | None = None,
        ref_bias: torch.Tensor | None = None,
    ):
        """
        Args:
            lin_weight: ``(V, H)`` policy LM-head weight.
            _input: ``(2P, L, H)`` policy hidden states, chosen rows first.
            target: ``(2P, L)`` labels (``ignore_index`` where there is no loss).
            bias: ``(V,)`` or None.  ref_input / ref_weight / ref_bias: the reference model's counterparts
                (used only when ``use_ref_model``; never differentiated).
        Returns:
            ``(loss, (chosen_logps, rejected_logps, chosen_logits_mean, rejected_logits_mean, nll_loss,
            chosen_rewards, rejected_rewards))``.
        """
        n_pairs = target.shape[0] // 2
        if target.shape[0] != 2 * n_pairs or n_pairs == 0:
            raise ValueError(
                f"ChunkedDPOLoss expects 2 P rows (P chosen, then P rejected); got a batch of {target.shape[0]}"
            )
        return self.run(_input, lin_weight, bias, target, ref_input, ref_weight, ref_bias)

    def batch_of(self, target, ref_logps, device):
        n_pairs = target.shape[0] // 2
        refs = (None, None) if ref_logps is None else (ref_logps[:n_pairs], ref_logps[n_pairs:])
        return _Batch(n_pairs, *refs, (target[:n_pairs] != self.ignore_index).sum())

    def metrics(self, logps, sums, batch: _Batch, row_sums, target, weight):
        n_pairs = batch.n_pairs
        refs = (batch.ref_chosen, batch.ref_rejected)
        _, chosen_rewards, rejected_rewards = self._preference(logps[:n_pairs], logps[n_pairs:], batch, refs)
        if self.compute_nll_loss:
            nll = -sums[:n_pairs].sum() / batch.chosen_tokens
        else:  # Liger returns 0.0 / count here: NaN when every chosen row is fully ignored
            nll = torch.zeros((), dtype=sums.dtype, device=sums.device)
        denom = float(n_pairs * target.shape[1] * weight.shape[0])
        return (
            logps[:n_pairs],
            logps[n_pairs:],
            row_sums[:n_pairs].sum() / denom,
            row_sums[n_pairs:].sum() / denom,
            nll,
            chosen_rewards,
            rejected_rewards,
        )

    def group_of_row(self, batch_size, device):
        return torch.arange(batch_size, device=device) % (batch_size // 2)  # pair i: rows i and i + P

    def group_loss(self, sums, counts, group, batch: _Batch):
        """Pair ``group``'s term: its preference loss / P, plus ``alpha`` x its share of the NLL term."""
        seq = self.averaged(sums, counts)
        refs = tuple(None if r is None else r[group : group + 1] for r in (batch.ref_chosen, batch.ref_rejected))
        loss = self._preference(seq[0:1], seq[1:2], batch, refs)[0]
        if self.compute_nll_loss:
            loss = loss - self.alpha * sums[0] / batch.chosen_tokens
        return loss

    def _preference(self, chosen, rejected, batch: _Batch, refs):
        return dpo_preference_loss(
            chosen,
            rejected,
            *refs,
            batch.n_pairs,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            discopop_tau=self.discopop_tau,
        )

r"""Token-chunked KTO loss on top of a linear LM head, in plain PyTorch autograd.

Drop-in replacement for ``liger_kernel.chunked_loss.LigerFusedLinearKTOLoss`` (liger-kernel 0.8.5) and
TRL 1.13's vendored ``trl.losses.FusedLinearKTOLoss``: same constructor keywords/defaults, same keyword
``forward`` call TRL's KTOTrainer makes (``_input=, lin_weight=, target=, bias=, preference_labels=,
ref_input=, ref_weight=, ref_bias=, kl=``), same ``(loss, (6 metrics))`` return -- without ``torch.func`` /
``torch.compile``.

KTO (Kahneman-Tversky Optimisation, arXiv:2402.01306), unpaired: each of the ``B`` rows is a completion
with a boolean label ``u_i`` (True = desirable).  With ``logp_i`` the (summed, or averaged if
``average_log_prob``) target log-prob of row ``i`` over its non-ignored tokens and
``r_i = logp_i - logp_ref_i`` (``r_i = logp_i`` when ``use_ref_model=False``), ``z_0`` = ``kl`` (one value for
every row -- a scalar, a 0-dim or a one-element tensor such as ``(1,)`` -- or a ``(B,)`` tensor, one per row; 0 when
``None``) and ``s_i = +1`` if ``u_i`` else ``-1``:

    loss_i = 1 - σ(β (r_i - z_0) s_i)          i.e.  1 - σ(β (r_i - z_0))  for desirable rows,
                                                      1 - σ(β (z_0 - r_i))  for undesirable rows
    loss   = (1/B) Σ_i loss_i

(matches ``liger_kernel.chunked_loss.kto_loss`` 0.8.5 / TRL 1.13 ``trl/losses/kto_loss.py``; independent
implementation).

Metrics (detached fp32 scalars), in order:
    chosen_logps_sum   = Σ_{u_i} logp_i,          rejected_logps_sum   = Σ_{¬u_i} logp_i,
    chosen_logits_sum  = Σ_{u_i} Σ_{t,v} logits,  rejected_logits_sum  = Σ_{¬u_i} Σ_{t,v} logits
        (over *all* positions, ignored ones included, as in Liger; computed without a GEMM),
    chosen_rewards_sum = Σ_{u_i} β r_i,           rejected_rewards_sum = Σ_{¬u_i} β r_i.

Every row is its own group: the base (``_base``) sums ``loss_i / B`` over rows (``ChunkedKTOLoss.group_loss``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._base import ChunkedLinearLoss, one_workspace

__all__ = ["ChunkedKTOLoss", "kto_preference_loss"]


def kto_preference_loss(logps, preference_labels, ref_logps=None, beta=0.1, kl=None):
    """Returns ``(loss, chosen_rewards_sum, rejected_rewards_sum)`` (see the module docstring)."""
    labels = preference_labels.to(device=logps.device, dtype=torch.bool)
    logratios = logps if ref_logps is None else logps - ref_logps
    sign = labels.to(logratios.dtype) * 2 - 1
    z = logratios if kl is None else logratios - kl
    losses = 1 - torch.sigmoid(beta * z * sign)
    rewards = beta * logratios
    chosen_rewards_sum = (rewards * labels).sum()
    rejected_rewards_sum = (rewards * ~labels).sum()
    return losses.sum() / logps.shape[0], chosen_rewards_sum, rejected_rewards_sum


def _batch_kl(kl, batch_size: int, device):
    """``kl`` as the loss reads it: None, a float, a detached 0-dim tensor (one value for every row: a 0-dim, ``(1,)``
    or any one-element tensor, as Liger broadcasts it), or a detached ``(B,)`` tensor (one value per row).

    A ``(1,)`` kl is what Liger-Kernel's own KTO tests pass and what TRL 1.12's KTOTrainer builds without a KL term
    (``torch.zeros(1)``); taken per row it left rows 1+ without a term (issue 31).  Any other shape is refused: the
    fused losses broadcast it against a chunk of rows, which adds up terms of the wrong rows."""
    if not isinstance(kl, torch.Tensor):
        return kl
    kl = kl.detach().to(device)
    if kl.numel() == 1:
        return kl.reshape(())
    if kl.shape == (batch_size,):
        return kl
    raise ValueError(
        f"kl must be a scalar, a one-element tensor or a (B,) tensor with B = {batch_size} rows (one KL estimate "
        f"per row), got shape {tuple(kl.shape)}: pass kl.mean() for one estimate, or kl.reshape({batch_size}) if it "
        "holds one value per row"
    )


class _Batch(NamedTuple):
    """The batch constants of one KTO call: what a row's loss reads besides its own sum."""

    labels: torch.Tensor  # (B,) bool
    ref_logps: torch.Tensor | None  # (B,) or None
    kl: torch.Tensor | float | None  # detached 0-dim or (B,) (_batch_kl), a float, or None
    size: int


class ChunkedKTOLoss(ChunkedLinearLoss):
    """Token-chunked linear + KTO loss (plain autograd; see the module docstring for formulas/metrics).

    Paths: as ``ChunkedDPOLoss``, with a row (its loss reads only its own log-prob; ``kl`` is detached) in place of
    a pair.

    Args (same names/defaults as ``LigerFusedLinearKTOLoss`` 0.8.5 and TRL 1.13 ``FusedLinearKTOLoss``):
        ignore_index, beta, use_ref_model, average_log_prob: as in Liger.
        compiled: accepted and **ignored** (nothing is compiled).
        chunk_size: accepted and **ignored** (Liger's chunk counts rows; the result does not depend on it).
        token_chunk_size: (our own keyword) non-ignored tokens projected per chunk; ``None`` = auto (a memory
            budget per device type, see ``ChunkedDPOLoss``).
        one_pass: (our own keyword) ``None``: by the held budget (auto chunks widened to a long row where its
            sum would not fit, or on an accelerator narrowed until it does); ``True`` / ``False`` force one / two passes
            (see ``ChunkedDPOLoss``).
        sweep: (our own keyword) ``"eager"`` or ``"triton"`` (see ``ChunkedDPOLoss``).
    """

    def __init__(
        self,
        ignore_index: int = -100,
        beta: float = 0.1,
        compiled: bool = True,
        use_ref_model: bool = False,
        average_log_prob: bool = False,
        chunk_size: int = 1,
        token_chunk_size: int | None = None,
        one_pass: bool | None = None,
        sweep: str = "eager",
    ):
        super().__init__(
            ignore_index, beta, compiled, use_ref_model, average_log_prob, chunk_size, token_chunk_size, one_pass,
            sweep,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"beta={self.beta}, use_ref_model={self.use_ref_model}, token_chunk_size={self.token_chunk_size}, "
            f"one_pass={self.one_pass}, sweep={self.sweep!r}"
        )

    @one_workspace
    def forward(
        self,
        _input: torch.Tensor,
        lin_weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None = None,
        preference_labels: torch.Tensor | None = None,
        ref_input: torch.Tensor | None = None,
        ref_weight: torch.Tensor | None = None,
        ref_bias: torch.Tensor | None = None,
        kl: torch.Tensor | None = None,
    ):
        """
        Args:
            _input: ``(B, L, H)`` hidden states; lin_weight ``(V, H)``; target ``(B, L)``; bias ``(V,)``/None.
            preference_labels: ``(B,)`` bool (True = desirable); required (Liger asserts it, so do we).
            ref_input / ref_weight / ref_bias: reference model counterparts (only if ``use_ref_model``).
            kl: KL estimate ``z_0`` (treated as a constant): a scalar or one-element tensor (e.g. ``(1,)``) for all
                rows, a ``(B,)`` tensor per row, or None; another shape raises ``ValueError``.
        Returns:
            ``(loss, (chosen_logps_sum, rejected_logps_sum, chosen_logits_sum, rejected_logits_sum,
            chosen_rewards_sum, rejected_rewards_sum))``.
        """
        if preference_labels is None:
            # Same exception type as Liger's `assert preference_labels is not None, ...`
            raise AssertionError("preference_labels must be provided for unpaired preference loss")
        return self.run(
            _input, lin_weight, bias, target, ref_input, ref_weight, ref_bias, labels=preference_labels, kl=kl
        )

    def batch_of(self, target, ref_logps, device, labels, kl):
        labels = labels.to(device=device, dtype=torch.bool)
        return _Batch(labels, ref_logps, _batch_kl(kl, target.shape[0], device), target.shape[0])

    def metrics(self, logps, sums, batch: _Batch, row_sums, target, weight):
        labels = batch.labels
        _, chosen_rewards_sum, rejected_rewards_sum = kto_preference_loss(
            logps, labels, batch.ref_logps, self.beta, batch.kl
        )
        return (
            (logps * labels).sum(),
            (logps * ~labels).sum(),
            (row_sums * labels).sum(),
            (row_sums * ~labels).sum(),
            chosen_rewards_sum,
            rejected_rewards_sum,
        )

    def group_loss(self, sums, counts, group, batch: _Batch):
        """Row ``group``'s term: ``loss_i / B`` (``kl`` is a detached batch constant)."""

        def one(t):  # this row's entry of a per-row constant (a scalar kl is the same for every row)
            return t[group : group + 1] if isinstance(t, torch.Tensor) and t.dim() > 0 else t

        logps = self.averaged(sums, counts)
        loss = kto_preference_loss(logps, one(batch.labels), one(batch.ref_logps), self.beta, one(batch.kl))[0]
        return loss / batch.size

"""Token-chunked, plain-autograd replacements for the fused Liger/TRL DPO and KTO losses.

No ``torch.func`` and no ``torch.compile`` anywhere in the loss path (so they work inside
``DistributedDataParallel.forward``), and no import of ``trl`` or ``liger_kernel``.  Layers, each importing only
those below it (as Liger's ``chunked_loss/``):

* ``dpo.py``, ``kto.py`` -- one loss each: its formula, the loss of one group, its metrics;
* ``_base.py`` -- the base class: the forward every loss shares, a loss as a sum of per-group terms, which path runs;
* ``_onepass.py`` (gradients formed in the forward) and ``_twopass.py`` (the backward recomputes the logits; also
  :func:`sequence_logprob_sums`, the per-row log-probs without a loss, e.g. KTO's KL rows);
* ``_plan.py`` -- how one call runs: the token chunk, the compute dtype, the memory budget, the sweep;
* ``_gemm.py`` (the ``(chunk, V)`` logits buffers, fp32 accumulation), ``_softmax.py`` (the in-place softmax),
  ``_tokens.py`` (which tokens carry a loss, per-row sums), ``_metrics.py`` (the logit sums, without a GEMM);
* ``_tiles.py`` -- the softmax and gradient sweep of a half-precision CPU chunk on fp32 row tiles (the default
  there: the half block is then the only ``(chunk, V)`` block);
* ``_workspace.py`` -- one loss call's scratch buffers, shared by its passes (no page faults twice);
* ``_triton.py`` -- ``sweep="triton"`` only: the softmax and gradient sweep of a chunk as two Triton kernels
  (imported on first use; the only module that imports anything beyond torch).
"""

from ._twopass import sequence_logprob_sums
from .dpo import ChunkedDPOLoss
from .kto import ChunkedKTOLoss

__all__ = ["ChunkedDPOLoss", "ChunkedKTOLoss", "sequence_logprob_sums"]

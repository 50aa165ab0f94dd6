"""Token-chunked, plain-autograd replacements for the fused Liger/TRL DPO and KTO losses.

No ``torch.func`` and no ``torch.compile`` anywhere in the loss path (so they work inside
``DistributedDataParallel.forward``), and no import of ``trl`` or ``liger_kernel``.
"""

from .dpo import ChunkedDPOLoss
from .kto import ChunkedKTOLoss

__all__ = ["ChunkedDPOLoss", "ChunkedKTOLoss"]

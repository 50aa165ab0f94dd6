"""How far apart the ranks' weights are, where their exact digests differ: in ulps of each weight's largest element.

A digest says *whether* two copies differ, not by how much. Ranks that round differently (mixed GPUs, MIG slices,
other CPU kinds or thread counts, whose clipping norm or optimizer kernels round in another order) hold copies whose
elements differ by about one unit in the last place (ulp) of the numbers the update rounded, at most the ulp of the
weight's largest element; ranks that trained apart (a missed all-reduce, a skipped or extra update) differ by a whole
update: one AdamW step at lr 1e-6 is ~8 ulps of a weight whose largest element is 1 and ~70 of one whose largest is
0.25. Per-element ulps would not do: an element near zero that two ranks round to 1e-10 and 0 is billions of its own
ulps apart. So, for the weights whose digests differ (the same list on every rank: it comes from the gathered
table), one ``all_reduce(MAX)`` of ``[x, -x]`` per block (fp32, which holds a bf16, fp16 or fp32 value exactly) gives
each element's largest and smallest value over the ranks, hence the weight's largest magnitude; the widest spread
over that magnitude's ulp is the answer.

Never a hang: every rank walks the same weights in the same blocks through one buffer allocated before the first
collective, and a rank that fails to fill a block sends it flagged instead, so the answer is "unknown" on every rank
alike. A healthy job whose replicas are bitwise equal never gets here: this costs nothing there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

BLOCK = 1 << 18  # elements per all_reduce: a 2 MiB buffer for fp32, bf16 and fp16 weights (4 MiB for fp64)
ROUNDING_ULPS = 4.0  # at most this far apart everywhere: the ranks round differently; further: they trained apart


def ulp(magnitude: float, dtype: torch.dtype) -> float:
    """The unit in the last place of ``magnitude`` in ``dtype`` (its smallest normal's for zero or less)."""
    info = torch.finfo(dtype)
    return 2.0 ** math.floor(math.log2(max(magnitude, info.tiny))) * info.eps


def _exact(dtype: torch.dtype) -> torch.dtype:
    """A dtype that holds every ``dtype`` value exactly and that every backend reduces: fp32, or fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def spreads(tensors: Sequence[torch.Tensor], device: torch.device, group=None) -> list[float] | None:
    """Per tensor, the largest difference between two ranks' copies of one of its elements, in ulps of its largest
    element; ``None`` when some rank could not read its copy (every rank gets the same answer). A collective: call on
    every rank with tensors of the same shapes and dtypes, in the same order."""
    buffers = {
        kind: torch.empty(2 * BLOCK + 1, dtype=kind, device=device) for kind in {_exact(t.dtype) for t in tensors}
    }
    flagged = torch.zeros((), dtype=torch.float64, device=device)
    widest, largest = [], []
    for tensor in tensors:
        flat, buffer = None, buffers[_exact(tensor.dtype)]
        spread = torch.zeros((), dtype=torch.float64, device=device)
        magnitude = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, tensor.numel(), BLOCK):
            size = min(BLOCK, tensor.numel() - start)
            block = buffer[: 2 * size + 1]
            try:
                flat = tensor.detach().reshape(-1) if flat is None else flat
                block[:size].copy_(flat[start : start + size])
                block[size : 2 * size].copy_(block[:size]).neg_()
                block[2 * size] = 0
            except Exception:  # this rank cannot say; it still takes part, flagged
                block.zero_()
                block[2 * size] = 1
            dist.all_reduce(block, op=dist.ReduceOp.MAX, group=group)
            high, low = block[:size].double(), block[size : 2 * size].double()  # max, and -min, over the ranks
            spread = torch.maximum(spread, (high + low).max())
            magnitude = torch.maximum(magnitude, torch.maximum(high, low).max())
            flagged = torch.maximum(flagged, block[2 * size].double())
        widest.append(spread)
        largest.append(magnitude)
    if not tensors:
        return []
    if float(flagged):
        return None
    pairs = torch.stack([torch.stack(widest), torch.stack(largest)]).cpu().tolist()
    return [s / ulp(m, t.dtype) for s, m, t in zip(*pairs, tensors)]

"""Fingerprints: a few float64 numbers per tensor that ranks can compare instead of the tensors themselves.

Gradients. After DDP's all-reduce every rank holds bitwise-identical gradients, and the fingerprint is computed by the
same deterministic reductions on identical bits, so on homogeneous ranks the fingerprints are bitwise equal. Ranks
on different hardware or thread counts may sum in another order; in float64 that moves a sum by at most ~n*2**-53 of
its scale (~1e-7 for a 10**9-element parameter, far less in practice). We accept a difference up to ``rtol`` = 1e-7
of the parameter's L1 norm (of the sum of squares, for that column). A real desync (ranks that never all-reduced, or
one that missed a micro-batch) differs by O(1e-3..1) of the norm: four orders of magnitude above the tolerance.

Weights (at a checkpoint). DDP broadcasts them at the start and every rank applies the same update to the same
gradients, so they stay bitwise equal: compared exactly, on the tensor's own-precision sum (one read at memory speed;
the gradients' float64 upcast reads ~20x slower on CPU). A desync moves every element that receives a gradient, far
above the sum's last bit.

A tensor that cannot be read the same way on every rank (sparse, a ``DTensor`` shard, meta, a tensor subclass,
anything that raises) is marked *not compared*, never guessed at. ``NaN`` equals ``NaN``; ``inf`` the same ``inf``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

# Columns. PRESENT: GRAD = a value, NONE = no gradient, SKIPPED = not readable here (not compared).
PRESENT, SUM, ABS_SUM, SUM_SQ, SAMPLED_DOT = range(5)
COLUMNS = 5
GRAD, NONE, SKIPPED = 1.0, 0.0, -1.0
DEFAULT_RTOL = 1e-7
HINT = (
    "Each rank is training its own copy of the model. Is liger_ddp_patch applied? See `liger-ddp-patch status` "
    "(TRL 1.9-1.13 DPO/KTO with use_liger_kernel=True need it under DDP)."
)
_SAMPLES = 64  # fixed-index samples per tensor for the weighted dot (catches permuted gradients)
_CHUNK = 1 << 24  # elements upcast to float64 at a time on a GPU: bounds the temporary memory to 128 MiB
_CPU_CHUNK = 1 << 18  # on CPU: 2 MiB, so the three reductions read the upcast chunk from cache (about 3x faster)


@functools.lru_cache(maxsize=256)
def _sampler(numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    count = min(numel, _SAMPLES)
    index = torch.linspace(0, numel - 1, count, dtype=torch.float64).round().long().to(device)
    weight = (1.0 + torch.arange(count, dtype=torch.float64) / count).to(device)  # distinct weights in [1, 2)
    return index, weight


def readable(tensor: torch.Tensor) -> bool:
    """A plain dense floating-point tensor with storage: what every rank reduces the same way."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)  # not a DTensor shard or another subclass
        and tensor.layout == torch.strided  # not sparse
        and not tensor.is_meta
        and tensor.is_floating_point()
    )


def _row(total: torch.Tensor, l1: torch.Tensor | None, squares: torch.Tensor | None, dot: torch.Tensor) -> torch.Tensor:
    """One row from scalar tensors on one device (``None``: a zero column); one ``stack``, no host round trip."""
    zero = torch.zeros_like(dot)
    columns = (torch.ones_like(dot), total, zero if l1 is None else l1, zero if squares is None else squares, dot)
    return torch.stack([c.to(torch.float64) for c in columns])


def _skipped() -> torch.Tensor:
    return torch.tensor([SKIPPED, 0, 0, 0, 0], dtype=torch.float64)


def _sampled_dot(flat: torch.Tensor) -> torch.Tensor:
    index, weight = _sampler(flat.numel(), flat.device)
    return torch.dot(flat[index].to(torch.float64), weight)


def fingerprint(grad: torch.Tensor | None) -> torch.Tensor:
    """``[COLUMNS]`` float64: present, sum, L1 norm, sum of squares, weighted fixed-index dot (float64 throughout)."""
    if grad is None:
        return torch.zeros(COLUMNS, dtype=torch.float64)
    try:
        if not readable(grad):
            return _skipped()
        flat = grad.detach().reshape(-1)
        if not flat.numel():
            return torch.tensor([GRAD, 0, 0, 0, 0], dtype=torch.float64)
        zero = torch.zeros((), dtype=torch.float64, device=flat.device)
        total, l1, squares = zero, zero, zero
        size = _CHUNK if flat.device.type != "cpu" else _CPU_CHUNK
        buffer = torch.empty(min(size, flat.numel()), dtype=torch.float64, device=flat.device)
        for start in range(0, flat.numel(), size):
            chunk = buffer[: min(size, flat.numel() - start)].copy_(flat[start : start + size])
            total = total + chunk.sum()
            l1 = l1 + torch.linalg.vector_norm(chunk, 1)
            squares = squares + torch.dot(chunk, chunk)
        return _row(total, l1, squares, _sampled_dot(flat))
    except Exception:  # whatever this tensor is, it is not something we can compare: say so, never stop the job
        return _skipped()


def _own_sum(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's sum in its own precision (fp32 for half types), or ``None``: not readable alike on every rank."""
    try:
        if not readable(weight):
            return None
        flat = weight.detach().reshape(-1)
        return flat.sum(dtype=torch.float32) if flat.element_size() < 4 else flat.sum()
    except Exception:
        return None


def weight_table(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(weights), COLUMNS]`` float64 on the CPU, for an exact comparison: present and the own-precision sum.

    One read of each weight and one small copy for them all: at a checkpoint the sums are the cost (a weight that
    moved on one rank moves its sum; permutations, which the gradients' sampled dot is for, are not how weights
    drift)."""
    sums = [_own_sum(w) for w in weights]
    out = torch.zeros(len(weights), COLUMNS, dtype=torch.float64)
    read = [i for i, s in enumerate(sums) if s is not None]
    out[:, PRESENT] = SKIPPED
    if read:
        out[read, PRESENT] = GRAD
        out[read, SUM] = torch.stack([sums[i].to(torch.float64) for i in read]).cpu()
    return out


def weight_fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """One weight's row of :func:`weight_table`."""
    return weight_table([weight])[0]


def table(tensors: Sequence[torch.Tensor | None], device: torch.device | str = "cpu", weights: bool = False):
    """``[len(tensors), COLUMNS]`` float64 on ``device`` (gradients: a small copy per row, no host synchronisation)."""
    if weights:
        return weight_table(tensors).to(device)
    if not tensors:
        return torch.zeros(0, COLUMNS, dtype=torch.float64, device=device)
    return torch.stack([fingerprint(t).to(device) for t in tensors])


def fingerprints(grads: Sequence[torch.Tensor | None], device: torch.device | str = "cpu") -> torch.Tensor:
    """The gradients' table (:func:`table`)."""
    return table(grads, device)


def _close(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rtol: float) -> torch.Tensor:
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return same | ((a - b).abs() <= rtol * scale.abs())


def compared(gathered: torch.Tensor) -> int:
    """How many rows every rank could read and held a value for: what a comparison really covered."""
    return int((gathered[:, :, PRESENT] == GRAD).all(dim=0).sum()) if gathered.numel() else 0


def disagreements(gathered: torch.Tensor, rtol: float = DEFAULT_RTOL) -> dict[int, list[int]]:
    """``{row: [ranks whose fingerprint differs from rank 0's]}`` for a ``[world, n, COLUMNS]`` table.

    A row some rank could not read is not compared (see :func:`compared`); one rank holding a gradient where
    another holds none is a difference. ``rtol=0``: exact (weights)."""
    gathered = gathered.detach().to("cpu", torch.float64)
    ref = gathered[0]
    readable_everywhere = (gathered[:, :, PRESENT] != SKIPPED).all(dim=0)
    out: dict[int, list[int]] = {}
    for rank in range(1, gathered.shape[0]):
        other = gathered[rank]
        ok = ref[:, PRESENT] == other[:, PRESENT]
        scale = torch.maximum(ref[:, ABS_SUM].abs(), other[:, ABS_SUM].abs())
        values = (
            _close(ref[:, SUM], other[:, SUM], scale, rtol)
            & _close(ref[:, ABS_SUM], other[:, ABS_SUM], scale, rtol)
            & _close(ref[:, SUM_SQ], other[:, SUM_SQ], torch.maximum(ref[:, SUM_SQ], other[:, SUM_SQ]), rtol)
            & _close(ref[:, SAMPLED_DOT], other[:, SAMPLED_DOT], 2 * scale, rtol)
        )
        ok &= values | (ref[:, PRESENT] != GRAD)  # no gradient on both: nothing more to compare
        ok |= ~readable_everywhere
        for index in torch.nonzero(~ok).flatten().tolist():
            out.setdefault(index, []).append(rank)
    return out


def describe(
    names: Sequence[str],
    bad: dict[int, list[int]],
    world: int,
    step: int | None,
    first: int = 5,
    what: str = "Gradients",
    hint: str = HINT,
    where: str | None = None,
) -> str:
    """The message for :func:`disagreements`' answer (``where``: instead of "at optimizer step N")."""
    listed = [names[i] for i in sorted(bad)]
    ranks = sorted({r for rs in bad.values() for r in rs})
    shown = ", ".join(listed[:first]) + (f" (+{len(listed) - first} more)" if len(listed) > first else "")
    if where is None:
        where = f"at optimizer step {step}" if step is not None else "at this optimizer step"
    return (
        f"{what} are NOT synchronised across the {world} data-parallel ranks {where}: "
        f"{len(listed)} of {len(names)} parameters differ between rank 0 and rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))}: {shown}. {hint}"
    ).rstrip()

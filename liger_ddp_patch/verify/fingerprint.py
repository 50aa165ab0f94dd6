"""Fingerprints: a few numbers per tensor that ranks can compare instead of the tensors themselves.

Gradients (float64 rows, compared within a tolerance). After DDP's all-reduce every rank holds bitwise-identical
gradients, but ranks on other hardware or thread counts may sum them in another order; in float64 that moves a sum
by at most ~n*2**-53 of its scale (~1e-7 for a 10**9-element parameter, far less in practice). We accept a difference
up to ``rtol`` = 1e-7 of the parameter's L1 norm (of the sum of squares, for that column). A real desync (ranks that
never all-reduced, or one that missed a micro-batch) differs by O(1e-3..1) of the norm: four orders of magnitude
above the tolerance.

Weights (int64 rows, compared exactly). DDP broadcasts them at the start and every rank applies the same update to
the same gradients, so they stay bitwise equal, and a one-rank AdamW step at lr 1e-6 moves them by far less than any
float tolerance would forgive. The digest is therefore exact, and it must be the same on every rank whatever its
hardware: the sum of the tensor's raw bits read as 64-bit integers, modulo 2**64. Integer addition is associative
and commutative, so no thread count, SIMD width, SM count or ``torch.compile`` can change it (a float sum can: a
4M-element fp32 sum gives -28.62053108 on 1 thread and -28.62053680 on 2); it reads the weight once, at the speed of
a float sum. Two different weights collide only if their differences cancel exactly modulo 2**64. Where digests
differ, :mod:`.distance` measures how far apart the ranks really are.

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
DIGEST = 1  # the weights' table: PRESENT, DIGEST
WEIGHT_COLUMNS = 2
GRAD, NONE, SKIPPED = 1.0, 0.0, -1.0
DEFAULT_RTOL = 1e-7
HINT = (
    "Each rank is training its own copy of the model. Is liger_ddp_patch applied? See `liger-ddp-patch status` "
    "(TRL 1.9-1.13 DPO/KTO with use_liger_kernel=True need it under DDP)."
)
_SAMPLES = 64  # fixed-index samples per tensor for the weighted dot (catches permuted gradients)
_CHUNK = 1 << 24  # elements upcast to float64 at a time on a GPU: bounds the temporary memory to 128 MiB
_CPU_CHUNK = 1 << 18  # on CPU: 2 MiB, so the three reductions read the upcast chunk from cache (about 3x faster)
_WORDS = (torch.int64, torch.int32, torch.int16, torch.int8)  # the widest that tiles the tensor's bytes is read


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


def words(flat: torch.Tensor) -> torch.Tensor:
    """``flat``'s bytes as the widest signed integers that tile them (a view: nothing is copied)."""
    for word in _WORDS:
        try:
            return flat.view(word)
        except RuntimeError:  # bytes not a multiple of the width, or an offset not aligned to it
            continue
    raise TypeError(f"cannot read a {flat.dtype} tensor as integers")


def digest(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's raw bits summed as integers modulo 2**64 (an int64 scalar on its device), or ``None``: not
    readable alike on every rank. Exact and independent of summation order (see the module's docstring)."""
    try:
        if not readable(weight):
            return None
        flat = weight.detach().reshape(-1)  # logical order: a non-contiguous weight is read as its values are laid out
        return words(flat).sum(dtype=torch.int64)
    except Exception:
        return None


def weight_fingerprint(weight: torch.Tensor) -> torch.Tensor:
    """``[WEIGHT_COLUMNS]`` int64: present and the exact digest (:func:`digest`)."""
    found = digest(weight)
    if found is None:
        return torch.tensor([int(SKIPPED), 0], dtype=torch.int64)
    return torch.stack([torch.ones_like(found), found])


def _stacked(rows: list[torch.Tensor], device: torch.device | str, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` (each on its tensor's device) as one table on ``device``: one stack and one copy per device the rows
    are on, so that on a GPU the check waits on the host once, not once per row."""
    out = torch.zeros(len(rows), columns, dtype=dtype, device=device)
    by_device: dict[torch.device, list[int]] = {}
    for index, row in enumerate(rows):
        by_device.setdefault(row.device, []).append(index)
    for indices in by_device.values():
        out[indices] = torch.stack([rows[i] for i in indices]).to(device)
    return out


def table(
    tensors: Sequence[torch.Tensor | None],
    device: torch.device | str = "cpu",
    weights: bool = False,
    compare: Sequence[bool] | None = None,
) -> torch.Tensor:
    """``[len(tensors), COLUMNS]`` float64 of gradient fingerprints, or with ``weights`` ``[len(tensors),
    WEIGHT_COLUMNS]`` int64 of weight digests, on ``device``. ``compare[i]`` false: row ``i`` is not read (marked not
    compared), as for a parameter DDP does not synchronise."""
    read = fingerprint if not weights else weight_fingerprint
    width, dtype = (WEIGHT_COLUMNS, torch.int64) if weights else (COLUMNS, torch.float64)
    skipped = torch.tensor([SKIPPED] + [0] * (width - 1), dtype=dtype)
    rows = [read(t) if compare is None or compare[i] else skipped for i, t in enumerate(tensors)]
    return _stacked(rows, device, width, dtype)


def fingerprints(grads: Sequence[torch.Tensor | None], device: torch.device | str = "cpu") -> torch.Tensor:
    """The gradients' table (:func:`table`)."""
    return table(grads, device)


def weight_table(weights: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> torch.Tensor:
    """The weights' table (:func:`table`)."""
    return table(weights, device, weights=True)


def _close(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rtol: float) -> torch.Tensor:
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return same | ((a - b).abs() <= rtol * scale.abs())


def compared(gathered: torch.Tensor) -> int:
    """How many rows every rank could read and held a value for: what a comparison really covered."""
    return int((gathered[:, :, PRESENT] == GRAD).all(dim=0).sum()) if gathered.numel() else 0


def disagreements(gathered: torch.Tensor, rtol: float = DEFAULT_RTOL) -> dict[int, list[int]]:
    """``{row: [ranks whose fingerprint differs from rank 0's]}`` for a ``[world, n, columns]`` table.

    A row some rank could not read is not compared (see :func:`compared`); one rank holding a gradient where
    another holds none is a difference. An int64 table (weights) is compared exactly, whatever ``rtol`` says."""
    exact = not gathered.is_floating_point()
    gathered = gathered.detach().cpu()
    if not exact:
        gathered = gathered.to(torch.float64)
    ref = gathered[0]
    readable_everywhere = (gathered[:, :, PRESENT] != SKIPPED).all(dim=0)
    out: dict[int, list[int]] = {}
    for rank in range(1, gathered.shape[0]):
        other = gathered[rank]
        ok = ref[:, PRESENT] == other[:, PRESENT]
        if exact:
            values = (ref[:, 1:] == other[:, 1:]).all(dim=1)
        else:
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
    reference: int = 0,
) -> str:
    """The message for :func:`disagreements`' answer (``where``: instead of "at optimizer step N"; ``reference``: the
    rank the others were compared with)."""
    listed = [names[i] for i in sorted(bad)]
    ranks = sorted({r for rs in bad.values() for r in rs})
    shown = ", ".join(listed[:first]) + (f" (+{len(listed) - first} more)" if len(listed) > first else "")
    if where is None:
        where = f"at optimizer step {step}" if step is not None else "at this optimizer step"
    return (
        f"{what} are NOT synchronised across the {world} data-parallel ranks {where}: "
        f"{len(listed)} of {len(names)} parameters differ between rank {reference} and "
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {shown}. {hint}"
    ).rstrip()

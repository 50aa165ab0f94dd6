"""The one collective a check runs: every rank's small table to every rank, on the device the backend needs.

NCCL takes CUDA tensors, XCCL XPU tensors, HCCL NPU tensors, gloo and MPI CPU tensors; a multi-device backend
(``cpu:gloo,cuda:nccl``) takes CPU ones. The table travels as bytes, so a backend without float64 collectives (HCCL)
carries it too.

Never a rank left waiting: the buffers are allocated before any tensor is read, and whatever fails on one rank
between reading its first tensor and the gather (a fingerprint, a copy to the host or into the buffer) is sent in
place of its table: a status byte and the error's text. Every rank enters the one ``all_gather`` exactly once, and
every rank learns which rank could not check and why. Whatever the collective itself raises, it raises on every rank
alike (same arguments, same group).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

_CPU_BACKENDS = ("gloo", "mpi")
HEADER = 256  # bytes before a rank's table: its status, then why it failed (UTF-8)
_SENT = 1  # the status byte of a rank that sent its table; 0: it could not


class Gathered(NamedTuple):
    tables: torch.Tensor  # [world, *shape] on the CPU; a rank that could not check holds zeros
    failed: dict[int, str]  # the ranks that could not check: why, as each said it


def several_ranks(group=None) -> bool:
    """A process group of two or more ranks: something to compare."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def device(group=None) -> torch.device:
    """Where ``group``'s backend wants its tensors: CPU for gloo/MPI and mixed backends, else the accelerator."""
    backend = str(dist.get_backend(group)).lower()
    if backend in _CPU_BACKENDS or ":" in backend:  # "cpu:gloo,cuda:nccl": a CPU tensor goes through gloo
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6: CUDA, XPU, NPU (torch_npu), MPS ...
    if accelerator is not None and accelerator.is_available():
        kind = accelerator.current_accelerator()
        return torch.device(kind.type, accelerator.current_device_index())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exchange(build: Callable[[torch.device], torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype, group=None):
    """Every rank's ``build(device)`` (a ``shape`` x ``dtype`` table) to every rank, as :class:`Gathered`."""
    where = device(group)
    size = math.prod(shape) * dtype.itemsize
    payload = torch.zeros(HEADER + size, dtype=torch.uint8, device=where)
    parts = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]
    try:
        local = build(where)
        if tuple(local.shape) != tuple(shape) or local.dtype != dtype:
            raise ValueError(f"a {tuple(local.shape)} {local.dtype} table, not {tuple(shape)} {dtype}")
        payload[HEADER:].copy_(local.detach().contiguous().reshape(-1).view(torch.uint8))
        payload[0] = _SENT  # last: a payload half written says "could not"
    except Exception as exc:  # this rank sends why instead; the others are not left waiting for it
        _say(payload, exc)
    dist.all_gather(parts, payload, group=group)
    gathered = torch.stack(parts).cpu()
    failed = {rank: _said(row) for rank, row in enumerate(gathered) if int(row[0]) != _SENT}
    tables = gathered[:, HEADER:].contiguous().view(dtype).reshape(len(parts), *shape)
    return Gathered(tables, failed)


def _say(payload: torch.Tensor, exc: BaseException) -> None:
    """Write ``exc`` into ``payload``'s header, marked not sent (best effort: a zero header says the same)."""
    try:
        text = f"{type(exc).__name__}: {exc}".encode()[: HEADER - 1]
        payload[0] = 0
        payload[1 : 1 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    except Exception:
        pass


def _said(row: torch.Tensor) -> str:
    text = bytes(row[1:HEADER].tolist()).rstrip(b"\0").decode(errors="replace")
    return text or "no reason given"

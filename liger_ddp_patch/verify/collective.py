"""The one collective the checks run: every rank's small table to every rank, on the device the backend needs.

NCCL takes CUDA tensors, XCCL XPU tensors, HCCL NPU tensors, gloo and MPI CPU tensors; a multi-device backend
(``cpu:gloo,cuda:nccl``) takes CPU ones. The table travels as bytes, so a backend without float64 collectives (HCCL)
carries it too. Whatever the collective raises, it raises on every rank alike (same arguments, same group): the
caller turns it into one warning, never an early return on one rank while another waits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_CPU_BACKENDS = ("gloo", "mpi")


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


def gather(local: torch.Tensor, group=None) -> torch.Tensor:
    """``[world, *local.shape]``: every rank's ``local`` (same shape and dtype on every rank), on the CPU."""
    where = device(group)
    payload = local.detach().to(where).contiguous().view(torch.uint8).reshape(-1)
    parts = [torch.empty_like(payload) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, payload, group=group)
    return torch.stack([p.cpu().view(local.dtype).reshape(local.shape) for p in parts])

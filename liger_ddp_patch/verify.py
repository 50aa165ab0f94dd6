"""Runtime check that DDP really synchronised the gradients: a ``TrainerCallback`` that compares them across ranks.

At the first optimizer step and every ``every`` steps after, just before the optimizer consumes the gradients (after
DDP's all-reduce and any gradient accumulation), every rank reduces each parameter's gradient to a few float64
numbers (its *fingerprint*), one ``all_gather`` of the small ``[n_params, 5]`` table brings every rank's table to
every rank, and all ranks compare it with rank 0's. If any parameter disagrees, every rank raises the same
:class:`GradientDesyncError` (no rank is left waiting in a collective), naming the parameters and the ranks.

    trainer = DPOTrainer(...)
    liger_ddp_patch.verify_gradient_sync(trainer, every=100)   # or LIGER_DDP_PATCH_VERIFY=1 for every Trainer

Tolerance. After an all-reduce every rank holds bitwise-identical gradients, and the fingerprint is computed by
the same deterministic reductions on identical bits, so on homogeneous ranks the fingerprints are bitwise equal.
Ranks on different hardware or thread counts may sum in another order; in float64 that moves a sum by at most
~n*2**-53 of its scale (~1e-7 for a 10**9-element parameter, far less in practice). We therefore accept a
difference up to ``rtol`` = 1e-7 of the parameter's L1 norm (of the sum of squares, for that column). A real desync
(ranks that never all-reduced, or one that missed a micro-batch) differs by O(1e-3..1) of the norm: at least four
orders of magnitude above the tolerance. ``NaN`` equals ``NaN`` and ``inf`` equals the same ``inf``.

This module imports torch and transformers; :mod:`liger_ddp_patch` imports it only when a Trainer exists anyway.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from . import log as package_log

DEFAULT_EVERY = 100
DEFAULT_RTOL = 1e-7
HINT = (
    "Each rank is training its own copy of the model. Is liger_ddp_patch applied? See `liger-ddp-patch status` "
    "(TRL 1.9-1.13 DPO/KTO with use_liger_kernel=True need it under DDP)."
)

# Fingerprint columns. PRESENT: 1 = gradient, 0 = no gradient, -1 = sharded (DTensor), not compared.
PRESENT, SUM, ABS_SUM, SUM_SQ, SAMPLED_DOT = range(5)
COLUMNS = 5
_SAMPLES = 64  # fixed-index samples per parameter for the weighted dot (catches permuted gradients)
_CHUNK = 1 << 24  # elements upcast to float64 at a time on a GPU: bounds the temporary memory to 128 MiB
_CPU_CHUNK = 1 << 18  # on CPU: 2 MiB, so the three reductions read the upcast chunk from cache (about 3x faster)


class GradientDesyncError(RuntimeError):
    """Gradients differ across data-parallel ranks at an optimizer step: DDP did not synchronise them."""

    def __init__(self, message: str, params: Sequence[str] = (), ranks: Sequence[int] = (), step: int | None = None):
        super().__init__(message)
        self.params = list(params)
        self.ranks = list(ranks)
        self.step = step


# -- fingerprints -----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _sampler(numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    count = min(numel, _SAMPLES)
    index = torch.linspace(0, numel - 1, count, dtype=torch.float64).round().long().to(device)
    weight = (1.0 + torch.arange(count, dtype=torch.float64) / count).to(device)  # distinct weights in [1, 2)
    return index, weight


def fingerprint(grad: torch.Tensor | None) -> torch.Tensor:
    """``[COLUMNS]`` float64 on ``grad``'s device: present, sum, L1 norm, sum of squares, weighted fixed-index dot."""
    if grad is None:
        return torch.zeros(COLUMNS, dtype=torch.float64)
    if type(grad).__name__ == "DTensor":  # tensor/FSDP2 sharding: each rank holds a different shard
        return torch.tensor([-1.0, 0, 0, 0, 0], dtype=torch.float64)
    flat = grad.detach().reshape(-1)
    zero = torch.zeros((), dtype=torch.float64, device=flat.device)
    total, l1, squares = zero, zero, zero
    size = _CHUNK if flat.is_cuda else _CPU_CHUNK
    buffer = torch.empty(min(size, flat.numel()), dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), size):
        part = flat[start : start + size]
        chunk = buffer[: part.numel()].copy_(part)
        total = total + chunk.sum()
        l1 = l1 + torch.linalg.vector_norm(chunk, 1)
        squares = squares + torch.dot(chunk, chunk)
    if flat.numel():
        index, weight = _sampler(flat.numel(), flat.device)
        dot = torch.dot(flat[index].to(torch.float64), weight)
    else:
        dot = zero
    return torch.stack([torch.ones_like(zero), total, l1, squares, dot])


def fingerprints(grads: Sequence[torch.Tensor | None], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[len(grads), COLUMNS]`` float64 on ``device`` (one small copy per call, no host synchronisation)."""
    if not grads:
        return torch.zeros(0, COLUMNS, dtype=torch.float64, device=device)
    return torch.stack([fingerprint(g).to(device) for g in grads])


def _close(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, rtol: float) -> torch.Tensor:
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return same | ((a - b).abs() <= rtol * scale.abs())


def disagreements(gathered: torch.Tensor, rtol: float = DEFAULT_RTOL) -> dict[int, list[int]]:
    """``{parameter index: [ranks whose fingerprint differs from rank 0's]}`` for a ``[world, n, COLUMNS]`` table."""
    gathered = gathered.detach().to("cpu", torch.float64)
    ref = gathered[0]
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
        ok &= values | (ref[:, PRESENT] != 1)  # no gradient (or sharded) on both: nothing more to compare
        for index in torch.nonzero(~ok).flatten().tolist():
            out.setdefault(index, []).append(rank)
    return out


def describe(names: Sequence[str], bad: dict[int, list[int]], world: int, step: int | None, first: int = 5) -> str:
    """The :class:`GradientDesyncError` message for :func:`disagreements`' answer."""
    listed = [names[i] for i in sorted(bad)]
    ranks = sorted({r for rs in bad.values() for r in rs})
    shown = ", ".join(listed[:first]) + (f" (+{len(listed) - first} more)" if len(listed) > first else "")
    where = f"at optimizer step {step}" if step is not None else "at this optimizer step"
    return (
        f"Gradients are NOT synchronised across the {world} data-parallel ranks {where}: "
        f"{len(listed)} of {len(names)} parameters differ between rank 0 and rank{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(map(str, ranks))}: {shown}. {HINT}"
    )


# -- the callback -----------------------------------------------------------------------------------------------
def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP and similar wrappers
        model = model.module
    return model


def _several_ranks() -> bool:
    """A process group of two or more ranks: something to compare."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _comm_device() -> torch.device:
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GradientSyncVerifier(TrainerCallback):
    """Raise :class:`GradientDesyncError` when gradients differ across ranks (first step, then every ``every``)."""

    def __init__(self, every: int = DEFAULT_EVERY, rtol: float = DEFAULT_RTOL):
        if int(every) <= 0:
            raise ValueError(f"every must be a positive number of optimizer steps, got {every!r}")
        self.every = int(every)
        self.rtol = rtol
        self.checked_steps: list[int] = []
        self._warned = False
        self._said = False  # the first check that held logged it at INFO

    def _sharded(self, args) -> bool:
        return bool(getattr(args, "fsdp", None)) or bool(getattr(args, "deepspeed", None))

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step % self.every:
            return
        if not _several_ranks():
            return
        if self._sharded(args):  # FSDP/DeepSpeed shard gradients: ranks legitimately hold different values
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "liger_ddp_patch: gradient-sync verification skipped: FSDP/DeepSpeed shard gradients", stacklevel=2
                )
            return
        self.check(model, state.global_step)

    def check(self, model: torch.nn.Module, step: int | None = None) -> None:
        """Compare every parameter's gradient fingerprint across ranks now (a collective: call on every rank).

        Raises :class:`GradientDesyncError` on every rank when they disagree."""
        named = [(n, p) for n, p in _unwrap(model).named_parameters() if p.requires_grad]
        device = _comm_device()
        table = fingerprints([p.grad for _, p in named], device)
        world = dist.get_world_size()
        gathered = [torch.empty_like(table) for _ in range(world)]
        dist.all_gather(gathered, table)
        bad = disagreements(torch.stack(gathered), self.rtol)
        if step is not None:
            self.checked_steps.append(step)
        if bad:
            names = [n for n, _ in named]
            ranks = sorted({r for rs in bad.values() for r in rs})
            raise GradientDesyncError(describe(names, bad, world, step), [names[i] for i in sorted(bad)], ranks, step)
        if dist.get_rank() == 0:
            package_log.get().log(
                logging.DEBUG if self._said else logging.INFO,  # the first check says it held
                "liger_ddp_patch: gradients in sync across %d ranks at step %s (%d parameters)",
                world,
                step,
                len(named),
            )
            self._said = True


class FirstStepCheck(GradientSyncVerifier):
    """The default check (``LIGER_DDP_PATCH_VERIFY`` unset): once, at the first optimizer step of a DDP job.

    A desync is a hole nobody has found yet (a wrapper or a code path the patches do not know): it is logged on rank 0
    as a WARNING naming the parameters and the likely cause, and raised only under ``LIGER_DDP_PATCH_STRICT=1``, so
    a check we add by default never stops a job that would otherwise run. Sharded gradients (FSDP, DeepSpeed) are
    skipped silently: ranks legitimately differ there.
    """

    def __init__(self, trainer=None, strict: bool = False):
        super().__init__(every=1)
        self.strict = strict
        self._trainer = weakref.ref(trainer) if trainer is not None else lambda: None
        self.done = False

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.done or model is None:
            return
        self.done = True
        if not _several_ranks() or self._sharded(args):
            return
        try:
            self.check(model, state.global_step)
        except GradientDesyncError as exc:
            if self.strict:
                raise
            if dist.get_rank() == 0:
                package_log.get().warning("liger_ddp_patch: %s Likely cause: %s", exc, likely_cause(self._trainer()))


def likely_cause(trainer) -> str:
    """In words, what most probably left the gradients unsynchronised in ``trainer``'s job."""
    import sys

    package = sys.modules.get("liger_ddp_patch")
    wrapped = getattr(trainer, "model_wrapped", None)
    name = type(trainer).__name__
    # the rows of the patches of TRL's Liger path (not this check's own row, on transformers' Trainer)
    rows = {r.name: r for r in package.report() if r.target.startswith("trl")} if package is not None else {}
    ours = [r for r in rows.values() if r.runtime.get(name)]
    if ours:  # a patch of ours saw this trainer's compute_loss: say what it decided
        said = "; ".join(f"{r.name}: {', '.join(r.runtime[name])}" for r in ours)
        return (
            f"the patches decided [{said}], and the gradients still differ: a gap in liger_ddp_patch, please report it"
        )
    if rows and not any(r.status == "applied" for r in rows.values()):
        return "no liger_ddp_patch patch is applied here (see `liger-ddp-patch status`)"
    return (
        f"{name} (model {type(wrapped).__name__}) computes its loss outside DistributedDataParallel.forward in a way "
        "no patch of liger_ddp_patch knows (TRL #7245 is one such path); `liger-ddp-patch status` shows what applied"
    )


def verify_gradient_sync(trainer, every: int = DEFAULT_EVERY) -> GradientSyncVerifier:
    """Add (or re-time) the :class:`GradientSyncVerifier` on ``trainer`` and return it."""
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, GradientSyncVerifier):
            callback.every = GradientSyncVerifier(every).every  # validates
            return callback
    verifier = GradientSyncVerifier(every)
    trainer.add_callback(verifier)
    return verifier

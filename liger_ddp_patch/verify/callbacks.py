"""The checks as ``TrainerCallback``s: gradients before an optimizer step, weights after a checkpoint save.

Where. Only where ranks must agree and the package can tell they should: the Trainer's model runs through a
``DistributedDataParallel`` module (plain or compiled, :mod:`liger_ddp_patch._ddp`), read from the objects the
Trainer holds, never from ``TrainingArguments`` (FSDP and DeepSpeed launched from an accelerate config leave them
empty). The default check also needs a Liger path on the trainer: the bug lives nowhere else. Everywhere else (one
process, DeepSpeed, FSDP, tensor parallel, no Liger) it runs no collective and prints nothing.

How it fails. Every rank decides from the same objects and runs the same one collective; a rank never returns early
or raises while another waits in it. A failure of the check itself is one rank-0 WARNING and the job goes on; only a
real desync raises, and for the default check only under ``LIGER_DDP_PATCH_STRICT=1``.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, NamedTuple

import torch
from transformers import TrainerCallback

from .. import _ddp
from .. import log as package_log
from . import collective
from .fingerprint import DEFAULT_RTOL, compared, describe, disagreements, table

DEFAULT_EVERY = 100
WEIGHTS_HINT = "The checkpoint holds rank 0's copy only; the ranks are training different models."


class GradientDesyncError(RuntimeError):
    """Gradients differ across data-parallel ranks at an optimizer step: DDP did not synchronise them."""

    def __init__(self, message: str, params=(), ranks=(), step: int | None = None):
        super().__init__(message)
        self.params = list(params)
        self.ranks = list(ranks)
        self.step = step


class WeightDesyncError(GradientDesyncError):
    """Weights differ across data-parallel ranks at a checkpoint (a :class:`GradientDesyncError`: one ``except``)."""


class Target(NamedTuple):
    """What a check compares: the module whose parameters the ranks must agree on, over which process group."""

    module: torch.nn.Module
    group: Any  # the DDP module's process group (None: the default group)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP and similar wrappers
        model = model.module
    return model


class GradientSyncVerifier(TrainerCallback):
    """Raise :class:`GradientDesyncError` when gradients differ across the ranks of a DDP model (at the first step this
    check sees, then every ``every``); after each checkpoint save, :class:`WeightDesyncError` when weights differ."""

    strict = True  # a desync raises (the default check: only under LIGER_DDP_PATCH_STRICT=1)

    def __init__(self, every: int = DEFAULT_EVERY, rtol: float = DEFAULT_RTOL, trainer=None, checkpoints: bool = True):
        if int(every) <= 0:
            raise ValueError(f"every must be a positive number of optimizer steps, got {every!r}")
        self.every = int(every)
        self.rtol = rtol
        self.checkpoints = checkpoints
        self.checked_steps: list[int] = []  # optimizer steps whose gradients were compared
        self.checked_saves: list[int] = []  # checkpoint steps whose weights were compared
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        self._seen_step = False
        self._said: set[str] = set()  # the first check of each kind that held said so at INFO
        self._skipped = False

    # Pickling or deep-copying a Trainer copies its callbacks: the trainer goes along as a plain reference (the
    # pickler's memo resolves the cycle to the copy being made) and comes back as a weak one.
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_trainer"] = self._trainer() if self._trainer is not None else None
        return state

    def __setstate__(self, state: dict) -> None:
        trainer = state.pop("_trainer", None)
        self.__dict__.update(state)
        self._trainer = weakref.ref(trainer) if trainer is not None else None

    # -- where ----------------------------------------------------------------------------------------------------
    def target(self, args, model) -> Target | None:
        """The DDP model to compare, or ``None``: nothing comparable here (the same answer on every rank)."""
        if not collective.several_ranks():
            return None
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None:  # a verifier added by hand, without its trainer: judge by the arguments and the launcher
            return None if _sharded(args) else Target(_unwrap(model), None) if model is not None else None
        found = _ddp.find(getattr(trainer, "model_wrapped", None))
        if found is None:
            self._skip_once(getattr(trainer, "model_wrapped", None))
            return None
        group = getattr(found.ddp, "process_group", None)
        return Target(found.inner, group) if collective.several_ranks(group) else None

    def _skip_once(self, wrapped) -> None:
        """The explicit check says once why it compares nothing (the default check stays silent)."""
        if self._skipped:
            return
        self._skipped = True
        package_log.emit(
            logging.WARNING,
            "liger_ddp_patch: gradient-sync check skipped: the model (%s) does not run through "
            "DistributedDataParallel, so ranks do not hold copies to compare (FSDP, DeepSpeed and tensor parallelism "
            "shard them)",
            type(wrapped).__name__,
        )

    def due(self, step: int) -> bool:
        first, self._seen_step = not self._seen_step, True
        return first or step % self.every == 0

    # -- events ---------------------------------------------------------------------------------------------------
    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.due(state.global_step):
            return
        target = self.target(args, model)
        if target is not None:
            self.compare(target, state.global_step, weights=False)

    def on_save(self, args, state, control, model=None, **kwargs):
        if not self.checkpoints:
            return
        target = self.target(args, model)
        if target is not None:
            self.compare(target, state.global_step, weights=True)

    # -- the comparison ---------------------------------------------------------------------------------------------
    def check(self, model: torch.nn.Module, step: int | None = None, group=None) -> None:
        """Compare every trainable parameter's gradient across ranks now (a collective: call on every rank)."""
        self.compare(Target(_unwrap(model), group), step, weights=False)

    def compare(self, target: Target, step: int | None, weights: bool) -> None:
        """One comparison: fingerprints, one all-gather, the verdict. Raises only a real desync (when strict)."""
        try:
            named = [(n, p) for n, p in target.module.named_parameters() if p.requires_grad]
            local = table([p if weights else p.grad for _, p in named], weights=weights)
            gathered = collective.gather(local, target.group)
            bad = disagreements(gathered, 0.0 if weights else self.rtol)
            covered = compared(gathered)
        except Exception as exc:  # the same on every rank: nobody is left in the collective
            package_log.emit(
                logging.WARNING,
                "liger_ddp_patch: the %s check could not run (%s: %s); the job goes on unchecked",
                "weights" if weights else "gradient-sync",
                type(exc).__name__,
                exc,
            )
            return
        (self.checked_saves if weights else self.checked_steps).append(step)
        world = len(gathered)
        if bad:
            self.desync(named, bad, world, step, weights)
        elif covered:
            what = "weights" if weights else "gradients"
            where = f"checkpoint-{step}" if weights else f"step {step}" if step is not None else "this step"
            level = logging.DEBUG if what in self._said else logging.INFO  # the first that held says so
            self._said.add(what)
            package_log.emit(
                level,
                "liger_ddp_patch: %s in sync across %d ranks at %s (%d of %d parameters compared)",
                what,
                world,
                where,
                covered,
                len(named),
            )

    def desync(self, named, bad, world: int, step: int | None, weights: bool) -> None:
        names = [n for n, _ in named]
        ranks = sorted({r for rs in bad.values() for r in rs})
        params = [names[i] for i in sorted(bad)]
        if weights:
            message = describe(
                names, bad, world, step, what="Weights", hint=WEIGHTS_HINT, where=f"at checkpoint-{step}"
            )
            raise WeightDesyncError(message, params, ranks, step)
        raise GradientDesyncError(describe(names, bad, world, step), params, ranks, step)


class FirstStepCheck(GradientSyncVerifier):
    """The default check (``LIGER_DDP_PATCH_VERIFY`` unset): at the first optimizer step and at every checkpoint, of a
    DDP model on a Liger path only.

    A desync is a hole nobody has found yet (a wrapper or a code path the patches do not know): rank 0 logs a WARNING
    naming the parameters and the likely cause, and the job goes on; only ``LIGER_DDP_PATCH_STRICT=1`` raises, so a
    check we add by default never stops a job that would otherwise run.
    """

    def __init__(self, trainer=None, strict: bool = False, liger_flags: tuple[str, ...] = ("use_liger_kernel",)):
        super().__init__(every=1, trainer=trainer)
        self.strict = strict
        self.liger_flags = tuple(liger_flags)
        self.done = False

    def due(self, step: int) -> bool:
        first, self.done = not self.done, True
        return first

    def target(self, args, model) -> Target | None:
        trainer = self._trainer() if self._trainer is not None else None
        if trainer is None or not uses_liger(trainer, self.liger_flags):
            return None
        return super().target(args, model)

    def _skip_once(self, wrapped) -> None:
        """Silent: a job that never had the bug hears nothing from the default check."""

    def desync(self, named, bad, world: int, step: int | None, weights: bool) -> None:
        try:
            super().desync(named, bad, world, step, weights)
        except GradientDesyncError as exc:
            if self.strict:
                raise
            trainer = self._trainer() if self._trainer is not None else None
            package_log.emit(logging.WARNING, "liger_ddp_patch: %s Likely cause: %s", exc, likely_cause(trainer))


def uses_liger(trainer, flags: tuple[str, ...]) -> bool:
    """A Liger flag set on the trainer or its arguments (``use_liger_kernel``, or the trainer's own)."""
    holders = (trainer, getattr(trainer, "args", None))
    return any(getattr(holder, flag, None) is True for holder in holders for flag in flags)


def _sharded(args) -> bool:
    """FSDP or DeepSpeed, as the arguments or accelerate's launcher say (a verifier without its trainer)."""
    import os

    launcher = any(
        os.environ.get(v, "").lower() in ("1", "true") for v in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")
    )
    return launcher or bool(getattr(args, "fsdp", None)) or bool(getattr(args, "deepspeed", None))


def likely_cause(trainer) -> str:
    """In words, what most probably left the ranks unsynchronised in ``trainer``'s job."""
    package = sys.modules.get("liger_ddp_patch")
    wrapped = getattr(trainer, "model_wrapped", None)
    name = type(trainer).__name__
    # the rows of the patches of TRL's Liger path (not the check's own row, on transformers' Trainer)
    rows = {r.name: r for r in package.report() if r.target.startswith("trl")} if package is not None else {}
    decided = package.decisions(trainer) if package is not None else {}  # this trainer's, not its class's
    ours = {record: said for record, said in decided.items() if record in rows and said}
    if ours:  # a patch of ours saw this trainer's compute_loss: say what it decided
        said = "; ".join(f"{record}: {', '.join(said)}" for record, said in ours.items())
        return f"the patches decided [{said}], and the ranks still differ: a gap in liger_ddp_patch, please report it"
    if rows and not any(r.status == "applied" for r in rows.values()):
        return "no liger_ddp_patch patch is applied here (see `liger-ddp-patch status`)"
    return (
        f"{name} (model {type(wrapped).__name__}) computes its loss outside DistributedDataParallel.forward in a way "
        "no patch of liger_ddp_patch knows (TRL #7245 is one such path); `liger-ddp-patch status` shows what applied"
    )


def verify_gradient_sync(trainer, every: int = DEFAULT_EVERY) -> GradientSyncVerifier:
    """Give ``trainer`` the raising check every ``every`` steps (it replaces the default check) and return it."""
    every = GradientSyncVerifier(every).every  # validates before anything changes
    for callback in list(trainer.callback_handler.callbacks):
        if isinstance(callback, FirstStepCheck):
            trainer.remove_callback(callback)
        elif isinstance(callback, GradientSyncVerifier):
            callback.every = every
            return callback
    verifier = GradientSyncVerifier(every, trainer=trainer)
    trainer.add_callback(verifier)
    return verifier

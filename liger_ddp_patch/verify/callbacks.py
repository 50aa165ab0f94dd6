"""The checks as ``TrainerCallback``s: gradients before an optimizer step, weights after a checkpoint save.

Where. Only where ranks must agree and the package can tell they should: the Trainer's model runs through a
``DistributedDataParallel`` module (plain or compiled, :mod:`liger_ddp_patch._ddp`), read from the objects the
Trainer holds, never from ``TrainingArguments`` (FSDP and DeepSpeed launched from an accelerate config leave them
empty). The default check also needs a Liger path on the trainer: the bug lives nowhere else. Everywhere else (one
process, DeepSpeed, FSDP, tensor parallel, no Liger) it runs no collective and prints nothing.

What. The parameters DDP averages: those that take a gradient, less the DDP module's ``parameters_to_ignore``
(``_ddp_params_and_buffers_to_ignore``, as expert-parallel weights use it), which are counted as not compared.

How it fails. Every rank decides from the same objects and enters the one all-gather once, whatever failed on it
before (:func:`.collective.exchange`); a rank never returns early or raises while another waits. A rank that could
not check is named by rank 0, once; the job goes on. Only a real desync raises, and for the default check only under
``LIGER_DDP_PATCH_STRICT=1``; weights that differ by rounding alone (:mod:`.distance`) are one INFO line.
"""

from __future__ import annotations

import copy
import logging
import sys
import weakref
from typing import Any, NamedTuple

import torch
from transformers import TrainerCallback

from .. import _ddp
from .. import log as package_log
from . import collective, distance
from .fingerprint import COLUMNS, DEFAULT_RTOL, WEIGHT_COLUMNS, compared, describe, disagreements, table

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
    ignored: frozenset[str] = frozenset()  # parameter names DDP does not synchronise (not compared)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while isinstance(getattr(model, "module", None), torch.nn.Module):  # DDP and similar wrappers
        model = model.module
    return model


def _target(model: torch.nn.Module, group=None) -> Target:
    """``model`` (a DDP module or what it wraps) as a :class:`Target`, with what DDP leaves alone."""
    inner = _unwrap(model)
    return Target(inner, group, _ddp.ignored(model) | _ddp.ignored(inner))


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

    # A check belongs to one Trainer and holds it weakly. Copied with it (a deep-copied or pickled Trainer), the copy
    # belongs to the copy; copied alone, it carries no Trainer and says so once (:meth:`orphaned`).
    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items() if k != "_trainer"}
        state["_belonged"] = self._trainer is not None  # found again where a Trainer holds it (:meth:`trainer`)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._trainer = None

    def __deepcopy__(self, memo: dict):
        twin = type(self).__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        owner = self.trainer
        copied = memo.get(id(owner)) if owner is not None else None  # the Trainer being copied with it, if any
        if copied is not None:
            twin._trainer, twin._belonged = weakref.ref(copied), False
        return twin

    @property
    def trainer(self):
        """The Trainer this check belongs to (``None``: added by hand without one, or copied alone). Unpickled with
        its Trainer, the check finds it once, as the Trainer that holds it in its callbacks."""
        if self._trainer is None and vars(self).pop("_belonged", False):
            holder = _holder(self)
            if holder is not None:
                self._trainer = weakref.ref(holder)
            else:
                self._orphaned = True
        return self._trainer() if self._trainer is not None else None

    # -- where ----------------------------------------------------------------------------------------------------
    def target(self, args, model) -> Target | None:
        """The DDP model to compare, or ``None``: nothing comparable here (the same answer on every rank)."""
        if not collective.several_ranks():
            return None
        trainer = self.trainer
        if trainer is None:  # a verifier added by hand, without its trainer: judge by the arguments and the launcher
            return None if _sharded(args) else _target(model) if model is not None else None
        found = _ddp.find(getattr(trainer, "model_wrapped", None))
        if found is None:
            self._skip_once(getattr(trainer, "model_wrapped", None))
            return None
        group = getattr(found.ddp, "process_group", None)
        return _target(found.ddp, group) if collective.several_ranks(group) else None

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
        """Compare every synchronised parameter's gradient across ranks now (a collective: call on every rank)."""
        self.compare(_target(model, group), step, weights=False)

    def compare(self, target: Target, step: int | None, weights: bool) -> None:
        """One comparison: fingerprints, one all-gather, the verdict. Raises only a real desync (when strict)."""
        what = "weights" if weights else "gradient-sync"
        try:
            named = [(n, p) for n, p in target.module.named_parameters() if p.requires_grad]
            synced = [n not in target.ignored for n, _ in named]

            def build(where):  # everything that reads a tensor: a failure here is sent, not raised
                return table([p if weights else p.grad for _, p in named], where, weights, synced)

            shape = (len(named), WEIGHT_COLUMNS if weights else COLUMNS)
            dtype = torch.int64 if weights else torch.float64
            result = collective.exchange(build, shape, dtype, target.group)
        except Exception as exc:  # before any tensor was read, or the collective itself: the same on every rank
            said = "liger_ddp_patch: the %s check could not run (%s: %s); the job goes on unchecked"
            self._say(logging.WARNING, said, what, type(exc).__name__, exc, key=f"error {what}")
            return
        where = f"checkpoint-{step}" if weights else f"step {step}" if step is not None else "this step"
        if result.failed:
            self._could_not(what, where, result.failed, len(result.tables))
        sent = [rank for rank in range(len(result.tables)) if rank not in result.failed]
        if len(sent) < 2:
            return
        gathered = result.tables[sent]
        bad = {row: [sent[i] for i in ranks] for row, ranks in disagreements(gathered, self.rtol).items()}
        covered = compared(gathered)
        (self.checked_saves if weights else self.checked_steps).append(step)
        world = len(result.tables)
        apart = self.how_far(named, bad, target) if weights and bad else None
        if apart is not None and max(apart) <= distance.ROUNDING_ULPS:
            self._say(
                logging.INFO,
                "liger_ddp_patch: weights at %s differ across %d ranks by rounding only: %d of %d parameters, at most "
                "%d ulp%s apart (ranks that round differently: other hardware, thread counts or kernels); not a desync",
                where, world, len(bad), len(named), max(apart), "" if max(apart) == 1 else "s", key="rounding",
            )  # fmt: skip
        elif bad:
            self.desync(named, bad, world, step, weights, apart, sent[0])
        elif covered:
            self._say(
                logging.INFO,
                "liger_ddp_patch: %s in sync across %d ranks at %s (%d of %d parameters compared)",
                "weights" if weights else "gradients", world, where, covered, len(named), key=what,
            )  # fmt: skip

    def how_far(self, named, bad: dict[int, list[int]], target: Target) -> list[int] | None:
        """Per differing weight, the largest distance in ulps between the ranks (:func:`.distance.spreads`, a
        collective every rank enters alike: ``bad`` comes from the gathered table); ``None``: not measured."""
        try:
            return distance.spreads([named[row][1] for row in sorted(bad)], collective.device(target.group),
                                    target.group)  # fmt: skip
        except Exception:
            return None

    def _say(self, level: int, message: str, *args: object, key: str | None = None) -> None:
        """``message`` at ``level`` the first time for ``key`` (default: the message), at DEBUG after that."""
        key = message if key is None else key
        package_log.emit(level if key not in self._said else logging.DEBUG, message, *args)
        self._said.add(key)

    def _could_not(self, what: str, where: str, failed: dict[int, str], world: int) -> None:
        ranks = sorted(failed)
        self._say(
            logging.WARNING,
            "liger_ddp_patch: the %s check could not run on rank%s %s at %s (%s); %s",
            what, "s" if len(ranks) > 1 else "", ", ".join(map(str, ranks)), where,
            "; ".join(f"rank {r}: {failed[r]}" for r in ranks),
            "the other ranks were compared" if world - len(ranks) > 1 else "nothing was compared",
            key=f"failed {what}",
        )  # fmt: skip

    def desync(self, named, bad, world: int, step: int | None, weights: bool, apart=None, reference: int = 0) -> None:
        names = [n for n, _ in named]
        ranks = sorted({r for rs in bad.values() for r in rs})
        params = [names[i] for i in sorted(bad)]
        if weights:
            how_far = (f" The copies are up to {max(apart):,} ulps apart, beyond rounding ({distance.ROUNDING_ULPS})."
                       if apart else "")  # fmt: skip
            message = describe(names, bad, world, step, what="Weights", hint=WEIGHTS_HINT + how_far,
                               where=f"at checkpoint-{step}", reference=reference)  # fmt: skip
            raise WeightDesyncError(message, params, ranks, step)
        raise GradientDesyncError(describe(names, bad, world, step, reference=reference), params, ranks, step)


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
        trainer = self.trainer
        if trainer is None:
            if vars(self).pop("_orphaned", False) and collective.several_ranks():
                package_log.emit(
                    logging.WARNING,
                    "liger_ddp_patch: a gradient-sync check was copied without its Trainer, so it checks nothing; "
                    "give that Trainer its own with liger_ddp_patch.verify_gradient_sync(trainer)",
                )
            return None
        if not uses_liger(trainer, self.liger_flags):
            return None
        return super().target(args, model)

    def _skip_once(self, wrapped) -> None:
        """Silent: a job that never had the bug hears nothing from the default check."""

    def desync(self, named, bad, world: int, step: int | None, weights: bool, apart=None, reference: int = 0) -> None:
        try:
            super().desync(named, bad, world, step, weights, apart, reference)
        except GradientDesyncError as exc:
            if self.strict:
                raise
            package_log.emit(logging.WARNING, "liger_ddp_patch: %s Likely cause: %s", exc, likely_cause(self.trainer))


def _holder(callback):
    """The Trainer whose callback handler holds ``callback`` (an unpickled check finds its Trainer this way, once:
    the pickle carried no reference, so that a check pickled alone does not carry a whole Trainer)."""
    import gc

    def owners(value, attribute):
        for ref in gc.get_referrers(value):
            if isinstance(ref, dict) and ref.get(attribute) is value:  # an instance's __dict__: its instance
                yield from (o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref)
            elif isinstance(getattr(ref, "__dict__", None), dict) and ref.__dict__.get(attribute) is value:
                yield ref

    lists = [r for r in gc.get_referrers(callback) if isinstance(r, list) and any(c is callback for c in r)]
    for held in lists:
        for handler in owners(held, "callbacks"):
            for trainer in owners(handler, "callback_handler"):
                return trainer
    return None


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


def _patches_of(trainer, rows) -> dict:
    """The rows (``report()``'s) whose target is a method of a class ``trainer`` is an instance of."""
    classes = {(c.__module__, c.__name__) for c in type(trainer).__mro__}
    mine = {}
    for row in rows:
        modules, _, attributes = row.target.partition(":")
        owners = {a.split(".")[0] for a in attributes.split("|")}
        if any((m, o) in classes for m in modules.split("|") for o in owners):
            mine[row.name] = row
    return mine


def likely_cause(trainer) -> str:
    """In words, what most probably left the ranks unsynchronised in ``trainer``'s job (only what is true of it)."""
    package = sys.modules.get("liger_ddp_patch")
    wrapped = getattr(trainer, "model_wrapped", None)
    name = type(trainer).__name__
    # the patches of this trainer's TRL Liger path (not the check's own row, on transformers' Trainer)
    rows = package.report() if package is not None else []
    rows = _patches_of(trainer, [r for r in rows if r.target.startswith("trl")]) if trainer is not None else {}
    decided = package.decisions(trainer) if package is not None and trainer is not None else {}
    ours = {record: said for record, said in decided.items() if record in rows and said}
    if ours:  # a patch of ours saw this trainer's compute_loss: say what it decided
        said = "; ".join(f"{record}: {', '.join(said)}" for record, said in ours.items())
        return f"the patches decided [{said}], and the ranks still differ: a gap in liger_ddp_patch, please report it"
    if rows and not any(r.status == "applied" for r in rows.values()):
        return f"no liger_ddp_patch patch of {name} is applied here (see `liger-ddp-patch status`)"
    if not rows:
        return (
            f"{name} (model {type(wrapped).__name__}) is not a trainer liger_ddp_patch patches, and its loss runs "
            "outside DistributedDataParallel.forward (as TRL #7245's Liger path did)"
        )
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

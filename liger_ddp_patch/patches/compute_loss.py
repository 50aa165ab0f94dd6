"""Route the Liger loss through the distributed wrapper's ``forward`` (TRL issue #7245).

TRL 1.9.0-1.13.0 call ``_compute_loss_liger`` on the unwrapped model unless ZeRO-3 or FSDP is on, so under plain
DDP ``DistributedDataParallel.forward()`` never runs, its reducer is never armed and gradients are never all-reduced.
Upstream's fix (TRL 1.14.0; PRs #7243 and #7247) redirects whenever ``model is not unwrapped_model``. We redirect
only when that wrapper is ``DistributedDataParallel`` (see :func:`route`), by calling the *original* ``compute_loss``
inside the wrapper's forward: every other configuration, and everything else the original does (the non-Liger path,
the ZeRO-3/FSDP redirect, the re-raised image-token ``ValueError``), stays exactly TRL's own code.

TRL 1.0.0-1.8.0 pass the DDP wrapper itself into the Liger path, which crashes (no ``get_decoder``/``base_model``
on ``DistributedDataParallel``). The same replacement fixes that: the original runs on the unwrapped model, inside
the wrapper's forward. Which releases have which shape: :mod:`.trainers`.

The distillation trainers (GKD, GOLD, Distillation; TRL issue #5282) get the same replacement: in 1.0.0-1.5.1 they run
the student's decoder on the unwrapped model (silently unsynchronised under DDP); in 1.6.0-1.13.0 TRL routes the
decoder but uses the head outside the wrapper's forward, which DDP rejects only with find_unused_parameters=True and an
untied trainable head: only that setup is routed (:func:`head_route`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

from .. import _ddp, environment
from ..log import announce
from . import _shape, chunked_loss, kl_logps, pitfalls
from .trainers import TrainerSpec

# The code shapes we know how to fix, by name (each TrainerSpec.shapes says which release has which). Each entry is one
# thing the replacement relies on; the check names the first one missing.
SHAPES: dict[str, dict[str, str]] = {
    # 1.9.0-1.13.0: the Liger call runs on the unwrapped model; only ZeRO-3/FSDP are redirected (TRL #6372, #7245).
    "guarded": {
        "if self.use_liger_kernel:": "the `use_liger_kernel` branch",
        "unwrapped_model = self.accelerator.unwrap_model(model)": "the unwrap of the model",
        "if is_zero3 or self.is_fsdp_enabled:": "the ZeRO-3/FSDP-only redirect guard",
        "self._forward_redirection(": "the `_forward_redirection` call",
        "return self._compute_loss_liger(unwrapped_model, inputs, return_outputs)": "the unredirected Liger call",
    },
    # 1.0.0-1.8.0 DPO, 1.5.0-1.8.0 KTO: the model the Trainer passed (the DDP wrapper) goes straight into the Liger
    # path, which reaches for `get_decoder`/`base_model` and crashes. Given the unwrapped model inside the wrapper's
    # forward, the very same code runs and DDP arms its reducer.
    "unredirected": {
        "if self.use_liger_kernel:": "the `use_liger_kernel` branch",
        "return self._compute_loss_liger(model, inputs, return_outputs)": "the Liger call on the model passed in",
    },
    # 1.0.0-1.4.0 KTO (trl.experimental.kto): compute_loss hands the model to get_batch_loss_metrics, whose
    # `self.args.use_liger_kernel` branch calls `_compute_loss_liger(model, batch)`: same crash, same fix.
    "batch_metrics": {
        "loss, metrics = self.get_batch_loss_metrics(model, inputs)": "the get_batch_loss_metrics call",
    },
}
# The distillation trainers' Liger JSD path, in compute_loss or in the `_compute_liger_loss` it calls (Distillation).
_STUDENT = {
    "unwrapped_student = self.accelerator.unwrap_model(model)": "the unwrap of the student",
    "student_weight=student_head.weight": "the student head's weight handed to the JSD loss",
}
# 1.0.0-1.5.1 (TRL #5282): the student's decoder runs on the unwrapped model, outside DDP's forward.
SHAPES["decoder_unrouted"] = {**_STUDENT, "student_outputs = base_student(": "the direct call of the student's decoder"}
# 1.6.0-1.13.0 (TRL PR #5934): the decoder is routed, the head is used after the wrapper's forward returned.
SHAPES["head_outside"] = {
    **_STUDENT,
    "self._forward_redirection( model, unwrapped_student,": "the routed student decoder",
}
# 1.14.0-1.14.2 DPO/KTO (upstream's fix, PRs #7243/#7247): redirect whenever `model is not unwrapped_model`, which is
# false for a compiled model (accelerate's unwrap returns the compiled wrapper itself): only that case is routed.
COMPILED_HOLE = {
    "if self.use_liger_kernel:": "the `use_liger_kernel` branch",
    "unwrapped_model = self.accelerator.unwrap_model(model)": "the unwrap of the model",
    "if self.is_fsdp_enabled or model is not unwrapped_model:": "the identity test of upstream's redirect",
    "self._forward_redirection(": "the `_forward_redirection` call",
}
_LIGER_HELPER = "self._compute_liger_loss(model, inputs"  # Distillation's compute_loss hands its Liger path on
_BATCH_METRICS_LIGER = {
    "if self.args.use_liger_kernel:": "the `args.use_liger_kernel` branch of get_batch_loss_metrics",
    "self._compute_loss_liger(model, batch)": "the Liger call on the model passed in",
}
_SIGNATURE = ("self", "model", "inputs", "return_outputs", "num_items_in_batch")
_FIXED = "model is not unwrapped_model"


def _owner(func: Any) -> Any:
    """The class that defines ``func`` (looked up by qualified name in its module's globals)."""
    owner: Any = getattr(func, "__globals__", {})
    for part in func.__qualname__.split(".")[:-1]:
        owner = owner.get(part) if isinstance(owner, dict) else getattr(owner, part, None)
    return owner if isinstance(owner, type) else None


def _source(original: Any) -> tuple[str | None, str]:
    """``(source, "")`` of a compute_loss with TRL's signature, else ``(None, why its shape cannot be checked)``."""
    if not callable(original):
        return None, f"compute_loss is a {type(original).__name__}, not a function"
    if _shape.parameters(original) != _SIGNATURE:
        return None, f"compute_loss takes {_shape.parameters(original)}, expected {_SIGNATURE}"
    source = _shape.source_of(original)
    if source is None:
        return None, "the source of compute_loss is not available, so its shape cannot be verified"
    return source, ""


def shape(original: Any, names: tuple[str, ...] | None = None) -> tuple[str | None, str]:
    """``(shape name, "")`` when ``original`` is a compute_loss we know how to fix, else ``(None, why not)``.

    ``names``: only these keys of :data:`SHAPES` (a spec's own shapes); default every one.
    """
    source, why = _source(original)
    if source is None:
        return None, why
    if _LIGER_HELPER in source:
        helper = getattr(_owner(original), "_compute_liger_loss", None)
        source += " " + (_shape.source_of(helper) or "")
    if _FIXED in source:
        return None, "compute_loss already redirects when `model is not unwrapped_model` (upstream's fix)"
    misses = {}
    for name, required in SHAPES.items():
        if names is not None and name not in names:
            continue
        why = _shape.missing(source, required)
        if why is None and name == "batch_metrics":
            owner = _owner(original)
            helper = _shape.source_of(getattr(owner, "get_batch_loss_metrics", None)) if owner else None
            why = (
                "get_batch_loss_metrics cannot be read"
                if helper is None
                else _shape.missing(helper, _BATCH_METRICS_LIGER)
            )
        if why is None:
            if name not in ("guarded", "head_outside") and "_forward_redirection(" in source:
                why = "it already calls `_forward_redirection` itself"
            else:
                return name, ""
        misses[name] = why
    return None, "no known shape matches: " + "; ".join(f"{name}: {why}" for name, why in misses.items())


def compiled_checker(original: Any) -> str | None:
    """The shape check of a TRL 1.14.x compute_loss: upstream's identity-tested redirect (:data:`COMPILED_HOLE`)."""
    source, why = _source(original)
    return why if source is None else _shape.missing(source, COMPILED_HOLE)


def checker(spec: TrainerSpec) -> Callable[[Any], str | None]:
    """The shape check of ``spec``'s compute_loss: one of the shapes its releases have."""
    names = tuple(dict.fromkeys(s for _, s in spec.shapes if s in SHAPES))

    def check(original: Any) -> str | None:
        name, why = shape(original, names)
        return None if name else why

    return check


def _uses_liger(trainer: Any, spec: TrainerSpec) -> bool:
    """Does this compute_loss call take the Liger path?

    The first of ``spec.liger_flags`` the trainer has (DPO/KTO: ``self.use_liger_kernel``; GKD/GOLD:
    ``self.use_liger_gkd_loss``), else ``self.args.use_liger_kernel`` (the 1.0.0-1.4.0 KTO trainer); never when every
    ``spec.not_liger_when`` attribute is set (GOLD's ULD loss calls the wrapper itself).
    """
    flag = next((getattr(trainer, f) for f in spec.liger_flags if getattr(trainer, f, None) is not None), None)
    if flag is None:
        flag = getattr(getattr(trainer, "args", None), "use_liger_kernel", False)
    if spec.not_liger_when and all(getattr(trainer, a, None) not in (None, False) for a in spec.not_liger_when):
        return False
    return bool(flag)


def route(model: Any, uses_liger: bool) -> tuple[_ddp.Found | None, str]:
    """``(the DDP module to route through, or None; what that means)`` for the model handed to ``compute_loss``.

    Only ``DistributedDataParallel`` (or a subclass) is broken: its reducer is armed by its own ``forward`` alone. It
    is found through ``torch.compile`` too (:mod:`._ddp`), and the call then goes through the DDP module itself, eager:
    TRL's and Liger's ``torch.func`` losses are not traced by dynamo. Everything else keeps TRL's code:
    ``DataParallel`` would scatter the inputs over the GPUs while the original runs on the un-replicated module; a
    DeepSpeed engine (any ZeRO stage) and FSDP reduce gradients through their own hooks, and TRL already redirects
    ZeRO-3/FSDP itself; an unwrapped model (one process, evaluation) needs nothing.
    """
    if not uses_liger:
        return None, "use_liger_kernel=False: left to TRL"
    found = _ddp.find(model)
    if found is None:
        return None, f"{_label(model)}: left to TRL"
    ddp = type(found.ddp).__name__
    via = f"routed through {ddp}.forward"
    if found.how == _ddp.COMPILED:
        via = f"compiled ({type(model).__name__} around {ddp}): {via}, eager"
    elif found.how == _ddp.REGIONS:
        via = f"compiled regions (accelerate's regional compilation inside {ddp}): {via}"
    return found, via


def _label(model: Any) -> str:
    """What wraps the model, in words ("no wrapper" for a bare model)."""
    from torch import nn

    if type(model).__name__ == "OptimizedModule":
        return f"compiled {_label(vars(model)['_modules'].get('_orig_mod'))}"
    return type(model).__name__ if isinstance(getattr(model, "module", None), nn.Module) else "no wrapper"


def head_route(wrapper: Any, unwrapped: Any) -> tuple[bool, str]:
    """For TRL 1.6.0-1.13.0's distillation trainers, which route the decoder themselves: ``(route?, why)``.

    The head is used after the wrapper's forward. With ``find_unused_parameters=False`` DDP still all-reduces its
    gradient (its hook fires in backward), and a head tied to the input embedding gets its gradient hook once, so
    those keep TRL's code. With ``find_unused_parameters=True`` DDP marks an untied head unused at the end of its
    forward, then its gradient arrives: "Expected to mark a variable ready only once". Routed, the head's use is
    inside the wrapper's forward, as with ``use_liger_kernel=False``.
    """
    if not getattr(wrapper, "find_unused_parameters", False):
        return False, "TRL routes the decoder and DDP all-reduces the head (find_unused_parameters=False): left to TRL"
    head = unwrapped.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or not weight.requires_grad:
        return False, "the head is frozen (find_unused_parameters=True): left to TRL"
    embedding = unwrapped.get_input_embeddings()
    if getattr(embedding, "weight", None) is weight:
        return False, "the head is tied to the input embedding (find_unused_parameters=True): left to TRL"
    return True, (
        f"routed through {type(wrapper).__name__}.forward (find_unused_parameters=True and an untied trainable head: "
        "TRL's own code would stop with 'Expected to mark a variable ready only once')"
    )


def autocast_precision(trainer: Any) -> str | None:
    """``"bf16"``/``"fp16"`` when the routed Liger path should run under ``trainer.accelerator.autocast()``, else None.

    TRL 1.14's fix runs its Liger forward and loss inside the accelerator's autocast (its non-Liger path runs inside
    the autocast Accelerate wraps around ``forward``); TRL 1.9-1.13's Liger path calls the decoders directly, outside
    it, so a float32 model (TRL's own float32 reference included) ran float32 GEMMs (TRL PR #6988: 0.37 s against
    0.17 s per H100 step). ``LIGER_DDP_PATCH_LOSS=autocast=0`` keeps TRL 1.9-1.13's precision.
    """
    precision = pitfalls.autocasts(trainer)
    return None if environment.loss_options().autocast is False else precision


def routed_autocast(trainer: Any) -> Any:
    """The accelerator's autocast with its weight cache off: the routed region spans the policy's and the
    reference's decoders and the loss, and the cache would keep the bf16 casts of the reference's weights (which
    require grad, as TRL leaves them) until it ends; each forward casts a weight once, so no time is lost (issue 39,
    ``benchmarks/mem_head.py``). The handler's other settings are the Trainer's."""
    from accelerate.utils import AutocastKwargs

    handler = getattr(trainer.accelerator, "autocast_handler", None)
    enabled = True if handler is None else handler.enabled
    return trainer.accelerator.autocast(AutocastKwargs(enabled=enabled, cache_enabled=False))


def redirect_forward(wrapper: Any, inner: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``method(*args, **kwargs)`` as ``inner``'s forward, called through ``wrapper`` so its forward runs.

    TRL 1.9+ trainers carry ``_forward_redirection``; older DPO/KTO trainers do not, so this is our own. The inputs go
    through ``wrapper(*args, **kwargs)`` as in TRL's: DDP built with ``device_ids`` (every GPU job) moves them to its
    device and hands them on; called without inputs it fails (``IndexError`` in ``_pre_forward``).
    """
    own = "forward" in vars(inner)
    saved = vars(inner).get("forward")

    def restore() -> None:
        if own:
            inner.forward = saved
        else:
            vars(inner).pop("forward", None)

    def forward(*moved_args: Any, **moved_kwargs: Any) -> Any:
        restore()  # the method may call inner itself: give it the real forward
        return method(*moved_args, **moved_kwargs)

    inner.forward = forward
    try:
        return wrapper(*args, **kwargs)
    finally:
        restore()


def replacer(spec: TrainerSpec, compiled_only: bool = False) -> Callable[[Any, Any], Any]:
    """The ``replace`` of ``spec``'s compute_loss record (``engine``: the armed loss swap and the run-time notes).

    ``compiled_only``: the record for TRL 1.14.x, whose own redirect handles a plain DDP module (left to it, with its
    own loss) but not one that ``torch.compile`` wraps (:mod:`._ddp`): only that one is routed, and no loss is swapped.
    """
    name = spec.compiled_patch if compiled_only else spec.compute_loss_patch
    checked: weakref.WeakSet = weakref.WeakSet()  # wrappers already looked at by pitfalls.warn (first routed call)

    def replace(original: Any, engine: Any) -> Any:
        # TRL 1.6-1.13's distillation trainers route the decoder themselves: only their head is at stake
        head_only = not compiled_only and shape(original, ("head_outside",))[0] == "head_outside"

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            found, decision = route(model, _uses_liger(self, spec))
            if found and compiled_only and not found.how:
                found, decision = None, f"TRL routes {type(model).__name__} itself: left to TRL"
            if found and head_only and not found.how:
                routed, decision = head_route(found.ddp, found.inner)
                found = found if routed else None
            trainer = type(self).__name__
            if not found:
                engine.note(name, trainer, decision, owner=self)
                return original(self, model, inputs, return_outputs, num_items_in_batch)
            ddp, inner = found.ddp, found.inner
            if spec.loss and not compiled_only:
                decision = f"{decision}, {chunked_loss.swap(self, engine.original(spec.chunked_loss_patch), spec)}"
            kl_original = engine.original(spec.kl_logps_patch) if spec.kl_rows and not compiled_only else None
            if kl_original is not None and getattr(self, "calculate_KL", False):
                decision = f"{decision}, KL log-probs chunked"
            precision = None if compiled_only else autocast_precision(self)  # TRL 1.14 autocasts itself
            if precision:
                decision = f"{decision}, under {precision} autocast"
            if ddp not in checked:
                checked.add(ddp)
                fp32 = None if compiled_only else pitfalls.warn_fp32(self, inner)  # TRL 1.14 autocasts its own path
                for pitfall in (pitfalls.warn(ddp, inner), fp32):
                    if pitfall:
                        engine.note(name, trainer, pitfall, owner=self)
            engine.note(name, trainer, decision, owner=self)
            announce(
                "liger_ddp_patch: %s under DistributedDataParallel: %s (%s)", trainer, decision, spec.upstream, key=self
            )

            # Inside the wrapper's forward the original sees the unwrapped model and takes its plain Liger path, under
            # the Trainer's autocast as TRL 1.14's fix runs it (TRL 1.9-1.13 call the decoders outside it), with the
            # KL rows' log-probs chunked as TRL 1.14 computes them (1.9-1.13 materialise their logits).
            def run(unwrapped_model, inputs, return_outputs):
                with (
                    routed_autocast(self) if precision else contextlib.nullcontext(),
                    kl_logps.chunked(self, kl_original, spec),
                ):
                    return original(self, unwrapped_model, inputs, return_outputs, num_items_in_batch)

            redirect = getattr(self, "_forward_redirection", None) or redirect_forward
            return redirect(ddp, inner, run, inner, inputs, return_outputs)

        return compute_loss

    return replace

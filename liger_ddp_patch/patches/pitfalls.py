"""Name, on rank 0, what goes wrong in the path we route into before users blame the package for it.

1. A setup DDP itself rejects, before its error does.

A ``PeftModel`` makes transformers' Trainer build DDP with ``find_unused_parameters=True`` (its default for a model
that is not a ``PreTrainedModel``). With *reentrant* gradient checkpointing, DDP then fails in backward with
``Expected to mark a variable ready only once`` -- with ``use_liger_kernel=False`` as well. TRL's unpatched Liger path
never enters ``DistributedDataParallel.forward``, so the same job "ran" without synchronising its gradients; routed
through the wrapper, it reaches DDP's check.

2. A float32 model under bf16/fp16 mixed precision that the accelerator really autocasts (not fp16 on CPU, where
Accelerate casts nothing), with ``LIGER_DDP_PATCH_LOSS=autocast=0`` set. TRL 1.9-1.13's Liger
path calls the decoders (``model.base_model``, ``ref_model.base_model``; the distillation trainers' teacher's)
directly, never the forward that Accelerate wraps in autocast: a float32 model's GEMMs then run in float32. The routed
path runs under the accelerator's autocast by default (``compute_loss.autocast_precision``), so this warning is for
the opt-out only. TRL loads a reference model it
builds itself in float32 (its ``model_init_kwargs`` dtype default), so a full fine-tune with a bf16 policy gets one.
Measured on an H200 (``benchmarks/gpu_check.py``, ``gpu_profile.py``): a routed KTO step took 3.35 s with that
float32 reference against 1.69 s with a bf16 one (1.85 s with ``use_liger_kernel=False``), DPO 2.25 s against 1.52 s
(2.01 s).
"""

from __future__ import annotations

from typing import Any

from .. import environment
from ..log import warn_once
from ._peft import is_peft_model

MESSAGE = (
    "liger_ddp_patch: DistributedDataParallel will fail in backward with 'Expected to mark a variable ready only "
    "once': this PeftModel uses reentrant gradient checkpointing and DDP was built with find_unused_parameters=True "
    "(Trainer's default for a PeftModel). DDP rejects this combination with or without Liger (use_liger_kernel=False "
    "fails the same way); without this package TRL's Liger path never armed DDP, so its gradients were never "
    'synchronised. Fix: gradient_checkpointing_kwargs={"use_reentrant": False}, or ddp_find_unused_parameters=False.'
)
NOTE = "DDP will reject reentrant checkpointing of a PeftModel with find_unused_parameters=True (warned)"


def reentrant_checkpointing(model: Any) -> bool:
    """Whether a module of ``model`` checkpoints with torch's reentrant variant.

    transformers records the choice as the keywords of each checkpointing module's ``_gradient_checkpointing_func``
    (a ``functools.partial`` of ``torch.utils.checkpoint.checkpoint``; PEFT leaves the base model's modules as they
    are); torch treats a missing ``use_reentrant`` as reentrant.
    """
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if getattr(module, "gradient_checkpointing", False) is True and func is not None:
            if (getattr(func, "keywords", None) or {}).get("use_reentrant", True) is not False:
                return True
    return False


def ddp_rejects(wrapper: Any, model: Any) -> bool:
    """The combination DDP cannot run: find_unused_parameters=True, a PeftModel, reentrant checkpointing."""
    return (
        getattr(wrapper, "find_unused_parameters", False) is True
        and is_peft_model(model)
        and reentrant_checkpointing(model)
    )


def warn(wrapper: Any, model: Any) -> str | None:
    """Warn once per process (rank 0) when DDP will reject this setup; the note for the report, else ``None``."""
    if not ddp_rejects(wrapper, model):
        return None
    warn_once(NOTE, MESSAGE)
    return NOTE


FP32_MESSAGE = (
    "liger_ddp_patch: %s runs in %s mixed precision, but its %s float32 and LIGER_DDP_PATCH_LOSS=autocast=0 keeps "
    "TRL's Liger path outside the autocast that Accelerate wraps around forward, so those GEMMs run in float32: on an "
    "H200 this made a KTO step 2x slower, and slower than use_liger_kernel=False. TRL loads a reference model it "
    "builds itself in float32. Fix: drop autocast=0 (the default runs the path under autocast, as TRL 1.14 does), "
    "pass ref_model=AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16) (load the model and a teacher "
    "the same way), or set tf32=True."
)
FP32_NOTE = "a float32 model under mixed precision runs float32 GEMMs in TRL's Liger path (warned)"


def mostly_fp32(model: Any) -> bool:
    """Whether most of ``model``'s floating-point parameter elements are float32 (LoRA's few fp32 adapters aside)."""
    fp32 = other = 0
    for param in model.parameters() if model is not None else ():
        if param.is_floating_point():
            if str(param.dtype) == "torch.float32":  # torch is not imported here: the package imports light
                fp32 += param.numel()
            else:
                other += param.numel()
    return fp32 > other


# The frozen models a trainer runs beside the one it trains, by attribute (DPO/KTO; GKD/GOLD/Distillation/IW-OPD).
FROZEN = (("ref_model", "reference model"), ("teacher_model", "teacher model"))


def autocasts(trainer: Any) -> str | None:
    """``"bf16"``/``"fp16"``: the precision ``trainer.accelerator.autocast()`` really casts to; None when it casts to
    none (no mixed precision; fp16 on CPU, where Accelerate leaves ``native_amp`` off and autocasts nothing, so the
    non-Liger path computes in float32 too; DeepSpeed, which casts the model itself)."""
    accelerator = getattr(trainer, "accelerator", None)
    precision = str(getattr(accelerator, "mixed_precision", "no"))
    return precision if precision in ("bf16", "fp16") and getattr(accelerator, "native_amp", False) else None


def fp32_models(trainer: Any, model: Any) -> list[str]:
    """Which of ``model`` (unwrapped) and the trainer's frozen models run float32 where the non-Liger path would
    autocast them (:func:`autocasts`)."""
    accelerator = getattr(trainer, "accelerator", None)
    args = getattr(trainer, "args", None)
    if autocasts(trainer) is None or getattr(args, "tf32", None) is True:
        return []  # tf32=True: float32 GEMMs already run on tensor cores, the fix the warning would name
    names = ["model"] if mostly_fp32(model) else []
    precomputed = getattr(args, "precompute_ref_log_probs", False)
    unwrap = getattr(accelerator, "unwrap_model", None) or (lambda m: m)
    for attribute, name in FROZEN:
        frozen = getattr(trainer, attribute, None)
        if frozen is None or (attribute == "ref_model" and precomputed):
            continue  # precomputed reference log-probs: the reference never runs during a step
        if callable(getattr(frozen, "parameters", None)) and mostly_fp32(unwrap(frozen)):
            names.append(name)
    return names


def warn_fp32(trainer: Any, model: Any) -> str | None:
    """Warn once per process (rank 0) when ``LIGER_DDP_PATCH_LOSS=autocast=0`` is set and a float32 model runs outside
    the autocast the accelerator really applies; the note, else ``None``. Only then is every word of it true."""
    if environment.loss_options().autocast is not False:  # the default (unset, or autocast=1): routed under autocast
        return None
    names = fp32_models(trainer, model)
    if not names:
        return None
    what = " and ".join(names) + (" are" if len(names) > 1 else " is")
    warn_once(FP32_NOTE, FP32_MESSAGE, type(trainer).__name__, autocasts(trainer), what)
    return FP32_NOTE

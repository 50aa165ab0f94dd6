"""Give DDP trainers the KTO KL rows' log-probs through the chunked head, without ``(B, L, V)`` logits.

TRL 1.9.0-1.13.0's Liger KTO path computes the KL rows' log-probs (``_compute_kl_logps``, no gradient, once for the
policy and once for the reference) as ``backbone(...).last_hidden_state @ lm_head.weight.t()`` and a log-softmax: the
whole ``(B, L, V)`` logits tensor, for every position, padding and prompt included. TRL 1.14.0 computes them
chunked, over the completion tokens only (its ``_get_per_token_logps_and_entropies``, PR #7243), which is why our KTO
step missed TRL 1.14's time and 0.5x Liger-off's memory (issue 32).

Nothing is replaced at import: the record checks ``_compute_kl_logps`` and is *armed*; the compute_loss patch gives a
trainer :func:`chunked` for the duration of one call routed through ``DistributedDataParallel.forward``. One process,
DataParallel, DeepSpeed and FSDP keep TRL's own method.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from . import _shape
from .trainers import TrainerSpec

# What :func:`kl_logps` relies on, in the words the check reports. The batch keys TRL keeps out of the backbone's
# inputs are listed one by one: a release that adds one would feed the backbone an input we would not.
NOT_MODEL_INPUTS = (
    "input_ids",
    "attention_mask",
    "completion_mask",
    "KL_completion_mask",
    "KL_token_type_ids",
    "KL_mm_token_type_ids",
    "label",
    "ref_logps",
    "ref_KL_logps",
)
SHAPE = {
    "if self.calculate_KL:": "the `calculate_KL` guard",
    "_non_model_keys = { " + " ".join(f'"{k}",' for k in NOT_MODEL_INPUTS) + " }": "the batch keys kept from the model",
    'KL_model_kwargs["input_ids"] = KL_model_kwargs.pop("KL_input_ids")': "the KL input ids",
    'KL_model_kwargs["attention_mask"] = KL_model_kwargs.pop("KL_attention_mask")': "the KL attention mask",
    'KL_model_kwargs["token_type_ids"] = batch["KL_token_type_ids"]': "the KL token type ids",
    'KL_model_kwargs["mm_token_type_ids"] = batch["KL_mm_token_type_ids"]': "the KL multimodal token type ids",
    "inner = model.base_model.model if is_peft_model(model) else model": "the PEFT unwrap",
    'if self._is_vlm and Version(transformers.__version__) < Version("5.0.0"): backbone = inner.model': "the pre-5.0 "
    "VLM backbone",
    "backbone = inner.base_model": "the backbone",
    "KL_hidden_states = backbone(**KL_model_kwargs).last_hidden_state": "the KL hidden states",
    "KL_logits = KL_hidden_states @ lm_head.weight.t()": "the whole-vocabulary KL logits",
    "KL_logits = KL_logits + lm_head.bias": "the head's bias",
    'selective_log_softmax(shift_KL_logits, batch["KL_input_ids"][:, 1:])': "the KL log-softmax",
    'KL_per_token_logps[batch["KL_completion_mask"][:, 1:] == 0] = 0.0': "the KL completion mask",
    "KL_logps = KL_per_token_logps.sum(-1)": "the per-row sum",
}


def check(original: Any) -> str | None:
    """The shape check of ``_compute_kl_logps``: TRL 1.9-1.13's, which materialises the KL rows' logits."""
    if not callable(original) or _shape.parameters(original) != ("self", "model", "batch"):
        return f"_compute_kl_logps is not a method taking (model, batch): {original!r}"
    source = _shape.source_of(original)
    if source is None:
        return "the source of _compute_kl_logps is not available, so its shape cannot be verified"
    return _shape.missing(source, SHAPE)


def _backbone(trainer: Any, model: Any) -> tuple[Any, Any]:
    """``(backbone, head)`` of ``model`` as TRL's Liger path picks them (a PEFT model's base; a VLM before
    transformers 5.0 keeps its decoder in ``.model``)."""
    import transformers
    from accelerate.utils import is_peft_model
    from packaging.version import Version

    inner = model.base_model.model if is_peft_model(model) else model
    old_vlm = getattr(trainer, "_is_vlm", False) and Version(transformers.__version__) < Version("5.0.0")
    return (inner.model if old_vlm else inner.base_model), inner.get_output_embeddings()


def kl_logps(trainer: Any, model: Any, batch: dict, options: Any = None) -> Any:
    """The KL rows' per-row sums of completion-token log-probs, fp32, ``(B,)``: TRL's ``_compute_kl_logps`` value,
    computed as TRL 1.14 does (chunked, completion tokens only). ``options``: the loss whose chunk size and sweep to
    use (our swapped loss; default: the loss defaults)."""
    import torch

    from ..losses import sequence_logprob_sums

    inputs = {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
    inputs["input_ids"], inputs["attention_mask"] = inputs.pop("KL_input_ids"), inputs.pop("KL_attention_mask")
    for key in ("token_type_ids", "mm_token_type_ids"):
        if f"KL_{key}" in batch:
            inputs[key] = batch[f"KL_{key}"]
    inputs["use_cache"] = False  # no KV cache for a forward without generation (as TRL 1.14)
    backbone, head = _backbone(trainer, model)
    with torch.no_grad():
        hidden = backbone(**inputs).last_hidden_state[:, :-1]
        target = batch["KL_input_ids"][:, 1:].masked_fill(batch["KL_completion_mask"][:, 1:] == 0, -100)
        return sequence_logprob_sums(
            hidden,
            head.weight,
            head.bias,
            target,
            token_chunk_size=getattr(options, "token_chunk_size", None),
            sweep=getattr(options, "sweep", "eager"),
        )


@contextlib.contextmanager
def chunked(trainer: Any, original: Any, spec: TrainerSpec):
    """For one routed call: ``trainer._compute_kl_logps`` is :func:`kl_logps` (when the KL term is on), then TRL's
    method again. ``original``: the method the record checked (``None`` when it is not applied: nothing changes)."""
    if original is None or not getattr(trainer, "calculate_KL", False):
        yield
        return
    loss = getattr(trainer, spec.loss_attribute(trainer) or "", None)

    @functools.wraps(original)
    def _compute_kl_logps(model, batch):
        return kl_logps(trainer, model, batch, loss)

    own = vars(trainer).get("_compute_kl_logps")
    trainer._compute_kl_logps = _compute_kl_logps
    try:
        yield
    finally:
        if own is None:
            vars(trainer).pop("_compute_kl_logps", None)
        else:
            trainer._compute_kl_logps = own

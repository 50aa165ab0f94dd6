"""A real DeepSpeed run on CPU (torchrun, gloo): Liger DPO/KTO for a few optimizer steps under ZeRO-2 or ZeRO-3.

Launched by tests/test_deepspeed.py once with the package (``PROBE_PATCH=before``) and once without (``none``); the
test then asks that both runs be the same run: TRL's own fused loss object, the same logged metrics, the same weights.
Rank 0 writes JSON to ``--out``; the final weights, gathered from every rank, are recorded as a sha256 per parameter.

What it takes to run DeepSpeed here: the CPU accelerator (which falls back to gloo without oneCCL), a ``PartialState``
configured for DeepSpeed before the training arguments (``use_configured_state``, else accelerate sees one process),
``use_cpu=False`` (``True`` skips DeepSpeed's distributed setup), ``bf16=False`` (TRL turns it on) and HF's AdamW
(``zero_force_ds_cpu_optimizer: false``: no DeepSpeed CPU-Adam build).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("ACCELERATE_USE_DEEPSPEED", "true")

PATCH_MODE = os.environ.get("PROBE_PATCH", "before")
if PATCH_MODE == "before":
    import liger_ddp_patch  # noqa: F401
elif PATCH_MODE != "none":
    raise SystemExit(f"PROBE_PATCH={PATCH_MODE!r}: use 'before' or 'none'")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from harness.probe import (  # noqa: E402
    CHAT_TEMPLATE,
    NO_TRITON,
    _dataset,
    _teacher,
    _trainer_classes,
    trainer_specs,
)

import liger_ddp_patch  # noqa: E402,F401  (PROBE_PATCH=none too: the test launches it disabled and reads its report)


def ds_config(stage: int) -> dict:
    """``"auto"`` values are filled from the training arguments; HF's AdamW, not DeepSpeed's compiled CPU-Adam."""
    return {
        "zero_optimization": {"stage": stage},
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_force_ds_cpu_optimizer": False,
    }


def gathered_digests(module: torch.nn.Module) -> tuple[dict, list]:
    """sha256 of every parameter's full fp32 bytes (ZeRO-3 shards gathered: a collective), and which were partitioned.

    Partitioned: the full tensor is absent on this rank between steps (ZeRO-3 keeps parameters below
    ``stage3_param_persistence_threshold`` whole on every rank).
    """
    import deepspeed

    digests, partitioned = {}, []
    for name, param in module.named_parameters():
        if hasattr(param, "ds_id") and param.data.numel() == 0:
            partitioned.append(name)
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            data = param.detach().float().cpu().contiguous()
            digests[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return digests, partitioned


def run_one(kind: str, args) -> dict:
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AcceleratorState._reset_state()  # one Accelerator per trainer; the distributed PartialState stays
    import dataclasses

    config_cls, trainer_cls = _trainer_classes(kind)
    spec = trainer_specs()[kind]
    rank = dist.get_rank()
    # GKD/GOLD/Distillation: no generation, temperature 1, GOLD without ULD, Distillation's full-vocabulary loss
    distill = dict(lmbda=0.0, beta=0.5, temperature=1.0, max_new_tokens=4, max_completion_length=8,
                   use_uld_loss=False, loss_top_k=0) if spec.dataset == "messages" else {}  # fmt: skip
    fields = {f.name for f in dataclasses.fields(config_cls)}
    config = config_cls(
        **{k: v for k, v in distill.items() if k in fields},
        output_dir=tempfile.mkdtemp(prefix=f"ds-probe-{kind}-"),
        deepspeed=ds_config(args.zero_stage),
        accelerator_config={"use_configured_state": True},
        use_liger_kernel=True,
        liger_kernel_config=NO_TRITON,
        per_device_train_batch_size=2,
        max_steps=args.steps,
        bf16=False,
        use_cpu=False,
        logging_steps=1,
        max_length=64,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    # Built after the config, so under ZeRO-3 from_pretrained partitions the weights as it loads them (zero.Init).
    model = AutoModelForCausalLM.from_pretrained(args.assets, dtype=torch.float32)
    tokenizer, extra = AutoTokenizer.from_pretrained(args.assets), {}
    if spec.dataset == "messages":  # a chat template for the conversations, and a frozen teacher
        tokenizer.chat_template = CHAT_TEMPLATE
        extra["teacher_model"] = _teacher(args.assets, torch.float32)
    trainer = trainer_cls(
        model=model,
        args=config,
        train_dataset=_dataset(kind, rank),  # different rows per rank
        processing_class=tokenizer,
        **extra,
    )
    trainer.train()
    loss = getattr(trainer, spec.loss_attribute(trainer))
    digests, partitioned = gathered_digests(trainer.accelerator.unwrap_model(trainer.model))
    return {
        "trainer": kind,
        "engine": type(trainer.model_wrapped).__name__,
        "engine_zero_stage": trainer.model_wrapped.zero_optimization_stage(),
        "world_size": dist.get_world_size(),
        "loss_class": type(loss).__name__,
        "loss_module": type(loss).__module__,
        "history": trainer.state.log_history,
        "weights": digests,
        "partitioned": partitioned,
        # the steps each gradient check of the package compared (its default check: none, under DeepSpeed)
        "checks": {
            type(c).__name__: c.checked_steps for c in trainer.callback_handler.callbacks if hasattr(c, "checked_steps")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", required=True, help="folder with the tiny model and tokenizer (demo.tiny.build)")
    parser.add_argument("--trainers", default="dpo,kto")
    parser.add_argument("--zero-stage", type=int, choices=(2, 3), required=True)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from accelerate import PartialState

    PartialState(backend="gloo")  # DeepSpeed-typed (ACCELERATE_USE_DEEPSPEED), before any training arguments
    results = [run_one(kind, args) for kind in args.trainers.split(",")]
    package = sys.modules.get("liger_ddp_patch")
    report = [s.as_dict() for s in package.report()] if package else None
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump({"patch_mode": PATCH_MODE, "stage": args.zero_stage, "results": results, "report": report}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

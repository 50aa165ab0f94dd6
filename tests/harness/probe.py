"""The 2-rank probe: one Liger step per trainer under ``torchrun``, then its gradients compared across ranks.

It runs as a plain script and never imports the package unless asked: the trainer specs and the tiny model's words
and rows are read from the checkout's files (``liger_ddp_patch/patches/trainers.py``, ``liger_ddp_patch/demo/tiny.py``).

Each rank trains on different rows, so gradients that were never all-reduced differ. Rank 0 writes a JSON result to
``--out``. Run without torchrun it is one plain process; ``--grads-out`` then keeps the gradients for a bitwise
comparison between runs; under torchrun it keeps rank 0's first synchronised gradients. ``--configs`` runs several
named setups (:data:`CONFIGS`: LoRA, checkpointing, a reference model, ...) in one launch, each on a fresh model and
trainer, and ``--arms`` runs each of them with Liger, with Liger's fused loss kept while routed, and with Liger off.
``PROBE_PATCH`` says how the package arrives: ``before`` (imported before TRL), ``after``
(after ``from trl import ...``), ``late`` (after the trainers are built), ``none`` (never imported here; a
``sitecustomize`` may still bring it).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

PATCH_MODE = os.environ.get("PROBE_PATCH", "before")
if PATCH_MODE == "before":
    import liger_ddp_patch  # noqa: F401

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Liger's Triton model kernels need a GPU; its chunked losses are plain PyTorch and run on CPU.
NO_TRITON = {k: False for k in ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy",
                                "layer_norm", "geglu")}  # fmt: skip

# Named setups for --configs, each a fresh model and trainer. Keys override the command line: trainer, lora (LoRA on
# q/v), modules_to_save, peft_model (a PeftModel, adapters already moved off zero, handed to the trainer), checkpointing
# ("reentrant"/"non-reentrant"), find_unused (ddp_find_unused_parameters), ref_model (an explicit reference model),
# grad_accum, loss_type, bf16, model_dtype, loss_options (LIGER_DDP_PATCH_LOSS while it trains: token_chunk_size=1
# makes every pair / row longer than a chunk), compile (torch_compile=True with this backend), regional (accelerate's
# regional compilation). A trainer's short name alone is its plain setup.
CONFIGS: dict[str, dict] = {
    # torch_compile=True (inductor, the default backend): the Trainer hands compute_loss torch.compile(DDP)
    **{f"{kind}-compile": {"trainer": kind, "compile": "inductor"} for kind in ("dpo", "kto", "gkd")},
    "dpo-compile-regional": {"trainer": "dpo", "compile": "inductor", "regional": True},
    "dpo-bf16-mixed": {"trainer": "dpo", "bf16": True},  # fp32 weights, bf16=True (TRL's default)
    "kto-bf16-mixed": {"trainer": "kto", "bf16": True},
    "dpo-bf16": {"trainer": "dpo", "bf16": True, "model_dtype": "bfloat16"},  # the upstream report's setting
    "dpo-lora": {"trainer": "dpo", "lora": True},
    "dpo-lora-gc": {"trainer": "dpo", "lora": True, "checkpointing": "non-reentrant"},
    "dpo-lora-head": {"trainer": "dpo", "lora": True, "modules_to_save": ["lm_head"]},
    "dpo-peft-model": {"trainer": "dpo", "peft_model": True},
    "dpo-gc": {"trainer": "dpo", "checkpointing": "non-reentrant"},
    "dpo-gc-reentrant": {"trainer": "dpo", "checkpointing": "reentrant"},
    "dpo-find-unused": {"trainer": "dpo", "find_unused": True},
    "dpo-ref-model": {"trainer": "dpo", "ref_model": True},
    "dpo-grad-accum": {"trainer": "dpo", "grad_accum": 2},
    "dpo-apo-zero": {"trainer": "dpo", "loss_type": ["apo_zero"]},
    "dpo-long-pairs": {"trainer": "dpo", "loss_options": "token_chunk_size=1"},
    "kto-long-rows": {"trainer": "kto", "loss_options": "token_chunk_size=1"},
    "dpo-bf16-long-pairs": {
        "trainer": "dpo",
        "bf16": True,
        "model_dtype": "bfloat16",
        "loss_options": "token_chunk_size=1",
    },
    "dpo-two-pass": {"trainer": "dpo", "loss_options": "one_pass=0,token_chunk_size=3"},
    "kto-lora": {"trainer": "kto", "lora": True},
    "kto-bf16": {"trainer": "kto", "bf16": True, "model_dtype": "bfloat16"},
    "kto-gc": {"trainer": "kto", "checkpointing": "non-reentrant"},
    "kto-peft-model": {"trainer": "kto", "peft_model": True},
    # A PeftModel makes Trainer default ddp_find_unused_parameters=True, which DDP cannot combine with reentrant
    # checkpointing: "Expected to mark a variable ready only once", with or without Liger.
    "dpo-lora-gc-reentrant": {"trainer": "dpo", "lora": True, "checkpointing": "reentrant"},
    # The distillation trainers (a student and a frozen teacher; lmbda=0 by default: no generation). lmbda=1: every
    # batch is generated on-policy by the student under DDP first.
    **{f"{kind}-onpolicy": {"trainer": kind, "lmbda": 1.0} for kind in ("gkd", "gold", "distillation")},
    **{f"{kind}-lora": {"trainer": kind, "lora": True} for kind in ("gkd", "gold", "distillation")},
    **{
        f"{kind}-find-unused": {"trainer": kind, "find_unused": True}
        for kind in ("gkd", "gold", "distillation", "iw_opd")
    },
    # find_unused_parameters=True with a head TRL 1.6-1.13 may keep outside DDP's forward: tied, or frozen (LoRA)
    "gkd-find-unused-tied": {"trainer": "gkd", "find_unused": True, "tied": True},
    "gkd-find-unused-lora": {"trainer": "gkd", "find_unused": True, "lora": True},
    # Distillation's default loss_top_k=1 (the non-Liger loss on the top-1 token plus a tail bucket), which its Liger
    # path ignores (full-vocabulary JSD); the other configs use loss_top_k=0 (full vocabulary) on both paths.
    "distillation-top1": {"trainer": "distillation", "loss_top_k": 1},
    "iw_opd-top1": {"trainer": "iw_opd", "loss_top_k": 1},  # IW-OPD (1.9-1.13): Distillation's frozen code, the same
    "gkd-temp": {"trainer": "gkd", "temperature": 0.9},  # GKDConfig's default temperature (the others use 1.0)
    # on the model of --real-assets (Qwen's 151,936-token vocabulary) in a launch whose other configs use --assets
    **{f"{kind}-real-vocab": {"trainer": kind, "real_vocab": True} for kind in ("gkd", "distillation")},
}
LOSS_VARIABLE = "LIGER_DDP_PATCH_LOSS"  # settings.LOSS, spelled out: importing the package here would patch TRL
ARMS = ("liger", "fused", "off")  # use_liger_kernel=True; the same with TRL's fused loss kept; use_liger_kernel=False
PACKAGE = Path(__file__).resolve().parents[2] / "liger_ddp_patch"  # the checkout's, first on the ranks' PYTHONPATH


def setup(name: str, arm: str, args) -> argparse.Namespace:
    """The command line with config ``name``'s keys and ``arm`` applied (unknown names: a trainer's plain setup)."""
    defaults = {"lora": False, "modules_to_save": None, "peft_model": False, "checkpointing": None,
                "find_unused": None, "ref_model": False, "loss_type": None, "loss_options": None,
                "lmbda": 0.0, "tied": False, "loss_top_k": 0, "temperature": 1.0, "real_vocab": False,
                "compile": None, "regional": False}  # fmt: skip
    merged = {**defaults, **vars(args), **CONFIGS.get(name, {"trainer": name}), "config": name, "arm": arm}
    if arm == "off":
        merged["no_liger"] = True
    return argparse.Namespace(**merged)


def tag(name: str, arm: str) -> str:
    """The file suffix of one run: the config name, plus the arm unless it is plain Liger."""
    return name if arm == "liger" else f"{name}.{arm}"


@functools.cache
def package_file(relative: str):
    """A module of the package read from its file: importing liger_ddp_patch would patch TRL."""
    import importlib.util

    loader = importlib.util.spec_from_file_location(f"_liger_ddp_patch_{Path(relative).stem}", PACKAGE / relative)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


@functools.cache
def trainer_specs() -> dict:
    """The package's trainer specs by name."""
    return {spec.name: spec for spec in package_file("patches/trainers.py").SPECS}


def _trainer_classes(kind: str):
    import importlib

    import trl

    spec = trainer_specs()[kind]
    module = importlib.import_module(spec.module_at(trl.__version__))
    return getattr(module, spec.config), getattr(module, spec.trainer)


def _dataset(kind: str, rank: int):
    from datasets import Dataset

    rows = prompt_rows(rank)
    if trainer_specs()[kind].dataset == "messages":  # a conversation (TRL's DataCollatorForChatML reads `messages`)
        rows = [
            {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["chosen"]}]}
            for r in rows
        ]
    elif trainer_specs()[kind].dataset == "unpaired":
        rows = [
            {"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
            for i, r in enumerate(rows)
        ]
    return Dataset.from_list(rows)


def prompt_rows(rank: int, n: int = 32) -> list[dict]:
    """Preference rows that differ per rank (the demo's, written with the tiny tokenizer's words)."""
    return package_file("demo/tiny.py").prompt_rows(rank, n)


STEPPED = "_stepped"  # a key of _watch_losses' record: set at the first optimizer step


def _watch_losses(seen: dict) -> object:
    """Note the dtypes and autocast state each DPO/KTO loss module sees, and the dtypes the Linear layers (the decoders'
    GEMMs) put out (to show which precision really ran)."""

    def hook(module, args, kwargs, output):  # the global *post* hook sees keywords too (KTO passes them all so)
        name = type(module).__name__
        if name == "Linear" and torch.is_tensor(output) and STEPPED not in seen:  # the first training step's GEMMs
            linear = seen.setdefault("Linear outputs", [])
            if str(output.dtype) not in linear:
                linear.append(str(output.dtype))
        if name.endswith(("DPOLoss", "KTOLoss")):
            tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.is_floating_point()]
            seen.setdefault(
                name, sorted({str(t.dtype) for t in tensors} | {f"autocast={torch.is_autocast_enabled('cpu')}"})
            )
            loss = output[0] if isinstance(output, tuple) else output
            seen.setdefault(f"{name} grad_fn", type(getattr(loss, "grad_fn", None)).__name__)
            if getattr(module, "last_path", None) is not None:  # ours: the path and token chunk it really ran
                seen.setdefault(f"{name} path", module.last_path)
                seen.setdefault(f"{name} chunk", module.last_chunk)
                seen.setdefault(f"{name} sweep", getattr(module, "last_sweep", None))

    handle = torch.nn.modules.module.register_module_forward_hook(hook, with_kwargs=True)
    kl = sys.modules.get("liger_ddp_patch.patches.kl_logps")  # imported where the package is
    if kl is None:
        return handle
    chunked = kl.kl_logps

    def spy(*args, **kwargs):  # the KL rows' log-probs through the chunked head: how often they really ran
        seen["KL log-probs chunked"] = seen.get("KL log-probs chunked", 0) + 1
        return chunked(*args, **kwargs)

    class Undo:
        def remove(self):
            handle.remove()
            kl.kl_logps = chunked

    kl.kl_logps = spy
    return Undo()


def save_gradients(model: torch.nn.Module, path: str) -> dict:
    """One process: keep every gradient for a bitwise comparison between runs."""
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.save(grads, path)
    return {"params": len(grads)}


def compare_across_ranks(model: torch.nn.Module, mean: dict | None = None) -> dict:
    """Gradients of every parameter gathered from all ranks: how many differ from rank 0, and by how much.

    ``mean``: filled with each gradient's mean over the ranks (what DDP's all-reduce would have made of them).
    """
    world = dist.get_world_size()
    differing, total, max_diff, names = 0, 0, 0.0, []
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad.detach().float().contiguous()
        gathered = [torch.empty_like(grad) for _ in range(world)]
        dist.all_gather(gathered, grad)
        diff = max((gathered[0] - other).abs().max().item() for other in gathered[1:])
        if mean is not None:
            mean[name] = sum(gathered) / world
        total += 1
        max_diff = max(max_diff, diff)
        if diff > 0:
            differing += 1
            names.append(name)
    trainable = sum(p.requires_grad for p in model.parameters())  # what "params" must reach: every one got a gradient
    return {"params": total, "trainable": trainable, "differing": differing, "max_abs_diff": max_diff,
            "differing_names": names[:5]}  # fmt: skip


def _optional(args) -> dict:
    """Config keywords set only when asked for, so the plain probe builds the same config on every TRL release."""
    extra: dict = {}
    if args.lr is not None:
        extra["learning_rate"] = args.lr
    if args.optim:
        extra["optim"] = args.optim
    if args.checkpointing:
        extra["gradient_checkpointing"] = True
        extra["gradient_checkpointing_kwargs"] = {"use_reentrant": args.checkpointing == "reentrant"}
    if args.find_unused is not None:
        extra["ddp_find_unused_parameters"] = args.find_unused
    if args.loss_type:
        extra["loss_type"] = args.loss_type
    if args.compile:
        extra.update(torch_compile=True, torch_compile_backend=args.compile)
    if args.save_steps:
        extra.update(save_strategy="steps", save_steps=args.save_steps)
    if trainer_specs()[args.trainer].dataset == "messages":
        # temperature 1 unless a config sets it (TRL 1.13's Liger path applies none); short generations (a
        # completion shorter than max_length: GOLD 1.6 requires it); GOLD without its ULD loss; the full vocabulary
        # for Distillation's loss; IW-OPD's generalized JSD (its own objective refuses Liger). Each config takes the
        # fields it has.
        extra.update(lmbda=args.lmbda, beta=0.5, temperature=args.temperature, max_new_tokens=4,
                     max_completion_length=8, use_uld_loss=False, loss_top_k=args.loss_top_k,
                     distillation_objective="jsd")  # fmt: skip
        # no clipping: each unsynchronised rank would clip by its own norm, and the mean of the ranks' gradients
        # (what the all-reduce makes of them, kept by --grads-out) would no longer be comparable
        extra["max_grad_norm"] = 0.0
    return extra


def _lora(args):
    from peft import LoraConfig

    # No dropout: every arm must draw the same numbers.
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      modules_to_save=args.modules_to_save, task_type="CAUSAL_LM")  # fmt: skip


def _peft_model(model, args):
    """A PeftModel built before the trainer, its adapters moved off zero as training leaves them."""
    from peft import get_peft_model

    model = get_peft_model(model, _lora(args))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    return model


def keep_fused(trainer, spec) -> None:
    """Make the trainer's fused loss a trivial subclass, which the package's swap keeps: TRL's own loss, routed."""
    attribute = spec.loss_attribute(trainer)
    loss = getattr(trainer, attribute)
    loss.__class__ = type(f"Kept{type(loss).__name__}", (type(loss),), {})


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} <eos> {% endfor %}"


def _teacher(assets: str, dtype):
    """The student's architecture with its own weights (seeded), frozen as TRL freezes a teacher."""
    from transformers import AutoModelForCausalLM

    teacher = AutoModelForCausalLM.from_pretrained(assets, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in teacher.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.05)
    return teacher


def _state(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(config_cls, kind: str, args):
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config_cls)}
    return config_cls(
        **{k: v for k, v in _optional(args).items() if k in fields},
        output_dir=os.path.join(args.output_dir, tag(args.config, args.arm))
        if args.output_dir
        else tempfile.mkdtemp(prefix=f"probe-{kind}-"),
        use_liger_kernel=not args.no_liger,
        liger_kernel_config=NO_TRITON,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        max_steps=args.steps,
        gradient_accumulation_steps=args.grad_accum,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        bf16=args.bf16,
        logging_steps=1,
        max_length=64,
        use_cpu=args.device == "cpu",
        ddp_backend="gloo" if args.device == "cuda" else None,  # NCCL refuses two ranks on one GPU
        **({} if args.save_steps else {"save_strategy": "no"}),
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def run_one(name: str, assets: str, args, arm: str = "liger") -> dict:
    """One config (a trainer's short name or a key of :data:`CONFIGS`) under one arm: build, train, record."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed

    args = setup(name, arm, args)
    if args.real_vocab:
        if not args.real_assets:
            raise SystemExit(f"config {name} needs --real-assets")
        assets = args.real_assets
    kind, out = args.trainer, tag(name, arm)
    spec = trainer_specs()[kind]
    config_cls, trainer_cls = _trainer_classes(kind)
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    tokenizer = AutoTokenizer.from_pretrained(assets)
    model = AutoModelForCausalLM.from_pretrained(assets, dtype=getattr(torch, args.model_dtype))
    if args.tied:  # the head becomes the input embedding (as tied checkpoints load)
        model.config.tie_word_embeddings = True
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    regional = "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"  # read when the Trainer builds its Accelerator
    os.environ[regional] = str(bool(args.regional))
    config = _config(config_cls, kind, args)
    result: dict = {"trainer": kind, "config": name, "arm": arm}
    # The eval set is the same on every rank: the Trainer shards it, so eval metrics are comparable across runs.
    eval_dataset = _dataset(kind, 7) if args.eval_steps else None
    extra: dict = {}
    set_seed(0)  # LoRA's init draws from the global RNG inside the trainer, before Trainer seeds it
    if args.peft_model:
        model = _peft_model(model, args)
    elif args.lora:
        extra["peft_config"] = _lora(args)
    if args.ref_model:
        extra["ref_model"] = AutoModelForCausalLM.from_pretrained(assets, dtype=getattr(torch, args.model_dtype))
    teacher = teacher_before = None
    if spec.dataset == "messages":
        tokenizer.chat_template = CHAT_TEMPLATE
        if kind == "gold":  # GOLD 1.6+ refuses a tokenizer without a ByteLevel decoder (even without its ULD loss)
            from tokenizers import decoders

            tokenizer.backend_tokenizer.decoder = decoders.ByteLevel()
        extra["teacher_model"] = teacher = _teacher(assets, getattr(torch, args.model_dtype))
        teacher_before = _state(teacher)
    if args.weights_out and rank == 0:
        torch.save({k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()},
                   f"{args.weights_out}.{out}.init.pt")  # fmt: skip
    trainer = trainer_cls(
        model=model,
        args=config,
        train_dataset=_dataset(kind, rank),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        **extra,
    )
    os.environ.pop(regional)
    if arm == "fused":
        keep_fused(trainer, spec)

    seen: dict = {}

    class GradProbe(TrainerCallback):
        def on_pre_optimizer_step(self, _args, state, control, **kwargs):
            seen[STEPPED] = True  # the Linear outputs noted are the first training step's (not an evaluation's)
            model = trainer.accelerator.unwrap_model(trainer.model)
            if dist.is_initialized():
                mean: dict = {}
                result.update(compare_across_ranks(model, mean))
                if args.grads_out and state.global_step == 0 and rank == 0:  # after DDP's all-reduce
                    save_gradients(model, f"{args.grads_out}.{out}.pt")
                    torch.save(mean, f"{args.grads_out}.{out}.mean.pt")  # what an all-reduce would have made
            elif args.grads_out and state.global_step == 0:
                result.update(save_gradients(model, f"{args.grads_out}.{out}.pt"))

    if PATCH_MODE == "late":
        import liger_ddp_patch  # noqa: F401  (the trainer already holds a fused loss: the patch must convert it)

    trainer.add_callback(GradProbe())
    result["callbacks"] = [type(c).__name__ for c in trainer.callback_handler.callbacks]  # e.g. the sync verifier
    handle = _watch_losses(seen)
    saved = os.environ.get(LOSS_VARIABLE)
    if args.loss_options:  # read by the loss swap, the first time the trainer computes a loss under DDP
        os.environ[LOSS_VARIABLE] = args.loss_options
    try:
        resume = os.path.join(config.output_dir, args.resume) if args.resume else None
        trainer.train(resume_from_checkpoint=resume)
    finally:
        handle.remove()
        if saved is None:
            os.environ.pop(LOSS_VARIABLE, None)
        else:
            os.environ[LOSS_VARIABLE] = saved
    seen.pop(STEPPED, None)
    result["loss_saw"] = seen
    result["history"] = trainer.state.log_history
    result["evals"] = [h for h in trainer.state.log_history if "eval_loss" in h]
    if args.weights_out and rank == 0:
        weights = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        torch.save({k: v.detach().float().cpu() for k, v in weights.items()}, f"{args.weights_out}.{out}.pt")
    attribute = spec.loss_attribute(trainer)
    result["loss_class"] = type(getattr(trainer, attribute)).__name__ if attribute else "NoneType"
    if teacher is not None:  # the teacher must come out bit for bit as it went in
        after = _state(teacher)
        result["teacher_changed"] = sum(not torch.equal(v, after[k]) for k, v in teacher_before.items())
        result["teacher_params"] = len(after)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", required=True, help="folder with the tiny model and tokenizer (demo.tiny.build)")
    parser.add_argument("--real-assets", help="the same at the real vocabulary, for the *-real-vocab configs")
    parser.add_argument("--trainers", default="dpo,kto")
    parser.add_argument(
        "--configs", help="comma-separated keys of CONFIGS (or trainer names), run in turn; overrides --trainers"
    )
    parser.add_argument("--arms", default="liger", help=f"comma-separated, each config under each: {', '.join(ARMS)}")
    parser.add_argument("--lr", type=float, help="learning rate (default: TRL's)")
    parser.add_argument("--optim", help="Trainer optimizer name, e.g. sgd (default: TRL's AdamW)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--output-dir", help="output_dir is OUTPUT_DIR/<config>[.<arm>] (default: a temporary folder)")
    parser.add_argument("--save-steps", type=int, default=0, help="save a checkpoint every N steps (0: never)")
    parser.add_argument("--resume", help="resume_from_checkpoint: a checkpoint's folder name, e.g. checkpoint-1")
    parser.add_argument("--eval-steps", type=int, default=0, help="evaluate every N steps (0: no evaluation)")
    parser.add_argument(
        "--bf16", action="store_true", help="TRL's bf16=True (mixed precision; the loss still sees fp32)"
    )
    parser.add_argument("--model-dtype", default="float32", help="e.g. bfloat16: the loss then gets bf16 tensors")
    parser.add_argument("--no-liger", action="store_true", help="use_liger_kernel=False: the reference run")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: each rank on cuda:LOCAL_RANK, gloo (two one-process nodes can share cuda:0)",
    )
    parser.add_argument("--weights-out", help="rank 0 saves the final weights to WEIGHTS_OUT.<trainer>.pt")
    parser.add_argument(
        "--grads-out",
        help="save the first step's gradients to GRADS_OUT.<config>[.<arm>].pt (under torchrun: rank 0's, after the "
        "all-reduce)",
    )
    args = parser.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    unknown += [c for c in (args.configs or "").split(",") if c and c not in CONFIGS and c not in trainer_specs()]
    if unknown:
        parser.error(f"unknown arm(s) or config(s) {', '.join(unknown)}; arms: {', '.join(ARMS)}; configs: "
                     f"{', '.join([*trainer_specs(), *CONFIGS])}")  # fmt: skip

    if PATCH_MODE == "after":
        from trl import DPOTrainer  # noqa: F401  (the lazy import path users take)

        import liger_ddp_patch  # noqa: F401

    results = []
    rank = int(os.environ.get("RANK", "0"))
    for name in (args.configs or args.trainers).split(","):
        for arm in args.arms.split(","):
            try:
                results.append(run_one(name, args.assets, args, arm))
            except Exception as exc:  # record the crash (e.g. the TensorWrapper error) and go on to the next run
                error = f"{type(exc).__name__}: {exc}"
                kind = CONFIGS.get(name, {"trainer": name})["trainer"]
                results.append({"trainer": kind, "config": name, "arm": arm, "error": error,
                                "trace": traceback.format_exc()})  # fmt: skip
                if rank == 0:
                    # stderr, where the package logs: the order of the two lines is the order of the events
                    print(
                        f"[probe] {tag(name, arm)} failed: {error.splitlines()[0][:200]}", file=sys.stderr, flush=True
                    )

    report = None
    if "liger_ddp_patch" in sys.modules:
        report = [s.as_dict() for s in sys.modules["liger_ddp_patch"].report()]
    from importlib import metadata

    import trl

    if rank == 0:
        liger = metadata.version(
            "liger-kernel"
        )  # the version matrix puts other liger-kernel releases first on the path
        with open(args.out, "w") as fh:
            json.dump({"trl": trl.__version__, "liger_kernel": liger, "patch_mode": PATCH_MODE, "results": results,
                       "report": report}, fh)  # fmt: skip
    if dist.is_initialized():
        # Every rank leaves together: a rank tearing gloo down while another still works can abort at exit
        # ("terminate called without an active exception"), and a two-node torchrun then waits 300 s for it.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

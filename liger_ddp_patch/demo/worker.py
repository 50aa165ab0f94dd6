"""The demo's worker: one Liger DPO or KTO step on each rank (``torchrun``), its gradients compared across the ranks.

``liger-ddp-patch demo`` launches it twice: ``--patched`` imports the package first, as a training script would;
without it the package is never imported here. Each rank trains on different rows, so gradients that DDP never
all-reduced differ. Rank 0 writes a JSON result to ``--out``.

It runs as a plain script: the tiny model's rows and the trainer specs are read from their files (importing them as
``liger_ddp_patch.*`` would import the package, and so patch TRL, in the unpatched run).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
# Liger's Triton model kernels need a GPU; its chunked losses are plain PyTorch and run on CPU.
NO_TRITON = {k: False for k in ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy",
                                "layer_norm", "geglu")}  # fmt: skip


@functools.cache
def load(relative: str):
    """A module of the package read from its file, without importing the package."""
    spec = importlib.util.spec_from_file_location(f"_liger_ddp_demo_{Path(relative).stem}", PACKAGE / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(kind: str, rank: int) -> list[dict]:
    """This rank's rows: preference pairs for DPO, the same as unpaired completions with a label for KTO."""
    pairs = load("demo/tiny.py").prompt_rows(rank)
    if kind == "dpo":
        return pairs
    return [{"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
            for i, r in enumerate(pairs)]  # fmt: skip


def compare_across_ranks(model) -> dict:
    """Every parameter's gradient gathered from all ranks: how many differ from rank 0's, and by how much."""
    import torch
    import torch.distributed as dist

    counted, differing, largest = 0, 0, 0.0
    for param in model.parameters():
        if param.grad is None:
            continue
        grad = param.grad.detach().float().contiguous()
        gathered = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, grad)
        diff = max((gathered[0] - other).abs().max().item() for other in gathered[1:])
        counted, differing, largest = counted + 1, differing + (diff > 0), max(largest, diff)
    trainable = sum(p.requires_grad for p in model.parameters())  # "0 differing" must cover every one of them
    return {"params": counted, "trainable": trainable, "differing": differing, "max_abs_diff": largest}


def one_step(kind: str, assets: str) -> dict:
    """Build the trainer as a user would (Liger on, CPU), train one optimizer step, compare the gradients before it."""
    import torch
    import torch.distributed as dist
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed

    spec = {s.name: s for s in load("patches/trainers.py").SPECS}[kind]
    module = importlib.import_module(spec.module_at(trl.__version__))  # KTO moved between releases
    config_cls, trainer_cls = getattr(module, spec.config), getattr(module, spec.trainer)
    config = config_cls(
        output_dir=tempfile.mkdtemp(prefix=f"demo-{kind}-"),
        use_liger_kernel=True,
        liger_kernel_config=NO_TRITON,
        per_device_train_batch_size=2,
        max_steps=1,
        bf16=False,
        logging_steps=1,
        max_length=64,
        use_cpu=True,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    tokenizer = AutoTokenizer.from_pretrained(assets)
    model = AutoModelForCausalLM.from_pretrained(assets, dtype=torch.float32)
    set_seed(0)
    trainer = trainer_cls(
        model=model, args=config, train_dataset=Dataset.from_list(rows(kind, rank)), processing_class=tokenizer
    )
    result: dict = {"trainer": kind}

    class CompareGradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):  # after DDP's all-reduce, if there was one
            result.update(compare_across_ranks(trainer.accelerator.unwrap_model(trainer.model)))

    trainer.add_callback(CompareGradients())
    trainer.train()
    attribute = spec.loss_attribute(trainer)
    result["loss_class"] = type(getattr(trainer, attribute)).__name__ if attribute else "NoneType"
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--assets", required=True, help="folder with the tiny model and tokenizer (tiny.build)")
    parser.add_argument("--trainers", default="dpo,kto")
    parser.add_argument("--patched", action="store_true", help="import liger_ddp_patch first")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.patched:
        import liger_ddp_patch  # noqa: F401  (before TRL, as in a training script)
    import torch.distributed as dist
    import trl

    results = []
    for kind in args.trainers.split(","):
        try:
            results.append(one_step(kind, args.assets))
        except Exception as exc:  # a crash (e.g. TRL's fused loss inside DDP) is a row of the table
            results.append({"trainer": kind, "error": f"{type(exc).__name__}: {exc}"})
    package = sys.modules.get("liger_ddp_patch")
    report = [s.as_dict() for s in package.report()] if package else None
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as fh:
            json.dump({"trl": trl.__version__, "results": results, "report": report}, fh)
    if dist.is_initialized():
        dist.barrier()  # every rank leaves together: one tearing gloo down under another can abort at exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One process, one TRL release: DPO/KTO trainers built with given settings; TRL's own losses and our warnings.

Run by tests/test_liger_settings.py with a TRL release first on PYTHONPATH:

    python tests/_settings_probe.py CASES.json OUT.json ASSETS REF_ASSETS

Each case builds a trainer with ``use_liger_kernel=True`` and the case's config (fp32, CPU, tiny model, Liger's Triton
kernels off), records the package's warnings emitted while it was built (or the exception that stopped it), then
computes TRL's Liger loss on one fixed batch and, with ``use_liger_kernel`` turned off on the same trainer, TRL's
non-Liger loss. A case with ``perturb_ref`` computes both again after moving the PEFT "ref" adapter. Cases named in
``control`` run again after ``liger_ddp_patch.unpatch()``: their losses must not move by a bit.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import logging
import sys
import tempfile
import traceback

import torch

import liger_ddp_patch  # noqa: F401  (before TRL: the hooks fire when TRL's trainer modules load)

NO_TRITON = {k: False for k in ("rope", "rms_norm", "swiglu", "cross_entropy", "fused_linear_cross_entropy",
                                "layer_norm", "geglu")}  # fmt: skip
WORDS = "a good bad answer from the model rank one two three four five six".split()


class Captured(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def classes(kind: str):
    import trl

    from liger_ddp_patch.patches.trainers import SPECS

    spec = next(s for s in SPECS if s.name == kind)
    module = importlib.import_module(spec.module_at(trl.__version__))
    return spec, getattr(module, spec.config), getattr(module, spec.trainer)


def dataset(kind: str):
    from datasets import Dataset

    rows = [
        {
            "prompt": f"rank {WORDS[8 + i % 6]} question",
            "chosen": f"a good answer {WORDS[8 + i % 6]}",
            "rejected": f"a bad answer from the model {WORDS[8 + (i + 1) % 6]}",  # longer: LD-DPO has a tail
        }
        for i in range(4)
    ]
    if kind == "kto":
        rows = [
            {"prompt": r["prompt"], "completion": r["chosen" if i % 2 else "rejected"], "label": bool(i % 2)}
            for i, r in enumerate(rows)
        ]
    return Dataset.from_list(rows)


def peft_model(model):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    with torch.no_grad():  # an adapter off zero, as training leaves it
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    return model


def build(case: dict, assets: str, ref_assets: str, captured: Captured):
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    spec, config_cls, trainer_cls = classes(case["kind"])
    config = config_cls(
        output_dir=tempfile.mkdtemp(prefix="settings-"), use_liger_kernel=True, liger_kernel_config=NO_TRITON,
        per_device_train_batch_size=4, per_device_eval_batch_size=4, bf16=False, use_cpu=True, max_length=32,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0, **case.get("config", {}),
    )  # fmt: skip
    set_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(assets)
    model = AutoModelForCausalLM.from_pretrained(assets, dtype=torch.float32)
    kwargs = {}
    if case.get("peft"):
        model = peft_model(model)
    else:
        kwargs["ref_model"] = AutoModelForCausalLM.from_pretrained(ref_assets, dtype=torch.float32)
    captured.lines.clear()
    trainer = trainer_cls(
        model=model, args=config, train_dataset=dataset(case["kind"]), processing_class=tokenizer, **kwargs
    )
    return spec, trainer


def losses(trainer) -> dict:
    """TRL's Liger loss, its reward sums, then TRL's non-Liger loss, on the trainer's first 4 rows."""
    batch = next(iter(trainer.get_eval_dataloader(trainer.train_dataset)))
    inputs = trainer._prepare_inputs(batch)
    trainer.model.train()
    out = {}
    metrics = (getattr(trainer, "_metrics", None) or trainer._stored_metrics)["train"]  # 1.0.0-1.4.0 KTO: stored
    for arm in ("liger", "plain"):
        trainer.use_liger_kernel = trainer.args.use_liger_kernel = arm == "liger"
        metrics.clear()
        loss = trainer.compute_loss(trainer.model, inputs)
        out[arm] = loss.item()
        out[f"{arm}_rewards"] = [v[-1] for k, v in sorted(metrics.items()) if "rewards" in k and "accurac" not in k]
    trainer.use_liger_kernel = trainer.args.use_liger_kernel = True
    return out


def perturb_ref_adapter(trainer) -> None:
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if ".ref." in name and "lora_B" in name:
                param.add_(torch.full_like(param, 0.05))


def run(case: dict, assets: str, ref_assets: str, captured: Captured) -> dict:
    import time

    from liger_ddp_patch import log

    if not case.get("keep_warned"):
        log._warned.clear()  # each case shows its own warnings; "keep_warned" shows the once-per-process rule
    start = time.perf_counter()
    result: dict = {"id": case["id"]}
    try:
        return _run(case, assets, ref_assets, captured, result)
    finally:
        result["seconds"] = round(time.perf_counter() - start, 2)


def _run(case: dict, assets: str, ref_assets: str, captured: Captured, result: dict) -> dict:
    try:
        _, trainer = build(case, assets, ref_assets, captured)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["warnings"] = list(captured.lines)
        return result
    result["warnings"] = list(captured.lines)
    try:
        result.update(losses(trainer))
        if case.get("perturb_ref"):
            perturb_ref_adapter(trainer)
            result["after"] = losses(trainer)
    except Exception as exc:
        result["loss_error"] = f"{type(exc).__name__}: {exc}"
        result["trace"] = traceback.format_exc()[-2000:]
    return result


def main() -> None:
    cases_path, out_path, assets, ref_assets = sys.argv[1:5]
    spec = json.loads(open(cases_path).read())
    captured = Captured()
    package_logger = logging.getLogger("liger_ddp_patch")
    package_logger.addHandler(captured)
    import trl

    results = [run(case, assets, ref_assets, captured) for case in spec["cases"]]
    report = [s.as_dict() for s in liger_ddp_patch.report(resolve=True)]
    liger_ddp_patch.unpatch()
    control = [run(case, assets, ref_assets, captured) for case in spec["cases"] if case["id"] in spec["control"]]
    with open(out_path, "w") as f:
        liger = importlib.metadata.version("liger-kernel")
        json.dump(
            {"trl": trl.__version__, "liger": liger, "results": results, "control": control, "report": report},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()

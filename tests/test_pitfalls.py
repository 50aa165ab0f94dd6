"""The rank-0 warning before DDP rejects reentrant checkpointing of a PeftModel (find_unused_parameters=True).

Real objects in one gloo process: a tiny Qwen3 under PEFT with transformers' checkpointing, a real
DistributedDataParallel, and the package's compute_loss replacement called as a Trainer would. The 2-rank crash
itself, and the warning before it on rank 0: tests/test_configs.py.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
import torch.distributed as dist
from _fakes import RecordingEngine
from harness import free_port
from torch import nn

from liger_ddp_patch import log
from liger_ddp_patch.patches import compute_loss, pitfalls
from liger_ddp_patch.patches.trainers import DPO


@pytest.fixture(scope="module")
def process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny(peft: bool, reentrant: bool | None):
    """A 1-layer Qwen3, LoRA on q/v when ``peft``, checkpointing as transformers sets it (None: off)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4)  # fmt: skip
    model = Qwen3ForCausalLM(config)
    if reentrant is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if peft:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return model


@pytest.mark.parametrize(
    ("peft", "reentrant", "find_unused", "rejected"),
    [
        (True, True, True, True),
        (True, False, True, False),  # the first fix the warning names
        (True, True, False, False),  # the second
        (True, None, True, False),  # no checkpointing
        (False, True, True, False),  # not a PeftModel: not the case the warning is about
    ],
    ids=["peft-reentrant-unused", "non-reentrant", "find-unused-off", "no-checkpointing", "no-peft"],
)
def test_only_the_combination_ddp_rejects_is_named(process_group, peft, reentrant, find_unused, rejected):
    model = tiny(peft, reentrant)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    assert pitfalls.ddp_rejects(ddp, model) is rejected


def test_peft_is_not_imported_to_ask(monkeypatch):
    monkeypatch.delitem(sys.modules, "peft", raising=False)
    assert pitfalls.is_peft_model(nn.Linear(1, 1)) is False
    assert "peft" not in sys.modules


class Trainer:  # what the replacement reads from a TRL trainer
    use_liger_kernel = True

    class accelerator:  # noqa: N801
        @staticmethod
        def unwrap_model(model):
            return model.module


@pytest.fixture
def records(monkeypatch):
    """Every record of the package logger, on rank 0 of a fresh process (the once-per-process guard reset)."""
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(log, "_warned", set())
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("liger_ddp_patch")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def run_twice(model, find_unused: bool) -> RecordingEngine:
    """Two training steps' compute_loss calls through the package's replacement, under a real DDP wrapper."""
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    engine = RecordingEngine()
    replaced = compute_loss.replacer(DPO)(lambda self, model, inputs, *_: torch.zeros(()), engine)
    for _ in range(2):
        replaced(Trainer(), ddp, {}, False, None)
    return engine


def test_the_first_routed_call_warns_once_on_rank_0_and_notes_it(process_group, records):
    engine = run_twice(tiny(True, True), find_unused=True)
    warnings = [r for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in records]
    message = warnings[0].getMessage()
    fixes = ('gradient_checkpointing_kwargs={"use_reentrant": False}', "ddp_find_unused_parameters=False")
    for words in ("Expected to mark a variable ready only once", "with or without Liger", *fixes):
        assert words in message, message
    assert ("dpo_compute_loss", "Trainer", pitfalls.NOTE) in engine.notes, engine.notes


def test_no_warning_when_ddp_can_run_it(process_group, records):
    """Control: the same PeftModel with find_unused_parameters=False routes silently (INFO line only)."""
    engine = run_twice(tiny(True, True), find_unused=False)
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    assert all(pitfalls.NOTE not in n for n in engine.notes), engine.notes


def test_other_ranks_stay_silent(process_group, records, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    run_twice(tiny(True, True), find_unused=True)
    assert not [r for r in records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------ a float32 model under mixed precision


class MixedTrainer(Trainer):
    """A trainer in ``precision`` mixed precision with ``ref_model`` (TRL's attribute) and ``args``."""

    def __init__(self, precision="bf16", ref_model=None, precompute=False, teacher_model=None, tf32=None):
        self.ref_model, self.teacher_model = ref_model, teacher_model
        self.args = type("Args", (), {"precompute_ref_log_probs": precompute, "tf32": tf32})()
        self.accelerator = type(
            "Acc",
            (),
            {
                "mixed_precision": precision,
                "native_amp": precision != "no",
                "unwrap_model": staticmethod(lambda m: m),
                "autocast": staticmethod(lambda handler=None: torch.autocast("cpu", dtype=torch.bfloat16)),
            },
        )()


@pytest.mark.parametrize(
    ("precision", "policy", "ref", "precompute", "named"),
    [
        ("bf16", torch.bfloat16, torch.float32, False, ["reference model"]),  # TRL's own reference: fp32
        ("fp16", torch.float16, torch.float32, False, ["reference model"]),
        ("bf16", torch.float32, torch.float32, False, ["model", "reference model"]),
        ("bf16", torch.bfloat16, torch.bfloat16, False, []),  # the fix the warning names
        ("no", torch.float32, torch.float32, False, []),  # plain fp32 training: nothing bypassed
        ("bf16", torch.bfloat16, torch.float32, True, []),  # precomputed reference log-probs: never run per step
        ("bf16", torch.bfloat16, None, False, []),  # no reference model (LoRA: the adapter is switched off)
    ],
    ids=["bf16-fp32-ref", "fp16-fp32-ref", "fp32-both", "bf16-both", "no-mixed", "precomputed", "no-ref"],
)
def test_fp32_models_under_mixed_precision_are_named(precision, policy, ref, precompute, named):
    trainer = MixedTrainer(precision, None if ref is None else tiny(False, None).to(ref), precompute)
    assert pitfalls.fp32_models(trainer, tiny(False, None).to(policy)) == named


@pytest.mark.parametrize(("teacher", "named"), [(torch.float32, ["teacher model"]), (torch.bfloat16, [])])
def test_a_distillation_trainers_fp32_teacher_is_named(teacher, named):
    """GKD/GOLD/Distillation keep their teacher in ``teacher_model``; their Liger path calls its decoder directly."""
    trainer = MixedTrainer("bf16", teacher_model=tiny(False, None).to(teacher))
    assert pitfalls.fp32_models(trainer, tiny(False, None).to(torch.bfloat16)) == named


@pytest.mark.parametrize(("tf32", "named"), [(None, ["reference model"]), (False, ["reference model"]), (True, [])])
def test_tf32_the_other_fix_silences_it(tf32, named):
    trainer = MixedTrainer("bf16", tiny(False, None), tf32=tf32)
    assert pitfalls.fp32_models(trainer, tiny(False, None).to(torch.bfloat16)) == named


def test_lora_adapters_in_fp32_do_not_make_a_bf16_model_fp32():
    """PEFT upcasts LoRA adapters to fp32 by default: a few fp32 parameters on a bf16 base are a bf16 model."""
    model = tiny(True, None)
    for name, param in model.named_parameters():
        param.data = param.data.to(torch.float32 if "lora_" in name else torch.bfloat16)
    assert any(p.dtype == torch.float32 for p in model.parameters())
    assert not pitfalls.mostly_fp32(model)
    assert pitfalls.mostly_fp32(tiny(False, None))


def test_a_routed_call_with_an_fp32_reference_warns_once_with_the_fix(process_group, records, monkeypatch):
    """With the autocast opt-out (``LIGER_DDP_PATCH_LOSS=autocast=0``) TRL's Liger path runs the float32 reference
    outside autocast: warned, with the fixes."""
    monkeypatch.setenv("LIGER_DDP_PATCH_LOSS", "autocast=0")
    ddp = nn.parallel.DistributedDataParallel(tiny(False, None).to(torch.bfloat16))
    engine = RecordingEngine()
    replaced = compute_loss.replacer(DPO)(lambda self, model, inputs, *_: torch.zeros(()), engine)
    trainer = MixedTrainer("bf16", tiny(False, None))
    trainer.accelerator.unwrap_model = staticmethod(lambda m: getattr(m, "module", m))
    for _ in range(2):
        replaced(trainer, ddp, {}, False, None)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    for words in ("MixedTrainer runs in bf16 mixed precision", "reference model is float32", "outside the autocast",
                  "drop autocast=0", "dtype=torch.bfloat16", "tf32=True"):  # fmt: skip
        assert words in warnings[0], warnings[0]
    assert ("dpo_compute_loss", "MixedTrainer", pitfalls.FP32_NOTE) in engine.notes, engine.notes


def test_a_routed_call_with_a_bf16_reference_stays_silent(process_group, records):
    """Control: the same call with the reference model in bf16."""
    ddp = nn.parallel.DistributedDataParallel(tiny(False, None).to(torch.bfloat16))
    engine = RecordingEngine()
    replaced = compute_loss.replacer(DPO)(lambda self, model, inputs, *_: torch.zeros(()), engine)
    trainer = MixedTrainer("bf16", tiny(False, None).to(torch.bfloat16))
    trainer.accelerator.unwrap_model = staticmethod(lambda m: getattr(m, "module", m))
    replaced(trainer, ddp, {}, False, None)
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    assert all(pitfalls.FP32_NOTE not in n for n in engine.notes), engine.notes


def test_by_default_the_routed_call_runs_under_autocast_and_stays_silent(process_group, records):
    """The default: the routed original runs inside the accelerator's autocast (as TRL 1.14's fix does), so the float32
    reference's GEMMs run in bf16 and there is nothing to warn about; the decision says so."""
    ddp = nn.parallel.DistributedDataParallel(tiny(False, None).to(torch.bfloat16))
    engine = RecordingEngine()
    seen = []

    def original(self, model, inputs, *_):
        seen.append(torch.is_autocast_enabled("cpu"))
        return torch.zeros(())

    replaced = compute_loss.replacer(DPO)(original, engine)
    trainer = MixedTrainer("bf16", tiny(False, None))
    replaced(trainer, ddp, {}, False, None)
    assert seen == [True]
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    assert engine.notes[-1][2].endswith("under bf16 autocast"), engine.notes


@pytest.mark.parametrize(
    ("precision", "native_amp", "loss", "compiled", "warned"),
    [
        ("bf16", True, "autocast=0", False, True),  # the opt-out, under an autocast the accelerator applies: true
        ("fp16", True, "autocast=0", False, True),  # fp16 on a GPU
        ("fp16", False, "", False, False),  # fp16 on CPU: Accelerate autocasts nothing (issue 38; before: warned)
        ("fp16", False, "autocast=0", False, False),  # ... opt-out or not: use_liger_kernel=False is float32 too
        ("bf16", True, "", False, False),  # the default: routed under the autocast
        ("bf16", True, "autocast=1", False, False),
        ("bf16", True, "autocast=0", True, False),  # TRL 1.14's compiled route: TRL autocasts its own Liger path
    ],
    ids=["bf16-opt-out", "fp16-gpu-opt-out", "fp16-cpu", "fp16-cpu-opt-out", "default", "autocast=1", "compiled-1.14"],
)
def test_the_fp32_warning_fires_only_where_every_word_of_it_is_true(
    process_group, records, monkeypatch, precision, native_amp, loss, compiled, warned
):
    """It names ``LIGER_DDP_PATCH_LOSS=autocast=0`` and an autocast that the Liger path misses: it fires only when the
    user set that and the accelerator really autocasts, and only where our route decides the autocast (not TRL 1.14's
    compiled route). Before, fp16 on CPU with nothing set warned about autocast=0 (and the compiled route too)."""
    monkeypatch.setenv("LIGER_DDP_PATCH_LOSS", loss)
    ddp = nn.parallel.DistributedDataParallel(tiny(False, None).to(torch.bfloat16))
    engine = RecordingEngine()
    replaced = compute_loss.replacer(DPO, compiled_only=compiled)(lambda self, model, *_: torch.zeros(()), engine)
    trainer = MixedTrainer(precision, tiny(False, None))  # TRL's own float32 reference model
    trainer.accelerator.native_amp = native_amp
    trainer.accelerator.unwrap_model = staticmethod(lambda m: getattr(m, "module", m))
    replaced(trainer, torch.compile(ddp) if compiled else ddp, {}, False, None)  # never called: not compiled
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == int(warned), warnings
    assert ((pitfalls.FP32_NOTE,) in [n[2:] for n in engine.notes]) is warned, engine.notes
    if warned:
        assert f"runs in {precision} mixed precision" in warnings[0] and "autocast=0" in warnings[0], warnings[0]


def test_what_the_accelerator_autocasts():
    """Accelerate's own rule: ``autocast()`` casts only with ``native_amp`` (off for fp16 on CPU and DeepSpeed)."""
    trainer = MixedTrainer("fp16")
    assert pitfalls.autocasts(trainer) == "fp16"
    trainer.accelerator.native_amp = False
    assert pitfalls.autocasts(trainer) is None and compute_loss.autocast_precision(trainer) is None
    assert pitfalls.autocasts(MixedTrainer("no")) is None and pitfalls.autocasts(object()) is None

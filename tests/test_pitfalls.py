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
from torch import nn

from liger_ddp_patch import log
from liger_ddp_patch.demo import free_port
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

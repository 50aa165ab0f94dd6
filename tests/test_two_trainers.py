"""Two trainers in one process (issue 38 item 6): each gets its own run-time decision notes, its own rank-0 line and
its own fp16 loss scale; nothing is keyed by the trainer's class or by the process.

One gloo process, the package's real compute_loss replacement and a real :class:`Engine`, called as a Trainer would
call them, one trainer after the other. Each test has a control that runs the same sequence against the state as it
was shared before (by class name, once per process, one scale per process) and shows the second trainer then gets
the first one's.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
import torch.distributed as dist
from harness import free_port
from test_engine import record
from torch import nn

import liger_ddp_patch
from liger_ddp_patch import log
from liger_ddp_patch.engine import Engine
from liger_ddp_patch.environment import Settings
from liger_ddp_patch.losses import ChunkedDPOLoss, _onepass
from liger_ddp_patch.patches import compute_loss
from liger_ddp_patch.patches.trainers import DPO

NAME = DPO.compute_loss_patch
LEFT = "no wrapper: left to TRL"


@pytest.fixture(scope="module")
def process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Trainer:  # what the replacement reads from a TRL trainer (no mixed precision, no fused loss to swap)
    use_liger_kernel = True

    class accelerator:  # noqa: N801
        @staticmethod
        def unwrap_model(model):
            return model.module


class EqualTrainer(Trainer):
    """A trainer class that defines ``__eq__`` (so it is unhashable, and every instance equals every other)."""

    def __eq__(self, other):
        return isinstance(other, EqualTrainer)


def engine_and_step():
    """A real engine holding the DPO compute_loss record (never hooked: its module is never imported), and that
    record's replacement over a stand-in for TRL's compute_loss."""
    engine = Engine([record("two_trainers_never_imported", name=NAME)], Settings())
    return engine, compute_loss.replacer(DPO)(lambda self, model, inputs, *_: torch.zeros(()), engine)


def model():
    return nn.Linear(4, 4)


@pytest.fixture
def lines(monkeypatch):
    """The package logger's INFO lines on rank 0 of a fresh process (the once-only guards reset)."""
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(log, "_announced", False)
    monkeypatch.setattr(log, "_announced_for", log.ByObject())
    monkeypatch.setattr(log, "_warned", set())
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage()) if r.levelno == logging.INFO else None
    logger = logging.getLogger("liger_ddp_patch")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


@pytest.mark.parametrize("cls", [Trainer, EqualTrainer], ids=["trainer", "unhashable-trainer"])
def test_each_trainer_object_has_its_own_decisions(process_group, lines, cls):
    """The first trainer runs under DDP (routed), the second, of the same class, on a bare model (left to TRL): each
    object's decisions are its own, while report() still groups both under the class name, as `status` shows."""
    engine, step = engine_and_step()
    first, second = cls(), cls()
    for _ in range(2):
        step(first, nn.parallel.DistributedDataParallel(model()), {}, False, None)
    step(second, model(), {}, False, None)
    routed = engine.decisions(first)[NAME]
    assert len(routed) == 1 and routed[0].startswith("routed through DistributedDataParallel.forward"), routed
    assert engine.decisions(second) == {NAME: [LEFT]}
    assert engine.decisions(cls()) == {}  # a trainer none of the patches saw
    (status,) = engine.report()
    assert status.runtime == {cls.__name__: [routed[0], LEFT]}  # grouped by class, as before
    # control: the class-keyed lookup (what likely_cause read) says the second trainer was routed; it never was
    assert routed[0] in status.runtime[type(second).__name__]


def test_the_package_answers_for_its_engine(monkeypatch):
    """``liger_ddp_patch.decisions(trainer)`` is the package engine's answer for that object."""
    engine, _ = engine_and_step()
    trainer = Trainer()
    engine.note(NAME, "Trainer", "decided", owner=trainer)
    monkeypatch.setattr(liger_ddp_patch, "_engine", engine)
    assert liger_ddp_patch.decisions(trainer) == {NAME: ["decided"]}
    assert liger_ddp_patch.decisions(Trainer()) == {}


def test_a_trainer_is_not_kept_alive_by_its_decisions(process_group, lines):
    engine, step = engine_and_step()
    trainer = Trainer()
    step(trainer, model(), {}, False, None)
    assert len(engine._by_owner) == 1
    del trainer
    gc.collect()
    assert len(engine._by_owner) == 0
    held = log.ByObject()
    obj = Trainer()
    assert held.add(obj) and not held.add(obj)  # an object with a weak reference: tracked, once
    with pytest.raises(TypeError):  # none (a plain int): the caller falls back (announce: once per class)
        held.add(7)


def run_two_routed(step) -> None:
    """Two trainers of one class in sequence, each under its own DDP wrapper, two steps each."""
    for trainer in (Trainer(), Trainer()):
        ddp = nn.parallel.DistributedDataParallel(model())
        for _ in range(2):
            step(trainer, ddp, {}, False, None)


def test_each_trainer_announces_its_own_routing_once(process_group, lines, monkeypatch):
    """One INFO line per trainer object, at its first routed step; the control (the line once per process, as before)
    announces the first trainer only."""
    _, step = engine_and_step()
    run_two_routed(step)
    assert len(lines) == 2 and all(
        line.startswith("liger_ddp_patch: Trainer under DistributedDataParallel") for line in lines
    ), lines

    lines.clear()
    monkeypatch.setattr(log, "_announced", False)
    monkeypatch.setattr(log, "_announced_for", log.ByObject())
    monkeypatch.setattr(compute_loss, "announce", lambda *args, key=None: log.announce(*args))  # once per process
    _, step = engine_and_step()
    run_two_routed(step)
    assert len(lines) == 1, lines


def test_without_a_key_the_line_is_once_per_process(lines):
    for n in (1, 2):
        log.announce("fix took effect %s", n)
    assert lines == ["fix took effect 1"]


GRAD_SCALE = 2.0**13  # GradScaler's scale after three halvings: the incoming gradient of the first run's backward


def fp16_step(loss: ChunkedDPOLoss, incoming: float, seed: int = 0) -> None:
    """One fp16 one-pass forward and backward of ``loss`` at GradScaler's scale ``incoming`` (B = 4, V = 300)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, 8, 16, generator=g).half().requires_grad_(True)
    weight = (torch.randn(300, 16, generator=g) * 0.02).half().requires_grad_(True)
    ref_hidden, ref_weight = (
        torch.randn(4, 8, 16, generator=g).half(),
        (torch.randn(300, 16, generator=g) * 0.02).half(),
    )
    target = torch.randint(0, 300, (4, 8), generator=g)
    target[:, :2] = -100
    out, _ = loss(weight, hidden, target, None, ref_hidden, ref_weight, None)
    assert "OnePassLoss" in out.grad_fn.name()
    (out * incoming).backward()
    assert torch.isfinite(weight.grad).all()


def test_each_loss_object_keeps_its_own_fp16_scale(monkeypatch):
    """Two fp16 runs in sequence, a loss object each (as two trainers swap in): the second starts at GradScaler's
    initial 2**16, not at the first run's 2**13, and moving its scale leaves the first's. Control: one scale for the
    process (as before) hands the second run the first's scale."""
    first, second = ChunkedDPOLoss(), ChunkedDPOLoss()
    fp16_step(first, GRAD_SCALE)
    assert _onepass.scale_of(first).value == GRAD_SCALE
    assert _onepass.scale_of(second).value == _onepass.LossScale.INITIAL  # its own, fresh
    fp16_step(second, 2.0**10, seed=1)
    assert _onepass.scale_of(second).value == 2.0**10 and _onepass.scale_of(first).value == GRAD_SCALE

    shared = _onepass.LossScale()
    monkeypatch.setattr(_onepass, "scale_of", lambda loss: shared)
    first, second = ChunkedDPOLoss(), ChunkedDPOLoss()
    fp16_step(first, GRAD_SCALE)
    assert _onepass.scale_of(second).value == GRAD_SCALE  # the second run inherits the first's scale

"""The compute_loss patch at unit level: which wrapper is routed, the pre-1.9 redirect on a real DDP wrapper, and the
replacement itself handed real FSDP / FSDP2 models (left to TRL's original untouched) beside a DDP control."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _fakes import RecordingEngine
from harness import free_port
from torch import nn

from liger_ddp_patch.patches.compute_loss import redirect_forward, replacer, route
from liger_ddp_patch.patches.trainers import SPECS


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x)


@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo group in this process: enough to build a real DistributedDataParallel on CPU."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class DDPSubclass(nn.parallel.DistributedDataParallel):
    pass


class DeepSpeedEngine(nn.Module):  # stands in for deepspeed's engine, by name (the real one: tests/test_deepspeed.py)
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_only_distributed_data_parallel_is_routed(process_group):
    inner = Tiny()
    ddp, sub = nn.parallel.DistributedDataParallel(inner), DDPSubclass(Tiny())
    found, decision = route(ddp, True)
    assert (found.ddp, found.inner, found.how, decision) == (
        ddp,
        inner,
        "",
        "routed through DistributedDataParallel.forward",
    )
    assert route(sub, True)[1] == "routed through DDPSubclass.forward"
    assert route(ddp, False) == (None, "use_liger_kernel=False: left to TRL")


@pytest.mark.parametrize(
    ("wrap", "expected"),
    [
        (lambda m: m, "no wrapper: left to TRL"),  # one process, or evaluation
        # transformers wraps the model in DataParallel when it sees several GPUs and no launcher: routing through
        # DataParallel.forward would scatter the inputs while the original runs on the un-replicated module.
        (nn.DataParallel, "DataParallel: left to TRL"),
        (DeepSpeedEngine, "DeepSpeedEngine: left to TRL"),
        (torch.compile, "compiled no wrapper: left to TRL"),  # torch_compile=True in one process
        (lambda m: torch.compile(nn.DataParallel(m)), "compiled DataParallel: left to TRL"),
    ],
    ids=["none", "DataParallel", "DeepSpeedEngine", "compiled", "compiled-DataParallel"],
)
def test_every_other_wrapper_is_left_to_trl(wrap, expected):
    inner = Tiny()
    assert route(wrap(inner), True) == (None, expected)


COMPILED = "compiled (OptimizedModule around DistributedDataParallel): routed through DistributedDataParallel.forward"


def test_a_compiled_ddp_model_is_seen_through_even_after_accelerate_reseats_it(process_group):
    """torch_compile=True hands compute_loss ``torch.compile(ddp)``. Accelerate's ``unwrap_model`` (what TRL calls)
    re-seats its ``_orig_mod`` on the innermost module and returns the compiled model itself; the DDP module is still
    found, through the forward torch.compile bound."""
    from accelerate.utils import extract_model_from_parallel

    inner = Tiny()
    ddp = nn.parallel.DistributedDataParallel(inner)
    compiled = torch.compile(ddp, backend="eager")
    assert route(compiled, True)[0].ddp is ddp
    assert extract_model_from_parallel(compiled) is compiled  # accelerate's unwrap: TRL 1.14's `model is not ...`
    assert compiled._orig_mod is inner  # ... and the DDP module is no longer reachable by _orig_mod
    found, decision = route(compiled, True)
    assert (found.ddp, found.inner, found.how) == (ddp, inner, "compiled") and decision == f"{COMPILED}, eager"


def test_accelerates_regional_compilation_of_a_ddp_model_is_routed(process_group):
    from accelerate.utils import compile_regions

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])

        def forward(self, x):
            return self.layers[1](self.layers[0](x))

    ddp = nn.parallel.DistributedDataParallel(Blocks())
    regional = compile_regions(ddp, backend="eager")  # a shallow copy of the DDP module, its blocks compiled
    found, decision = route(regional, True)
    assert found.ddp is regional and found.inner is regional.module and found.how == "compiled regions"
    assert decision.startswith("compiled regions (accelerate's regional compilation inside DistributedDataParallel)")


def test_pre_19_redirect_hands_the_inputs_to_a_ddp_built_with_device_ids(process_group):
    """accelerate builds DDP with ``device_ids=[local_rank]`` on GPUs; DDP then moves the inputs and passes them on.

    Set here on a CPU wrapper (device 0 of the CPU), as on a GPU job. Called without inputs DDP's ``_pre_forward``
    raises ``IndexError: tuple index out of range``.
    """
    inner = Tiny()
    ddp = nn.parallel.DistributedDataParallel(inner)
    ddp.device_ids = [0]
    inputs = {"x": torch.ones(4, 3)}
    events = []
    # DDP's own forward must run (it arms the reducer), once, with the inputs, and the method inside it.
    ddp.register_forward_pre_hook(lambda _, args, kwargs: events.append(("enter", args, kwargs)), with_kwargs=True)
    ddp.register_forward_hook(lambda *_: events.append(("exit",)))

    def method(model, batch, flag):
        events.append(("method", model, flag))
        return model.lin(batch["x"]).sum()

    loss = redirect_forward(ddp, inner, method, inner, inputs, False)
    loss.backward()
    assert [e[0] for e in events] == ["enter", "method", "exit"], events
    _, args, kwargs = events[0]
    assert len(args) == 3 and args[0] is inner and args[1] is inputs and args[2] is False and kwargs == {}, events[0]
    assert events[1][1:] == (inner, False)
    assert inner.lin.weight.grad is not None
    assert "forward" not in vars(inner)  # the real forward is back


# --- the compute_loss replacement with real FSDP wrappers ------------------------------------------------------------
# What the replacement reads from a DPOTrainer/KTOTrainer is faked (use_liger_kernel, the fused loss object, the
# accelerator's unwrap, which is accelerate's own); the models and wrappers are real, in the one-rank gloo group.


class FusedLoss(nn.Module):  # stands in for the fused class the chunked-loss record checked (Liger's, or TRL 1.13's)
    beta = 0.1


class Trainer:
    use_liger_kernel = True
    use_liger_gkd_loss = use_liger_loss = True  # what GKD/GOLD and Distillation read instead

    def __init__(self):
        from accelerate.utils import extract_model_from_parallel

        self.accelerator = SimpleNamespace(
            unwrap_model=extract_model_from_parallel
        )  # what Accelerator.unwrap_model does
        self.liger_loss = FusedLoss()


def call_replacement(spec, model, compiled_only=False):
    """One call of ``spec``'s compute_loss replacement with ``model``: what TRL's original saw, what the wrapper saw."""
    calls, forwards, result = [], [], torch.tensor(0.5)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # TRL's, as a recorder
        calls.append((self, model, inputs, return_outputs, num_items_in_batch))
        return result

    model.register_forward_pre_hook(lambda _, args, kwargs: forwards.append(args), with_kwargs=True)
    trainer, inputs = Trainer(), {"x": torch.ones(4, 3)}
    loss = trainer.liger_loss
    engine = RecordingEngine({spec.chunked_loss_patch: FusedLoss})  # the fused class its chunked record checked
    returned = replacer(spec, compiled_only)(compute_loss, engine)(trainer, model, inputs, False, 7)
    return SimpleNamespace(
        calls=calls, forwards=forwards, trainer=trainer, inputs=inputs, loss=loss, result=result, returned=returned,
        notes=engine.notes,
    )  # fmt: skip


def fsdp(module):
    from torch.distributed.fsdp import FullyShardedDataParallel

    with warnings.catch_warnings():  # one rank: FSDP says it falls back to NO_SHARD
        warnings.simplefilter("ignore", UserWarning)
        return FullyShardedDataParallel(module, device_id=torch.device("cpu"))


def fsdp2(module):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    sharded = fully_shard(module, mesh=init_device_mesh("cpu", (1,)))
    assert isinstance(sharded, FSDPModule) and sharded is module  # FSDP2 shards in place: no wrapper object
    return sharded


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
@pytest.mark.parametrize(
    ("wrap", "decision"),
    [
        (fsdp, "FullyShardedDataParallel: left to TRL"),
        (fsdp2, "no wrapper: left to TRL"),  # what the report says for FSDP2: the model is its own unwrapped model
        (nn.DataParallel, "DataParallel: left to TRL"),  # built here without GPUs, the same object a GPU job hands on
    ],
    ids=["FSDP", "FSDP2", "DataParallel"],
)
def test_other_wrappers_reach_trls_compute_loss_untouched(process_group, spec, wrap, decision):
    """FSDP reduces gradients through its own hooks and TRL redirects FSDP itself; DataParallel must not be entered
    (see route()): the original gets the very model, the very inputs and arguments, its result comes back as is, no
    wrapper forward runs and TRL's loss object stays."""
    model = wrap(Tiny())
    seen = call_replacement(spec, model)
    assert len(seen.calls) == 1, seen.calls
    trainer, passed_model, inputs, return_outputs, num_items = seen.calls[0]
    assert trainer is seen.trainer and passed_model is model and inputs is seen.inputs, seen.calls
    assert (return_outputs, num_items) == (False, 7)
    assert seen.returned is seen.result
    assert seen.forwards == []  # not run inside the wrapper's forward
    assert seen.trainer.liger_loss is seen.loss and type(seen.loss) is FusedLoss  # TRL's loss object, not swapped
    assert seen.notes == [(spec.compute_loss_patch, "Trainer", decision)]


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_control_the_same_harness_sees_ddp_routed_and_swapped(process_group, spec, monkeypatch):
    """The harness above can fail: a DDP model in it is routed (the original gets the unwrapped module, inside the
    wrapper's forward) and its loss object swapped for ours."""
    from liger_ddp_patch import log

    monkeypatch.setattr(log, "_announced", True)  # the once-per-process line stays unsaid in this pytest process
    inner = Tiny()
    ddp = nn.parallel.DistributedDataParallel(inner)
    seen = call_replacement(spec, ddp)
    assert len(seen.calls) == 1 and seen.calls[0][1] is inner and seen.calls[0][1] is not ddp
    assert len(seen.forwards) == 1 and seen.forwards[0][0] is inner and seen.forwards[0][1] is seen.inputs
    if not spec.loss:  # GKD/GOLD/Distillation: TRL's JSD loss runs as is inside the wrapper's forward
        assert seen.trainer.liger_loss is seen.loss
        assert seen.notes[0][2] == "routed through DistributedDataParallel.forward"
        return
    assert seen.trainer.liger_loss is not seen.loss and isinstance(seen.trainer.liger_loss, spec.loss_class())
    assert seen.notes[0][2].startswith("routed through DistributedDataParallel.forward, fused loss FusedLoss → ")


@pytest.mark.parametrize("spec", [s for s in SPECS if s.compiled_hole], ids=lambda s: s.name)
def test_the_114_record_routes_only_a_compiled_ddp_model_and_keeps_trls_loss(process_group, spec, monkeypatch):
    """TRL 1.14.x routes a plain DDP module itself (left to it, bit for bit); a compiled one is routed by us, through
    the DDP module, with TRL 1.14's own loss (no swap). Control: the same DDP module, compiled, is routed."""
    from liger_ddp_patch import log

    monkeypatch.setattr(log, "_announced", True)
    inner = Tiny()
    ddp = nn.parallel.DistributedDataParallel(inner)
    plain = call_replacement(spec, ddp, compiled_only=True)
    assert plain.calls[0][1] is ddp and plain.forwards == [] and plain.returned is plain.result
    assert plain.notes == [(spec.compiled_patch, "Trainer", "TRL routes DistributedDataParallel itself: left to TRL")]
    entered = []
    ddp.register_forward_pre_hook(lambda *_: entered.append(1))
    compiled = call_replacement(spec, torch.compile(ddp, backend="eager"), compiled_only=True)
    assert compiled.calls[0][1] is inner and entered == [1]  # inside DDP's own forward
    assert compiled.forwards == []  # ... called directly: the compiled wrapper (dynamo) is not entered
    assert compiled.trainer.liger_loss is compiled.loss  # TRL's loss object: nothing swapped
    assert compiled.notes[-1] == (spec.compiled_patch, "Trainer", f"{COMPILED}, eager")

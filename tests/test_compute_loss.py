"""The compute_loss patch at unit level: which wrapper is routed, and the pre-1.9 redirect on a real DDP wrapper."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from liger_ddp_patch.demo import free_port
from liger_ddp_patch.patches.compute_loss import redirect_forward, route


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
    assert route(ddp, inner, True) == (True, "routed through DistributedDataParallel.forward")
    assert route(sub, sub.module, True) == (True, "routed through DDPSubclass.forward")
    assert route(ddp, inner, False) == (False, "use_liger_kernel=False: left to TRL")


@pytest.mark.parametrize(
    ("wrap", "expected"),
    [
        (lambda m: m, "no wrapper: left to TRL"),  # one process, or evaluation
        # transformers wraps the model in DataParallel when it sees several GPUs and no launcher: routing through
        # DataParallel.forward would scatter the inputs while the original runs on the un-replicated module.
        (nn.DataParallel, "DataParallel: left to TRL"),
        (DeepSpeedEngine, "DeepSpeedEngine: left to TRL"),
    ],
    ids=["none", "DataParallel", "DeepSpeedEngine"],
)
def test_every_other_wrapper_is_left_to_trl(wrap, expected):
    inner = Tiny()
    assert route(wrap(inner), inner, True) == (False, expected)


def test_pre_19_redirect_hands_the_inputs_to_a_ddp_built_with_device_ids(process_group):
    """accelerate builds DDP with ``device_ids=[local_rank]`` on GPUs; DDP then moves the inputs and passes them on.

    Set here on a CPU wrapper (device 0 of the CPU), as on a GPU job. Called without inputs DDP's ``_pre_forward``
    raises ``IndexError: tuple index out of range``.
    """
    inner = Tiny()
    ddp = nn.parallel.DistributedDataParallel(inner)
    ddp.device_ids = [0]
    inputs = {"x": torch.ones(4, 3)}
    seen = []

    def method(model, batch, flag):
        seen.append((model, flag))
        return model.lin(batch["x"]).sum()

    loss = redirect_forward(ddp, inner, method, inner, inputs, False)
    loss.backward()
    assert seen == [(inner, False)]
    assert inner.lin.weight.grad is not None
    assert "forward" not in vars(inner)  # the real forward is back

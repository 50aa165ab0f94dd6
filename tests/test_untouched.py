"""Configurations that were never broken run TRL's own code and loss objects, bit for bit, with the package imported.

One process (no launcher) here; DeepSpeed ZeRO-2/3 in tests/test_deepspeed.py; FSDP, FSDP2 and DataParallel at unit
level in tests/test_compute_loss.py (the compute_loss replacement handed real wrappers: TRL does not build FSDP on CPU,
DataParallel needs several GPUs).
"""

from __future__ import annotations

from functools import partial

import pytest
from harness import run_probe, two_at_a_time

pytestmark = pytest.mark.ddp  # real subprocesses, ~20 s each

TRL_LOSS = {"dpo": "LigerFusedLinearDPOLoss", "kto": "LigerFusedLinearKTOLoss"}


@pytest.fixture(scope="module")
def single_runs(tiny_small, tmp_path_factory):
    """One Liger DPO and one Liger KTO step in one plain process: package disabled vs imported before TRL (the two
    processes at once: each is bound by its imports on one core)."""
    out = tmp_path_factory.mktemp("single")
    arms = (("unpatched", "none", {"LIGER_DDP_PATCH_DISABLE": "1"}), ("patched", "before", {}))
    calls = [partial(run_probe, tiny_small, mode, env=env, nproc=0, extra=("--grads-out", str(out / label)))
             for label, mode, env in arms]  # fmt: skip
    return out, dict(zip((label for label, _, _ in arms), two_at_a_time(*calls)))


@pytest.mark.parametrize("trainer", ["dpo", "kto"])
def test_single_process_is_bitwise_trl(single_runs, trainer):
    import torch

    out, runs = single_runs
    before, after = ({r["trainer"]: r for r in runs[k]["results"]}[trainer] for k in ("unpatched", "patched"))
    for run in (before, after):
        assert "error" not in run, run.get("trace")
    assert after["loss_class"] == before["loss_class"] == TRL_LOSS[trainer]
    # loss and every logged metric, exactly (train_runtime and the throughput figures are wall-clock)
    clock = ("runtime", "per_second")
    history = [
        [{k: v for k, v in h.items() if not any(c in k for c in clock)} for h in r["history"]] for r in (before, after)
    ]
    assert history[0] == history[1] and any("rewards/chosen" in h or "rewards/chosen_sum" in h for h in history[1])
    grads = [torch.load(out / f"{label}.{trainer}.pt") for label in ("unpatched", "patched")]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 25
    different = [name for name in grads[0] if not torch.equal(grads[0][name], grads[1][name])]
    assert not different, different


def test_single_process_decision_is_reported(single_runs):
    _, runs = single_runs
    runtime = {row["name"]: row["runtime"] for row in runs["patched"]["report"]}
    assert runtime["dpo_compute_loss"] == {"DPOTrainer": ["no wrapper: left to TRL"]}
    assert runtime["kto_compute_loss"] == {"KTOTrainer": ["no wrapper: left to TRL"]}
    assert "under DistributedDataParallel" not in runs["patched"]["log"]  # the fix never announced itself

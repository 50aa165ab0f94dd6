"""Real DeepSpeed runs (CPU, gloo, 2 ranks): under ZeRO-2 and ZeRO-3 the package must leave TRL exactly alone.

Only ``DistributedDataParallel`` is broken (TRL #7245); a DeepSpeed engine reduces gradients through its own hooks
and TRL already redirects ZeRO-3 itself. So a patched run must *be* the unpatched run: TRL's own fused loss object,
the same logged metrics and the same weights after 2 optimizer steps, bit for bit. Each stage is two torchrun
launches of tests/_deepspeed_probe.py (package off, package on), each training DPO then KTO.

Both stages use the real 151,936-token vocabulary: it is what makes ZeRO-3 really partition ``lm_head`` (asserted
below; smaller tensors stay whole on every rank), and for ZeRO-2 a 64-token vocabulary measured no faster.
The first launch on a machine builds DeepSpeed's shared-memory comm extension (~80 s, then cached).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.ddp,
    pytest.mark.deepspeed,
    pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None,
        reason='deepspeed is not installed (pip install -e ".[test]" pins deepspeed==0.19.8)',
    ),
]

ROOT = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).with_name("_deepspeed_probe.py")
TRAINERS = {"dpo": ("DPOTrainer", "dpo_compute_loss"), "kto": ("KTOTrainer", "kto_compute_loss")}
FUSED = {"dpo": "LigerFusedLinearDPOLoss", "kto": "LigerFusedLinearKTOLoss"}
TIMING = ("runtime", "per_second")  # wall-clock keys of the log history: the only ones allowed to differ


def launch(
    assets: Path, stage: int, mode: str, out: Path, trainers: tuple[str, ...] = tuple(TRAINERS), pythonpath: str = ""
) -> dict:
    """One 2-rank torchrun of the probe; rank 0's JSON, by trainer, with the report alongside (``pythonpath``: a TRL
    release first on the path)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_DDP_PATCH_")}
    env.update(PROBE_PATCH=mode, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, str(ROOT), env.get("PYTHONPATH")]))
    if mode == "none":
        env["LIGER_DDP_PATCH_DISABLE"] = "1"  # the probe's helpers import the package: keep it inert
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(PROBE),
           "--assets", str(assets), "--trainers", ",".join(trainers), "--zero-stage", str(stage), "--steps", "2",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    # Rank 0 writes its JSON before the barrier and teardown: a JSON alone does not mean the job ended cleanly.
    if proc.returncode != 0 or not out.exists():
        log = (proc.stdout + proc.stderr)[-6000:]
        wrote = "wrote its JSON" if out.exists() else "wrote nothing"
        pytest.fail(f"ZeRO-{stage} PROBE_PATCH={mode} launch {wrote} and exited {proc.returncode}:\n{log}")
    data = json.loads(out.read_text())
    return {"report": data["report"], "log": proc.stdout + proc.stderr, **{r["trainer"]: r for r in data["results"]}}


@pytest.fixture(scope="module", params=[3, 2], ids=["zero3", "zero2"])
def runs(request, tiny_real, tmp_path_factory):
    """``(stage, unpatched, patched)``: the two launches, shared by every test of that stage."""
    stage, tmp = request.param, tmp_path_factory.mktemp(f"zero{request.param}")
    unpatched = launch(tiny_real, stage, "none", tmp / "none.json")
    return stage, unpatched, launch(tiny_real, stage, "before", tmp / "before.json")


def history_differences(unpatched: list[dict], patched: list[dict]) -> list[tuple]:
    """``(log entry, key, unpatched value, patched value)`` wherever the two log histories differ, timing aside."""
    assert len(patched) == len(unpatched), (unpatched, patched)
    return [
        (i, key, before.get(key), after.get(key))
        for i, (before, after) in enumerate(zip(unpatched, patched))
        for key in sorted(before.keys() | after.keys())
        if not any(t in key for t in TIMING) and before.get(key, "absent") != after.get(key, "absent")
    ]


def assert_left_to_trl(report: list[dict], trainer: str) -> None:
    """The patched run's own account of each compute_loss call: every decision names the engine, and left it to TRL.

    Reads the ``runtime`` key of ``Status.as_dict()`` ({trainer class: [decision strings]}) on the compute_loss
    record; adjust here if that format changes.
    """
    cls, record = TRAINERS[trainer]
    status = next(s for s in report if s["name"] == record)
    decisions = status.get("runtime", {}).get(cls)
    assert decisions, f"{record} recorded no run-time decision for {cls}: {status}"
    for decision in decisions:
        assert decision.startswith("DeepSpeedEngine") and "left to TRL" in decision, decisions


def test_the_runs_are_real_deepspeed(runs):
    """The setup is what it claims: 2 ranks in a DeepSpeed engine at the stage asked; ZeRO-3 partitions lm_head."""
    stage, unpatched, patched = runs
    for run in (unpatched, patched):
        for trainer in TRAINERS:
            r = run[trainer]
            assert (r["engine"], r["engine_zero_stage"], r["world_size"]) == ("DeepSpeedEngine", stage, 2)
            assert ("lm_head.weight" in r["partitioned"]) == (stage == 3), r["partitioned"]
    assert {s["status"] for s in unpatched["report"]} == {"disabled"}
    assert {
        s["name"]: s["status"] for s in patched["report"] if s["name"] in ("dpo_compute_loss", "kto_compute_loss")
    } == {
        "dpo_compute_loss": "applied",
        "kto_compute_loss": "applied",
    }


@pytest.mark.parametrize("trainer", TRAINERS)
def test_keeps_trls_fused_loss(runs, trainer):
    _, unpatched, patched = runs
    classes = [(run[trainer]["loss_class"], run[trainer]["loss_module"]) for run in (unpatched, patched)]
    assert classes[0][0] == FUSED[trainer] and classes[0][1].startswith("liger_kernel."), classes
    assert classes[1] == classes[0]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_same_losses_and_metrics(runs, trainer):
    _, unpatched, patched = runs
    assert [h["step"] for h in unpatched[trainer]["history"] if "loss" in h] == [1, 2]
    assert history_differences(unpatched[trainer]["history"], patched[trainer]["history"]) == []


@pytest.mark.parametrize("trainer", TRAINERS)
def test_same_weights_bit_for_bit(runs, trainer):
    _, unpatched, patched = runs
    before, after = unpatched[trainer]["weights"], patched[trainer]["weights"]
    assert len(before) == 25
    assert [n for n in before if after.get(n) != before[n]] == []


@pytest.mark.parametrize("trainer", TRAINERS)
def test_the_gradient_check_stays_out(runs, trainer):
    """DeepSpeed launched the usual way (accelerate's environment, ``args.deepspeed`` empty) holds no DDP module: the
    default check compares nothing and claims nothing (it once logged "in sync" with 0 gradients read)."""
    _, unpatched, patched = runs
    assert unpatched[trainer]["checks"] == {} and patched[trainer]["checks"] == {"FirstStepCheck": []}
    assert "in sync across" not in patched["log"] and "NOT synchronised" not in patched["log"]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_decision_recorded(runs, trainer):
    assert_left_to_trl(runs[2]["report"], trainer)

"""Real 2-rank torchrun jobs (CPU, gloo): every fix shown against a control that exhibits the bug.

TRL is whatever is installed (CI pins 1.12.0). Each test is one torchrun launch that runs a Liger DPO step and a
Liger KTO step and compares every parameter's gradient across the two ranks.
"""

from __future__ import annotations

import pytest
from harness import run_probe

from liger_ddp_patch.patches import NAMES

pytestmark = pytest.mark.ddp

EXAMPLE = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "sitecustomize_example")
PARAMS = 25  # the tiny model's parameters, every one with a gradient: "0 differing" must cover all of them
TENSORWRAPPER = "Cannot access storage of TensorWrapper"


def by_trainer(result: dict) -> dict:
    return {r["trainer"]: r for r in result["results"]}


def assert_in_sync(result: dict, *trainers: str) -> None:
    runs = by_trainer(result)
    for trainer in trainers or runs:
        run = runs[trainer]
        assert "error" not in run, run.get("trace", "") + result["log"][-3000:]
        assert run["params"] == PARAMS, run
        assert (run["differing"], run["max_abs_diff"]) == (0, 0.0), run


def assert_desynced(result: dict, *trainers: str) -> None:
    runs = by_trainer(result)
    for trainer in trainers or runs:
        run = runs[trainer]
        assert "error" not in run, run.get("trace", "")
        assert run["params"] == PARAMS and run["differing"] > 0 and run["max_abs_diff"] > 0, run


def test_unpatched_control_desyncs(tiny_real):
    result = run_probe(tiny_real, "none")
    assert result["report"] is None
    assert_desynced(result)
    assert by_trainer(result)["dpo"]["differing"] == PARAMS  # every parameter: nothing was all-reduced


ROUTED = "routed through DistributedDataParallel.forward, fused loss {} → {}"
ANNOUNCED = "liger_ddp_patch: DPOTrainer under DistributedDataParallel: " + ROUTED.format(
    "LigerFusedLinearDPOLoss", "ChunkedDPOLoss"
)


def test_patched_real_vocab_is_in_sync(tiny_real):
    # --tee 3: torchrun prefixes every line with the rank that printed it ("[default0]:")
    result = run_probe(tiny_real, "before", launch=("--tee", "3"))
    assert_in_sync(result)
    # GKD & co: never imported by this run; the 1.14.x records: not needed on this TRL (dpo_compute_loss handles it)
    ours = {name for name in NAMES if name.startswith(("dpo_", "kto_")) and not name.endswith("_compiled_ddp")}
    assert {row["name"]: row["status"] for row in result["report"] if row["name"] in ours} == dict.fromkeys(
        ours, "applied"
    )
    assert {"dpo_compute_loss", "kto_compute_loss", "dpo_chunked_loss", "kto_chunked_loss"} <= NAMES
    assert {r["loss_class"] for r in result["results"]} == {"ChunkedDPOLoss", "ChunkedKTOLoss"}
    runtime = {row["name"]: row["runtime"] for row in result["report"]}
    assert runtime["dpo_compute_loss"] == {"DPOTrainer": [ROUTED.format("LigerFusedLinearDPOLoss", "ChunkedDPOLoss")]}
    assert runtime["kto_compute_loss"] == {
        "KTOTrainer": [ROUTED.format("LigerFusedLinearKTOLoss", "ChunkedKTOLoss") + ", KL log-probs chunked"]
    }
    # one line per trainer (DPO, then KTO in the same process: issue 38 item 6), on rank 0 only, with logging never
    # configured
    announced = [line for line in result["log"].splitlines() if "under DistributedDataParallel" in line]
    kto = "KTOTrainer under DistributedDataParallel: " + runtime["kto_compute_loss"]["KTOTrainer"][0]
    assert announced == [f"[default0]:{ANNOUNCED} (TRL #7245)", f"[default0]:liger_ddp_patch: {kto} (TRL #7245)"], (
        announced
    )


@pytest.mark.parametrize("trainer", ["dpo", "kto"])
def test_redirect_alone_crashes_inside_ddp_with_the_fused_losses(tiny_real, trainer):
    """Control for the chunked-loss patches: compute_loss redirected, fused losses kept -> TensorWrapper crash.

    One trainer per launch: a crash inside a trainer step can leave autograd hooks behind for the next one.
    """
    env = {"LIGER_DDP_PATCH_DISABLE": "dpo_chunked_loss,kto_chunked_loss"}
    (run,) = run_probe(tiny_real, "before", trainers=trainer, env=env)["results"]
    assert TENSORWRAPPER in run.get("error", ""), run


def test_import_after_trl(tiny_small):
    assert_in_sync(run_probe(tiny_small, "after"))


def test_trainer_built_before_the_patch_is_converted(tiny_real):
    result = run_probe(tiny_real, "late")
    assert_in_sync(result)
    assert {r["loss_class"] for r in result["results"]} == {"ChunkedDPOLoss", "ChunkedKTOLoss"}


def test_injected_by_sitecustomize_only(tiny_small):
    result = run_probe(tiny_small, "none", pythonpath=(EXAMPLE,))
    assert result["report"] is not None  # the package arrived without the script importing it
    assert_in_sync(result)


def test_opt_out_restores_the_bug(tiny_small):
    result = run_probe(tiny_small, "before", env={"LIGER_DDP_PATCH_DISABLE": "1"})
    assert_desynced(result)
    assert {row["status"] for row in result["report"]} == {"disabled"}


def test_opt_out_of_one_patch_by_name(tiny_small):
    result = run_probe(tiny_small, "before", env={"LIGER_DDP_PATCH_DISABLE": "kto_compute_loss"})
    assert_in_sync(result, "dpo")
    assert_desynced(result, "kto")
    statuses = {row["name"]: row["status"] for row in result["report"]}
    assert statuses["kto_compute_loss"] == "disabled" and statuses["dpo_compute_loss"] == "applied"

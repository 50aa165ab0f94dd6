"""``torch_compile=True`` under DDP: the Trainer hands ``compute_loss`` a compiled model around the DDP module.

Each release beside its control (2 ranks, CPU/gloo, the 64-token tiny Qwen3, inductor, TRL's default backend):
unpatched, every parameter's gradient differs across ranks (TRL 1.9-1.13 run the Liger loss on the unwrapped model;
TRL 1.14's redirect tests ``model is not unwrapped_model``, which accelerate's unwrap of a compiled model makes
false); patched, 0 of every trainable parameter differ, the first synchronised gradients equal Liger-off's, and a run
resumed from its step-1 checkpoint ends bit for bit where the uninterrupted run ended (1.12.0).

TRL 1.12.0 (the installed one) and 1.14.0 run always; 1.9.0 and 1.13.0 with ``LIGER_DDP_PATCH_FULL_MATRIX=1``
(each launch ~45 s; a Liger-off arm compiles the model with inductor, ~30 s more).
"""

from __future__ import annotations

import os
from pathlib import Path

import matrix
import pytest
import torch
from harness import run_probe

pytestmark = pytest.mark.ddp

ROOT = Path(__file__).resolve().parents[1]
FULL = os.environ.get("LIGER_DDP_PATCH_FULL_MATRIX") == "1"
PARAMS = 25  # the tiny model's parameters: "0 differing" must cover every one
COMPILED = "compiled (OptimizedModule around DistributedDataParallel): routed through DistributedDataParallel.forward"
SGD = ("--optim", "sgd", "--lr", "0.1")  # weights that really move (TRL's AdamW at 1e-6 moves them ~1e-6 regardless)


def trl_folder(version: str) -> tuple[str, ...]:
    from importlib.metadata import version as installed

    if installed("trl") == version:
        return ()
    folder = Path(os.environ.get("LIGER_DDP_PATCH_TRL_DIRS", ROOT / ".cache" / "trl")) / version
    if not (folder / "trl" / "__init__.py").exists():
        pytest.skip(f"TRL {version} is not unpacked: run `.ci/trl_matrix.sh --prepare-only`")
    return (str(folder),)


def probe(assets, version: str, patched: bool, configs: str, *extra: str) -> dict:
    env = {"LIGER_DDP_PATCH_DISABLE": "" if patched else "1"}
    result = run_probe(
        assets,
        "before" if patched else "none",
        env=env,
        pythonpath=trl_folder(version),
        extra=("--configs", configs, *extra),
    )
    assert result["trl"] == version
    return result


def runs(result: dict) -> dict:
    return {(r["config"], r["arm"]): r for r in result["results"]}


def assert_desynced(result: dict, config: str) -> None:
    run = runs(result)[(config, "liger")]
    assert "error" not in run, run.get("trace", "") + result["log"][-2000:]
    assert run["params"] == run["trainable"] == PARAMS and run["differing"] == PARAMS, run


def assert_in_sync(result: dict, config: str, arm: str = "liger") -> None:
    run = runs(result)[(config, arm)]
    assert "error" not in run, run.get("trace", "") + result["log"][-2000:]
    assert run["params"] == run["trainable"] == PARAMS, run  # every trainable parameter got a gradient, compared
    assert (run["differing"], run["max_abs_diff"]) == (0, 0.0), run


def assert_liger_equals_off(grads: Path, config: str, atol: float = 1e-4) -> float:
    ours, off = torch.load(f"{grads}.{config}.pt"), torch.load(f"{grads}.{config}.off.pt")
    assert ours.keys() == off.keys() and len(ours) == PARAMS
    worst = max((ours[n] - off[n]).abs().max().item() for n in ours)
    assert worst <= atol, (config, worst)
    return worst


def decisions(result: dict, patch: str, trainer: str) -> list[str]:
    return next(r["runtime"].get(trainer, []) for r in result["report"] if r["name"] == patch)


RELEASES = [
    pytest.param("1.9.0", marks=pytest.mark.skipif(not FULL, reason="full matrix: LIGER_DDP_PATCH_FULL_MATRIX=1")),
    "1.12.0",
    pytest.param("1.13.0", marks=pytest.mark.skipif(not FULL, reason="full matrix: LIGER_DDP_PATCH_FULL_MATRIX=1")),
    "1.14.0",
]


# TRL 1.12.0 unpatched: the controls of both tests below in one launch (the regional config, which crashes, last)
CONTROL_1_12 = "dpo-compile,kto-compile,gkd-compile,dpo-compile-regional"


@pytest.fixture(scope="module")
def control_1_12(tiny_small):
    return probe(tiny_small, "1.12.0", False, CONTROL_1_12)


@pytest.mark.parametrize("version", RELEASES)
def test_compiled_ddp_desyncs_unpatched_and_is_in_sync_patched(tiny_small, tmp_path, version, request):
    if version == "1.12.0":
        control = request.getfixturevalue("control_1_12")
    else:
        control = probe(tiny_small, version, False, "dpo-compile,kto-compile")
    for config in ("dpo-compile", "kto-compile"):
        assert_desynced(control, config)

    grads = tmp_path / "grads"
    patched = probe(
        tiny_small, version, True, "dpo-compile,kto-compile", "--arms", "liger,off", "--grads-out", str(grads)
    )
    patch = "{}_compiled_ddp" if version == "1.14.0" else "{}_compute_loss"
    for config in ("dpo-compile", "kto-compile"):
        kind = config.split("-")[0]
        assert_in_sync(patched, config)
        trainer = f"{kind.upper()}Trainer"
        assert f"{COMPILED}, eager" in decisions(patched, patch.format(kind), trainer)[0]
        assert matrix.expected_status(version, patch.format(kind)) == "applied"
        assert_in_sync(patched, config, "off")
        assert_liger_equals_off(grads, config)
    assert f"DPOTrainer under DistributedDataParallel: {COMPILED}" in patched["log"]  # the rank-0 line says so
    # the default check (LIGER_DDP_PATCH_VERIFY unset) held, and said so once per Liger trainer; the Liger-off arm has
    # no Liger path, so no check and no line
    liger = [r for r in patched["results"] if r["arm"] == "liger"]
    assert len(liger) == 2 and patched["log"].count("gradients in sync across 2 ranks at step 0") == len(liger)
    assert "NOT synchronised" not in patched["log"]


def test_compiled_gkd_and_regional_compilation_are_routed(tiny_small, control_1_12):
    """GKD on one release, and accelerate's regional compilation (a copy of the DDP module with compiled blocks),
    where unpatched TRL hands the DDP copy to its Liger path and crashes."""
    control = control_1_12
    assert_desynced(control, "gkd-compile")
    assert "no attribute 'base_model'" in runs(control)[("dpo-compile-regional", "liger")]["error"]
    patched = probe(tiny_small, "1.12.0", True, "gkd-compile,dpo-compile-regional")
    assert_in_sync(patched, "gkd-compile")
    assert_in_sync(patched, "dpo-compile-regional")
    assert decisions(patched, "gkd_compute_loss", "GKDTrainer")[0].startswith(COMPILED)
    assert decisions(patched, "dpo_compute_loss", "DPOTrainer")[0].startswith("compiled regions")


def test_a_resumed_compiled_run_ends_where_the_uninterrupted_run_ends(tiny_small, tmp_path):
    """Two SGD steps with a checkpoint after each; then a run resumed from checkpoint-1: the same final weights."""
    out = tmp_path / "runs"
    both = "dpo-compile,kto-compile"
    whole = probe(tiny_small, "1.12.0", True, both, "--steps", "2", *SGD, "--save-steps", "1", "--output-dir",
                  str(out), "--weights-out", str(tmp_path / "whole"))  # fmt: skip
    resumed = probe(tiny_small, "1.12.0", True, both, "--steps", "2", *SGD, "--output-dir", str(out), "--resume",
                    "checkpoint-1", "--weights-out", str(tmp_path / "resumed"))  # fmt: skip
    for config in ("dpo-compile", "kto-compile"):
        assert_in_sync(whole, config)
        assert_in_sync(resumed, config)
        start = torch.load(tmp_path / f"whole.{config}.init.pt")
        a, b = torch.load(tmp_path / f"whole.{config}.pt"), torch.load(tmp_path / f"resumed.{config}.pt")
        assert max((a[n] - start[n]).abs().max().item() for n in a) > 1e-3  # two real steps were taken
        assert all(torch.equal(a[n], b[n]) for n in a), config
    # the resumed trainer restored step 1's log from the checkpoint and trained step 2 only
    assert [h["step"] for h in resumed["results"][0]["history"] if "loss" in h] == [1, 2]

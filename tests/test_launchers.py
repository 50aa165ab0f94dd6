"""Other ways users launch: `accelerate launch`, and multi-node `torchrun` (two "nodes" on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import PACKAGE_ROOT, PROBE, run_probe_two_nodes

pytestmark = pytest.mark.ddp

EXAMPLE = str(Path(__file__).resolve().parents[1] / "sitecustomize_example")
PARAMS = 25  # the tiny model's parameters, every one with a gradient: "0 differing" must cover all of them


def env_with(pythonpath: list[str], **extra: str) -> dict:
    env = {**os.environ, "PROBE_PATCH": "none", "OMP_NUM_THREADS": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, PACKAGE_ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def probe_args(assets, out: Path, trainers: str = "dpo") -> list[str]:
    return [str(PROBE), "--assets", str(assets), "--trainers", trainers, "--out", str(out)]


def read(out: Path, procs: list[subprocess.CompletedProcess]) -> dict:
    assert out.exists(), "\n".join(p.stdout[-2000:] + p.stderr[-3000:] for p in procs)
    return json.loads(out.read_text())["results"][0]


@pytest.mark.parametrize("injected", [False, True, "run"], ids=["control", "sitecustomize", "liger-ddp-patch-run"])
def test_accelerate_launch(tiny_small, tmp_path, injected):
    """`accelerate launch` on 2 CPU processes; the package arrives only through the sitecustomize example, or only
    through `liger-ddp-patch run -- accelerate launch ...` (the README's form)."""
    out = tmp_path / "result.json"
    prefix = [sys.executable, "-m", "liger_ddp_patch", "run", "--"] if injected == "run" else []
    cmd = [*prefix, sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           *probe_args(tiny_small, out)]  # fmt: skip
    env = env_with([EXAMPLE] if injected is True else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    result = read(out, [proc])
    assert result["params"] == PARAMS, result
    if injected:
        assert (result["differing"], result["max_abs_diff"], result["loss_class"]) == (0, 0.0, "ChunkedDPOLoss"), result
    else:
        assert result["differing"] > 0 and result["loss_class"] == "LigerFusedLinearDPOLoss", result


@pytest.mark.parametrize("injected", [False, True], ids=["control", "liger-ddp-patch-run"])
def test_two_node_torchrun_on_loopback(tiny_small, tmp_path, injected):
    """Two torchrun invocations, one process each; the package arrives only through `liger-ddp-patch run`."""
    prefix = (sys.executable, "-m", "liger_ddp_patch", "run", "--") if injected else ()
    result, logs = run_probe_two_nodes(tiny_small, tmp_path, env_with([]), prefix=prefix)
    assert result is not None, logs[-5000:]
    (run,) = result["results"]
    assert run["params"] == PARAMS, run
    if injected:
        assert (run["differing"], run["max_abs_diff"]) == (0, 0.0), run
    else:
        assert run["differing"] > 0, run

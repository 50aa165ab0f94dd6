"""The main job: a real 2-rank CPU/gloo run of TRL's DPO and KTO with Liger, unpatched and patched.

``liger-ddp-patch demo`` builds a tiny Qwen3 with a real-size vocabulary locally (no hub, :mod:`.tiny`), runs
:mod:`.worker` under ``torchrun`` twice (package off, package on) and prints how many parameters' gradients differ
across ranks. (The tests' 2-rank probe, with its many setups, is ``tests/harness``: not part of the package.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def launch(assets: str | Path, trainers: str, patched: bool, env: dict[str, str] | None = None) -> dict:
    """Run :mod:`.worker` on 2 CPU ranks under ``torchrun`` and return rank 0's JSON."""
    out = Path(tempfile.mkdtemp(prefix="liger-ddp-demo-")) / "result.json"
    full_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
    full_env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
           "--assets", str(assets), "--trainers", trainers, "--out", str(out)]  # fmt: skip
    if patched:
        cmd.append("--patched")
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=900)
    if not out.exists():
        raise RuntimeError(
            f"demo run produced no result (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(out.read_text())


def _row(trainer: str, label: str, r: dict) -> str:
    if "error" in r:
        return f"{trainer:<7} {label:<10} crashed: {r['error'].splitlines()[0][:90]}"
    return (f"{trainer:<7} {label:<10} {r['params']:>6} {r['differing']:>9} {r['max_abs_diff']:>12.3e}  "
            f"{r.get('loss_class', '')}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="liger-ddp-patch demo", description=__doc__)
    parser.add_argument("--vocab-size", type=int, default=None, help="default: 151,936 (Qwen's real vocabulary)")
    parser.add_argument("--trainers", default="dpo,kto", help="dpo, kto or both, comma-separated")
    args = parser.parse_args(argv)
    if unknown := set(args.trainers.split(",")) - {"dpo", "kto"}:
        parser.error(f"the demo runs dpo and kto; not {', '.join(sorted(unknown))}")

    from .tiny import REAL_VOCAB, build

    started = time.monotonic()
    assets = build(tempfile.mkdtemp(prefix="liger-ddp-tiny-"), vocab_size=args.vocab_size or REAL_VOCAB)
    print(f"tiny Qwen3 (2 layers, vocab {args.vocab_size or REAL_VOCAB:,}) in {assets}; 2 ranks, CPU/gloo, one step")
    runs = {
        "unpatched": launch(assets, args.trainers, patched=False, env={"LIGER_DDP_PATCH_DISABLE": "1"}),
        "patched": launch(assets, args.trainers, patched=True),
    }
    print(f"TRL {runs['patched']['trl']}\n")
    print(f"{'trainer':<7} {'run':<10} {'params':>6} {'differing':>9} {'max|Δgrad|':>12}  loss module")
    ok = True
    for index, trainer in enumerate(args.trainers.split(",")):
        for label, run in runs.items():
            result = run["results"][index]
            print(_row(trainer, label, result))
            if label == "patched":
                # in sync, and every trainable parameter got a gradient (0 of 1 counted would also read "0 differing")
                ok &= "error" not in result and result["differing"] == 0 and result["params"] == result["trainable"]
    print(
        "\n" + "\n".join(closing(runs["patched"]["report"], args.trainers.split(","), ok, time.monotonic() - started))
    )
    return 0 if ok else 1


def closing(report: list[dict] | None, trainers: list[str], ok: bool, seconds: float) -> list[str]:
    """The demo's last lines: what the package did for the trainers that ran, the verdict, and what a user needs.

    Only those trainers' patches are listed: the others' trainer modules were never imported by the probe, so their
    records wait for that import ("pending"), which is what a real job would do too, not a problem to report.
    """
    mine = [s for s in report or [] if any(s["name"].startswith(f"{t}_") for t in trainers)]
    by_status: dict[str, list[str]] = {}
    for s in mine:
        by_status.setdefault(s["status"], []).append(s["name"])
    done = "; ".join(f"{', '.join(names)} {status}" for status, names in by_status.items())
    lines = [f"patches for {', '.join(trainers)}: {done or 'none reported'}"]
    if ok:
        lines.append(f"took {seconds:.0f} s; gradients in sync when patched")
        lines.append(
            "in your job: `import liger_ddp_patch` in the training script, or "
            "`liger-ddp-patch run -- torchrun ... train.py`; `liger-ddp-patch status` checks your TRL"
        )
    else:
        lines.append(
            f"took {seconds:.0f} s; PATCHED RUN NOT IN SYNC: the table says which trainer, `liger-ddp-patch status` "
            "which patch did not apply"
        )
    return lines

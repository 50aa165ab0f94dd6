"""The main job: a real 2-rank CPU/gloo run of TRL's DPO and KTO with Liger, unpatched and patched.

``liger-ddp-patch demo`` builds a tiny Qwen3 with a real-size vocabulary locally (no hub), runs :mod:`.probe` under
``torchrun`` twice (package off, package on) and prints how many parameters' gradients differ across ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROBE = Path(__file__).with_name("probe.py")
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def run_probe(
    assets: str | Path,
    mode: str = "before",
    trainers: str = "dpo,kto",
    env: dict[str, str] | None = None,
    pythonpath: tuple[str, ...] = (),
    nproc: int = 2,
    timeout: float = 900,
    extra: tuple[str, ...] = (),
    launch: tuple[str, ...] = (),
) -> dict:
    """Run the probe under ``torchrun`` and return rank 0's JSON (``log`` holds the combined output).

    ``nproc=0`` runs it as one plain process, without torchrun. ``extra`` passes more probe options (``--steps``,
    ``--grad-accum``, ``--eval-steps``, ``--bf16``, ``--lr``, ``--optim``, ``--grads-out``, ``--weights-out``,
    ``--configs``, ``--arms``, ...), ``launch`` more torchrun options.
    """
    out = Path(tempfile.mkdtemp(prefix="liger-ddp-probe-")) / "result.json"
    full_env = {**os.environ, **(env or {}), "PROBE_PATCH": mode, "OMP_NUM_THREADS": "1"}
    full_env["PYTHONPATH"] = os.pathsep.join([*pythonpath, PACKAGE_ROOT, full_env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *launch] if nproc else []
    cmd = [sys.executable, *launcher, str(PROBE), "--assets", str(assets), "--trainers", trainers, "--out", str(out),
           *extra]  # fmt: skip
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if not out.exists():
        raise RuntimeError(
            f"probe produced no result (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    result = json.loads(out.read_text())
    result["log"] = proc.stdout + proc.stderr
    return result


def run_probe_two_nodes(
    assets: str | Path,
    out: Path,
    env: dict[str, str],
    trainers: str = "dpo",
    prefix: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
    timeout: float = 900,
) -> tuple[dict | None, str]:
    """The probe as two one-process torchrun "nodes" on loopback, as multi-node jobs run: ``(rank 0's JSON or None,
    both nodes' output)``. ``prefix`` goes before each torchrun (e.g. ``liger-ddp-patch run --``); ``env`` is complete.

    Each node writes to a file, not a pipe: a node blocked on a full pipe would hold the other at the exit barrier.
    """
    out.mkdir(parents=True, exist_ok=True)
    result = out / "result.json"
    port = free_port()
    procs = []
    for rank in (0, 1):
        cmd = [*prefix, sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={rank}",
               "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}", str(PROBE),
               "--assets", str(assets), "--trainers", trainers, "--out", str(result), *extra]  # fmt: skip
        with open(out / f"node{rank}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=out))
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    logs = "\n".join((out / f"node{rank}.log").read_text() for rank in (0, 1))
    return (json.loads(result.read_text()) if result.exists() else None), logs


def free_port() -> int:
    """A TCP port free on loopback right now (for a rendezvous or a process-group store)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row(trainer: str, label: str, r: dict) -> str:
    if "error" in r:
        return f"{trainer:<7} {label:<10} crashed: {r['error'].splitlines()[0][:90]}"
    return (f"{trainer:<7} {label:<10} {r['params']:>6} {r['differing']:>9} {r['max_abs_diff']:>12.3e}  "
            f"{r.get('loss_class', '')}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="liger-ddp-patch demo", description=__doc__)
    parser.add_argument("--vocab-size", type=int, default=None, help="default: 151,936 (Qwen's real vocabulary)")
    parser.add_argument("--trainers", default="dpo,kto")
    args = parser.parse_args(argv)

    from .tiny import REAL_VOCAB, build

    started = time.monotonic()
    assets = build(tempfile.mkdtemp(prefix="liger-ddp-tiny-"), vocab_size=args.vocab_size or REAL_VOCAB)
    print(f"tiny Qwen3 (2 layers, vocab {args.vocab_size or REAL_VOCAB:,}) in {assets}; 2 ranks, CPU/gloo, one step")
    runs = {
        "unpatched": run_probe(assets, "none", args.trainers, env={"LIGER_DDP_PATCH_DISABLE": "1"}),
        "patched": run_probe(assets, "before", args.trainers),
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

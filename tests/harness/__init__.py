"""The test harness, outside the package: the 2-rank probe (:mod:`.probe`) and its launchers.

Tests and benchmarks import it as ``harness`` (pytest puts ``tests/`` on ``sys.path``; ``benchmarks/*.py`` insert it).
The probe runs as a plain script under ``torchrun``, with the checkout first on ``PYTHONPATH``; the tiny model it
trains is the demo's (``liger_ddp_patch.demo.tiny``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PROBE = Path(__file__).with_name("probe.py")
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout: its liger_ddp_patch comes first


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


@contextlib.contextmanager
def started_two_at_a_time(calls: dict) -> Iterator[dict]:
    """``{key: future}`` of independent no-argument calls that each run one interpreter, started two at a time: such
    an interpreter is bound by its imports on one core, so on 2 cores this takes ~0.6x the time of running them one
    after another. A module fixture yields the futures, so its first test starts before the last call ends; the calls
    not yet started when it leaves are cancelled."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=2)
    try:
        yield {key: pool.submit(call) for key, call in calls.items()}
    finally:
        pool.shutdown(cancel_futures=True)


def two_at_a_time(*calls):
    """The results of ``calls``, in order, run as :func:`started_two_at_a_time` runs them."""
    with started_two_at_a_time(dict(enumerate(calls))) as futures:
        return [future.result() for future in futures.values()]

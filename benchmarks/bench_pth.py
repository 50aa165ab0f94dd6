"""What the ``.pth`` line costs a Python process that does not set ``LIGER_DDP_PATCH_AUTO``.

    python benchmarks/bench_pth.py [--runs 30]

A throw-away venv (``--system-site-packages``, no pip) gets our ``.pth`` in its own site-packages, so the real
interpreter's site-packages is never touched. ``python -c pass`` is timed in that venv without the file, with the
file and the variable unset, and with ``LIGER_DDP_PATCH_AUTO=1`` (the package imported, for scale). Runs are
interleaved (A, B, C, A, B, C, ...) so drift in machine load hits every arm alike; medians are printed.
Uses hyperfine when it is installed, else a loop of subprocess runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import venv

from liger_ddp_patch import pth


def make_venv(folder: str) -> tuple[str, str]:
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(folder)
    python = os.path.join(folder, "bin", "python")
    purelib = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    )
    return python, purelib.strip()


def once(python: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run([python, "-c", "pass"], env=env, capture_output=True, text=True)
    if proc.returncode or proc.stderr:
        raise RuntimeError(f"python -c pass failed or printed to stderr:\n{proc.stderr}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()

    folder = tempfile.mkdtemp(prefix="bench-pth-")
    try:
        python, site_dir = make_venv(folder)
        # The venv's site-packages is read before the system one that holds the package and wrapt: put both on
        # PYTHONPATH in every arm so the AUTO=1 arm really imports the package.
        root = os.path.dirname(os.path.dirname(os.path.abspath(pth.__file__)))
        off = {k: v for k, v in os.environ.items() if k != pth.VARIABLE}
        path = (root, pth.default_site_dir(), off.get("PYTHONPATH"))
        off["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        on = {**off, pth.VARIABLE: "1"}
        arms = {"no .pth": (False, off), ".pth, variable unset": (True, off), ".pth, AUTO=1": (True, on)}
        if shutil.which("hyperfine"):
            print("hyperfine is installed; this script still uses its own interleaved loop for one method everywhere")
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.runs + 2):  # the first two rounds warm the page cache and are dropped
            for name, (with_pth, env) in arms.items():
                if with_pth:
                    pth.install(site_dir)
                else:
                    pth.uninstall(site_dir)
                times[name].append(once(python, env))
        pth.uninstall(site_dir)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    base = statistics.median(times["no .pth"][2:])
    print(f"python -c pass in a venv, median of {args.runs} interleaved runs each (Python {sys.version.split()[0]})")
    for name, samples in times.items():
        median = statistics.median(samples[2:])
        print(f"  {name:<22} {1e3 * median:8.1f} ms  {median / base:6.3f}x  ({1e3 * (median - base):+6.1f} ms)")


if __name__ == "__main__":
    main()

"""Import cost of ``liger_ddp_patch``: against ``wrapt`` alone, and added to ``from trl import DPOTrainer``.

    python benchmarks/bench_startup.py [--runs 15] [--trl-runs 5] [--importtime]

Each command is a fresh ``python -c ...``; runs are interleaved (A, B, A, B, ...) so drift in machine load hits
every arm alike, one warm-up round is dropped, and medians are printed. The TRL arm *with* the package includes
the patches being applied when TRL's trainer modules load. Bytecode caching is on for the subprocesses (like an
installed package; ``--no-bytecode`` keeps ``PYTHONDONTWRITEBYTECODE`` from the environment instead).
``--importtime`` adds the ten slowest modules (self
time) of ``python -X importtime -c "import liger_ddp_patch"``.
Targets: package <= wrapt + 15 ms; ``from trl import DPOTrainer`` with the package <= 1.02x without.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

SMALL = {
    "python -c pass": "pass",
    "import wrapt": "import wrapt",
    "import liger_ddp_patch": "import liger_ddp_patch",
}
TRL = {
    "from trl import DPOTrainer": "from trl import DPOTrainer",
    "+ import liger_ddp_patch first": "import liger_ddp_patch; from trl import DPOTrainer",
}


ENV = dict(os.environ)


def once(code: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=ENV)
    return time.perf_counter() - start


def interleaved(commands: dict[str, str], runs: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(runs + 1):
        for name, code in commands.items():
            samples[name].append(once(code))
    return {name: statistics.median(values[1:]) for name, values in samples.items()}


# In one process: what the package itself spends (its import, then its post-import hooks while TRL loads), against
# the TRL import it rides on. Immune to the run-to-run noise of 10-second subprocess imports on a shared machine.
DIRECT = """
import time
t0 = time.perf_counter()
import liger_ddp_patch
from liger_ddp_patch.engine import Engine
t1 = time.perf_counter()
spent = [0.0]
def timed(original):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    return wrapper
for name in ("_patch_one",):  # the work the hooks do per record (find, check, decide, swap)
    setattr(Engine, name, timed(getattr(Engine, name)))
t2 = time.perf_counter()
from trl import DPOTrainer
t3 = time.perf_counter()
print(t1 - t0, spent[0], t3 - t2 - spent[0])
"""


def direct(runs: int) -> tuple[float, float, float]:
    rows = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, "-c", DIRECT], capture_output=True, text=True, env=ENV, check=True).stdout
        rows.append([float(x) for x in out.split()])
    return tuple(statistics.median(col) for col in zip(*rows))


def importtime(top: int = 10) -> list[tuple[int, int, str]]:
    cmd = [sys.executable, "-X", "importtime", "-c", "import liger_ddp_patch"]
    err = subprocess.run(cmd, capture_output=True, text=True, env=ENV).stderr
    rows = []
    for line in err.splitlines():
        if line.startswith("import time:") and "|" in line and "self" not in line:
            self_us, cumulative_us, name = (part.strip() for part in line[len("import time:") :].split("|"))
            rows.append((int(self_us), int(cumulative_us), name))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--trl-runs", type=int, default=5)
    parser.add_argument("--importtime", action="store_true")
    parser.add_argument(
        "--no-bytecode", action="store_true", help="keep PYTHONDONTWRITEBYTECODE: our modules compile every run"
    )
    args = parser.parse_args()
    if (
        not args.no_bytecode
    ):  # an installed package has its .pyc files (pip compiles them); a source tree gets them here
        ENV.pop("PYTHONDONTWRITEBYTECODE", None)

    small = interleaved(SMALL, args.runs)
    trl = interleaved(TRL, args.trl_runs) if args.trl_runs else {}
    cache = "no bytecode cache for our modules" if args.no_bytecode else "with .pyc files"
    print(
        f"medians: {args.runs} interleaved runs each (TRL: {args.trl_runs}), Python {sys.version.split()[0]}, {cache}"
    )
    for name, value in {**small, **trl}.items():
        print(f"  {name:<32} {1e3 * value:9.1f} ms")
    extra = 1e3 * (small["import liger_ddp_patch"] - small["import wrapt"])
    print(
        f"package vs wrapt: {extra:+.1f} ms (target <= +15 ms: {'met' if extra <= 15 else 'MISSED'}); "
        f"over bare interpreter: {1e3 * (small['import liger_ddp_patch'] - small['python -c pass']):+.1f} ms"
    )
    if trl:
        ratio = trl["+ import liger_ddp_patch first"] / trl["from trl import DPOTrainer"]
        print(
            f"TRL import with/without the package: {ratio:.3f}x "
            f"(target <= 1.02x: {'met' if ratio <= 1.02 else 'MISSED'})"
        )
    if args.trl_runs:
        package, hooks, rest = direct(args.trl_runs)
        print(
            f"in-process (median of {args.trl_runs}): import liger_ddp_patch {1e3 * package:.1f} ms + hooks while TRL "
            f"loads {1e3 * hooks:.1f} ms, against TRL's own import {1e3 * rest:.0f} ms: "
            f"{(package + hooks + rest) / rest:.4f}x"
        )
    if args.importtime:
        print("\nslowest modules of `python -X importtime -c 'import liger_ddp_patch'` (self / cumulative, us):")
        for self_us, cumulative_us, name in importtime():
            print(f"  {self_us:>7} {cumulative_us:>8}  {name}")


if __name__ == "__main__":
    main()

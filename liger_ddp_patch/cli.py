"""``liger-ddp-patch status [--json] | demo | run -- CMD | pth install|uninstall [--site-dir DIR]``.

Also ``python -m liger_ddp_patch``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# What a status means for the user, printed under the table when a row has it (the README says the same).
UNAVAILABLE_NOTE = (
    "unavailable: TRL code that cannot run in this environment (the reason says why): no job can reach the bug "
    "through it, so nothing is patched and the exit code leaves it out. If you train with it, fix what the reason "
    "names first (TRL itself fails there too), then run status again."
)


def _liger_kernel(trl: str) -> str:
    """``liger-kernel <version>`` (and TRL's minimum when below it), or ``liger-kernel not installed``."""
    from liger_ddp_patch.engine import installed_version

    version = installed_version("liger-kernel")
    if version is None:
        from importlib.util import find_spec

        try:
            found = find_spec("liger_kernel") is not None
        except (ImportError, ValueError):
            found = False
        return "liger-kernel (version unreadable)" if found else "liger-kernel not installed"
    minimum = getattr(sys.modules.get("trl.import_utils"), "LIGER_KERNEL_MIN_VERSION", None)  # read, never imported
    try:
        from packaging.version import Version

        below = minimum is not None and Version(version) < Version(str(minimum))
    except ValueError:  # InvalidVersion
        below = False
    return f"liger-kernel {version}" + (f" (below TRL {trl}'s minimum {minimum})" if below else "")


def _status(as_json: bool) -> int:
    import liger_ddp_patch
    from liger_ddp_patch.engine import FAILED, PENDING, UNAVAILABLE, UNSUPPORTED, installed_version
    from liger_ddp_patch.patches.verifier import NAME as CHECK  # its version is transformers'

    rows = liger_ddp_patch.report(resolve=True)  # imports the trainer modules, so "pending" becomes a real answer
    if as_json:
        print(json.dumps([row.as_dict() for row in rows], indent=2))
    else:
        trl = next((r.version for r in rows if r.version and r.name != CHECK), None)
        version = trl or installed_version("trl") or "not installed"
        print(f"liger_ddp_patch {liger_ddp_patch.__version__}, TRL {version}, {_liger_kernel(version)}\n")
        width = max(len(r.name) for r in rows)
        for row in rows:
            print(f"{row.name:<{width}}  {row.status:<11}  {row.reason}")
        if any(r.status == UNAVAILABLE for r in rows):
            print(f"\n{UNAVAILABLE_NOTE}")
    # non-zero only where the user must act: a patch that should apply and could not (unavailable code cannot run)
    bad = any(r.status in (UNSUPPORTED, FAILED, PENDING) for r in rows)
    return 1 if bad else 0


def _run(command: list[str]) -> int:
    """Exec ``command`` with the bootstrap ``sitecustomize`` first on ``PYTHONPATH`` (inherited by every worker)."""
    from liger_ddp_patch.bootstrap import FOLDER

    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print(
            "liger-ddp-patch run: nothing to run; usage: liger-ddp-patch run -- torchrun ... train.py", file=sys.stderr
        )
        return 2
    package_root = os.path.dirname(os.path.dirname(FOLDER))
    old = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (FOLDER, package_root, old) if p)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"liger-ddp-patch run: cannot execute {command[0]!r}: {exc}", file=sys.stderr)
        return 127


def _pth(action: str, site_dir: str | None) -> int:
    from liger_ddp_patch import pth

    try:
        done = pth.install(site_dir) if action == "install" else pth.uninstall(site_dir)
    except pth.PthError as exc:
        print(f"liger-ddp-patch pth {action}: {exc}", file=sys.stderr)
        return 1
    if action == "install":
        print(f"wrote {done}: processes started with {pth.VARIABLE}=1 import liger_ddp_patch")
        if not pth.is_site_dir(os.path.dirname(done)):
            print(
                f"note: Python does not read .pth files from {os.path.dirname(done)} unless it is a site dir",
                file=sys.stderr,
            )
    else:
        print(f"removed {done}" if done else f"nothing to remove: no {pth.path(site_dir)}")
    return 0


def _trainers() -> str:
    """The trainers the package fixes, from the specs (no torch): DPO, KTO, GKD, GOLD, Distillation and IW-OPD."""
    from liger_ddp_patch.patches.trainers import SPECS

    def label(spec) -> str:
        short = spec.trainer.removesuffix("Trainer")  # DPO, Distillation; IWOPD is spelled from its name: IW-OPD
        return spec.name.upper().replace("_", "-") if short.isupper() else short

    names = [label(spec) for spec in SPECS]
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="liger-ddp-patch", description=f"Restore DDP gradient sync for TRL's Liger path of {_trainers()}."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="which patches apply to the installed TRL, and why the others do not")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("demo", help="2-rank CPU before/after run on a tiny local model (about 1.5 minutes)", add_help=False)
    run = sub.add_parser("run", help="run CMD with every Python process it starts patched: run -- CMD ...")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    pth = sub.add_parser("pth", help="install/uninstall a .pth that imports the package when LIGER_DDP_PATCH_AUTO=1")
    pth.add_argument("action", choices=["install", "uninstall"])
    pth.add_argument("--site-dir", default=None, help="default: this interpreter's site-packages (purelib)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from liger_ddp_patch.demo import main as demo

        return demo(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "status":
        return _status(args.json)
    if args.command == "pth":
        return _pth(args.action, args.site_dir)
    return _run(args.cmd)


if __name__ == "__main__":
    sys.exit(main())

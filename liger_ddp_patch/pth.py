"""Opt-in activation for every Python process through a ``.pth`` file, gated by ``LIGER_DDP_PATCH_AUTO=1``.

``site`` executes a ``.pth`` line that starts with ``import`` at every interpreter start. Ours reads the environment
first (``os`` is already imported by ``site``, so the check costs a dictionary lookup) and imports the package only
when ``LIGER_DDP_PATCH_AUTO=1``; every other process pays nothing measurable (see benchmarks/bench_pth.py).

    liger-ddp-patch pth install          # then: LIGER_DDP_PATCH_AUTO=1 torchrun ... train.py
    liger-ddp-patch pth uninstall

Put the file in the site-packages the package (and wrapt) are installed in, which is the default: ``site`` reads
the user site and a venv's site-packages *before* the system one, so a ``.pth`` there cannot import a package that
only the system site-packages holds (with the variable set, Python would print "Error processing line ...").
"""

from __future__ import annotations

import os
import sysconfig

VARIABLE = "LIGER_DDP_PATCH_AUTO"
FILENAME = "liger_ddp_patch.pth"
LINE = f'import os; os.environ.get("{VARIABLE}") == "1" and __import__("liger_ddp_patch")\n'
_HEADER = f"# liger_ddp_patch: imported only when {VARIABLE}=1 (remove with `liger-ddp-patch pth uninstall`)\n"


class PthError(OSError):
    """The ``.pth`` file could not be written or removed; the message says what to do instead."""


def default_site_dir() -> str:
    return sysconfig.get_paths()["purelib"]


def path(site_dir: str | os.PathLike | None = None) -> str:
    return os.path.join(os.fspath(site_dir) if site_dir is not None else default_site_dir(), FILENAME)


def _advice(site_dir: str) -> str:
    return (
        f"pass --site-dir with a writable site directory that Python reads .pth files from and that can import "
        f"liger_ddp_patch and wrapt when it is read (the site-packages they are installed in, e.g. a venv's or the "
        f"user site after `pip install --user`), or run with permission to write {site_dir}"
    )


def install(site_dir: str | os.PathLike | None = None) -> str:
    """Write ``liger_ddp_patch.pth`` into ``site_dir`` (default: this interpreter's purelib) and return its path."""
    target = path(site_dir)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise PthError(f"cannot install {FILENAME}: {folder} is not an existing directory; {_advice(folder)}")
    try:
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(_HEADER + LINE)
    except OSError as exc:
        raise PthError(f"cannot write {target}: {exc.strerror or exc}; {_advice(folder)}") from exc
    return target


def uninstall(site_dir: str | os.PathLike | None = None) -> str | None:
    """Remove our ``.pth`` file; return its path, or ``None`` when there was none. Never removes someone else's."""
    target = path(site_dir)
    try:
        with open(target, encoding="utf-8") as fh:
            content = fh.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PthError(f"cannot read {target}: {exc.strerror or exc}") from exc
    if LINE.strip() not in content:
        raise PthError(f"{target} was not written by liger_ddp_patch; left in place")
    try:
        os.remove(target)
    except OSError as exc:
        raise PthError(f"cannot remove {target}: {exc.strerror or exc}; {_advice(os.path.dirname(target))}") from exc
    return target


def is_site_dir(site_dir: str | os.PathLike) -> bool:
    """Whether Python processes ``.pth`` files in ``site_dir`` at startup (site-packages or the user site)."""
    import site

    known = [*site.getsitepackages(), site.getusersitepackages(), default_site_dir()]
    real = os.path.realpath(os.fspath(site_dir))
    return any(os.path.realpath(d) == real for d in known)

"""Patch every Python process (each torchrun/accelerate worker) started with this folder on PYTHONPATH.

    PYTHONPATH=/path/to/sitecustomize_example:$PYTHONPATH torchrun --nproc_per_node=8 train.py

Any other sitecustomize.py further down sys.path still runs: ours hands over to it.
"""

try:
    import liger_ddp_patch  # noqa: F401
    from liger_ddp_patch.bootstrap import chain_next_sitecustomize
except ImportError as exc:  # never break an unrelated Python process because the package is missing
    import sys

    print(f"sitecustomize: liger_ddp_patch is not importable ({exc}); continuing unpatched", file=sys.stderr)
else:
    chain_next_sitecustomize(__file__)

"""Activation without editing the training script: a ``sitecustomize`` that hands over to the user's own.

Python imports exactly one module named ``sitecustomize``: the first on ``sys.path``. Ours must therefore run any
other ``sitecustomize.py`` further down the path, or putting our folder first would silently shadow the user's.
"""

from __future__ import annotations

import importlib.util
import os
import sys

FOLDER = os.path.dirname(os.path.abspath(__file__))


def chain_next_sitecustomize(our_file: str) -> None:
    """Execute the next ``sitecustomize.py`` on ``sys.path`` after the folder holding ``our_file``."""
    ours = os.path.dirname(os.path.realpath(our_file))
    seen_ours = False
    for entry in sys.path:
        folder = os.path.realpath(entry or os.getcwd())
        if folder == ours:
            seen_ours = True
            continue
        candidate = os.path.join(folder, "sitecustomize.py")
        if seen_ours and os.path.isfile(candidate) and os.path.realpath(candidate) != os.path.realpath(our_file):
            spec = importlib.util.spec_from_file_location("_liger_ddp_patch_next_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return

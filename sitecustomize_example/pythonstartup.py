"""For interactive sessions only: PYTHONSTARTUP=/path/to/pythonstartup.py python

Python reads PYTHONSTARTUP only for an interactive prompt. It never runs in `python train.py`, torchrun or
accelerate workers: use sitecustomize.py (or `liger-ddp-patch run -- CMD`) for those.
"""

import liger_ddp_patch  # noqa: F401

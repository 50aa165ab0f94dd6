"""Put on ``PYTHONPATH`` by ``liger-ddp-patch run``: every Python process below it (each torchrun worker) is patched."""

import liger_ddp_patch  # noqa: F401
from liger_ddp_patch.bootstrap import chain_next_sitecustomize

chain_next_sitecustomize(__file__)

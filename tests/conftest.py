"""Shared fixtures: tiny local models (built once per session) and the 2-rank probe launcher."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_real(tmp_path_factory):
    """A 2-layer Qwen3 with Qwen's real vocabulary (151,936): the size at which the fused losses crash in DDP."""
    from liger_ddp_patch.demo.tiny import build

    return build(tmp_path_factory.mktemp("tiny-real"))


@pytest.fixture(scope="session")
def tiny_small(tmp_path_factory):
    """The same model with a 64-token vocabulary: fast, and enough to show the desync."""
    from liger_ddp_patch.demo.tiny import build

    return build(tmp_path_factory.mktemp("tiny-small"), vocab_size=64)


@pytest.fixture(scope="session")
def tiny_tied(tmp_path_factory):
    """The 64-token model with the LM head tied to the input embedding (as Qwen3-0.6B and Llama-3.2-1B have)."""
    from liger_ddp_patch.demo.tiny import build

    return build(tmp_path_factory.mktemp("tiny-tied"), vocab_size=64, tied=True)

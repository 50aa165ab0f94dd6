"""The version matrix: a real 2-rank DDP run per TRL release, unpatched and patched, at a real-size vocabulary.

For each release: one ``torchrun`` with the package off (the control) and one with it imported before TRL, both
trainers per run (~45-130 s each on 2 CPU cores). What each release must show comes from
the test plan, ``tests/matrix.py`` (``Line.unpatched``): ``unsynced`` (1.9.0-1.13.0: gradients differ across
ranks), ``crash`` (<= 1.8.0: the DDP wrapper reaches the Liger path), ``synced`` (>= 1.14.0: fixed upstream, so the
patched-import run must equal the unpatched one). Patched, every affected release must show 0 parameters differing.

Releases come from ``$LIGER_DDP_PATCH_TRL_DIRS/<version>`` (``.ci/trl_matrix.sh`` creates them); the ``ALWAYS``
releases run by default, the rest with ``LIGER_DDP_PATCH_FULL_MATRIX=1``. ``$LIGER_DDP_PATCH_MATRIX_OUT`` (a folder)
keeps each run's JSON, from which ``matrix.OBSERVED`` is updated by hand.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import matrix
import pytest

from liger_ddp_patch.patches import NAMES
from liger_ddp_patch.patches import trl_versions as tv

pytestmark = [pytest.mark.ddp, pytest.mark.matrix]

ROOT = Path(__file__).resolve().parents[1]
PARAMS = 25  # the tiny model's parameters, every one with a gradient: "0 differing" must cover all of them
FULL = os.environ.get("LIGER_DDP_PATCH_FULL_MATRIX") == "1"
HOW = "run `.ci/trl_matrix.sh` (or set LIGER_DDP_PATCH_TRL_DIRS / LIGER_DDP_PATCH_LIGER_DIRS)"


def _dir(env: str, default: str, version: str, package: str) -> Path:
    folder = Path(os.environ.get(env, ROOT / ".cache" / default)) / version
    if not (folder / package / "__init__.py").exists():
        pytest.skip(f"{package} {version} is not unpacked under {folder.parent}: {HOW}")
    return folder


@pytest.fixture(scope="session")
def real_vocab_assets(tmp_path_factory):
    from liger_ddp_patch.demo.tiny import REAL_VOCAB, build

    return build(tmp_path_factory.mktemp("tiny-real-vocab"), vocab_size=REAL_VOCAB)


def _run(assets, mode: str, pythonpath: tuple[Path, ...], tag: str) -> dict:
    from harness import run_probe

    env = {"LIGER_DDP_PATCH_DISABLE": "1"} if mode == "none" else {"LIGER_DDP_PATCH_DISABLE": ""}
    result = run_probe(assets, mode, "dpo,kto", env=env, pythonpath=tuple(str(p) for p in pythonpath))
    out = os.environ.get("LIGER_DDP_PATCH_MATRIX_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        keep = {k: v for k, v in result.items() if k != "log"}
        (Path(out) / f"{tag}-{mode}.json").write_text(json.dumps(keep, indent=1))
    return result


def _by_trainer(result: dict) -> dict[str, dict]:
    return {r["trainer"]: r for r in result["results"]}


def _check_pair(version: str, unpatched: dict, patched: dict) -> None:
    line = matrix.line_of(version)
    assert unpatched["trl"] == patched["trl"] == version
    assert unpatched["report"] is None, "the control run must not import the package"
    statuses = {s["name"]: s for s in patched["report"]}
    assert set(statuses) == NAMES
    assert statuses.pop("gradient_sync_check")["status"] == "applied"  # transformers' Trainer, whatever TRL
    for status in statuses.values():
        expected = matrix.expected_status(version, status["name"])
        if matrix.spec_of(status["name"]).loss:
            assert status["status"] == expected, status
        else:  # GKD/GOLD/Distillation: their trl.experimental modules are never imported by a DPO/KTO run
            assert status["status"] in ("pending", expected), status
    before, after = _by_trainer(unpatched), _by_trainer(patched)
    for kind in ("dpo", "kto"):
        b, a = before[kind], after[kind]
        if line.unpatched == "unsynced":
            assert "error" not in b and b["differing"] > 0, f"{kind}: the bug did not show unpatched: {b}"
            assert b["params"] == PARAMS, b
        elif line.unpatched == "crash":
            attribute = re.search(r"no attribute '(\w+)'", line.broken).group(1)
            assert b.get("error", "").startswith("AttributeError") and "DistributedDataParallel" in b["error"], b
            assert f"'{attribute}'" in b["error"], (attribute, b["error"])
        if line.patched:
            assert "error" not in a, f"{kind} patched crashed: {a.get('trace', a['error'])}"
            assert a["params"] == PARAMS, f"{kind}: not every parameter got a gradient patched: {a}"
            assert a["differing"] == 0, f"{kind}: gradients differ patched: {a}"
            assert a["loss_class"].startswith("Chunked"), a
        else:  # fixed upstream: the patched-import run behaves exactly like the unpatched one
            assert a.get("error") == b.get("error"), (b, a)  # 1.15.0 stops in Triton on CPU, either way alike
            if "error" not in a:
                for key in ("params", "differing", "max_abs_diff", "loss_class"):
                    assert a[key] == b[key], (kind, key, b, a)
                assert (a["params"], a["differing"]) == (PARAMS, 0), a


@pytest.mark.parametrize("version", tv.RELEASES)
def test_ddp_matrix(version, real_vocab_assets):
    if not FULL and matrix.tier(version) != "always":
        pytest.skip(f"TRL {version} is in the full matrix only: set LIGER_DDP_PATCH_FULL_MATRIX=1")
    folder = _dir("LIGER_DDP_PATCH_TRL_DIRS", "trl", version, "trl")
    unpatched = _run(real_vocab_assets, "none", (folder,), f"trl-{version}")
    patched = _run(real_vocab_assets, "before", (folder,), f"trl-{version}")
    _check_pair(version, unpatched, patched)


@pytest.mark.parametrize("version", ["1.12.0"] + (["1.8.0", "1.13.0"] if FULL else []))
def test_liger_kernel_minimum(version, real_vocab_assets):
    """TRL's minimum liger-kernel (0.8.2) first on the path: patched runs still sync (the bug shows unpatched)."""
    trl = _dir("LIGER_DDP_PATCH_TRL_DIRS", "trl", version, "trl")
    liger = _dir("LIGER_DDP_PATCH_LIGER_DIRS", "liger-kernel", "0.8.2", "liger_kernel")
    unpatched = _run(real_vocab_assets, "none", (liger, trl), f"trl-{version}-liger-0.8.2")
    patched = _run(real_vocab_assets, "before", (liger, trl), f"trl-{version}-liger-0.8.2")
    assert unpatched["liger_kernel"] == patched["liger_kernel"] == "0.8.2"
    _check_pair(version, unpatched, patched)

"""The engine's decision on every TRL release we have read, on that release's real code, plus fake/unknown versions.

Each TRL release lives in its own ``pip install --no-deps --target <root>/<version> trl==<version>`` folder; the root
is ``$LIGER_DDP_PATCH_TRL_DIRS`` (default ``.cache/trl``; ``.ci/trl_matrix.sh`` creates it). A release whose folder is
absent is skipped with a message saying how to create it. Each check runs in a subprocess with that folder first on
``PYTHONPATH``, since one process can import only one TRL.

Expectations come from the test plan (``tests/matrix.py``: what each release does, stated from the 2-rank runs) and
the trainer specs (``liger_ddp_patch.patches.trainers``: which code shape each release has).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import matrix
import pytest
from harness import started_two_at_a_time

from liger_ddp_patch.patches import NAMES, verifier
from liger_ddp_patch.patches import trl_versions as tv
from liger_ddp_patch.patches.trainers import SPECS

ROOT = Path(__file__).resolve().parents[1]
TRL_NAMES = NAMES - {verifier.NAME}  # the gradient check's row is transformers', the same whatever TRL
HOW = "run `.ci/trl_matrix.sh` (or set LIGER_DDP_PATCH_TRL_DIRS to a folder of `pip install --target` dirs)"


def trl_dir(version: str) -> Path | None:
    """``<root>/<version>`` when it holds that TRL release, else ``None``."""
    root = Path(os.environ.get("LIGER_DDP_PATCH_TRL_DIRS", ROOT / ".cache" / "trl"))
    folder = root / version
    return folder if (folder / "trl" / "__init__.py").exists() else None


def require(version: str) -> Path:
    folder = trl_dir(version)
    if folder is None:
        pytest.skip(f"TRL {version} is not unpacked under LIGER_DDP_PATCH_TRL_DIRS: {HOW}")
    return folder


# Runs in the subprocess: import the package, let it resolve every trainer module, report, and name the shape the
# compute_loss checks see (on TRL's own function, whether or not it was replaced: our wrapper keeps it as __wrapped__).
_PROBE = r"""
import importlib, inspect, json, sys
import liger_ddp_patch
from liger_ddp_patch.patches import compute_loss
from liger_ddp_patch.patches.trainers import SPECS
report = liger_ddp_patch.report(resolve=True)
import trl
shapes = {}
for spec in SPECS:
    try:
        module = importlib.import_module(spec.module_at(trl.__version__))
    except (KeyError, ImportError):  # no such trainer in this release (Distillation before 1.1.0), or a fake release
        shapes[spec.name] = [None, "absent"]
        continue
    own = inspect.unwrap(vars(getattr(module, spec.trainer))["compute_loss"])
    shapes[spec.name] = list(compute_loss.shape(own))
print("RESULT" + json.dumps({"trl": trl.__version__, "file": trl.__file__, "shapes": shapes,
                             "report": [s.as_dict() for s in report]}))
"""


def engine_report(pythonpath: Path, extra_env: dict[str, str] | None = None) -> dict:
    env = {**os.environ, **(extra_env or {}), "PYTHONPATH": os.pathsep.join([str(pythonpath), str(ROOT)])}
    env.pop("LIGER_DDP_PATCH_DISABLE", None)
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, f"no result (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(line[len("RESULT") :])
    result["statuses"] = {s["name"]: s for s in result["report"] if s["name"] != verifier.NAME}
    result["check"] = next(s for s in result["report"] if s["name"] == verifier.NAME)
    return result


FULL = os.environ.get("LIGER_DDP_PATCH_FULL_MATRIX") == "1"


@pytest.fixture(scope="module")
def reports(request):
    """Every release this session runs, reported two at a time (one interpreter each, bound by its imports): version
    -> future. On 2 cores this halves the module's time; each report is the same subprocess as before."""
    wanted = [
        item.callspec.params["version"]
        for item in request.session.items
        if item.module is request.module and getattr(item, "originalname", "") == "test_release_report"
    ]
    runs = {v: partial(engine_report, folder) for v in dict.fromkeys(wanted) if runs_here(v) and (folder := trl_dir(v))}
    with started_two_at_a_time(runs) as futures:
        yield futures


def runs_here(version: str) -> bool:
    """Whether this session checks ``version``'s report: the full-matrix releases only with FULL."""
    return FULL or matrix.tier(version) != "full"


@pytest.mark.parametrize("version", tv.RELEASES)
def test_release_report(version, reports):
    """On each release's real code: the status the test plan expects, and the shape check recognises the right shape.

    ~5 s per release (a fresh interpreter imports transformers and TRL; two at a time, see ``reports``): every release
    where something changes and the ``ALWAYS`` ones run every time, the rest with ``LIGER_DDP_PATCH_FULL_MATRIX=1``.
    """
    if not runs_here(version):
        pytest.skip(f"TRL {version} is in the full matrix only: set LIGER_DDP_PATCH_FULL_MATRIX=1")
    folder = require(version)
    result = reports[version].result()
    assert result["trl"] == version and result["file"].startswith(str(folder)), result["file"]
    assert set(result["statuses"]) == TRL_NAMES and result["check"]["status"] == "applied", result["check"]
    for status in result["statuses"].values():
        spec = matrix.spec_of(status["name"])
        assert status["status"] == matrix.expected_status(version, status["name"]), status
        if not matrix.exists_in(spec, version):  # its module was never imported: nothing to patch
            assert "cannot be imported" in status["reason"] and status["status"] == "not_needed", status
            continue
        assert status["version"] == version
        if status["name"] == spec.compiled_patch:  # not needed before its range (compute_loss routes) or after it
            assert (
                status["status"] == "applied"
                or "handles it" in status["reason"]
                or (f"fixed upstream in trl {spec.compiled_hole[1]}" in status["reason"])
            ), status
        elif status["name"] == spec.kl_logps_patch:  # before 1.9 the KL rows run the whole model; 1.14 chunks them
            assert (
                status["status"] == "applied"
                or "nothing to chunk" in status["reason"]
                or (f"fixed upstream in trl {spec.kl_rows[1]}" in status["reason"])
            ), status
        elif status["status"] == "not_needed":
            assert f"fixed upstream in trl {spec.fixed_in or tv.FIXED_IN}" in status["reason"], status
    for spec in SPECS:
        shape = result["shapes"][spec.name]
        if matrix.expected_status(version, spec.compute_loss_patch) == "applied":
            assert shape[0] == spec.shape_at(version), result["shapes"]
            if spec.loss:  # the fused class was found in the module this release defines the trainer in
                assert spec.module_at(version) in result["statuses"][spec.chunked_loss_patch]["reason"]
        else:  # fixed upstream: were the version unknown, the shape check alone would also leave it alone
            assert shape[0] is None, result["shapes"]


def fake_release(tmp_path: Path, version: str, code_from: str) -> Path:
    """A folder where ``trl`` is ``code_from``'s code but the installed metadata says ``version``."""
    source = require(code_from)
    folder = tmp_path / f"trl-{version}-from-{code_from}"
    folder.mkdir()
    (folder / "trl").symlink_to(source / "trl", target_is_directory=True)
    info = folder / f"trl-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: trl\nVersion: {version}\n")
    return folder


# label: (the version its metadata says, the release its code is from)
FAKES = {"1.13.1": ("1.13.1", "1.13.0"), "2.0.0": ("2.0.0", "1.14.0"), "2.0.0-broken": ("2.0.0", "1.12.0"),
         "1.8.0": ("1.8.0", "1.16.0"),
         # TRL from git: a .devN build carries the code of the release it leads to, or of the one before
         "1.13.0.dev0": ("1.13.0.dev0", "1.13.0"), "1.14.0.dev0": ("1.14.0.dev0", "1.14.0"),
         "1.15.0.dev0-1.14": ("1.15.0.dev0", "1.14.0"), "1.15.0.dev0-1.15": ("1.15.0.dev0", "1.15.0"),
         "1.15.0.dev0-1.16": ("1.15.0.dev0", "1.16.0")}  # fmt: skip


@pytest.fixture(scope="module")
def fakes(tmp_path_factory):
    """The engine's report on each fake release below (label -> future), two at a time like :func:`reports`."""
    folder = tmp_path_factory.mktemp("fakes")  # fake_release names each folder by its version and code
    runs = {label: partial(engine_report, fake_release(folder, version, code_from))
            for label, (version, code_from) in FAKES.items() if trl_dir(code_from) is not None}  # fmt: skip
    with started_two_at_a_time(runs) as futures:
        yield futures


def fake(fakes: dict, label: str) -> dict:
    require(FAKES[label][1])
    return fakes[label].result()


def broken_in(result: dict, code_from: str) -> list[dict]:
    """The statuses of the patches whose trainer code is broken in release ``code_from`` (Distillation is fixed from
    1.10.0 on, DPO/KTO from 1.14.0): the ones a fake version borrowing that code must patch."""
    return [s for s in result["statuses"].values() if matrix.expected_status(code_from, s["name"]) == "applied"]


def test_unknown_post_release_with_broken_code_is_patched_by_shape(fakes):
    result = fake(fakes, "1.13.1")
    assert len(broken_in(result, "1.13.0")) == len(TRL_NAMES) - 4  # all but Distillation's two and the 1.14.x records
    for status in broken_in(result, "1.13.0"):
        assert status["status"] == "applied", status
        assert "not a release we have verified" in status["reason"] and "shape check matched" in status["reason"]


def test_unknown_future_release_with_fixed_code_is_left_alone(fakes):
    result = fake(fakes, "2.0.0")
    for status in result["statuses"].values():
        spec = matrix.spec_of(status["name"])
        if status["name"] == spec.compiled_patch:  # 1.14's redirect still misses a compiled model: its shape decides
            assert status["status"] == "applied" and "shape check matched" in status["reason"], status
            continue
        assert status["status"] == "not_needed", status
        assert "2.0.0" in status["reason"] and (spec.fixed_in or tv.FIXED_IN) in status["reason"], status
    # what was checked is in the words: the guard already redirects / the fused loss is gone
    assert "model is not unwrapped_model" in result["statuses"]["dpo_compute_loss"]["reason"]
    assert "not found in trl 2.0.0" in result["statuses"]["dpo_chunked_loss"]["reason"]


def test_unknown_future_release_with_broken_code_is_patched_only_by_shape(fakes):
    """A 2.0.0 that still carried the 1.12 code: not a known release, so only the shape check lets it through."""
    result = fake(fakes, "2.0.0-broken")
    assert {s["status"] for s in broken_in(result, "1.12.0")} == {"applied"}
    assert all("not a release we have verified" in s["reason"] for s in broken_in(result, "1.12.0"))


def test_known_affected_release_with_unexpected_code_is_not_patched_blind(fakes):
    """Metadata says 1.8.0 (affected) but the code is 1.16.0's: the shape check refuses, nothing is replaced."""
    result = fake(fakes, "1.8.0")
    for name in ("dpo_compute_loss", "kto_compute_loss"):
        status = result["statuses"][name]
        assert status["status"] == "unsupported", status
        assert "shape check failed: no known shape matches" in status["reason"], status
    for name in ("dpo_chunked_loss", "kto_chunked_loss"):
        assert result["statuses"][name]["status"] == "unsupported"
        assert "not found in trl 1.8.0" in result["statuses"][name]["reason"]


BY_SHAPE = "is not a release we have verified, applied because the shape check matched"
LOOKS_FIXED = "it looks fixed (upstream fixed this in 1.14.0)"
# label -> (the compiled-DDP records' status, words of their reason; words of DPO's/KTO's compute_loss reasons)
DEV = {
    "1.13.0.dev0": ("not_needed", "trl 1.13.0.dev0 (a pre-release of 1.13.0) is before >=1.14.0,<1.15.0",
                    f"trl 1.13.0.dev0 {BY_SHAPE}"),
    "1.14.0.dev0": ("applied", f"trl 1.14.0.dev0 {BY_SHAPE}", LOOKS_FIXED),
    "1.15.0.dev0-1.14": ("applied", f"trl 1.15.0.dev0 {BY_SHAPE}", LOOKS_FIXED),
    "1.15.0.dev0-1.15": ("not_needed", "trl 1.15.0.dev0 is not a release we have read, and the `use_liger_kernel` "
                         "branch is gone (looked for `if self.use_liger_kernel:`): it looks fixed (upstream fixed this "
                         "in 1.15.0)", LOOKS_FIXED),
    "1.15.0.dev0-1.16": ("not_needed", "it looks fixed (upstream fixed this in 1.15.0)", LOOKS_FIXED),
}  # fmt: skip


@pytest.mark.parametrize("label", DEV)
def test_a_pre_release_is_judged_by_its_code(fakes, label):
    """TRL installed from git (a .devN version) over real release code: every record decides as on the release whose
    code it carries, from that code's shape, never from a range that excludes pre-releases. Before: 1.15.0.dev0 over
    1.14's code read `dpo_compiled_ddp` not_needed "is before >=1.14.0,<1.15.0", its compiled DDP hole left open."""
    result = fake(fakes, label)
    code_from = FAKES[label][1]
    compiled, said, routed = DEV[label]
    for status in result["statuses"].values():
        spec = matrix.spec_of(status["name"])
        assert status["status"] == matrix.expected_status(code_from, status["name"]), status
        assert "(installed" not in status["reason"], status  # "fixed upstream in trl X (installed Y)": version alone
        if status["name"] == spec.compiled_patch:
            assert status["status"] == compiled and said in status["reason"], status
        elif status["name"] == spec.compute_loss_patch and spec.name in ("dpo", "kto"):
            assert routed in status["reason"], status


def test_docs_table_is_current():
    path = ROOT / "docs" / "versions.md"
    assert path.exists() and path.read_text() == matrix.render_versions(), (
        "docs/versions.md is stale: run `python tests/matrix.py versions > docs/versions.md`"
    )

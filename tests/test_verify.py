"""The runtime gradient-sync verifier: comparison logic on fabricated per-rank tables, then real 2-rank runs.

The 2-rank runs use the unpatched control (package brought in by the example sitecustomize with every patch
disabled, verifier on through ``LIGER_DDP_PATCH_VERIFY``) and the patched run with the same variable.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from liger_ddp_patch import verify  # noqa: E402
from liger_ddp_patch.verify import GradientDesyncError, describe, disagreements, fingerprints  # noqa: E402

EXAMPLE = str(Path(__file__).resolve().parents[1] / "sitecustomize_example")
NAMES = ["embed.weight", "layer.0.weight", "layer.0.bias", "head.weight", "frozen.weight"]


def grads(seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 8, generator=g), torch.randn(8, 8, generator=g), torch.randn(8, generator=g),
            torch.randn(64, 8, generator=g), None]  # fmt: skip


def test_identical_gradients_give_bitwise_identical_fingerprints():
    a, b = fingerprints(grads()), fingerprints([None if g is None else g.clone() for g in grads()])
    assert a.shape == (5, verify.COLUMNS) and a.dtype == torch.float64
    assert torch.equal(a, b)
    assert disagreements(torch.stack([a, b, a])) == {}


def test_desync_names_the_parameters_and_ranks():
    ref = grads()
    rank1 = [None if g is None else g.clone() for g in ref]
    rank1[1] = rank1[1] * 1.001  # one micro-batch's worth of difference
    rank2 = [None if g is None else g.clone() for g in ref]
    rank2[1] = torch.randn(8, 8)  # never all-reduced
    rank2[3] = rank2[3].flip(0)  # same values, permuted: sum and sum of squares agree, the sampled dot does not
    table = torch.stack([fingerprints(ref), fingerprints(rank1), fingerprints(rank2)])
    bad = disagreements(table)
    assert bad == {1: [1, 2], 3: [2]}
    message = describe(NAMES, bad, world=3, step=0)
    assert message.startswith("Gradients are NOT synchronised across the 3 data-parallel ranks at optimizer step 0: ")
    assert "2 of 5 parameters differ between rank 0 and ranks 1, 2: layer.0.weight, head.weight. " in message
    assert "liger-ddp-patch status" in message
    assert isinstance(GradientDesyncError(message), RuntimeError)


def test_missing_gradient_on_one_rank_and_nan_handling():
    ref = grads()
    ref[2] = torch.full((8,), float("nan"))
    other = [None if g is None else g.clone() for g in ref]
    assert disagreements(torch.stack([fingerprints(ref), fingerprints(other)])) == {}  # NaN on both: same
    other[0] = None
    assert disagreements(torch.stack([fingerprints(ref), fingerprints(other)])) == {0: [1]}


def test_tolerance_accepts_reordered_summation_only():
    ref = fingerprints(grads())
    jitter = ref.clone()
    jitter[:, verify.SUM] += 1e-12 * jitter[:, verify.ABS_SUM]  # last-bits noise of another summation order
    assert disagreements(torch.stack([ref, jitter])) == {}
    jitter[0, verify.SUM_SQ] *= 1 + 1e-5
    assert disagreements(torch.stack([ref, jitter])) == {0: [1]}


def test_many_parameters_are_summarised():
    names = [f"p{i}" for i in range(9)]
    message = describe(names, {i: [1] for i in range(9)}, world=2, step=100)
    assert "9 of 9 parameters differ between rank 0 and rank 1: p0, p1, p2, p3, p4 (+4 more)." in message


def test_every_must_be_positive_and_single_process_is_a_no_op():
    with pytest.raises(ValueError):
        verify.GradientSyncVerifier(0)
    code = (
        "import torch, types, liger_ddp_patch.verify as v\n"
        "m = torch.nn.Linear(2, 2); m(torch.ones(1, 2)).sum().backward()\n"
        "cb = v.GradientSyncVerifier(1)\n"
        "cb.on_pre_optimizer_step(None, types.SimpleNamespace(global_step=0), None, model=m)\n"
        "print(cb.checked_steps)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Run after `import liger_ddp_patch`: is transformers' Trainer.__init__ the check's wrapper; its status row.
HOOKED = (
    "import transformers.trainer as t\n"
    "print(getattr(vars(t.Trainer)['__init__'], '_self_liger_ddp_patch', None) == 'gradient_sync_check',\n"
    "      {r.name: r for r in liger_ddp_patch.report()}['gradient_sync_check'].status)\n"
)


def test_env_hook_adds_the_callback_and_unpatch_removes_it():
    code = (
        "import liger_ddp_patch, sys\n"
        "assert 'torch' not in sys.modules\n"
        "import transformers.trainer as t\n"
        "own = vars(t.Trainer)['__init__'].__wrapped__\n" + HOOKED + "liger_ddp_patch.unpatch()\n"
        "assert vars(t.Trainer)['__init__'] is own, 'unpatch() left the wrapper'\n" + HOOKED
    )
    env = {**__import__("os").environ, "LIGER_DDP_PATCH_VERIFY": "1", "LIGER_DDP_PATCH_DISABLE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["True", "applied", "False", "disabled"]


@pytest.mark.ddp
def test_unpatched_control_raises_naming_parameters(tiny_small):
    from harness import run_probe

    env = {"LIGER_DDP_PATCH_DISABLE": "1", "LIGER_DDP_PATCH_VERIFY": "1"}
    result = run_probe(tiny_small, "none", trainers="dpo", env=env, pythonpath=(EXAMPLE,))
    statuses = {row["name"]: row["status"] for row in result["report"]}
    assert statuses.pop("gradient_sync_check") == "applied"  # LIGER_DDP_PATCH_VERIFY=1 checks with the patches off
    assert set(statuses.values()) == {"disabled"}
    (run,) = result["results"]
    error = run.get("error", "")
    assert error.startswith("GradientDesyncError: Gradients are NOT synchronised across the 2 data-parallel ranks "
                            "at optimizer step 0: 25 of 25 parameters differ between rank 0 and rank 1: "
                            "model.embed_tokens.weight, "), run  # fmt: skip
    assert "(+20 more)" in error and "liger-ddp-patch status" in error


@pytest.mark.ddp
def test_patched_run_with_verifier_is_silent(tiny_small):
    from harness import run_probe

    result = run_probe(tiny_small, "before", trainers="dpo", env={"LIGER_DDP_PATCH_VERIFY": "1"})
    (run,) = result["results"]
    assert "error" not in run, run.get("trace", "") + result["log"][-3000:]
    assert "GradientSyncVerifier" in run["callbacks"]
    assert (run["params"], run["differing"]) == (25, 0)
    assert "GradientDesyncError" not in result["log"]


# -- the default check: once, at the first optimizer step of every DDP job where the package is on ------------------
FIRST = "liger_ddp_patch: gradients in sync across 2 ranks at step 0 (25 parameters)"
NOT_SYNCED = "liger_ddp_patch: Gradients are NOT synchronised across the 2 data-parallel ranks at optimizer step 0: "


def test_default_check_is_hooked_only_while_the_package_is_on():
    from harness import two_at_a_time

    clean = {k: v for k, v in __import__("os").environ.items() if not k.startswith("LIGER_DDP_PATCH_")}

    def hooked_in(env: dict[str, str]) -> str:
        proc = subprocess.run([sys.executable, "-c", "import liger_ddp_patch\n" + HOOKED], capture_output=True,
                              text=True, env={**clean, **env})  # fmt: skip
        return proc.stdout.strip()

    envs = {"default": {}, "VERIFY=0": {"LIGER_DDP_PATCH_VERIFY": "0"}, "DISABLE=1": {"LIGER_DDP_PATCH_DISABLE": "1"},
            "DISABLE=name": {"LIGER_DDP_PATCH_DISABLE": "gradient_sync_check"}}  # fmt: skip
    hooked = dict(zip(envs, two_at_a_time(*(functools.partial(hooked_in, env) for env in envs.values()))))
    assert hooked == {"default": "True applied", "VERIFY=0": "False disabled", "DISABLE=1": "False disabled",
                      "DISABLE=name": "False disabled"}  # fmt: skip


@pytest.mark.ddp
@pytest.mark.parametrize("strict", [False, True], ids=["warns", "strict-raises"])
def test_default_check_catches_a_desync_the_patches_miss(tiny_small, strict):
    """The hole of issue 31 as it was before the compile fix: torch_compile=True with DPO's routing turned off. The
    default check (LIGER_DDP_PATCH_VERIFY unset) warns on rank 0 with the parameters and the likely cause; the job
    goes on. Under LIGER_DDP_PATCH_STRICT=1 it raises instead."""
    from harness import run_probe

    env = {"LIGER_DDP_PATCH_DISABLE": "dpo_compute_loss", "LIGER_DDP_PATCH_STRICT": "1" if strict else ""}
    result = run_probe(tiny_small, "before", env=env, extra=("--configs", "dpo-compile"))
    (run,) = result["results"]
    assert FIRST not in result["log"]
    if strict:
        assert run.get("error", "").startswith("GradientDesyncError: Gradients are NOT synchronised"), run
        return
    assert "error" not in run and run["differing"] == 25, run
    assert NOT_SYNCED in result["log"] and "model.embed_tokens.weight" in result["log"], result["log"][-3000:]
    assert "Likely cause: DPOTrainer (model OptimizedModule) computes its loss outside" in result["log"]
    assert result["log"].count(NOT_SYNCED) == 1  # rank 0 only, first step only

"""The runtime gradient-sync verifier: comparison logic on fabricated per-rank tables, then real 2-rank runs.

The 2-rank runs use the unpatched control (package brought in by the example sitecustomize with every patch
disabled, verifier on through ``LIGER_DDP_PATCH_VERIFY``) and the patched run with the same variable.
"""

from __future__ import annotations

import functools
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from liger_ddp_patch import verify  # noqa: E402
from liger_ddp_patch.verify import GradientDesyncError, describe, disagreements, fingerprints  # noqa: E402
from liger_ddp_patch.verify.distance import ROUNDING_ULPS  # noqa: E402

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


# Run after `import liger_ddp_patch`: is transformers' Trainer.__init__ the check's wrapper; its status row; the checks
# a new Trainer really holds.
HOOKED = (
    "import tempfile, torch, transformers.trainer as t\n"
    "trainer = t.Trainer(model=torch.nn.Linear(2, 2), args=t.TrainingArguments(output_dir=tempfile.mkdtemp(),\n"
    "                    use_cpu=True, report_to=[]))\n"
    "checks = [type(c).__name__ for c in trainer.callback_handler.callbacks if hasattr(c, 'checked_steps')]\n"
    "print('HOOKED', getattr(vars(t.Trainer)['__init__'], '_self_liger_ddp_patch', None) == 'gradient_sync_check',\n"
    "      {r.name: r for r in liger_ddp_patch.report()}['gradient_sync_check'].status, ','.join(checks) or '-')\n"
)


def said(out: str) -> list[str]:
    """HOOKED's lines (DeepSpeed, imported by transformers, prints its accelerator to stdout too)."""
    return [line.removeprefix("HOOKED ") for line in out.splitlines() if line.startswith("HOOKED ")]


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
    assert said(out) == ["True applied GradientSyncVerifier", "False disabled -"]


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
FIRST = "liger_ddp_patch: gradients in sync across 2 ranks at step 0 (25 of 25 parameters compared)"
NOT_SYNCED = "liger_ddp_patch: Gradients are NOT synchronised across the 2 data-parallel ranks at optimizer step 0: "


def test_default_check_is_hooked_only_while_the_package_is_on():
    from harness import two_at_a_time

    clean = {k: v for k, v in __import__("os").environ.items() if not k.startswith("LIGER_DDP_PATCH_")}

    def hooked_in(env: dict[str, str]) -> str:
        proc = subprocess.run([sys.executable, "-c", "import liger_ddp_patch\n" + HOOKED], capture_output=True,
                              text=True, env={**clean, **env})  # fmt: skip
        return " / ".join(said(proc.stdout))

    envs = {"default": {}, "VERIFY=0": {"LIGER_DDP_PATCH_VERIFY": "0"}, "DISABLE=1": {"LIGER_DDP_PATCH_DISABLE": "1"},
            "DISABLE=name": {"LIGER_DDP_PATCH_DISABLE": "gradient_sync_check"}}  # fmt: skip
    hooked = dict(zip(envs, two_at_a_time(*(functools.partial(hooked_in, env) for env in envs.values()))))
    assert hooked == {"default": "True applied FirstStepCheck", "VERIFY=0": "False disabled -",
                      "DISABLE=1": "False disabled -", "DISABLE=name": "False disabled -"}  # fmt: skip


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


# -- robust: what cannot be compared is counted as such, never a crash ----------------------------------------------
def test_unreadable_gradients_are_skipped_and_not_counted():
    dense = torch.randn(4, 3)
    sparse = torch.randn(4, 3).to_sparse()
    meta = torch.empty(4, 3, device="meta")

    class Shard(torch.Tensor):  # a tensor subclass, as a DTensor shard is
        pass

    shard = dense.clone().as_subclass(Shard)
    rows = fingerprints([dense, sparse, meta, shard, None])
    assert rows[:, verify.PRESENT].tolist() == [1.0, -1.0, -1.0, -1.0, 0.0]
    other = fingerprints([dense.clone(), torch.randn(4, 3).to_sparse(), meta, shard * 2, None])
    table = torch.stack([rows, other])
    assert disagreements(table) == {} and verify.compared(table) == 1  # only the dense gradient was compared
    table[1, 0, verify.SUM] += 1.0
    assert disagreements(table) == {0: [1]}


def test_weights_are_compared_exactly():
    """An AdamW step at TRL's default lr 1e-6 on one rank only moves every element by ~1e-6: the exact weight check
    sees it, the gradients' tolerance (1e-7 of the L1 norm) would not."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, generator=g)
    stepped = w - 1e-6 * torch.randn(1000, generator=g).sign()
    same = torch.stack([verify.weight_fingerprint(w), verify.weight_fingerprint(w.clone())])[:, None]
    differ = torch.stack([verify.weight_fingerprint(w), verify.weight_fingerprint(stepped)])[:, None]
    assert same.dtype == torch.int64  # a weight table is compared exactly whatever tolerance is asked for
    assert disagreements(same, 1e-3) == {} and disagreements(differ, 1e-3) == {0: [1]}
    one_ulp = w.clone()
    one_ulp[123] = torch.nextafter(one_ulp[123], torch.tensor(float("inf")))
    assert disagreements(torch.stack([verify.weight_fingerprint(w), verify.weight_fingerprint(one_ulp)])[:, None]) == {
        0: [1]
    }
    loose = torch.stack([fingerprints([w])[0], fingerprints([stepped])[0]])[:, None]
    assert disagreements(loose) == {}  # why weights are not compared by the gradients' fingerprint


def test_the_weight_digest_is_the_same_for_any_thread_count():
    """Issue 44: the old digest, a float sum, splits a 4M-element sum otherwise on 2 threads than on 1 (the control);
    the integer sum of the bits cannot. A transposed weight is read in its logical order."""
    fingerprint = importlib.import_module("liger_ddp_patch.verify.fingerprint")

    w = torch.randn(1 << 22, generator=torch.Generator().manual_seed(0)) * 0.02
    threads = torch.get_num_threads()
    try:
        sums, digests = [], []
        for n in (1, 2):
            torch.set_num_threads(n)
            sums.append(w.sum().item())
            digests.append(fingerprint.digest(w).item())
    finally:
        torch.set_num_threads(threads)
    assert sums[0] != sums[1]  # the control: the float sum depends on the thread count
    assert digests[0] == digests[1]
    matrix = w[:4096].reshape(64, 64)
    assert fingerprint.digest(matrix.t()).item() == fingerprint.digest(matrix.t().contiguous()).item()
    assert fingerprint.digest(torch.ones(3, dtype=torch.bfloat16)) is not None  # 6 bytes: read as int16 words


def test_ulps_are_counted_at_the_weights_largest_element():
    from liger_ddp_patch.verify import distance

    assert distance.ulp(1.0, torch.float32) == 2**-23 and distance.ulp(0.3, torch.float32) == 2**-25
    assert distance.ulp(1.0, torch.bfloat16) == 2**-7 and distance.ulp(0.0, torch.float32) > 0


def test_one_process_group_of_one(tmp_path):
    """The exchange and the distance in a real (gloo, 1 rank) group: a rank whose table cannot be built sends why
    instead, and takes part; the distance of a copy to itself is 0."""
    code = (
        "import torch, torch.distributed as dist\n"
        "from liger_ddp_patch.verify import collective, distance\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "ok = collective.exchange(lambda where: torch.ones(2, 3, dtype=torch.int64), (2, 3), torch.int64)\n"
        "def broken(where): raise RuntimeError('CUDA out of memory')\n"
        "bad = collective.exchange(broken, (2, 3), torch.int64)\n"
        "wrong = collective.exchange(lambda where: torch.ones(3, 2), (2, 3), torch.int64)\n"
        "print(ok.tables.tolist(), ok.failed, bad.failed, wrong.failed)\n"
        "print(distance.spreads([torch.randn(5, 7), torch.randn(300000)], torch.device('cpu')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == (
        "[[[1, 1, 1], [1, 1, 1]]] {} {0: 'RuntimeError: CUDA out of memory'} "
        "{0: 'ValueError: a (3, 2) torch.float32 table, not (2, 3) torch.int64'}"
    )
    assert out[1] == "[0.0, 0.0]"


@pytest.mark.parametrize(
    "backend,expected",
    [("gloo", "cpu"), ("mpi", "cpu"), ("cpu:gloo,cuda:nccl", "cpu"), ("nccl", "acc:3"), ("xccl", "acc:3"),
     ("hccl", "acc:3")],
)  # fmt: skip
def test_the_table_travels_on_the_device_the_backend_needs(monkeypatch, backend, expected):
    from liger_ddp_patch.verify import collective

    class Accelerator:
        is_available = staticmethod(lambda: True)
        current_accelerator = staticmethod(lambda: __import__("types").SimpleNamespace(type="acc"))
        current_device_index = staticmethod(lambda: 3)

    monkeypatch.setattr(collective.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch, "accelerator", Accelerator, raising=False)
    monkeypatch.setattr(collective.torch, "device", lambda kind, index=None: f"{kind}:{index}" if index is not None
                        else kind)  # fmt: skip
    assert collective.device() == expected


def test_a_failing_collective_is_one_warning_and_the_job_goes_on(monkeypatch, caplog):
    from liger_ddp_patch.verify import callbacks, collective

    def broken(parts, payload, group=None):
        raise RuntimeError("Tensors must be CUDA and dense")

    monkeypatch.setattr(collective.dist, "all_gather", broken)
    monkeypatch.setattr(collective.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(collective, "device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(callbacks.package_log, "is_main_process", lambda: True)
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    check = verify.GradientSyncVerifier(1)
    with caplog.at_level("WARNING", logger="liger_ddp_patch"):
        check.check(model, 0)  # no exception
    assert "the gradient-sync check could not run (RuntimeError: Tensors must be CUDA and dense)" in caplog.text
    assert check.checked_steps == []


# -- the documented API, pickling ---------------------------------------------------------------------------------
def _trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    import liger_ddp_patch  # noqa: F401  (the default check is added by the package's Trainer.__init__ hook)

    return Trainer(model=torch.nn.Linear(2, 2), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                        report_to=[]))  # fmt: skip


def _checks(trainer) -> list:
    return [c for c in trainer.callback_handler.callbacks if isinstance(c, verify.GradientSyncVerifier)]


def test_verify_gradient_sync_replaces_the_default_check_with_the_raising_one(tmp_path):
    trainer = _trainer(tmp_path)
    (default,) = _checks(trainer)
    assert type(default) is verify.FirstStepCheck and not default.strict
    check = verify.verify_gradient_sync(trainer, every=3)
    assert _checks(trainer) == [check] and type(check) is verify.GradientSyncVerifier
    assert (check.every, check.strict) == (3, True)
    assert verify.verify_gradient_sync(trainer, every=5) is check and check.every == 5  # re-timed, not doubled
    with pytest.raises(ValueError):
        verify.verify_gradient_sync(trainer, every=0)


def test_a_trainer_pickles_and_deep_copies_with_its_check(tmp_path):
    import copy
    import pickle

    trainer = _trainer(tmp_path)
    for twin in (pickle.loads(pickle.dumps(trainer)), copy.deepcopy(trainer)):
        (check,) = _checks(twin)
        assert type(check) is verify.FirstStepCheck and check.trainer is twin  # the copy checks the copy


def test_a_check_copied_alone_carries_no_trainer_and_says_so_once(tmp_path, monkeypatch, caplog):
    """Issue 44: pickled alone, a check carried the whole Trainer; deep-copied alone, it silently checked nothing."""
    import copy
    import pickle

    from liger_ddp_patch.verify import callbacks

    trainer = _trainer(tmp_path)
    (check,) = _checks(trainer)
    alone = pickle.dumps(check)
    assert len(alone) < len(pickle.dumps(trainer)) / 10 and b"Linear" not in alone  # no model, no Trainer
    monkeypatch.setattr(callbacks.collective, "several_ranks", lambda group=None: True)
    monkeypatch.setattr(callbacks.package_log, "is_main_process", lambda: True)
    for orphan in (pickle.loads(alone), copy.deepcopy(check)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="liger_ddp_patch"):
            assert orphan.target(trainer.args, trainer.model) is None and orphan.target(None, None) is None
        assert caplog.text.count("was copied without its Trainer, so it checks nothing") == 1, caplog.text
    assert check.trainer is trainer  # the original is untouched


# -- scope and honesty: real 2-rank jobs of a plain Trainer (tests/_verify_probe.py) ---------------------------------
PROBE = str(Path(__file__).with_name("_verify_probe.py"))
SETUPS = "ddp-liger,ddp,desync,desync-late,sparse,fsdp1,fsdp2,desync+verify"
FAULTS = ("fault-fingerprint-r1", "fault-host-r1", "fault-device-r1", "fault-fingerprint-r0")
ISSUE_44 = ("hetero", "rounding", "skip-once", "ignored", "unreadable", *FAULTS)
# Ranks that differ as mixed hardware does: thread counts, and (where the CPU has more) rank 1 on AVX2 only
HETEROGENEOUS = {"PROBE_THREADS": "1,2", "PROBE_ISA_RANK1": "avx2"}


def verify_probe(setups: str, nproc: int = 2, env: dict | None = None, extra: tuple[str, ...] = ()) -> dict:
    import json
    import os
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="verify-probe-")) / "out.json"
    full = {k: v for k, v in os.environ.items() if not k.startswith("LIGER_DDP_PATCH_")}
    full.update(env or {}, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parents[1]), full.get("PYTHONPATH")])))  # fmt: skip
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    proc = subprocess.run([sys.executable, *launch, PROBE, "--setup", setups, "--out", str(out), *extra], env=full,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert out.exists(), (proc.stdout + proc.stderr)[-4000:]
    return {r["setup"]: r for r in json.loads(out.read_text())["results"]}


@pytest.fixture(scope="module")
def scoped():
    """The default environment, 2 ranks of other thread counts (and CPU ISAs where there are two), every setup in one
    launch; a process group that gives up after 60 s, so a rank left waiting fails the test rather than hangs it."""
    return verify_probe(",".join([SETUPS, *ISSUE_44]), env=HETEROGENEOUS, extra=("--ddp-timeout", "60"))


IN_SYNC = "INFO: liger_ddp_patch: gradients in sync across 2 ranks at step 0 (3 of 3 parameters compared)"
WEIGHTS_IN_SYNC = "INFO: liger_ddp_patch: weights in sync across 2 ranks at checkpoint-3 (3 of 3 parameters compared)"


@pytest.mark.ddp
def test_default_check_acts_only_on_a_ddp_model_on_a_liger_path(scoped):
    """DDP + Liger: one collective at the first step (of 3) and one at the checkpoint, and two true lines. No Liger,
    FSDP1 (use_orig_params), FSDP2: no collective, no line (the old check false-alarmed on FSDP1 from a config)."""
    liger = scoped["ddp-liger"]
    assert "error" not in liger and liger["checks"] == {"FirstStepCheck": {"steps": [0], "saves": [3]}}, liger
    assert (liger["collectives"], liger["lines"]) == (2, [IN_SYNC, WEIGHTS_IN_SYNC])
    assert liger["portable"] == {"pickle": "ok", "deepcopy": "ok"}  # a launch's first Trainer (transformers' own
    # state stops later ones pickling, with the package or without)
    for setup in ("ddp", "fsdp1", "fsdp2"):
        run = scoped[setup]
        assert "error" not in run and (run["collectives"], run["lines"]) == (0, []), run
        assert run["checks"] == {"FirstStepCheck": {"steps": [], "saves": []}}
    # the control: a check without the scope sees FSDP1's shards differ (a false alarm) and FSDP2's not at all
    assert (scoped["fsdp1"]["unscoped"], scoped["fsdp2"]["unscoped"]) == ("differ: 3", "same")


@pytest.mark.ddp
def test_default_check_warns_at_the_first_step_and_at_a_checkpoint(scoped):
    """A loss that bypasses DDP's forward from step 0: one WARNING, the job trains on. From step 1 only: the first
    step holds, and the checkpoint's weights catch it."""
    first = scoped["desync"]
    assert "error" not in first and first["checks"]["FirstStepCheck"]["steps"] == [0], first
    said = (
        "WARNING: liger_ddp_patch: Gradients are NOT synchronised across the 2 data-parallel ranks at optimizer step 0"
    )
    assert first["lines"][0].startswith(f"{said}: 3 of 3 parameters differ"), first
    late = scoped["desync-late"]
    assert "error" not in late and late["lines"][0] == IN_SYNC, late
    said = "WARNING: liger_ddp_patch: Weights are NOT synchronised across the 2 data-parallel ranks at checkpoint-3"
    assert late["lines"][1].startswith(f"{said}: 3 of 3 parameters differ"), late
    assert "The checkpoint holds rank 0's copy only" in late["lines"][1] and len(late["lines"]) == 2


@pytest.mark.ddp
def test_a_sparse_gradient_is_skipped_and_counted(scoped):
    run = scoped["sparse"]
    assert "error" not in run, run
    assert run["lines"][0] == IN_SYNC.replace("3 of 3", "2 of 3"), run  # the sparse embedding was not compared


@pytest.mark.ddp
def test_verify_gradient_sync_raises_after_the_default_check(scoped):
    run = scoped["desync+verify"]
    assert run["error"].startswith("GradientDesyncError: Gradients are NOT synchronised"), run
    assert set(run["checks"]) == {"GradientSyncVerifier"}


@pytest.mark.ddp
def test_strict_and_verify_n_raise_and_one_process_is_silent():
    from harness import two_at_a_time

    strict, every = two_at_a_time(
        functools.partial(verify_probe, "desync,ddp-liger", env={"LIGER_DDP_PATCH_STRICT": "1"}),
        functools.partial(verify_probe, "desync,ddp", env={"LIGER_DDP_PATCH_VERIFY": "2"}),
    )
    assert strict["desync"]["error"].startswith("GradientDesyncError: Gradients are NOT synchronised"), strict
    assert "error" not in strict["ddp-liger"] and strict["ddp-liger"]["lines"] == [IN_SYNC, WEIGHTS_IN_SYNC]
    assert every["desync"]["error"].startswith("GradientDesyncError"), every
    ddp = every["ddp"]  # the explicit check needs no Liger: steps 0 and 2 of 3 (every 2), and the checkpoint
    assert ddp["checks"] == {"GradientSyncVerifier": {"steps": [0, 2], "saves": [3]}} and ddp["collectives"] == 3
    alone = verify_probe("ddp-liger,desync", nproc=0)
    for run in alone.values():
        assert "error" not in run and (run["collectives"], run["lines"]) == (0, []), run
    assert alone["ddp-liger"]["portable"] == {"pickle": "ok", "deepcopy": "ok"}


# -- issue 44: never cry wolf, never hang (the same launch) -------------------------------------------------------
def _warnings(run: dict) -> list[str]:
    return [line for line in run["lines"] if line.startswith("WARNING")]


@pytest.mark.ddp
def test_heterogeneous_ranks_of_a_healthy_job_hear_nothing_wrong(scoped):
    """Rank 1 on 2 threads (and AVX2), AdamW with clipping, 4 checkpoints: the replicas are bitwise equal, and the
    check says so. The control: the digest before issue 44 (each weight's float sum) differs, a false alarm at
    every checkpoint."""
    run = scoped["hetero"]
    assert "error" not in run and run["weights_differ"] == 0, run
    assert run["lines"] == [IN_SYNC, WEIGHTS_IN_SYNC.replace("checkpoint-3", "checkpoint-1")], run
    assert run["checks"]["FirstStepCheck"] == {"steps": [0], "saves": [1, 2, 3, 4]}
    assert run["legacy_differ"] >= 1, run  # the old digest would have warned


@pytest.mark.ddp
def test_ranks_that_round_differently_get_one_info_line(scoped):
    """Rank 1's AdamW is the fused kernel: every weight ends an ulp or so away from rank 0's, at every checkpoint.
    One INFO line says so; no warning."""
    run = scoped["rounding"]
    assert "error" not in run and run["weights_differ"] == 3, run
    assert run["lines"][0] == IN_SYNC and len(run["lines"]) == 2, run
    said = run["lines"][1]
    assert said.startswith("INFO: liger_ddp_patch: weights at checkpoint-1 differ across 2 ranks by rounding only: 3 "
                           "of 3 parameters, at most 1 ulp apart"), said  # fmt: skip


@pytest.mark.ddp
def test_one_adamw_step_apart_warns_at_the_next_checkpoint(scoped):
    """Rank 1's second update undone (AdamW at TRL's lr 1e-6): checkpoint-1 is in sync, checkpoint-2 on warn, with
    how far apart (far beyond rounding); its control is ``hetero`` (silent)."""
    run = scoped["skip-once"]
    assert "error" not in run, run
    assert run["lines"][:2] == [IN_SYNC, WEIGHTS_IN_SYNC.replace("checkpoint-3", "checkpoint-1")], run
    warned = _warnings(run)
    said = "WARNING: liger_ddp_patch: Weights are NOT synchronised across the 2 data-parallel ranks at checkpoint-"
    assert [w[len(said)] for w in warned] == ["2", "3", "4"] and all(w.startswith(said) for w in warned), run
    apart = float(warned[0].split("The copies are up to ")[1].split(" ulps")[0].replace(",", ""))
    assert apart > 10 * ROUNDING_ULPS, warned[0]
    assert "Likely cause: Probe (model DistributedDataParallel) is not a trainer liger_ddp_patch patches" in warned[0]


@pytest.mark.ddp
def test_parameters_ddp_ignores_are_not_compared(scoped):
    """``_ddp_params_and_buffers_to_ignore = ["embed.weight"]``: DDP never averages it, so it differs across ranks;
    the check leaves it out and counts it (before: a warning naming embed.weight, at the step and the checkpoint)."""
    run = scoped["ignored"]
    assert "error" not in run and run["lines"] == [IN_SYNC.replace("3 of 3", "2 of 3"),
                                                   WEIGHTS_IN_SYNC.replace("3 of 3", "2 of 3")], run  # fmt: skip


@pytest.mark.ddp
def test_a_check_that_read_nothing_claims_nothing(scoped):
    run = scoped["unreadable"]
    assert "error" not in run and run["collectives"] == 2 and run["lines"] == [], run


@pytest.mark.ddp
@pytest.mark.parametrize("setup", FAULTS)
def test_a_rank_failing_inside_the_check_leaves_nobody_waiting(scoped, setup):
    """The check fails on one rank only, in each stage: every rank still enters the one all-gather, rank 0 names the
    rank and its error, the job trains on (before: the other rank waited until the process group's timeout)."""
    run = scoped[setup]
    _, stage, rank = setup.split("-")
    rank = rank.removeprefix("r")
    assert "error" not in run and run["seconds"] < 30, run  # the process group would give up after 60 s
    why = f"(rank {rank}: RuntimeError: injected fault ({stage}, rank {rank})); nothing was compared"
    assert run["lines"] == [
        f"WARNING: liger_ddp_patch: the gradient-sync check could not run on rank {rank} at step 0 {why}",
        f"WARNING: liger_ddp_patch: the weights check could not run on rank {rank} at checkpoint-3 {why}",
    ], run

"""GKD, GOLD and Distillation (TRL issue #5282) on 2 CPU ranks: every fix beside the control that shows the bug.

Each TRL release runs in two launches of the demo probe (package on with arms Liger and Liger-off; package off), each
training several configurations in turn: a 64-token tiny Qwen3 student (untied head) and a frozen teacher with its
own weights, SGD-free (one step's gradients are what is compared), fp32 (``bf16=False``), no gradient clipping.

- TRL 1.0.0-1.5.1 (``decoder_unrouted``): unpatched, every trainable parameter differs across ranks; patched, none.
  The patched run's first synchronised gradients must equal (within 1e-4 of each tensor's scale) the mean over the
  ranks of the unpatched run's gradients -- TRL's own Liger loss, each rank on its own batch, averaged as DDP's
  all-reduce averages -- and the Liger-off DDP run's, except where TRL's Liger path computes another loss (GKD 1.0-1.3
  adds Liger's default hard cross-entropy term: there it must differ). A 1 % error in the loss fails both comparisons.
- TRL 1.6.0-1.13.0 (``head_outside``): with ``ddp_find_unused_parameters=True`` and an untied trainable head TRL stops
  with "Expected to mark a variable ready only once"; patched it trains, in sync, as Liger-off does. A tied head, a
  frozen one (LoRA) and the default setting keep TRL's code: the patched gradients are the unpatched ones, bit for bit.
- The teacher comes out of every run bit-identical; lmbda=1 generates every batch on-policy under DDP; LoRA on the
  student; the real 151,936-token vocabulary runs inside DDP's forward; one process is TRL's code bit for bit.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import pytest
from harness import run_probe, two_at_a_time

from liger_ddp_patch.patches.trainers import SPECS

pytestmark = pytest.mark.ddp

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "sitecustomize_example")
FULL = os.environ.get("LIGER_DDP_PATCH_FULL_MATRIX") == "1"
BOUND = 1e-4  # of each tensor's scale (fp32)
PARAMS, LORA, TIED = 25, 8, 24  # every trainable tensor of the student (untied head); LoRA A/B on q/v; tied head
REJECTED = "Expected to mark a variable ready only once"

# Per release: the configs one pair of launches runs (harness/probe.py CONFIGS; a trainer's name is its plain setup).
RELEASES: dict[str, tuple[str, ...]] = {
    "1.0.0": ("gkd", "gold", "gkd-temp"),
    "1.5.1": ("gkd", "distillation", "distillation-onpolicy", "distillation-lora", "distillation-top1"),
    "1.6.0": ("gkd-find-unused", "distillation-find-unused", "gkd-find-unused-tied", "gkd"),
    "1.12.0": ("iw_opd-find-unused", "iw_opd", "iw_opd-top1"),  # IW-OPD: 1.9.0-1.13.0 only
}  # fmt: skip
FULL_RELEASES: dict[str, tuple[str, ...]] = {
    "1.0.0-full": ("gkd-onpolicy", "gold-onpolicy", "gkd-lora", "gold-lora"),
    "1.1.0": ("gkd", "gold", "distillation", "gold-onpolicy", "gkd-lora"),
    "1.5.1-full": ("gold", "gkd-onpolicy", "gold-lora", "gold-onpolicy"),
    "1.6.0-full": ("gold-find-unused", "gkd-find-unused-lora"),
    "1.9.2": ("gold-find-unused", "distillation-find-unused", "gkd-find-unused-tied"),
    "1.13.0": ("gkd-find-unused", "gold-find-unused", "gkd", "iw_opd-find-unused"),
}


def differs_from_off(version: str, config: str) -> bool:
    """TRL's Liger loss differs from its non-Liger loss by design (a liger_settings fact): the comparison must fail.
    GKD 1.0-1.3: Liger's default weight_hard_loss=0.5; Distillation 1.1-1.8 and IW-OPD 1.9-1.13: loss_top_k=1
    ignored by the Liger path."""
    from liger_ddp_patch.patches import liger_settings as ls

    kind = config.split("-")[0]
    if kind == "gkd":
        return ls.dropped_in(ls.facts("gkd")[0], version, None)
    top_k = [f for f in ls.facts(kind) if f.setting == "loss_top_k"]
    return config.endswith("-top1") and bool(top_k) and ls.dropped_in(top_k[0], version, None)


def release(key: str) -> str:
    return key.removesuffix("-full")


def trl_dir(version: str) -> Path:
    from test_versions import require

    return require(version)


def params_of(config: str) -> int:
    return LORA if "lora" in config else TIED if "tied" in config else PARAMS


def head_outside(version: str) -> bool:
    """TRL 1.6.0+: TRL routes the decoder itself, only the head is used outside DDP's forward."""
    from packaging.version import Version

    return Version(version) >= Version("1.6.0")


def routed(version: str, config: str) -> bool:
    """Does the package route this config? 1.0-1.5.1: always under DDP; 1.6+: untied trainable head + find_unused."""
    return config.endswith("-find-unused") if head_outside(version) else True


@pytest.fixture(scope="module")
def launches(tiny_small, tmp_path_factory):
    """``{key: (folder, patched, unpatched)}``, launched on first use (two torchrun launches per key: a release, or
    ``<release>-full`` for the configs only the full matrix runs)."""
    assets = tiny_small
    done: dict = {}

    def get(version: str):
        if version not in done:
            folder, configs = tmp_path_factory.mktemp(f"distill-{version}"), {**RELEASES, **FULL_RELEASES}[version]
            path = (str(trl_dir(release(version))),)
            # The patched launch also runs the sync verifier: it must stay silent.
            patched = run_probe(assets, "before", pythonpath=path, env={"LIGER_DDP_PATCH_VERIFY": "1"},
                                extra=("--configs", ",".join(configs), "--arms", "liger,off",
                                       "--grads-out", str(folder / "p")))  # fmt: skip
            unpatched = run_probe(
                assets,
                "none",
                pythonpath=path,
                env={"LIGER_DDP_PATCH_DISABLE": "1"},
                extra=("--configs", ",".join(configs), "--grads-out", str(folder / "u")),
            )
            done[version] = folder, patched, unpatched
        return done[version]

    return get


def result(launch: dict, config: str, arm: str = "liger") -> dict:
    (found,) = [r for r in launch["results"] if r["config"] == config and r["arm"] == arm]
    return found


def relative(ours: dict, theirs: dict, scale: float = 1.0) -> float:
    """max over tensors of max|scale * ours - theirs| / max|theirs| (an all-zero tensor must be matched exactly)."""
    assert ours.keys() == theirs.keys()
    worst = 0.0
    for name, reference in theirs.items():
        diff = (ours[name].float() * scale - reference.float()).abs().max().item()
        size = reference.float().abs().max().item()
        worst = max(worst, diff / size if size else (0.0 if diff == 0 else float("inf")))
    return worst


def grads(folder: Path, name: str) -> dict:
    import torch

    return torch.load(folder / f"{name}.pt")


CASES = [(v, c) for v, configs in RELEASES.items() for c in configs]
CASES += [(v, c) for v, configs in FULL_RELEASES.items() for c in configs if FULL]


@pytest.mark.parametrize(("version", "config"), CASES, ids=[f"{v}-{c}" for v, c in CASES])
def test_control_shows_the_bug_and_the_patch_syncs_every_parameter(launches, version, config):
    folder, patched, unpatched = launches(version)
    version = release(version)
    assert patched["trl"] == unpatched["trl"] == version
    count = params_of(config)
    for arm in ("liger", "off"):
        run = result(patched, config, arm)
        assert "error" not in run, run.get("trace", "") + patched["log"][-3000:]
        assert (run["params"], run["trainable"], run["differing"], run["max_abs_diff"]) == (count, count, 0, 0.0), run
        assert (run["teacher_changed"], run["teacher_params"]) == (0, PARAMS), run  # the teacher, bit for bit
    assert (
        "GradientDesyncError" not in patched["log"] and "GradientSyncVerifier" in result(patched, config)["callbacks"]
    )
    spec = {s.name: s for s in SPECS}[config.split("-")[0]]
    assert result(patched, config)["loss_class"] in spec.fused  # TRL's own loss object, kept
    control = result(unpatched, config)
    if not routed(version, config):  # left to TRL: it runs and stays in sync unpatched too
        assert "error" not in control and (control["params"], control["differing"]) == (count, 0), control
    elif head_outside(version):
        assert REJECTED in control.get("error", ""), control
    else:
        assert "error" not in control, control.get("trace")
        assert control["params"] == count and control["teacher_changed"] == 0, control
        # every parameter desynced (LoRA: A gets no gradient at step 0, its B is still zero)
        assert control["differing"] == (count // 2 if "lora" in config else count), control


@pytest.mark.parametrize(("version", "config"), CASES, ids=[f"{v}-{c}" for v, c in CASES])
def test_synchronised_gradients_are_trls_liger_loss(launches, version, config):
    """vs the unpatched ranks' mean (TRL's own Liger loss, averaged as an all-reduce would) and vs Liger-off DDP."""
    folder, patched, unpatched = launches(version)
    version = release(version)
    ours = grads(folder, f"p.{config}")
    off = grads(folder, f"p.{config}.off")
    if routed(version, config) and head_outside(version):
        reference = None  # TRL's own Liger run crashed: Liger-off is the reference
    elif routed(version, config):
        reference = grads(folder, f"u.{config}.mean")
    else:  # TRL's code ran: the very gradients of the unpatched run, bit for bit
        theirs = grads(folder, f"u.{config}")
        assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)
        reference = theirs
    if reference is not None:
        assert relative(ours, reference) <= BOUND
        assert relative(ours, reference, scale=1.01) > BOUND  # a 1 % error in the loss would be seen
    if differs_from_off(version, config):
        assert relative(ours, off) > BOUND, "TRL's Liger loss no longer differs from Liger-off"
    else:
        assert relative(ours, off) <= BOUND
        assert relative(ours, off, scale=1.01) > BOUND


@pytest.mark.parametrize("version", [*RELEASES, *(FULL_RELEASES if FULL else ())])
def test_the_report_says_what_was_done(launches, version):
    """Routed configs say so (report() and the rank-0 line); the others say they were left to TRL."""
    _, patched, unpatched = launches(version)
    assert unpatched["report"] is None
    notes = {s["name"]: s for s in patched["report"]}
    configs, version = {**RELEASES, **FULL_RELEASES}[version], release(version)
    for config in configs:
        kind = config.split("-")[0]
        status = notes[f"{kind}_compute_loss"]
        assert status["status"] == "applied", status
        decisions = next(iter(status["runtime"].values()))
        if routed(version, config):
            assert any(d.startswith("routed through DistributedDataParallel.forward") for d in decisions), decisions
        else:
            assert any(d.endswith("left to TRL") and "use_liger_kernel=False" not in d for d in decisions), decisions
    assert "liger_ddp_patch:" in patched["log"] and "under DistributedDataParallel: routed" in patched["log"]


def test_head_decisions_on_1_6(launches):
    """TRL 1.6: untied trainable head + find_unused routed; tied, frozen (LoRA) and the default left to TRL."""
    _, patched, _ = launches("1.6.0")
    decisions = [d for s in patched["report"] if s["name"] == "gkd_compute_loss" for d in s["runtime"]["GKDTrainer"]]
    assert any("untied trainable head" in d for d in decisions), decisions
    assert any(d.startswith("the head is tied") for d in decisions), decisions
    assert any("find_unused_parameters=False" in d for d in decisions), decisions
    if FULL:  # the LoRA config (a frozen head) runs in the full matrix only
        _, patched, _ = launches("1.6.0-full")
        decisions = [
            d for s in patched["report"] if s["name"] == "gkd_compute_loss" for d in s["runtime"]["GKDTrainer"]
        ]
        assert any(d.startswith("the head is frozen") for d in decisions), decisions


@pytest.fixture(scope="module")
def real_vocab(tiny_real):
    return run_probe(tiny_real, "before", pythonpath=(str(trl_dir("1.5.1")),), extra=("--configs", "gkd,distillation"))


def test_real_vocabulary_runs_inside_ddps_forward(real_vocab):
    """Liger's JSD loss (torch.func, compiled=False) runs inside DDP's forward at V=151,936: no swap needed."""
    for config in ("gkd", "distillation"):
        run = result(real_vocab, config)
        assert "error" not in run, run.get("trace", "") + real_vocab["log"][-3000:]
        assert (run["params"], run["differing"], run["max_abs_diff"]) == (PARAMS, 0, 0.0), run
        assert run["loss_class"] == "LigerFusedLinearJSDLoss" and run["teacher_changed"] == 0, run
    for name in ("gkd_compute_loss", "distillation_compute_loss"):
        (status,) = [s for s in real_vocab["report"] if s["name"] == name]
        assert next(iter(status["runtime"].values())) == ["routed through DistributedDataParallel.forward"], status


def test_one_process_is_trls_code_bit_for_bit(tiny_small, tmp_path):
    """No wrapper: the patched run's gradients are the unpatched run's, bit for bit (the two processes at once)."""
    assets = tiny_small
    path, configs = (str(trl_dir("1.5.1")),), ("--configs", "gkd")
    patched, unpatched = two_at_a_time(
        partial(run_probe, assets, "before", pythonpath=path, nproc=0,
                extra=(*configs, "--grads-out", str(tmp_path / "p"))),
        partial(run_probe, assets, "none", pythonpath=path, nproc=0, env={"LIGER_DDP_PATCH_DISABLE": "1"},
                extra=(*configs, "--grads-out", str(tmp_path / "u"))),
    )  # fmt: skip
    for config in ("gkd",):
        assert "error" not in result(patched, config) and "error" not in result(unpatched, config)
        ours, theirs = grads(tmp_path, f"p.{config}"), grads(tmp_path, f"u.{config}")
        assert len(ours) == PARAMS and ours.keys() == theirs.keys()
        assert all(ours[k].equal(theirs[k]) for k in ours), config
        (status,) = [s for s in patched["report"] if s["name"] == f"{config}_compute_loss"]
        assert next(iter(status["runtime"].values())) == ["no wrapper: left to TRL"], status


def test_verifier_catches_an_unpatched_gkd_run(tiny_small):
    """LIGER_DDP_PATCH_VERIFY on, every patch off: the first optimizer step stops, naming the parameters."""
    assets = tiny_small
    env = {"LIGER_DDP_PATCH_DISABLE": "1", "LIGER_DDP_PATCH_VERIFY": "1"}
    found = run_probe(assets, "none", pythonpath=(str(trl_dir("1.0.0")), EXAMPLE), env=env, extra=("--configs", "gkd"))
    assert {row["status"] for row in found["report"] if row["name"] != "gradient_sync_check"} == {"disabled"}
    error = result(found, "gkd").get("error", "")
    assert error.startswith(
        "GradientDesyncError: Gradients are NOT synchronised across the 2 data-parallel ranks at optimizer step 0: "
        f"{PARAMS} of {PARAMS} parameters differ between rank 0 and rank 1: "
    ), error


def test_liger_path_facts(launches):
    """Each GKD/Distillation/IW-OPD row of liger_settings.FACTS, by a run: TRL's Liger loss ignores (or applies) the
    setting while its non-Liger loss does the opposite, and rank 0 says so once; 1.5.1's GKD says nothing (TRL 1.4
    fixed it)."""
    folder, patched, _ = launches("1.0.0")
    # the loss: Liger's hard cross-entropy term (test_synchronised_gradients_are_trls_liger_loss[1.0.0-gkd]: differs
    # from Liger-off; [1.5.1-gkd]: equal)
    assert (
        "GKDTrainer (TRL 1.0.0, use_liger_kernel=True) changes the loss: TRL builds Liger's JSD loss" in patched["log"]
    )
    # temperature: the Liger loss moves with it, the non-Liger loss (lmbda=0: no sampling) stays bit for bit
    assert relative(grads(folder, "p.gkd-temp"), grads(folder, "p.gkd")) > BOUND
    plain, hot = grads(folder, "p.gkd.off"), grads(folder, "p.gkd-temp.off")
    assert all(plain[k].equal(hot[k]) for k in plain)
    assert "GKDTrainer (TRL 1.0.0, use_liger_kernel=True) applies temperature=0.9: " in patched["log"]

    folder, patched, _ = launches("1.5.1")
    # loss_top_k=1 (the default): the Liger loss is the full-vocabulary one bit for bit, the non-Liger loss moves
    top1, full = grads(folder, "p.distillation-top1"), grads(folder, "p.distillation")
    assert all(top1[k].equal(full[k]) for k in top1)
    assert relative(grads(folder, "p.distillation-top1.off"), grads(folder, "p.distillation.off")) > BOUND
    assert "DistillationTrainer (TRL 1.5.1, use_liger_kernel=True) ignores loss_top_k=1: " in patched["log"]
    assert patched["log"].count("ignores loss_top_k=1") == 1  # rank 0, once per process
    assert "GKDTrainer (TRL" not in patched["log"]

    folder, patched, _ = launches("1.12.0")  # IW-OPD: Distillation's pre-1.9 code, frozen, the same fact
    top1, full = grads(folder, "p.iw_opd-top1"), grads(folder, "p.iw_opd")
    assert all(top1[k].equal(full[k]) for k in top1)
    assert relative(grads(folder, "p.iw_opd-top1.off"), grads(folder, "p.iw_opd.off")) > BOUND
    assert "IWOPDTrainer (TRL 1.12.0, use_liger_kernel=True) ignores loss_top_k=1: " in patched["log"]
    assert patched["log"].count("ignores loss_top_k=1") == 1


@pytest.mark.deepspeed
@pytest.mark.skipif(not FULL, reason="~3 min on 2 CPU cores: set LIGER_DDP_PATCH_FULL_MATRIX=1")
def test_deepspeed_zero2_is_trls_code_bit_for_bit(tiny_small, tmp_path):
    """A DeepSpeed engine reduces gradients itself: patched, GKD and Distillation (TRL 1.5.1) train exactly as
    unpatched -- TRL's JSD loss object, the same logged metrics and the same weights after 2 steps, bit for bit."""
    pytest.importorskip("deepspeed")
    from test_deepspeed import history_differences, launch

    path, kinds = str(trl_dir("1.5.1")), ("gkd", "distillation")
    unpatched = launch(tiny_small, 2, "none", tmp_path / "none.json", kinds, path)
    patched = launch(tiny_small, 2, "before", tmp_path / "before.json", kinds, path)
    for kind in kinds:
        before, after = unpatched[kind], patched[kind]
        assert (after["engine"], after["engine_zero_stage"], after["world_size"]) == ("DeepSpeedEngine", 2, 2)
        assert before["loss_class"] == after["loss_class"] == "LigerFusedLinearJSDLoss"
        assert history_differences(before["history"], after["history"]) == []
        assert len(before["weights"]) == PARAMS and before["weights"] == after["weights"]
        (status,) = [s for s in patched["report"] if s["name"] == f"{kind}_compute_loss"]
        decisions = next(iter(status["runtime"].values()))
        assert decisions and all(d == "DeepSpeedEngine: left to TRL" for d in decisions), decisions


@pytest.mark.parametrize("version", [*RELEASES, *(FULL_RELEASES if FULL else ())])
def test_table(launches, capsys, version):
    """The numbers for the closing note (run with -s to see them), and what each row must say (README, "How we
    know"): patched, every trainable parameter counted and none differing; unpatched, what the release does to that
    config (every parameter differs where TRL never routes the student, LoRA's B half; TRL's crash where its head is
    used outside DDP's forward with find_unused; 0 where the package leaves TRL's code to run); within BOUND of TRL's
    own Liger loss (the unpatched ranks' mean; "-" exactly where TRL's own run crashed) and of Liger-off, except where
    a liger_settings fact makes TRL's Liger loss differ from Liger-off (then beyond it)."""
    release_ = release(version)
    rows = [f"{'TRL':<7} {'config':<26} {'params':>6} {'unpatched':>10} {'patched':>7} {'vs TRL':>8} {'vs off':>8}"]
    wrong = []
    folder, patched, unpatched = launches(version)
    for config in {**RELEASES, **FULL_RELEASES}[version]:
        control, ours = result(unpatched, config), result(patched, config)
        mean, ran = folder / f"u.{config}.mean.pt", "error" not in ours  # a patched run that failed saved nothing
        vs_trl = (
            relative(grads(folder, f"p.{config}"), grads(folder, f"u.{config}.mean")) if ran and mean.exists() else None
        )
        vs_off = relative(grads(folder, f"p.{config}"), grads(folder, f"p.{config}.off")) if ran else float("nan")
        before = "crash" if "error" in control else control["differing"]
        row = (
            f"{release_:<7} {config:<26} {ours.get('params', '-'):>6} {before:>10} "
            f"{ours.get('differing', 'crash'):>7} {'-' if vs_trl is None else f'{vs_trl:.1e}':>8} {vs_off:>8.1e}"
        )
        rows.append(row)
        count = params_of(config)
        if not routed(release_, config):
            expected_before = 0  # TRL's code runs, in sync
        elif head_outside(release_):
            expected_before = "crash"  # "Expected to mark a variable ready only once"
        else:
            expected_before = count // 2 if "lora" in config else count
        off_ok = vs_off > BOUND if differs_from_off(release_, config) else vs_off <= BOUND
        synced = (ours.get("params"), ours.get("differing")) == (count, 0)
        checks = {
            "patched: every parameter counted, none differing": synced,
            f"unpatched: {expected_before}": before == expected_before,
            "vs TRL: '-' exactly where TRL crashed": not ran or (vs_trl is None) == (before == "crash"),
            f"vs TRL within {BOUND:.0e}": vs_trl is None or vs_trl <= BOUND,
            "vs Liger-off: within the bound, or beyond it where a fact applies": off_ok,
        }
        wrong += [f"{config}: {what}" + ("" if ran else f" ({ours['error']})") for what, ok in checks.items() if not ok]
    with capsys.disabled():
        print("\n" + "\n".join(rows))
    assert not wrong, wrong

"""What TRL's Liger path drops (``liger_ddp_patch.patches.liger_settings``), proven by runs on each release's code.

One subprocess per TRL release (``tests/_settings_probe.py``, two at a time) builds DPO/KTO trainers with
``use_liger_kernel=True`` and one setting each, fp32 on a 64-token tiny Qwen3 (explicit reference model: a second
tiny model, so the log-ratios are not zero), and reports TRL's own Liger loss and, on the same trainer and batch,
TRL's non-Liger loss. For every fact row, in a release that drops the setting: the Liger loss is bit for bit the one
without the setting while the non-Liger loss moves, and the package warns exactly once for it; in a release that does
not drop it: no warning, and the setting either stops the build/loss or moves the Liger loss. The expectations are
read from the rows, and pinned literally for 1.12.0 and 1.13.0 so that a deleted row fails here too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from types import SimpleNamespace

import pytest
from _fakes import RecordingEngine
from harness import started_two_at_a_time
from test_versions import ROOT, require

from liger_ddp_patch import log
from liger_ddp_patch.patches import liger_settings as ls
from liger_ddp_patch.patches import settings_warning
from liger_ddp_patch.patches.trainers import DPO, KTO

# The releases whose Liger path runs in one process on CPU, one per line of tests/matrix.py and per fact boundary.
RELEASES = ("1.0.0", "1.5.0", "1.6.0", "1.8.0", "1.9.0", "1.12.0", "1.13.0", "1.14.0")

CASES: list[dict] = [
    {"id": "dpo-base", "kind": "dpo"},
    # values the non-Liger path does nothing with: never a warning
    {"id": "dpo-neutral", "kind": "dpo",
     "config": {"ld_alpha": 1.0, "loss_weights": [1.0], "label_smoothing": 0.2, "discopop_tau": 0.5}},
    {"id": "dpo-weighting", "kind": "dpo", "config": {"use_weighting": True}},
    {"id": "dpo-ld_alpha", "kind": "dpo", "config": {"ld_alpha": 0.5}},
    {"id": "dpo-loss_weights", "kind": "dpo", "config": {"loss_weights": [2.0]}},
    {"id": "dpo-f_divergence", "kind": "dpo", "config": {"f_divergence_type": "forward_kl"}},
    {"id": "dpo-robust-base", "kind": "dpo", "config": {"loss_type": "robust"}},
    {"id": "dpo-robust", "kind": "dpo", "config": {"loss_type": "robust", "label_smoothing": 0.2}},
    {"id": "dpo-discopop-base", "kind": "dpo", "config": {"loss_type": "discopop"}},
    {"id": "dpo-discopop", "kind": "dpo", "config": {"loss_type": "discopop", "discopop_tau": 0.5}},
    {"id": "dpo-exo", "kind": "dpo", "config": {"loss_type": "exo_pair", "label_smoothing": 0.001}},
    {"id": "dpo-exo-big", "kind": "dpo", "config": {"loss_type": "exo_pair", "label_smoothing": 0.1}},
    {"id": "kto-base", "kind": "kto"},
    {"id": "kto-desirable", "kind": "kto", "config": {"desirable_weight": 3.0}},
    {"id": "kto-desirable-again", "kind": "kto", "config": {"desirable_weight": 3.0}, "keep_warned": True},
    {"id": "kto-undesirable", "kind": "kto", "config": {"undesirable_weight": 0.5}},
    {"id": "kto-peft", "kind": "kto", "peft": True, "perturb_ref": True},
    {"id": "kto-scenario", "kind": "kto", "peft": True, "config": {"desirable_weight": 3.0}},  # the user
]  # fmt: skip
CONTROL = ["dpo-weighting", "kto-peft"]  # run again after unpatch(): nothing may move

# fact -> (the case that sets it, what it is compared with: a case without it, or "after" the reference moved)
PROOF = {
    "label_smoothing (loss_type='robust')": ("dpo-robust", "dpo-robust-base"),
    "label_smoothing (loss_type='exo_pair')": ("dpo-exo", "dpo-exo-big"),
    "discopop_tau (loss_type='discopop')": ("dpo-discopop", "dpo-discopop-base"),
    "use_weighting": ("dpo-weighting", "dpo-base"),
    "ld_alpha": ("dpo-ld_alpha", "dpo-base"),
    "loss_weights": ("dpo-loss_weights", "dpo-base"),
    "f_divergence_type": ("dpo-f_divergence", "dpo-base"),
    "desirable_weight": ("kto-desirable", "kto-base"),
    "undesirable_weight": ("kto-undesirable", "kto-base"),
    "reference under PEFT (no ref_model)": ("kto-peft", "after"),
}
# Which facts each case sets (the scenario sets two).
SETS = {case: [fact] for fact, (case, _) in PROOF.items()} | {
    "dpo-exo-big": ["label_smoothing (loss_type='exo_pair')"],  # the other exo_pair value: also set
    "kto-desirable-again": ["desirable_weight"],
    "kto-scenario": ["desirable_weight", "reference under PEFT (no ref_model)"],
}

# Written out by hand from the wheels, so that deleting or narrowing a row fails here (case -> settings warned).
PINNED = {
    "1.12.0": {
        "dpo-weighting": ["use_weighting"], "dpo-ld_alpha": ["ld_alpha"], "dpo-loss_weights": ["loss_weights"],
        "dpo-robust": ["label_smoothing (loss_type='robust')"],
        "dpo-discopop": ["discopop_tau (loss_type='discopop')"],
        "dpo-exo": ["label_smoothing (loss_type='exo_pair')"],
        "dpo-exo-big": ["label_smoothing (loss_type='exo_pair')"],
        "kto-desirable": ["desirable_weight"], "kto-undesirable": ["undesirable_weight"],
        "kto-peft": ["reference under PEFT (no ref_model)"],
        "kto-scenario": ["desirable_weight", "reference under PEFT (no ref_model)"],
    },
    "1.13.0": {"dpo-weighting": ["use_weighting"], "dpo-ld_alpha": ["ld_alpha"], "dpo-loss_weights": ["loss_weights"]},
}  # fmt: skip
SCENARIO = {  # what a KTO + LoRA (PeftModel, no ref_model) + desirable_weight=3.0 user reads
    "1.12.0": [
        "liger_ddp_patch: KTOTrainer (TRL 1.12.0, use_liger_kernel=True) ignores desirable_weight=3.0: the Liger KTO "
        "loss has no class weights; TRL 1.13 rejects this combination. Set use_liger_kernel=False to apply it.",
        "liger_ddp_patch: KTOTrainer (TRL 1.12.0, use_liger_kernel=True) ignores the reference model (PEFT model, no "
        "ref_model): the Liger KTO loss is built with use_ref_model=False, so its rewards are the policy's "
        "log-probabilities instead of log-ratios against the reference (the adapter switched off, or its 'ref' copy; "
        "only the KL baseline uses it); TRL 1.13 uses the reference. Upgrade to TRL 1.13, pass a ref_model, or set "
        "use_liger_kernel=False.",
    ],
    "1.13.0": [],
}
# DPO/KTO's rows, proven here one process per release (GKD/Distillation's: tests/test_distill.py)
FACT = {fact.setting: fact for fact in ls.FACTS if fact.trainer in ("dpo", "kto")}
TRAINER = {"dpo": DPO.trainer, "kto": KTO.trainer}


@pytest.fixture(scope="module")
def probes(request, tmp_path_factory):
    """Every release this session selected, probed two at a time (one interpreter each): version -> future."""
    from liger_ddp_patch.demo.tiny import build

    folder = tmp_path_factory.mktemp("settings")
    assets, ref_assets = build(folder / "model", vocab_size=64), build(folder / "ref", vocab_size=64, seed=1)
    cases = folder / "cases.json"
    cases.write_text(json.dumps({"cases": CASES, "control": CONTROL}))
    wanted = [
        item.callspec.params["version"]
        for item in request.session.items
        if item.module is request.module and "version" in getattr(getattr(item, "callspec", None), "params", {})
    ]

    def probe(version: str) -> dict:
        out = folder / f"{version}.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(require(version)), str(ROOT)])}
        for name in ("LIGER_DDP_PATCH_DISABLE", "LIGER_DDP_PATCH_STRICT", "RANK", "LOCAL_RANK"):
            env.pop(name, None)
        command = [sys.executable, str(ROOT / "tests" / "_settings_probe.py"), str(cases), str(out), str(assets)]
        proc = subprocess.run([*command, str(ref_assets)], env=env, capture_output=True, text=True, timeout=600)
        assert out.exists(), f"probe failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        return json.loads(out.read_text())

    runs = {v: partial(probe, v) for v in dict.fromkeys(wanted) if v in RELEASES and v not in _absent()}
    with started_two_at_a_time(runs) as futures:
        yield futures


def _absent() -> set[str]:
    from test_versions import trl_dir

    return {v for v in RELEASES if trl_dir(v) is None}


def warned(lines: list[str], kind: str, version: str) -> list[str]:
    """The fact behind each warning line (each must be one of ours, in our words, for this trainer and release)."""
    found = []
    for line in lines:
        facts = [f for f in ls.facts(kind) if f.lost in line and _names(f, line)]
        assert len(facts) == 1, line
        prefix = f"liger_ddp_patch: {TRAINER[kind]} (TRL {version}, use_liger_kernel=True) {facts[0].verb} "
        assert line.startswith(prefix) and line.endswith(f"{facts[0].later}. {facts[0].remedy}"), line
        found.append(facts[0].setting)
    return found


def _names(fact: ls.Dropped, line: str) -> bool:
    """Does the warning name ``fact``'s setting right after its verb ("ignores desirable_weight=3.0: ...")?"""
    head = line.partition(f") {fact.verb} ")[2].removeprefix("the ")
    return head.startswith(fact.setting.split()[0])


def test_readme_table_is_current():
    import matrix

    readme = (ROOT / "README.md").read_text()
    start, end = readme.find(matrix.SETTINGS_BEGIN), readme.find(matrix.SETTINGS_END)
    assert 0 <= start < end, "README.md lost the liger-settings table markers"
    assert readme[start : end + len(matrix.SETTINGS_END)] + "\n" == matrix.render_liger_settings(), (
        "README's liger-settings table is stale: paste `python tests/matrix.py liger-settings` over it"
    )


def test_every_fact_is_proven_by_a_case():
    assert set(PROOF) == set(FACT), "each row of liger_settings.FACTS needs a case in PROOF (and CASES)"
    ids = {case["id"] for case in CASES}
    assert {c for pair in PROOF.values() for c in pair if c != "after"} <= ids and set(SETS) <= ids


@pytest.mark.parametrize("version", RELEASES)
def test_release(version, probes):
    require(version)
    out = probes[version].result()
    assert out["trl"] == version
    results = {r["id"]: r for r in out["results"]}
    liger = out["liger"]

    # 1. the warnings: exactly the dropped settings, per the rows; pinned by hand for 1.12.0 and 1.13.0
    seen = {}
    for case in CASES:
        r = results[case["id"]]
        got = warned(r["warnings"], case["kind"], version)
        expected = [s for s in SETS.get(case["id"], []) if ls.dropped_in(FACT[s], version, liger)]
        if case.get("keep_warned"):
            expected = []  # once per process: kto-desirable said it already
        assert got == expected, (case["id"], r["warnings"])
        if got:
            seen[case["id"]] = got
    if version in PINNED:
        assert seen == PINNED[version]
    if version in SCENARIO:
        assert results["kto-scenario"]["warnings"] == SCENARIO[version]

    # 2. the numbers: a dropped setting leaves TRL's Liger loss bit for bit while TRL's non-Liger loss moves
    for setting, (case, against) in PROOF.items():
        fact, r = FACT[setting], results[case]
        base = r.get("after") if against == "after" else results[against]
        if ls.dropped_in(fact, version, liger):
            if fact.verb == "does not pass":  # exo_pair: Liger refuses its own default, after our warning
                assert "label_smoothing must be > 0" in r.get("error", ""), (setting, r)
                continue
            assert "error" not in r and "loss_error" not in r, (setting, r)
            if against == "after":  # the reference moved: the Liger rewards do not see it, the non-Liger ones do
                assert r["liger_rewards"] == base["liger_rewards"], (setting, r)
                assert r["plain_rewards"] != base["plain_rewards"], (setting, r)
            else:
                assert r["liger"] == base["liger"], (setting, r["liger"], base["liger"])
                assert abs(r["plain"] - base["plain"]) > 1e-4, (setting, r["plain"], base["plain"])
        else:  # not silent: the setting stops the build or the loss, or TRL's Liger loss follows it
            loud = "error" in r or "loss_error" in r
            key = "liger_rewards" if against == "after" else "liger"
            assert loud or r[key] != base[key], (setting, version, r)

    # 3. values the non-Liger path ignores change nothing and say nothing
    neutral, plain = results["dpo-neutral"], results["dpo-base"]
    # ld_alpha=1.0 is neutral in value, not in rounding, where the path reads it (TRL 1.14's shared + 1.0 * tail):
    # the same 1e-6 as the non-Liger path, which a dropped or honoured setting moves by far more.
    assert neutral["warnings"] == [] and neutral["liger"] == pytest.approx(plain["liger"], rel=1e-6)
    assert neutral["plain"] == pytest.approx(plain["plain"], rel=1e-6)

    # 4. the package changes no number: the same cases after unpatch(), bit for bit
    assert [_numbers(r) for r in out["control"]] == [_numbers(results[c]) for c in CONTROL]

    # 5. the records: applied on the releases with facts, each warning kept under its trainer
    statuses = {s["name"]: s for s in out["report"]}
    has_facts = any(ls.dropped_in(f, version, liger) for f in FACT.values())
    for spec in (DPO, KTO):
        status = statuses[spec.liger_settings_patch]
        assert status["status"] == ("applied" if has_facts else "not_needed"), status
        notes = status["runtime"].get(spec.trainer, [])
        lines = {w for c in CASES if c["kind"] == spec.name for w in results[c["id"]]["warnings"]}
        assert lines <= set(notes), (lines, notes)


def _numbers(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("warnings", "seconds", "trace")}


# ------------------------------------------------------------------------------------------- in-process unit tests


def test_warn_once_is_once_per_key_and_rank_0_only(monkeypatch, caplog):
    monkeypatch.setattr(log, "_warned", set())
    with caplog.at_level("WARNING", logger=log.NAME):
        log.warn_once(("KTOTrainer", "desirable_weight"), "first")
        log.warn_once(("KTOTrainer", "desirable_weight"), "again")
        log.warn_once(("DPOTrainer", "ld_alpha"), "other")
        monkeypatch.setenv("RANK", "1")
        log.warn_once(("DPOTrainer", "use_weighting"), "rank 1")
    assert [r.getMessage() for r in caplog.records] == ["first", "other"]


def _wrapped(spec, original):
    return settings_warning.replacer(spec)(original, engine := RecordingEngine()), engine


def test_a_failing_read_is_recorded_and_the_original_still_runs(monkeypatch):
    """A config whose attribute raises must not stop the user's trainer: noted, then TRL's __init__ runs."""
    calls = []

    def __init__(self, model, ref_model=None, args=None, peft_config=None):
        calls.append(args)

    class Broken:
        use_liger_kernel = True

        @property
        def desirable_weight(self):
            raise RuntimeError("boom")

    monkeypatch.setattr(ls, "dropped_in", lambda fact, trl, liger: True)
    init, engine = _wrapped(KTO, __init__)
    trainer = type("KTOTrainer", (), {"__init__": init})
    config = Broken()
    trainer("model", args=config)
    assert calls == [config]
    assert engine.notes == [
        ("kto_liger_settings", "KTOTrainer", "settings not checked: reading them raised RuntimeError: boom")
    ]


def test_default_config_or_liger_off_reads_nothing(monkeypatch):
    monkeypatch.setattr(ls, "dropped_in", lambda fact, trl, liger: True)
    init, engine = _wrapped(DPO, lambda self, model, ref_model=None, args=None, peft_config=None: None)
    trainer = type("DPOTrainer", (), {"__init__": init})
    trainer("model")  # args=None: TRL builds its defaults
    trainer("model", args=SimpleNamespace(use_liger_kernel=False, use_weighting=True))
    assert engine.notes == []


def test_shape_check_says_what_no_longer_matches():
    check = settings_warning.checker(KTO)

    def no_args(self, model, ref_model=None, peft_config=None):
        pass

    def no_fused(self, model, ref_model=None, args=None, peft_config=None):
        self.liger_loss = None

    def fused(self, model, ref_model=None, args=None, peft_config=None):
        self.liger_loss = LigerFusedLinearKTOLoss(beta=1.0)  # noqa: F821

    assert check(no_args) == "KTOTrainer.__init__ takes no ['args']"
    assert "builds none of ['LigerFusedLinearKTOLoss', 'FusedLinearKTOLoss']" in check(no_fused)
    assert check(fused) is None


# What a user script prints (no logging configured: the package's own stderr handler), KTO + LoRA PeftModel without
# ref_model + desirable_weight=3.0; argv: model folder, then "liger" or "plain".
_USER = r"""
import sys, tempfile
import liger_ddp_patch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import KTOConfig, KTOTrainer
rows = [{"prompt": "rank one question", "completion": "a good answer", "label": bool(i % 2)} for i in range(4)]
model = get_peft_model(AutoModelForCausalLM.from_pretrained(sys.argv[1]),
                       LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
args = KTOConfig(tempfile.mkdtemp(), use_liger_kernel=True, desirable_weight=3.0, per_device_train_batch_size=2,
                 bf16=False, use_cpu=True, report_to="none",
                 liger_kernel_config={k: False for k in ("rope", "rms_norm", "swiglu", "cross_entropy",
                                                         "fused_linear_cross_entropy", "layer_norm", "geglu")})
try:
    KTOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
               processing_class=AutoTokenizer.from_pretrained(sys.argv[1]))
    print("BUILT")
except Exception as exc:
    print("TRL REFUSED:", type(exc).__name__, str(exc)[:200])
"""


@pytest.mark.parametrize(
    ("version", "disable"), [("1.12.0", ""), ("1.12.0", "kto_liger_settings"), ("1.13.0", "")], ids=str
)
def test_user_script_reads_the_warnings_on_stderr(version, disable, tiny_small):
    """The issue's user, for real: the lines on stderr (1.12.0), none when disabled or on 1.13.0 (which refuses)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(require(version)), str(ROOT)])}
    env.pop("LIGER_DDP_PATCH_DISABLE", None)
    if disable:
        env["LIGER_DDP_PATCH_DISABLE"] = disable
    proc = subprocess.run(
        [sys.executable, "-c", _USER, str(tiny_small)], env=env, capture_output=True, text=True, timeout=300
    )
    ours = [line for line in proc.stderr.splitlines() if line.startswith("liger_ddp_patch: KTOTrainer")]
    expected = [] if disable else SCENARIO[version]
    assert ours == expected, proc.stdout[-2000:] + proc.stderr[-3000:]
    if version == "1.13.0":
        assert "TRL REFUSED: ValueError" in proc.stdout and "desirable_weight" in proc.stdout, proc.stdout
    else:
        assert "BUILT" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


# A DPO user with use_weighting=True (dropped by every Liger path before 1.14); argv: model folder.
_DPO_USER = r"""
import sys, tempfile
import liger_ddp_patch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
rows = [{"prompt": "rank one question", "chosen": "a good answer", "rejected": "a bad one"} for _ in range(4)]
args = DPOConfig(tempfile.mkdtemp(), use_liger_kernel=True, use_weighting=True, per_device_train_batch_size=2,
                 bf16=False, use_cpu=True, report_to="none",
                 liger_kernel_config={k: False for k in ("rope", "rms_norm", "swiglu", "cross_entropy",
                                                         "fused_linear_cross_entropy", "layer_norm", "geglu")})
DPOTrainer(model=AutoModelForCausalLM.from_pretrained(sys.argv[1]), args=args, train_dataset=Dataset.from_list(rows),
           processing_class=AutoTokenizer.from_pretrained(sys.argv[1]))
print("BUILT")
"""


def test_a_pre_release_is_judged_as_the_release_before_its_base(tiny_small, tmp_path):
    """TRL from git carrying 1.13.0's code: 1.14.0.dev0 (outside ``<1.14.0`` for a specifier, which skips
    pre-releases) is judged as 1.13.0, 1.13.0.dev0 as 1.12.0, as the engine judges a pre-release; both warn."""
    from test_versions import fake_release

    def run(version: str) -> list[str]:
        folder = fake_release(tmp_path, version, "1.13.0")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
        env.pop("LIGER_DDP_PATCH_DISABLE", None)
        proc = subprocess.run([sys.executable, "-c", _DPO_USER, str(tiny_small)], env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert "BUILT" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
        return [line for line in proc.stderr.splitlines() if line.startswith("liger_ddp_patch: DPOTrainer")]

    from harness import two_at_a_time

    dev14, dev13 = two_at_a_time(partial(run, "1.14.0.dev0"), partial(run, "1.13.0.dev0"))
    for said, judged in ((dev14, "1.14.0.dev0, a pre-release judged as 1.13.0"),
                         (dev13, "1.13.0.dev0, a pre-release judged as 1.12.0")):  # fmt: skip
        assert said and all(f"(TRL {judged}, use_liger_kernel=True)" in line for line in said), said
        assert any("use_weighting=True" in line for line in said), said
    assert ls.judged_as("1.14.0") == "1.14.0" and ls.judged_as("1.14.0.dev0") == "1.13.0"

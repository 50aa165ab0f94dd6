"""The configurations DPO/KTO users train with: 2 ranks, a tiny Qwen3 with tied embeddings (as Qwen3-0.6B and
Llama-3.2-1B have), TRL 1.12.0 + liger-kernel 0.8.5 + peft 0.21.2.

Each configuration runs three arms in one launch: Liger with the package, TRL's fused Liger loss kept while the
package routes it (reference (a): TRL's Liger semantics, possible at a 64-token vocabulary) and
``use_liger_kernel=False`` (reference (b)); a second launch runs Liger without the package (the control: it never
synchronises). Rank 0's first synchronised gradients are compared per tensor, relative to the reference's largest
entry. The probe seeds before each trainer is built (LoRA's init draws from the global RNG before Trainer seeds it).
"""

from __future__ import annotations

from typing import NamedTuple

import pytest

from liger_ddp_patch.demo import run_probe
from liger_ddp_patch.patches import pitfalls

pytest.importorskip("peft")
pytestmark = pytest.mark.ddp

FP32, BF16 = 1e-4, 5e-2  # of each tensor's scale; bf16 runs differ from either reference by bf16 rounding (~1e-2)
FULL, LORA = 24, 8  # tied: the head is the embedding; LoRA on q/v of 2 layers: A and B of 4 modules
REJECTED = "Expected to mark a variable ready only once"


class Case(NamedTuple):
    params: int  # every parameter that should get a gradient
    bf16: bool = False
    off_differs: str = ""  # why TRL's Liger path differs from Liger-off by design (its TRL issue), if it does


CASES: dict[str, Case] = {
    "dpo-bf16": Case(FULL, bf16=True),
    "dpo-lora": Case(LORA),
    "dpo-lora-gc": Case(LORA),
    "dpo-lora-head": Case(LORA + 1),  # modules_to_save: a trainable copy of lm_head
    "dpo-peft-model": Case(LORA),
    "dpo-gc": Case(FULL),
    "dpo-gc-reentrant": Case(FULL),
    "dpo-find-unused": Case(FULL),
    "dpo-ref-model": Case(FULL),
    "dpo-grad-accum": Case(FULL),
    "dpo-apo-zero": Case(FULL),
    "dpo-long-pairs": Case(FULL),  # a token chunk of 1: every pair is longer than a chunk (one pass, pending sums)
    "kto-long-rows": Case(FULL),
    "dpo-bf16-long-pairs": Case(FULL, bf16=True),
    "kto-lora": Case(
        LORA, off_differs="TRL #7063: 1.12's KTO Liger path with PEFT and no ref_model ignores the reference"
    ),
    "kto-bf16": Case(FULL, bf16=True),
    "kto-gc": Case(FULL),
    "kto-peft-model": Case(
        LORA, off_differs="TRL #7063: 1.12's KTO Liger path with PEFT and no ref_model ignores the reference"
    ),
}
CRASHING = "dpo-lora-gc-reentrant"  # last: DDP rejects it with or without Liger (see patches/pitfalls.py)


@pytest.fixture(scope="module")
def launches(tiny_tied, tmp_path_factory):
    out = tmp_path_factory.mktemp("configs")
    names = ",".join([*CASES, CRASHING])
    patched = run_probe(tiny_tied, "before", extra=("--configs", names, "--arms", "liger,fused,off",
                                                    "--grads-out", str(out / "grads")))  # fmt: skip
    unpatched = run_probe(tiny_tied, "none", env={"LIGER_DDP_PATCH_DISABLE": "1"}, extra=("--configs", names))
    return out, patched, unpatched


def result(launch: dict, config: str, arm: str = "liger") -> dict:
    (found,) = [r for r in launch["results"] if r["config"] == config and r["arm"] == arm]
    return found


def relative(ours: dict, theirs: dict) -> float:
    """max over tensors of max|ours - theirs| / max|theirs| (an all-zero reference tensor must be matched exactly)."""
    assert ours.keys() == theirs.keys()
    worst = 0.0
    for name, reference in theirs.items():
        diff = (ours[name].float() - reference.float()).abs().max().item()
        scale = reference.float().abs().max().item()
        worst = max(worst, diff / scale if scale else (0.0 if diff == 0 else float("inf")))
    return worst


def distance(out, config: str, arm: str) -> float:
    import torch

    return relative(torch.load(out / f"grads.{config}.pt"), torch.load(out / f"grads.{config}.{arm}.pt"))


@pytest.mark.parametrize("config", CASES)
def test_every_trainable_parameter_is_in_sync(launches, config):
    """0 differing with every parameter that should have a gradient counted; the control (no package) desyncs."""
    _, patched, unpatched = launches
    for arm in ("liger", "fused", "off"):
        run = result(patched, config, arm)
        assert "error" not in run, run.get("trace")
        assert (run["params"], run["differing"], run["max_abs_diff"]) == (CASES[config].params, 0, 0.0), (arm, run)
    control = result(unpatched, config)
    assert "error" not in control, control.get("trace")
    assert control["params"] == CASES[config].params and control["differing"] > 0, control


@pytest.mark.parametrize("config", CASES)
def test_gradients_match_trls_liger_loss(launches, config):
    """Reference (a): TRL's own fused loss, routed the same way; ours must be the loss that really ran."""
    out, patched, _ = launches
    kind = config.split("-")[0].upper()
    assert result(patched, config)["loss_class"] == f"Chunked{kind}Loss"
    assert result(patched, config, "fused")["loss_class"] == f"KeptLigerFusedLinear{kind}Loss"
    bound = BF16 if CASES[config].bf16 else FP32
    assert distance(out, config, "fused") <= bound


@pytest.mark.parametrize("config", CASES)
def test_gradients_match_liger_off(launches, config):
    """Reference (b): use_liger_kernel=False, except where TRL's Liger path differs by design (then it must differ)."""
    out, _, _ = launches
    bound = BF16 if CASES[config].bf16 else FP32
    if CASES[config].off_differs:
        assert distance(out, config, "off") > bound, f"no longer differs: {CASES[config].off_differs}"
    else:
        assert distance(out, config, "off") <= bound


@pytest.mark.parametrize(
    ("config", "loss"),
    [
        ("dpo-long-pairs", "ChunkedDPOLoss"),
        ("kto-long-rows", "ChunkedKTOLoss"),
        ("dpo-bf16-long-pairs", "ChunkedDPOLoss"),
    ],
)
def test_pairs_longer_than_a_chunk_take_the_one_pass_path(launches, config, loss):
    """These configs run our loss with a token chunk of 1 (every pair / row split over chunks): it must be
    the one-pass path that ran (the three tests above then hold its gradients to both references); the other
    configs run it too, with whole pairs per chunk."""
    import torch

    from liger_ddp_patch.losses._kernels import resolve_token_chunk_size

    _, patched, _ = launches
    saw = result(patched, config)["loss_saw"]
    assert saw[f"{loss} grad_fn"] == "OnePassLossBackward"
    assert saw[f"{loss} logits budget"] == 256  # what our loss read while it ran: a chunk of 1 token at V=64
    assert resolve_token_chunk_size(None, 64, "cpu", torch.float32, 256) == 1
    assert resolve_token_chunk_size(None, 64, "cpu", torch.bfloat16, 256) == 1
    plain = f"{config.split('-')[0]}-gc"  # whole pairs per chunk
    assert result(patched, plain)["loss_saw"][f"{loss} grad_fn"] == "OnePassLossBackward"


def test_ddp_rejects_reentrant_peft_the_same_way_and_rank_0_says_why_first(launches):
    """LoRA + reentrant checkpointing + find_unused_parameters=True (Trainer's default for a PeftModel): Liger-off
    fails in DDP's backward, so the patched run must fail the same way, after one rank-0 warning that says why.
    Control: unpatched Liger never arms DDP and "runs", unsynchronised.
    """
    _, patched, unpatched = launches
    for arm in ("liger", "off"):
        assert REJECTED in result(patched, CRASHING, arm).get("error", ""), arm
    log = patched["log"]
    warning = "liger_ddp_patch: DistributedDataParallel will fail in backward"
    assert log.count(warning) == 1, log[-3000:]  # rank 0 only, once per process
    assert log.index(warning) < log.index(f"[probe] {CRASHING} failed: RuntimeError: {REJECTED}")
    (status,) = [s for s in patched["report"] if s["name"] == "dpo_compute_loss"]
    assert pitfalls.NOTE in status["runtime"]["DPOTrainer"], status  # and in report() / `status --json`
    control = result(unpatched, CRASHING)
    assert "error" not in control and control["differing"] > 0, control
    assert warning not in unpatched["log"]


def test_table(launches, capsys):
    """The numbers for the closing note (run with -s to see them)."""
    out, patched, unpatched = launches
    rows = [f"{'config':<24} {'params':>6} {'differing':>9} {'no pkg':>7} {'vs fused':>9} {'vs off':>9}  note"]
    for config, case in CASES.items():
        ours = result(patched, config)
        rows.append(
            f"{config:<24} {ours.get('params', '-'):>6} {ours.get('differing', '-'):>9} "
            f"{result(unpatched, config).get('differing', '-'):>7} {distance(out, config, 'fused'):>9.1e} "
            f"{distance(out, config, 'off'):>9.1e}  {'bf16' if case.bf16 else 'fp32'} {case.off_differs}"
        )
    rows.append(f"{CRASHING:<24} crashes with and without Liger ({REJECTED}); warned first on rank 0")
    with capsys.disabled():
        print("\n" + "\n".join(rows))

"""KTO's KL log-probs through the chunked head (issue 32 item 3): TRL's value, without TRL's ``(B, L, V)`` logits.

TRL 1.9.0-1.13.0's ``KTOTrainer._compute_kl_logps`` is run here on its own (a stand-in ``self``) against
:func:`liger_ddp_patch.patches.kl_logps.kl_logps` on the same tiny Qwen3 and batch. The control: TRL's method
materialises a ``(B, L, V)`` tensor, ours never holds more than a ``(chunk, V)`` block. The DDP runs (the routed call
uses ours, the decision says so, gradients in sync and equal to Liger-off) are in tests/test_ddp.py and
tests/test_equivalence.py.
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from liger_ddp_patch.patches import kl_logps
from liger_ddp_patch.patches.trainers import KTO

kto_trainer = pytest.importorskip("trl.trainer.kto_trainer")
TRL_METHOD = kto_trainer.KTOTrainer._compute_kl_logps
if kl_logps.check(TRL_METHOD) is not None:
    pytest.skip(f"the installed TRL's _compute_kl_logps is not the 1.9-1.13 shape: {kl_logps.check(TRL_METHOD)}",
                allow_module_level=True)  # fmt: skip

V, B, L = 4_099, 3, 21


def model(tied: bool = False, bias: bool = False, dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=tied, pad_token_id=0,
    )  # fmt: skip
    m = Qwen3ForCausalLM(config)
    if bias:
        m.lm_head = torch.nn.Linear(32, V, bias=True)
        torch.nn.init.normal_(m.lm_head.bias, std=0.5)
    return m.to(dtype).eval()


def batch(seed: int = 1) -> dict:
    """KTO's KL half of a collated batch: left-aligned rows of different lengths, a prompt, padding at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, L), generator=g)
    lengths, prompt = torch.tensor([L, L - 5, 9]), torch.tensor([4, 7, 3])
    positions = torch.arange(L)
    attention = (positions < lengths[:, None]).long()
    completion = attention * (positions >= prompt[:, None]).long()
    ids = ids.masked_fill(attention == 0, 0)
    return {
        "KL_input_ids": ids,
        "KL_attention_mask": attention,
        "KL_completion_mask": completion,
        # what else a collated KTO batch carries: kept from the model by TRL's list, and by ours
        "input_ids": ids.flip(0),
        "attention_mask": attention.flip(0),
        "completion_mask": completion.flip(0),
        "label": torch.tensor([True, False, True]),
    }


def trainer(is_vlm: bool = False):
    return types.SimpleNamespace(calculate_KL=True, use_liger_kernel=True, _is_vlm=is_vlm)


def theirs(m, b, t=None):
    return TRL_METHOD(t or trainer(), m, b)


def fp64_truth(m, b):
    m = m.double()
    with torch.no_grad():
        logits = m(input_ids=b["KL_input_ids"], attention_mask=b["KL_attention_mask"]).logits[:, :-1]
    logp = logits.log_softmax(-1).gather(-1, b["KL_input_ids"][:, 1:, None]).squeeze(-1)
    return (logp * b["KL_completion_mask"][:, 1:]).sum(-1)


@pytest.mark.parametrize(
    ("tied", "bias"), [(False, False), (True, False), (False, True)], ids=["untied", "tied", "bias"]
)
def test_equal_to_trls_in_fp32(tied, bias):
    m, b = model(tied, bias), batch()
    ours, ref = kl_logps.kl_logps(trainer(), m, b), theirs(m, b)
    assert ours.dtype == torch.float32 and ours.shape == (B,)
    scale = ref.abs().max().item()
    assert (ours - ref).abs().max().item() <= 1e-6 * scale, (ours, ref)
    assert (ours.double() - fp64_truth(m, b)).abs().max().item() <= 1e-6 * scale


def test_a_chunk_at_a_time_too():
    """token_chunk_size=1 (one token per block, the loss option a user can set) gives the same value."""
    m, b = model(), batch()
    one = types.SimpleNamespace(token_chunk_size=1, sweep="eager")
    ref = theirs(m, b)
    assert (kl_logps.kl_logps(trainer(), m, b, one) - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()


def test_bf16_is_closer_to_the_fp64_truth_than_trls():
    """bf16 weights: TRL's bf16 logits and log-softmax against ours (bf16 GEMM, fp32 softmax), both vs fp64."""
    m, b = model(dtype=torch.bfloat16), batch()
    truth = fp64_truth(model(dtype=torch.bfloat16).float(), b)
    ours, ref = kl_logps.kl_logps(trainer(), m, b), theirs(m, b)
    err_ours, err_trl = (ours.double() - truth).abs().max().item(), (ref.double() - truth).abs().max().item()
    assert err_ours <= err_trl, (err_ours, err_trl)


def test_peft_model():
    peft = pytest.importorskip("peft")
    torch.manual_seed(3)
    m = peft.get_peft_model(model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    b = batch()
    ref = theirs(m, b)
    assert (kl_logps.kl_logps(trainer(), m, b) - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()


class LargestTensor(TorchDispatchMode):
    """The largest number of elements any op returned while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_whole_vocabulary_logits_control_trls_has_them():
    m, b = model(), batch()
    with LargestTensor() as trl_run:
        theirs(m, b)
    with LargestTensor() as our_run:
        kl_logps.kl_logps(trainer(), m, b, types.SimpleNamespace(token_chunk_size=4, sweep="eager"))
    assert trl_run.largest >= B * (L - 1) * V  # the control: TRL's method holds the (B, L, V) logits
    # ours: one (chunk, V) block at a time; the largest tensor is the (V, H) head itself (an alias the mode sees)
    assert our_run.largest <= max(4, 32) * V < B * (L - 1) * V, our_run.largest


def test_the_method_chunked_installs_is_ours():
    """What the routed call really runs: inside :func:`kl_logps.chunked` the trainer's ``_compute_kl_logps`` holds no
    ``(B, L, V)`` tensor and equals TRL's value (issue 38 item 9: with the wrapper calling TRL's method instead, the
    tests above and the decision text all still passed); the control, TRL's method on the same trainer, holds one."""
    m, b = model(), batch()
    t = kto_trainer.KTOTrainer.__new__(kto_trainer.KTOTrainer)
    t.calculate_KL, t.use_liger_kernel, t._is_vlm = True, True, False
    t.liger_loss = types.SimpleNamespace(token_chunk_size=4, sweep="eager")  # the swapped loss the options come from
    whole = B * (L - 1) * V
    with LargestTensor() as trl_run:
        ref = t._compute_kl_logps(m, b)
    with kl_logps.chunked(t, TRL_METHOD, KTO), LargestTensor() as routed:
        ours = t._compute_kl_logps(m, b)
    assert trl_run.largest >= whole, trl_run.largest
    assert routed.largest < whole, f"the routed call materialised {routed.largest:,} elements: TRL's method ran"
    assert (ours - ref).abs().max().item() <= 1e-6 * ref.abs().max().item(), (ours, ref)


def test_chunked_is_scoped_to_one_call():
    """The routed call sees ours; before and after it, the trainer's method is TRL's again (and so is a second
    trainer's): one process, DeepSpeed, FSDP never meet it."""
    t, other = (
        kto_trainer.KTOTrainer.__new__(kto_trainer.KTOTrainer),
        kto_trainer.KTOTrainer.__new__(kto_trainer.KTOTrainer),
    )
    t.calculate_KL = True
    with kl_logps.chunked(t, TRL_METHOD, KTO):
        assert t._compute_kl_logps.__wrapped__ is TRL_METHOD and "_compute_kl_logps" in vars(t)
        assert other._compute_kl_logps.__func__ is TRL_METHOD
    assert "_compute_kl_logps" not in vars(t) and t._compute_kl_logps.__func__ is TRL_METHOD
    t.calculate_KL = False  # no KL term (e.g. loss_type="apo_zero_unpaired"): nothing to chunk
    with kl_logps.chunked(t, TRL_METHOD, KTO):
        assert "_compute_kl_logps" not in vars(t)
    with kl_logps.chunked(t, None, KTO):  # the record is not applied (disabled, or the shape check failed)
        assert "_compute_kl_logps" not in vars(t)


def test_check_names_what_changed():
    assert kl_logps.check(TRL_METHOD) is None

    def materialises_nothing(self, model, batch):
        return None

    assert "calculate_KL" in kl_logps.check(materialises_nothing)
    assert "not a method taking (model, batch)" in kl_logps.check(lambda self, model: None)

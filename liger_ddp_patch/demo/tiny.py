"""A tiny Qwen3 and a word-level tokenizer, built locally: the demo and the tests never touch a model hub.

Only the standard library at import: the demo's worker and the test probe read this file without importing the
package (which would patch TRL in a run that must stay unpatched).
"""

from __future__ import annotations

from pathlib import Path

REAL_VOCAB = 151_936  # Qwen's vocabulary size: large enough to trip the fused losses' compiled path inside DDP
WORDS = (  # the tokenizer's words: every row below is written with them alone
    "rank question about something a good bad answer from the model is here yes no maybe "
    "one two three four five six seven eight nine ten"
).split()
# The model's sizes (Qwen3Config's names); ``build``'s keywords override them (benchmarks/bench_step.py: a real head).
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             head_dim=16, max_position_embeddings=256)  # fmt: skip


def prompt_rows(rank: int, n: int = 32) -> list[dict]:
    """Preference rows that differ per rank, so unsynchronised gradients are guaranteed to differ."""
    return [
        {
            "prompt": f"rank {WORDS[-10 + rank % 10]} question {WORDS[-10 + i % 10]} about something",
            "chosen": f"a good answer from rank {WORDS[-10 + rank % 10]}",
            "rejected": f"a bad answer from the model {WORDS[-10 + (rank + i) % 10]}",
        }
        for i in range(n)
    ]


def build(
    directory: str | Path,
    vocab_size: int = REAL_VOCAB,
    seed: int = 0,
    tied: bool = False,
    *,
    words: list[str] = WORDS,
    dtype: str = "float32",
    device: str = "cpu",
    **shape: int,
) -> Path:
    """Save a 2-layer Qwen3ForCausalLM and a matching tokenizer (one token per word of ``words``) to ``directory``.

    ``tied``: the LM head shares the input embedding (as in Qwen3-0.6B and Llama-3.2-1B), so one tensor gets both
    gradients: what the loss hands back through the head and what flows into the embedding. ``dtype``: the weights as
    saved (a ``torch`` name); ``device``: where they are drawn (a GPU draws a billion in a moment); ``shape``:
    :data:`SHAPE`'s sizes to change.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    directory = Path(directory)
    specials = ["<pad>", "<eos>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + list(words))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.save_pretrained(directory)

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=max(vocab_size, len(vocab)),
        **{**SHAPE, **shape},
        tie_word_embeddings=tied,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=None,
    )
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(directory)
    return directory

"""A tiny Qwen3 and a word-level tokenizer, built locally: the demo and the tests never touch a model hub."""

from __future__ import annotations

from pathlib import Path

REAL_VOCAB = 151_936  # Qwen's vocabulary size: large enough to trip the fused losses' compiled path inside DDP


def build(directory: str | Path, vocab_size: int = REAL_VOCAB, seed: int = 0, tied: bool = False) -> Path:
    """Save a 2-layer Qwen3ForCausalLM and a matching tokenizer to ``directory`` and return it.

    ``tied``: the LM head shares the input embedding (as in Qwen3-0.6B and Llama-3.2-1B), so one tensor gets both
    gradients: what the loss hands back through the head and what flows into the embedding.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    directory = Path(directory)
    specials = ["<pad>", "<eos>", "<unk>"]
    from .probe import WORDS  # the probe writes the rows; the tokenizer must know every word

    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.save_pretrained(directory)

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=max(vocab_size, len(vocab)),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=None,
    )
    Qwen3ForCausalLM(config).save_pretrained(directory)
    return directory

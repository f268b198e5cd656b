"""Small Hugging Face model directories for the weights tests (need ``transformers``)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_llama(path: Path, hidden: int = 32, tied: bool = False, seed: int = 123) -> Path:
    """A 2-layer LLaMA with its own random weights, saved with ``save_pretrained``."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=48,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path

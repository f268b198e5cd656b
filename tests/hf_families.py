"""Tiny configs of Hugging Face causal-LM families, dropout on (need ``transformers``).

Each family keeps its config's defaults except the sizes, and every dropout probability of the
config that defaults to 0 is set to 0.1 (``classifier``/``summary`` dropouts are not in a causal
LM's forward; ``layerdrop`` skips whole layers at random and stays 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 64
_LLAMA_LIKE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "gpt2": {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64},
    "opt": {
        "hidden_size": 32,
        "ffn_dim": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "word_embed_proj_dim": 32,
    },
    "bloom": {"hidden_size": 32, "n_layer": 4, "n_head": 4},
    "falcon": {
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "new_decoder_architecture": True,
    },
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "gemma": {**_LLAMA_LIKE, "head_dim": 8},
    "phi": {**_LLAMA_LIKE, "num_key_value_heads": 4},
    "stablelm": _LLAMA_LIKE,
    "gpt_neox": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    },
    "gpt_neo": {
        "hidden_size": 32,
        "num_layers": 4,
        "num_heads": 4,
        "attention_types": [[["global", "local"], 2]],
        "max_position_embeddings": 64,
        "window_size": 8,
    },
    "biogpt": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    },
    "xglm": {
        "d_model": 32,
        "ffn_dim": 64,
        "num_layers": 4,
        "attention_heads": 4,
        "max_position_embeddings": 64,
    },
    "gpt_bigcode": {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64},
    "codegen": {"n_embd": 32, "n_layer": 4, "n_head": 4, "n_positions": 64, "rotary_dim": 4},
}
"""Family (``model_type``) -> the config arguments that make it tiny."""

_NOT_IN_FORWARD = ("classifier", "summary", "layerdrop")


def dropout_on(config: Any, p: float = 0.1) -> list[str]:
    """Set every dropout probability of ``config`` that is 0 to ``p``; the names it set."""
    names = []
    for name, value in config.to_dict().items():
        if (
            isinstance(value, float)
            and value == 0.0
            and ("drop" in name)
            and not any(skip in name for skip in _NOT_IN_FORWARD)
        ):
            setattr(config, name, p)
            names.append(name)
    return names


def save_family(family: str, path: Path, seed: int = 0) -> Path:
    """The tiny ``family`` model with dropout on, saved with ``save_pretrained`` in ``path``."""
    import transformers as tf

    config = tf.AutoConfig.for_model(family, vocab_size=VOCAB, **FAMILIES[family])
    dropout_on(config)
    torch.manual_seed(seed)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path

"""Where a :class:`~dapple.profiler.analytic_models.TransformerSpec` comes from: named presets,
a Hugging Face ``config.json``, the zoo transformer's arguments.

Pure, no torch. Each preset (:data:`PRESETS`) is built from its published configuration (the
comments name the source; the mixtures of experts' are in
:data:`~dapple.profiler.analytic_moe_models.MOE_SHAPES`), and :data:`PUBLISHED_PARAMETERS`
keeps the parameter counts their publishers print, to check the specs against.
:func:`from_hf_config` reads a Hugging Face config (``hf:DIR``), :func:`zoo_transformer` the zoo
``transformer``'s arguments; :func:`resolve_spec` takes any of the three by name.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from dapple.errors import ValidationError
from dapple.profiler.analytic_models import TransformerSpec
from dapple.profiler.analytic_moe_models import MOE_PUBLISHED, MOE_SHAPES, mla_from_hf, moe_from_hf

__all__ = [
    "PRESETS",
    "PUBLISHED_ACTIVE_PARAMETERS",
    "PUBLISHED_PARAMETERS",
    "from_hf_config",
    "llama_ffn",
    "resolve_spec",
    "zoo_transformer",
]


def llama_ffn(hidden: int, multiplier: float | None, multiple_of: int) -> int:
    """Feed-forward width of Meta's Llama code (``FeedForward`` in ``model.py``, torchtitan's
    ``TransformerModelArgs``): ``2/3 * 4h``, times ``ffn_dim_multiplier``, rounded up to a
    multiple of ``multiple_of``."""
    f = int(2 * 4 * hidden / 3)
    if multiplier is not None:
        f = int(multiplier * f)
    return multiple_of * math.ceil(f / multiple_of)


def _llama(
    name: str, h: int, layers: int, heads: int, kv: int, f: int, vocab: int, seq: int
) -> TransformerSpec:
    return TransformerSpec(
        name=name, hidden=h, layers=layers, heads=heads, kv_heads=kv, ffn=f, vocab=vocab, seq=seq
    )


def _gpt(
    name: str, h: int, layers: int, heads: int, vocab: int, seq: int, *, dropout: bool = True
) -> TransformerSpec:
    return TransformerSpec(
        name=name,
        hidden=h,
        layers=layers,
        heads=heads,
        ffn=4 * h,
        vocab=vocab,
        seq=seq,
        mlp="gelu",
        norm="layernorm",
        linear_bias=True,
        learned_positions=True,
        tied_embeddings=True,
        dropout=dropout,
    )


_L3_VOCAB = 128256
PRESETS: dict[str, TransformerSpec] = {
    # Llama 3 / 3.1: torchtitan torchtitan/models/llama/__init__.py (llama3_configs: dim,
    # n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of), vocabulary 128,256 (the
    # Llama 3 tokenizer), context 8,192 (torchtitan's training seq_len). 3.1 has the 3 shapes.
    "llama3-8b": _llama("llama3-8b", 4096, 32, 32, 8, llama_ffn(4096, 1.3, 1024), _L3_VOCAB, 8192),
    "llama3-70b": _llama(
        "llama3-70b", 8192, 80, 64, 8, llama_ffn(8192, 1.3, 4096), _L3_VOCAB, 8192
    ),
    "llama3.1-8b": _llama(
        "llama3.1-8b", 4096, 32, 32, 8, llama_ffn(4096, 1.3, 1024), _L3_VOCAB, 8192
    ),
    "llama3.1-70b": _llama(
        "llama3.1-70b", 8192, 80, 64, 8, llama_ffn(8192, 1.3, 4096), _L3_VOCAB, 8192
    ),
    "llama3.1-405b": _llama(
        "llama3.1-405b", 16384, 126, 128, 8, llama_ffn(16384, 1.2, 4096), _L3_VOCAB, 8192
    ),
    # Llama 2: torchtitan's llama2_configs (multiple_of 256 by default; 70B: 1.3 and 4096),
    # vocabulary 32,000, context 4,096.
    "llama2-7b": _llama("llama2-7b", 4096, 32, 32, 32, llama_ffn(4096, None, 256), 32000, 4096),
    "llama2-13b": _llama("llama2-13b", 5120, 40, 40, 40, llama_ffn(5120, None, 256), 32000, 4096),
    "llama2-70b": _llama("llama2-70b", 8192, 80, 64, 8, llama_ffn(8192, 1.3, 4096), 32000, 4096),
    # GPT-3 175B: Brown et al. 2020, table 2.1 (96 layers, d_model 12288, 96 heads, context
    # 2048); GPT-2 BPE vocabulary 50,257 padded to 50,304 (Megatron: multiple of 128).
    "gpt3-175b": _gpt("gpt3-175b", 12288, 96, 96, 50304, 2048),
    # NeMo's GPT-3 5B: NVIDIA/NeMo-Framework-Launcher launcher_scripts/conf/training/gpt3/5b.yaml.
    "gpt3-5b": _gpt("gpt3-5b", 4096, 24, 32, 50304, 2048),
    # NeMo's GPT-3 20B: the same repository's launcher_scripts/conf/training/gpt3/20b.yaml.
    "gpt3-20b": _gpt("gpt3-20b", 6144, 44, 48, 50304, 2048),
    # Megatron-LM's 1.2B GPT-2 (nv-adlr.github.io _projects/megatron-lm.md, table 1, config 1;
    # vocabulary padded to 51,200, context 1,024).
    "megatron-gpt2-1.2b": _gpt("megatron-gpt2-1.2b", 1536, 40, 16, 51200, 1024),
    # The DAPPLE paper's BERT-48 (table 1; BERT-large widths, 48 layers) fine-tuned on SQuAD:
    # sequence 512, WordPiece vocabulary 30,522, span head (2 outputs), fp32, dropout 0.1.
    "paper-bert-48": TransformerSpec(
        name="paper-bert-48",
        hidden=1024,
        layers=48,
        heads=16,
        ffn=4096,
        vocab=30522,
        seq=512,
        mlp="gelu",
        norm="layernorm",
        linear_bias=True,
        learned_positions=True,
        token_types=2,
        embedding_norm=True,
        final_norm=False,
        head_outputs=2,
        head_bias=True,
        causal=False,
        dropout=True,
    ),
    **{name: TransformerSpec(name=name, **shape) for name, shape in MOE_SHAPES.items()},
}
"""Named model presets, each from its published configuration (comments give the source; the
mixtures of experts' are in :data:`~dapple.profiler.analytic_moe_models.MOE_SHAPES`)."""

PUBLISHED_PARAMETERS: dict[str, str] = {
    "llama3-8b": "8.03B",
    "llama3-70b": "70.6B",
    "llama3.1-8b": "8.03B",
    "llama3.1-70b": "70.6B",
    "llama3.1-405b": "405B",
    "llama2-7b": "6.74B",
    "llama2-13b": "13.0B",
    "llama2-70b": "69.0B",
    "gpt3-175b": "175.0B",
    "gpt3-5b": "5B",
    "gpt3-20b": "20B",
    "megatron-gpt2-1.2b": "1.2B",
    "paper-bert-48": "640M",
    **{name: total for name, (total, _) in MOE_PUBLISHED.items()},
}
"""Parameter counts as their publishers print them, to the printed precision (Meta's model
cards and the Hugging Face hub for Llama; Brown et al. table 2.1; NeMo's config name;
nv-adlr's table 1; the DAPPLE paper's table 1; Mistral AI's Mixtral announcement, the Qwen
model cards and the DeepSeek-V3 technical report for the mixtures of experts)."""

PUBLISHED_ACTIVE_PARAMETERS: dict[str, str] = {
    name: active for name, (_, active) in MOE_PUBLISHED.items()
}
"""Parameters active per token of the mixtures of experts, as their publishers print them
(:meth:`TransformerSpec.active_parameters`)."""


def zoo_transformer(
    layers: int = 6,
    hidden: int = 64,
    heads: int = 4,
    seq: int = 32,
    vocab: int = 256,
    ffn: int | None = None,
    name: str = "transformer",
    **_ignored: Any,
) -> TransformerSpec:
    """The shapes of :func:`dapple.models.zoo.transformer.transformer` with the same arguments
    (pre-LN GPT blocks, learned positions, biases, an untied LM head with bias, no dropout)."""
    return TransformerSpec(
        name=name,
        hidden=hidden,
        layers=layers,
        heads=heads,
        ffn=ffn or 4 * hidden,
        vocab=vocab,
        seq=seq,
        mlp="gelu",
        norm="layernorm",
        linear_bias=True,
        learned_positions=True,
        head_bias=True,
    )


_ZOO = {
    "transformer": {},
    "bert-48": {
        "layers": 48,
        "hidden": 1024,
        "heads": 16,
        "seq": 512,
        "vocab": 30522,
        "name": "bert-48",
    },
}
"""Zoo names whose model is :func:`zoo_transformer` (with the zoo loader's defaults)."""

_LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", "granite", "olmo2", "mixtral", "qwen2_moe",
                "deepseek_v3")  # fmt: skip


def from_hf_config(
    config: dict[str, Any], name: str = "hf", seq: int | None = None
) -> TransformerSpec:
    """A spec from the fields of a Hugging Face ``config.json``.

    Llama-family types (``llama``, ``mistral``, ``qwen2``, ...), their mixtures of experts
    (``mixtral``, ``qwen2_moe``, ``deepseek_v3``), ``gpt2`` and ``bert`` are read.

    Args:
        config: the parsed ``config.json``.
        name: the spec's name.
        seq: tokens per sample; None: ``max_position_embeddings`` (``n_positions`` for GPT-2),
            at most 8,192.

    Raises:
        ValidationError: an unsupported ``model_type`` or a missing field.
    """
    kind = config.get("model_type", "")

    def get(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if config.get(k) is not None:
                return config[k]
        if default is None:
            raise ValidationError(f"hf config {name!r}: none of {list(keys)} is set")
        return default

    if kind in _LLAMA_TYPES:
        positions = int(get("max_position_embeddings", default=4096))
        return TransformerSpec(
            name=name,
            hidden=int(get("hidden_size")),
            layers=int(get("num_hidden_layers")),
            heads=int(get("num_attention_heads")),
            kv_heads=int(get("num_key_value_heads", "num_attention_heads")),
            head_dim=config.get("head_dim"),
            ffn=int(get("intermediate_size")),
            vocab=int(get("vocab_size")),
            seq=seq or min(positions, 8192),
            qkv_bias=bool(config.get("attention_bias", kind in ("qwen2", "qwen2_moe"))),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            moe=moe_from_hf(config, kind, name),
            mla=mla_from_hf(config, kind, name),
        )
    if kind == "gpt2":
        h = int(get("n_embd"))
        positions = int(get("n_positions", default=1024))
        spec = _gpt(
            name,
            h,
            int(get("n_layer")),
            int(get("n_head")),
            int(get("vocab_size")),
            seq or positions,
        )
        return dataclasses.replace(
            spec, ffn=int(config.get("n_inner") or 4 * h), max_positions=positions
        )
    if kind == "bert":
        positions = int(get("max_position_embeddings", default=512))
        return dataclasses.replace(
            PRESETS["paper-bert-48"],
            name=name,
            hidden=int(get("hidden_size")),
            layers=int(get("num_hidden_layers")),
            heads=int(get("num_attention_heads")),
            ffn=int(get("intermediate_size")),
            vocab=int(get("vocab_size")),
            seq=seq or positions,
            max_positions=positions,
            token_types=int(config.get("type_vocab_size", 2)),
        )
    raise ValidationError(
        f"hf config {name!r}: model_type {kind!r} is not supported by the analytic profiler; "
        f"supported: {', '.join((*_LLAMA_TYPES, 'gpt2', 'bert'))}"
    )


def resolve_spec(
    spec: str | TransformerSpec, seq_len: int | None = None, **overrides: Any
) -> TransformerSpec:
    """A :class:`TransformerSpec` from a preset name, ``hf:DIR`` or a zoo transformer name.

    Args:
        spec: a :data:`PRESETS` name, ``hf:DIR`` (reads ``DIR/config.json``), ``transformer``
            or ``bert-48`` (the zoo's, with ``overrides`` as its factory arguments), or a spec.
        seq_len: tokens per sample instead of the spec's own.
        overrides: zoo factory arguments (``layers=8``, ``seq=64``, ...); only for zoo names,
            but ``seq`` (tokens per sample, as ``seq_len``) for ``hf:DIR`` too.

    Raises:
        ValidationError: unknown name, unreadable config, or overrides for a non-zoo spec.
    """
    if isinstance(spec, TransformerSpec):
        out = spec
    elif spec in _ZOO:
        out = zoo_transformer(**{**_ZOO[spec], **overrides})
        overrides = {}
    elif spec.startswith("hf:"):
        overrides = dict(overrides)
        if "seq" in overrides:  # as --set seq= sets a measured Hugging Face profile's length
            if seq_len is None:
                seq_len = int(overrides["seq"])
            elif int(overrides["seq"]) != seq_len:
                raise ValidationError(
                    f"two lengths for {spec!r}: seq={overrides['seq']} and {seq_len} tokens"
                )
            del overrides["seq"]
        path = Path(spec[3:]) / "config.json"
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValidationError(f"cannot read the Hugging Face config {path}: {e}") from e
        out = from_hf_config(config, name=Path(spec[3:]).name or "hf", seq=seq_len)
    elif spec in PRESETS:
        out = PRESETS[spec]
    else:
        raise ValidationError(
            f"unknown analytic model {spec!r}; give hf:DIR, a zoo transformer "
            f"({', '.join(_ZOO)}) or a preset: {', '.join(PRESETS)}"
        )
    if overrides:
        raise ValidationError(
            f"model arguments {sorted(overrides)} apply to zoo transformers only, not to {spec!r}"
        )
    return out if seq_len is None or seq_len == out.seq else out.with_seq(seq_len)

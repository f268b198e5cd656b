"""Activation and parameter bytes of a Llama-family model as dapple's runtime holds them: eager
PyTorch under ``torch.autocast`` (bf16/fp16) over fp32 master weights.

:func:`~dapple.profiler.analytic.analytic_profile` counts every activation in the compute
precision (2 bytes in bf16), as a model whose weights are 16-bit (Megatron-LM, torchtitan) keeps
them. dapple's runtime (:mod:`dapple.runtime.precision`) and a plain Hugging Face loop with
``torch.autocast`` keep fp32 weights, and then the embedding lookup (not an autocast op) returns
fp32, so the residual stream, the RMSNorms' inputs and outputs and every residual add are fp32,
and autocast casts each projection's input separately (one 16-bit copy per ``nn.Linear``).
:func:`autocast_profile` replaces the analytic profile's kept, output and cast bytes with that
accounting. Counted from the tensors autograd saves in a Hugging Face ``LlamaDecoderLayer`` as
dapple traces it (``torch.export``: the causal mask is materialised, so SDPA gets a mask and
``repeat_kv`` expands K and V to all heads), checked on this machine's CPU with
``saved_tensors_hooks`` (``benchmarks/gpu_memory_fit.py``, ``tests/test_memory_realistic.py``).

Per sample of s tokens (h hidden, a query heads of width d, f feed-forward width, e = 2 bytes
per 16-bit element):

* ``embedding``: the token ids (8 s, int64); output the fp32 hidden state ``4 s h``.
* a block: its fp32 input ``4 s h`` (saved by the first RMSNorm's ``pow``/``mul``), each
  RMSNorm's fp32 ``rsqrt`` (``4 s``) and normalised fp32 tensor (``4 s h``, saved by the weight
  multiply), the middle residual ``4 s h``; the 16-bit input copies of q, k, v (``3 e s h``)
  and of gate, up (``2 e s h``); SDPA's q, K and V expanded to a heads, its output (``4 e s a
  d``), log-sum-exp (``4 a s``) and the 16-bit additive mask (``e s^2``); SwiGLU's gate, up,
  SiLU output and product (``4 e s f``). The rotary tables (``(1, s, d)`` fp32, per call) are
  left out. Output ``4 s h``.
* ``lm_head``: the final RMSNorm's fp32 input, ``rsqrt`` and normalised tensor and the head's
  16-bit input copy: ``8 s h + 4 s + e s h``. The loss (fp32 logits, log-softmax) is the
  runtime's, outside the layer: :mod:`dapple.cost.peak_memory` adds it on the last stage.

Cast parameters (autocast's weight cache): every projection's weight and bias; not the
embedding table (a lookup) nor the norm weights (an element-wise multiply).
"""

from __future__ import annotations

import dataclasses

from dapple.core.precision import TRAINING_PRECISIONS, precision_of
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.profiler.analytic_models import TransformerSpec

__all__ = [
    "autocast_block_kept_bytes",
    "autocast_head_kept_bytes",
    "autocast_profile",
    "cast_parameters",
]


def autocast_block_kept_bytes(spec: TransformerSpec, precision: str = "bf16") -> float:
    """Kept bytes per sample of one Llama block under autocast over fp32 weights (module
    docstring): ``4 (3 s h + 2 s) + e (5 s h + 4 s a d + s^2 + 4 s f) + 4 a s``."""
    e = _element_bytes(precision)
    s, h, f = float(spec.seq), spec.hidden, spec.ffn
    q_w = spec.heads * spec.d_head
    fp32 = 4 * (3 * s * h + 2 * s)  # block input, two normalised tensors; two rsqrt
    fp32 += 4 * s * h  # the middle residual (the second norm's input)
    casts = e * 5 * s * h  # q, k, v, gate, up inputs
    attention = e * 4 * s * q_w + 4 * spec.heads * s + e * s * s  # q, K, V, out; lse; mask
    mlp = e * 4 * s * f  # gate, up, silu(gate), product
    return fp32 + casts + attention + mlp


def autocast_head_kept_bytes(spec: TransformerSpec, precision: str = "bf16") -> float:
    """Kept bytes per sample of the final RMSNorm and the head's projection (no loss):
    ``8 s h + 4 s + e s h``."""
    e = _element_bytes(precision)
    s, h = float(spec.seq), spec.hidden
    return 8 * s * h + 4 * s + e * s * h


def cast_parameters(spec: TransformerSpec, layer: str) -> int:
    """Parameters of ``layer`` (``embedding``, ``block<i>``, ``lm_head``) that autocast casts:
    the projections' weights and biases, not tables or norm weights."""
    norm = spec.hidden * (2 if spec.norm == "layernorm" else 1)
    if layer == "embedding":
        return 0
    if layer.startswith("block"):
        return spec.block_parameters() - 2 * norm
    if layer == "lm_head":
        return spec.head_parameters() - (norm if spec.final_norm else 0)
    raise ValidationError(f"unknown analytic layer {layer!r}: embedding, block<i> or lm_head")


def autocast_profile(profile: ModelProfile, spec: TransformerSpec) -> ModelProfile:
    """``profile`` (an unfolded analytic profile of ``spec``, bf16 or fp16) with the kept,
    output and cast bytes of the runtime's autocast over fp32 weights (module docstring).

    Raises:
        ValidationError: a model that is not a Llama-family decoder (SwiGLU, RMSNorm, rotary),
            a precision without autocast, or a profile whose layers are not ``embedding``,
            ``block<i>``..., ``lm_head``.
    """
    if spec.mlp != "swiglu" or spec.norm != "rmsnorm" or spec.learned_positions:
        raise ValidationError(
            f"autocast bytes are counted for Llama-family decoders (SwiGLU, RMSNorm, rotary), "
            f"not {spec.name!r} (mlp {spec.mlp}, norm {spec.norm})"
        )
    _element_bytes(profile.precision)
    names = [layer.name for layer in profile.layers]
    want = ["embedding", *(f"block{i}" for i in range(spec.layers)), "lm_head"]
    if names != want:
        raise ValidationError(f"expected the layers {want[:3]}...{want[-1:]}, got {names}")
    s, h = float(spec.seq), spec.hidden
    kept = {"embedding": 8 * s, "lm_head": autocast_head_kept_bytes(spec, profile.precision)}
    block = autocast_block_kept_bytes(spec, profile.precision)
    layers = []
    for layer in profile.layers:
        head = layer.name == "lm_head"
        layers.append(
            dataclasses.replace(
                layer,
                kept_activation_bytes_per_sample=kept.get(layer.name, block),
                output_bytes_per_sample=layer.output_bytes_per_sample if head else 4 * s * h,
                cast_parameter_bytes=4 * cast_parameters(spec, layer.name),
            )
        )
    return dataclasses.replace(profile, layers=tuple(layers), memory_at=None)


def _element_bytes(precision: str) -> int:
    """Bytes of an autocast element of ``precision`` (bf16 or fp16)."""
    if precision not in TRAINING_PRECISIONS or not precision_of(precision).autocast:
        raise ValidationError(f"autocast bytes need precision bf16 or fp16, got {precision!r}")
    return precision_of(precision).element_bytes

"""torchtitan's activation checkpointing policies on an analytic profile (``published.py``).

The analytic profiler (:mod:`dapple.profiler.analytic_ops`) knows ``none``, ``selective``
(Korthikanti et al.: eager attention's core; nothing under flash attention) and ``full``.
torchtitan's two other policies (``torchtitan/models/llama/parallelize_llama.py``,
``_apply_ac_to_transformer_block``) are built here from the same ops:

* ``selective-layer`` (``selective_ac_option = "2"``): every second block is checkpointed in
  full (torchtitan counts wrapped blocks from 1 and wraps those with ``count % 2 == 0``:
  blocks 1, 3, 5, ... counted from 0); the others keep everything.
* ``selective-op``: inside each block the outputs of ``mm`` and the attention kernel are
  saved, except every second ``mm``; everything else is recomputed in the backward. A Llama
  block's ``mm`` run ``wq wk wv`` (the profile's ``qkv``), ``wo``, ``w1 w3`` (``gate_up``),
  ``w2``: saved are ``q``, ``v``, the attention's output and log-sum-exp, ``w1`` and ``w2``'s
  outputs, and the block input; recomputed are the two norms, ``wk``, rotary, ``wo`` and the
  first residual add, ``w3`` and SiLU x mul (what the backward needs of them).

Pure, no torch. Times use :func:`dapple.profiler.analytic.layer_time_ms`, fitted affine in the
batch size like the profiler's own layers.
"""

from __future__ import annotations

import dataclasses

from dapple.core.layer_profile import AffineTime, LayerProfile, fit_affine
from dapple.core.precision import precision_of
from dapple.core.profile import ModelProfile
from dapple.profiler.analytic import layer_time_ms
from dapple.profiler.analytic_devices import DeviceSpec, Efficiency
from dapple.profiler.analytic_models import TransformerSpec
from dapple.profiler.analytic_ops import LayerCost, Op, block_ops

__all__ = ["TORCHTITAN_POLICIES", "apply_policy", "selective_op_cost"]

TORCHTITAN_POLICIES = ("selective-op", "selective-layer")
"""The row checkpoint modes this module builds."""

_RECOMPUTED_WHOLE = ("attention_norm", "rotary", "attention_out", "attention_residual",
                     "mlp_norm", "silu_mul")  # fmt: skip
"""Ops of a Llama block the ``op`` policy re-runs whole in the backward."""


def _scaled(op: Op, share: float) -> Op:
    """The forward of ``share`` of ``op`` (one of the GEMMs a merged linear holds)."""
    return dataclasses.replace(
        op,
        fwd_flops=op.fwd_flops * share,
        fwd_bytes=op.fwd_bytes * share,
        fwd_bytes_per_call=op.fwd_bytes_per_call * share,
    )


def selective_op_cost(spec: TransformerSpec, precision: str, block: LayerCost) -> LayerCost:
    """``block`` (profiled with no checkpointing) under torchtitan's ``op`` policy: kept
    activations and the recomputed forward ops of the module docstring.

    Raises:
        ValueError: the model is not a Llama (SwiGLU, rotary, flash attention) block.
    """
    names = {op.name for op in block.ops}
    if spec.mlp != "swiglu" or "attention" not in names or "rotary" not in names:
        raise ValueError(f"{spec.name}: the op policy is modelled for Llama blocks only")
    e, s, h, f = precision_of(precision).element_bytes, float(spec.seq), spec.hidden, spec.ffn
    q_w, kv_w = spec.heads * spec.d_head, spec.n_kv_heads * spec.d_head
    lse = spec.heads * s * 4.0
    kept = s * e * (h + q_w + kv_w + q_w + f + h) + lse
    recomputed = []
    for op in block.ops:
        if op.name in _RECOMPUTED_WHOLE:
            recomputed.append(op)
        elif op.name == "qkv":  # wk of wq wk wv
            recomputed.append(_scaled(op, kv_w / (q_w + 2 * kv_w)))
        elif op.name == "gate_up":  # w3 of w1 w3
            recomputed.append(_scaled(op, 0.5))
    return dataclasses.replace(block, kept_bytes_per_sample=kept, recomputed=tuple(recomputed))


def apply_policy(
    policy: str,
    profile: ModelProfile,
    full: ModelProfile,
    spec: TransformerSpec,
    precision: str,
    device: DeviceSpec,
    efficiency: Efficiency,
) -> ModelProfile:
    """``profile`` (no checkpointing) with torchtitan's ``policy`` on its blocks.

    Args:
        policy: one of :data:`TORCHTITAN_POLICIES`.
        profile: the analytic profile with ``recompute="none"`` (layers ``embedding``,
            ``block<i>``, ``lm_head``; not folded).
        full: the same profile with ``recompute="full"`` (the ``layer`` policy's blocks).
        spec, precision, device, efficiency: what ``profile`` was built from.

    Raises:
        ValueError: an unknown policy.
    """
    if policy not in TORCHTITAN_POLICIES:
        raise ValueError(f"checkpoint policy must be one of {TORCHTITAN_POLICIES}, got {policy!r}")
    layers = list(profile.layers)
    if policy == "selective-layer":
        for i, layer in enumerate(layers):
            if layer.name.startswith("block") and int(layer.name[5:]) % 2 == 1:
                layers[i] = full.layers[i]
        return dataclasses.replace(profile, layers=tuple(layers))
    e = precision_of(precision).element_bytes
    block = selective_op_cost(spec, precision, _block_cost(spec, e))
    sizes = profile.batch_sizes
    backward = fit_affine(
        sizes, [layer_time_ms(block, b, device, precision, efficiency)[1] for b in sizes]
    )
    for i, layer in enumerate(layers):
        if layer.name.startswith("block"):
            layers[i] = _with(layer, backward, block.kept_bytes_per_sample)
    return dataclasses.replace(profile, layers=tuple(layers))


def _block_cost(spec: TransformerSpec, e: int) -> LayerCost:
    """One block's ops, no checkpointing (as :func:`dapple.profiler.analytic_ops.layer_costs`
    builds it; parameters and output are not read here)."""
    ops = block_ops(spec, float(spec.seq), e, "flash")
    return LayerCost(
        name="block",
        ops=tuple(ops),
        parameters=spec.block_parameters(),
        output_bytes_per_sample=float(spec.seq * spec.hidden * e),
        kept_bytes_per_sample=sum(op.kept_bytes for op in ops),
    )


def _with(layer: LayerProfile, backward: AffineTime, kept: float) -> LayerProfile:
    return dataclasses.replace(layer, backward=backward, kept_activation_bytes_per_sample=kept)

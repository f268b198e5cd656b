"""Analytic layer profiles of transformers: FLOPs and bytes per operation, timed by a roofline.

Builds the :class:`~dapple.core.profile.ModelProfile` the planner and simulator take, without
running the model, from its shapes (:class:`~dapple.profiler.analytic_models.TransformerSpec`)
and a device's datasheet (:mod:`dapple.profiler.analytic_devices`). Pure, no torch: it works for
models far too large for this machine.

The layers and their operations (FLOPs, bytes, kept activations) are counted by
:mod:`dapple.profiler.analytic_ops`: ``embedding``, one ``block<i>`` per block, ``lm_head``.

An op takes ``max(FLOPs / (efficiency x peak), bytes / (efficiency x bandwidth))`` plus
:data:`~dapple.profiler.analytic_devices.KERNEL_GAP_US` per kernel: a roofline with one
efficiency per operation class and device (:class:`~dapple.profiler.analytic_devices.Efficiency`).
Forward and backward times are summed over a layer's ops at each batch size of the profile and
fitted affine in the batch size (:func:`~dapple.core.layer_profile.fit_affine`), as measured
profiles are.

Transformer blocks are marked shardable (``LayerProfile.tensor_parallel``: Megatron's column- and
row-parallel attention and MLP); the embedding and the head are not. A block with a mixture of
experts also carries its :class:`~dapple.core.moe_profile.MoEProfile`
(:func:`~dapple.profiler.analytic_moe_ops.moe_record`): the FLOPs of its k active experts per
token, the parameters of all E.

Parameters are counted in fp32 bytes (4 per parameter: master weights), as dapple's memory
model expects; the optimizer update time ``U`` is AdamW's 28 bytes moved per parameter (30 with
a 16-bit copy) at the memory efficiency.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dapple.core.attention import CAUSAL, MASKED, check_attention
from dapple.core.layer_profile import LayerProfile, fit_affine
from dapple.core.precision import ANALYTIC_PRECISIONS, precision_of
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError, positive_integers
from dapple.profiler.analytic_devices import (
    FITTED,
    DeviceSpec,
    Efficiency,
    fitted_efficiency,
    get_device,
)
from dapple.profiler.analytic_models import TransformerSpec, spec_fingerprint
from dapple.profiler.analytic_moe_ops import moe_record
from dapple.profiler.analytic_ops import (
    LayerCost,
    Op,
    block_ops,
    layer_costs,
    linear_op,
)
from dapple.profiler.analytic_presets import resolve_spec

__all__ = [
    "MAX_BATCH_SIZE",
    "LayerCost",
    "Op",
    "analytic_profile",
    "block_ops",
    "layer_costs",
    "layer_time_ms",
    "linear_op",
    "op_efficiencies",
]

MAX_BATCH_SIZE = 2**20
"""The largest batch size the analytic profiler fits its times over (1,048,576 samples on one
device)."""

_ADAM_BYTES_PER_PARAMETER = 28.0
"""AdamW over fp32 master weights: reads parameter, gradient and both moments, writes the
parameter and the moments."""


# -- time -------------------------------------------------------------------------------------


_EMBEDDING_OPS = frozenset({"token_embedding", "position_embedding", "token_type_embedding"})
"""Ops timed at :attr:`Efficiency.embedding` (lookups, the dense table gradient)."""


def op_efficiencies(op: Op, eff: Efficiency) -> tuple[float, float]:
    """``(compute, memory)`` efficiencies of ``op``: its class's (:class:`Efficiency`), the
    finer classes (eager attention's core, the LM head, unaligned GEMMs, embeddings) where set."""
    if op.core and eff.eager_attention is not None:
        return eff.eager_attention, eff.eager_attention
    compute = eff.matmul if op.kind == "matmul" else eff.attention
    if op.kind == "matmul" and not op.aligned and eff.unaligned is not None:
        compute = eff.unaligned
    elif op.kind == "matmul" and op.name == "head" and eff.head is not None:
        compute = eff.head
    memory = eff.memory
    if op.name in _EMBEDDING_OPS and eff.embedding is not None:
        memory = eff.embedding
    return compute, memory


def _op_ms(op: Op, b: float, dev: DeviceSpec, precision: str, eff: Efficiency, fwd: bool) -> float:
    flops = (op.fwd_flops if fwd else op.bwd_flops) * b
    nbytes = (op.fwd_bytes if fwd else op.bwd_bytes) * b
    nbytes += op.fwd_bytes_per_call if fwd else op.bwd_bytes_per_call
    c_eff, m_eff = op_efficiencies(op, eff)
    if op.kind == "matmul":
        p = precision if op.weight_gemm else precision_of(precision).tensor_precision.value
        compute = flops / (c_eff * dev.matmul_peak(p))
    elif op.kind == "attention":
        compute = flops / (c_eff * dev.attention_peak(precision))
    else:
        compute = 0.0
    memory = nbytes / (m_eff * dev.hbm_bytes_per_s)
    kernels = op.kernels[0] if fwd else op.kernels[1]
    return (max(compute, memory) + kernels * eff.kernel_gap_us * 1e-6) * 1e3


def layer_time_ms(
    layer: LayerCost, b: float, device: DeviceSpec, precision: str, efficiency: Efficiency
) -> tuple[float, float]:
    """Roofline ``(forward_ms, backward_ms)`` of one call of ``layer`` on ``b`` samples; the
    backward includes the recomputed forward ops."""
    f = sum(_op_ms(op, b, device, precision, efficiency, True) for op in layer.ops)
    bw = sum(_op_ms(op, b, device, precision, efficiency, False) for op in layer.ops)
    bw += sum(_op_ms(op, b, device, precision, efficiency, True) for op in layer.recomputed)
    return f, bw


HF_ATTENTION = {MASKED: "masked", CAUSAL: "flash"}
"""A traced Hugging Face causal LM's ``attention`` (:mod:`dapple.core.attention`) -> the attention
it times: SDPA given the mask, or SDPA's causal kernel."""


def _hf_attention(mode: Any, given: str | None) -> str:
    """The attention timed for ``--set attention=mode`` of an ``hf:DIR`` model.

    Raises:
        ValidationError: an unknown mode, or ``given`` (the ``attention`` argument) another."""
    check_attention(mode)
    impl = HF_ATTENTION[mode]
    if given is not None and given != impl:
        raise ValidationError(
            f"two attentions: the model's attention={mode} runs {impl!r}, attention={given!r}"
        )
    return impl


def analytic_profile(
    model: str | TransformerSpec,
    device: str | DeviceSpec = "h100",
    *,
    precision: str = "bf16",
    seq_len: int | None = None,
    recompute: str = "none",
    attention: str | None = None,
    batch_sizes: Sequence[int] = (1, 2, 4, 8),
    efficiency: Efficiency | None = None,
    kernels: str | None = None,
    fold_ends: bool = False,
    overrides: Mapping[str, Any] | None = None,
) -> ModelProfile:
    """A layer profile of ``model`` on ``device`` from its shapes (``dapple profile --analytic``).

    Args:
        model: a preset name (``llama3-8b``, ``gpt3-175b``, ...), ``hf:DIR``, a zoo
            transformer name (``transformer``, ``bert-48``) or a :class:`TransformerSpec`.
        device: ``h200``, ``h100``, ``a100``, ``v100`` or a :class:`DeviceSpec`.
        precision: ``fp32``, ``bf16``, ``fp16`` or ``fp8`` (weight GEMMs in fp8).
        seq_len: tokens per sample instead of the model's own.
        recompute: ``none``, ``selective`` or ``full``: what the blocks re-compute in the
            backward (activation checkpointing).
        attention: ``flash``, ``eager`` or ``masked`` (SDPA given a mask); None: eager in
            fp32, masked under ``kernels="eager"``, flash otherwise.
        batch_sizes: batch sizes the affine times are fitted over.
        efficiency: the roofline's efficiencies instead of the device's for ``precision``.
        kernels: ``eager`` (autocast's weight casts counted) or ``fused``: the efficiencies
            fitted on measured layers for that kernel setting
            (:func:`~dapple.profiler.analytic_devices.fitted_efficiency`); with ``efficiency``
            only the casts follow it. None: the device's ``default_kernels`` where fitted for
            ``precision`` (``h200``: eager), else the device's efficiencies without casts.
        fold_ends: merge the embedding into the first block and the head into the last.
        overrides: zoo transformer arguments (``layers``, ``hidden``, ...), zoo names only;
            for ``hf:DIR`` ``seq`` and ``attention`` (the traced model's, ``masked`` or
            ``causal``: timed as ``masked`` or ``flash``, :data:`HF_ATTENTION`).

    Raises:
        ValidationError: unknown model, device, precision (or one the device lacks), mode;
            a length, size or batch size past the limits (:data:`MAX_BATCH_SIZE`,
            :data:`~dapple.profiler.analytic_models.MAX_SEQ`,
            :data:`~dapple.profiler.analytic_models.MAX_PARAMETERS`).
    """
    overrides = dict(overrides or {})
    if isinstance(model, str) and model.startswith("hf:") and "attention" in overrides:
        attention = _hf_attention(overrides.pop("attention"), attention)
    spec = resolve_spec(model, seq_len, **overrides)
    dev = device if isinstance(device, DeviceSpec) else get_device(device)
    if precision not in ANALYTIC_PRECISIONS:
        raise ValidationError(
            f"precision must be one of {', '.join(ANALYTIC_PRECISIONS)}, got {precision!r}"
        )
    kernels, eff = _efficiency(dev, precision, kernels, efficiency)
    sizes = _batch_sizes(batch_sizes)
    prec = precision_of(precision)
    eager = kernels == "eager" and prec.autocast
    if eager and attention is None:
        attention = "masked"  # dapple's traced HF models: SDPA given the causal mask
    costs = _tied_once(layer_costs(
        spec, precision, attention=attention, recompute=recompute, fold_ends=fold_ends,
        autocast=eager,
    ))  # fmt: skip
    holders = [i for i, c in enumerate(costs) if c.tied_parameters]
    layers = [
        _layer_profile(c, i, holders, spec, sizes, dev, precision, eff) for i, c in enumerate(costs)
    ]
    return ModelProfile(
        model_name=spec.name,
        layers=tuple(layers),
        input_bytes_per_sample=8.0 * spec.seq,
        dtype=prec.dtype_name,
        device=f"{dev.label} (analytic, {precision}{f', {kernels} kernels' if kernels else ''})",
        batch_sizes=tuple(sizes),
        optimizer_state_factor=3.0,
        update_ms_per_parameter_byte=_update_ms_per_byte(dev, precision, eff),
        precision=prec.tensor_precision.value,
        seq_len=spec.seq,
        model_fingerprint=spec_fingerprint(spec, len(layers)),
    )


def _efficiency(
    dev: DeviceSpec, precision: str, kernels: str | None, efficiency: Efficiency | None
) -> tuple[str | None, Efficiency]:
    """The kernel setting and the roofline's efficiencies :func:`analytic_profile` times with:
    ``efficiency`` when given; else those fitted for ``kernels`` (None: the device's
    ``default_kernels`` where fitted for ``precision``); else the device's for ``precision``."""
    if kernels is None and efficiency is None and (precision, dev.default_kernels) in FITTED:
        kernels = dev.default_kernels
    if efficiency is not None:
        return kernels, efficiency
    if kernels is not None:
        return kernels, fitted_efficiency(dev, precision, kernels)
    return kernels, dev.efficiency_for(precision)


def _batch_sizes(batch_sizes: Sequence[int]) -> list[int]:
    """The distinct batch sizes, sorted, each from 1 to :data:`MAX_BATCH_SIZE`.

    Raises:
        ValidationError: none, one that is not an integer (a float, a bool), one below 1 or
            one past the limit.
    """
    sizes = sorted(set(batch_sizes))
    if not positive_integers(sizes):
        raise ValidationError(f"batch_sizes must be positive integers, got {list(batch_sizes)}")
    if sizes[-1] > MAX_BATCH_SIZE:
        raise ValidationError(
            f"batch size {sizes[-1]:,} exceeds the analytic profiler's limit of "
            f"{MAX_BATCH_SIZE:,} samples per device"
        )
    return sizes


def _tied_once(costs: list[LayerCost]) -> list[LayerCost]:
    """``costs`` with a tied table held by one layer alone (both copies in it: the embedding
    and the head folded together) counted once in its parameters, and no longer tied."""
    holders = [i for i, c in enumerate(costs) if c.tied_parameters]
    if len(holders) == 1:
        c = costs[holders[0]]
        table = (c.tied_parameters // 2,)  # first in registration order: the embedding's
        costs[holders[0]] = dataclasses.replace(
            c, parameters=c.parameters - c.tied_parameters // 2, tied_parameters=0,
            tensors=None if c.tensors is None else table + c.tensors,
        )  # fmt: skip
    return costs


def _layer_profile(
    c: LayerCost,
    i: int,
    holders: Sequence[int],
    spec: TransformerSpec,
    sizes: Sequence[int],
    dev: DeviceSpec,
    precision: str,
    eff: Efficiency,
) -> LayerProfile:
    """Layer ``i``'s profile: its roofline times at each batch size fitted affine, its sizes
    (parameters in fp32 bytes), the other layers holding its tied table (``holders``), and its
    mixture of experts' record (:func:`moe_record`, shares at the largest batch size)."""
    times = [layer_time_ms(c, b, dev, precision, eff) for b in sizes]
    moe = moe_record(
        c, spec, precision_of(precision).element_bytes,
        lambda op, fwd: _op_ms(op, sizes[-1], dev, precision, eff, fwd),
    )  # fmt: skip
    return LayerProfile(
        name=c.name,
        forward=fit_affine(sizes, [t[0] for t in times]),
        backward=fit_affine(sizes, [t[1] for t in times]),
        output_bytes_per_sample=c.output_bytes_per_sample,
        parameter_bytes=4 * c.parameters,
        kept_activation_bytes_per_sample=c.kept_bytes_per_sample,
        tied_parameter_bytes=4 * c.tied_parameters,
        tied_layers=tuple(j for j in holders if j != i) if c.tied_parameters else (),
        tensor_parallel=c.name.startswith("block"),
        moe=moe,
        parameter_sizes=None if c.tensors is None else tuple(4 * n for n in c.tensors),
    )


def _update_ms_per_byte(dev: DeviceSpec, precision: str, eff: Efficiency) -> float:
    """U per fp32 parameter byte: AdamW's bytes per parameter (:data:`_ADAM_BYTES_PER_PARAMETER`,
    plus the 16-bit copy under autocast) moved at the memory efficiency."""
    prec = precision_of(precision)
    cast = prec.element_bytes if prec.autocast else 0.0
    return (_ADAM_BYTES_PER_PARAMETER + cast) / 4 / (eff.memory * dev.hbm_bytes_per_s) * 1e3

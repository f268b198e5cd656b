"""Torch measurements of a model's mixture-of-experts blocks: the router, the routed experts and
the rest of their layer timed apart, and the tokens each expert receives counted.

A sparse block is a module with a ``gate`` (the router: called on the ``(tokens, h)`` hidden
states, it returns logits, routing weights and the top-k expert indices) and ``experts`` (called
as ``experts(hidden, indices, weights)``): the ``SparseMoeBlock`` of Hugging Face's Mixtral and
Qwen2-MoE. Its layer is the module holding it (the decoder layer), the piece a split workload
profiles (``LayerProfile.name`` is the layer's module path).

:func:`measure_moe` builds the whole model (random weights), runs one forward on the workload's
batch keeping each layer's arguments and each block's input (forward pre-hooks), then times, at
each batch size, the layer, the router and the experts alone on those inputs
(:func:`~dapple.profiler.layer_measure.measure_layer`: medians of forward and backward), and
counts the router's top-k per expert. :func:`with_moe` turns the measurements into
:class:`~dapple.core.moe_profile.MoEProfile` records on a measured profile's layers: the router's
and the experts' shares of their eager layer's time at the largest batch size, the mean and the
busiest expert's tokens per sample and each expert's share of the tokens.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dapple.core.moe_profile import MoEProfile
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.hf import hf_config
from dapple.models.split import model_factory_of
from dapple.models.workload import Workload
from dapple.profiler.layer_measure import Timer, measure_layer
from dapple.profiler.measure import resolve_device

__all__ = [
    "BlockMeasurement",
    "configured_experts",
    "measure_moe",
    "moe_record",
    "sparse_blocks",
    "with_moe",
]

_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Config fields of the routed experts' number: Mixtral's, Qwen2-MoE's, DeepSeek's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockMeasurement:
    """One sparse block measured at one batch size."""

    path: str
    """Module path of the block (``model.layers.0.mlp``)."""
    layer: str
    """Module path of the layer holding it (``model.layers.0``)."""
    batch_size: int
    """Samples of the measured batch."""
    experts: int
    """E: routed experts."""
    top_k: int
    """k: experts per token."""
    expert_parameter_bytes: int
    """Bytes of the routed experts' parameters."""
    tokens_per_sample: int
    """s: tokens of one sample."""
    token_bytes: int
    """Bytes of one token's hidden state (h x element size)."""
    layer_ms: tuple[float, float]
    """Forward and backward of the whole layer, eager."""
    router_ms: tuple[float, float]
    """Forward and backward of the router."""
    experts_ms: tuple[float, float]
    """Forward and backward of the routed experts on the router's choice."""
    load: tuple[int, ...]
    """Tokens routed to each expert over the batch."""


def configured_experts(workload: Workload) -> int:
    """Routed experts per block that ``workload``'s Hugging Face config declares; 0 for a dense
    or non-Hugging Face model (told without building it)."""
    config = hf_config(workload)
    return max((int(getattr(config, k, 0) or 0) for k in _EXPERT_KEYS), default=0)


def sparse_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``(path, module)`` of every sparse block of ``model`` (module docstring), in order."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "gate", None), nn.Module)
        and isinstance(getattr(m, "experts", None), nn.Module)
        and "top_k" in vars(m.get_submodule("gate"))
    ]


class _Call(nn.Module):
    """``module(x, *args, **kwargs)`` as a one-input layer for :func:`measure_layer`."""

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.module, self.args, self.kwargs = module, args, kwargs

    def forward(self, x: torch.Tensor) -> Any:
        return self.module(x, *self.args, **self.kwargs)


class _Router(nn.Module):
    """The router's routing weights (what the block's output depends on)."""

    def __init__(self, gate: nn.Module) -> None:
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x)[1]  # type: ignore[no-any-return]


def _captured(model: nn.Module, blocks: list[tuple[str, nn.Module]], inputs: Any) -> dict[str, Any]:
    """One forward of ``model`` keeping each block's input and its layer's arguments."""
    names = {id(m): n for n, m in model.named_modules()}
    seen: dict[str, Any] = {}
    hooks = []

    def keep(key: str) -> Any:
        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen.setdefault(key, (args, kwargs))

        return hook

    for path, block in blocks:
        parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
        hooks.append(block.register_forward_pre_hook(keep(path), with_kwargs=True))
        layer_key = "layer:" + names[id(parent)]
        hooks.append(parent.register_forward_pre_hook(keep(layer_key), with_kwargs=True))
    try:
        with torch.no_grad():
            if isinstance(inputs, (tuple, list)):
                model(*inputs)
            else:
                model(inputs)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def _measure_block(
    model: nn.Module, path: str, block: nn.Module, seen: dict[str, Any], b: int,
    timer: Timer, warmup: int, repeats: int,
) -> BlockMeasurement:  # fmt: skip
    layer_path = path.rpartition(".")[0]
    layer = model.get_submodule(layer_path) if layer_path else model
    x = seen[path][0][0]  # the block's hidden states (batch, tokens, h)
    h = x.reshape(-1, x.shape[-1])
    args, kwargs = seen["layer:" + layer_path]
    gate, experts = block.get_submodule("gate"), block.get_submodule("experts")
    times = []
    for module, inp in (
        (_Call(layer, tuple(args[1:]), kwargs), _leaf(args[0])),
        (_Router(gate), _leaf(h)),
    ):
        f, bw, *_ = measure_layer(module, inp, timer, warmup, repeats)
        times.append((f, bw))
    with torch.no_grad():
        _, weights, indices = gate(h)
    routed = _Call(experts, (indices, weights.detach()), {})
    f, bw, *_ = measure_layer(routed, _leaf(h), timer, warmup, repeats)
    n_e = int(vars(experts).get("num_experts") or vars(gate).get("num_experts") or 0)
    if n_e < 1:
        raise ValidationError(f"sparse block {path!r}: its number of experts is not known")
    load = torch.bincount(indices.reshape(-1), minlength=n_e)
    params = sum(p.numel() * p.element_size() for p in experts.parameters())
    return BlockMeasurement(
        path=path, layer=layer_path, batch_size=b, experts=n_e, top_k=int(vars(gate)["top_k"]),
        expert_parameter_bytes=params, tokens_per_sample=x.shape[-2],
        token_bytes=x.shape[-1] * x.element_size(), layer_ms=times[0], router_ms=times[1],
        experts_ms=(f, bw), load=tuple(int(n) for n in load.tolist()),
    )  # fmt: skip


def measure_moe(
    workload: Workload,
    batch_sizes: Sequence[int],
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
    device: str = "cpu",
    num_threads: int | None = None,
) -> list[BlockMeasurement]:
    """Every sparse block of ``workload``'s model measured at each batch size (module
    docstring); empty for a model without one.

    Args:
        workload: a split workload (:func:`~dapple.models.split.workload_from_module`).
        batch_sizes: samples of the measured batches.
        warmup: untimed runs per measurement.
        repeats: timed runs per measurement, median kept.
        seed: the model's weights and the batches.
        device: ``auto``, ``cpu`` or ``cuda[:N]`` (:func:`~dapple.profiler.measure.resolve_device`).
        num_threads: torch's intra-op threads on the CPU while measuring; None: as set.

    Raises:
        ValidationError: not a split workload, bad batch sizes or repeats, an unknown or
            missing device, a block whose number of experts is unknown.
    """
    if not batch_sizes or min(batch_sizes) < 1 or repeats < 1 or warmup < 0:
        raise ValidationError(
            f"measure_moe needs batch sizes >= 1, repeats >= 1 and warmup >= 0, got "
            f"{list(batch_sizes)}, {repeats}, {warmup}"
        )
    dev = resolve_device(device)
    torch.manual_seed(seed)
    model = model_factory_of(workload)().to(dev).train()
    blocks = sparse_blocks(model)
    timer = Timer(dev)
    out: list[BlockMeasurement] = []
    threads = torch.get_num_threads()
    if num_threads is not None and dev.type == "cpu":
        torch.set_num_threads(num_threads)
    try:
        for b in sorted(set(batch_sizes)):
            inputs, _ = workload.make_batch(b, seed)
            if isinstance(inputs, (tuple, list)):
                inputs = tuple(t.to(dev) for t in inputs)
            else:
                inputs = inputs.to(dev)
            seen = _captured(model, blocks, inputs)
            out += [_measure_block(model, p, m, seen, b, timer, warmup, repeats)
                    for p, m in blocks]  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return out


def moe_record(measured: Sequence[BlockMeasurement]) -> MoEProfile:
    """The record of one block from its measurements at several batch sizes: the router's and
    the experts' shares of the eager layer's time at the largest batch size (scaled down
    together should their sum exceed the layer's time, timer noise), tokens per expert per
    sample (mean ``s k / E``; the busiest expert's, the median over the batch sizes) and each
    expert's share of the tokens (its median over the batch sizes, normalised).

    Raises:
        ValidationError: no measurements, or measurements of different blocks.
    """
    if not measured or len({m.path for m in measured}) != 1:
        raise ValidationError(
            f"moe_record takes the measurements of one block, got {[m.path for m in measured]}"
        )
    last = max(measured, key=lambda m: m.batch_size)

    def shares(i: int) -> tuple[float, float]:
        total = last.layer_ms[i]
        parts = last.router_ms[i] + last.experts_ms[i]
        scale = max(total, parts)
        if scale <= 0:
            return 0.0, 0.0
        return last.router_ms[i] / scale, last.experts_ms[i] / scale

    (rf, xf), (rb, xb) = shares(0), shares(1)
    mean = last.tokens_per_sample * last.top_k / last.experts
    peak = statistics.median(max(m.load) / m.batch_size for m in measured)
    per_expert = [statistics.median(m.load[k] / m.batch_size for m in measured)
                  for k in range(last.experts)]  # fmt: skip
    total = sum(per_expert)
    routed = last.tokens_per_sample * last.top_k * last.token_bytes
    return MoEProfile(
        experts=last.experts, top_k=last.top_k, expert_parameter_bytes=last.expert_parameter_bytes,
        tokens_per_expert_per_sample=mean, max_tokens_per_expert_per_sample=max(mean, peak),
        dispatch_bytes_per_sample=float(routed), combine_bytes_per_sample=float(routed),
        router_time_share=(rf, rb), expert_time_share=(xf, xb),
        expert_load_shares=tuple(x / total for x in per_expert) if total > 0 else None,
    )  # fmt: skip


def with_moe(profile: ModelProfile, measured: Sequence[BlockMeasurement]) -> ModelProfile:
    """``profile`` whose layers holding a measured block carry its :func:`moe_record`: the
    layer named as the block's layer, or whose name is a module-path prefix of it.

    Raises:
        ValidationError: a measured block in no layer of the profile, or a layer with two.
    """
    by_block: dict[str, list[BlockMeasurement]] = {}
    for m in measured:
        by_block.setdefault(m.path, []).append(m)
    layers = list(profile.layers)
    filled: set[int] = set()
    for path, ms in by_block.items():
        hits = [i for i, ly in enumerate(layers) if (path + ".").startswith(ly.name + ".")]
        if len(hits) != 1 or hits[0] in filled:
            raise ValidationError(
                f"profile {profile.model_name!r}: the mixture-of-experts block {path!r} is in "
                f"{'no layer' if not hits else 'a layer holding another'}; layers: "
                f"{[ly.name for ly in layers]}"[:300]
            )
        filled.add(hits[0])
        layers[hits[0]] = dataclasses.replace(layers[hits[0]], moe=moe_record(ms))
    return dataclasses.replace(profile, layers=tuple(layers))

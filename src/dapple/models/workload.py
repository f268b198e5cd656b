"""Workload: what training a model needs, as the layer chain the planner cuts between.

A :class:`Workload` bundles a list of *layer factories* (layer ``i`` is built under a seed
derived from ``(seed, i)``, so any process can build just its own layer range and get exactly
the weights the single-process model has), a batch maker and the loss.

Conventions:
    - a layer takes one tensor or a tuple of tensors and returns one tensor or a tuple;
    - ``make_batch(batch_size, seed)`` returns ``(inputs, targets)``, both with the batch in
      dimension 0 (``inputs`` may be a tuple of tensors); the same arguments give the same data;
    - ``loss_fn(output, targets)`` is the *mean* of per-sample losses, so a slice of ``n``
      samples out of a global batch of ``G`` contributes ``loss_fn(...) * n / G``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dapple.models.shapes import DynamicDim

__all__ = ["Workload", "layer_seed"]


def layer_seed(seed: int, index: int) -> int:
    """The RNG seed layer ``index`` is initialised under for a run seeded with ``seed``."""
    return (seed * 1_000_003 + index * 7919) % (2**63 - 1)


@dataclass(frozen=True)
class Workload:
    """A model as a chain of layers plus its data and loss."""

    name: str
    """Name used in profiles and plans."""
    layer_factories: Sequence[Callable[[], nn.Module]]
    """One zero-argument constructor per layer, in execution order."""
    make_batch: Callable[[int, int], tuple[Any, torch.Tensor]]
    """``(batch_size, seed) -> (inputs, targets)``; deterministic in its arguments."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    """Mean loss of a batch's outputs against its targets."""
    layer_names: Sequence[str] = field(default=())
    """Optional name of each layer; when empty, :meth:`name_of` gives the layer's index."""
    tied_parameters: Sequence[Sequence[tuple[int, str]]] = field(default=())
    """Groups of ``(layer index, parameter name)`` that are one shared parameter in the original
    model (e.g. GPT-2's input embedding and LM head); their gradients are summed over copies."""
    dynamic_dims: Mapping[int, Mapping[int, DynamicDim | None]] = field(default_factory=dict)
    """Input dimensions whose size may change from step to step, ``{input position: {dim:
    DynamicDim}}``, with the sizes the layers accept (see :mod:`dapple.models.shapes`); the
    runtime adds the ones it finds by drawing ``make_batch`` at a few seeds, except those
    declared ``None`` (static)."""
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    """How a stage of this model is cut over a tensor group (t_s > 1): module-name pattern ->
    ``colwise`` / ``packed_colwise`` / ``rowwise`` (:mod:`dapple.runtime.parallel.tp.plan`); empty: a
    Hugging Face model's config plan, else none (tensor parallelism is refused)."""

    @property
    def num_layers(self) -> int:
        return len(self.layer_factories)

    def build_layer(self, index: int, seed: int = 0) -> nn.Module:
        """Layer ``index`` with its deterministic initial weights."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, index))
            return self.layer_factories[index]()

    def build_stage(self, start: int, end: int, seed: int = 0) -> nn.Sequential:
        """Layers ``[start, end)`` as an ``nn.Sequential`` (only these layers are built)."""
        return nn.Sequential(*(self.build_layer(i, seed) for i in range(start, end)))

    def build_model(self, seed: int = 0) -> nn.Sequential:
        """The whole single-process model."""
        return self.build_stage(0, self.num_layers, seed)

    def name_of(self, index: int) -> str:
        """``layer_names[index]``, or ``str(index)`` when the workload has no layer names."""
        if self.layer_names:
            return str(self.layer_names[index])
        return f"{index}"

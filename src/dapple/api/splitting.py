"""The Python API's view of a model's layer chain: one typed :class:`SplitConfig` behind
``dapple split`` and :func:`split`.

``dapple split``'s flags are read once into a :class:`SplitConfig`; ``split(cfg)`` builds the
model it names, runs a batch through its chain and says, per piece, what it holds and hands on.
Torch loads with the model, not with this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dapple.api.run_config import ModelConfig
from dapple.errors import ValidationError

__all__ = ["Piece", "Split", "SplitConfig", "split"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SplitConfig:
    """What ``dapple split`` is asked for: the model and the batch run through its chain."""

    model: ModelConfig
    """The model (``-m`` and its flags)."""
    batch_size: int = 2
    """Samples of the batch run through the chain."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of the chain."""

    name: str
    """The layer's name (:meth:`~dapple.models.workload.Workload.name_of`)."""
    params: int
    """Its parameters (elements)."""
    output: str
    """What it hands on: ``dtype[shape]`` per tensor, comma-separated."""
    tied: tuple[tuple[str, int], ...]
    """Its parameters tied to other pieces': (name, tie group)."""


@dataclass(frozen=True, slots=True)
class Split:
    """A model's chain as :func:`split` ran it."""

    model: str
    """The workload's name."""
    num_layers: int
    """The workload's layers."""
    pieces: tuple[Piece, ...]
    """The pieces in order (layer ``i`` is ``pieces[i]``)."""


def _describe(value: Any) -> str:
    items = value if isinstance(value, tuple) else (value,)
    return ", ".join(
        f"{str(t.dtype).removeprefix('torch.')}[{','.join(map(str, t.shape))}]" for t in items
    )


def split(cfg: SplitConfig) -> Split:
    """Build ``cfg.model`` whole and run a batch of ``cfg.batch_size`` samples through its
    chain, without gradients.

    Raises:
        ValidationError: a batch size below 1 (before the model is built), a bad model spec,
            or a model that does not fit this host's memory.
    """
    if cfg.batch_size < 1:
        raise ValidationError(f"--batch-size must be >= 1, got {cfg.batch_size}")
    import torch

    from dapple.models.zoo import load_workload
    from dapple.profiler.host_fit import check_training_memory

    assert cfg.model.spec is not None  # -m is a required flag
    workload = load_workload(cfg.model.spec, **cfg.model.overrides())
    check_training_memory(workload, 0.0, what="splitting")  # the whole model is built below
    tied = {(i, n): g for g, group in enumerate(workload.tied_parameters) for i, n in group}
    chain = workload.build_model(0)
    x, _ = workload.make_batch(cfg.batch_size, 0)
    pieces = []
    with torch.no_grad():
        for i, piece in enumerate(chain):
            x = piece(x)
            names = [n for n, _ in piece.named_parameters()]
            pieces.append(
                Piece(
                    workload.name_of(i),
                    sum(p.numel() for p in piece.parameters()),
                    _describe(x),
                    tuple((n, tied[(i, n)]) for n in names if (i, n) in tied),
                )
            )
    return Split(workload.name, workload.num_layers, tuple(pieces))

"""Any ``nn.Module`` as the layer chain the planner cuts between, traced with ``torch.export``.

Design choices:
    - The model is captured once per process with ``torch.export.export`` (non-strict, batch
      dimension of every input dynamic), giving a flat ATen graph whose nodes carry the
      ``nn_module_stack`` of the module that ran them. We do not write a tracer. The model is
      traced without weights, its tensors fake CPU tensors (:mod:`dapple.models.trace`), so
      code that branches on the device takes the branch the CPU runs.
    - A *cut* is a position in that graph's node list: "before module X" is the first node X
      ran. By default we cut before every element of the model's largest ``nn.ModuleList``
      (the transformer blocks) and after the last one; ``split_at`` names other modules.
    - Each run of nodes between two cuts becomes one *piece*: a ``torch.fx.GraphModule`` that
      takes one tensor or a tuple of tensors and returns the tensors later pieces (or the final
      output) need, in graph order. Values that skip pieces are passed through.
    - Integer/bool tensors (attention masks, position ids) flow like any other tensor. Symbolic
      sizes (``x.size(0)``) never cross a cut: a piece re-reads them from the shape of one of
      its own input tensors (``aten.sym_size``). Tensors that do not depend on the inputs
      (tables built from buffers) are recomputed by every piece that uses them. Every tensor
      crossing a cut has the batch in dimension 0, or the cut is rejected.
    - Tracing and cutting live in :mod:`dapple.models.split_graph`, building the pieces with
      per-seed or pretrained weights in :mod:`dapple.models.split_pieces`; this module turns
      them into a :class:`~dapple.models.workload.Workload`.
    - A parameter reached from two pieces (tied weights such as GPT-2's ``wte``/``lm_head``) is
      copied into each; :func:`~dapple.models.tied.find_tied_parameters` records the groups so
      the runtime can sum their gradients with :mod:`dapple.models.tied`.
    - Parameter names inside a piece are the original model's fully qualified names, so the
      weights of seed ``s`` are loaded into the traced pieces by name.

Limitations (all from tracing once, ahead of time):
    - train/eval mode and BatchNorm behaviour are fixed when the model is traced; only the
      random sites (dropout, attention dropout: :mod:`dapple.models.rng`) follow
      ``piece.eval()``. Trace the model in the mode you train it in.
    - Pieces are traced in float32: use ``torch.autocast`` for mixed precision, not
      ``piece.to(torch.bfloat16)`` (dtype checks are baked into the graph).
    - Ops of a parent module that run between two cut modules belong to the piece before
      the cut; data-dependent Python control flow cannot be exported (a ValidationError).
    - Every process traces the model once and keeps the initial weights of the whole model
      for its two most recent seeds (:mod:`dapple.models.split_pieces`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from dapple.errors import ValidationError
from dapple.models.shapes import DimsArg, DynamicDim, check_dims_exist, resolve_dims
from dapple.models.split_graph import SplitModel, parse_split_at
from dapple.models.split_pieces import PieceFactory, Splitter, declaring_dims, flat_inputs
from dapple.models.tied import find_tied_parameters
from dapple.models.weights import WeightFiles
from dapple.models.workload import Workload, layer_seed

__all__ = [
    "is_traced",
    "loaded_tensors",
    "model_factory_of",
    "original_model",
    "piece_template",
    "random_sites",
    "split_module",
    "with_dynamic_dims",
    "with_weights",
    "workload_from_module",
]

log = logging.getLogger(__name__)


def split_module(
    model: nn.Module, example_inputs: Any, split_at: Sequence[str] | None = None
) -> tuple[list[fx.GraphModule], list[str]]:
    """Cut ``model`` into pieces sharing its parameter objects (no copy, no seed handling).

    Args:
        model: The model, called as ``model(*inputs)``.
        example_inputs: A tensor or tuple of tensors with the batch in dimension 0.
        split_at: Module names to cut before (``None``: the default block cuts).

    Raises:
        ValidationError: See :class:`SplitModel`.
    """
    split = SplitModel(model, example_inputs, split_at)
    return split.pieces, split.names


def workload_from_module(
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int, int], tuple[Any, torch.Tensor]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    split_at: Sequence[str] | None = None,
    name: str | None = None,
    dynamic_dims: DimsArg | None = None,
) -> Workload:
    """A :class:`Workload` whose layers are the pieces of any model, cut at module boundaries.

    Args:
        model_factory: Builds the original model (random init from the global RNG). The
            workload pickles (for spawned workers) when ``model_factory`` and ``make_batch``
            do; each process traces the model again.
        make_batch: ``(batch_size, seed) -> (inputs, targets)``; ``inputs`` are passed to the
            model as ``model(*inputs)`` (a single tensor: ``model(inputs)``).
        loss_fn: Mean loss of the model's output against ``targets``.
        split_at: Module names to cut before; ``None``: before every element of the largest
            ``nn.ModuleList`` and after the last one.
        name: Workload name (default: the model's class name).
        dynamic_dims: Non-batch input dimensions whose size changes from step to step, by input
            position or ``forward`` argument name, e.g. ``{"input_ids": {1: "seq"}}`` or
            ``{0: {1: ("seq", 1, 512)}}`` (a range); dimensions that differ between
            ``make_batch`` draws at seeds 0, 1, 2 are added. The pieces are traced with them
            dynamic; :attr:`Workload.dynamic_dims` holds them with the ranges the trace is
            valid for.

    Raises:
        ValidationError: Bad ``split_at`` names (the message lists the valid ones), a model
            ``torch.export`` cannot trace, or one that cannot take a dimension dynamic (the
            message names it and suggests declaring it static).
    """
    if isinstance(split_at, str):
        split_at = parse_split_at(split_at)
    splitter = Splitter(
        model_factory, make_batch, list(split_at) if split_at else None, dynamic_dims
    )
    split = splitter.split
    log.debug("split %s into %d pieces: %s", splitter.model_name, len(split.names), split.names)
    return Workload(
        name=name or splitter.model_name,
        layer_factories=[PieceFactory(splitter, i) for i in range(len(split.pieces))],
        make_batch=make_batch,
        loss_fn=loss_fn,
        layer_names=tuple(split.names),
        tied_parameters=tuple(tuple(g) for g in find_tied_parameters(split.pieces)),
        dynamic_dims=_with_static(split.dynamic_dims, splitter.static_dims),
    )


def _with_static(
    dynamic: Mapping[int, Mapping[int, DynamicDim]],
    static: Mapping[int, Mapping[int, DynamicDim | None]],
) -> dict[int, dict[int, DynamicDim | None]]:
    """The traced dynamic dimensions and (as None) the ones declared static."""
    out: dict[int, dict[int, DynamicDim | None]] = {i: dict(ds) for i, ds in dynamic.items()}
    for i, ds in static.items():
        if ds:
            out.setdefault(i, {}).update(ds)
    return out


def _splitter_of(workload: Workload) -> Splitter:
    factory = workload.layer_factories[0] if workload.num_layers else None
    if not isinstance(factory, PieceFactory):
        raise ValidationError(f"workload {workload.name!r} was not made by workload_from_module")
    return factory.owner


def with_dynamic_dims(workload: Workload, dynamic_dims: DimsArg) -> Workload:
    """``workload`` with more input dimensions declared dynamic (or static), on top of its own.

    A workload made by :func:`workload_from_module` is traced again with the merged
    declaration (inputs by position or ``forward`` argument name), so its pieces take the new
    sizes; any other layer chain runs eager modules, and only its
    :attr:`~dapple.models.workload.Workload.dynamic_dims` change (inputs by position).

    Raises:
        ValidationError: an unknown input or a bad dimension (see
            :func:`~dapple.models.shapes.resolve_dims`); a model that cannot be traced with a
            dimension dynamic (see :func:`workload_from_module`).
    """
    factory = workload.layer_factories[0] if workload.num_layers else None
    if isinstance(factory, PieceFactory):
        old = factory.owner
        names = old.input_names
        merged: dict[int | str, dict[int, DynamicDim | None]] = {
            i: dict(ds) for i, ds in old.declared_dims.items()
        }
        for i, ds in resolve_dims(dynamic_dims, names).items():
            merged.setdefault(i, {}).update(ds)
        with declaring_dims(None):
            traced = workload_from_module(
                old.model_factory,
                old.make_batch,
                workload.loss_fn,
                old.split_at,
                name=workload.name,
                dynamic_dims=merged,
            )
        if old.weights is not None:
            owner = _splitter_of(traced).with_weights(old.weights)
            factories = [PieceFactory(owner, i) for i in range(traced.num_layers)]
            traced = dataclasses.replace(traced, layer_factories=factories)
        return dataclasses.replace(workload, **_traced_fields(traced))
    inputs = flat_inputs(workload.make_batch(1, 0)[0])
    count, names = len(inputs), [str(i) for i in range(len(inputs))]
    for key in dynamic_dims:
        if isinstance(key, str) and not key.isdigit():
            raise ValidationError(
                f"dynamic_dims names input {key!r}: workload {workload.name!r} is a layer chain "
                f"(not traced from a module), name its inputs by position 0..{count - 1}"
            )
    own = {i: dict(ds) for i, ds in workload.dynamic_dims.items()}
    resolved = resolve_dims(dynamic_dims, names)
    check_dims_exist(resolved, inputs)
    for i, ds in resolved.items():
        own.setdefault(i, {}).update(ds)
    return dataclasses.replace(workload, dynamic_dims={i: ds for i, ds in own.items() if ds})


def is_traced(workload: Workload) -> bool:
    """Whether ``workload`` was made by :func:`workload_from_module`."""
    return bool(workload.num_layers) and isinstance(workload.layer_factories[0], PieceFactory)


def piece_template(workload: Workload, index: int) -> nn.Module | None:
    """Layer ``index`` of a traced ``workload`` as traced: its parameters on ``meta`` (names,
    shapes and dtypes of the built layer, no memory); None for a workload not traced."""
    factory = workload.layer_factories[index]
    if not isinstance(factory, PieceFactory):
        return None
    return factory.owner.split.pieces[factory.index]


def _traced_fields(traced: Workload) -> dict[str, Any]:
    return {
        "layer_factories": traced.layer_factories,
        "layer_names": traced.layer_names,
        "tied_parameters": traced.tied_parameters,
        "dynamic_dims": traced.dynamic_dims,
    }


def model_factory_of(workload: Workload) -> Callable[[], nn.Module]:
    """The factory of the unsplit model of a :func:`workload_from_module` workload.

    Raises:
        ValidationError: ``workload`` was not made by :func:`workload_from_module`.
    """
    return _splitter_of(workload).model_factory


def with_weights(workload: Workload, path: str | Path) -> Workload:
    """``workload`` whose pieces take their initial parameters from pretrained weights.

    Each rank reads only the tensors of its own pieces. Names, shapes and dtypes are checked
    here, against the file headers, before any compute.

    Args:
        workload: A workload made by :func:`workload_from_module`.
        path: A Hugging Face style directory, a ``.safetensors`` file or a ``state_dict`` file
            (see :class:`~dapple.models.weights.WeightFiles`).

    Raises:
        ValidationError: Not a split workload; a missing tensor, shape or dtype mismatch.
    """
    factory = workload.layer_factories[0] if workload.num_layers else None
    if not isinstance(factory, PieceFactory):
        raise ValidationError(
            "pretrained weights load into a model split from one nn.Module (hf:DIR, or a "
            "package.module:factory or file.py:factory that returns an nn.Module); "
            f"{workload.name!r} is built layer by layer and has no module tensor names to "
            f"match {path!r} to"
        )
    owner = _splitter_of(workload).with_weights(WeightFiles(path))
    return dataclasses.replace(
        workload,
        layer_factories=[PieceFactory(owner, i) for i in range(workload.num_layers)],
    )


def loaded_tensors(workload: Workload, first: int, end: int) -> tuple[Path, int] | None:
    """Where the layers ``[first, end)`` of ``workload`` take pretrained weights from and how
    many tensors of those files they read (each once, a tied tensor in every stage that holds
    a copy); None when the workload has no weights (:func:`with_weights`)."""
    keys: set[str] = set()
    source: Path | None = None
    for f in workload.layer_factories[first:end]:
        if not isinstance(f, PieceFactory) or f.owner.weights is None:
            return None
        keys |= f.owner.piece_keys(f.index)
        source = f.owner.weights.path
    return None if source is None else (source, len(keys))


def original_model(workload: Workload, seed: int = 0) -> nn.Module:
    """The unsplit model whose weights ``workload.build_model(seed)``'s pieces carry.

    Args:
        workload: A workload made by :func:`workload_from_module`.
        seed: The run seed given to ``build_model``.

    Raises:
        ValidationError: ``workload`` was not made by :func:`workload_from_module`.
    """
    return _splitter_of(workload).whole(layer_seed(seed, 0))


def random_sites(workload: Workload) -> list[int | None]:
    """The batch dimension of each random site (dropout, attention) of a
    :func:`workload_from_module` workload, in the order its model runs them
    (:mod:`dapple.models.rng`).

    Raises:
        ValidationError: ``workload`` was not made by :func:`workload_from_module`.
    """
    return list(_splitter_of(workload).split.random_sites)

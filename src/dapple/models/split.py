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
    - Tracing and cutting live in :mod:`dapple.models.split_graph`; this module turns the pieces
      into a :class:`~dapple.models.workload.Workload` with per-seed weights.
    - A parameter reached from two pieces (tied weights such as GPT-2's ``wte``/``lm_head``) is
      copied into each; :func:`find_tied_parameters` records the groups so the runtime can sum
      their gradients with :mod:`dapple.models.tied` (re-exported here).
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
      for its two most recent seeds.

Piece ``i``'s factory builds the whole model under the run's base seed (recovered from the
per-layer seed :meth:`dapple.models.workload.Workload.build_layer` sets) and returns a copy of piece
``i`` holding that model's weights, so ``build_stage(i, j, seed)`` equals the layers ``[i, j)``
of ``build_model(seed)`` and tied copies start equal.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from dapple.errors import ValidationError
from dapple.models.materialize import build_meta, init_parameters, materialize
from dapple.models.shapes import (
    DimsArg,
    DynamicDim,
    check_dims_exist,
    find_dynamic_dims,
    merge_dims,
    resolve_dims,
)
from dapple.models.split_graph import (
    EXAMPLE_BATCH,
    SplitModel,
    default_cut_names,
    executed_module_names,
    parse_split_at,
)
from dapple.models.tied import find_tied_parameters, sum_tied_grads_local, sync_tied_grads
from dapple.models.trace import fake_copy
from dapple.models.weights import WeightFiles
from dapple.models.workload import Workload, layer_seed

__all__ = [
    "SplitModel",
    "declaring_dims",
    "default_cut_names",
    "executed_module_names",
    "find_tied_parameters",
    "is_traced",
    "loaded_tensors",
    "model_factory_of",
    "original_model",
    "parse_split_at",
    "piece_template",
    "random_sites",
    "split_module",
    "sum_tied_grads_local",
    "sync_tied_grads",
    "with_dynamic_dims",
    "with_weights",
    "workload_from_module",
]

log = logging.getLogger(__name__)

_SEED_MOD = 2**63 - 1

_DECLARED: ContextVar[DimsArg | None] = ContextVar("dapple_declared_dims", default=None)
"""Dimensions declared by the caller of a model factory (:func:`declaring_dims`)."""


@contextlib.contextmanager
def declaring_dims(dynamic_dims: DimsArg | None) -> Iterator[None]:
    """Within the block, :func:`workload_from_module` traces with ``dynamic_dims`` on top of
    the ones its caller passes: a model factory that traces its model takes a user's
    declaration (``--dynamic-dims``) without a parameter of its own for it."""
    token = _DECLARED.set(dynamic_dims)
    try:
        yield
    finally:
        _DECLARED.reset(token)


def _base_seed_of_current_rng(index: int) -> int:
    """The run seed's layer-0 seed, recovered inside ``Workload.build_layer(index, seed)``.

    ``layer_seed(seed, i) = layer_seed(seed, 0) + layer_seed(0, i) (mod 2**63 - 1)``, so every
    piece of one run maps to the same base seed and builds the same whole model.
    """
    return (torch.initial_seed() - layer_seed(0, index)) % _SEED_MOD


class _PieceFactory:
    """Zero-argument factory of piece ``index`` (see the module docstring)."""

    def __init__(self, owner: _Splitter, index: int) -> None:
        self.owner = owner
        self.index = index

    def __call__(self) -> nn.Module:
        return self.owner.piece(self.index, _base_seed_of_current_rng(self.index))


class _Splitter:
    """Per-process cache: the traced templates and the weightless models of recent base seeds."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        make_batch: Callable[[int, int], tuple[Any, torch.Tensor]],
        split_at: Sequence[str] | None,
        dynamic_dims: DimsArg | None = None,
    ) -> None:
        self.model_factory = model_factory
        self.make_batch = make_batch
        self.split_at = split_at
        self.weights: WeightFiles | None = None
        self.weight_keys: dict[str, str] = {}
        self.models: OrderedDict[int, nn.Module] = OrderedDict()
        base = layer_seed(0, 0)
        model = self.model(base)
        self.model_name = type(model).__name__
        inputs, _ = make_batch(EXAMPLE_BATCH, 0)
        names = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        self.input_names = names
        declared = resolve_dims(dynamic_dims, names)
        for i, ds in resolve_dims(_DECLARED.get(), names).items():
            declared.setdefault(i, {}).update(ds)
        check_dims_exist(declared, _flat_inputs(inputs))
        self.declared_dims = declared
        """The declaration by input position (the caller's and :func:`declaring_dims`')."""
        dims = merge_dims(declared, find_dynamic_dims(make_batch, EXAMPLE_BATCH, 0))
        self.static_dims: dict[int, dict[int, DynamicDim | None]] = {
            i: {d: None for d, v in ds.items() if v is None} for i, ds in declared.items()
        }
        """Dimensions declared static (the runtime does not take them for dynamic ones)."""
        try:  # trace a copy whose tensors are fake CPU tensors: no weights anywhere
            self.split = SplitModel(*_fake_trace_args(model, inputs), split_at, dims)
        except ValidationError as fake_error:
            try:  # tensors fake_copy cannot fake (a tensor subclass): the real model
                self.split = SplitModel(self.whole(base), inputs, split_at, dims)
            except ValidationError:
                raise fake_error from None
            log.warning(
                "%s could not be traced without its weights (%s); traced with real weights",
                self.model_name,
                fake_error,
            )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the recipe, not the graphs: a spawned worker traces the model again."""
        if self.weights is None:
            return (
                _Splitter,
                (self.model_factory, self.make_batch, self.split_at, self.declared_dims),
            )
        recipe = (self.model_factory, self.make_batch, self.split_at, self.declared_dims)
        return (_splitter_with_weights, (recipe, self.weights))

    def with_weights(self, weights: WeightFiles) -> _Splitter:
        """A splitter sharing these templates whose pieces take their parameters from
        ``weights`` (checked against the model here, before any compute)."""
        keys = weights.check(self.model(layer_seed(0, 0)))
        out = copy.copy(self)
        out.weights, out.weight_keys, out.models = weights, keys, OrderedDict()
        return out

    def piece_keys(self, index: int) -> set[str]:
        """The names in the weight files of the tensors piece ``index`` reads (:meth:`values`
        of its parameters' names; empty without weights)."""
        names = self.split.pieces[index].named_parameters(remove_duplicate=False)
        return {self.weight_keys[n] for n, _ in names} if self.weights is not None else set()

    def values(self, model: nn.Module, names: list[str], base: int) -> dict[str, torch.Tensor]:
        """Initial values of the named parameters: from the weights, or initialised."""
        if self.weights is None:
            return init_parameters(model, names, base)
        out = {}
        for name in names:
            like = model.get_parameter(name)
            t = self.weights.get(self.weight_keys[name])
            out[name] = t.to(dtype=like.dtype, copy=True)
        return out

    def model(self, base: int) -> nn.Module:
        """The model built under ``base`` with its re-initialisable parameters on ``meta``."""
        if base in self.models:
            self.models.move_to_end(base)
            return self.models[base]
        self.models[base] = model = build_meta(self.model_factory, base)
        while len(self.models) > 2:
            self.models.popitem(last=False)
        return model

    def piece(self, index: int, base: int) -> nn.Module:
        """Piece ``index`` with the initial weights of the model of ``base``; only its own
        parameters are made real."""
        model = self.model(base)
        piece = copy.deepcopy(self.split.pieces[index])
        names = [n for n, _ in piece.named_parameters(remove_duplicate=False)]
        values = self.values(model, names, base)
        buffers = dict(model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name in names:
                owner, _, leaf = name.rpartition(".")
                mod = piece.get_submodule(owner)
                old = mod._parameters[leaf]
                assert old is not None
                mod._parameters[leaf] = nn.Parameter(values[name], old.requires_grad)
            for name, t in piece.named_buffers(remove_duplicate=False):
                owner, _, leaf = name.rpartition(".")
                if name in buffers:
                    piece.get_submodule(owner)._buffers[leaf] = buffers[name].clone()
                elif t.is_meta:
                    raise ValidationError(f"piece {index} needs tensor {name!r} the model lacks")
        return piece

    def whole(self, base: int) -> nn.Module:
        """The unsplit model of ``base`` with every parameter real (a reference)."""
        model = build_meta(self.model_factory, base)
        return materialize(model, base, values=functools.partial(self.values, model, base=base))


def _splitter_with_weights(recipe: tuple[Any, ...], weights: WeightFiles) -> _Splitter:
    """Unpickling hook of a :class:`_Splitter` with pretrained weights."""
    return _Splitter(*recipe).with_weights(weights)


def _fake_trace_args(model: nn.Module, inputs: Any) -> tuple[nn.Module, Any]:
    """A copy of ``model`` and ``inputs`` (a tensor or a tuple) as fake CPU tensors
    (:func:`dapple.models.trace.fake_copy`).

    Raises:
        ValidationError: A tensor cannot be made fake (a tensor subclass torch cannot fake).
    """
    try:
        fake_model, fake_inputs = fake_copy(
            copy.deepcopy(model), inputs if isinstance(inputs, tuple) else (inputs,)
        )
    except Exception as e:  # torch raises many types; the caller falls back to real weights
        raise ValidationError(f"cannot make fake tensors of it: {type(e).__name__}: {e}") from e
    return fake_model, fake_inputs if isinstance(inputs, tuple) else fake_inputs[0]


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
    splitter = _Splitter(
        model_factory, make_batch, list(split_at) if split_at else None, dynamic_dims
    )
    split = splitter.split
    log.debug("split %s into %d pieces: %s", splitter.model_name, len(split.names), split.names)
    return Workload(
        name=name or splitter.model_name,
        layer_factories=[_PieceFactory(splitter, i) for i in range(len(split.pieces))],
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


def _splitter_of(workload: Workload) -> _Splitter:
    factory = workload.layer_factories[0] if workload.num_layers else None
    if not isinstance(factory, _PieceFactory):
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
    if isinstance(factory, _PieceFactory):
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
            factories = [_PieceFactory(owner, i) for i in range(traced.num_layers)]
            traced = dataclasses.replace(traced, layer_factories=factories)
        return dataclasses.replace(workload, **_traced_fields(traced))
    inputs = _flat_inputs(workload.make_batch(1, 0)[0])
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
    return bool(workload.num_layers) and isinstance(workload.layer_factories[0], _PieceFactory)


def piece_template(workload: Workload, index: int) -> nn.Module | None:
    """Layer ``index`` of a traced ``workload`` as traced: its parameters on ``meta`` (names,
    shapes and dtypes of the built layer, no memory); None for a workload not traced."""
    factory = workload.layer_factories[index]
    if not isinstance(factory, _PieceFactory):
        return None
    return factory.owner.split.pieces[factory.index]


def _traced_fields(traced: Workload) -> dict[str, Any]:
    return {
        "layer_factories": traced.layer_factories,
        "layer_names": traced.layer_names,
        "tied_parameters": traced.tied_parameters,
        "dynamic_dims": traced.dynamic_dims,
    }


def _flat_inputs(inputs: Any) -> tuple[Any, ...]:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


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
    if not isinstance(factory, _PieceFactory):
        raise ValidationError(
            "pretrained weights load into a model split from one nn.Module (hf:DIR, or a "
            "package.module:factory or file.py:factory that returns an nn.Module); "
            f"{workload.name!r} is built layer by layer and has no module tensor names to "
            f"match {path!r} to"
        )
    owner = _splitter_of(workload).with_weights(WeightFiles(path))
    return dataclasses.replace(
        workload,
        layer_factories=[_PieceFactory(owner, i) for i in range(workload.num_layers)],
    )


def loaded_tensors(workload: Workload, first: int, end: int) -> tuple[Path, int] | None:
    """Where the layers ``[first, end)`` of ``workload`` take pretrained weights from and how
    many tensors of those files they read (each once, a tied tensor in every stage that holds
    a copy); None when the workload has no weights (:func:`with_weights`)."""
    keys: set[str] = set()
    source: Path | None = None
    for f in workload.layer_factories[first:end]:
        if not isinstance(f, _PieceFactory) or f.owner.weights is None:
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

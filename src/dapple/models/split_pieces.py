"""The pieces of a traced model, built with the run's initial weights or pretrained ones.

A :class:`Splitter` is a per-process cache: it traces the model once
(:class:`~dapple.models.split_graph.SplitModel`, on fake CPU tensors, no weights anywhere) and
keeps the weightless models of its two most recent base seeds. Piece ``i``'s factory
(:class:`PieceFactory`) builds the whole model under the run's base seed (recovered from the
per-layer seed :meth:`dapple.models.workload.Workload.build_layer` sets) and returns a copy of
piece ``i`` holding that model's weights, so ``build_stage(i, j, seed)`` equals the layers
``[i, j)`` of ``build_model(seed)`` and tied copies start equal. With pretrained weights
(:meth:`Splitter.with_weights`) each piece reads only its own tensors. A splitter pickles as its
recipe: a spawned worker traces the model again.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

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
from dapple.models.split_graph import EXAMPLE_BATCH, SplitModel
from dapple.models.trace import fake_copy
from dapple.models.weights import WeightFiles
from dapple.models.workload import layer_seed

__all__ = ["PieceFactory", "Splitter", "declaring_dims", "flat_inputs"]

log = logging.getLogger(__name__)

_SEED_MOD = 2**63 - 1

_DECLARED: ContextVar[DimsArg | None] = ContextVar("dapple_declared_dims", default=None)
"""Dimensions declared by the caller of a model factory (:func:`declaring_dims`)."""


@contextlib.contextmanager
def declaring_dims(dynamic_dims: DimsArg | None) -> Iterator[None]:
    """Within the block, :func:`~dapple.models.split.workload_from_module` traces with
    ``dynamic_dims`` on top of the ones its caller passes: a model factory that traces its
    model takes a user's declaration (``--dynamic-dims``) without a parameter of its own for
    it."""
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


class PieceFactory:
    """Zero-argument factory of piece ``index`` of ``owner`` (see the module docstring)."""

    def __init__(self, owner: Splitter, index: int) -> None:
        self.owner = owner
        self.index = index

    def __call__(self) -> nn.Module:
        return self.owner.piece(self.index, _base_seed_of_current_rng(self.index))


class Splitter:
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
        check_dims_exist(declared, flat_inputs(inputs))
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
                Splitter,
                (self.model_factory, self.make_batch, self.split_at, self.declared_dims),
            )
        recipe = (self.model_factory, self.make_batch, self.split_at, self.declared_dims)
        return (_splitter_with_weights, (recipe, self.weights))

    def with_weights(self, weights: WeightFiles) -> Splitter:
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


def _splitter_with_weights(recipe: tuple[Any, ...], weights: WeightFiles) -> Splitter:
    """Unpickling hook of a :class:`Splitter` with pretrained weights."""
    return Splitter(*recipe).with_weights(weights)


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


def flat_inputs(inputs: Any) -> tuple[Any, ...]:
    """A model's inputs (a tensor or a tuple or list of them) as a tuple."""
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)

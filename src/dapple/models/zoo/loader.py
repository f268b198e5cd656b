"""Resolve a workload spec: a zoo name, ``package.module:factory`` or ``file.py:factory``."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.models.zoo.cnn import resnet50, vgg19
from dapple.models.zoo.common import generator
from dapple.models.zoo.gnmt import gnmt
from dapple.models.zoo.mlp import mlp
from dapple.models.zoo.override_check import check_override_types
from dapple.models.zoo.transformer import transformer, transformer_tp

__all__ = ["HF_PREFIX", "NAMES", "get_workload", "load_workload", "workload_from_sequential"]

_REGISTRY: dict[str, tuple[Callable[..., Workload], dict[str, Any]]] = {
    "mlp": (mlp, {}),
    "transformer": (transformer, {}),
    "transformer-tp": (transformer_tp, {}),
    "bert-48": (
        transformer,
        {"layers": 48, "hidden": 1024, "heads": 16, "seq": 512, "vocab": 30522, "name": "bert-48"},
    ),
    "vgg19": (vgg19, {}),
    "resnet50": (resnet50, {}),
    "gnmt": (gnmt, {}),
    "gnmt-16": (gnmt, {"layers": 16, "hidden": 1024, "vocab": 32320, "seq": 50, "name": "gnmt-16"}),
}

HF_PREFIX = "hf:"
"""``hf:DIR``: a Hugging Face causal LM from the ``config.json`` in the local directory DIR."""

NAMES: tuple[str, ...] = tuple(_REGISTRY)
"""Zoo model names; ``bert-48``, ``gnmt-16``, ``vgg19`` and ``resnet50`` are paper-sized."""


def _call(factory: Callable[..., Any], what: str, kwargs: dict[str, Any]) -> Any:
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        try:
            names = list(inspect.signature(factory).parameters)
        except (TypeError, ValueError):  # pragma: no cover - builtins without signature
            names = []
        unknown = sorted(k for k in kwargs if k not in names) or sorted(kwargs)
        accepted = ", ".join(names) or "?"
        if unknown == ["split_at"]:  # a CLI flag, not one of the user's --set arguments
            raise ValidationError(
                f"{what} takes no split_at: --split-at cuts a model whose factory takes it "
                f"(hf:DIR, or one split by workload_from_module); its arguments: {accepted}"
            ) from e
        raise ValidationError(f"{what}: bad arguments {unknown} ({e}); accepted: {accepted}") from e
    except ValueError:  # pragma: no cover - no signature available
        pass
    return factory(**kwargs)


def get_workload(name: str, **overrides: Any) -> Workload:
    """Build zoo model ``name``, e.g. ``get_workload("transformer", layers=8, hidden=128)``.

    Args:
        name: one of :data:`NAMES`.
        **overrides: keyword arguments of the model's builder (sizes).

    Raises:
        ValidationError: unknown name or bad overrides (the message lists what is accepted).
    """
    if name not in _REGISTRY:
        raise ValidationError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
    builder, preset = _REGISTRY[name]
    check_override_types(builder, f"model {name!r}", overrides)
    return _call(builder, f"model {name!r}", {**preset, **overrides})  # type: ignore[no-any-return]


def workload_from_sequential(
    model: nn.Sequential, input_shape: Sequence[int], name: str = "sequential"
) -> Workload:
    """Wrap an ``nn.Sequential``: its children are the layers, with a synthetic regression task.

    Layer ``i`` is a copy of the ``i``-th child (its weights are the model's; the workload seed
    is not used for them). Batches are N(0, 1) inputs of per-sample shape ``input_shape`` and
    N(0, 1) targets of the model's per-sample output shape; the loss is the mean squared error.

    Args:
        model: the sequential model (its children must chain tensor to tensor).
        input_shape: per-sample input shape, e.g. ``(3, 32, 32)``.
        name: workload name.

    Raises:
        ValidationError: no children, bad shape, or the model fails on an input of that shape.
    """
    children = list(model.children())
    shape = tuple(int(d) for d in input_shape)
    if not children or not shape or min(shape) < 1:
        raise ValidationError(
            f"{name}: need a non-empty nn.Sequential and a positive input_shape, got "
            f"{len(children)} children and input_shape={tuple(input_shape)}"
        )
    probe = copy.deepcopy(model).eval()
    try:
        with torch.no_grad():
            out = probe(torch.zeros(2, *shape))
    except Exception as e:
        raise ValidationError(f"{name}: model fails on input_shape {shape}: {e}") from e
    if not isinstance(out, torch.Tensor):
        raise ValidationError(f"{name}: the model must return one tensor, got {type(out).__name__}")
    out_shape = tuple(out.shape[1:])

    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = generator(seed)
        x = torch.randn(batch_size, *shape, generator=g)
        return x, torch.randn(batch_size, *out_shape, generator=g)

    return Workload(
        name=name,
        layer_factories=[partial(copy.deepcopy, c) for c in children],
        make_batch=make_batch,
        loss_fn=F.mse_loss,
        layer_names=[f"{i}.{type(c).__name__}" for i, c in enumerate(children)],
    )


def _import_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr:
        raise ValidationError(
            f"bad workload spec {spec!r}: expected module:factory or file.py:factory"
        )
    try:
        if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
            path = Path(module_name)
            if not path.is_file():
                raise ValidationError(f"workload file {module_name!r} not found (spec {spec!r})")
            mod_id = f"_dapple_user_{abs(hash(str(path.resolve())))}"
            mspec = importlib.util.spec_from_file_location(mod_id, path)
            if mspec is None or mspec.loader is None:
                raise ValidationError(f"cannot load workload file {module_name!r}")
            module = importlib.util.module_from_spec(mspec)
            sys.modules[mod_id] = module
            mspec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ValidationError:
        raise
    except Exception as e:  # ImportError, SyntaxError, errors raised while importing
        raise ValidationError(
            f"cannot import {module_name!r} for workload {spec!r}: {type(e).__name__}: {e}"
        ) from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValidationError(f"{module_name!r} has no callable {attr!r} (workload {spec!r})")
    return factory  # type: ignore[no-any-return]


def load_workload(
    spec: str, input_shape: Sequence[int] | None = None, **overrides: Any
) -> Workload:
    """Resolve ``spec``: a zoo name, ``package.module:factory`` or ``path/to/file.py:factory``.

    The factory is called with ``overrides`` under a fixed torch seed and must return a
    :class:`Workload` or an ``nn.Sequential`` (wrapped by :func:`workload_from_sequential`,
    which needs ``input_shape``).

    ``hf:DIR`` is any Hugging Face causal LM whose ``config.json`` is in ``DIR``
    (:func:`dapple.models.hf.hf_causal_lm`). The override ``weights=PATH`` loads pretrained
    weights into a model traced from an ``nn.Module`` (:func:`dapple.models.split.with_weights`);
    ``dynamic_dims=`` declares input dimensions dynamic or static on top of the model's own:
    a model traced from an ``nn.Module`` is traced with them
    (:func:`dapple.models.split_pieces.declaring_dims`), a layer chain records them.

    Args:
        spec: what to load.
        input_shape: per-sample input shape for ``nn.Sequential`` factories.
        **overrides: keyword arguments for the zoo builder or the factory, ``weights`` and
            ``dynamic_dims``.

    Raises:
        ValidationError: unknown name, import failure, missing factory, bad return value.
    """
    weights = overrides.pop("weights", None)
    dims = overrides.pop("dynamic_dims", None)
    from dapple.models.split import is_traced, with_dynamic_dims
    from dapple.models.split_pieces import declaring_dims

    with declaring_dims(dims):  # a factory that traces its model traces with them
        wl = _load(spec, input_shape, overrides)
    if dims and not is_traced(wl):
        wl = with_dynamic_dims(wl, dims)
    if weights is None:
        return wl
    from dapple.models.split import with_weights

    return with_weights(wl, weights)


def _load(spec: str, input_shape: Sequence[int] | None, overrides: dict[str, Any]) -> Workload:
    if spec in _REGISTRY:
        return get_workload(spec, **overrides)
    if spec.startswith(HF_PREFIX):
        from dapple.models.hf import hf_causal_lm

        causal_lm = partial(hf_causal_lm, spec[len(HF_PREFIX) :])
        return cast(Workload, _call(causal_lm, f"model {spec!r}", overrides))
    if ":" not in spec:
        raise ValidationError(
            f"unknown model {spec!r}; known: {', '.join(NAMES)} "
            "(or package.module:factory / path/to/file.py:factory / hf:DIR)"
        )
    factory = _import_factory(spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        try:
            result = _call(factory, f"factory {spec!r}", overrides)
        except ValidationError:
            raise
        except Exception as e:
            raise ValidationError(f"factory {spec!r} failed: {type(e).__name__}: {e}") from e
    if isinstance(result, Workload):
        return result
    if isinstance(result, nn.Sequential):
        if input_shape is None:
            raise ValidationError(
                f"factory {spec!r} returned an nn.Sequential: pass input_shape (--input-shape)"
            )
        return workload_from_sequential(result, input_shape, name=spec)
    raise ValidationError(
        f"factory {spec!r} must return a Workload or an nn.Sequential, got {type(result).__name__}"
    )

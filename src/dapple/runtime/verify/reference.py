"""The one-process side of ``dapple verify``: the unsplit model trained on full batches, free
(:func:`reference_run`) or step by step from the distributed run's weights and gradients
(:class:`ForcedReference`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from dapple.datasets import BatchSource
from dapple.errors import ValidationError
from dapple.models.rng import KeyedRandomness, keyed
from dapple.models.split import original_model, random_sites
from dapple.models.tied import sum_tied_grads_local
from dapple.models.workload import Workload
from dapple.runtime.data import fit_data, fit_workload
from dapple.runtime.optim import config_lr, make_optimizer, set_lr
from dapple.runtime.precision import autocast_reference
from dapple.runtime.train_config import OPTIM_FIELDS, TrainConfig
from dapple.runtime.verify.report import Params

__all__ = ["ForcedReference", "StepResult", "config", "reference_run"]


def config(steps: int, seed: int, optimizer: str, lr: float, optim: dict[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` both runs train with.

    Raises:
        ValidationError: an option that is not an optimisation option.
    """
    unknown = sorted(set(optim) - set(OPTIM_FIELDS))
    if unknown:
        raise ValidationError(
            f"unknown options {unknown}; the optimisation options are {', '.join(OPTIM_FIELDS)}"
        )
    return TrainConfig(steps=steps, seed=seed, optimizer=optimizer, lr=lr, **optim)


def _call(model: nn.Module, inputs: Any) -> Any:
    return model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)


@dataclass
class _Model:
    """The reference model and its parameters addressed as the layers name them."""

    model: nn.Module
    chain: nn.Sequential
    kind: str
    """``original model`` or ``layer chain``."""
    by_layer: dict[tuple[int, str], nn.Parameter]
    """``(layer, name in the layer)`` -> the reference's parameter (the copies of a tied
    parameter of the original model are one parameter)."""
    counted: list[nn.Parameter]
    """The parameters of the original model, once each (the global norm's terms)."""
    sites: list[int | None] | None = None
    """The original model's random sites (batch dimension of each, in run order)."""

    @property
    def is_chain(self) -> bool:
        return self.model is self.chain


def _model(workload: Workload, seed: int) -> _Model:
    """The original model when the workload was cut from one, else the layer chain (whose tied
    copies get the summed gradient, :func:`sum_tied_grads_local`)."""
    chain = workload.build_model(seed)
    try:
        model: nn.Module = original_model(workload, seed)
        kind = "original model"
    except ValidationError:
        model, kind = chain, "layer chain"
    model.train()
    sites = None if model is chain else random_sites(workload)
    by_layer: dict[tuple[int, str], nn.Parameter] = {}
    for i, layer in enumerate(chain):
        for n, p in layer.named_parameters():
            by_layer[(i, n)] = p if model is chain else model.get_parameter(n)
    counted = list(model.parameters())
    if model is chain:  # every tied group's first copy only
        copies = {id(chain[i].get_parameter(n)) for g in workload.tied_parameters for i, n in g}
        firsts = {
            id(chain[i].get_parameter(n))
            for g in workload.tied_parameters
            for i, n in [min((int(i), str(n)) for i, n in g)]
        }
        counted = [p for p in counted if id(p) not in copies - firsts]
    return _Model(model, chain, kind, by_layer, counted, sites)


def _batches(
    workload: Workload, global_batch_size: int, cfg: TrainConfig, data: Dataset[Any] | None
) -> Iterator[tuple[Any, Any]]:
    """Each step's global batch, as the runtime's sampler picks it (or ``make_batch``)."""
    every = range(global_batch_size)
    data = fit_data(workload, data, cfg.seed)
    source = (
        BatchSource(data, global_batch_size, cfg.seed, every, every, prefetch=False)
        if data is not None
        else None
    )
    for step in range(cfg.steps):
        if source is not None:
            yield source.batch(step)
        else:
            yield workload.make_batch(global_batch_size, cfg.seed + step)


def _rows(inputs: Any) -> int:
    first = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    return int(first.shape[0])


def _grads(
    m: _Model, workload: Workload, cfg: TrainConfig, step: int, batch: tuple[Any, Any]
) -> float:
    """Forward and backward of step ``step``'s full batch (every tied copy of the chain gets
    the sum); random sites keyed as the runtime keys them (:mod:`dapple.models.rng`)."""
    inputs, targets = batch
    with contextlib.ExitStack() as rng:
        rng.enter_context(keyed(cfg.seed, step, 0, _rows(inputs)))
        if m.sites is not None:
            rng.enter_context(KeyedRandomness(m.sites))
        with autocast_reference(cfg.precision) as cast:
            output = _call(m.model, inputs)
    loss = workload.loss_fn(cast(output), targets)
    torch.autograd.backward([loss])
    if m.is_chain:
        sum_tied_grads_local(list(m.chain), workload.tied_parameters)
    return float(loss.detach())


def _update(m: _Model, opt: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> float:
    """Global norm, clipping and the optimizer step on the gradients the parameters hold."""
    grads = [p.grad for p in m.counted if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if cfg.clip_grad_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(list(m.model.parameters()), cfg.clip_grad_norm, total)
    set_lr(opt, config_lr(cfg, step))
    opt.step()
    return float(total)


def _weights(m: _Model) -> Params:
    """Every layer's weights (parameter-free layers too, as empty dicts)."""
    out: Params = {i: {} for i in range(len(m.chain))}
    for (i, n), p in m.by_layer.items():
        out.setdefault(i, {})[n] = p.detach().clone()
    return out


def reference_run(
    workload: Workload,
    global_batch_size: int,
    steps: int,
    *,
    seed: int = 0,
    optimizer: str = "sgd",
    lr: float = 0.01,
    data: Dataset[Any] | None = None,
    precision: str = "fp32",
    **optim: Any,
) -> tuple[list[float], Params, str]:
    """Train ``steps`` full-batch steps in this process, as the runtime would on one device.

    Args:
        workload: The model, data and loss.
        global_batch_size: Samples per step (``make_batch(G, seed + step)``).
        steps: Optimizer steps.
        seed: Weights seed (``build_model(seed)`` / ``original_model(workload, seed)``).
        optimizer: ``sgd``, ``adam`` or ``adamw``.
        lr: Learning rate (the schedule's peak).
        data: Training samples; step ``t`` takes the global batch the runtime's sampler picks
            (:class:`~dapple.datasets.BatchSource`, seeded by ``seed``). None: ``make_batch``.
        precision: ``fp32`` or ``bf16``: the forward runs under the runtime's CPU autocast,
            the loss in fp32.
        **optim: The other optimisation fields of :class:`TrainConfig`
            (:data:`~dapple.runtime.train_config.OPTIM_FIELDS`).

    Returns:
        The loss of each step, the final parameters per layer (named as in the layers) and
        which reference ran (``original model`` or ``layer chain``).

    Raises:
        ValidationError: Bad optimisation options.
    """
    cfg = replace(config(steps, seed, optimizer, lr, optim), precision=precision)
    workload = fit_workload(workload, data)
    m = _model(workload, seed)
    opt = make_optimizer(cfg, list(m.model.parameters()))
    losses = []
    for step, batch in enumerate(_batches(workload, global_batch_size, cfg, data)):
        opt.zero_grad(set_to_none=True)
        losses.append(_grads(m, workload, cfg, step, batch))
        _update(m, opt, cfg, step)
    return losses, _weights(m), m.kind


@dataclass(frozen=True, slots=True)
class StepResult:
    """The reference's side of one step of :class:`ForcedReference`."""

    loss: float
    """The full batch's loss on the distributed run's weights."""
    grad_norm: float
    """The global norm of the reference's gradients (before clipping)."""
    grads: Params
    """The reference's gradients on the distributed run's weights."""
    expected: Params
    """The weights after the reference optimizer's update of the distributed run's weights by
    the distributed run's gradients."""


class ForcedReference:
    """The reference stepped along a distributed run: each step starts from the distributed
    run's weights of that step, computes the full batch's loss and gradients there, and
    applies the reference optimizer (whose state has seen the distributed gradients of every
    earlier step) to the distributed run's gradients.

    So each step's gradients are compared on the same weights, and each update from the same
    gradients: differences in summation order never compound, and an optimizer that magnifies
    tiny gradients (Adam: any gradient moves a weight by about lr) sees identical inputs.

    Args:
        workload: The model, data and loss.
        global_batch_size: Samples per step.
        cfg: Steps, seed, precision and the optimisation options.
        data: Training samples (None: ``make_batch``).
    """

    def __init__(
        self,
        workload: Workload,
        global_batch_size: int,
        cfg: TrainConfig,
        data: Dataset[Any] | None = None,
    ) -> None:
        self.workload = fit_workload(workload, data)
        self.cfg = cfg
        self.m = _model(self.workload, cfg.seed)
        self.initial = _weights(self.m)
        """The weights every rank must start from."""
        self.opt = make_optimizer(cfg, list(self.m.model.parameters()))
        self._batches = _batches(self.workload, global_batch_size, cfg, data)

    @property
    def kind(self) -> str:
        return self.m.kind

    def step(self, step: int, weights: Params, grads: Params) -> StepResult:
        """Step ``step`` from the distributed ``weights`` (every layer) with the distributed
        ``grads`` (every layer, whole parameters).

        Raises:
            ValidationError: a parameter is missing from ``weights`` or ``grads``.
        """
        m = self.m
        with torch.no_grad():
            for (i, n), p in m.by_layer.items():
                p.copy_(_take(weights, i, n, "weights", step))
        self.opt.zero_grad(set_to_none=True)
        loss = _grads(m, self.workload, self.cfg, step, next(self._batches))
        mine: Params = {i: {} for i in range(len(m.chain))}
        for (i, n), p in m.by_layer.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            mine.setdefault(i, {})[n] = g.detach().clone()
        norm = float(
            torch.nn.utils.get_total_norm([p.grad for p in m.counted if p.grad is not None])
        )
        for (i, n), p in m.by_layer.items():
            p.grad = _take(grads, i, n, "gradients", step).clone().to(p.dtype)
        _update(m, self.opt, self.cfg, step)
        return StepResult(loss, norm, mine, _weights(m))


def _take(params: Params, i: int, name: str, what: str, step: int) -> torch.Tensor:
    t = params.get(i, {}).get(name)
    if t is None:
        raise ValidationError(
            f"step {step}: the distributed run recorded no {what} of layer {i} {name!r}"
        )
    return t

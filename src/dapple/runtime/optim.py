"""The update of a step: optimizer, learning-rate schedule and global gradient-norm clipping.

Design choices:
    - Parameter groups: a parameter decays (``weight_decay``) iff ``ndim >= 2`` (weight matrices,
      embeddings, convolution kernels); biases and normalisation weights (``ndim < 2``) never
      do (:func:`decays`). The rule reads only the parameter's shape, so a stage of any plan and
      the one-process reference in :mod:`dapple.runtime.verify` make the same groups, and the
      copies of a tied parameter (same shape) all land in the same group.
    - The learning rate is a pure function of the step index, :func:`lr_at`, written into every
      parameter group right before each optimizer step: a resumed run continues the schedule
      exactly (the checkpoint's step is the next step's index) with no scheduler state.
    - The global gradient norm ``||g||_2`` of the *whole original model* is computed on every
      step, clipping or not, and reported as ``StepMetrics.grad_norm``; it costs one pass over
      the gradients and one float64 per rank in the step's one all_gather, which every rank
      joins anyway (:meth:`dapple.runtime.guard.NonFiniteGuard.agree_finite`): each rank's squared
      norm (:meth:`ModelUpdate.local_sq_norm`, after the tied sums; 0 beyond the plan) travels
      in its row, the sum of the rows is the square of the norm on the device (clipping reads
      nothing on the host) and rank 0 reads the norm with the rest of the row - no collective
      and no host read of its own. Each parameter of the original model counts once
      (:func:`counted_parameters`): after AR(P_s, g_s) every replica of a stage holds the same
      gradient, so only replica 0 counts; after the tied sums every copy of a tied parameter
      holds the total, so only the copy in the lowest layer counts.
    - With ``grad_norm_every`` N > 1 the norm is computed on steps 0, N, 2N, ... only; on the
      others a rank's part in the row is one fused finiteness check of the same gradients
      (:meth:`ModelUpdate.local_nonfinite_part`): the guard's verdict, without the norm.
    - Clipping is ``torch.nn.utils.clip_grad_norm_``'s: float32 per-parameter norms, the total
      in float32, ``clip_coef = max_norm / (total + 1e-6)`` clamped to 1, every gradient times
      the coefficient. The squares of the per-parameter norms are summed in float64 across
      ranks (torch sums them in float32 in one process), so the two agree to float32 rounding.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dapple.core.plan import Plan
from dapple.models.workload import Workload
from dapple.runtime.train_config import TrainConfig

__all__ = [
    "CLIP_EPS",
    "COUNT_EVERY_REPLICA_ENV",
    "GradGroups",
    "ModelUpdate",
    "config_lr",
    "counted_parameters",
    "decays",
    "lr_at",
    "make_optimizer",
    "param_groups",
    "set_lr",
]

CLIP_EPS = 1e-6
"""Added to the total norm before dividing (as ``torch.nn.utils.clip_grad_norm_``)."""
COUNT_EVERY_REPLICA_ENV = "DAPPLE_TEST_GRAD_NORM_EVERY_REPLICA"
"""Test hook: when set to 1, every replica counts its gradients in the global norm (a wrong
count that ``verify`` must catch)."""


def decays(param: torch.Tensor) -> bool:
    """Whether weight decay applies to ``param``: ``ndim >= 2`` (not biases, not norm weights)."""
    return param.ndim >= 2


def param_groups(
    params: Iterable[nn.Parameter],
    weight_decay: float,
    like: Mapping[int, torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: ``{"params", "weight_decay"}`` for the decaying
    parameters (:func:`decays`) and the others (weight decay 0), empty groups left out.

    ``like`` maps ``id(p)`` of a parameter that is a piece of another (a sharded view) to the
    parameter whose group it takes."""
    ps = list(params)
    like = like or {}
    dec = [decays(like.get(id(p), p)) for p in ps]
    groups = [
        {"params": [p for p, d in zip(ps, dec, strict=True) if d], "weight_decay": weight_decay},
        {"params": [p for p, d in zip(ps, dec, strict=True) if not d], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def make_optimizer(
    config: TrainConfig,
    params: Iterable[nn.Parameter],
    like: Mapping[int, torch.Tensor] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer every rank (and the one-process reference) uses, over ``params``.

    ``sgd`` (with ``momentum``), ``adam`` or ``adamw`` (``betas``, ``eps``), weight decay per
    :func:`param_groups` (``like``: as there); the lr is ``config.lr`` until :func:`set_lr` sets a step's. Adam and
    AdamW run fused (one kernel over each parameter, CPU and CUDA): no temporaries the size of
    the stage's parameters at the step, so the step's memory is the planner's parameter state.
    """
    groups = param_groups(params, config.weight_decay, like)
    fused = True
    c = config
    if c.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=c.lr, betas=tuple(c.betas), eps=c.eps, fused=fused)  # type: ignore[arg-type]
    if c.optimizer == "adam":
        return torch.optim.Adam(groups, lr=c.lr, betas=tuple(c.betas), eps=c.eps, fused=fused)  # type: ignore[arg-type]
    return torch.optim.SGD(groups, lr=c.lr, momentum=c.momentum)


def lr_at(
    step: int,
    *,
    lr: float,
    steps: int,
    schedule: str = "constant",
    warmup_steps: int = 0,
    min_lr: float = 0.0,
) -> float:
    """The learning rate of step ``step`` (0-based; the update number is ``n = step + 1``).

    With ``W = warmup_steps`` and ``T = steps``::

        n <= W:                lr * n / W                                   (linear warm-up)
        n >  W, constant:      lr
        n >  W, cosine:        min_lr + (lr - min_lr) * (1 + cos(pi * (n - W) / (T - W))) / 2

    the cosine decay of SGDR (Loshchilov & Hutter, 2017, eq. 5) after a linear warm-up (Goyal et
    al., 2017): the first update uses ``lr / W`` (never 0), update ``W`` the peak ``lr``, the last
    update (``n = T``) ``min_lr``. Steps past ``T`` keep ``min_lr``.

    Args:
        step: the step index (``0 <= step``).
        lr: the peak learning rate.
        steps: ``T``, the run's total steps.
        schedule: ``constant`` or ``cosine``.
        warmup_steps: ``W``.
        min_lr: the cosine schedule's final lr.
    """
    n = step + 1
    if n <= warmup_steps:
        return lr * n / warmup_steps
    if schedule == "constant":
        return lr
    if n >= steps:
        return min_lr
    progress = (n - warmup_steps) / (steps - warmup_steps)  # in (0, 1): W < n < T
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def config_lr(config: TrainConfig, step: int) -> float:
    """:func:`lr_at` of ``config``'s schedule."""
    c = config
    return lr_at(step, lr=c.lr, steps=c.steps, schedule=c.lr_schedule,
                 warmup_steps=c.warmup_steps, min_lr=c.min_lr)  # fmt: skip


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the lr of every parameter group."""
    for g in optimizer.param_groups:
        g["lr"] = lr


def counted_parameters(
    plan: Plan,
    workload: Workload,
    stage: int | None,
    replica: int | None,
    module: nn.Module | None,
) -> list[nn.Parameter]:
    """The parameters of this rank whose gradients count in the global norm: each parameter of
    the original model exactly once over all ranks.

    Replica 0 of each stage counts its stage's parameters, except a copy of a tied parameter
    (``workload.tied_parameters``) that is not the group's copy in its lowest ``(layer, name)``;
    other replicas and ranks beyond the plan count nothing.
    """
    if module is None or stage is None or replica is None:
        return []
    every = os.environ.get(COUNT_EVERY_REPLICA_ENV) == "1"
    if replica != 0 and not every:
        return []
    device = plan.stages[stage].replica_devices[replica]
    layers = dict(zip(plan.layers_of_device(device), module.children(), strict=False))
    keep: set[int] = set()
    drop: set[int] = set()
    for group in workload.tied_parameters:
        first = min((int(i), str(n)) for i, n in group)
        for i, name in group:
            if i in layers:
                p = layers[i].get_parameter(name)
                (keep if (int(i), str(name)) == first else drop).add(id(p))
    return [p for p in module.parameters() if id(p) not in drop - keep]


_NORM_OUT = torch.ops.aten._foreach_norm.Scalar_out
"""``torch._foreach_norm`` writing into given tensors (no Python binding takes ``out``)."""


def _local_grad(g: torch.Tensor) -> torch.Tensor:
    """A gradient as this rank holds it (a ZeRO-3 DTensor's own shard)."""
    return g.to_local() if isinstance(g, DTensor) else g


class GradGroups:
    """Parameters grouped by device and dtype, once: each group's gradients are what one
    ``torch._foreach_*`` call takes (tensors of one device and dtype), gathered each step
    without a Python call per parameter.

    A gradient has its parameter's dtype and device, so the groups hold for every step; a
    DTensor parameter (ZeRO-3, FSDP) contributes its gradient's local shard.
    """

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        kinds: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            kinds.setdefault((p.device, p.dtype), []).append(p)
        self.groups = list(kinds.values())
        """The parameters of each (device, dtype), in their first appearance's order."""
        self.dtypes = [ps[0].dtype for ps in self.groups]
        self._dtensor = any(isinstance(p, DTensor) for ps in self.groups for p in ps)
        self._norm_out: list[tuple[torch.Tensor, list[torch.Tensor], torch.Tensor] | None] = [
            None
        ] * len(self.groups)
        """Per group on the CPU: a vector of one norm per parameter, its elements as views
        (:meth:`norms` writes into them) and a float64 vector as long (:meth:`float64`), made
        at the first call."""

    def _found(self) -> list[list[torch.Tensor]]:
        """Each group's gradients as this rank holds them (missing ones left out)."""
        if self._dtensor:
            return [[_local_grad(p.grad) for p in ps if p.grad is not None] for ps in self.groups]
        return [[p.grad for p in ps if p.grad is not None] for ps in self.groups]

    def grads(self) -> list[tuple[torch.dtype, list[torch.Tensor]]]:
        """Each group's dtype and its parameters' gradients as this rank holds them (missing
        gradients left out, groups without any too)."""
        return [(d, gs) for d, gs in zip(self.dtypes, self._found(), strict=True) if gs]

    def norms(self) -> list[torch.Tensor]:
        """Per group with gradients: its gradients' L2 norms (``torch._foreach_norm``, in the
        gradients' dtype) as one vector.

        On the CPU, where ``_foreach_norm`` runs one norm per gradient, the norms of a group
        whose every parameter has a gradient are written into the group's own vector (the
        ``out`` overload: one copy per gradient instead of ``stack``'s view, copy and strides);
        the vector is overwritten by the next call. Elsewhere (one fused kernel) they are
        stacked.
        """
        out: list[torch.Tensor] = []
        for k, gs in enumerate(self._found()):
            if not gs:
                continue
            if gs[0].device.type != "cpu" or len(gs) != len(self.groups[k]):
                out.append(torch.stack(torch._foreach_norm(gs, 2.0)))
                continue
            held = self._norm_out[k]
            if held is None:
                vec = torch.zeros(len(gs), dtype=gs[0].dtype)
                vec64 = torch.zeros(len(gs), dtype=torch.float64)
                held = self._norm_out[k] = (vec, list(vec.unbind()), vec64)
            _NORM_OUT(gs, 2.0, out=held[1])
            out.append(held[0])
        return out

    def float64(self, norms: torch.Tensor) -> torch.Tensor:
        """A vector of :meth:`norms` as float64: one it holds is copied into a float64 vector
        held beside it (``copy_`` converts: no allocation per step), any other converted."""
        for held in self._norm_out:
            if held is not None and held[0] is norms:
                return held[2].copy_(norms)
        return norms.to(torch.float64)

    def flat(self) -> list[torch.Tensor]:
        """Every gradient of :meth:`grads`, in one list."""
        return [g for _, gs in self.grads() for g in gs]


def _local_sq_norm(groups: GradGroups, device: torch.device) -> torch.Tensor:
    """Sum over ``groups``' parameters of the square of each gradient's float32 norm, in
    float64.

    One group's norms (one dtype: the common case) on the CPU are copied into the float64
    vector ``groups`` holds beside them (:meth:`GradGroups.float64`); several groups' are
    converted and concatenated."""
    norms = groups.norms()
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    if len(norms) == 1 and norms[0].device == device:
        v = groups.float64(norms[0])
    else:
        v = torch.cat([n.to(device, torch.float64) for n in norms])
    return v.dot(v)  # the squares' sum in one op


class ModelUpdate:
    """The end of one rank's step, at ``OPT`` after the tied sums: global gradient norm,
    clipping, the step's lr and the optimizer step (see the module docstring).

    Every rank creates one; a rank beyond the plan (no parameters) calls :meth:`join` where
    the others call :meth:`step`. Before either, the step's collective carries
    :meth:`local_sq_norm` and :meth:`set_norm` takes the sum.

    Attributes:
        lr: the lr of the last update (None: no update ran since :meth:`take_report`).
        grad_norm: the global norm before clipping of the last update, as read on the host.
        total: the same norm on the device (a 0-d float32 tensor: what clipping uses; None
            when nothing clips).
        observer: called with the step index at the start of :meth:`step`, when the
            gradients of ``params`` are final and unclipped and the weights not yet updated
            (``dapple verify`` records both there).
    """

    def __init__(
        self,
        config: TrainConfig,
        optimizer: torch.optim.Optimizer | None,
        params: list[nn.Parameter],
        counted: list[nn.Parameter],
        device: torch.device,
    ) -> None:
        self.config, self.optimizer, self.params = config, optimizer, params
        self.counted, self.device = counted, device
        self._counted = GradGroups(counted)
        self._clipped = GradGroups(params)
        self.lr: float | None = None
        self.grad_norm: float | None = None
        self.total: torch.Tensor | None = None
        self.observer: Callable[[int], None] | None = None
        self._found = torch.zeros(1, dtype=torch.float32, device=device)
        """:meth:`local_nonfinite_part`'s flag: 1 after a check found a non-finite gradient."""
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        """The check's "inverse scale": 1, so the gradients keep their values."""

    def norm_due(self, step: int) -> bool:
        """Whether step ``step`` computes the global norm (``grad_norm_every``)."""
        return step % self.config.grad_norm_every == 0

    def local_sq_norm(self) -> torch.Tensor:
        """This rank's part of ``||g||_2^2``: the squares of its counted gradients' float32
        norms, summed in float64 on the device (0 with nothing counted)."""
        return _local_sq_norm(self._counted, self.device)

    def local_nonfinite_part(self) -> torch.Tensor | float:
        """On a step without the norm (:meth:`norm_due`), what stands in its place in the
        step's row for the guard: 0 when this rank's counted gradients (those the norm would
        read) are all finite, else non-finite (0 with nothing counted).

        One fused check per (device, dtype) group, ``torch._amp_foreach_non_finite_check_and_
        unscale_`` by an inverse scale of 1 (the gradients keep their values), into a held
        flag ``f`` (1 when one was not finite); the part is ``log1p(-f)``: 0 or ``-inf``."""
        groups = self._counted.grads()
        if not groups:
            return 0.0
        found = self._found.zero_()
        for _, grads in groups:
            on = grads[0].device
            if on == found.device:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self._one)
            else:  # a group on another device: its own flag, added in
                flag = torch.zeros(1, dtype=torch.float32, device=on)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, self._one.to(on))
                found.add_(flag.to(found.device))
        return found.neg().log1p().reshape(())

    @property
    def clips(self) -> bool:
        """Whether :meth:`step` clips (``clip_grad_norm``): only then does it read the norm on
        the device."""
        return self.config.clip_grad_norm is not None

    def set_norm(self, sq_total: torch.Tensor | None, reported: float | None) -> None:
        """The step's ``||g||_2^2`` summed over every rank's part (on the device; None when
        nothing clips: :attr:`clips`) and the norm rank 0 read with the step's collective
        (``StepMetrics.grad_norm``; None on a step without the norm, :meth:`norm_due`)."""
        self.total = None if sq_total is None else sq_total.sqrt().float()
        self.grad_norm = reported

    def step(self, step: int) -> None:
        """Clipping (``clip_grad_norm``) by the norm of :meth:`set_norm`, ``lr_at(step)``,
        optimizer step."""
        if self.observer is not None:
            self.observer(step)
        max_norm = self.config.clip_grad_norm
        grads = self._clipped.flat() if max_norm is not None else []
        if max_norm is not None and grads:
            total = self.total
            assert total is not None, "set_norm comes first"
            coef = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        self.lr = config_lr(self.config, step)
        if self.optimizer is not None:
            set_lr(self.optimizer, self.lr)
            self.optimizer.step()

    def join(self, step: int) -> None:
        """A rank beyond the plan (its part of the norm was 0): it reports like the rest."""
        self.lr = config_lr(self.config, step)

    def take_report(self) -> dict[str, float | None]:
        """The last update's ``lr`` and ``grad_norm`` (as :class:`StepMetrics` fields), then
        forget them (a skipped step reports None)."""
        out = {"lr": self.lr, "grad_norm": self.grad_norm}
        self.lr, self.grad_norm, self.total = None, None, None
        return out

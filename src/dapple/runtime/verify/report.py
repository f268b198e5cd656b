"""What ``dapple verify`` compares and reports: per-stage differences of the gradients and of
the weights, per-step losses and global gradient norms, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dapple.core.plan import Plan
from dapple.errors import ValidationError

__all__ = [
    "ATOL",
    "GRAD_NORM_RTOL",
    "GRAD_RTOL",
    "RTOL",
    "GradPiece",
    "Params",
    "StageDiff",
    "VerifyReport",
    "grad_diffs",
    "merge",
    "stage_diffs",
]

RTOL = 1.3e-6
"""Relative tolerance of a weight after one update from identical gradients (float32's
``torch.testing.assert_close`` default: the update's arithmetic rounds, nothing else)."""
ATOL = 1e-5
"""Absolute tolerance of a weight after one update from identical gradients."""
GRAD_RTOL = 1e-4
"""A gradient element may differ from the reference's by this fraction of the largest gradient
element of its layer (float32: the two runs add the same terms in another order, micro-batch by
micro-batch and replica by replica; rounding is a few ulps of the terms, and terms are at most
the layer's scale times the batch's spread). A missing micro-batch, replica or tied copy moves
the gradient by a sizeable fraction of its scale."""
GRAD_NORM_RTOL = 1e-4
"""Relative tolerance of each step's loss and global gradient norm (float32 sums of the same
terms in another order; a miscounted parameter or micro-batch is off by far more)."""

Params = dict[int, dict[str, torch.Tensor]]
"""Layer index -> parameter name (as in the layer) -> value."""

GradPiece = tuple[int, str, int, torch.Tensor]
"""What one rank's optimizer updates of one parameter: ``(layer, name, offset, gradient)``, the
gradient flattened and starting at ``offset`` of the parameter's flattened elements."""


@dataclass(frozen=True, slots=True)
class StageDiff:
    """How far one stage (all replicas, every step) was from the reference."""

    stage: int
    layers: tuple[int, int]
    """Layer range ``[start, end)``."""
    replicas: int
    num_params: int
    """Parameter elements of the stage (one replica)."""
    max_abs_diff: float
    """Largest ``|distributed - expected|`` weight difference over the stage's parameters,
    replicas and steps (expected: the initial weights, then each step's update of the
    distributed weights with the distributed gradients by the reference's optimizer)."""
    max_rel_diff: float
    """Largest ``|distributed - expected| / |expected|`` over elements with ``|expected| >
    atol`` (smaller ones are judged by the absolute tolerance; 0 if there are none)."""
    ok: bool
    """Every weight element within ``atol + rtol * |expected|`` (and the gradients within
    ``grad_rtol``, see :attr:`grad_ok`)."""
    worst: str = ""
    """The weight with the largest absolute difference, ``step t layer i name``."""
    max_grad_diff: float = 0.0
    """Largest gradient difference over the stage's parameters, replicas and steps, as a
    fraction of the largest reference gradient element of its layer."""
    grad_ok: bool = True
    """Every gradient within ``grad_rtol`` of its layer's scale."""
    grad_worst: str = ""
    """The gradient with the largest difference, ``step t layer i name``."""
    first_failure: str = ""
    """The first check out of tolerance, e.g. ``step 0 gradient of layer 2 fc.weight``
    (empty: none): where the run first went wrong, as later steps inherit its weights."""


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """Result of :func:`dapple.runtime.verify.verify`: per-stage differences, per-step losses
    and gradient norms of both runs."""

    plan: Plan
    model_name: str
    reference: str
    """``original model`` or ``layer chain`` (see :mod:`dapple.runtime.verify`)."""
    stages: tuple[StageDiff, ...]
    losses: tuple[float, ...]
    """Distributed loss of each step (before its update)."""
    reference_losses: tuple[float, ...]
    """The reference's loss of each step, on the distributed run's weights of that step."""
    rtol: float = RTOL
    atol: float = ATOL
    options: dict[str, Any] = field(default_factory=dict)
    """Seed, optimizer, learning rate and the other optimisation options of both runs."""
    grad_norms: tuple[float, ...] = ()
    """Distributed global gradient norm of each step, before clipping."""
    reference_grad_norms: tuple[float, ...] = ()
    grad_norm_rtol: float = GRAD_NORM_RTOL
    """Relative tolerance of each step's loss and gradient norm."""
    grad_rtol: float = GRAD_RTOL

    @property
    def ok(self) -> bool:
        """Every stage's gradients and weights, every step's loss and gradient norm within
        tolerance."""
        return (
            all(s.ok and s.grad_ok for s in self.stages) and self.grad_norms_ok and self.losses_ok
        )

    @property
    def grad_norms_ok(self) -> bool:
        """Every step's global gradient norm within ``grad_norm_rtol`` of the reference's."""
        return _close(self.grad_norms, self.reference_grad_norms, self.grad_norm_rtol)

    @property
    def losses_ok(self) -> bool:
        """Every step's loss within ``grad_norm_rtol`` of the reference's."""
        return _close(self.losses, self.reference_losses, self.grad_norm_rtol)

    @property
    def failures(self) -> list[str]:
        """What is out of tolerance, one line each (empty when :attr:`ok`)."""
        out = [
            f"stage {s.stage}: {s.first_failure}"
            for s in self.stages
            if not (s.ok and s.grad_ok) and s.first_failure
        ]
        if not self.losses_ok:
            out.append(
                f"losses differ from the reference's by more than rtol {self.grad_norm_rtol:g}"
            )
        if not self.grad_norms_ok:
            out.append(
                "gradient norms differ from the reference's by more than "
                f"rtol {self.grad_norm_rtol:g}"
            )
        return out

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.stages), default=0.0)

    @property
    def max_grad_diff(self) -> float:
        return max((s.max_grad_diff for s in self.stages), default=0.0)

    @property
    def max_loss_diff(self) -> float:
        return max(
            (abs(a - b) for a, b in zip(self.losses, self.reference_losses, strict=True)),
            default=0.0,
        )

    def __str__(self) -> str:
        """A short summary: the verdict, the run, the largest differences against their
        tolerances and the first check out of tolerance (``repr`` keeps every field)."""
        plan, opts, n = self.plan, self.options, len(self.losses)
        lines = [
            f"verify {'OK' if self.ok else 'MISMATCH'}: {self.model_name} on "
            f"{plan.replication} ({plan.schedule}, policy {plan.policy}), {n} "
            f"step{'s' * (n != 1)} {opts.get('precision', 'fp32')} vs the {self.reference}",
            f"  largest gradient difference {self.max_grad_diff:.3g} of its layer's scale "
            f"(tolerance {self.grad_rtol:g})",
            f"  largest weight difference after an update {self.max_abs_diff:.3g} "
            f"(rtol {self.rtol:g}, atol {self.atol:g})",
            f"  largest loss difference {self.max_loss_diff:.3g} (rtol {self.grad_norm_rtol:g})",
        ]
        lines += [f"  out of tolerance: {line}" for line in self.failures]
        return "\n".join(lines)


def _close(got: tuple[float, ...], ref: tuple[float, ...], rtol: float) -> bool:
    if len(got) != len(ref):
        return False
    return all(abs(a - b) <= rtol * abs(b) for a, b in zip(got, ref, strict=True))


def stage_diffs(
    plan: Plan,
    reference: Params,
    runs: list[dict[str, Any]],
    rtol: float,
    atol: float,
    label: str = "",
) -> tuple[StageDiff, ...]:
    """Every replica's weights (``runs``: one ``{"stages", "replica", "layers"}`` per rank)
    against ``reference``, per stage.

    Raises:
        ValidationError: a replica or a parameter is missing, or has another shape.
    """
    out = []
    for s, st in enumerate(plan.stages):
        lo, hi = st.layers
        mine = [r for r in runs if s in r["stages"]]
        if len({int(r["replica"]) for r in mine}) != st.replicas:  # t_s ranks per replica
            raise ValidationError(
                f"stage {s}: got the weights of {len(mine)} replicas, expected {st.replicas}"
            )
        n_el, max_abs, max_rel, ok, worst, first = 0, 0.0, 0.0, True, "", ""
        for i in range(lo, hi):
            for name, ref in reference[i].items():
                n_el += ref.numel()
                for r in mine:
                    got = r["layers"][i].get(name)
                    if got is None or got.shape != ref.shape:
                        raise ValidationError(
                            f"stage {s} replica {r['replica']}: layer {i} parameter {name!r} "
                            "missing or of another shape than the reference"
                        )
                    diff = (got.double() - ref.double()).abs()
                    if diff.numel() == 0:
                        continue
                    a = float(diff.max())
                    mag = ref.double().abs()
                    big = mag > atol
                    rel = float((diff[big] / mag[big]).max()) if big.any() else 0.0
                    within = bool((diff <= atol + rtol * mag).all())
                    if not within and not first:
                        first = f"{label}weights of layer {i} {name} (replica {r['replica']})"
                    ok = ok and within
                    if a > max_abs or not worst:
                        max_abs, worst = max(a, max_abs), f"{label}layer {i} {name}"
                    max_rel = max(max_rel, rel)
        out.append(
            StageDiff(
                s, (lo, hi), st.replicas, n_el, max_abs, max_rel, ok, worst, first_failure=first
            )
        )
    return tuple(out)


def layer_scales(grads: Params) -> dict[int, float]:
    """The largest gradient element of each layer (the scale its rounding is judged by)."""
    return {
        i: max((float(g.abs().max()) for g in layer.values() if g.numel()), default=0.0)
        for i, layer in grads.items()
    }


def grad_diffs(
    plan: Plan,
    reference: Params,
    runs: list[dict[str, Any]],
    rtol: float,
    label: str = "",
) -> tuple[StageDiff, ...]:
    """Every rank's gradients (``runs``: ``{"stages", "replica", "grads": [GradPiece]}``)
    against the reference's gradients on the same weights, per stage: the largest difference
    as a fraction of its layer's scale (:func:`layer_scales`), ``ok`` within ``rtol``.

    Raises:
        ValidationError: a rank's gradient names a parameter the reference lacks.
    """
    scales = layer_scales(reference)
    out = []
    for s, st in enumerate(plan.stages):
        worst, top, n_el, first = "", 0.0, 0, ""
        for i in range(*st.layers):
            n_el += sum(t.numel() for t in reference[i].values())
        for r in (r for r in runs if s in r["stages"]):
            for i, name, offset, got in r["grads"]:
                if not st.layers[0] <= i < st.layers[1]:
                    continue
                ref = reference.get(i, {}).get(name)
                if ref is None or offset + got.numel() > ref.numel():
                    raise ValidationError(
                        f"stage {s} replica {r['replica']}: a gradient of layer {i} {name!r} "
                        "that the reference does not hold"
                    )
                part = ref.reshape(-1)[offset : offset + got.numel()]
                diff = float((got.double() - part.double()).abs().max()) if got.numel() else 0.0
                scale = scales[i]
                rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
                if rel != rel:  # NaN
                    rel = float("inf")
                if rel > rtol and not first:
                    first = f"{label}gradient of layer {i} {name} (replica {r['replica']})"
                if rel > top or not worst:
                    top, worst = max(rel, top), f"{label}layer {i} {name}"
        out.append(
            StageDiff(
                s,
                st.layers,
                st.replicas,
                n_el,
                0.0,
                0.0,
                True,
                "",
                max_grad_diff=top,
                grad_ok=top <= rtol,
                grad_worst=worst,
                first_failure=first,
            )
        )
    return tuple(out)


def merge(a: StageDiff, b: StageDiff) -> StageDiff:
    """One stage's two comparisons (weights or gradients of two steps) as one: the larger
    differences, both verdicts."""
    weights = b if b.max_abs_diff > a.max_abs_diff or not a.worst else a
    grads = b if b.max_grad_diff > a.max_grad_diff or not a.grad_worst else a
    return StageDiff(
        a.stage,
        a.layers,
        a.replicas,
        a.num_params,
        weights.max_abs_diff,
        max(a.max_rel_diff, b.max_rel_diff),
        a.ok and b.ok,
        weights.worst,
        grads.max_grad_diff,
        a.grad_ok and b.grad_ok,
        grads.grad_worst,
        a.first_failure or b.first_failure,
    )

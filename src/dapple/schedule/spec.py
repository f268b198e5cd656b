"""What one schedule declares: a :class:`ScheduleSpec` per schedule module, read through
:mod:`dapple.schedule.registry` by the CLI, the planner, the cost model, the simulator and the
runtime.

A schedule module (``fill_drain``, ``early_backward``, ``interleaved``, ``zerobubble``, or a
plug-in outside dapple) holds its generator and its rules and ends with
``SCHEDULE = ScheduleSpec(...)``. Its parts:

* the generator: the compute order of each pipeline rank for a :class:`Shape`
  (:data:`~dapple.schedule.ir.ComputeOrder`, checked by
  :func:`~dapple.schedule.validate.validate_compute_order` and lowered by
  :func:`~dapple.schedule.lower.lower`);
* what it needs from the runtime: the backward split into ``I`` and ``W``
  (``split_backward``), v model chunks per device group (``chunks``), placed on the groups by
  ``placement`` (round robin, or a V) and cut from a plan of one stage per group by ``cut``;
* its memory rule: K_i, the micro-batches whose activations stage i holds at most
  (``in_flight``), which the cost model's L (equations 1-3) and the planner's scorer read;
* its step time: None for the paper's L over those K_i, or its own rule over
  :class:`StepTerms` (:func:`dapple.schedule.replay.replayed_step_ms` for interleaved 1F1B,
  ZB-H1, ZB-V and DualPipeV: the longest path through the compute order);
* its validation rules beyond :class:`~dapple.core.plan.Plan`'s (``check``, e.g. M a multiple
  of the device groups);
* how it is shown: ``title`` and ``label`` templates over ``{policy}`` and ``{v}``.

Pure, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dapple.core.plan import Plan, Policy
from dapple.errors import ValidationError
from dapple.schedule.ir import ComputeOrder

__all__ = [
    "POLICIES",
    "LinkTimes",
    "ScheduleSpec",
    "Shape",
    "StageTimes",
    "StepTerms",
    "round_robin",
]

POLICIES: tuple[Policy, ...] = ("A", "B")
"""Warm-up policies a plan can carry (section 6.3): A ``K_i = min(S-i, D)``, B
``min(2(S-i)-1, D)``."""

_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """The pipeline a generator or a memory rule is asked about."""

    P: int
    """Pipeline ranks (device groups); the stages are S = P·v."""
    M: int
    """Micro-batches."""
    policy: str = "A"
    """Warm-up policy (schedules whose ``policies`` hold more than A)."""
    D: int | Sequence[int | None] | None = None
    """In-flight bound per stage, one value for all, or None (``bounded`` schedules only)."""
    v: int = 1
    """Model chunks per rank (``chunks`` schedules; 1 for the others)."""


@dataclass(frozen=True, slots=True)
class StageTimes:
    """One stage's compute for one micro-batch: its slowest replica's slice, in ms."""

    forward_ms: float
    """F_s."""
    backward_ms: float
    """B_s, re-computation included."""
    input_grad_ms: float
    """I_s, the input-gradient half of the split backward (re-computed forward included)."""
    weight_grad_ms: float
    """W_s, the weight-gradient half."""


@dataclass(frozen=True, slots=True)
class LinkTimes:
    """One stage boundary k|k+1 for one micro-batch: the slowest replica's transfers, in ms."""

    forward_ms: float
    """Activations from stage k to k+1 (0 when both run on one device group)."""
    backward_ms: float
    """Their gradients back from k+1 to k."""
    latency_ms: float
    """The link latency within them: it delays the arrival but does not hold the way out."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTerms:
    """What a schedule's own step-time rule reads (filled by
    :func:`dapple.cost.schedule_step.schedule_step_ms` from the plan's cost terms)."""

    M: int
    """Micro-batches."""
    P: int
    """Device groups; ``len(stages) = P·v``."""
    v: int
    """Model chunks per device group."""
    order: ComputeOrder
    """The plan's compute order: device group -> its ordered compute actions."""
    stages: tuple[StageTimes, ...]
    """Per (virtual) stage in pipeline order, host CPU extras included."""
    links: tuple[LinkTimes, ...]
    """Per boundary k|k+1 between (virtual) stages."""
    tails: tuple[float, ...]
    """Per device group, what it does once after its last compute: its replicated stages'
    gradient synchronisation and its optimizer step."""
    updates: tuple[float, ...] = ()
    """Per device group, the part of its tail after the step point: its optimizer step (empty:
    none, the whole tail before it)."""
    overlapped: bool = False
    """No group waits at the step point (``on_nonfinite`` off, the ``POST`` step point):
    consecutive steps overlap and the step time is their steady period; False: every group
    waits in the step's collective (``AGREE``) before its update."""


def round_robin(k: int, P: int, v: int) -> int:
    """Virtual stage k runs on device group k mod P (interleaved 1F1B; every unchunked plan)."""
    return k % P


OrderRule = Callable[[Shape], ComputeOrder]
Placement = Callable[[int, int, int], int]
"""(virtual stage k, device groups P, chunks v) -> the device group that runs stage k."""
CutRule = Callable[[Plan, int], Plan]
"""(a plan of one stage per device group, v) -> the plan with v chunks per group."""
InFlightRule = Callable[[Shape], list[int]]
StepRule = Callable[[StepTerms], float]
PlanRule = Callable[[Plan], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleSpec:
    """One schedule, as its module declares it (module docstring)."""

    name: str
    """What plans, the CLI (``--schedule``) and the Python API call it: lower case letters,
    digits, ``-`` and ``_``."""
    title: str
    """Display name, a template over ``{policy}`` and ``{v}``: ``DAPPLE (policy {policy})``."""
    order: OrderRule
    """The generator: rank -> ordered compute actions for a :class:`Shape`."""
    in_flight: InFlightRule | None = None
    """Memory rule: K_i per stage for a :class:`Shape` with P = S (one stage per rank); None:
    no per-stage count (the cost model then needs ``step_ms``)."""
    step_ms: StepRule | None = None
    """The step time over :class:`StepTerms`; None: the paper's L over the K_i of
    ``in_flight`` (equations 1-3)."""
    label: str = ""
    """Short label in schedule comparisons, a template like ``title``; default ``name``."""
    bounded: bool = False
    """The warm-up obeys each stage's in-flight bound D (``StagePlan.max_in_flight``) and K_i
    bounds the steady period (DAPPLE); otherwise every stage must hold its K_i."""
    policies: tuple[Policy, ...] = ("A",)
    """Warm-up policies the planner's scorer tries."""
    variants: tuple[tuple[Policy, int], ...] = (("A", 1),)
    """``(policy, v)`` of each column of the schedule comparison
    (:func:`dapple.planner.schedule_choice.best_per_schedule`)."""
    split_backward: bool = False
    """The runtime runs the backward as ``I`` then ``W`` (:mod:`dapple.models.split_backward`)."""
    chunks: bool = False
    """Takes v > 1 model chunks per device group (``Plan.virtual_stages``)."""
    chunk_count: int | None = None
    """The v it always takes (ZB-V: 2, two chunks per device group); None: the v asked for."""
    placement: Placement = round_robin
    """Which device group runs each virtual stage (:data:`Placement`); the first P stages
    must be groups 0..P-1 in order."""
    cut: CutRule | None = None
    """How a plan of one stage per device group becomes v chunks per group, placed by
    ``placement``; None: :func:`dapple.core.plan.interleave` (round robin)."""
    check: PlanRule | None = None
    """Rules a plan must meet beyond :class:`~dapple.core.plan.Plan`'s, run when a plan is put
    under the schedule (:func:`dapple.simulate.plan_variants.with_schedule`); raises
    :class:`~dapple.errors.ValidationError`."""
    compare_with: str = ""
    """The schedule ``dapple simulate --other-schedule`` runs beside this one; empty: the default
    schedule (``Plan.schedule``'s default)."""
    baseline: bool = False
    """Shown first when compared (GPipe, the paper's baseline)."""
    module: str = ""
    """The importable module that defines it (``SCHEDULE``); default: the generator's. A plan
    under a schedule outside dapple records it, so that any process loading the plan finds
    the schedule (:mod:`dapple.schedule.registry`)."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValidationError(
                f"schedule name must be lower case letters, digits, '-' or '_', got {self.name!r}"
            )
        if self.step_ms is None and self.in_flight is None:
            raise ValidationError(
                f"schedule {self.name!r}: give in_flight (the paper's L reads K_i) or step_ms"
            )
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise ValidationError(
                f"schedule {self.name!r}: policies must be some of {POLICIES}, got {self.policies}"
            )
        if self.chunk_count is not None and (not self.chunks or self.chunk_count < 2):
            raise ValidationError(
                f"schedule {self.name!r}: chunk_count={self.chunk_count} needs chunks=True and "
                "a count >= 2"
            )
        for policy, v in self.variants:
            if policy not in self.policies or v < 1 or (v > 1 and not self.chunks):
                raise ValidationError(
                    f"schedule {self.name!r}: variant (policy {policy!r}, v={v}) needs a policy "
                    f"of {self.policies} and v >= 1 (v > 1 only with chunks)"
                )
        for template in (self.title, self.label):
            try:
                template.format(policy="A", v=1)
            except (KeyError, IndexError, ValueError) as e:
                raise ValidationError(
                    f"schedule {self.name!r}: {template!r} may use only {{policy}} and {{v}}"
                ) from e
        if not self.module:
            object.__setattr__(self, "module", self.order.__module__)

    @property
    def uses_pipeline_latency(self) -> bool:
        """Costed by the paper's L over its K_i (no ``step_ms`` of its own)."""
        return self.step_ms is None

    def title_of(self, plan: Plan) -> str:
        """``title`` for ``plan``'s policy and v."""
        return self.title.format(policy=plan.policy, v=plan.virtual_stages)

    def label_of(self, policy: str, v: int) -> str:
        """``label`` (default ``name``) for one variant."""
        return (self.label or self.name).format(policy=policy, v=v)

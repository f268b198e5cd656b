"""An execution plan: stage partition, per-stage replication and placement, micro-batching.

Pure data model, no torch. Notation (paper sections 4-5): S stages; stage ``s`` holds layers
``[start, end)`` replicated r_s times (:class:`~dapple.core.stage_plan.StagePlan`, with its
tensor groups of t_s devices); the global batch is cut into M micro-batches of
``micro_batch_size`` samples, and each micro-batch entering stage ``s`` is split into ``r_s``
slices (replica ``j`` takes slice j: even, or the stage's per-replica ``shares``,
:mod:`dapple.core.slicing`). This module also holds the plan's JSON round-trip and two ways of
making a plan from another: :func:`straight_plan` and :func:`interleave`. A plan's invariants are
checked as it is made (:mod:`dapple.core.plan_checks`); its schedule by the rules the schedule
registry installs (:mod:`dapple.core.schedule_rules`).

:class:`StagePlan` and the split-concat functions (:func:`split_sizes`, :func:`slice_bounds`,
:func:`transfers`) are importable from here too.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from dapple.core._json import (
    as_float,
    check_schema_version,
    get_field,
    load_json_file,
    require,
    save_json_file,
)
from dapple.core.plan_checks import check_plan
from dapple.core.planning_options import PlanningOptions
from dapple.core.profile import comparable_fingerprints
from dapple.core.schedule_rules import group_of, load_schedule_module, module_of
from dapple.core.slicing import slice_bounds, split_sizes, transfers
from dapple.core.stage_plan import StagePlan
from dapple.errors import ValidationError

_MODULE_PART = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _is_schedule_module(name: Any) -> bool:
    """Whether ``name`` can name a schedule module: dotted identifiers, none a dunder name (a
    ``__main__`` module runs a program when imported)."""
    return isinstance(name, str) and all(
        _MODULE_PART.fullmatch(part) and not part.startswith("__") for part in name.split(".")
    )


__all__ = [
    "DEFAULT_SCHEDULE",
    "PLAN_SCHEMA_VERSION",
    "Plan",
    "StagePlan",
    "interleave",
    "slice_bounds",
    "split_sizes",
    "straight_plan",
    "transfers",
]

PLAN_SCHEMA_VERSION = 1
DEFAULT_SCHEDULE = "dapple"
_OLD_MEAN_SEQ_LEN = "seq_len"
"""The key plan files of earlier versions record :attr:`Plan.mean_seq_len` under (read as it)."""
"""The schedule of a plan that names none: DAPPLE early backward (1F1B)."""
ScheduleName = str
"""A registered schedule's name (:mod:`dapple.schedule.registry`)."""
Policy = Literal["A", "B"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A full hybrid data/pipeline parallel plan for one synchronous training step."""

    planner: str
    """Which planner produced it (``dapple``, ``dp``, ``straight``, ``gpipe``, ``pipedream``, ...)."""
    global_batch_size: int
    """Samples per optimizer step."""
    micro_batch_size: int
    """Samples per micro-batch (before the per-stage split into replica slices)."""
    num_micro_batches: int
    """M; ``global_batch_size == micro_batch_size * num_micro_batches``."""
    stages: tuple[StagePlan, ...]
    """The S stages in pipeline order."""
    schedule: ScheduleName = DEFAULT_SCHEDULE
    """A registered schedule (:mod:`dapple.schedule.registry`): ``dapple`` (early backward,
    1F1B), ``gpipe`` (all forwards first), ``interleaved`` (interleaved 1F1B over
    ``virtual_stages`` chunks per device group), ``zbh1`` (ZB-H1) or a plug-in."""
    virtual_stages: int = 1
    """v: model chunks per device group. With v > 1 (a schedule with chunks) ``stages`` lists the
    S = P·v virtual stages in pipeline order; stage k runs on the devices of stage
    :meth:`group_of_stage` (k), which the schedule places: k mod P for interleaved 1F1B (group
    g holds stages g, g+P, ..., g+(v-1)P), a V for ZB-V (group g holds stages g and 2P-1-g).
    The first P stages are the device groups in order."""
    policy: Policy = "A"
    """Warm-up policy: A ``K_i = min(S-i, D)``, B ``K_i = min(2(S-i)-1, D)`` (section 6.3)."""
    predicted_step_ms: float = math.nan
    """The planner's pipeline latency L (equation 2) in ms; NaN when not predicted."""
    model_name: str = ""
    """Model the plan was made for: its profile's ``model_name``, which is the workload's
    ``name``. ``dapple train``/``verify`` refuse a model of another name
    (:meth:`check_model`); empty (a plan written by hand, an older file): any name."""
    mean_seq_len: float | None = None
    """Mean tokens per sample the step time was predicted for (a profile at several lengths,
    :mod:`dapple.cost.at_length`); None: the profile's one size. The plan runs on any length
    its model accepts."""
    max_seq_len: float | None = None
    """Longest sample (tokens) the memory was planned for; None with ``mean_seq_len``."""
    planned_with: PlanningOptions | None = field(default=None, compare=False)
    """The search options :func:`dapple.planner.make_plan` made it with (an elastic re-plan
    searches them again); None: a plan made by hand or by an older version. Not compared:
    two plans of the same stages are the same plan however they were found."""
    model_fingerprint: str | None = field(default=None, compare=False)
    """Its profile's :attr:`~dapple.core.profile.ModelProfile.model_fingerprint` (the model's
    layers' tensors): ``dapple simulate`` refuses a profile of another model. None: not
    recorded (not checked). Not compared, as :attr:`planned_with`."""
    schema_version: int = PLAN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        check_plan(self)

    @property
    def num_stages(self) -> int:
        """S, the number of (computation) stages."""
        return len(self.stages)

    @property
    def num_groups(self) -> int:
        """P: device groups (pipeline ranks); ``num_stages / virtual_stages``."""
        return len(self.stages) // self.virtual_stages

    @property
    def num_layers(self) -> int:
        """N covered by the plan."""
        return self.stages[-1].layers[1]

    @property
    def devices(self) -> tuple[int, ...]:
        """All device ids in stage order (each once)."""
        return tuple(d for st in self.stages[: self.num_groups] for d in st.devices)

    @property
    def replica_devices(self) -> tuple[int, ...]:
        """The device standing for each replica (its tensor group's first), in stage order:
        the devices a lowered schedule has programs for (:attr:`devices` when every t_s = 1)."""
        return tuple(d for st in self.stages[: self.num_groups] for d in st.replica_devices)

    @property
    def replication(self) -> str:
        """Replica counts joined by ':' as in the paper (e.g. ``15:1``)."""
        return ":".join(str(st.replicas) for st in self.stages[: self.num_groups])

    @property
    def split_positions(self) -> tuple[int, ...]:
        """Layer indices where a new stage starts."""
        return tuple(st.layers[0] for st in self.stages[1:])

    def group_of_stage(self, k: int) -> int:
        """The device group (pipeline rank) that runs virtual stage ``k``: k itself for k < P,
        else the schedule's placement (``ScheduleSpec.placement``; k mod P without the schedule
        registry)."""
        P = self.num_groups
        if k < P:
            return k
        return group_of(self.schedule, k, P, self.virtual_stages)

    def stages_of_group(self, g: int) -> tuple[int, ...]:
        """The stages device group ``g`` runs: stage g, or its v virtual stages in pipeline
        order."""
        return tuple(k for k in range(len(self.stages)) if self.group_of_stage(k) == g)

    def stages_of_device(self, device: int) -> tuple[int, ...]:
        """The stages ``device`` runs: one, or its group's v virtual stages in pipeline order.

        Raises:
            ValidationError: the device is not part of the plan.
        """
        g, _j = self.stage_of_device(device)
        return self.stages_of_group(g)

    def layers_of_device(self, device: int) -> tuple[int, ...]:
        """The chain indices of the layers ``device`` holds, stage by stage in pipeline order
        (with v > 1 its chunks' layers, which are not contiguous).

        Raises:
            ValidationError: the device is not part of the plan.
        """
        return tuple(
            i for s in self.stages_of_device(device) for i in range(*self.stages[s].layers)
        )

    def stage_of_device(self, device: int) -> tuple[int, int]:
        """``(stage, replica)`` that ``device`` runs (its first stage when v > 1); a device of
        a tensor group gets its group's replica.

        Raises:
            ValidationError: the device is not part of the plan.
        """
        for s, st in enumerate(self.stages[: self.num_groups]):
            if device in st.devices:
                return s, st.devices.index(device) // st.tensor_width
        raise ValidationError(
            f"device {device} is not used by the plan (devices {list(self.devices)})"
        )

    def validate_for(self, num_layers: int, num_devices: int | None = None) -> None:
        """Check the plan against a model's layer count and a cluster's device count.

        Raises:
            ValidationError: layers do not cover ``[0, num_layers)`` exactly or a device id
                does not exist.
        """
        require(
            self.num_layers == num_layers,
            f"plan covers layers [0, {self.num_layers}) but the model has {num_layers} layers",
        )
        if num_devices is not None:
            bad = [d for d in self.devices if d >= num_devices]
            require(
                not bad,
                f"plan uses device id(s) {bad} but the cluster has only {num_devices} devices (0..{num_devices - 1})",
            )

    def check_model(self, model_name: str, num_layers: int | None = None) -> None:
        """Check that the plan was made for the model about to run it (when the plan records
        its model): the same name. The layers it covers are :meth:`validate_for`'s check.

        Args:
            model_name: the workload's name.
            num_layers: the workload's layer count, for the message.

        Raises:
            ValidationError: one line naming the plan's model and the given one.
        """
        if self.model_name in ("", model_name):
            return
        n = self.num_layers
        theirs = "" if num_layers is None else f" ({num_layers} layers)"
        layers = (
            f"plan covers layers [0, {n}) but the model has {num_layers} layers: "
            if num_layers not in (None, n)
            else ""
        )
        raise ValidationError(
            f"{layers}the plan was made for model {self.model_name!r} ({n} layers), not for "
            f"{model_name!r}{theirs}; profile and plan this model (dapple profile -m MODEL -o "
            "P.json; dapple plan --profile P.json ...)"
        )

    def check_fingerprint(self, fingerprint: str | None, what: str) -> None:
        """Check that ``what`` (a profile, named for the message) is of the model the plan was
        made for, when both record a :attr:`model_fingerprint` of one kind (no check otherwise:
        :func:`~dapple.core.profile.comparable_fingerprints`).

        Raises:
            ValidationError: one line naming both fingerprints and the plan's model.
        """
        mine = self.model_fingerprint
        if not comparable_fingerprints(mine, fingerprint) or mine == fingerprint:
            return
        raise ValidationError(
            f"{what} was measured on another model than the plan was made for "
            f"({self.model_name or 'unnamed'!r}, {self.num_layers} layers: fingerprint {mine}; "
            f"the profile's {fingerprint}): give the profile the plan was made from, or plan "
            "with this one (dapple plan --profile ...)"
        )

    def profile_doubt(self, model_name: str, fingerprint: str | None) -> str | None:
        """Why a profile of ``model_name`` with ``fingerprint`` cannot be checked to be of the
        model the plan was made for (:meth:`check_fingerprint` refuses a mismatch of two
        fingerprints); None when it is, or when the plan records nothing to check it with."""
        if self.model_name and model_name and model_name != self.model_name:
            return (
                f"profiled as {model_name!r}, the plan was made for {self.model_name!r}: "
                "the step times and memory may be another model's"
            )
        if self.model_fingerprint is not None and not comparable_fingerprints(
            self.model_fingerprint, fingerprint
        ):
            return (
                "the profile records no model fingerprint of the plan's kind (an imported or "
                "older profile, or an analytic one beside a measured one): dapple cannot check "
                f"it was measured on the plan's {self.model_name!r}"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        lengths = (
            {}
            if self.mean_seq_len is None and self.max_seq_len is None
            else {"mean_seq_len": self.mean_seq_len, "max_seq_len": self.max_seq_len}
        )
        fp = self.model_fingerprint
        return {
            "schema_version": self.schema_version,
            "planner": self.planner,
            "model_name": self.model_name,
            "num_layers": self.num_layers,
            "global_batch_size": self.global_batch_size,
            "micro_batch_size": self.micro_batch_size,
            "num_micro_batches": self.num_micro_batches,
            "schedule": self.schedule,
            **self._schedule_module(),
            "policy": self.policy,
            **({"virtual_stages": self.virtual_stages} if self.virtual_stages != 1 else {}),
            "predicted_step_ms": None
            if math.isnan(self.predicted_step_ms)
            else self.predicted_step_ms,
            **lengths,
            **({} if self.planned_with is None else {"planned_with": self.planned_with.to_dict()}),
            **({} if fp is None else {"model_fingerprint": fp}),
            "replication": self.replication,
            "stages": [st.to_dict() for st in self.stages],
        }

    def _schedule_module(self) -> dict[str, str]:
        """``{"schedule_module": module}`` for a schedule outside dapple, else empty."""
        module = module_of(self.schedule)
        return {"schedule_module": module} if module else {}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Plan:
        what = "plan"
        check_schema_version(d, PLAN_SCHEMA_VERSION, what)
        module = d.get("schedule_module")
        require(
            module is None or module == "" or _is_schedule_module(module),
            f"{what}: schedule_module must be the dotted name of a module defining a SCHEDULE "
            f"(no __main__, no dunder part), got {module!r}"[:300],
        )
        if module:  # the plug-in that registers the plan's schedule
            load_schedule_module(module)
        stages = get_field(d, "stages", what)
        require(
            isinstance(stages, list), f"{what}: stages must be a list, got {type(stages).__name__}"
        )
        pred = d.get("predicted_step_ms")
        fp = d.get("model_fingerprint")
        require(
            fp is None or isinstance(fp, str),
            f"{what}: model_fingerprint must be a string, got {fp!r}"[:200],
        )
        gbs = get_field(d, "global_batch_size", what)
        mbs = d.get("micro_batch_size")
        m = d.get("num_micro_batches")
        if mbs is None and isinstance(m, int) and isinstance(gbs, int) and m > 0:
            mbs = gbs // m
        if m is None and isinstance(mbs, int) and isinstance(gbs, int) and mbs > 0:
            m = gbs // mbs
        plan = Plan(
            planner=str(d.get("planner", "manual")),
            model_name=str(d.get("model_name", "")),
            global_batch_size=gbs,
            micro_batch_size=mbs if mbs is not None else 0,
            num_micro_batches=m if m is not None else 0,
            schedule=d.get("schedule", DEFAULT_SCHEDULE),
            policy=d.get("policy", "A"),
            virtual_stages=d.get("virtual_stages", 1),
            predicted_step_ms=math.nan if pred is None else as_float(pred, "predicted_step_ms"),
            mean_seq_len=d.get("mean_seq_len", d.get(_OLD_MEAN_SEQ_LEN)),
            max_seq_len=d.get("max_seq_len"),
            planned_with=None
            if d.get("planned_with") is None
            else PlanningOptions.from_dict(d["planned_with"]),
            stages=tuple(StagePlan.from_dict(x, i) for i, x in enumerate(stages)),
            model_fingerprint=fp,
        )
        n = d.get("num_layers", plan.num_layers)  # files of older versions do not record it
        require(
            n == plan.num_layers,
            f"{what}: num_layers is {n!r} but the stages cover layers [0, {plan.num_layers})",
        )
        return plan

    def save(self, path: str | Path) -> None:
        save_json_file(path, self.to_dict(), "plan")

    @staticmethod
    def load(path: str | Path) -> Plan:
        """Load a plan JSON file.

        Raises:
            ValidationError: unreadable, malformed or invalid plan (message names the field).
        """
        return Plan.from_dict(load_json_file(path, "plan"))


def straight_plan(
    num_layers: int,
    bounds: list[int],
    *,
    global_batch_size: int,
    num_micro_batches: int,
    replicas: list[int] | None = None,
    **kw: Any,
) -> Plan:
    """Convenience constructor: stages cut at ``bounds`` (e.g. ``[0, 3, 6]``) with ``replicas[s]``
    consecutive device ids each (default one per stage)."""
    cuts = [*bounds, num_layers] if bounds[-1] != num_layers else bounds
    reps = replicas or [1] * (len(cuts) - 1)
    require(
        len(reps) == len(cuts) - 1, f"need one replica count per stage, got {reps} for cuts {cuts}"
    )
    stages = []
    dev = 0
    for s in range(len(cuts) - 1):
        stages.append(
            StagePlan(layers=(cuts[s], cuts[s + 1]), devices=tuple(range(dev, dev + reps[s])))
        )
        dev += reps[s]
    return Plan(
        planner=kw.pop("planner", "manual"),
        global_batch_size=global_batch_size,
        micro_batch_size=global_batch_size // num_micro_batches,
        num_micro_batches=num_micro_batches,
        stages=tuple(stages),
        **kw,
    )


def interleave(plan: Plan, v: int) -> Plan:
    """``plan`` run as interleaved 1F1B with v model chunks per device group.

    Device group g of ``plan`` (its stage g, ``n_g`` layers) keeps ``n_g`` layers in all, as v
    chunks of ``n_g / v``; virtual stage ``c·P + g`` (chunk c of group g, P groups) takes the
    next ``n_g / v`` layers of the chain, so the chunks are placed round-robin over the groups
    and every group keeps its share of the model.

    Args:
        plan: a plan with one stage per device group (``virtual_stages == 1``).
        v: chunks per device group, >= 1.

    Raises:
        ValidationError: ``plan`` is already interleaved, v < 1, or v does not divide the
            layers of some device group (naming the group, its layers and v).
    """
    require(
        plan.virtual_stages == 1,
        f"interleave: the plan already has virtual_stages={plan.virtual_stages}",
    )
    require(isinstance(v, int) and v >= 1, f"interleave: v must be an integer >= 1, got {v!r}")
    counts = [st.layers[1] - st.layers[0] for st in plan.stages]
    for g, (st, n) in enumerate(zip(plan.stages, counts, strict=True)):
        require(
            n % v == 0,
            f"interleave: v={v} chunks do not divide the {n} layers {list(st.layers)} of "
            f"stage {g} (devices {list(st.devices)})"
            + ("; it has fewer layers than chunks" if n < v else ""),
        )
    P = len(plan.stages)
    stages = []
    start = 0
    for _c in range(v):
        for g in range(P):
            st = plan.stages[g]
            end = start + counts[g] // v
            # every setting of the group's stage carries to its chunks but D, which counts the
            # whole stage's micro-batches in flight
            stages.append(replace(st, layers=(start, end), max_in_flight=None))
            start = end
    return Plan(
        planner=plan.planner,
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.micro_batch_size,
        num_micro_batches=plan.num_micro_batches,
        stages=tuple(stages),
        schedule="interleaved",
        policy=plan.policy,
        virtual_stages=v,
        model_name=plan.model_name,
        mean_seq_len=plan.mean_seq_len,
        max_seq_len=plan.max_seq_len,
    )

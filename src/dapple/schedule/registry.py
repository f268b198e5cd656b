"""The schedule registry: every schedule by name, as its module declares it
(:class:`~dapple.schedule.spec.ScheduleSpec`), like torch.distributed.pipelining's
``get_schedule_class``.

The CLI's ``--schedule`` choices, the planner's scorer, the schedule comparison, the cost
model, the lowering and the runtime all ask :func:`get_schedule` instead of comparing names.
Built in, in this order: ``gpipe`` (:mod:`~dapple.schedule.fill_drain`), ``dapple``
(:mod:`~dapple.schedule.early_backward`), ``interleaved`` (:mod:`~dapple.schedule.interleaved`),
``zbh1`` (:mod:`~dapple.schedule.zerobubble`), ``zbv`` (:mod:`~dapple.schedule.zbv`) and
``dualpipev`` (:mod:`~dapple.schedule.dualpipev`).

A schedule outside dapple is a module that defines ``SCHEDULE = ScheduleSpec(...)``; it joins
the registry by :func:`register` (or :func:`registered` for a while), by :func:`load_schedule`
of its module path, or through the environment: ``DAPPLE_SCHEDULES=pkg.mod,pkg.other`` (read on
the first lookup, e.g. for the CLI). A plan under such a schedule records the module in its
file (``schedule_module``, :meth:`Plan.to_dict <dapple.core.plan.Plan.to_dict>`), and loading
the plan loads the module: spawned workers and ``torchrun`` ranks find the schedule the plan
was made with. Importing this module also gives :class:`~dapple.core.plan.Plan` its schedule
rules (:func:`dapple.core.schedule_rules.use_schedule_rules`: core sits below, it cannot
import them).

Pure, no torch.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from dapple.core.plan import Plan
from dapple.core.schedule_rules import use_schedule_rules
from dapple.errors import ValidationError
from dapple.schedule.dualpipev import SCHEDULE as DUALPIPEV
from dapple.schedule.early_backward import SCHEDULE as DAPPLE
from dapple.schedule.fill_drain import SCHEDULE as GPIPE
from dapple.schedule.interleaved import SCHEDULE as INTERLEAVED
from dapple.schedule.ir import ComputeOrder
from dapple.schedule.spec import ScheduleSpec, Shape
from dapple.schedule.zbv import SCHEDULE as ZBV
from dapple.schedule.zerobubble import SCHEDULE as ZBH1

__all__ = [
    "ENV_SCHEDULES",
    "builtin_schedules",
    "check_virtual_stages",
    "compute_order",
    "get_schedule",
    "in_flight_counts",
    "load_schedule",
    "register",
    "registered",
    "schedule_names",
    "schedules",
    "unregister",
]

logger = logging.getLogger(__name__)

ENV_SCHEDULES = "DAPPLE_SCHEDULES"
"""Environment variable: comma-separated modules whose ``SCHEDULE`` joins the registry on the
first lookup (a module that does not load is logged and left out)."""

_BUILTIN: tuple[ScheduleSpec, ...] = (GPIPE, DAPPLE, INTERLEAVED, ZBH1, ZBV, DUALPIPEV)
"""The schedules dapple ships, in the order the CLI and the schedule comparison list them."""
_registry: dict[str, ScheduleSpec] = {s.name: s for s in _BUILTIN}
_env_loaded = False


def _builtin(spec: ScheduleSpec) -> bool:
    return any(spec is b for b in _BUILTIN)


def register(spec: ScheduleSpec) -> ScheduleSpec:
    """Add ``spec`` to the registry (again: its module was imported anew); returns it.

    Raises:
        ValidationError: another module already registered the name (built-ins included).
    """
    have = _registry.get(spec.name)
    if have is not None and have is not spec and (_builtin(have) or have.module != spec.module):
        raise ValidationError(
            f"schedule {spec.name!r} is already registered by module {have.module!r}; "
            f"{spec.module!r} cannot register it again"
        )
    _registry[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a registered schedule (not a built-in one); no-op for an unknown name.

    Raises:
        ValidationError: ``name`` is built in.
    """
    if any(s.name == name for s in _BUILTIN):
        raise ValidationError(f"schedule {name!r} is built in")
    _registry.pop(name, None)


@contextmanager
def registered(spec: ScheduleSpec) -> Iterator[ScheduleSpec]:
    """``spec`` in the registry inside the ``with`` block only (tests, scripts)."""
    register(spec)
    try:
        yield spec
    finally:
        unregister(spec.name)


def load_schedule(module: str) -> ScheduleSpec:
    """Import ``module`` and register its ``SCHEDULE``.

    Raises:
        ValidationError: the module cannot be imported or has no ``SCHEDULE`` spec.
    """
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValidationError(f"schedule module {module!r} cannot be imported: {e}") from e
    spec = getattr(mod, "SCHEDULE", None)
    if not isinstance(spec, ScheduleSpec):
        raise ValidationError(
            f"schedule module {module!r} defines no SCHEDULE (a dapple.schedule.ScheduleSpec)"
        )
    return register(spec)


def _load_env() -> None:
    """Register the schedules of :data:`ENV_SCHEDULES`, once per process; one that does not
    load is logged (the CLI still starts; its ``--schedule`` lacks that one)."""
    global _env_loaded
    if _env_loaded:
        return
    _env_loaded = True
    for module in os.environ.get(ENV_SCHEDULES, "").split(","):
        if module.strip():
            try:
                load_schedule(module.strip())
            except ValidationError as e:
                logger.warning("%s: %s; left out", ENV_SCHEDULES, e)


def builtin_schedules() -> tuple[ScheduleSpec, ...]:
    """The schedules dapple ships, in order: gpipe, dapple, interleaved, zbh1, zbv,
    dualpipev."""
    return _BUILTIN


def schedules() -> tuple[ScheduleSpec, ...]:
    """Every registered schedule: the built-in ones in their order, then the others as
    registered."""
    _load_env()
    return tuple(_registry.values())


def schedule_names() -> tuple[str, ...]:
    """The names of :func:`schedules` (the CLI's ``--schedule`` choices)."""
    return tuple(s.name for s in schedules())


def _find(name: str) -> ScheduleSpec | None:
    spec = _registry.get(name)
    if spec is None and not _env_loaded:
        _load_env()
        spec = _registry.get(name)
    return spec


def get_schedule(name: str) -> ScheduleSpec:
    """The schedule called ``name``.

    Raises:
        ValidationError: no schedule of that name (the message lists them).
    """
    spec = _find(name)
    if spec is None:
        raise ValidationError(
            f"unknown schedule {name!r}; choose one of {', '.join(schedule_names())}"
        )
    return spec


def _either(names: Sequence[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def check_virtual_stages(v: int, schedule: str | None, *, cli: bool = False) -> None:
    """The one virtual-stages rule: v > 1 model chunks per device group need a schedule that
    takes chunks (``ScheduleSpec.chunks``).

    Args:
        v: chunks per device group.
        schedule: the schedule asked for; None: the plan's own (not chunked).
        cli: name the command-line flags (``--virtual-stages 2 needs --schedule
            interleaved``) instead of the Python names (``virtual_stages=2 needs
            schedule='interleaved'``).

    Raises:
        ValidationError: v > 1 under a schedule without chunks (or none), v other than 1 or
            its count under a schedule of a fixed chunk count (ZB-V), or an unknown schedule.
    """
    spec = None if schedule is None else get_schedule(schedule)
    if spec is not None and spec.chunk_count is not None and v not in (1, spec.chunk_count):
        flag = "--virtual-stages" if cli else "virtual_stages"
        raise ValidationError(
            f"schedule {schedule!r} holds {spec.chunk_count} chunks per device group "
            f"(chunk count = {spec.chunk_count} x ranks), got {flag} {v}"
        )
    if v == 1 or (spec is not None and spec.chunks):
        return
    chunked = [s.name for s in schedules() if s.chunks and s.chunk_count in (None, v)]
    if cli:
        need = f"--virtual-stages {v} needs --schedule {_either(chunked)}"
    else:
        need = f"virtual_stages={v} needs schedule={_either([repr(n) for n in chunked])}"
    raise ValidationError(need + ("" if schedule is None else f", got {schedule!r}"))


def compute_order(
    schedule: str,
    S: int,
    M: int,
    policy: str = "A",
    D: int | Sequence[int | None] | None = None,
    v: int = 1,
) -> ComputeOrder:
    """The compute order of ``schedule`` (its generator).

    Args:
        schedule: a registered name, e.g. ``gpipe``, ``dapple``, ``interleaved`` or ``zbh1``.
        S: pipeline ranks (device groups); the stages are S·v.
        M: micro-batches.
        policy: the warm-up policy (schedules with policies).
        D: the in-flight bound per stage (``bounded`` schedules).
        v: chunks per rank (``chunks`` schedules; 1 for the others).

    Raises:
        ValidationError: unknown schedule, v > 1 for a schedule without chunks, or what the
            generator refuses.
    """
    spec = get_schedule(schedule)
    check_virtual_stages(v, schedule)
    return spec.order(Shape(P=S, M=M, policy=policy, D=D, v=v))


def in_flight_counts(
    schedule: str, S: int, M: int, policy: str = "A", D: Sequence[int | None] | None = None
) -> list[int]:
    """K_i per stage, the micro-batches whose activations stage i holds at most: the
    schedule's memory rule (``ScheduleSpec.in_flight``): M for GPipe,
    :func:`~dapple.schedule.early_backward.warmup_counts` for DAPPLE, ``min(S, M)`` for ZB-H1.

    Raises:
        ValidationError: unknown schedule, one without per-stage counts (``interleaved``
            counts per rank, see :func:`dapple.schedule.interleaved.interleaved_warmup`), or
            bad policy or D.
    """
    spec = get_schedule(schedule)
    if spec.in_flight is None:
        names = sorted(s.name for s in schedules() if s.in_flight is not None)
        raise ValidationError(
            f"no per-stage in-flight counts for schedule {schedule!r}; "
            f"choose {_either([repr(n) for n in names])}"
        )
    return spec.in_flight(Shape(P=S, M=M, policy=policy, D=D))


class _PlanRules:
    """What :class:`~dapple.core.plan.Plan` asks the registry
    (:class:`dapple.core.plan.ScheduleRules`)."""

    def check(self, plan: Plan) -> None:
        if _find(plan.schedule) is None:
            raise ValidationError(
                f"plan: schedule must be one of {', '.join(schedule_names())}, "
                f"got {plan.schedule!r}"
            )
        try:
            check_virtual_stages(plan.virtual_stages, plan.schedule)
        except ValidationError as e:
            raise ValidationError(f"plan: {e}") from e
        regathered = [k for k, st in enumerate(plan.stages) if st.regather]
        if regathered and get_schedule(plan.schedule).split_backward:
            raise ValidationError(
                f"plan: stages {regathered} re-gather their ZeRO-3 parameters per micro-batch, "
                f"which the split backward of schedule {plan.schedule!r} does not run (its W "
                "needs the parameters its I gathered)"
            )

    def module_of(self, schedule: str) -> str:
        spec = _find(schedule)
        return "" if spec is None or _builtin(spec) else spec.module

    def group_of(self, schedule: str, k: int, P: int, v: int) -> int:
        spec = _find(schedule)
        return k % P if spec is None else spec.placement(k, P, v)

    def load(self, module: str) -> None:
        load_schedule(module)


use_schedule_rules(_PlanRules())

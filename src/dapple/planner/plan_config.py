"""What a plan is asked for: one typed configuration behind ``dapple plan``, the ``[planning]``
section of a config file and :func:`dapple.api.plan`.

``dapple plan --config FILE`` reads :class:`PlanConfig` from the file's ``[planning]`` section
(each key is its field's name, which is also the API's keyword; flags given beside it win)::

    [planning]
    profile = "paper:bert48"
    cluster = "paper-a"
    zero_stage = "auto"
    tensor_widths = [1, 2, 4]
    interleave = true
    output = "plan.json"

The sections of ``dapple train`` (:data:`dapple.api.run_config.RUN_SECTIONS`) may share
the file: each command reads its own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapple.core.plan import Plan
from dapple.core.planning_options import (
    NONFINITE_MODES,
    ZERO_CHOICES,
    PlanningOptions,
    ZeroChoice,
    zero_choice,
)
from dapple.core.tensor_layout import TENSOR_WIDTHS
from dapple.errors import ValidationError, renamed_fields
from dapple.files.config_file import Schema, dump, load
from dapple.planner.registry import DEFAULT_PLANNER, get_planner

__all__ = [
    "PLAN_SECTIONS",
    "RUN_SECTION_NAMES",
    "PlanConfig",
    "check_interleave",
    "choices",
    "config_of",
    "dump_plan_config",
    "load_plan_config",
    "options_of",
    "tensor_width_list",
]

AUTO = "auto"
"""``tensor_widths = "auto"``: the widths :func:`dapple.planner.widths.width_candidates` picks."""


@renamed_fields(seq_len="mean_seq_len", interleaved="interleave")
@dataclass(frozen=True, slots=True, kw_only=True)
class PlanConfig:
    """How to plan a profiled model on a cluster."""

    profile: str | None = None
    """The model profile JSON, or ``paper:NAME`` (required)."""
    cluster: str | None = None
    """A cluster JSON/TOML file or preset (required)."""
    servers: int | None = None
    """Another number of servers than the cluster's."""
    global_batch_size: int | None = None
    """G, samples per optimizer step (None: the paper's, for ``paper:`` profiles)."""
    planner: str = DEFAULT_PLANNER
    """``dapple`` or a baseline (:data:`dapple.planner.registry.PLANNERS`)."""
    mean_seq_len: float | None = None
    """Mean tokens per sample the step time is planned for (a profile measured at several)."""
    max_seq_len: float | None = None
    """The longest sample in tokens, which the memory is planned for (None: ``mean_seq_len``)."""
    schedule: str | None = None
    """Run the planned stages under this schedule, or ``best`` (None: the planner's choice)."""
    virtual_stages: int = 1
    """v, model chunks per device group with ``schedule = "interleaved"``."""
    zero_stage: ZeroChoice = 0
    """0, 1 (ZeRO-1), 2 (ZeRO-2), 3 (ZeRO-3) or ``auto`` (per stage, where memory asks for it;
    :data:`~dapple.core.planning_options.ZeroChoice`)."""
    tensor_widths: str | tuple[int, ...] = AUTO
    """Tensor widths t to search (each of 1, 2, 4, 8), or ``auto``: 1, and every width
    dividing the server size when some layer of the profile shards."""
    interleave: bool = False
    """Also search interleaved 1F1B plans (v = 2) and the grid's interleaved points (dapple
    planner only, :mod:`dapple.planner.interleaving`), so the plan may be interleaved."""
    on_nonfinite: str = "stop"
    """The run's non-finite mode (``dapple train --on-nonfinite``), whose step point the
    schedules are simulated and predicted with (``off``: no step collective, consecutive steps
    overlap; :func:`dapple.simulate.simulate`)."""
    output: str | None = None
    """Also write the plan JSON here."""

    def __post_init__(self) -> None:
        get_planner(self.planner)
        zero = zero_choice(self.zero_stage)
        if zero is None:
            raise ValidationError(
                f"zero_stage must be one of {choices(ZERO_CHOICES)}, got {self.zero_stage!r}"
            )
        object.__setattr__(self, "zero_stage", zero)
        if not isinstance(self.interleave, bool):
            raise ValidationError(f"interleave must be true or false, got {self.interleave!r}")
        if self.on_nonfinite not in NONFINITE_MODES:
            raise ValidationError(
                f"on_nonfinite must be stop, skip or off, got {self.on_nonfinite!r}"
            )
        widths = tensor_width_list(self.tensor_widths)
        object.__setattr__(self, "tensor_widths", AUTO if widths is None else tuple(widths))
        for name in ("servers", "global_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValidationError(f"{name} must be >= 1, got {value}")
        if self.virtual_stages < 1:
            raise ValidationError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        _check_lengths(self.mean_seq_len, self.max_seq_len)


def _check_lengths(mean: float | None, top: float | None) -> None:
    if mean is None:
        if top is not None:
            raise ValidationError(f"max_seq_len={top:g} needs mean_seq_len")
        return
    for name, v in (("mean_seq_len", mean), ("max_seq_len", top)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValidationError(f"{name} must be a length > 0, got {v}")
    if top is not None and mean > top:
        raise ValidationError(f"mean_seq_len {mean:g} exceeds max_seq_len {top:g}")


def check_interleave(interleave: bool, schedule: str | None, *, cli: bool = False) -> None:
    """Refuse ``interleave`` beside a ``schedule``: the schedule replaces the planner's choice
    between 1F1B and interleaved 1F1B (``best`` makes that choice by simulation). ``cli``:
    name them as ``dapple plan``'s flags.

    Raises:
        ValidationError: both given.
    """
    if interleave and schedule is not None:
        what = ("--interleave", "--schedule") if cli else ("interleave", "schedule")
        raise ValidationError(
            f"{what[0]} searches the schedule, {what[1]} {schedule} fixes it: give one of them"
        )


def choices(values: Sequence[int | str]) -> str:
    """``0, 1, 2, 3 or auto``."""
    *head, last = map(str, values)
    return f"{', '.join(head)} or {last}"


def tensor_width_list(value: str | Sequence[int], what: str = "tensor_widths") -> list[int] | None:
    """``tensor_widths`` as :func:`dapple.planner.make_plan` takes them: None for ``auto``,
    else the distinct widths in increasing order.

    Raises:
        ValidationError: neither ``auto`` nor widths of :data:`TENSOR_WIDTHS` (naming ``what``).
    """
    if value == AUTO:
        return None
    widths = list(value) if isinstance(value, (list, tuple)) else None
    if not widths or any(isinstance(t, bool) or t not in TENSOR_WIDTHS for t in widths):
        raise ValidationError(
            f"{what} must be auto or widths from {', '.join(map(str, TENSOR_WIDTHS))}, "
            f"got {value if widths is None else widths!r}"
        )
    return sorted(set(widths))


def options_of(cfg: PlanConfig) -> PlanningOptions:
    """What a plan made for ``cfg`` records of it (:attr:`dapple.core.plan.Plan.planned_with`):
    every option but the inputs (profile, cluster, servers), the output file and what the plan
    records itself (G, the lengths)."""
    widths = tensor_width_list(cfg.tensor_widths)
    return PlanningOptions(
        planner=cfg.planner, zero_stage=cfg.zero_stage,
        tensor_widths=None if widths is None else tuple(widths), interleave=cfg.interleave,
        schedule=cfg.schedule, virtual_stages=cfg.virtual_stages, on_nonfinite=cfg.on_nonfinite,
    )  # fmt: skip


def config_of(
    plan: Plan,
    *,
    profile: str | None = None,
    cluster: str | None = None,
    servers: int | None = None,
    output: str | None = None,
) -> PlanConfig:
    """The :class:`PlanConfig` ``plan`` was made with: its recorded options
    (:attr:`~dapple.core.plan.Plan.planned_with`), its G and lengths, on the inputs and output
    given (a plan records no file names).

    Raises:
        ValidationError: ``plan`` records no options (made by hand or by an older version).
    """
    opts = plan.planned_with
    if opts is None:
        raise ValidationError(
            f"plan {plan.replication} of {plan.model_name or 'a model'} records no planning "
            "options (made by hand or by an earlier version): plan it again with dapple plan"
        )
    return PlanConfig(
        profile=profile, cluster=cluster, servers=servers, output=output,
        global_batch_size=plan.global_batch_size, planner=opts.planner,
        mean_seq_len=plan.mean_seq_len, max_seq_len=plan.max_seq_len, schedule=opts.schedule,
        virtual_stages=opts.virtual_stages, zero_stage=opts.zero_stage,
        tensor_widths=AUTO if opts.tensor_widths is None else opts.tensor_widths,
        interleave=opts.interleave, on_nonfinite=opts.on_nonfinite,
    )  # fmt: skip


PLAN_SECTIONS: Schema = {"planning": tuple(("", f.name) for f in dataclasses.fields(PlanConfig))}
"""The section of a plan file and the fields its keys set (each key is its field's name)."""


RENAMED_KEYS = {"seq_len": "mean_seq_len"}
"""Old spellings of ``[planning]`` keys, refused naming the key now (``seq_len`` is tokens per
sample in ``dapple train``'s ``[data]``; the planner's mean length is ``mean_seq_len``)."""


RUN_SECTION_NAMES = (
    "model", "plan", "data", "train", "optimizer", "checkpoint", "eval", "report", "elastic",
)  # fmt: skip
"""The sections ``dapple train --config`` reads (:data:`dapple.api.run_config.RUN_SECTIONS`;
a test keeps the two equal)."""


def load_plan_config(
    path: str | Path, *, over: dict[tuple[str, str], Any] | None = None
) -> PlanConfig:
    """The :class:`PlanConfig` of a file's ``[planning]`` section, with ``over`` on top
    (``dapple train``'s and ``dapple simulate``'s sections skipped unread).

    Raises:
        ValidationError: an unreadable file, an unknown section or key, a value of the wrong
            type, or a bad option (each naming the file).
    """
    ignore = (*RUN_SECTION_NAMES, "simulate")
    return load(path, PLAN_SECTIONS, PlanConfig, ignore=ignore, over=over, renamed=RENAMED_KEYS)


def dump_plan_config(cfg: PlanConfig) -> str:
    """``cfg`` as a ``[planning]`` section that :func:`load_plan_config` reads back to ``cfg``."""
    return dump(cfg, PLAN_SECTIONS, "dapple plan --config FILE (flags given beside it win)")

"""``dapple plan``: plan a profiled model on a cluster (DAPPLE search or a baseline)."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from dapple.cli._console import StepProgress, console, print_table
from dapple.cli._kinds_show import shares_line
from dapple.cli._plan_flags import add_plan_config_arguments, plan_config_of
from dapple.cli._plan_show import (
    format_devices,
    gib_text,
    idle_line,
    mesh_columns,
    ms_text,
    plan_summary,
    print_stage_table,
    speedup_text,
    zero_line,
)
from dapple.cli._profile_arg import add_profile_argument
from dapple.cli._renamed import renamed
from dapple.cli._run_args import add_on_nonfinite_argument, add_virtual_stages_argument
from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import describe_presets
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import DappleError, InfeasibleError, ValidationError
from dapple.files.output_path import check_output_file
from dapple.planner.registry import DEFAULT_PLANNER, PLANNERS, planner_names, searched
from dapple.schedule.registry import check_virtual_stages, get_schedule, schedule_names

if TYPE_CHECKING:
    from dapple.api import PlanInputs
    from dapple.planner.plan_config import PlanConfig
    from dapple.planner.schedule_choice import ScheduleChoice
    from dapple.simulate.engine import SimResult

__all__ = [
    "MAX_SIMULATED_WORK",
    "format_devices",
    "parse_mean_seq_len",
    "register",
    "run",
    "run_config",
]

MAX_SIMULATED_WORK = 1 << 18
"""Most micro-batches x devices ``--schedule`` simulates for a schedule with a step rule of its
own (interleaved, zbh1): the event simulation takes time in proportion (about 0.1 ms each on
one CPU core)."""
BEST = "best"
"""``--schedule best``: the fastest simulated schedule variant that fits the memory."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plan",
        help="plan partition, replication, placement and micro-batching (DAPPLE planner)",
        description="Plan a profiled model on a cluster and print the stages, pivot stage Q, "
        "predicted step time L and speed-up over data parallelism.",
    )
    add_profile_argument(p)
    p.add_argument(
        "--cluster", required=True, help=f"a JSON/TOML file or a preset: {describe_presets()}"
    )
    p.add_argument("--servers", type=int, default=None, help="override the number of servers")
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per step (default for paper: profiles: the paper's)",
    )
    p.add_argument(
        "--planner",
        choices=planner_names(),
        default=DEFAULT_PLANNER,
        help="; ".join(f"{s.name}: {s.summary}" for s in PLANNERS.values())
        + " (default: %(default)s)",
    )
    p.add_argument(
        "--mean-seq-len",
        default=None,
        metavar="MEAN[,MAX]",
        help="mean tokens per sample: N plans for samples of N tokens; MEAN,MAX for samples of "
        "varying length, MEAN on average (the step time) and at most MAX (the memory; train "
        "--pad --seq-len MAX). From a profile measured at several lengths (`dapple profile "
        "--seq-lens`), interpolated in tokens; the plan records both",
    )
    p.add_argument("--seq-len", action=renamed("--mean-seq-len"), help=argparse.SUPPRESS)
    p.add_argument("-o", "--output", default=None, help="plan JSON to write")
    p.add_argument(
        "--compare",
        action="store_true",
        help="run every planner and compare them side by side, then the best plan per schedule "
        "(simulated)",
    )
    p.add_argument(
        "--schedule",
        choices=(*schedule_names(), BEST),
        default=None,
        help="run the plan's stages under this schedule (default: the planner's choice, gpipe "
        "or dapple); best: every schedule (interleaved v = 2, 4 where the layers allow) on the "
        "planner's partition and balanced pipelines, each M, the fastest simulated plan that "
        "fits the memory",
    )
    add_virtual_stages_argument(p)
    p.add_argument(
        "--zero-stage",
        default="0",
        metavar="Z",
        help="1: replicated stages shard their optimizer state over their replicas (ZeRO-1); "
        "2: their gradients too, reduce-scattered after every micro-batch (ZeRO-2); 3: their "
        "parameters too (ZeRO-3 / FSDP), all-gathered once per step or again per micro-batch "
        "(less memory, more traffic), whichever gives the lower step time; auto: per stage, "
        "unsharded unless its state leaves too little memory for its in-flight micro-batches, "
        "then the cheapest of ZeRO-1, ZeRO-2, ZeRO-3 and re-computation; each plan found is "
        "also scored with every replicated stage at ZeRO 0-3, the fastest kept. A stage with one "
        "replica stays unsharded. The search counts the memory and the traffic of each; the "
        "plan records zero_stage (and ZeRO-3's regather) per stage, which train and verify "
        "follow (dapple planner only; default %(default)s)",
    )
    p.add_argument(
        "--tensor-widths",
        default="auto",
        metavar="auto|T[,T...]",
        help="tensor-parallel widths t to search (Megatron-style groups of t devices inside one "
        "server per replica; each of 1, 2, 4, 8 dividing the server size), one search per "
        "width with every stage that width, the fastest plan winning; auto: 1, and every width "
        "that fits when some layer of the profile shards (layers a TP plan cuts: dapple "
        "profile marks them, from the model's own plan or its Hugging Face "
        "base_model_tp_plan); a width > 1 for a profile where no layer shards is refused "
        "(dapple planner only; default %(default)s)",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="also search interleaved 1F1B (v = 2 model chunks per device group): the dapple "
        "planner's own plans cut into chunks and the dp x tp x pp grid's interleaved points, "
        "each costed by the interleaved step rule and its replayed memory; the fastest plan "
        "wins, interleaved or 1F1B (dapple planner only, not with --schedule, nor on a "
        "cluster with host terms)",
    )
    add_on_nonfinite_argument(p)
    add_plan_config_arguments(p)
    p.set_defaults(func=run)


def parse_mean_seq_len(text: str) -> tuple[float, float]:
    """``--mean-seq-len``: ``"512"`` -> ``(512, 512)``, ``"300.5,1024"`` -> ``(300.5, 1024)``.

    Raises:
        ValidationError: not one or two numbers, a length <= 0, or MEAN > MAX.
    """
    parts = [s.strip() for s in text.split(",")]
    try:
        nums = [float(s) for s in parts]
    except ValueError:
        nums = []
    if len(nums) not in (1, 2) or not all(math.isfinite(n) and n > 0 for n in nums):
        raise ValidationError(
            f"--mean-seq-len must be MEAN or MEAN,MAX with lengths > 0, got {text!r}"
        )
    mean, top = nums[0], nums[-1]
    if mean > top:
        raise ValidationError(
            f"--mean-seq-len {text}: the mean {mean:g} exceeds the maximum {top:g}"
        )
    return mean, top


_AFTER_SEARCH = "the refinement and other offers (MoE: the search without expert widths)"
"""What the DAPPLE search runs after its last reported step (:func:`_plan_with_progress`)."""


def _plan_with_progress(con: Console, cfg: PlanConfig, inputs: PlanInputs) -> Plan:
    """Run ``cfg``'s planner (:func:`dapple.api.plan`, no schedule); show its progress once it
    has taken more than a second. The search reports its micro-batch counts of each tensor
    width; what runs after the last (each width's refinement, the other offers and, on an MoE
    profile, the whole search again without expert widths) is said, without an ETA."""
    from dapple.api import plan

    searched = dataclasses.replace(cfg, schedule=None, virtual_stages=1, output=None)
    what = f"plan {cfg.planner}"
    with StepProgress(what, detail="micro-batch counts", console=con, delay_s=1.0,
                      after=_AFTER_SEARCH) as bar:  # fmt: skip
        return plan(searched, inputs=inputs, progress=bar)


def _planner_only(cfg: PlanConfig, planner: str, interleave: bool = False) -> PlanConfig:
    """``cfg``'s subject with ``planner`` and every search option at its default (but
    ``interleave``)."""
    from dapple.planner.plan_config import PlanConfig

    return PlanConfig(profile=cfg.profile, cluster=cfg.cluster, planner=planner,
                      interleave=interleave)  # fmt: skip


def _dp_ms(cfg: PlanConfig, inputs: PlanInputs) -> float:
    from dapple.api import plan

    try:
        return plan(_planner_only(cfg, "dp"), inputs=inputs).predicted_step_ms
    except InfeasibleError:
        return math.nan


def run(args: argparse.Namespace) -> int:
    cfg = plan_config_of(args, parse_mean_seq_len)  # --config FILE, --print-config
    return 0 if cfg is None else run_config(cfg, compare=args.compare)


def run_config(cfg: PlanConfig, *, compare: bool = False) -> int:
    """Plan what ``cfg`` asks for and print it (``dapple plan`` once its flags are read);
    ``compare``: every planner side by side instead."""
    from dapple.api import plan_inputs
    from dapple.planner.plan_config import check_interleave, options_of
    from dapple.planner.schedule_choice import check_v_layers

    check_interleave(cfg.interleave, cfg.schedule, cli=True)
    inputs = plan_inputs(cfg, cli=True)
    if cfg.output is not None:
        check_output_file(cfg.output, "--output plan file")
    con = console()
    best = cfg.schedule == BEST
    check_virtual_stages(cfg.virtual_stages, None if best else cfg.schedule, cli=True)
    if cfg.schedule and not best:
        check_v_layers(cfg.schedule, inputs.profile, inputs.cluster)  # before the search
    if compare:
        return _compare(con, cfg, inputs, _dp_ms(cfg, inputs))
    plan = _plan_with_progress(con, cfg, inputs)
    dp_ms = _dp_ms(cfg, inputs)  # after the planner's checks of the options
    if best:
        return _best_schedule(con, plan, inputs, cfg, dp_ms)
    if cfg.schedule and not get_schedule(cfg.schedule).uses_pipeline_latency:
        return _new_schedule(con, plan, inputs, cfg, dp_ms)
    profile, cluster = inputs.profile, inputs.cluster
    if cfg.schedule:  # GPipe or DAPPLE: predicted by L (equations 1-3)
        from dapple.planner.schedule_choice import under_schedule

        mode = cfg.on_nonfinite
        v = cfg.virtual_stages
        plan = under_schedule(plan, cfg.schedule, v, profile, cluster, on_nonfinite=mode)
    _print_plan(con, plan, profile, cluster, dp_ms)
    single = [str(i) for i, st in enumerate(plan.stages) if not st.parallel.data_parallel]
    zero = cfg.zero_stage
    if zero in (1, 2, 3) and single:
        con.print(f"--zero-stage {zero} is a no-op on stage(s) {', '.join(single)} (one replica)")
    if cfg.output:  # with cfg's options, which an elastic re-plan asks for again
        dataclasses.replace(plan, planned_with=options_of(cfg)).save(cfg.output)
        con.print(f"plan written to {cfg.output}")
    return 0


def _print_plan(
    con: Console, plan: Plan, profile: ModelProfile, cluster: Cluster, dp_ms: float
) -> None:
    """The stage table and the summary lines of the plan (:func:`plan_summary`)."""
    print_stage_table(con, plan, profile, cluster)
    for line in plan_summary(plan, profile, cluster, dp_ms):
        con.print(line)
    _print_idle(con, plan, profile, cluster)
    shares = shares_line(plan, cluster)
    if shares is not None:
        con.print(shares)
    con.print(zero_line(plan, profile))
    if plan.mean_seq_len is not None:
        con.print(
            f"planned for samples of {plan.mean_seq_len:g} tokens on average (step time) and at "
            f"most {plan.max_seq_len:g} (memory)"
        )


def _print_idle(con: Console, plan: Plan, profile: ModelProfile, cluster: Cluster) -> None:
    """The line on the devices ``plan`` leaves idle, if any (:func:`idle_line`)."""
    idle = idle_line(plan, profile, cluster)
    if idle is not None:
        con.print(idle)


def _compare(con: Console, cfg: PlanConfig, inputs: PlanInputs, dp_ms: float) -> int:
    """Every planner side by side (the dapple planner with ``cfg.interleave``), then the best
    plan per schedule; the dapple planner's plan saved to ``cfg.output`` if given."""
    profile, cluster, output = inputs.profile, inputs.cluster, cfg.output
    t = Table(
        title=f"planners on {profile.model_name}, {cluster.name}, "
        f"global batch {inputs.global_batch_size}"
    )
    for col in ("planner", "replication", "split positions", "M", "schedule", "L ms", "vs dp"):
        t.add_column(col, justify="left" if col in ("planner", "replication") else "right")
    best: Plan | None = None
    bases: list[Plan] = []
    skipped: list[str] = []
    for name, spec in PLANNERS.items():
        try:
            mine = cfg.interleave and spec.is_search
            plan = _plan_with_progress(con, _planner_only(cfg, name, mine), inputs)
        except DappleError as e:
            t.add_row(name, "-", "-", "-", "-", "n/a", "n/a")
            skipped.append(f"{name}: {e}")
            continue
        if spec.is_search:
            best = plan
        if spec.schedule_base:
            bases.append(plan)
        t.add_row(
            name,
            plan.replication,
            ",".join(map(str, plan.split_positions)) or "-",
            str(plan.num_micro_batches),
            f"{plan.schedule}/{plan.policy}",
            ms_text(plan.predicted_step_ms),
            speedup_text(dp_ms, plan.predicted_step_ms),
        )
    print_table(con, t)
    for line in skipped:
        con.print(f"[yellow]{line}[/yellow]")
    if bases:
        _schedule_table(con, bases, profile, cluster, dp_ms)
    if output and best is not None:
        best.save(output)
        con.print(f"dapple plan written to {output}")
    return 0


def _new_schedule(
    con: Console, plan: Plan, inputs: PlanInputs, cfg: PlanConfig, dp_ms: float
) -> int:
    """The planner's stages under a ``--schedule`` with a step rule of its own (interleaved,
    zbh1): predicted and simulated."""
    from dapple.cost.schedule_step import schedule_latency
    from dapple.simulate import simulate
    from dapple.simulate.plan_variants import with_schedule

    profile, cluster, schedule = inputs.profile, inputs.cluster, str(cfg.schedule)
    try:
        new = with_schedule(plan, schedule, cfg.virtual_stages)
    except ValidationError as e:
        layers = ", ".join(f"[{a}, {b})" for a, b in (st.layers for st in plan.stages))
        why = (
            f"--schedule {schedule} cannot run the {plan.planner} planner's plan (stages "
            f"{layers}, replication {plan.replication}; the planner does not plan for the "
            f"schedule): {e}"
        )
        if get_schedule(schedule).cut is None or not searched(plan):  # a baseline's cut
            raise ValidationError(
                f"{why}; --schedule best tries each schedule on balanced pipelines too"
            ) from e
        return _own_cut(con, plan, inputs, cfg, dp_ms, why)
    work = new.num_micro_batches * len(new.devices)
    if work > MAX_SIMULATED_WORK:
        raise ValidationError(
            f"--schedule {schedule} simulates every micro-batch on every device: "
            f"M = {new.num_micro_batches:,} micro-batches x {len(new.devices)} devices = "
            f"{work:,} is more than {MAX_SIMULATED_WORK:,}; give a smaller "
            "--global-batch-size, or plan without --schedule (no simulation)"
        )
    res = simulate(new, profile, cluster, on_nonfinite=cfg.on_nonfinite)
    predicted = schedule_latency(new, profile, cluster, on_nonfinite=cfg.on_nonfinite)
    new = dataclasses.replace(new, predicted_step_ms=predicted)
    return _print_scheduled(con, new, res, inputs, dp_ms, cfg)


def _print_scheduled(
    con: Console, new: Plan, res: SimResult, inputs: PlanInputs, dp_ms: float, cfg: PlanConfig
) -> int:
    """A plan under its schedule: its (virtual) stages, idle devices and simulated step."""
    profile, cluster = inputs.profile, inputs.cluster
    t = Table(title=f"{new.planner} plan of {profile.model_name} on {cluster.name}, {new.schedule}")
    mesh, mesh_cells = mesh_columns(new)
    for col in ("stage", "layers", "replicas", *mesh, "devices"):
        t.add_column(col, justify="left" if col == "devices" else "right")
    for i, st in enumerate(new.stages):
        t.add_row(
            str(i),
            f"[{st.layers[0]}, {st.layers[1]})",
            str(st.replicas),
            *mesh_cells(st),
            format_devices(st.devices),
        )
    print_table(con, t)
    chunks = f", v = {new.virtual_stages}" if new.virtual_stages > 1 else ""
    _print_idle(con, new, profile, cluster)
    return _report(con, f"schedule {new.schedule}{chunks}", new, res, dp_ms, cfg)


def _own_cut(
    con: Console, plan: Plan, inputs: PlanInputs, cfg: PlanConfig, dp_ms: float, why: str
) -> int:
    """A schedule with its own cut (a V) on the DAPPLE planner's plan that it cannot cut
    (``why``): the schedule's best plan on that plan and balanced pipelines of every depth,
    each M, cuts refined (:func:`~dapple.planner.schedule_choice.best_under_schedule`). A
    baseline planner's plan is the partition asked for, refused instead."""
    from dapple.planner.schedule_choice import best_under_schedule

    profile, cluster, mode = inputs.profile, inputs.cluster, cfg.on_nonfinite
    choice = best_under_schedule(plan, str(cfg.schedule), profile, cluster, on_nonfinite=mode)
    if choice.plan is None or choice.result is None:
        raise ValidationError(f"{why}; nor does any balanced pipeline fit: {choice.note}")
    con.print(f"{why}: planned for it on balanced pipelines of every depth instead (simulated, "
              "each M, cuts refined)")  # fmt: skip
    return _print_scheduled(con, choice.plan, choice.result, inputs, dp_ms, cfg)


def _best_schedule(
    con: Console, plan: Plan, inputs: PlanInputs, cfg: PlanConfig, dp_ms: float
) -> int:
    """``--schedule best``: every schedule on the planner's partition and balanced pipelines,
    each M, by simulation; the fastest that fits the memory is the plan."""
    from dapple.planner.schedule_choice import best_schedule

    profile, cluster = inputs.profile, inputs.cluster
    best, choices = best_schedule(plan, profile, cluster, on_nonfinite=cfg.on_nonfinite)
    _choices_table(con, choices, dp_ms, f"the {plan.planner} planner")
    assert best.plan is not None and best.result is not None
    _print_idle(con, best.plan, profile, cluster)
    return _report(con, f"chosen: {best.label}", best.plan, best.result, dp_ms, cfg)


def _report(
    con: Console, head: str, plan: Plan, res: SimResult, dp_ms: float, cfg: PlanConfig
) -> int:
    """One line on a simulated plan after ``head``; saved as :func:`run_config` saves it."""
    from dapple.planner.plan_config import options_of

    con.print(
        f"{head}, replication {plan.replication}, M = {plan.num_micro_batches} x "
        f"{plan.micro_batch_size} samples: predicted step {plan.predicted_step_ms:.2f} ms, "
        f"simulated {res.step_ms:.2f} ms, peak memory {gib_text(res.peak_memory_bytes)} GiB, "
        f"speed-up over dp {speedup_text(dp_ms, res.step_ms)}"
    )
    if cfg.output:
        dataclasses.replace(plan, planned_with=options_of(cfg)).save(cfg.output)
        con.print(f"plan written to {cfg.output}")
    return 0


def _schedule_table(
    con: Console, bases: list[Plan], profile: ModelProfile, cluster: Cluster, dp_ms: float
) -> None:
    """The best plan per schedule over the given bases' partitions and balanced pipelines
    (simulated)."""
    from dapple.planner.schedule_choice import balanced_pipelines, best_per_schedule

    bases = bases + balanced_pipelines(profile, cluster, bases[0].global_batch_size)
    _choices_table(
        con, best_per_schedule(bases, profile, cluster), dp_ms, "the dapple and straight planners"
    )


def _choices_table(con: Console, choices: list[ScheduleChoice], dp_ms: float, whose: str) -> None:
    """Each schedule variant's best plan side by side (its reason where none fits)."""
    t = Table(
        title=f"best plan per schedule (simulated; partitions of {whose} and balanced pipelines "
        "of every depth, each M)"
    )
    for col in (
        "schedule",
        "replication",
        "split positions",
        "M",
        "predicted ms",
        "simulated ms",
        "peak GiB",
        "vs dp",
    ):
        t.add_column(col, justify="left" if col in ("schedule", "replication") else "right")
    notes = []
    for ch in choices:
        if ch.plan is None or ch.result is None:
            t.add_row(ch.label, "-", "-", "-", "n/a", "n/a", "-", "n/a")
            notes.append(f"{ch.label}: {ch.note}")
            continue
        p = ch.plan
        t.add_row(
            ch.label,
            p.replication,
            ",".join(map(str, p.split_positions)) or "-",
            str(p.num_micro_batches),
            ms_text(p.predicted_step_ms),
            ms_text(ch.result.step_ms),
            gib_text(ch.result.peak_memory_bytes),
            speedup_text(dp_ms, ch.result.step_ms),
        )
    print_table(con, t)
    for line in notes:
        con.print(f"[yellow]{line}[/yellow]")

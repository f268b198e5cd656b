"""What ``dapple plan`` prints of a plan: its stage table (each stage's tensor width and zero
stage where any is not 1 / 0), its summary lines, and what each replicated stage's zero stage
saves. A plan under a schedule costed by the paper's L (GPipe, DAPPLE) shows L's rows
(:func:`stage_table`) and terms; one under a schedule with a step rule of its own (interleaved
1F1B, ZB-H1) shows its stage terms, its step rule's time and each device group's replayed
memory (:func:`schedule_stage_table`). Torch-free."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

from dapple.cli._console import print_table
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile

__all__ = [
    "expert_line",
    "format_devices",
    "gib_text",
    "idle_line",
    "mesh_columns",
    "ms_text",
    "plan_summary",
    "print_stage_table",
    "schedule_stage_table",
    "speedup_text",
    "stage_table",
    "zero_line",
]


def format_devices(devices: Sequence[int]) -> str:
    """Compact device list: ``0-7,12``."""
    out: list[str] = []
    ds = list(devices)
    i = 0
    while i < len(ds):
        j = i
        while j + 1 < len(ds) and ds[j + 1] == ds[j] + 1:
            j += 1
        out.append(str(ds[i]) if i == j else f"{ds[i]}-{ds[j]}")
        i = j + 1
    return ",".join(out)


def ms_text(v: float) -> str:
    return f"{v:.2f}"


def gib_text(v: float) -> str:
    return f"{v / 2**30:.2f}"


def speedup_text(dp_ms: float, ms: float) -> str:
    """The speed-up of a step of ``ms`` over data parallelism's ``dp_ms`` (NaN: infeasible)."""
    return (
        "n/a (data parallelism alone does not fit)" if math.isnan(dp_ms) else f"{dp_ms / ms:.2f}x"
    )


def mesh_columns(plan: Plan) -> tuple[list[str], Callable[[StagePlan], list[str]]]:
    """The ``tensor width``, ``expert width`` (e_s) and ``zero stage`` columns of a stage table,
    each only where some stage is not at 1 / 1 / 0, and a stage's cells in them."""
    cols = [
        name
        for name, shown in (
            ("tensor width", any(st.parallel.tensor_parallel for st in plan.stages)),
            ("expert width", any(st.parallel.expert_parallel for st in plan.stages)),
            ("zero stage", any(st.zero_stage for st in plan.stages)),
        )
        if shown
    ]

    def cells(st: StagePlan) -> list[str]:
        zero = f"{st.zero_stage}{' regather' if st.regather else ''}"
        return [
            str(st.tensor_width)
            if c == "tensor width"
            else str(st.expert_width)
            if c == "expert width"
            else zero
            for c in cols
        ]

    return cols, cells


def expert_line(plan: Plan) -> str | None:
    """Each stage's expert-parallel width where some stage shards its experts (``StagePlan.
    expert_width``): ``expert widths: stage 0 e_s=8 (1 group of 8 replicas), stage 1 e_s=1``;
    None where none does."""
    if not any(st.parallel.expert_parallel for st in plan.stages):
        return None
    parts = []
    for i, st in enumerate(plan.stages):
        e = st.expert_width
        groups = st.replicas // e
        many = f"{groups} group{'s' if groups > 1 else ''}"
        what = f" ({many} of {e} replicas)" if st.parallel.expert_parallel else ""
        parts.append(f"stage {i} e_s={e}{what}")
    return "expert widths: " + ", ".join(parts)


def stage_table(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Table:
    from dapple.cost.pipeline import pipeline_latency

    r = pipeline_latency(plan, profile, cluster)
    t = Table(title=f"{plan.planner} plan of {profile.model_name} on {cluster.name}")
    mesh, mesh_cells = mesh_columns(plan)
    for col in ("stage", "layers", "replicas", *mesh, "devices", "recompute", "K_i", "F ms",
                "B ms", "comm F/B ms", "AllReduce ms", "memory GiB"):  # fmt: skip
        t.add_column(col, justify="right" if col not in ("devices",) else "left")
    rows = r.stages
    for idx, row in enumerate(rows):
        if row.kind != "compute":
            continue
        st = plan.stages[row.index]
        comm = rows[idx + 1] if idx + 1 < len(rows) else None
        pivot = " (Q)" if idx == r.Q else ""
        t.add_row(
            f"{row.index}{pivot}",
            f"[{st.layers[0]}, {st.layers[1]})",
            str(st.replicas),
            *mesh_cells(st),
            format_devices(st.devices),
            "yes" if st.recompute else "no",
            str(row.in_flight),
            ms_text(row.forward_ms),
            ms_text(row.backward_ms),
            "-"
            if comm is None
            else f"{ms_text(comm.forward_ms)}/{ms_text(comm.backward_ms)}"
            + (" (Q)" if idx + 1 == r.Q else ""),
            ms_text(row.allreduce_ms),
            gib_text(row.memory_bytes),
        )
    return t


def schedule_stage_table(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Table:
    """The stages of a plan under a schedule with a step rule of its own: per (virtual) stage
    its device group, F_s and B_s of its slowest replica's slice, the transfer to the next
    stage, AR_s under its zero stage, and its group's peak memory replayed from the schedule's
    compute order (:func:`~dapple.cost.schedule_step.device_memory_by_group`)."""
    from dapple.cost.schedule_step import device_memory_by_group
    from dapple.cost.terms import stage_terms

    terms = stage_terms(plan, profile, cluster)
    memory = device_memory_by_group(plan, profile)
    t = Table(title=f"{plan.planner} plan of {profile.model_name} on {cluster.name}")
    mesh, mesh_cells = mesh_columns(plan)
    for col in ("stage", "group", "layers", "replicas", *mesh, "devices", "recompute", "F ms",
                "B ms", "comm ms", "AllReduce ms", "group memory GiB"):  # fmt: skip
        t.add_column(col, justify="left" if col == "devices" else "right")
    for k, (st, term) in enumerate(zip(plan.stages, terms.stages, strict=True)):
        slowest = term.replicas[0]
        comm = terms.boundaries[k].comm_ms if k < len(terms.boundaries) else None
        t.add_row(
            str(k),
            str(plan.group_of_stage(k)),
            f"[{st.layers[0]}, {st.layers[1]})",
            str(st.replicas),
            *mesh_cells(st),
            format_devices(st.devices),
            "yes" if st.recompute else "no",
            ms_text(slowest.forward_ms),
            ms_text(slowest.backward_ms),
            "-" if comm is None else ms_text(comm),
            ms_text(term.terms.sync_ms),
            gib_text(memory[plan.group_of_stage(k)]),
        )
    return t


def zero_line(plan: Plan, profile: ModelProfile) -> str:
    """Each replicated stage's zero stage (``StagePlan.zero_stage``) and the memory it saves per
    replica - or, unsharded, what ZeRO-1 would save; a stage sharding its experts (e_s > 1)
    says so instead (ZeRO is not costed beside it)."""
    parts = []
    for i, st in enumerate(plan.stages):
        if not st.parallel.data_parallel:
            continue
        if st.parallel.expert_parallel:  # ZeRO is not costed beside expert parallelism
            parts.append(
                f"stage {i} (r={st.replicas}) zero stage 0, experts sharded e_s={st.expert_width}"
            )
            continue
        gib = gib_text(_zero_saved_bytes(profile, st))
        what = (
            f"saves {gib} GiB" if st.parallel.shards_optimizer else f"sharding would save {gib} GiB"
        )
        again = " (regather)" if st.regather else ""
        parts.append(
            f"stage {i} (r={st.replicas}) zero stage {st.zero_stage}{again}, {what} per replica"
        )
    if not parts:
        return "zero stage: no stage is replicated, nothing to shard"
    return "; ".join(parts)


def _zero_saved_bytes(profile: ModelProfile, st: StagePlan) -> float:
    """Bytes the stage's zero stage (ZeRO-1 when 0) saves on one rank against none, at its
    tensor width."""
    from dapple.cost.memory import zero_saved_bytes

    par = st.parallel if st.zero_stage else dataclasses.replace(st.parallel, zero_stage=1)
    return zero_saved_bytes(profile, st.layers, par)


def print_stage_table(con: Console, plan: Plan, profile: ModelProfile, cluster: Cluster) -> None:
    """Print :func:`stage_table`, or :func:`schedule_stage_table` for a plan whose schedule
    has a step rule of its own (through the CLI's ``print_table``)."""
    from dapple.schedule.registry import get_schedule

    show = (
        stage_table if get_schedule(plan.schedule).uses_pipeline_latency else schedule_stage_table
    )
    print_table(con, show(plan, profile, cluster))


def plan_summary(plan: Plan, profile: ModelProfile, cluster: Cluster, dp_ms: float) -> list[str]:
    """Two lines on the plan: under a schedule costed by L, S, Q, M and L's terms T_w, T_s, T_e
    (equations 1-3); else its device groups, M, and the step time by the schedule's own rule
    (:func:`~dapple.cost.schedule_step.schedule_latency`) with the replayed peak memory. On the
    ``local-cpu`` preset a third says what the prediction rests on
    (:func:`~dapple.cli._prediction_note.local_preset_note`)."""
    from dapple.cli._prediction_note import local_preset_note
    from dapple.schedule.registry import get_schedule

    if get_schedule(plan.schedule).uses_pipeline_latency:
        lines = _latency_summary(plan, profile, cluster, dp_ms)
    else:
        lines = _step_rule_summary(plan, profile, cluster, dp_ms)
    note = local_preset_note(cluster)
    return lines if note is None else [*lines, note]


def _latency_summary(
    plan: Plan, profile: ModelProfile, cluster: Cluster, dp_ms: float
) -> list[str]:
    from dapple.cost.pipeline import pipeline_latency

    r = pipeline_latency(plan, profile, cluster)  # each stage's zero stage is in the plan
    return [
        f"S = {plan.num_stages} computation stages ({r.S} with comm stages), "
        f"replication {plan.replication}, split positions {list(plan.split_positions)}, "
        f"pivot Q = {r.Q}, M = {plan.num_micro_batches} x {plan.micro_batch_size} samples, "
        f"schedule {plan.schedule} policy {plan.policy}",
        f"predicted step L = {plan.predicted_step_ms:.2f} ms (T_w {r.T_w_ms:.2f} + T_s "
        f"{r.T_s_ms:.2f} + T_e {r.T_e_ms:.2f}), speed-up over dp "
        f"{speedup_text(dp_ms, plan.predicted_step_ms)}",
    ]


def _step_rule_summary(
    plan: Plan, profile: ModelProfile, cluster: Cluster, dp_ms: float
) -> list[str]:
    from dapple.cost.schedule_step import device_memory_by_group, schedule_latency
    from dapple.schedule.registry import get_schedule

    title = get_schedule(plan.schedule).title_of(plan)
    step_ms = schedule_latency(plan, profile, cluster)
    peak = max(device_memory_by_group(plan, profile))
    return [
        f"S = {plan.num_stages} computation stages on P = {plan.num_groups} device groups "
        f"(v = {plan.virtual_stages}), replication {plan.replication}, split positions "
        f"{list(plan.split_positions)}, M = {plan.num_micro_batches} x "
        f"{plan.micro_batch_size} samples, schedule {title}",
        f"predicted step L = {step_ms:.2f} ms (the {title} step rule), peak memory "
        f"{gib_text(peak)} of {gib_text(cluster.usable_memory_bytes)} GiB, speed-up over dp "
        f"{speedup_text(dp_ms, step_ms)}",
    ]


def idle_line(plan: Plan, profile: ModelProfile, cluster: Cluster) -> str | None:
    """How many of the cluster's devices ``plan`` leaves idle (None: it uses them all); for a
    dapple plan on more devices than a plan of its batch can keep busy, that bound
    (:func:`~dapple.core.usable.usable_devices`), the most its search looked at; on a mixed
    cluster each kind left idle, its devices and why (:func:`~dapple.planner.idle_kinds.
    idle_kinds`)."""
    from dapple.core.usable import usable_devices
    from dapple.planner.idle_kinds import idle_kinds
    from dapple.planner.registry import searched
    from dapple.planner.widths import width_candidates

    used, G = len(plan.devices), cluster.num_devices
    if used >= G:
        return None
    line = f"{G - used:,} of {G:,} devices left idle (the plan uses {used:,})"
    done = plan.planned_with
    widths = done.tensor_widths if done is not None and done.tensor_widths else None
    ts = list(widths) if widths is not None else width_candidates(profile, cluster)
    kinds = "".join(f"; {x}" for x in idle_kinds(plan, profile, cluster, ts))  # mixed clusters
    if not searched(plan):
        return line + kinds
    B, N = plan.global_batch_size, profile.num_layers
    usable = usable_devices(N, B, ts)
    if usable >= G:
        return line + kinds
    return (
        f"{line}: a global batch of {B} keeps at most {usable:,} busy ({N} stages x {B} "
        f"replicas x tensor width {max(ts)}), the most the search looked at{kinds}"
    )

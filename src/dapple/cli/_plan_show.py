"""What ``dapple plan`` prints of a plan: its stage table (each stage's tensor width and zero
stage where any is not 1 / 0) and what each replicated stage's zero stage saves. Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

from dapple.cli._console import print_table
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile

__all__ = [
    "format_devices",
    "gib_text",
    "mesh_columns",
    "ms_text",
    "print_stage_table",
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


def mesh_columns(plan: Plan) -> tuple[list[str], Callable[[StagePlan], list[str]]]:
    """The ``tensor width`` and ``zero stage`` columns of a stage table, each only where some
    stage is not at 1 / 0, and a stage's cells in them."""
    cols = [
        name
        for name, shown in (
            ("tensor width", any(st.tensor_width > 1 for st in plan.stages)),
            ("zero stage", any(st.zero_stage for st in plan.stages)),
        )
        if shown
    ]

    def cells(st: StagePlan) -> list[str]:
        zero = f"{st.zero_stage}{' regather' if st.regather else ''}"
        return [str(st.tensor_width) if c == "tensor width" else zero for c in cols]

    return cols, cells


def stage_table(plan: Plan, profile: ModelProfile, cluster: Cluster) -> Table:
    from dapple.planner.cost import pipeline_latency

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


def zero_line(plan: Plan, profile: ModelProfile) -> str:
    """Each replicated stage's zero stage (``StagePlan.zero_stage``) and the memory it saves per
    replica - or, unsharded, what ZeRO-1 would save."""
    parts = []
    for i, st in enumerate(plan.stages):
        if st.replicas == 1:
            continue
        gib = gib_text(_zero_saved_bytes(profile, st))
        what = f"saves {gib} GiB" if st.zero_stage else f"sharding would save {gib} GiB"
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
    from dapple.cost.memory import parameter_state_bytes

    z, t = st.zero_stage or 1, st.tensor_width
    whole = parameter_state_bytes(profile, st.layers, st.replicas, tensor_width=t)
    return whole - parameter_state_bytes(
        profile, st.layers, st.replicas, z, tensor_width=t, regather=st.regather
    )


def print_stage_table(con: Console, plan: Plan, profile: ModelProfile, cluster: Cluster) -> None:
    """Print :func:`stage_table` (through the CLI's ``print_table``)."""
    print_table(con, stage_table(plan, profile, cluster))

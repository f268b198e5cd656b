"""A picture of where a plan puts its stages: one row per server, one box per device.

Each box is coloured by its stage and labelled with its replica ``j`` and tensor rank ``i``
(:class:`~dapple.core.plan.StagePlan`: replica-major, device ``j x t_s + i`` of the stage);
each tensor group (t_s consecutive devices of one replica) is framed, so a 3-D plan shows its
pipeline (colours), data parallelism (frames per colour) and tensor parallelism (boxes per
frame) at once. The legend gives each stage's layers, r_s x t_s, its replicas' uneven shares
of a micro-batch, zero stage and re-computation; a replica's box also names its share (``n3``:
3 samples). Uses matplotlib's Agg backend.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan
from dapple.files.output_path import make_parent_dirs

__all__ = ["layout_cells", "plot_layout", "server_label", "stage_label"]

_LABELS_UP_TO = 16
"""Servers up to which every box carries its replica and tensor rank."""


def stage_label(s: int, st: StagePlan) -> str:
    """``stage s: layers a-b, r x t devices[, shares j:k][, ZeRO z][, recompute]``."""
    a, b = st.layers
    parts = [f"stage {s}: layers {a}-{b - 1}", f"{st.replicas} x {st.tensor_width} devices"]
    if st.shares is not None:
        parts.append("shares " + ":".join(map(str, st.shares)))
    if st.zero_stage:
        parts.append(f"ZeRO-{st.zero_stage}" + (" re-gathered" if st.regather else ""))
    if st.recompute:
        parts.append("recompute")
    return ", ".join(parts)


def server_label(cluster: Cluster, server: int) -> str:
    """``server 1``, with its device kind's name and speed on a cluster with kinds
    (``server 1\nA100-40GB x0.32``; ``own profile`` for a kind with its own,
    :mod:`dapple.core.kind_profiles`)."""
    k = cluster.kind_of(server * cluster.devices_per_server)
    if k is None:
        return f"server {server}"
    pace = "own profile" if k.profile is not None else f"x{k.speed:.2g}"
    return f"server {server}\n{k.name} {pace}"


def layout_cells(plan: Plan) -> dict[int, tuple[int, int, int]]:
    """Device -> ``(stage s, replica j, tensor rank i)`` for every device ``plan`` uses (its
    first chunk's stage for an interleaved plan)."""
    return {
        d: (s, j, i)
        for s, st in enumerate(plan.stages[: plan.num_groups])
        for j in range(st.replicas)
        for i, d in enumerate(st.tensor_group(j))
    }


def plot_layout(plan: Plan, cluster: Cluster, path: str | Path, title: str | None = None) -> None:
    """Draw ``plan``'s stages on ``cluster``'s devices (one row per server) into ``path``
    (PNG, SVG or PDF by suffix). Devices no stage uses stay white."""
    n, per = cluster.servers, cluster.devices_per_server
    stages = plan.stages[: plan.num_groups]
    colors = plt.get_cmap("tab10" if len(stages) <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(0.9 * per + 1.5, 0.55 * n + 1.6 + 0.25 * len(stages)))
    labelled = n <= _LABELS_UP_TO
    for s, st in enumerate(stages):
        color = colors(s % colors.N)
        for j in range(st.replicas):
            group = st.tensor_group(j)
            for i, d in enumerate(group):
                x, y = d % per, d // per
                ax.add_patch(Rectangle((x + 0.06, y + 0.1), 0.88, 0.8, facecolor=color, lw=0))
                if labelled:
                    text = f"s{s}\nr{j}" + (f" t{i}" if st.parallel.tensor_parallel else "")
                    text += f"\nn{st.shares[j]}" if st.shares is not None else ""
                    ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7)
            x0, y0 = group[0] % per, group[0] // per
            ax.add_patch(
                FancyBboxPatch(
                    (x0 + 0.03, y0 + 0.06), len(group) - 0.06, 0.88,
                    boxstyle="round,pad=0,rounding_size=0.08", fill=False, lw=1.6,
                )
            )  # fmt: skip
    for d in range(cluster.num_devices):
        ax.add_patch(
            Rectangle((d % per + 0.06, d // per + 0.1), 0.88, 0.8, fill=False, lw=0.4, ls=":")
        )
    ax.set_xlim(0, per)
    ax.set_ylim(n, 0)
    ax.set_xticks([x + 0.5 for x in range(per)], [str(x) for x in range(per)])
    ax.set_yticks([y + 0.5 for y in range(n)], [server_label(cluster, y) for y in range(n)])
    ax.set_xlabel("device in server")
    ax.tick_params(length=0)
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    L = plan.predicted_step_ms
    head = title or (
        f"{plan.planner} plan, schedule {plan.schedule}, M={plan.num_micro_batches}"
        + ("" if math.isnan(L) else f", L = {L:.1f} ms")
    )
    ax.set_title(head, fontsize=10)
    handles = [
        Patch(color=colors(s % colors.N), label=stage_label(s, st)) for s, st in enumerate(stages)
    ]
    fig.legend(handles=handles, loc="lower center", ncol=1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.045 * len(stages), 1, 1))
    fig.savefig(make_parent_dirs(path), dpi=120)
    plt.close(fig)

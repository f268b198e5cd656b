"""Pictures of a simulated step: a Gantt chart (one row per device; a tensor group, whose devices
run the same actions, is one row labelled with all of them) and memory over time.

The Gantt chart follows the paper's GPipe vs DAPPLE figure: forward boxes blue, backward green,
micro-batch numbers inside, gaps are bubbles. Transfers are thin orange bars at the bottom of
the sender's row (the link's busy time) and AllReduce red boxes. Uses matplotlib's Agg backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch

from dapple.files.output_path import make_parent_dirs
from dapple.schedule.ir import ActionKind
from dapple.simulate.engine import DeviceStats, SimResult

__all__ = ["plot_gantt", "plot_memory"]

K = ActionKind
COLORS = {
    K.FORWARD: "#4C72B0",
    K.BACKWARD: "#55A868",
    K.BACKWARD_INPUT: "#55A868",
    K.BACKWARD_WEIGHT: "#8172B2",
    K.ALLREDUCE: "#C44E52",
    "comm": "#DD8452",
}


def _devs(d: DeviceStats) -> str:
    """A row's devices: ``dev 3``, or ``devs 2-3 (TP2)`` for a stage replica's tensor group
    (one row per stage replica: its tensor ranks run the same actions)."""
    if not d.tensor_group:
        return f"dev {d.device}"
    return f"devs {d.devices_text} (TP{d.tensor_width})"


def _draw(ax: Axes, result: SimResult, title: str) -> None:
    devs = [d.device for d in result.devices]
    row = {d: i for i, d in enumerate(devs)}
    first = {d.device: d.stage for d in result.devices}
    span = max(result.step_ms, 1e-9)
    for e in result.events:
        y = row[e.device]
        kind = e.action.kind
        if kind.is_compute or kind is K.ALLREDUCE:
            if e.duration_ms <= 0:
                continue
            ax.broken_barh(
                [(e.start_ms, e.duration_ms)],
                (y - 0.4, 0.8),
                facecolors=COLORS[kind],
                edgecolors="black",
                linewidth=0.5,
            )
            if kind.is_compute and e.duration_ms / span > 0.012:
                # a device of an interleaved plan runs several stages: name the other chunks'
                label = str(e.action.micro_batch)
                if e.action.stage != first[e.device]:
                    label += f"\ns{e.action.stage}"
                ax.text(
                    e.start_ms + e.duration_ms / 2,
                    y,
                    label,
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=8,
                )
            elif kind is K.ALLREDUCE:
                ax.text(
                    e.start_ms + e.duration_ms / 2, y, "AR", ha="center", va="center", fontsize=7
                )
        elif kind in (K.SEND_F, K.SEND_B) and e.duration_ms > 0:
            ax.broken_barh(
                [(e.start_ms, e.duration_ms)], (y + 0.28, 0.12), facecolors=COLORS["comm"]
            )
    ax.set_yticks(range(len(devs)))
    ax.set_yticklabels([f"{_devs(d)}\nstage {d.stage}.{d.replica}" for d in result.devices])
    ax.set_ylim(len(devs) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01)
    ax.set_facecolor("#F2F2F2")  # bubbles show as grey gaps
    ax.grid(axis="x", color="white", linewidth=0.8)
    ax.set_axisbelow(True)
    L = "" if result.L_ms != result.L_ms else f", planner L {result.L_ms:.2f} ms"
    ax.set_title(f"{title}: step {result.step_ms:.2f} ms{L}", fontsize=10)


def plot_gantt(runs: Sequence[tuple[str, SimResult]], path: str | Path) -> None:
    """Gantt chart of one or more simulated steps stacked on a shared time axis.

    Args:
        runs: ``(title, result)`` per panel, e.g. GPipe and DAPPLE of the same plan.
        path: output image (PNG, SVG, PDF by suffix).
    """
    heights = [max(2.0, 0.6 * len(r.devices) + 1.0) for _, r in runs]
    fig, axes = plt.subplots(
        len(runs),
        1,
        figsize=(12, sum(heights)),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for ax, (title, r) in zip(axes[:, 0], runs, strict=True):
        _draw(ax, r, title)
    axes[-1, 0].set_xlabel("time (ms)")
    kinds = {e.action.kind for _, r in runs for e in r.events}
    split = K.BACKWARD_WEIGHT in kinds
    handles = [
        Patch(color=COLORS[K.FORWARD], label="forward"),
        Patch(
            color=COLORS[K.BACKWARD],
            label="backward (B, or I: input gradient)" if split else "backward",
        ),
        *([Patch(color=COLORS[K.BACKWARD_WEIGHT], label="W: weight gradient")] if split else []),
        Patch(color=COLORS["comm"], label="send (link busy)"),
        Patch(color=COLORS[K.ALLREDUCE], label="AllReduce"),
        Patch(color="#F2F2F2", label="bubble"),
    ]
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=len(handles),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / sum(heights)))  # room for the legend
    fig.savefig(make_parent_dirs(path), dpi=120)
    plt.close(fig)


def plot_memory(runs: Sequence[tuple[str, SimResult]], path: str | Path) -> None:
    """Memory over time per device (parameters, gradients, optimizer state, activations).

    Args:
        runs: ``(title, result)`` per panel.
        path: output image.
    """
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 3.2 * len(runs)), squeeze=False)
    for ax, (title, r) in zip(axes[:, 0], runs, strict=True):
        for d in r.devices:
            pts = [*list(r.memory[d.device]), (r.step_ms, r.memory[d.device][-1][1])]
            ax.step(
                [t for t, _ in pts],
                [b / 2**20 for _, b in pts],
                where="post",
                label=f"{_devs(d)} (stage {d.stage}.{d.replica}) peak {d.peak_memory_bytes / 2**20:.1f} MiB",
            )
        ax.set_title(f"{title}: memory per device", fontsize=10)
        ax.set_ylabel("MiB")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (ms)")
    fig.tight_layout()
    fig.savefig(make_parent_dirs(path), dpi=120)
    plt.close(fig)

"""``dapple train --profile P --cluster C``'s memory table: each stage's measured memory beside
the planner's per-replica estimate, and what the ratio of the two can and cannot say.

The estimate counts the stage's tensors (weights, gradients, optimizer state and the K_i
micro-batches' activations). What the table sets it against, "added by the stage", is the
growth of the rank's process: its resident peak less its resident size before it built the
stage (CPU: ``VmHWM``; CUDA: the caching allocator's peak reserved memory). That growth is
not a tensor count:

- it also holds what a running rank brings besides its stage's tensors (code and libraries
  loaded on first use, gloo's buffers, thread stacks, memory the allocator keeps after a
  free; on CUDA the allocator's rounding to its blocks and its workspaces): tens of MiB
  whatever the model, so a stage of a few MiB reads far below 1;
- it misses a stage built in memory the process already held (freed earlier and kept by the
  allocator), and a process whose peak came before the stage was built grew by that peak's
  excess instead: a ratio above 1.

:func:`memory_notes` says this under the table, and names each stage whose ratio is off by
more than :data:`NOTE_RATIO` either way with its cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free import of the CLI
    from dapple.core.plan import Plan
    from dapple.runtime.step_metrics import StepMetrics

__all__ = ["NOTE_RATIO", "memory_notes", "memory_table", "ratio_text"]

NOTE_RATIO = 2.0
"""estimate / added below ``1 / NOTE_RATIO`` or above ``NOTE_RATIO``: the stage gets a line
saying which side of the measure it is on."""

_MIB = 2**20

_GROWTH = {
    "VmHWM": "the process's resident peak (VmHWM) less its resident size before it built the stage",
    "cuda_max_reserved": "the CUDA caching allocator's peak reserved memory less what it had "
    "reserved before the stage was built",
}
_OVERHEAD = {
    "VmHWM": "code and libraries loaded on first use, gloo's buffers, thread stacks, memory "
    "the allocator keeps after a free",
    "cuda_max_reserved": "the allocator's rounding to its blocks, freed blocks it keeps "
    "cached, library workspaces",
}


def _size(n: float) -> str:
    """``41.4 MiB``, or below a tenth of a MiB ``12.5 KiB``."""
    return f"{n / _MIB:.1f} MiB" if n >= _MIB / 10 else f"{n / 1024:.1f} KiB"


def ratio_text(estimate: float, added: float) -> str:
    """estimate / added with two decimals; ``<0.01`` below that (never a bare ``0.00``) and
    ``-`` when nothing was added."""
    if added <= 0:
        return "-"
    ratio = estimate / added
    return "<0.01" if ratio < 0.01 else f"{ratio:.2f}"


def memory_notes(
    estimates: Sequence[float],
    added: Sequence[float],
    resident_kind: str,
    held: Sequence[float] = (),
) -> list[str]:
    """The lines printed under the memory table: what "added by the stage" measures, and a
    line for each stage whose estimate / added is off by more than :data:`NOTE_RATIO`.

    Args:
        estimates: the planner's estimate per stage (bytes).
        added: the growth measured per stage (bytes; the table's "added by the stage").
        resident_kind: what the growth was read from (``VmHWM``, ``cuda_max_reserved``;
            empty: not measured, no lines).
        held: the held activations the runtime counted per stage (bytes; CPU), quoted beside
            a stage whose growth is mostly not its tensors.
    """
    if not resident_kind or not added:
        return []
    growth = _GROWTH.get(resident_kind, f"the growth of {resident_kind}")
    overhead = _OVERHEAD.get(resident_kind, "what a running rank holds besides them")
    lines = [
        "estimate / added: the planner's estimate counts the stage's tensors (weights, "
        "gradients, optimizer state, K_i micro-batches' activations); added is "
        f"{growth}. That growth also holds what a running rank brings besides its tensors "
        f"({overhead}: tens of MiB whatever the model), and misses tensors built in memory "
        "the process already held, so the ratio says something of the estimate only for "
        "stages far larger than that."
    ]
    for s, (est, grown) in enumerate(zip(estimates, added, strict=True)):
        if grown <= 0 or 1 / NOTE_RATIO <= est / grown <= NOTE_RATIO:
            continue
        if est < grown:
            counted = ""
            if s < len(held):
                counted = f"; the runtime counted {_size(held[s])} of held activations"
            lines.append(
                f"stage {s}: the estimate is {_size(est)} of the {_size(grown)} added "
                f"({ratio_text(est, grown)}): most of that growth is the rank's own "
                f"cost, not the stage's tensors{counted}."
            )
        else:
            lines.append(
                f"stage {s}: the estimate is {_size(est)} against {_size(grown)} added "
                f"({ratio_text(est, grown)}): the stage was built mostly in memory "
                "the process already held (freed earlier and kept by the allocator)."
            )
    return lines


def memory_table(plan: Plan, last: StepMetrics, estimate: Sequence[float], optimizer: str) -> None:
    """Print each stage's measured memory in ``last`` beside ``estimate``, the planner's
    per-replica estimate of each device group with ``optimizer``'s state
    (:func:`dapple.api.predicting.planned_memory`, which :func:`dapple.api.train` returns
    with the metrics), then :func:`memory_notes`."""
    from rich.table import Table

    from dapple.cli._console import console, print_table

    table = Table(title=f"memory per replica (planner: {optimizer} state, K_i in flight)")
    for col in ("stage", "replicas", f"peak {last.resident_kind}", "added by the stage",
                f"peak {last.memory_kind}", "planner estimate", "estimate / added"):  # fmt: skip
        table.add_column(col, justify="right")
    stages = plan.stages[: plan.num_groups]  # a group's chunks: its first stage
    added = [last.stage_resident_bytes[s] if last.stage_resident_bytes else 0
             for s in range(len(stages))]  # fmt: skip
    for s, st in enumerate(stages):
        chunks = plan.stages_of_device(st.devices[0])
        table.add_row(
            str(s) if len(chunks) == 1 else ",".join(map(str, chunks)),
            str(st.replicas),
            f"{last.peak_resident_bytes[s] / _MIB:.1f} MiB" if last.peak_resident_bytes else "-",
            f"{added[s] / _MIB:.1f} MiB" if last.stage_resident_bytes else "-",
            f"{last.peak_memory_bytes[s] / _MIB:.1f} MiB",
            f"{estimate[s] / _MIB:.1f} MiB",
            ratio_text(estimate[s], added[s]),
        )
    con = console()
    print_table(con, table)
    held = last.peak_memory_bytes if last.memory_kind == "held_activations" else ()
    resident = last.resident_kind if last.stage_resident_bytes else ""
    for line in memory_notes(estimate[: len(stages)], added, resident, held):
        con.print(line, markup=False, highlight=False)

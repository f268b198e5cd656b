"""Chrome / Perfetto trace JSON of a simulated step (open in ui.perfetto.dev or chrome://tracing).

One process per device (``pid`` = device id; a tensor group, whose devices run the same
actions, is one process named by all of them) with threads for compute, sends, receive waits
and AllReduce; complete events (``ph: "X"``) in microseconds; memory as a counter track.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dapple.files.output_path import make_parent_dirs
from dapple.schedule.ir import ActionKind
from dapple.simulate.engine import DeviceStats, SimResult

__all__ = ["THREADS", "to_chrome_trace", "write_trace"]

K = ActionKind
THREADS = {"compute": 0, "send": 1, "recv": 2, "allreduce": 3}
"""Thread id of each event category inside a device's process."""


def _category(kind: ActionKind) -> str:
    if kind.is_compute or kind is K.STEP:
        return "compute"
    if kind in (K.SEND_F, K.SEND_B):
        return "send"
    if kind in (K.RECV_F, K.RECV_B):
        return "recv"
    return "allreduce"


def _process_name(d: DeviceStats) -> str:
    """``device 3 (stage 1, replica 0)``; a tensor group's one process names all its devices:
    ``devices 0,2 (TP2, stage 0, replica 0)``."""
    if not d.tensor_group:
        return f"device {d.device} (stage {d.stage}, replica {d.replica})"
    return f"devices {d.devices_text} (TP{d.tensor_width}, stage {d.stage}, replica {d.replica})"


def to_chrome_trace(result: SimResult) -> dict[str, Any]:
    """The ``{"traceEvents": [...]}`` document of ``result``."""
    events: list[dict[str, Any]] = []
    for d in result.devices:
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": d.device,
                "tid": 0,
                "args": {"name": _process_name(d)},
            }
        )
        events.append(
            {
                "ph": "M",
                "name": "process_sort_index",
                "pid": d.device,
                "args": {"sort_index": d.device},
            }
        )
        for name, tid in THREADS.items():
            events.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": d.device,
                    "tid": tid,
                    "args": {"name": name},
                }
            )
    for e in result.events:
        cat = _category(e.action.kind)
        args: dict[str, Any] = {"stage": e.action.stage, "replica": e.action.replica}
        if e.action.micro_batch is not None:
            args["micro_batch"] = e.action.micro_batch
        if e.peer_device is not None:
            args["peer_device"] = e.peer_device
        if e.nbytes:
            args["bytes"] = e.nbytes
        events.append(
            {
                "ph": "X",
                "name": str(e.action),
                "cat": cat,
                "pid": e.device,
                "tid": THREADS[cat],
                "ts": e.start_ms * 1e3,
                "dur": e.duration_ms * 1e3,
                "args": args,
            }
        )
    for dev, points in result.memory.items():
        for t_ms, nbytes in points:
            events.append(
                {
                    "ph": "C",
                    "name": "memory",
                    "pid": dev,
                    "ts": t_ms * 1e3,
                    "args": {"MiB": nbytes / 2**20},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": result.schedule,
            "policy": result.policy,
            "step_ms": result.step_ms,
            "L_ms": None if result.L_ms != result.L_ms else result.L_ms,
        },
    }


def write_trace(result: SimResult, path: str | Path) -> None:
    """Write :func:`to_chrome_trace` of ``result`` to ``path`` (missing folders made)."""
    make_parent_dirs(path).write_text(json.dumps(to_chrome_trace(result)) + "\n")

"""``benchmarks/schedules_measured_timeline.py`` without processes: its measures on hand-made
timelines of two ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import schedules_measured_timeline as smt


def _rank(offset: float, busy: list[tuple[float, float]], waits: list[tuple[float, float]]):
    """Three steps of 1.0 s from ``offset``, each with the compute spans ``busy`` and the waits
    ``waits`` (seconds from the step's start)."""
    events = []
    for s in range(3):
        t = offset + s
        events.append((s, "step", -1, -1, t, t + 1.0))
        events += [(s, "F", 0, 0, t + a, t + b) for a, b in busy]
        events += [(s, "wait", -1, -1, t + a, t + b) for a, b in waits]
    return events


def test_rank0_idle_lead_and_cores_idle_on_a_staircase() -> None:
    """Rank 0 computes 0.0-0.6 s of each step and waits the rest; rank 1, 0.2 s later, computes
    0.1-0.9 s (0.3-1.1 s on rank 0's clock). Rank 0 is idle 0.4 s between its steps and starts
    the next 0.1 s before rank 1's last compute ends; with one core, no core is idle while a rank
    computes, so only where both wait: never (rank 1 is outside a wait whenever rank 0 waits)."""
    r0 = _rank(0.0, [(0.0, 0.6)], [(0.6, 1.0)])
    r1 = _rank(0.2, [(0.1, 0.9)], [(0.0, 0.1), (0.9, 1.0)])
    run = {"label": "x", "round": 0, "events": [r0, r1]}
    got = smt.measures(run, skip=1, cores=1)
    assert got["ms"] == pytest.approx(1000.0)
    assert got["r0_idle"] == pytest.approx(400.0)
    assert got["r0_lead"] == pytest.approx(-100.0)
    assert got["cores_idle"] == pytest.approx(0.0, abs=1e-6)
    # two cores: one idles whenever either rank waits (both waiting: two idle)
    both = smt.cores_idle_ms([r0, r1], 1.0, 2.0, cores=2)
    # in [1.0, 2.0]: rank 0 waits 1.6-2.0; rank 1 waits 1.0-1.1 (its step 0's end wait,
    # 1.1-1.2 on rank 0's clock shifted) - computed from the events, not assumed
    waits = [(max(e[4], 1.0), min(e[5], 2.0)) for ev in (r0, r1) for e in ev
             if e[1] == "wait" and e[5] > 1.0 and e[4] < 2.0]  # fmt: skip
    assert both == pytest.approx(sum(b - a for a, b in waits) * 1e3)

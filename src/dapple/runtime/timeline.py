"""A rank's measured timeline: when each action of its program ran, in wall and CPU time.

The measured counterpart of the simulator's events (:class:`dapple.simulate.result.SimEvent`),
for finding where a prediction and a run part: set ``DAPPLE_TIMELINE=DIR`` and every rank of
every run writes ``DIR/timeline-<pid>-<run>.json`` when its run ends (the variable reaches the
workers through the environment). Off (the variable unset) nothing is wrapped and nothing is
timed. ``benchmarks/timeline_vs_sim.py`` reads the files beside the simulated step.

Each record is one action of one step: its program position, kind, stage, micro-batch,
replica and peer, its start and end in wall time (ms since the step began) and the CPU time
of the rank's thread it took (``time.thread_time``: computing and the host's own work, not
the time blocked waiting for a peer). A handler of ``F``/``B`` waits for its receives first,
so its wall time includes that wait and its CPU time does not. ``OPT`` has two records, its
part before the step point (the guard's collective, which is not an action's record: the gap
between them) and its part after. Each step ends with a ``STEP`` row (its wall time and the
thread's CPU time) and a ``PROCESS`` row (the CPU time of the whole process).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dapple.core.plan import Plan
from dapple.schedule.ir import Action

__all__ = ["ENV", "Timeline"]

ENV = "DAPPLE_TIMELINE"
"""The environment variable naming the folder the timelines are written to."""

_runs = 0
"""Runs this process has written a timeline of (a process may run several plans)."""


class Timeline:
    """One rank's records over a run (:meth:`wrap` each handler, :meth:`begin_step` each
    step, :meth:`write` at the end)."""

    def __init__(self, folder: Path, meta: dict[str, Any]) -> None:
        self.folder, self.meta = folder, meta
        self.steps: list[list[list[Any]]] = []
        self._t0 = self._c0 = self._p0 = 0.0

    @classmethod
    def from_env(cls, rank: int, plan: Plan) -> Timeline | None:
        """Rank ``rank``'s timeline of ``plan``, written to ``$DAPPLE_TIMELINE``; None (and
        nothing built) where the variable is unset or empty."""
        folder = os.environ.get(ENV)
        return cls(Path(folder), {"rank": rank, "plan": plan.to_dict()}) if folder else None

    def begin_step(self, step: int) -> None:
        """Start step ``step``'s records; times are taken from now."""
        self.steps.append([])
        self.meta.setdefault("steps", []).append(step)
        self._c0, self._p0 = time.thread_time(), time.process_time()
        self._t0 = time.perf_counter()

    def wrap(
        self, position: int, action: Action, run: Callable[[Action], None]
    ) -> Callable[[Action], None]:
        """``run`` recording one row per call: position, kind, stage, micro-batch, replica,
        peer, start and end ms since the step began, CPU ms."""
        head = [
            position,
            action.kind.value,
            action.stage,
            action.micro_batch,
            action.replica,
            action.peer,
        ]

        def timed(a: Action) -> None:
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                run(a)
            finally:
                t1, c1 = time.perf_counter(), time.thread_time()
                if self.steps:
                    self.steps[-1].append(
                        [*head, 1e3 * (t0 - self._t0), 1e3 * (t1 - self._t0), 1e3 * (c1 - c0)]
                    )

        return timed

    def end_step(self) -> None:
        """Close the step with two rows from :meth:`begin_step` to now: ``STEP`` (its wall
        time and the CPU time of the rank's thread) and ``PROCESS`` (the CPU time of the whole
        process: the communication library's threads too)."""
        if self.steps:
            t = 1e3 * (time.perf_counter() - self._t0)
            c = 1e3 * (time.thread_time() - self._c0)
            p = 1e3 * (time.process_time() - self._p0)
            self.steps[-1] += [
                [-1, "STEP", -1, None, 0, None, 0.0, t, c],
                [-1, "PROCESS", -1, None, 0, None, 0.0, t, p],
            ]

    def write(self) -> Path:
        """Write the run's records as ``timeline-<pid>-<run>.json`` into the folder."""
        global _runs
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"timeline-{os.getpid()}-{_runs}.json"
        _runs += 1
        fields = [
            "position",
            "kind",
            "stage",
            "micro_batch",
            "replica",
            "peer",
            "start_ms",
            "end_ms",
            "cpu_ms",
        ]
        path.write_text(json.dumps({**self.meta, "fields": fields, "records": self.steps}))
        return path

"""Discrete-event simulation of lowered schedules, with Gantt, memory and Chrome-trace output."""

from dapple.simulate.engine import (
    DeviceStats,
    SimEvent,
    SimResult,
    simulate,
)

__all__ = ["DeviceStats", "SimEvent", "SimResult", "simulate"]

"""What :func:`dapple.simulate.simulate` returns: timed events, per-device summaries and the
step time. Pure, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dapple.errors import ValidationError
from dapple.schedule.ir import Action

__all__ = ["DeviceStats", "SimEvent", "SimResult"]


def _devices_text(devices: tuple[int, ...]) -> str:
    """Device ids in words: ``3``, ``2-3`` when they run consecutively, else ``0,2``."""
    if len(devices) > 1 and devices == tuple(range(devices[0], devices[0] + len(devices))):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(map(str, devices))


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One timed action. For sends the interval is the link occupancy, for receives the wait."""

    device: int
    action: Action
    start_ms: float
    end_ms: float
    peer_device: int | None = None
    """Device at the other end of a send/receive."""
    nbytes: float = 0.0
    """Bytes moved by a send (0 for other actions)."""

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True, slots=True)
class DeviceStats:
    """Per-device summary of one simulated step."""

    device: int
    stage: int
    replica: int
    busy_ms: float
    """Time spent computing: F/B, and on hosts with CPU overhead terms the per-step host CPU
    of ``OPT`` (:mod:`dapple.cost.host`)."""
    bubble_fraction: float
    """``1 - busy_ms / step_ms``: idle (or communication-bound) share of the step."""
    static_memory_bytes: float
    """Parameters + gradients + optimizer state."""
    peak_memory_bytes: float
    """Static memory plus the largest activation footprint over time."""
    peak_in_flight: int
    """Most micro-batches whose F has started and whose B has not finished."""
    tensor_group: tuple[int, ...] = ()
    """The devices of its tensor group, ``device`` the first (empty: ``device`` alone): a stage
    of width t > 1 is simulated once per tensor group (its t devices run the same actions at
    the same times)."""

    @property
    def devices(self) -> tuple[int, ...]:
        """The devices this row stands for: its tensor group, or ``(device,)``."""
        return self.tensor_group or (self.device,)

    @property
    def tensor_width(self) -> int:
        """t: the devices of its tensor group (1 without tensor parallelism)."""
        return len(self.devices)

    @property
    def devices_text(self) -> str:
        """``3``; for a tensor group ``2-3`` (consecutive ids) or ``0,2`` (any others)."""
        return _devices_text(self.devices)


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of :func:`simulate`."""

    step_ms: float
    """Simulated time of one training step. With the step's collective (``AGREE``, the
    non-finite guard) the last action of any device in one step from a common start (every
    rank leaves the collective together). Without it (``POST``, ``on_nonfinite`` off)
    consecutive steps overlap: the period between consecutive step ends in the steady state,
    the slowest device's (:func:`dapple.simulate.engine.steady_period_ms`)."""
    L_ms: float
    """The planner's analytic pipeline latency L (equation 2), NaN when unavailable."""
    schedule: str
    policy: str
    devices: tuple[DeviceStats, ...]
    events: tuple[SimEvent, ...]
    memory: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """device -> step function ``(time_ms, bytes)``: the usage from that time on."""
    span_ms: float = math.nan
    """The last action of any device in one step from a common start (``step_ms`` with the
    step's collective)."""
    on_nonfinite: str = "stop"
    """The run's non-finite mode, whose step point the schedule ran (``off``: ``POST``)."""

    @property
    def peak_memory_bytes(self) -> float:
        """Largest peak over all devices."""
        return max(d.peak_memory_bytes for d in self.devices)

    def device(self, device: int) -> DeviceStats:
        """Stats of one device.

        Raises:
            ValidationError: the device was not simulated.
        """
        for d in self.devices:
            if d.device == device:
                return d
        raise ValidationError(f"device {device} not in the simulation")

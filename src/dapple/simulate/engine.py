"""Discrete-event simulation of a lowered schedule with the planner's costs (paper sections 4, 6).

Pure: no torch. Every device runs its program (:func:`dapple.schedule.lower`) in order:

* ``F``/``B`` occupy the device for ``compute_ms`` of its replica's slice of the micro-batch
  (:func:`dapple.core.plan.split_sizes`); with re-computation ``B`` includes the repeated forward.
* ``SEND_F``/``SEND_B`` are non-blocking for the sender's compute; the transfer of the slice
  overlap ``[lo, hi)`` (:func:`dapple.core.plan.transfers`) occupies the directed link
  ``(src, dst)`` for ``transfer_ms`` of its bytes, first come first served per link.
* ``RECV_F``/``RECV_B`` block the device until the matching transfer has arrived.
* ``AR`` starts when every replica of the stage has reached it and lasts
  ``allreduce_ms`` of the stage's parameter bytes over its devices, AR(P_s, g_s).
* ``OPT`` (the optimizer step) takes 0 ms: the planner's latency L (equation 2) does not
  model it either, so simulated and predicted step times stay comparable.

Since sends never block and each link has a single sender, every action's time depends only
on its device's previous action and on already-posted transfers, so a round-robin dataflow
sweep over the devices yields exact event times without a priority queue.

Memory per device = parameters + gradients + optimizer state (``parameter_state_bytes``) plus
activations: without re-computation a micro-batch slice holds its layers'
``kept_activation_bytes_per_sample`` from the start of its F to the end of its B; with
re-computation it holds only the stage input from F to B, plus the full activations as a
transient during B.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan, split_sizes, transfers
from dapple.core.profile import ModelProfile
from dapple.errors import DappleError, ValidationError
from dapple.planner import cost as costs
from dapple.schedule.ir import Action, ActionKind, Schedule
from dapple.schedule.lower import lower
from dapple.schedule.validate import validate

__all__ = ["DeviceStats", "SimEvent", "SimResult", "activation_bytes", "simulate"]

K = ActionKind
_MsgKey = tuple[ActionKind, int, int, int, int]
"""(SEND_F or SEND_B, sending stage, micro-batch, sending replica, receiving replica)."""


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
    """Time spent in F/B compute."""
    bubble_fraction: float
    """``1 - busy_ms / step_ms``: idle (or communication-bound) share of the step."""
    static_memory_bytes: float
    """Parameters + gradients + optimizer state."""
    peak_memory_bytes: float
    """Static memory plus the largest activation footprint over time."""
    peak_in_flight: int
    """Most micro-batches whose F has started and whose B has not finished."""


@dataclass(frozen=True, slots=True)
class SimResult:
    """Outcome of :func:`simulate`."""

    step_ms: float
    """Simulated time of one training step (last action of any device)."""
    L_ms: float
    """The planner's analytic pipeline latency L (equation 2), NaN when unavailable."""
    schedule: str
    policy: str
    devices: tuple[DeviceStats, ...]
    events: tuple[SimEvent, ...]
    memory: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """device -> step function ``(time_ms, bytes)``: the usage from that time on."""

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


def activation_bytes(profile: ModelProfile, stage: StagePlan, samples: int) -> tuple[float, float]:
    """Activation bytes of one slice on a stage: (held from F to B, extra transient during B).

    The held part is the planner's ``activation_bytes`` (all kept activations, or only the
    stage input with re-computation); a re-computing stage rebuilds its full activations
    during B, the transient part.

    Args:
        profile: the model profile.
        stage: the stage (layer range and re-computation flag).
        samples: samples in the slice.
    """
    held = float(costs.activation_bytes(profile, stage, samples))
    if not stage.recompute:
        return held, 0.0
    start, end = stage.layers
    return held, sum(
        x.kept_activation_bytes_per_sample for x in profile.layers[start:end]
    ) * samples


def simulate(
    plan: Plan, profile: ModelProfile, cluster: Cluster, schedule: Schedule | None = None
) -> SimResult:
    """Simulate one training step of ``plan``.

    Args:
        plan: the plan to run; its schedule/policy pick the compute order.
        profile: per-layer costs.
        cluster: devices and links.
        schedule: a lowered schedule to run instead of ``lower(plan)``; validated first.

    Raises:
        ValidationError: the plan does not fit the profile/cluster or the schedule is invalid.
    """
    plan.validate_for(profile.num_layers, cluster.num_devices)
    sched = lower(plan) if schedule is None else schedule
    validate(sched, plan)
    b = plan.micro_batch_size
    stages = plan.stages
    where = {d: plan.stage_of_device(d) for d in sched}
    sizes = [split_sizes(b, st.replicas) for st in stages]
    # (boundary s|s+1, src replica j, dst replica k) -> samples moved
    moved: dict[tuple[int, int, int], int] = {}
    for s in range(plan.num_stages - 1):
        for j, k, lo, hi in transfers(b, stages[s].replicas, stages[s + 1].replicas):
            moved[(s, j, k)] = hi - lo
    comp: dict[tuple[int, int], tuple[float, float]] = {}

    def compute(s: int, n: int) -> tuple[float, float]:
        if (s, n) not in comp:
            comp[(s, n)] = costs.compute_ms(
                profile, cluster, stages[s].layers, n, recompute=stages[s].recompute
            )
        return comp[(s, n)]

    t = dict.fromkeys(sched, 0.0)
    pc = dict.fromkeys(sched, 0)
    busy = dict.fromkeys(sched, 0.0)
    link_free: dict[tuple[int, int], float] = {}
    arrivals: dict[_MsgKey, deque[float]] = {}
    at_ar: dict[int, dict[int, float]] = {}
    events: list[SimEvent] = []
    # memory deltas (time, +-bytes) and in-flight counters per device
    deltas: dict[int, list[tuple[float, float]]] = {d: [] for d in sched}
    in_flight = dict.fromkeys(sched, 0)
    peak_in_flight = dict.fromkeys(sched, 0)

    progress = True
    while progress:
        progress = False
        for dev, prog in sched.items():
            s, j = where[dev]
            while pc[dev] < len(prog):
                a = prog[pc[dev]]
                now = t[dev]
                if a.kind.is_compute:
                    n = sizes[s][j]
                    f_ms, b_ms = compute(s, n)
                    dur = f_ms if a.kind is K.FORWARD else b_ms
                    held, transient = activation_bytes(profile, stages[s], n)
                    if a.kind is K.FORWARD:
                        deltas[dev].append((now, held))
                        in_flight[dev] += 1
                        peak_in_flight[dev] = max(peak_in_flight[dev], in_flight[dev])
                    else:
                        if transient:
                            deltas[dev].append((now, transient))
                        deltas[dev].append((now + dur, -transient - held))
                        in_flight[dev] -= 1
                    events.append(SimEvent(dev, a, now, now + dur))
                    busy[dev] += dur
                    t[dev] = now + dur
                elif a.kind in (K.SEND_F, K.SEND_B):
                    assert a.micro_batch is not None and a.peer is not None
                    fwd = a.kind is K.SEND_F
                    s_dst = s + 1 if fwd else s - 1
                    dst = stages[s_dst].devices[a.peer]
                    cut = stages[s + 1].layers[0] if fwd else stages[s].layers[0]
                    n = moved[(s, j, a.peer)] if fwd else moved[(s - 1, a.peer, j)]
                    nbytes = float(costs.boundary_bytes(profile, cut, n))
                    start = max(now, link_free.get((dev, dst), 0.0))
                    end = start + costs.transfer_ms(cluster, nbytes, dev, dst)
                    link_free[(dev, dst)] = end
                    key = (a.kind, s, a.micro_batch, j, a.peer)
                    arrivals.setdefault(key, deque()).append(end)
                    events.append(SimEvent(dev, a, start, end, dst, nbytes))
                elif a.kind in (K.RECV_F, K.RECV_B):
                    assert a.micro_batch is not None and a.peer is not None
                    fwd = a.kind is K.RECV_F
                    key = (
                        K.SEND_F if fwd else K.SEND_B,
                        s - 1 if fwd else s + 1,
                        a.micro_batch,
                        a.peer,
                        j,
                    )
                    q = arrivals.get(key)
                    if not q:
                        break
                    t[dev] = max(now, q.popleft())
                    src = stages[key[1]].devices[a.peer]
                    events.append(SimEvent(dev, a, now, t[dev], src))
                elif a.kind is K.ALLREDUCE:
                    waiting = at_ar.setdefault(s, {})
                    waiting[dev] = now
                    if len(waiting) < stages[s].replicas:
                        break
                    start = max(waiting.values())
                    pbytes = sum(
                        x.parameter_bytes for x in profile.layers[slice(*stages[s].layers)]
                    )
                    end = start + costs.allreduce_ms(cluster, pbytes, stages[s].devices)
                    for d, arrived in waiting.items():
                        events.append(SimEvent(d, sched[d][pc[d]], arrived, end))
                        t[d] = end
                        if d != dev:
                            pc[d] += 1
                    at_ar[s] = {}
                else:  # OPT: 0 ms, see the module docstring
                    events.append(SimEvent(dev, a, now, now))
                pc[dev] += 1
                progress = True
    stuck = [d for d in sched if pc[d] < len(sched[d])]
    if stuck:  # validate() runs the same dry run, so this is a bug guard
        raise ValidationError(f"simulation deadlocked at devices {stuck}")

    step_ms = max(t.values(), default=0.0)
    memory: dict[int, tuple[tuple[float, float], ...]] = {}
    stats = []
    for dev in sorted(sched):
        s, j = where[dev]
        static = float(costs.parameter_state_bytes(profile, stages[s].layers))
        level, peak = static, static
        points = [(0.0, static)]
        # frees before allocations at equal times, so back-to-back B/F do not double count
        for when, delta in sorted(deltas[dev], key=lambda x: (x[0], x[1])):
            level += delta
            peak = max(peak, level)
            if points[-1][0] == when:
                points[-1] = (when, level)
            else:
                points.append((when, level))
        memory[dev] = tuple(points)
        stats.append(
            DeviceStats(
                device=dev,
                stage=s,
                replica=j,
                busy_ms=busy[dev],
                bubble_fraction=1.0 - busy[dev] / step_ms if step_ms > 0 else 0.0,
                static_memory_bytes=static,
                peak_memory_bytes=peak,
                peak_in_flight=peak_in_flight[dev],
            )
        )
    try:
        L_ms = float(costs.pipeline_latency(plan, profile, cluster).L_ms)
    except DappleError:
        L_ms = math.nan
    return SimResult(
        step_ms=step_ms,
        L_ms=L_ms,
        schedule=plan.schedule,
        policy=plan.policy,
        devices=tuple(stats),
        events=tuple(sorted(events, key=lambda e: (e.start_ms, e.device))),
        memory=memory,
    )

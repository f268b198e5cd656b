"""Discrete-event simulation of a lowered schedule with the cost model's terms (sections 4, 6).

Pure: no torch. Every time below is a term of the plan's :class:`~dapple.cost.terms.PlanTerms`
(:func:`dapple.cost.terms.stage_terms`, the assembly the cost model's L reads too). Every device
runs its program (:func:`dapple.schedule.lower`) in order:

* ``F``/``B`` occupy the device for the compute time of its replica's slice of the micro-batch
  (:func:`dapple.core.plan.split_sizes`); with re-computation ``B`` includes the repeated forward.
  ``I``/``W`` (zero-bubble schedules) are compute tasks of their own, the input- and
  weight-gradient halves of ``B`` (:func:`dapple.cost.compute.split_backward_ms`); the
  re-computed forward belongs to ``I``. A device of an interleaved plan runs several stages
  (chunks): every action costs and communicates as the stage it names, so a chunk boundary's
  transfer uses the link between the two chunks' devices.
* ``SEND_F``/``SEND_B`` are non-blocking for the sender's compute; the transfer of the slice
  overlap ``[lo, hi)`` (:func:`dapple.core.plan.transfers`) occupies the sender's way out (one
  queue per device, first come first served: its activations to the next stage and its
  gradients to the previous one take turns) for the time of its bytes, and arrives a link
  latency later (:func:`dapple.cost.comm.transfer_ms`); the bytes' time is stretched where
  slices of other senders in the same cut share its receiver's way in or a server's network
  interface (:class:`~dapple.cost.terms.TransferTerms`). A device sending to itself moves
  nothing.
* ``RECV_F``/``RECV_B`` block the device until the matching transfer has arrived.
* ``AR`` starts when every replica of the stage has reached it and lasts
  AR(P_s, g_s) of the stage's parameter bytes over its devices; a stage with
  ``zero_stage`` 2 takes ``(M + 1) / 2`` of that (its reductions after every backward, then the
  gather: :func:`dapple.cost.comm.stage_sync_ms`, as the planner counts it).
* ``AGREE`` (the step point with the non-finite guard) ends when every device has reached it;
  ``POST`` (without the guard) waits for no one in its step: each device posts its row and
  goes on, and the next step's ``POST`` waits for every device's row of this step, as
  :class:`dapple.runtime.late_rows.LateRows` reads them. The collective's own time (a small
  all-gather: a few link latencies on devices) is not charged; on hosts with CPU overhead
  terms it is part of the per-step host CPU of ``OPT``.
* ``OPT`` (the optimizer step) takes U_s, the update the profile measured for the stage's
  parameters (1/r_s of them under ZeRO; :func:`dapple.cost.comm.stage_update_ms`), which
  the planner adds to AR_s; 0 for a profile without it. On hosts with CPU overhead terms
  (:mod:`dapple.cost.host`) F/B also carry the host CPU of their action and its messages,
  and ``OPT`` is a compute task of the per-step host CPU (optimizer, step collective,
  AllReduce copies, so U_s is 0 there), both shared like any compute.

Since sends never block and each way out has a single sender, every action's time depends only
on its device's previous action and on already-posted transfers, so a round-robin dataflow
sweep over the devices yields exact event times without a priority queue.

Memory per device follows :mod:`dapple.cost.peak_memory` over time: the always-held state
(parameters, optimizer state, ZeRO/AllReduce buffers, cast cache), plus per micro-batch slice its
held bytes (activations, or the stage input under re-computation; the stage output; the loss's
log-softmax) from the start of its F to the end of its B (or of its W: the weight gradient needs
the layers' inputs), plus each backward's moment while it runs (B, I and W each charged as a
whole backward), plus a stage's gradients from the end of its first B or W, less the cast cache
at the step's end (OPT). The peak equals :func:`dapple.cost.schedule_step.device_memory_by_group`.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.cost.at_length import profile_for_plan
from dapple.cost.overlap import NO_OVERLAP, CommOverlap
from dapple.cost.peak_memory import StageBytes, device_static, plan_stage_bytes
from dapple.cost.schedule_step import schedule_step_ms
from dapple.cost.terms import PlanTerms, TransferTerms, stage_terms
from dapple.errors import DappleError, ValidationError
from dapple.schedule.ir import RECVS, SENDS, Action, ActionKind, Schedule
from dapple.schedule.lower import lower
from dapple.schedule.validate import validate
from dapple.simulate.result import DeviceStats, SimEvent, SimResult

__all__ = ["DeviceStats", "SimEvent", "SimResult", "simulate", "steady_period_ms"]

K = ActionKind
STEADY_STEPS = 3
"""Consecutive steps :func:`steady_period_ms` runs; the last one's period is the step time."""
_MsgKey = tuple[ActionKind, int, int, int, int]
"""(SEND_F or SEND_B, sending stage, micro-batch, sending replica, receiving replica)."""
_BACKWARDS = frozenset({K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT})
"""B, I and W (sets: an Enum member looked up on its class costs an attribute lookup)."""


class _Run:
    """Mutable state of one simulated step and the two sweeps over it (dedicated or shared
    compute). Non-compute actions are handled identically by both."""

    def __init__(self, terms: PlanTerms, sched: Schedule) -> None:
        self.terms, self.sched = terms, sched
        self.agreeing: dict[int, float] = {}
        """Devices at the ``AGREE`` -> when they reached it."""
        self.posts: list[list[float]] = []
        """Per step, when each device posted its row (``POST``)."""
        self.posted = dict.fromkeys(sched, 0)
        """Per device, the rows it has posted."""
        self.plan, self.profile, self.cluster = terms.plan, terms.profile, terms.cluster
        # (boundary s|s+1, src replica j, dst replica k) -> the slice transfer
        self.transfer: dict[tuple[int, int, int], TransferTerms] = {
            (s, x.src_replica, x.dst_replica): x
            for s, boundary in enumerate(terms.boundaries)
            for x in boundary.transfers
        }
        plan = self.plan
        self.where = {d: plan.stage_of_device(d) for d in sched}
        self.t = dict.fromkeys(sched, 0.0)
        self.pc = dict.fromkeys(sched, 0)
        self.busy = dict.fromkeys(sched, 0.0)
        self.out_free: dict[int, float] = {}
        """Per device, when its way out is free (:meth:`other`)."""
        self.arrivals: dict[_MsgKey, deque[float]] = {}
        self.at_ar: dict[int, dict[int, float]] = {}
        self.events: list[SimEvent] = []
        # memory deltas (time, +-bytes) and in-flight counters per device
        self.deltas: dict[int, list[tuple[float, float]]] = {d: [] for d in sched}
        self.in_flight = dict.fromkeys(sched, 0)
        self.peak_in_flight = dict.fromkeys(sched, 0)
        self.seen: dict[int, set[int]] = {d: set() for d in sched}
        """Per device, the stages whose gradients exist (after their first B or W)."""
        self._bytes: dict[tuple[int, int], StageBytes] = {}

    def stage_bytes(self, s: int, j: int) -> StageBytes:
        """:class:`StageBytes` of replica ``j`` of stage ``s`` (its slice)."""
        key = (s, j)
        if key not in self._bytes:
            self._bytes[key] = plan_stage_bytes(
                self.profile,
                self.plan.stages[s],
                self.plan.micro_batch_size,
                samples=self.terms.stages[s].replicas[j].samples,
            )
        return self._bytes[key]

    def moment(self, dev: int, a: Action) -> float:
        """Bytes a backward (B, I or W) of ``a``'s stage adds while it runs, beyond the level:
        its first or later moment less the micro-batch's held bytes
        (:func:`~dapple.cost.peak_memory.device_peak`)."""
        sb = self.stage_bytes(a.stage, a.replica)
        return (sb.later if a.stage in self.seen[dev] else sb.first) - sb.other

    def opt_ms(self, a: Action) -> float:
        """An OPT's time: the per-step host CPU of its stage's replica plus the optimizer update
        U_s of each stage of its device group (its v chunks under interleaving)."""
        host = self.terms.stages[a.stage].replicas[a.replica].host.step_ms
        return host + sum(
            self.terms.stages[k].terms.update_ms for k in self.plan.stages_of_group(a.stage)
        )

    def is_cpu(self, dev: int, a: Action) -> bool:
        """F/B, or an OPT that takes time (host CPU or the update; module docstring)."""
        if a.kind.is_compute:
            return True
        if a.kind is not K.STEP:
            return False
        return self.opt_ms(a) > 0

    def compute_start(self, dev: int, a: Action, now: float) -> float:
        """Books the memory of compute action ``a`` starting at ``now``; returns its nominal
        duration (host CPU extras included; an OPT's is the per-step host CPU)."""
        s, j = a.stage, a.replica
        if a.kind is K.STEP:
            return self.opt_ms(a)
        r = self.terms.stages[s].replicas[j]
        if a.kind is K.FORWARD:
            dur = r.forward_ms + r.host.forward_ms
        elif a.kind is K.BACKWARD:
            dur = r.backward_ms + r.host.backward_ms
        elif a.kind is K.BACKWARD_INPUT:
            dur = r.input_grad_ms + r.host.backward_ms
        else:
            dur = r.weight_grad_ms
        if a.kind is K.FORWARD:
            self.deltas[dev].append((now, self.stage_bytes(s, j).other))
            self.in_flight[dev] += 1
            self.peak_in_flight[dev] = max(self.peak_in_flight[dev], self.in_flight[dev])
        else:
            self.deltas[dev].append((now, self.moment(dev, a)))
        return dur

    def compute_end(self, dev: int, a: Action, start: float, end: float, busy_ms: float) -> None:
        """Records compute ``a`` of ``dev`` over ``[start, end]`` (``busy_ms`` long) and frees
        what a B, I or W releases."""
        if a.kind in _BACKWARDS:
            sb = self.stage_bytes(a.stage, a.replica)
            freed = self.moment(dev, a)
            if a.kind is not K.BACKWARD_INPUT:  # B or W: the micro-batch goes, gradients stay
                freed += sb.other
                self.in_flight[dev] -= 1
                if a.stage not in self.seen[dev]:
                    self.seen[dev].add(a.stage)
                    freed -= sb.grads
            self.deltas[dev].append((end, -freed))
        self.events.append(SimEvent(dev, a, start, end))
        self.busy[dev] += busy_ms
        self.t[dev] = end

    def other(self, dev: int, a: Action, now: float) -> bool:
        """Runs a non-compute action of ``dev`` at ``now``; False when it must wait (a receive
        whose message is not posted yet, an AllReduce not all replicas have reached, an
        ``AGREE`` not every device has reached, a ``POST`` before the previous step's rows)."""
        stages = self.plan.stages
        s, j = a.stage, a.replica
        if a.kind in SENDS:
            assert a.micro_batch is not None and a.peer is not None
            fwd = a.kind is K.SEND_F
            s_dst = s + 1 if fwd else s - 1
            dst = stages[s_dst].replica_devices[a.peer]
            x = self.transfer[(s, j, a.peer)] if fwd else self.transfer[(s - 1, a.peer, j)]
            nbytes = x.nbytes
            ms = x.forward_ms if fwd else x.backward_ms
            start = max(now, self.out_free.get(dev, 0.0)) if ms > 0 else now
            end = start + ms
            if ms > 0:  # the bytes hold the way out; the latency only delays the arrival
                self.out_free[dev] = end - self.cluster.latency_ms(dev, dst)
            key = (a.kind, s, a.micro_batch, j, a.peer)
            self.arrivals.setdefault(key, deque()).append(end)
            self.events.append(SimEvent(dev, a, start, end, dst, nbytes))
        elif a.kind in RECVS:
            assert a.micro_batch is not None and a.peer is not None
            fwd = a.kind is K.RECV_F
            key = (K.SEND_F if fwd else K.SEND_B, s - 1 if fwd else s + 1, a.micro_batch, a.peer, j)
            q = self.arrivals.get(key)
            if not q:
                return False
            self.t[dev] = max(now, q.popleft())
            src = stages[key[1]].replica_devices[a.peer]
            self.events.append(SimEvent(dev, a, now, self.t[dev], src))
        elif a.kind is K.ALLREDUCE:
            waiting = self.at_ar.setdefault(s, {})
            # AR, or ZeRO's reductions and gathers (dapple.cost.comm.stage_sync_ms)
            return self._meet(
                waiting, dev, now, stages[s].replicas, self.terms.stages[s].terms.sync_ms
            )
        elif a.kind is K.AGREE:
            return self._meet(self.agreeing, dev, now, len(self.sched), 0.0)
        elif a.kind is K.POST:
            return self._post(dev, a, now)
        else:  # OPT without time (no host CPU, no update): see the module docstring
            self.events.append(SimEvent(dev, a, now, now))
        return True

    def _meet(self, waiting: dict[int, float], dev: int, now: float, count: int, ms: float) -> bool:
        """``dev`` reaches a collective of ``count`` devices at ``now`` (``waiting``: those
        there before it); when it is the last, all of them leave it ``ms`` after it came."""
        waiting[dev] = now
        if len(waiting) < count:
            return False
        end = max(waiting.values()) + ms
        for d, arrived in waiting.items():
            self.events.append(SimEvent(d, self.sched[d][self.pc[d]], arrived, end))
            self.t[d] = end
            if d != dev:
                self.pc[d] += 1
        waiting.clear()
        return True

    def _post(self, dev: int, a: Action, now: float) -> bool:
        """``POST``: the device's row of its k-th step, after the rows of step k - 1 of every
        device have been gathered (False: not yet)."""
        k = self.posted[dev]
        if k > 0 and len(self.posts[k - 1]) < len(self.sched):
            return False
        start = max(now, max(self.posts[k - 1])) if k > 0 else now
        if k == len(self.posts):
            self.posts.append([])
        self.posts[k].append(start)
        self.posted[dev] += 1
        self.t[dev] = start
        self.events.append(SimEvent(dev, a, now, start))
        return True

    def sweep(self) -> None:
        """The sweep of the cluster's compute: dedicated devices or shared cores."""
        if self.cluster.compute_cores_per_server is None:
            self.sweep_dedicated()
        else:
            self.sweep_shared()

    def sweep_dedicated(self) -> None:
        """Dedicated devices: a round-robin dataflow sweep (module docstring) gives exact times."""
        progress = True
        while progress:
            progress = False
            for dev, prog in self.sched.items():
                while self.pc[dev] < len(prog):
                    a = prog[self.pc[dev]]
                    now = self.t[dev]
                    if self.is_cpu(dev, a):
                        dur = self.compute_start(dev, a, now)
                        self.compute_end(dev, a, now, now + dur, dur)
                    elif not self.other(dev, a, now):
                        break
                    self.pc[dev] += 1
                    progress = True
        self._check_done()

    def sweep_shared(self) -> None:
        """Shared compute (processor sharing): a discrete-event simulation in global time.

        Each running F/B keeps its remaining nominal work (ms at full speed). When k devices
        of one server compute at once, each progresses at rate ``min(1, c / k)`` (c =
        ``compute_cores_per_server``; :meth:`Cluster.compute_rate` with background load); rates are re-evaluated whenever a compute task starts or finishes on any
        server, and time jumps to the next finish or the next device becoming ready.
        """
        now = 0.0
        running: dict[int, list[Any]] = {}  # dev -> [remaining_ms, start_ms, action, nominal_ms]
        server = {d: self.cluster.server_of(d) for d in self.sched}
        while True:
            changed = True
            while changed:  # start every action that can start at `now`
                changed = False
                for dev, prog in self.sched.items():
                    while dev not in running and self.pc[dev] < len(prog) and self.t[dev] <= now:
                        a = prog[self.pc[dev]]
                        if self.is_cpu(dev, a):
                            dur = self.compute_start(dev, a, now)
                            running[dev] = [dur, now, a, dur]
                        elif self.other(dev, a, self.t[dev]):
                            self.pc[dev] += 1
                        else:
                            break
                        changed = True
            waking = [
                self.t[d]
                for d in self.sched
                if d not in running and self.pc[d] < len(self.sched[d]) and self.t[d] > now
            ]
            if not running and not waking:
                break
            k: dict[int, int] = {}
            for d in running:
                k[server[d]] = k.get(server[d], 0) + 1
            rate = {d: self.cluster.compute_rate(k[server[d]]) for d in running}
            nxt = min([now + r[0] / rate[d] for d, r in running.items()] + waking)
            dt = nxt - now
            for d in list(running):
                r = running[d]
                r[0] -= rate[d] * dt
                if r[0] <= 1e-9 * max(1.0, r[3]):
                    del running[d]
                    self.compute_end(d, r[2], r[1], nxt, nxt - r[1])
                    self.pc[d] += 1
            now = nxt
        self._check_done()

    def _check_done(self) -> None:
        stuck = [d for d in self.sched if self.pc[d] < len(self.sched[d])]
        if stuck:  # validate() runs the same dry run, so this is a bug guard
            raise ValidationError(f"simulation deadlocked at devices {stuck}")


def simulate(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    schedule: Schedule | None = None,
    *,
    overlap: CommOverlap = NO_OVERLAP,
    on_nonfinite: str = "stop",
) -> SimResult:
    """Simulate one training step of ``plan``.

    Args:
        plan: the plan to run; its schedule/policy pick the compute order.
        profile: per-layer costs.
        cluster: devices and links.
        schedule: a lowered schedule to run instead of ``lower(plan)``; validated first.
        overlap: the traffic the training framework hides under compute
            (:mod:`dapple.cost.overlap`); default: dapple's runtime, none.
        on_nonfinite: the run's non-finite mode, whose step point the lowered schedule holds
            (``AGREE`` for stop and skip, ``POST`` for off; :func:`dapple.schedule.lower.lower`).
            Without the guard (off) the step time is the steady period of consecutive steps
            (:func:`steady_period_ms`).

    A plan made for sequence lengths (``plan.mean_seq_len``) runs at them when the profile was
    measured at several (:func:`dapple.cost.at_length.profile_for_plan`).

    Raises:
        ValidationError: the plan does not fit the profile/cluster, the schedule is invalid or
            ``on_nonfinite`` is none of stop, skip and off.
    """
    profile = profile_for_plan(profile, plan)
    plan.validate_for(profile.num_layers, cluster.num_devices)
    sched = lower(plan, on_nonfinite=on_nonfinite) if schedule is None else schedule
    validate(sched, plan)
    terms = stage_terms(plan, profile, cluster, overlap=overlap)
    stages = plan.stages
    where = {d: plan.stage_of_device(d) for d in sched}
    run = _Run(terms, sched)
    run.sweep()
    t, busy, events, deltas = run.t, run.busy, run.events, run.deltas
    peak_in_flight = run.peak_in_flight
    span_ms = max(t.values(), default=0.0)
    steps_overlap = any(a.kind is K.POST for prog in sched.values() for a in prog)
    step_ms = steady_period_ms(terms, sched) if steps_overlap else span_ms
    memory: dict[int, tuple[tuple[float, float], ...]] = {}
    stats = []
    for dev in sorted(sched):
        s, j = where[dev]
        j_of = [run.stage_bytes(k, j) for k in plan.stages_of_device(dev)]
        static = device_static(j_of)
        level, peak = static, static
        points = [(0.0, static)]
        # OPT at the device's end: every gradient, the cast caches freed
        opt = [(t[dev], -sum(x.cache for x in j_of))] if any(x.cache for x in j_of) else []
        # frees before allocations at equal times, so back-to-back B/F do not double count
        for when, delta in sorted([*deltas[dev], *opt], key=lambda x: (x[0], x[1])):
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
                tensor_group=stages[s].tensor_group(j)
                if stages[s].parallel.tensor_parallel
                else (),
            )
        )
    try:
        L_ms = schedule_step_ms(terms, on_nonfinite=on_nonfinite)
    except DappleError:
        L_ms = math.nan
    return SimResult(
        step_ms=step_ms,
        L_ms=L_ms,
        schedule=plan.schedule,
        policy=plan.policy,
        devices=tuple(stats),
        # by start, then device; starts equal up to float rounding (the shared-compute sweep
        # accumulates rates) count as equal, so the order does not hinge on the last bit
        events=tuple(sorted(events, key=lambda e: (round(e.start_ms, 9), e.device))),
        memory=memory,
        span_ms=span_ms,
        on_nonfinite=on_nonfinite,
    )


def steady_period_ms(terms: PlanTerms, sched: Schedule) -> float:
    """The step time of ``sched`` run step after step: its programs repeated
    :data:`STEADY_STEPS` times, each device starting a step as soon as its previous one ends
    (what runs without the step's collective, ``POST``), and the period between the last two
    step ends of the slowest device."""
    run = _Run(terms, {d: prog * STEADY_STEPS for d, prog in sched.items()})
    run.sweep()
    ends: dict[int, list[float]] = {}
    for e in run.events:  # each device's in its program's order
        if e.action.kind is K.STEP:
            ends.setdefault(e.device, []).append(e.end_ms)
    return max((e[-1] - e[-2] for e in ends.values()), default=0.0)

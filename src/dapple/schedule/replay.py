"""The step time of a schedule as the longest path through its compute order (max-plus replay).

The step rule of the schedules that the paper's L does not cost (interleaved 1F1B, ZB-H1,
ZB-V, DualPipeV: ``ScheduleSpec.step_ms``). Their published bubbles (Narayanan et al. section 2.2.2; Qi et al. sections
3-6; DeepSeek-V3's DualPipe) assume equal stages and free communication; the replay assumes
neither. It runs each device group's compute order (:data:`~dapple.schedule.ir.ComputeOrder`)
in order, every action as soon as its device group is free and its input has arrived:

* a forward of virtual stage k > 0 waits for stage k-1's forward of the same micro-batch plus
  the activations' transfer across boundary k-1|k;
* a backward (``B`` or ``I``) of stage k < S-1 waits for stage k+1's of the same micro-batch
  plus the gradients' transfer back;
* a ``W`` follows its ``I`` on the same group (the order puts it after).

A transfer leaves when its compute ends, through the sending group's one way out, first come
first served: its bytes hold the way out for the transfer's time less the link latency, which
only delays the arrival (as :mod:`dapple.simulate.engine` sends). A transfer between two stages
of one device group (the bottom of a V) takes no time. Each group then pays its tail once (its
stages' gradient synchronisation and optimizer step) around the step point: with the step's
collective (the non-finite guard's ``AGREE``) every group waits for the last one's
synchronisation, then runs its own update, and the step ends when the last group's update does
(the collective's own time is not charged, as in the simulator). Without it (``POST``, ``StepTerms.overlapped``) no group waits and consecutive
steps overlap: the order is replayed :data:`STEADY_STEPS` times, each group starting a step when
its previous one ends (a step's row posted once every group's row of the step before is in),
and the step time is the slowest group's period between its last two step ends. With dedicated
devices this is the simulator's step up to how the simulator shares a receiver's way in between
senders (here folded into each transfer's time) and the per-replica slices (here the slowest
replica's slice and transfers stand for its group).

Pure, no torch; O(actions) per replay (:data:`STEADY_STEPS` times that without the collective).
"""

from __future__ import annotations

from dapple.errors import ValidationError
from dapple.schedule.ir import Action, ActionKind
from dapple.schedule.spec import StepTerms

__all__ = ["STEADY_STEPS", "replayed_step_ms"]

K = ActionKind

STEADY_STEPS = 3
"""Consecutive steps replayed without the step's collective; the last one's period counts."""


def replayed_step_ms(t: StepTerms) -> float:
    """The step time of ``t.order`` over ``t``'s stage times, links and tails (module
    docstring), in ms.

    Raises:
        ValidationError: the order deadlocks (an action waits on one that never runs).
    """
    steps = STEADY_STEPS if t.overlapped else 1
    ends = _Replay(t).run(steps)
    if t.overlapped:
        return max(e[-1] - e[-2] for e in ends.values())
    return max(e[-1] for e in ends.values())


class _Replay:
    """The replay's state over one or more consecutive steps (module docstring)."""

    def __init__(self, t: StepTerms) -> None:
        self.t = t
        self.ranks = sorted(t.order)
        self.updates = t.updates or (0.0,) * len(t.tails)
        self.clock = dict.fromkeys(self.ranks, 0.0)
        self.out_free = dict.fromkeys(self.ranks, 0.0)
        self.fwd: dict[tuple[int, int, int], float] = {}
        """(step, stage k, micro-batch) -> the activations' arrival at k + 1."""
        self.bwd: dict[tuple[int, int, int], float] = {}
        """(step, stage k, micro-batch) -> the gradients' arrival at k - 1."""
        self.posts: list[list[float]] = []
        """Per step, when each group reached its step point (``POST``)."""

    def send(self, g: int, end: float, ms: float, latency: float) -> float:
        """A transfer leaving group ``g`` at ``end`` through its way out; its arrival."""
        if ms <= 0.0:
            return end
        start = max(end, self.out_free[g])
        self.out_free[g] = start + ms - latency
        return start + ms

    def compute(self, g: int, n: int, a: Action) -> bool:
        """Runs ``a`` of step ``n`` on group ``g`` (False: its input has not arrived)."""
        t, S = self.t, len(self.t.stages)
        k, m = a.stage, a.micro_batch
        assert m is not None
        st = t.stages[k]
        if a.kind is K.FORWARD:
            ready = self.fwd.get((n, k - 1, m)) if k > 0 else 0.0
            dur = st.forward_ms
        elif a.kind is K.BACKWARD_WEIGHT:
            ready, dur = 0.0, st.weight_grad_ms
        else:
            ready = self.bwd.get((n, k + 1, m)) if k < S - 1 else 0.0
            dur = st.backward_ms if a.kind is K.BACKWARD else st.input_grad_ms
        if ready is None:
            return False
        end = max(self.clock[g], ready) + dur
        self.clock[g] = end
        if a.kind is K.FORWARD and k < S - 1:
            x = t.links[k]
            self.fwd[(n, k, m)] = self.send(g, end, x.forward_ms, x.latency_ms)
        elif a.kind.sends_gradient and k > 0:
            x = t.links[k - 1]
            self.bwd[(n, k, m)] = self.send(g, end, x.backward_ms, x.latency_ms)
        return True

    def tail(self, g: int, n: int) -> bool:
        """Group ``g``'s tail of step ``n`` without the step's collective: its synchronisation,
        its row posted once every group's row of step ``n - 1`` is in (False: not yet), its
        update."""
        if n > 0 and len(self.posts[n - 1]) < len(self.ranks):
            return False
        self.clock[g] += self.t.tails[g] - self.updates[g]
        if n > 0:
            self.clock[g] = max(self.clock[g], max(self.posts[n - 1]))
        if n == len(self.posts):
            self.posts.append([])
        self.posts[n].append(self.clock[g])
        self.clock[g] += self.updates[g]
        return True

    def run(self, steps: int) -> dict[int, list[float]]:
        """Replays ``steps`` consecutive steps (each group's order, then its tail); returns each
        group's step ends. With the step's collective (one step) the groups meet in it after
        their synchronisation and before their updates."""
        t, ranks = self.t, self.ranks
        pc = dict.fromkeys(ranks, 0)
        ends: dict[int, list[float]] = {g: [] for g in ranks}
        progress = True
        while progress:
            progress = False
            for g in ranks:
                acts = t.order[g]
                while pc[g] < (len(acts) + 1) * steps:
                    n, i = divmod(pc[g], len(acts) + 1)
                    if i < len(acts):
                        if not self.compute(g, n, acts[i]):
                            break
                    elif t.overlapped:
                        if not self.tail(g, n):
                            break
                        ends[g].append(self.clock[g])
                    pc[g] += 1
                    progress = True
        stuck = [g for g in ranks if pc[g] < (len(t.order[g]) + 1) * steps]
        if stuck:
            raise ValidationError(f"the compute order deadlocks at device groups {stuck}")
        if not t.overlapped:
            met = max(self.clock[g] + t.tails[g] - self.updates[g] for g in ranks)
            return {g: [met + self.updates[g]] for g in ranks}
        return ends

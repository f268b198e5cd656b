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
stages' gradient synchronisation and optimizer step), and the step ends when the last group
does. With dedicated devices this is the simulator's step up to how the simulator shares a
receiver's way in between senders (here folded into each transfer's time) and the per-replica
slices (here the slowest replica's slice and transfers stand for its group).

Pure, no torch; O(actions) per replay.
"""

from __future__ import annotations

from dapple.errors import ValidationError
from dapple.schedule.ir import ActionKind
from dapple.schedule.spec import StepTerms

__all__ = ["replayed_step_ms"]

K = ActionKind


def replayed_step_ms(t: StepTerms) -> float:
    """The step time of ``t.order`` over ``t``'s stage times, links and tails (module
    docstring), in ms.

    Raises:
        ValidationError: the order deadlocks (an action waits on one that never runs).
    """
    order, stages, links = t.order, t.stages, t.links
    S = len(stages)
    ranks = sorted(order)
    clock = dict.fromkeys(ranks, 0.0)
    out_free = dict.fromkeys(ranks, 0.0)
    pc = dict.fromkeys(ranks, 0)
    fwd: dict[tuple[int, int], float] = {}  # (stage k, micro-batch) -> activations at k + 1
    bwd: dict[tuple[int, int], float] = {}  # (stage k, micro-batch) -> gradients at k - 1

    def send(g: int, end: float, ms: float, latency: float) -> float:
        if ms <= 0.0:
            return end
        start = max(end, out_free[g])
        out_free[g] = start + ms - latency
        return start + ms

    progress = True
    while progress:
        progress = False
        for g in ranks:
            acts = order[g]
            while pc[g] < len(acts):
                a = acts[pc[g]]
                k, m = a.stage, a.micro_batch
                assert m is not None
                st = stages[k]
                if a.kind is K.FORWARD:
                    ready = fwd.get((k - 1, m)) if k > 0 else 0.0
                    dur = st.forward_ms
                elif a.kind is K.BACKWARD_WEIGHT:
                    ready, dur = 0.0, st.weight_grad_ms
                else:
                    ready = bwd.get((k + 1, m)) if k < S - 1 else 0.0
                    dur = st.backward_ms if a.kind is K.BACKWARD else st.input_grad_ms
                if ready is None:
                    break
                end = max(clock[g], ready) + dur
                clock[g] = end
                if a.kind is K.FORWARD and k < S - 1:
                    x = links[k]
                    fwd[(k, m)] = send(g, end, x.forward_ms, x.latency_ms)
                elif a.kind.sends_gradient and k > 0:
                    x = links[k - 1]
                    bwd[(k, m)] = send(g, end, x.backward_ms, x.latency_ms)
                pc[g] += 1
                progress = True
    stuck = [g for g in ranks if pc[g] < len(order[g])]
    if stuck:
        raise ValidationError(f"the compute order deadlocks at device groups {stuck}")
    return max(clock[g] + t.tails[g] for g in ranks)

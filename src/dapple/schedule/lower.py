"""Lowering: a plan's compute order -> per-device programs with split-concat communication,
per-stage gradient AllReduce and the optimizer step (paper section 6.2).

For every F of micro-batch m on (stage s, replica j): receive the overlapping slices from the
replicas of stage s-1, run F, send the overlapping slices to the replicas of stage s+1
(:func:`dapple.core.plan.transfers`). B mirrors it with gradients. After the last action each
replicated stage AllReduces its gradients, every device reaches the step point (``AGREE``: the
non-finite guard's world collective, which every rank waits for; ``POST`` without the guard: the
rank posts its row and goes on), then steps its optimizer.
Replicas whose slice of a micro-batch is empty (r_s > micro-batch size) skip it.
"""

from __future__ import annotations

from dapple.core.plan import Plan, transfers
from dapple.schedule.ir import Action, ActionKind, ComputeOrder, Schedule, step_point_kind
from dapple.schedule.registry import compute_order, get_schedule

__all__ = ["lower", "plan_compute_order"]

K = ActionKind


def plan_compute_order(plan: Plan) -> ComputeOrder:
    """The rank-level compute order of ``plan`` (its schedule, policy, v and, for a schedule
    bounded by the stages' in-flight limits, their D)."""
    D = [st.max_in_flight for st in plan.stages]
    return compute_order(
        plan.schedule,
        plan.num_groups,
        plan.num_micro_batches,
        plan.policy,
        D if get_schedule(plan.schedule).bounded else None,
        plan.virtual_stages,
    )


def lower(plan: Plan, order: ComputeOrder | None = None, *, on_nonfinite: str = "stop") -> Schedule:
    """Per-device programs for ``plan``; ``order`` overrides the plan's compute order.

    ``order`` maps each device group (pipeline rank) g to its compute actions; every replica
    of the group runs them on its slice, each action on its own (virtual) stage, with the
    split-concat transfers of that stage's boundaries. ``I`` sends gradients like ``B``;
    ``W`` needs no communication. After its last compute a device AllReduces each of its
    replicated stages (last stage first: its gradients are complete first), reaches the step
    point of ``on_nonfinite`` (:func:`~dapple.schedule.ir.step_point_kind`: ``AGREE`` under the
    guard, ``POST`` with ``off``), then steps.

    Returns:
        device id -> ordered actions.

    Raises:
        ValidationError: ``on_nonfinite`` is none of stop, skip and off.
    """
    point = step_point_kind(on_nonfinite)
    order = plan_compute_order(plan) if order is None else order
    b = plan.micro_batch_size
    S = plan.num_stages
    reps = [st.replicas for st in plan.stages]
    # Peers per (stage boundary): for boundary s|s+1, src replica j -> [dst k...], dst k -> [src j...]
    fwd_peers: list[dict[int, list[int]]] = []
    bwd_peers: list[dict[int, list[int]]] = []
    for s in range(S - 1):
        out: dict[int, list[int]] = {}
        inn: dict[int, list[int]] = {}
        for j, k, _lo, _hi in transfers(
            b, reps[s], reps[s + 1], plan.stages[s].shares, plan.stages[s + 1].shares
        ):
            out.setdefault(j, []).append(k)
            inn.setdefault(k, []).append(j)
        fwd_peers.append(out)
        bwd_peers.append(inn)

    sched: Schedule = {}
    for g in range(plan.num_groups):
        st = plan.stages[g]
        stages = plan.stages_of_device(st.devices[0])
        sizes = st.slice_sizes(b)
        for j, dev in enumerate(st.replica_devices):  # a tensor group's first device
            prog: list[Action] = []
            if sizes[j] > 0:
                for a in order[g]:
                    m, s = a.micro_batch, a.stage
                    prev = bwd_peers[s - 1].get(j, []) if s > 0 else []
                    nxt = fwd_peers[s].get(j, []) if s < S - 1 else []
                    if a.kind is K.FORWARD:
                        prog += [Action(s, K.RECV_F, m, j, p) for p in prev]
                        prog.append(Action(s, K.FORWARD, m, j))
                        prog += [Action(s, K.SEND_F, m, j, p) for p in nxt]
                    elif a.kind.sends_gradient:
                        prog += [Action(s, K.RECV_B, m, j, p) for p in nxt]
                        prog.append(Action(s, a.kind, m, j))
                        prog += [Action(s, K.SEND_B, m, j, p) for p in prev]
                    else:
                        prog.append(Action(s, a.kind, m, j))
            if st.parallel.data_parallel:
                prog += [Action(s, K.ALLREDUCE, None, j) for s in reversed(stages)]
            prog.append(Action(g, point, None, j))
            prog.append(Action(g, K.STEP, None, j))
            sched[dev] = prog
    return sched

"""Schedule validation: coverage, ordering, send/recv pairing and a deadlock dry run.

Two entry points:

* :func:`validate_compute_order` (:mod:`dapple.schedule.validate_order`) checks a stage-level
  compute order (what the generators produce): every stage runs F_m and B_m exactly once for m
  in [0, M), B_m after F_m, and a dry run with the pipeline's data dependencies (F_m on stage s
  needs F_m on s-1; B_m on s needs B_m on s+1) finishes.
* :func:`validate` checks a lowered per-device schedule against its plan: actions belong to
  the device's (stage, replica), the replica's F/B cover every micro-batch once (none when its
  slice is empty), B follows its F, receives precede and sends follow their compute, sends and
  receives pair up with the split-concat peers of :func:`dapple.core.plan.transfers`, replicated
  stages AllReduce after their last B, the step point (``AGREE`` or ``POST``, one kind on
  every device) follows them, the optimizer steps last, and a dry run with blocking receives,
  non-blocking sends, an AllReduce that waits for every replica of its stage and an ``AGREE``
  that waits for every device terminates.

Failures raise :class:`~dapple.errors.ValidationError` whose message ends with a step x device
grid (rows: program step, columns: devices, cells: action strings) with the offending actions
marked ``>>like this<<`` (:func:`dapple.schedule.text_grid.format_grid`). The per-device checks are
named steps: :func:`_device_view`, :func:`_scan_actions` (:func:`_placement_problem`,
:func:`_order_problem`), :func:`_check_coverage`, :func:`_allreduce_problems`,
:func:`_step_problems`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dapple.core.parallelism import Parallelism
from dapple.core.plan import Plan, transfers
from dapple.errors import ValidationError
from dapple.schedule.ir import RECVS, SENDS, STEP_POINTS, Action, ActionKind, Schedule
from dapple.schedule.text_grid import Cell, Problem, fail, format_grid
from dapple.schedule.validate_order import validate_compute_order

__all__ = ["format_grid", "validate", "validate_compute_order"]

K = ActionKind

_MsgKey = tuple[ActionKind, int, int, int, int]
"""(SEND_F or SEND_B, sending stage, micro-batch, sending replica, receiving replica)."""

# Kinds by what the checks ask of them (sets: an Enum member looked up on its class costs an
# attribute lookup, and every action of every device is asked).
_TO_NEXT = frozenset({K.SEND_F, K.RECV_B})
"""Messages exchanged with the next stage's replicas."""
_TO_PREV = frozenset({K.RECV_F, K.SEND_B})
"""Messages exchanged with the previous stage's replicas."""
_AFTER_FORWARD = frozenset({K.BACKWARD, K.BACKWARD_INPUT, K.SEND_F})
"""Actions that need the micro-batch's forward before them."""


def _send_key(a: Action) -> _MsgKey:
    assert a.micro_batch is not None and a.peer is not None
    return (a.kind, a.stage, a.micro_batch, a.replica, a.peer)


def _recv_key(a: Action) -> _MsgKey:
    """The key of the send a receive matches."""
    assert a.micro_batch is not None and a.peer is not None
    if a.kind is K.RECV_F:
        return (K.SEND_F, a.stage - 1, a.micro_batch, a.peer, a.replica)
    return (K.SEND_B, a.stage + 1, a.micro_batch, a.peer, a.replica)


_Where = dict[tuple[ActionKind, int, int | None, int | None], int]
"""(kind, stage, micro-batch, peer) -> the step of the device's program that runs it."""


@dataclass(frozen=True, slots=True)
class _Device:
    """What the checks of one device's program know of it."""

    dev: int
    group: int
    """Its device group g (its first stage)."""
    replica: int
    """j: its replica index in every stage it runs."""
    owned: tuple[int, ...]
    """The stages it runs (v > 1: its group's chunks)."""
    parallel: Parallelism
    """The layout of its stages (r_s replicas)."""
    M: int
    active: bool
    """Its slice of a micro-batch is not empty."""
    prev_peers: dict[int, set[int]]
    """Per owned stage s: the replicas of s-1 that send to it."""
    next_peers: dict[int, set[int]]
    """Per owned stage s: the replicas of s+1 it sends to."""


_Peers = list[list[dict[int, list[int]]]]
"""``peers[0][s][k]``: the replicas of stage s-1 that send to replica k of s; ``peers[1][s][j]``:
the replicas of s+1 that replica j of s sends to (:func:`_peer_maps`)."""


def _peer_maps(plan: Plan) -> _Peers:
    """The split-concat peers of every stage boundary (:func:`dapple.core.plan.transfers`)."""
    S = plan.num_stages
    peers: _Peers = [[{} for _ in range(S)], [{} for _ in range(S)]]
    for s in range(S - 1):
        src, dst = plan.stages[s], plan.stages[s + 1]
        for j, k, _lo, _hi in transfers(
            plan.micro_batch_size, src.replicas, dst.replicas, src.shares, dst.shares
        ):
            peers[1][s].setdefault(j, []).append(k)
            peers[0][s + 1].setdefault(k, []).append(j)
    return peers


def _device_view(plan: Plan, dev: int, peers: _Peers) -> _Device:
    """:class:`_Device` of ``dev`` under ``plan`` (``peers`` as built by :func:`validate`)."""
    g, j = plan.stage_of_device(dev)
    owned = plan.stages_of_device(dev)
    st = plan.stages[g]
    S = plan.num_stages
    return _Device(
        dev=dev,
        group=g,
        replica=j,
        owned=owned,
        parallel=st.parallel,
        M=plan.num_micro_batches,
        active=st.slice_sizes(plan.micro_batch_size)[j] > 0,
        prev_peers={s: set(peers[0][s].get(j, [])) if s > 0 else set() for s in owned},
        next_peers={s: set(peers[1][s].get(j, [])) if s < S - 1 else set() for s in owned},
    )


def _check_device(plan: Plan, dev: int, prog: Sequence[Action], peers: _Peers) -> list[Problem]:
    """Per-device checks: ownership, coverage, local order of comm around compute, AR/OPT."""
    d = _device_view(plan, dev, peers)
    problems, where = _scan_actions(d, prog)
    if problems:
        return problems
    if d.active:
        for s in d.owned:
            for m in range(d.M):
                problems += _check_coverage(
                    dev, prog, where, s, m, d.prev_peers[s], d.next_peers[s]
                )
    return problems + _allreduce_problems(d, where) + _step_problems(d, where)


def _scan_actions(d: _Device, prog: Sequence[Action]) -> tuple[list[Problem], _Where]:
    """The device's actions one by one (:func:`_placement_problem`, :func:`_order_problem`).

    Returns:
        The problems found and where each action runs.
    """
    problems: list[Problem] = []
    where: _Where = {}
    for r, a in enumerate(prog):
        bad = _placement_problem(d, r, a, where)
        if bad is not None:
            problems.append(bad)
            continue
        where[(a.kind, a.stage, a.micro_batch, a.peer)] = r
        bad = _order_problem(d, r, a, where)
        if bad is not None:
            problems.append(bad)
    return problems, where


def _placement_problem(d: _Device, r: int, a: Action, where: _Where) -> Problem | None:
    """Step r runs one of the device's stages as its replica, a micro-batch in [0, M), and
    not an action seen before."""
    here = [(d.dev, r)]
    if a.stage not in d.owned or a.replica != d.replica:
        what = f"stage {d.group}" if len(d.owned) == 1 else f"stages {list(d.owned)}"
        return (f"device {d.dev} runs {what} replica {d.replica} but step {r} is {a}", here)
    m = a.micro_batch
    if m is not None and not 0 <= m < d.M:
        return (f"device {d.dev} step {r}: micro-batch {m} not in [0, {d.M})", here)
    key = (a.kind, a.stage, m, a.peer)
    if key in where:
        return (f"device {d.dev}: {a} appears twice", [(d.dev, where[key]), *here])
    return None


def _order_problem(d: _Device, r: int, a: Action, where: _Where) -> Problem | None:
    """Step r in order with what came before it: compute only with a non-empty slice, sends
    and receives with split-concat peers, backward halves and sends after what they need,
    AR only on a replicated stage."""
    dev, s, m, here = d.dev, a.stage, a.micro_batch, [(d.dev, r)]
    if a.kind.is_compute and not d.active:
        return (
            f"device {dev}: {a} but replica {d.replica}'s slice of a micro-batch is empty",
            here,
        )
    if a.kind in _TO_NEXT and a.peer not in d.next_peers[s]:
        return (
            f"device {dev}: {a} but replica {a.peer} of stage {s + 1} is no split-concat peer",
            here,
        )
    if a.kind in _TO_PREV and a.peer not in d.prev_peers[s]:
        return (
            f"device {dev}: {a} but replica {a.peer} of stage {s - 1} is no split-concat peer",
            here,
        )
    if a.kind in _AFTER_FORWARD and (K.FORWARD, s, m, None) not in where:
        verb = "sends" if a.kind is K.SEND_F else "runs"
        return (f"device {dev}: {a} {verb} before its forward", here)
    if a.kind is K.BACKWARD_WEIGHT and (K.BACKWARD_INPUT, s, m, None) not in where:
        return (f"device {dev}: {a} runs before its input gradient I", here)
    if a.kind is K.SEND_B and not (
        (K.BACKWARD, s, m, None) in where or (K.BACKWARD_INPUT, s, m, None) in where
    ):
        return (f"device {dev}: {a} sends before its backward", here)
    if a.kind is K.ALLREDUCE and not d.parallel.data_parallel:
        return (f"device {dev}: {a} on a stage with one replica", here)
    return None


_BACKS = (K.BACKWARD, K.BACKWARD_WEIGHT)
"""The actions that complete a micro-batch's parameter gradients."""


def _allreduce_problems(d: _Device, where: _Where) -> list[Problem]:
    """A replicated stage AllReduces once, after its last backward (B or W)."""
    problems: list[Problem] = []
    for s in d.owned:
        last_b = max(
            (r for (k, s2, _m, _p), r in where.items() if k in _BACKS and s2 == s), default=-1
        )
        ar = where.get((K.ALLREDUCE, s, None, None))
        if d.parallel.data_parallel and ar is None:
            r = d.parallel.replicas
            problems.append((f"device {d.dev}: stage {s} has {r} replicas but no AR", []))
        if ar is not None and ar < last_b:
            problems.append(
                (f"device {d.dev}: AR of stage {s} before its last backward", [(d.dev, ar)])
            )
    return problems


def _step_problems(d: _Device, where: _Where) -> list[Problem]:
    """The step point (``AGREE``/``POST``, where there is one) comes after every backward and
    AllReduce, and the optimizer step (OPT) after them all."""
    last = max(
        (
            r
            for (k, _s, _m, _p), r in where.items()
            if k in (*_BACKS, K.BACKWARD_INPUT, K.ALLREDUCE)
        ),
        default=-1,
    )
    points = sorted(r for (k, _s, _m, _p), r in where.items() if k in STEP_POINTS)
    if len(points) > 1:
        return [(f"device {d.dev}: {len(points)} step points (AGREE/POST), one allowed",
                 [(d.dev, r) for r in points])]  # fmt: skip
    if points and points[0] < last:
        return [(f"device {d.dev}: step point before the last backward/AR", [(d.dev, points[0])])]
    opt = where.get((K.STEP, d.group, None, None))
    if opt is None:
        return [(f"device {d.dev}: no optimizer step (OPT) on stage {d.group}", [])]
    if opt < max([last, *points]):
        return [(f"device {d.dev}: OPT before the last backward/AR/step point", [(d.dev, opt)])]
    return []


def _point_kind_problems(schedule: Schedule) -> list[Problem]:
    """Every device reaches the same step point (all ``AGREE``, all ``POST`` or none)."""
    kinds = {
        dev: next((a.kind.value for a in prog if a.kind in STEP_POINTS), "none")
        for dev, prog in schedule.items()
    }
    if len(set(kinds.values())) <= 1:
        return []
    where = [(dev, r) for dev, prog in schedule.items() for r, a in enumerate(prog)
             if a.kind in STEP_POINTS]  # fmt: skip
    said = ", ".join(f"device {dev} {k}" for dev, k in sorted(kinds.items()))
    return [(f"the devices' step points differ: {said}", where)]


def _check_coverage(
    dev: int,
    prog: Sequence[Action],
    where: Mapping[tuple[ActionKind, int, int | None, int | None], int],
    s: int,
    m: int,
    prev_peers: set[int],
    next_peers: set[int],
) -> list[Problem]:
    """Stage ``s`` runs F_m and B_m (or I_m and W_m) once, after their receives, before their
    sends."""
    problems: list[Problem] = []
    split = (K.BACKWARD_INPUT, s, m, None) in where or (K.BACKWARD_WEIGHT, s, m, None) in where
    grad = K.BACKWARD_INPUT if split else K.BACKWARD
    if split and (K.BACKWARD, s, m, None) in where:
        problems.append(
            (
                f"device {dev}: stage {s} micro-batch {m} runs both B and I/W",
                [(dev, where[(K.BACKWARD, s, m, None)])],
            )
        )
    if split and (K.BACKWARD_WEIGHT, s, m, None) not in where:
        problems.append((f"device {dev}: missing W of stage {s} micro-batch {m}", []))
    for kind, needs, ps in ((K.FORWARD, K.RECV_F, prev_peers), (grad, K.RECV_B, next_peers)):
        rc = where.get((kind, s, m, None))
        if rc is None:
            problems.append(
                (f"device {dev}: missing {kind.value} of stage {s} micro-batch {m}", [])
            )
            continue
        for p in sorted(ps):
            rr = where.get((needs, s, m, p))
            if rr is None or rr > rc:
                state = "missing" if rr is None else "after it"
                problems.append(
                    (f"device {dev}: {prog[rc]} needs {needs.value}{m}@{p} ({state})", [(dev, rc)])
                )
    for kind, send, ps in ((K.FORWARD, K.SEND_F, next_peers), (grad, K.SEND_B, prev_peers)):
        missing = [p for p in sorted(ps) if (send, s, m, p) not in where]
        rc = where.get((kind, s, m, None))
        if missing and rc is not None:
            problems.append(
                (f"device {dev}: {prog[rc]} never sends to replica(s) {missing}", [(dev, rc)])
            )
    return problems


def _dry_run(plan: Plan, schedule: Schedule) -> list[Problem]:
    """Blocking receives, non-blocking sends, AR waits for all replicas, AGREE for every
    device: find a deadlock."""
    pc = dict.fromkeys(schedule, 0)
    posted: Counter[_MsgKey] = Counter()
    at_ar: dict[int, set[int]] = {}
    agreeing: set[int] = set()
    progress = True
    while progress:
        progress = False
        for dev, prog in schedule.items():
            while pc[dev] < len(prog):
                a = prog[pc[dev]]
                if a.kind in RECVS:
                    key = _recv_key(a)
                    if posted[key] == 0:
                        break
                    posted[key] -= 1
                elif a.kind in SENDS:
                    posted[_send_key(a)] += 1
                elif a.kind is K.ALLREDUCE:
                    waiting = at_ar.setdefault(a.stage, set())
                    waiting.add(dev)
                    if len(waiting) < plan.stages[a.stage].replicas:
                        break
                    # the whole stage passes its AllReduce together
                    for d in waiting - {dev}:
                        pc[d] += 1
                    at_ar[a.stage] = set()
                elif a.kind is K.AGREE:
                    agreeing.add(dev)
                    if len(agreeing) < len(schedule):
                        break
                    for d in agreeing - {dev}:  # every device leaves the collective together
                        pc[d] += 1
                    agreeing = set()
                pc[dev] += 1
                progress = True
    stuck = [d for d in schedule if pc[d] < len(schedule[d])]
    if not stuck:
        return []
    waits = ", ".join(f"device {d} at {schedule[d][pc[d]]}" for d in sorted(stuck))
    return [(f"deadlock: {waits} wait forever", [(d, pc[d]) for d in stuck])]


def validate(schedule: Schedule, plan: Plan) -> None:
    """Check a lowered schedule (device -> actions) against ``plan``.

    Args:
        schedule: device id -> ordered actions, e.g. ``dapple.schedule.lower(plan)``.
        plan: the plan the schedule claims to run.

    Raises:
        ValidationError: devices differ from the plan's, an action belongs to another stage or
            replica, an F/B is missing or duplicated, B runs before its F, a receive does not
            precede (or a send does not follow) its compute, sends and receives do not pair
            up, AR/OPT or the step point are missing or misplaced, the devices' step points
            differ, or the dry run deadlocks. The message holds a
            step x device grid marking the offending actions ``>>so<<``.
    """
    if sorted(schedule) != sorted(plan.replica_devices):
        raise ValidationError(
            f"invalid schedule: devices {sorted(schedule)} differ from the plan's "
            f"{sorted(plan.replica_devices)}\n" + format_grid(schedule)
        )
    peers = _peer_maps(plan)
    problems: list[Problem] = []
    for dev in sorted(schedule):
        problems += _check_device(plan, dev, schedule[dev], peers)
    problems += _point_kind_problems(schedule)
    fail("schedule", problems, schedule, "dev")

    # Pairing: every send has exactly one receive and vice versa.
    sends: dict[_MsgKey, list[Cell]] = {}
    recvs: dict[_MsgKey, list[Cell]] = {}
    for dev, prog in schedule.items():
        for r, a in enumerate(prog):
            if a.kind in SENDS:
                sends.setdefault(_send_key(a), []).append((dev, r))
            elif a.kind in RECVS:
                recvs.setdefault(_recv_key(a), []).append((dev, r))
    for key in sorted(set(sends) | set(recvs), key=lambda k: (k[0].value, *k[1:])):
        ns, nr = len(sends.get(key, [])), len(recvs.get(key, []))
        if ns != nr:
            kind, s, m, j, k = key
            problems.append(
                (
                    f"{kind.value} of micro-batch {m} from stage {s} replica {j} to replica {k}: "
                    f"{ns} send(s) but {nr} receive(s)",
                    sends.get(key, []) + recvs.get(key, []),
                )
            )
    fail("schedule", problems, schedule, "dev")
    fail("schedule", _dry_run(plan, schedule), schedule, "dev")

"""Schedule validation: coverage, ordering, send/recv pairing and a deadlock dry run.

Two entry points:

* :func:`validate_compute_order` checks a stage-level compute order (what the generators
  produce): every stage runs F_m and B_m exactly once for m in [0, M), B_m after F_m, and a
  dry run with the pipeline's data dependencies (F_m on stage s needs F_m on s-1; B_m on s
  needs B_m on s+1) finishes.
* :func:`validate` checks a lowered per-device schedule against its plan: actions belong to
  the device's (stage, replica), the replica's F/B cover every micro-batch once (none when its
  slice is empty), B follows its F, receives precede and sends follow their compute, sends and
  receives pair up with the split-concat peers of :func:`dapple.core.plan.transfers`, replicated
  stages AllReduce after their last B, the optimizer steps last, and a dry run with blocking
  receives, non-blocking sends and an AllReduce that waits for every replica of its stage
  terminates.

Failures raise :class:`~dapple.errors.ValidationError` whose message ends with a step x device
grid (rows: program step, columns: devices, cells: action strings) with the offending actions
marked ``>>like this<<``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from dapple.core.plan import Plan, split_sizes, transfers
from dapple.errors import ValidationError
from dapple.schedule.ir import Action, ActionKind, ComputeOrder, Schedule

__all__ = ["format_grid", "validate", "validate_compute_order"]

K = ActionKind
Cell = tuple[int, int]
"""(column key: device or stage, row: program step)."""

_MAX_PROBLEMS = 8
_CONTEXT_ROWS = 2


def format_grid(
    programs: Mapping[int, Sequence[object]],
    marks: Iterable[Cell] = (),
    column_label: str = "dev",
) -> str:
    """Render programs as a step x column text grid, marking ``marks`` as ``>>cell<<``.

    Long programs are cut to the rows near a mark (``...`` stands for skipped rows).

    Args:
        programs: column key (device or stage) -> its ordered actions.
        marks: ``(column key, step)`` cells to highlight.
        column_label: header prefix of each column.
    """
    cols = sorted(programs)
    marked = set(marks)
    nrows = max((len(p) for p in programs.values()), default=0)
    cells: dict[Cell, str] = {}
    for c in cols:
        for r, a in enumerate(programs[c]):
            cells[(c, r)] = f">>{a}<<" if (c, r) in marked else str(a)
    for c, r in marked:  # a mark past the end of a program (e.g. a missing action)
        if r >= len(programs.get(c, ())):
            cells[(c, r)] = ">><<"
            nrows = max(nrows, r + 1)
    header = ["step", *(f"{column_label} {c}" for c in cols)]
    widths = [max(len(header[0]), len(str(max(nrows - 1, 0))))]
    for i, c in enumerate(cols):
        widths.append(
            max([len(header[i + 1])] + [len(cells.get((c, r), "")) for r in range(nrows)])
        )
    if nrows <= 24 or not marked:
        shown = list(range(min(nrows, 60)))
    else:
        keep = {
            r2
            for _c, r in marked
            for r2 in range(r - _CONTEXT_ROWS, r + _CONTEXT_ROWS + 1)
            if 0 <= r2 < nrows
        }
        shown = sorted(keep)

    def line(parts: Sequence[str]) -> str:
        return " | ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip()

    out = [line(header), "-+-".join("-" * w for w in widths)]
    prev = -1
    for r in shown:
        if r != prev + 1:
            out.append("...")
        out.append(line([str(r), *(cells.get((c, r), "") for c in cols)]))
        prev = r
    if shown and shown[-1] < nrows - 1:
        out.append("...")
    return "\n".join(out)


def _fail(
    what: str,
    problems: list[tuple[str, list[Cell]]],
    programs: Mapping[int, Sequence[object]],
    column_label: str,
) -> None:
    if not problems:
        return
    msgs = [p for p, _ in problems[:_MAX_PROBLEMS]]
    if len(problems) > _MAX_PROBLEMS:
        msgs.append(f"... and {len(problems) - _MAX_PROBLEMS} more")
    marks = [c for _, cs in problems[:_MAX_PROBLEMS] for c in cs]
    raise ValidationError(
        f"invalid {what}: "
        + "; ".join(msgs)
        + "\n"
        + format_grid(programs, marks, column_label=column_label)
    )


# --------------------------------------------------------------------------- compute orders


def validate_compute_order(order: ComputeOrder, S: int, M: int, v: int = 1) -> None:
    """Check a rank -> compute order for S ranks with v stages each and M micro-batches.

    Rank g runs stages g, g+S, ..., g+(v-1)S (v = 1: rank g is stage g). Each of its stages
    runs F_m once and then either the whole backward B_m or its two halves I_m and W_m (I
    first) for every m in [0, M). The dry run follows the pipeline's data dependencies: F_m
    on stage s needs F_m on s-1, B_m/I_m on s needs B_m/I_m on s+1.

    Args:
        order: rank -> ordered compute actions (as produced by the generators).
        S: number of ranks (device groups).
        M: number of micro-batches.
        v: stages per rank.

    Raises:
        ValidationError: a rank is missing or extra, an action is not a compute action of one
            of the rank's stages, an action is missing, duplicated or out of range, B/I runs
            before its F or W before its I, a stage mixes B with I/W for one micro-batch, or
            the order deadlocks; the message holds a step x rank grid marking the offending
            action.
    """
    problems: list[tuple[str, list[Cell]]] = []
    if v < 1:
        raise ValidationError(f"invalid compute order: v must be >= 1, got {v}")
    if sorted(order) != list(range(S)):
        problems.append((f"ranks must be 0..{S - 1}, got {sorted(order)}", []))
    for g in sorted(order):
        owned = set(range(g, S * v, S))
        seen: dict[tuple[int, ActionKind, int], int] = {}
        for r, a in enumerate(order[g]):
            if not a.kind.is_compute or a.stage not in owned:
                problems.append(
                    (
                        f"rank {g} step {r}: {a} is not a compute action of stages {sorted(owned)}",
                        [(g, r)],
                    )
                )
                continue
            m = a.micro_batch
            assert m is not None
            if not 0 <= m < M:
                problems.append((f"rank {g} step {r}: micro-batch {m} not in [0, {M})", [(g, r)]))
            key = (a.stage, a.kind, m)
            if key in seen:
                problems.append((f"rank {g}: {a} appears twice", [(g, seen[key]), (g, r)]))
                continue
            seen[key] = r
            need = K.BACKWARD_INPUT if a.kind is K.BACKWARD_WEIGHT else K.FORWARD
            if a.kind is not K.FORWARD and (a.stage, need, m) not in seen:
                problems.append((f"rank {g}: {a} runs before its {need.value}", [(g, r)]))
        for st in sorted(owned):
            for m in range(M):
                has = {k for k in K if (st, k, m) in seen}
                if K.FORWARD not in has:
                    problems.append((f"rank {g}: missing F of stage {st} micro-batch {m}", []))
                if K.BACKWARD in has and has & {K.BACKWARD_INPUT, K.BACKWARD_WEIGHT}:
                    problems.append(
                        (f"rank {g}: stage {st} micro-batch {m} runs both B and I/W", [])
                    )
                elif K.BACKWARD not in has and not {K.BACKWARD_INPUT, K.BACKWARD_WEIGHT} <= has:
                    problems.append(
                        (
                            f"rank {g}: missing backward (B, or I and W) of stage {st} micro-batch {m}",
                            [],
                        )
                    )
    _fail("compute order", problems, order, "rank")

    # Dry run: F_m on s needs F_m done on s-1, B_m/I_m on s needs B_m/I_m done on s+1.
    done: set[tuple[int, bool, int]] = set()  # (stage, is forward, micro-batch)
    pc = dict.fromkeys(order, 0)
    progress = True
    while progress:
        progress = False
        for g in order:
            while pc[g] < len(order[g]):
                a = order[g][pc[g]]
                m = a.micro_batch
                assert m is not None
                fwd = a.kind is K.FORWARD
                if fwd or a.kind.sends_gradient:
                    dep = (a.stage - 1 if fwd else a.stage + 1, fwd, m)
                    if 0 <= dep[0] < S * v and dep not in done:
                        break
                    done.add((a.stage, fwd, m))
                pc[g] += 1
                progress = True
    stuck = [g for g in order if pc[g] < len(order[g])]
    if stuck:
        waits = ", ".join(f"rank {g} at {order[g][pc[g]]}" for g in stuck)
        _fail(
            "compute order",
            [(f"deadlock: {waits} wait forever", [(g, pc[g]) for g in stuck])],
            order,
            "rank",
        )


# --------------------------------------------------------------------------- lowered schedules

_MsgKey = tuple[ActionKind, int, int, int, int]
"""(SEND_F or SEND_B, sending stage, micro-batch, sending replica, receiving replica)."""


def _send_key(a: Action) -> _MsgKey:
    assert a.micro_batch is not None and a.peer is not None
    return (a.kind, a.stage, a.micro_batch, a.replica, a.peer)


def _recv_key(a: Action) -> _MsgKey:
    """The key of the send a receive matches."""
    assert a.micro_batch is not None and a.peer is not None
    if a.kind is K.RECV_F:
        return (K.SEND_F, a.stage - 1, a.micro_batch, a.peer, a.replica)
    return (K.SEND_B, a.stage + 1, a.micro_batch, a.peer, a.replica)


def _check_device(
    plan: Plan, dev: int, prog: Sequence[Action], peers: list[list[dict[int, list[int]]]]
) -> list[tuple[str, list[Cell]]]:
    """Per-device checks: ownership, coverage, local order of comm around compute, AR/OPT."""
    problems: list[tuple[str, list[Cell]]] = []
    g, j = plan.stage_of_device(dev)
    owned = plan.stages_of_device(dev)
    st = plan.stages[g]
    M, S = plan.num_micro_batches, plan.num_stages
    active = split_sizes(plan.micro_batch_size, st.replicas)[j] > 0
    # replicas of s-1 that send to (s, j); replicas of s+1 that (s, j) sends to
    prev_peers = {s: set(peers[0][s].get(j, [])) if s > 0 else set() for s in owned}
    next_peers = {s: set(peers[1][s].get(j, [])) if s < S - 1 else set() for s in owned}
    where: dict[tuple[ActionKind, int, int | None, int | None], int] = {}
    what = f"stage {g}" if len(owned) == 1 else f"stages {list(owned)}"
    for r, a in enumerate(prog):
        here = [(dev, r)]
        s = a.stage
        if s not in owned or a.replica != j:
            problems.append((f"device {dev} runs {what} replica {j} but step {r} is {a}", here))
            continue
        m = a.micro_batch
        if m is not None and not 0 <= m < M:
            problems.append((f"device {dev} step {r}: micro-batch {m} not in [0, {M})", here))
            continue
        key = (a.kind, s, m, a.peer)
        if key in where:
            problems.append((f"device {dev}: {a} appears twice", [(dev, where[key]), *here]))
            continue
        where[key] = r
        if a.kind.is_compute and not active:
            problems.append(
                (f"device {dev}: {a} but replica {j}'s slice of a micro-batch is empty", here)
            )
        elif a.kind in (K.SEND_F, K.RECV_B) and a.peer not in next_peers[s]:
            problems.append(
                (
                    f"device {dev}: {a} but replica {a.peer} of stage {s + 1} is no split-concat peer",
                    here,
                )
            )
        elif a.kind in (K.RECV_F, K.SEND_B) and a.peer not in prev_peers[s]:
            problems.append(
                (
                    f"device {dev}: {a} but replica {a.peer} of stage {s - 1} is no split-concat peer",
                    here,
                )
            )
        elif (
            a.kind in (K.BACKWARD, K.BACKWARD_INPUT, K.SEND_F)
            and (K.FORWARD, s, m, None) not in where
        ):
            verb = "sends" if a.kind is K.SEND_F else "runs"
            problems.append((f"device {dev}: {a} {verb} before its forward", here))
        elif a.kind is K.BACKWARD_WEIGHT and (K.BACKWARD_INPUT, s, m, None) not in where:
            problems.append((f"device {dev}: {a} runs before its input gradient I", here))
        elif a.kind is K.SEND_B and not (
            (K.BACKWARD, s, m, None) in where or (K.BACKWARD_INPUT, s, m, None) in where
        ):
            problems.append((f"device {dev}: {a} sends before its backward", here))
        elif a.kind is K.ALLREDUCE and st.replicas == 1:
            problems.append((f"device {dev}: {a} on a stage with one replica", here))
    if problems:
        return problems
    if active:
        for s in owned:
            for m in range(M):
                problems += _check_coverage(dev, prog, where, s, m, prev_peers[s], next_peers[s])
    backs = (K.BACKWARD, K.BACKWARD_WEIGHT)
    for s in owned:
        last_b = max(
            (r for (k, s2, _m, _p), r in where.items() if k in backs and s2 == s), default=-1
        )
        ar = where.get((K.ALLREDUCE, s, None, None))
        if st.replicas > 1 and ar is None:
            problems.append((f"device {dev}: stage {s} has {st.replicas} replicas but no AR", []))
        if ar is not None and ar < last_b:
            problems.append(
                (f"device {dev}: AR of stage {s} before its last backward", [(dev, ar)])
            )
    last = max(
        (r for (k, _s, _m, _p), r in where.items() if k in (*backs, K.BACKWARD_INPUT, K.ALLREDUCE)),
        default=-1,
    )
    opt = where.get((K.STEP, g, None, None))
    if opt is None:
        problems.append((f"device {dev}: no optimizer step (OPT) on stage {g}", []))
    elif opt < last:
        problems.append((f"device {dev}: OPT before the last backward/AR", [(dev, opt)]))
    return problems


def _check_coverage(
    dev: int,
    prog: Sequence[Action],
    where: Mapping[tuple[ActionKind, int, int | None, int | None], int],
    s: int,
    m: int,
    prev_peers: set[int],
    next_peers: set[int],
) -> list[tuple[str, list[Cell]]]:
    """Stage ``s`` runs F_m and B_m (or I_m and W_m) once, after their receives, before their
    sends."""
    problems: list[tuple[str, list[Cell]]] = []
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


def _dry_run(plan: Plan, schedule: Schedule) -> list[tuple[str, list[Cell]]]:
    """Blocking receives, non-blocking sends, AR waits for all replicas: find a deadlock."""
    pc = dict.fromkeys(schedule, 0)
    posted: Counter[_MsgKey] = Counter()
    at_ar: dict[int, set[int]] = {}
    progress = True
    while progress:
        progress = False
        for dev, prog in schedule.items():
            while pc[dev] < len(prog):
                a = prog[pc[dev]]
                if a.kind in (K.RECV_F, K.RECV_B):
                    key = _recv_key(a)
                    if posted[key] == 0:
                        break
                    posted[key] -= 1
                elif a.kind in (K.SEND_F, K.SEND_B):
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
            up, AR/OPT are missing or misplaced, or the dry run deadlocks. The message holds a
            step x device grid marking the offending actions ``>>so<<``.
    """
    if sorted(schedule) != sorted(plan.devices):
        raise ValidationError(
            f"invalid schedule: devices {sorted(schedule)} differ from the plan's "
            f"{sorted(plan.devices)}\n" + format_grid(schedule)
        )
    b = plan.micro_batch_size
    S = plan.num_stages
    # peers[0][s][k]: replicas of s-1 that send to replica k of s; peers[1][s][j]: replicas of
    # s+1 that replica j of s sends to.
    peers: list[list[dict[int, list[int]]]] = [[{} for _ in range(S)], [{} for _ in range(S)]]
    for s in range(S - 1):
        for j, k, _lo, _hi in transfers(b, plan.stages[s].replicas, plan.stages[s + 1].replicas):
            peers[1][s].setdefault(j, []).append(k)
            peers[0][s + 1].setdefault(k, []).append(j)
    problems: list[tuple[str, list[Cell]]] = []
    for dev in sorted(schedule):
        problems += _check_device(plan, dev, schedule[dev], peers)
    _fail("schedule", problems, schedule, "dev")

    # Pairing: every send has exactly one receive and vice versa.
    sends: dict[_MsgKey, list[Cell]] = {}
    recvs: dict[_MsgKey, list[Cell]] = {}
    for dev, prog in schedule.items():
        for r, a in enumerate(prog):
            if a.kind in (K.SEND_F, K.SEND_B):
                sends.setdefault(_send_key(a), []).append((dev, r))
            elif a.kind in (K.RECV_F, K.RECV_B):
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
    _fail("schedule", problems, schedule, "dev")
    _fail("schedule", _dry_run(plan, schedule), schedule, "dev")

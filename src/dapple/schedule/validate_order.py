"""Validation of compute orders (what the schedule generators produce): coverage, ordering and
a dry run of the pipeline's data dependencies.

Every stage runs F_m once and B_m (or its halves I_m then W_m) once for m in [0, M), B_m after
F_m, and a dry run in which F_m on stage s needs F_m on s-1 and B_m/I_m on s needs B_m/I_m on
s+1 finishes. Failures raise :class:`~dapple.errors.ValidationError` whose message ends with a
step x rank grid marking the offending actions (:func:`dapple.schedule.text_grid.format_grid`).

Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dapple.errors import ValidationError
from dapple.schedule.ir import Action, ActionKind, ComputeOrder
from dapple.schedule.spec import Placement, round_robin
from dapple.schedule.text_grid import Problem, fail

__all__ = ["validate_compute_order"]

K = ActionKind


def validate_compute_order(
    order: ComputeOrder, S: int, M: int, v: int = 1, placement: Placement = round_robin
) -> None:
    """Check a rank -> compute order for S ranks with v stages each and M micro-batches.

    Rank g runs the stages ``placement`` puts on it: by default g, g+S, ..., g+(v-1)S (v = 1:
    rank g is stage g); ZB-V's :func:`~dapple.schedule.zbv.v_group`: g and 2S-1-g. Each of its stages
    runs F_m once and then either the whole backward B_m or its two halves I_m and W_m (I
    first) for every m in [0, M). The dry run follows the pipeline's data dependencies: F_m
    on stage s needs F_m on s-1, B_m/I_m on s needs B_m/I_m on s+1.

    Args:
        order: rank -> ordered compute actions (as produced by the generators).
        S: number of ranks (device groups).
        M: number of micro-batches.
        v: stages per rank.
        placement: (virtual stage, ranks, v) -> the rank that runs it.

    Raises:
        ValidationError: a rank is missing or extra, an action is not a compute action of one
            of the rank's stages, an action is missing, duplicated or out of range, B/I runs
            before its F or W before its I, a stage mixes B with I/W for one micro-batch, or
            the order deadlocks; the message holds a step x rank grid marking the offending
            action.
    """
    if v < 1:
        raise ValidationError(f"invalid compute order: v must be >= 1, got {v}")
    problems: list[Problem] = []
    if sorted(order) != list(range(S)):
        problems.append((f"ranks must be 0..{S - 1}, got {sorted(order)}", []))
    for g in sorted(order):
        owned = {k for k in range(S * v) if placement(k, S, v) == g}
        found, seen = _rank_actions(g, order[g], owned, M)
        problems += found + _rank_coverage(g, owned, seen, M)
    fail("compute order", problems, order, "rank")
    fail("compute order", _order_deadlock(order, S * v), order, "rank")


_OrderKey = tuple[int, ActionKind, int]
"""(stage, kind, micro-batch) of a compute action."""


def _rank_actions(
    g: int, actions: Sequence[Action], owned: set[int], M: int
) -> tuple[list[Problem], dict[_OrderKey, int]]:
    """Rank g's actions one by one: compute actions of its stages, micro-batches in [0, M),
    none twice, B/I after their F and W after its I.

    Returns:
        The problems found and where each action runs (step by key).
    """
    problems: list[Problem] = []
    seen: dict[_OrderKey, int] = {}
    for r, a in enumerate(actions):
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
    return problems, seen


def _rank_coverage(g: int, owned: set[int], seen: Mapping[_OrderKey, int], M: int) -> list[Problem]:
    """Every stage of rank g runs F_m and either B_m or I_m and W_m, for every m in [0, M)."""
    problems: list[Problem] = []
    halves = {K.BACKWARD_INPUT, K.BACKWARD_WEIGHT}
    for st in sorted(owned):
        for m in range(M):
            has = {k for k in K if (st, k, m) in seen}
            if K.FORWARD not in has:
                problems.append((f"rank {g}: missing F of stage {st} micro-batch {m}", []))
            if K.BACKWARD in has and has & halves:
                problems.append((f"rank {g}: stage {st} micro-batch {m} runs both B and I/W", []))
            elif K.BACKWARD not in has and not halves <= has:
                problems.append(
                    (
                        f"rank {g}: missing backward (B, or I and W) of stage {st} micro-batch {m}",
                        [],
                    )
                )
    return problems


def _order_deadlock(order: ComputeOrder, num_stages: int) -> list[Problem]:
    """Dry run of a compute order over ``num_stages`` stages: F_m on s needs F_m done on s-1,
    B_m/I_m on s needs B_m/I_m done on s+1. Returns the deadlock, if any."""
    done: set[tuple[int, bool, int]] = set()  # (stage, is forward, micro-batch)
    pc = dict.fromkeys(order, 0)
    progress = True
    while progress:
        progress = False
        for g, actions in order.items():
            start = pc[g]
            pc[g] = _run_rank(actions, start, done, num_stages)
            progress = progress or pc[g] > start
    stuck = [g for g in order if pc[g] < len(order[g])]
    if not stuck:
        return []
    waits = ", ".join(f"rank {g} at {order[g][pc[g]]}" for g in stuck)
    return [(f"deadlock: {waits} wait forever", [(g, pc[g]) for g in stuck])]


def _run_rank(
    actions: Sequence[Action], pc: int, done: set[tuple[int, bool, int]], num_stages: int
) -> int:
    """Run ``actions`` from step ``pc`` until one waits for a neighbour's F or B/I not yet in
    ``done`` (which the run adds to); returns the step it stopped at."""
    while pc < len(actions):
        a = actions[pc]
        m = a.micro_batch
        assert m is not None
        fwd = a.kind is K.FORWARD
        if fwd or a.kind.sends_gradient:
            dep = (a.stage - 1 if fwd else a.stage + 1, fwd, m)
            if 0 <= dep[0] < num_stages and dep not in done:
                break
            done.add((a.stage, fwd, m))
        pc += 1
    return pc

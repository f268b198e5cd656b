"""Schedule IR: actions as small immutable records, schedules as data (paper section 6.3).

An :class:`Action` is ``(stage, replica, kind, micro_batch, peer)``. Its compact string form
round-trips through :func:`parse_action`::

    1F3          stage 1 (replica 0) forward of micro-batch 3
    2.1B0        stage 2, replica 1, backward of micro-batch 0
    2I0 / 2W0    stage 2: the input-gradient / weight-gradient half of that backward (ZB-H1)
    0.0SEND_F4@1 stage 0 replica 0 sends micro-batch 4's activations to replica 1 of stage 1
    1.0RECV_B2@0 stage 1 replica 0 receives micro-batch 2's gradients from replica 0 of stage 2
    0.1AR        stage 0 replica 1 joins its stage's gradient AllReduce
    0.1AGREE     the step's world collective: every rank waits for every rank's verdict
    0.1POST      the step's rows posted without waiting (read at the next step's POST)
    0.1OPT       optimizer step

``B`` is a whole backward. Zero-bubble schedules split it as torch.distributed.pipelining
does: ``I`` computes the gradient of the stage input (Qi et al.'s ``B``, on the critical
path: its result is sent to the previous stage) and ``W`` the gradients of the parameters
(Qi et al.'s ``W``, free to fill bubbles); a schedule runs either ``B`` or ``I`` then ``W``.

A *compute order* maps each pipeline rank (device group) to its ordered compute actions (what
the generators produce); the action's ``stage`` is the stage it runs, the rank itself unless
the schedule interleaves v virtual stages per rank (rank g runs stages g, g+P, ...);
a *lowered schedule* maps each device id to its ordered actions, communication included
(what :func:`dapple.schedule.lower.lower` produces and both the simulator and the runtime run).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from dapple.errors import ValidationError

__all__ = [
    "RECVS",
    "SENDS",
    "STEP_POINTS",
    "Action",
    "ActionKind",
    "ComputeOrder",
    "Schedule",
    "format_actions",
    "parse_action",
    "step_point_kind",
]


class ActionKind(str, Enum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    """The input-gradient half of a backward (zero-bubble schedules)."""
    BACKWARD_WEIGHT = "W"
    """The weight-gradient half of a backward, after its ``I`` (zero-bubble schedules)."""
    SEND_F = "SEND_F"
    """Send forward activations (a slice) to ``peer`` in the next stage."""
    RECV_F = "RECV_F"
    """Receive forward activations from ``peer`` in the previous stage."""
    SEND_B = "SEND_B"
    """Send input gradients to ``peer`` in the previous stage."""
    RECV_B = "RECV_B"
    """Receive output gradients from ``peer`` in the next stage."""
    ALLREDUCE = "AR"
    """Gradient AllReduce over the stage's replicas, AR(P_s, g_s)."""
    AGREE = "AGREE"
    """The step point with the non-finite guard (``on_nonfinite`` stop or skip): every rank's
    verdict, measurements and part of the gradient norm in one world collective that every
    rank waits for before its ``OPT``."""
    POST = "POST"
    """The step point without the guard (``on_nonfinite`` off): the rank posts its row of the
    world collective and goes on; the rows are read at its next step's ``POST``, which waits
    for every rank's row of this step."""
    STEP = "OPT"
    """Optimizer step."""

    # The kinds' classes are module-level sets (below), read once per call: the simulator and
    # the validator ask them of every action, and an Enum member looked up on its class
    # costs an attribute lookup each.
    @property
    def is_compute(self) -> bool:
        """F, B, I or W."""
        return self in _COMPUTE

    @property
    def sends_gradient(self) -> bool:
        """A backward that produces the stage input's gradient (``B`` or ``I``)."""
        return self in _SENDS_GRADIENT

    @property
    def is_comm(self) -> bool:
        """A send or a receive."""
        return self in _COMM


_COMPUTE = frozenset(
    {
        ActionKind.FORWARD,
        ActionKind.BACKWARD,
        ActionKind.BACKWARD_INPUT,
        ActionKind.BACKWARD_WEIGHT,
    }
)
_SENDS_GRADIENT = frozenset({ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT})
SENDS = frozenset({ActionKind.SEND_F, ActionKind.SEND_B})
"""The send kinds."""
RECVS = frozenset({ActionKind.RECV_F, ActionKind.RECV_B})
"""The receive kinds."""
_COMM = SENDS | RECVS
STEP_POINTS = frozenset({ActionKind.AGREE, ActionKind.POST})
"""The step point's kinds: one per device, after its last backward and AR, before its OPT."""
_NEEDS_MB = _COMPUTE | _COMM


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one device's program."""

    stage: int
    kind: ActionKind
    micro_batch: int | None = None
    replica: int = 0
    peer: int | None = None
    """Replica index in the adjacent stage for send/recv actions."""

    def __post_init__(self) -> None:
        if self.stage < 0 or self.replica < 0:
            raise ValidationError(
                f"action stage/replica must be >= 0, got {self.stage}/{self.replica}"
            )
        if (self.kind in _NEEDS_MB) != (self.micro_batch is not None):
            raise ValidationError(
                f"action {self.kind.value} on stage {self.stage}: micro_batch "
                f"{'required' if self.kind in _NEEDS_MB else 'not allowed'}, got {self.micro_batch}"
            )
        if self.kind.is_comm != (self.peer is not None):
            raise ValidationError(
                f"action {self.kind.value} on stage {self.stage}: peer "
                f"{'required' if self.kind.is_comm else 'not allowed'}, got {self.peer}"
            )

    def __str__(self) -> str:
        head = (
            f"{self.stage}"
            if self.replica == 0 and self.peer is None
            else f"{self.stage}.{self.replica}"
        )
        mb = "" if self.micro_batch is None else str(self.micro_batch)
        tail = "" if self.peer is None else f"@{self.peer}"
        return f"{head}{self.kind.value}{mb}{tail}"


_KINDS = "|".join(sorted((k.value for k in ActionKind), key=len, reverse=True))
_RE = re.compile(rf"^(\d+)(?:\.(\d+))?({_KINDS})(\d+)?(?:@(\d+))?$")


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``.

    Raises:
        ValidationError: ``text`` is not an action string.
    """
    m = _RE.match(text.strip())
    if not m:
        raise ValidationError(
            f"not an action string: {text!r} (expected e.g. '1F3', '0.1SEND_F2@0', '1.0AR')"
        )
    stage, rep, kind, mb, peer = m.groups()
    return Action(
        stage=int(stage),
        replica=int(rep or 0),
        kind=ActionKind(kind),
        micro_batch=None if mb is None else int(mb),
        peer=None if peer is None else int(peer),
    )


def step_point_kind(on_nonfinite: str) -> ActionKind:
    """The step point of a run with ``on_nonfinite``: ``AGREE`` under the guard (stop, skip),
    ``POST`` without it (off).

    Raises:
        ValidationError: ``on_nonfinite`` is none of stop, skip and off.
    """
    if on_nonfinite in ("stop", "skip"):
        return ActionKind.AGREE
    if on_nonfinite == "off":
        return ActionKind.POST
    raise ValidationError(f"on_nonfinite must be stop, skip or off, got {on_nonfinite!r}")


def format_actions(actions: list[Action]) -> str:
    """Space-separated string form of a program."""
    return " ".join(str(a) for a in actions)


ComputeOrder = dict[int, list[Action]]
"""pipeline rank -> ordered compute actions (replica 0); the rank is the stage unless v > 1."""

Schedule = dict[int, list[Action]]
"""device id -> ordered actions of that device, communication included."""

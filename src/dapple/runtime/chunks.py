"""A rank that holds several model chunks (interleaved 1F1B: virtual stages g, g+P, ...).

Each chunk is a :class:`~dapple.runtime.stage.StageExecutor` of its own virtual stage, over its
own layers; :class:`RankChunks` is what the interpreter and the evaluation talk to when the
plan has ``virtual_stages > 1``: every action goes to the executor of ``action.stage``, and the
per-step calls (``begin_step``, ``finish_sends``, metering, the loss) go to all of them. The
rank's parameters are the union of the chunks' (one ``nn.Sequential`` over the same layers,
:meth:`dapple.core.plan.Plan.layers_of_device` giving each layer's chain index), so the
gradient AllReduce, the optimizer, checkpoints and the non-finite guard see one module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dapple.runtime.stage import StageExecutor
from dapple.schedule.ir import Action, ActionKind

__all__ = ["Executor", "RankChunks"]

Handler = Callable[[Action], None]


class RankChunks:
    """The executors of one rank's chunks, addressed by the stage of each action."""

    def __init__(self, executors: Sequence[StageExecutor]) -> None:
        if not executors:
            raise ValueError("a rank's chunks need at least one executor")
        self.chunks = {ex.s: ex for ex in executors}
        self.s = min(self.chunks)
        """The rank's first stage (its device group)."""
        self.j = executors[0].j
        self._tables = {s: ex.handlers() for s, ex in self.chunks.items()}

    # -- dispatch by stage -----------------------------------------------------------------------
    def handlers(self) -> dict[ActionKind, Handler]:
        """A handler per action kind that runs the action on its stage's chunk."""
        kinds = next(iter(self._tables.values()))
        return {kind: self._dispatch(kind) for kind in kinds}

    def _dispatch(self, kind: ActionKind) -> Handler:
        tables = self._tables
        return lambda a: tables[a.stage][kind](a)

    def forward(self, a: Action) -> None:
        self.chunks[a.stage].forward(a)

    def backward(self, a: Action) -> None:
        self.chunks[a.stage].backward(a)

    def backward_input(self, a: Action) -> None:
        self.chunks[a.stage].backward_input(a)

    def backward_weight(self, a: Action) -> None:
        self.chunks[a.stage].backward_weight(a)

    def recv_forward(self, a: Action) -> None:
        self.chunks[a.stage].recv_forward(a)

    def send_forward(self, a: Action) -> None:
        self.chunks[a.stage].send_forward(a)

    def release(self, a: Action) -> None:
        self.chunks[a.stage].release(a)

    # -- every chunk -----------------------------------------------------------------------------
    def begin_step(self, inputs: object, targets: torch.Tensor, step: int = 0) -> None:
        for ex in self.chunks.values():
            ex.begin_step(inputs, targets, step)

    def finish_sends(self) -> None:
        for ex in self.chunks.values():
            ex.finish_sends()

    @property
    def loss_sum(self) -> torch.Tensor | float:
        """The step's loss part: the last stage's chunk's (a device tensor; 0.0 on a rank
        without the last stage). Read after every forward of the rank: nothing is added."""
        for ex in self.chunks.values():
            if ex.last:
                return ex.loss_sum
        return 0.0

    @property
    def waiting_on(self) -> tuple[str, int] | None:
        return next((ex.waiting_on for ex in self.chunks.values() if ex.waiting_on), None)

    @property
    def metering(self) -> bool:
        return all(ex.metering for ex in self.chunks.values())

    @metering.setter
    def metering(self, on: bool) -> None:
        for ex in self.chunks.values():
            ex.metering = on

    @property
    def on_grad_ready(self) -> Callable[[torch.Tensor], None] | None:
        return next(iter(self.chunks.values())).on_grad_ready

    @on_grad_ready.setter
    def on_grad_ready(self, fn: Callable[[torch.Tensor], None] | None) -> None:
        for ex in self.chunks.values():
            ex.on_grad_ready = fn


Executor = StageExecutor | RankChunks
"""What runs a rank's actions: its stage's executor, or its chunks' (``virtual_stages > 1``)."""

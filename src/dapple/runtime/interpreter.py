"""One rank's lowered program, run action by action through a table of handlers (section 6).

Every rank runs ``dapple.schedule.lower(plan)[rank]`` - the same per-device program the
simulator runs - and dispatches every action on its kind:

- ``RECV_F``/``RECV_B`` post ``irecv``s, early: right after the first action at most
  :data:`RECV_AHEAD` positions before them that is not itself an early receive. Gloo moves a
  message only once its irecv is posted, so a just-in-time irecv exposes the whole transfer;
  posted early it overlaps compute;
- ``F``/``B`` wait for their receives and compute; the non-finite guard notes every loss
  (:meth:`NonFiniteGuard.watch`); the rank's last ``B`` first arms the overlapped gradient
  AllReduce (:meth:`GradientSync.arm`), whose buckets start while backward still runs;
- ZB-H1 splits ``B`` into ``I`` (the input gradients, sent at once) and ``W`` (the weight
  gradients, later; :mod:`dapple.models.split_backward`): ``W`` takes ``B``'s place for the
  guard, ZeRO-2 and the arming, and tells the buckets of each gradient it completes;
- a rank holding several chunks (interleaved) runs each action on the chunk of its stage
  (:class:`~dapple.runtime.chunks.RankChunks`); each chunk's last backward arms its own
  parameters' buckets, and the first ``AR`` waits for every chunk's gradients (one set of
  buckets over the group's replicas), the later ones do nothing;
- ``SEND_F``/``SEND_B`` post ``isend``s (all waited for at the step point);
- ``AR`` waits for AR(P_s, g_s) over the stage's replicas (:meth:`GradientSync.finish`);
- ``OPT`` runs in two parts around the step point. Before it: the tied parameters' gradient
  sums (:meth:`GradientSync.tied`), the fp16 unscaling (:meth:`Precision.unscale_grads`) and
  this rank's part of the global gradient norm (:meth:`ModelUpdate.local_sq_norm`; on a step
  without the norm, ``grad_norm_every``, its finiteness: :meth:`ModelUpdate.local_nonfinite_part`). After it:
  :meth:`ModelUpdate.step` clips by the global norm, sets the step's lr and steps the
  optimizer (ranks beyond the plan call :meth:`ModelUpdate.join` after their empty program);
  under ZeRO (:mod:`dapple.runtime.parallel.zero`) the optimizer holds this replica's shard only and
  :meth:`FlatShards.gather` then starts bringing every replica the others' updated chunks
  (each layer waits for its own before its next forward).
  ZeRO-1 reduce-scatters the gradients (overlapped with the last backward, waited for at
  ``AR``) instead of the AllReduce; ZeRO-2 after every ``B``.

The program is compiled once into *ops* - ``(position, action, handler)`` in execution order,
early receives moved up, the arming wrapped around the last ``B`` - so a step is a plain loop.

The step point: the program's ``AGREE`` or ``POST`` (:func:`dapple.schedule.lower.lower` puts it
after the ``AR`` and before the ``OPT``; it must match the guard's ``on_nonfinite``). After the
program's ``AR`` and the first part of its ``OPT`` (at the end of an empty program, on ranks
beyond the plan) every rank joins the step's one world collective at ``AGREE``,
:meth:`NonFiniteGuard.agree_finite`, with its non-finite verdict, loss part, peak memory, the batch's
target tokens and its part of the gradient norm - all on the device until that collective's
one host read, the only one of a step (no micro-batch reads anything: the losses stay on the
device, and the gradients' verdict is their norm). The optimizer step runs only when every
rank's verdict is finite, so a NaN stops or skips the step on every rank before ``OPT`` touches
the weights (its gradients are dropped). A non-finite gradient is named by a replay of the
step's compute part (:meth:`ProgramInterpreter._replay`) with a check after each backward.
:func:`dapple.schedule.lower.lower` puts ``AR``, the step point and ``OPT`` last; a program with
another action after them is rejected (:func:`step_point`).

With ``on_nonfinite="off"`` (the ``POST`` step point) there is no verdict: each rank posts its row
asynchronously (:class:`~dapple.runtime.late_rows.LateRows`) and runs OPT's second part at once,
without waiting for the other ranks; :meth:`ProgramInterpreter.run_step` returns the previous
step's rows, read when this step posts its own, and :meth:`ProgramInterpreter.finish` the last
step's.

A failure inside an action raises :class:`RankFailure` naming the step, the rank, the action or
what it waited for and the lost peer, followed by the schedule grid with that action marked.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from dapple.core.plan import Plan
from dapple.errors import ValidationError
from dapple.runtime.chunks import Executor, RankChunks
from dapple.runtime.guard import NonFiniteGuard
from dapple.runtime.late_rows import LateRows
from dapple.runtime.launch.failure import RankFailure, describe_rank, failure_grid, short_error
from dapple.runtime.metrics import ROW_SQ_NORM, StepProbe, device_row, global_norm
from dapple.runtime.optim import ModelUpdate
from dapple.runtime.parallel.expert import ExpertLoads
from dapple.runtime.parallel.zero import FlatShards
from dapple.runtime.precision import Precision
from dapple.runtime.reporting import target_token_count
from dapple.runtime.step_point import point_of, step_point
from dapple.runtime.sync import GradientSync
from dapple.runtime.timeline import Timeline
from dapple.schedule.ir import RECVS, STEP_POINTS, Action, ActionKind, Schedule

__all__ = ["RECV_AHEAD", "ProgramInterpreter", "step_point"]

K = ActionKind

RECV_AHEAD = 4
"""Program positions ahead of the current action whose RECV_F/RECV_B are posted early."""
_GRADS = (K.BACKWARD, K.BACKWARD_WEIGHT)
"""The actions that accumulate parameter gradients."""

Handler = Callable[[Action], None]


class _Op(NamedTuple):
    """One compiled action: its position in the rank's program, the action, its handler."""

    position: int
    action: Action
    run: Handler


def _reduced(a: Action) -> None:
    """``AR`` of a rank's second and later chunk (interleaved): its gradients were reduced
    with the first chunk's, in the same buckets over the same replicas."""


def _compile(program: Sequence[Action], handler_at: Callable[[int], Handler]) -> list[_Op]:
    """``program`` in execution order: each action, then the receives up to
    :data:`RECV_AHEAD` positions ahead that are not posted yet."""
    ops: list[_Op] = []
    early: set[int] = set()
    for i, a in enumerate(program):
        if i in early:
            continue
        ops.append(_Op(i, a, handler_at(i)))
        for k in range(i + 1, min(len(program), i + 1 + RECV_AHEAD)):
            if program[k].kind in RECVS and k not in early:
                ops.append(_Op(k, program[k], handler_at(k)))
                early.add(k)
    return ops


class ProgramInterpreter:
    """Runs one rank's lowered program, step by step (see the module docstring).

    Every rank creates one, ranks beyond the plan too (``executor=None``, an empty program):
    they take part in the step's collective.
    """

    def __init__(
        self,
        plan: Plan,
        schedule: Schedule,
        rank: int,
        *,
        executor: Executor | None,
        sync: GradientSync,
        guard: NonFiniteGuard,
        optimizer: torch.optim.Optimizer | None,
        params: list[nn.Parameter],
        probe: StepProbe,
        update: ModelUpdate,
        precision: Precision | None = None,
        shards: FlatShards | None = None,
        loads: ExpertLoads | None = None,
    ) -> None:
        self.plan, self.schedule, self.rank = plan, schedule, rank
        self.shards = shards
        self.loads = loads
        """The expert-load counters (None: no MoE layer counted); summed over the ranks in
        the step's collective, the sums in :attr:`expert_load`."""
        self.expert_load: tuple[tuple[tuple[int, ...], ...], tuple[float, ...]] = ((), ())
        """The last step's tokens per expert and load-balancing loss per MoE layer
        (:meth:`~dapple.runtime.parallel.expert.load.LoadLayout.split`)."""
        self.ex, self.sync, self.guard, self.probe = executor, sync, guard, probe
        self.optimizer, self.params, self.update = optimizer, params, update
        self.precision = precision or Precision("fp32", torch.device("cpu"))
        program = schedule.get(rank, [])
        if program and executor is None:
            raise ValidationError(f"rank {rank} has a program but no stage executor")
        n = step_point(schedule, rank)
        point = point_of(program[n:], guard.config.on_nonfinite, rank)
        self.late = LateRows(guard.world) if point is K.POST else None
        """The ``POST`` step point (``on_nonfinite="off"``): the step's rows gathered
        asynchronously, read a step late (None: ``AGREE``, the guard's collective, read at the
        step point)."""
        table: dict[ActionKind, Handler] = {
            **(executor.handlers() if executor is not None else {}),
            K.BACKWARD: self._backward,
            K.BACKWARD_INPUT: self._backward_input,
            K.BACKWARD_WEIGHT: self._backward,
            K.ALLREDUCE: self._allreduce,
            K.STEP: self._prepare_update,
        }
        if guard.last_stage:  # its F keep the loss so far (the others: the executor's F alone)
            table[K.FORWARD] = self._forward
        last_b = {a.stage: i for i, a in enumerate(program) if a.kind in _GRADS}
        """Each chunk's last ``B``/``W`` of the step: its gradients are final after it."""
        if executor is not None:  # a W's parameter gradients bypass autograd's hooks
            executor.on_grad_ready = self._grad_ready

        first_ar = next((i for i, a in enumerate(program) if a.kind is K.ALLREDUCE), -1)

        def handler_at(i: int) -> Handler:
            if last_b.get(program[i].stage) == i:
                return self._last_backward
            if program[i].kind is K.ALLREDUCE and i != first_ar:
                return _reduced  # the rank's first AR reduced every chunk's gradients
            return table[program[i].kind]

        self._compute = _compile(program[:n], handler_at)
        """F, B, sends and receives: everything before the step point."""
        self._reduce = [
            _Op(i, program[i], handler_at(i))
            for i in range(n, len(program))
            if program[i].kind not in STEP_POINTS
        ]
        """AR and OPT's first part (tied sums, unscaling, this rank's part of the norm): after
        the compute, before the step point."""
        self._apply = [
            op._replace(run=self._apply_update) for op in self._reduce if op.action.kind is K.STEP
        ]
        """OPT's second part (clipping, optimizer step, ZeRO's gather): after the step point."""
        self._timeline = Timeline.from_env(rank, plan)
        """This rank's measured timeline (None unless ``DAPPLE_TIMELINE`` is set)."""
        if self._timeline is not None:
            timed = self._timeline.wrap
            self._compute, self._reduce, self._apply = (
                [op._replace(run=timed(op.position, op.action, op.run)) for op in ops]
                for ops in (self._compute, self._reduce, self._apply)
            )
        self._joins = not self._apply
        """No OPT here (a rank beyond the plan): it only reports the step's lr."""
        self._sq_norm: torch.Tensor | float = 0.0
        """This step's part of the squared gradient norm (0 until OPT's first part)."""
        ranks = list(plan.stages[executor.s].devices) if executor is not None else []
        self._phases = {
            K.ALLREDUCE: f"gradient AllReduce over ranks {ranks}",
            K.STEP: "tied-parameter sums, global gradient norm and optimizer step"
            + (" (its shard), parameter gather" if shards is not None else ""),
        }
        self._at: _Op | str = "start of step"  # what runs now (formatted only on failure)
        self._step = -1

    # -- one step ------------------------------------------------------------------------------
    def run_step(self, step: int, inputs: Any, targets: torch.Tensor) -> list[list[float]] | None:
        """Run step ``step`` of the program on this global batch.

        Returns:
            The rows of the step's collective, one per rank: ``[loss, stage, squared
            gradient norm part, rank, loss part, peak bytes, peak resident bytes, baseline
            bytes, target tokens]`` (see :meth:`NonFiniteGuard.agree_finite`,
            :data:`dapple.runtime.metrics.ROW_SQ_NORM` and :data:`~dapple.runtime.metrics.ROW_TOKENS`).
            With ``on_nonfinite="off"`` (:attr:`late`): the previous step's rows (None at the
            run's first step; the last step's come from :meth:`finish`).

        Raises:
            RankFailure: a non-finite loss or gradient stops the run (``on_nonfinite="stop"``;
                one line), or an action, the step's collective or a peer failed (the action's
                failure carries the schedule grid).
        """
        self._step = step
        self._at = "start of step"
        self._sq_norm = 0.0
        if self._timeline is not None:
            self._timeline.begin_step(step)
        try:
            if self.ex is not None:
                self._compute_part(step, inputs, targets)  # F, B, SEND_*, RECV_*
            self._execute(self._reduce)  # AR, OPT's first part
            verdict, rows = (
                (None, self._post(targets))
                if self.late is not None
                else self._meet(step, inputs, targets)
            )
            if verdict is None:
                self._execute(self._apply)  # OPT's second part
                if self._joins:
                    self.update.join(step)
            else:  # stop or skip: drop what is in flight (a skipped step updates nothing)
                self._at = "dropping the gradient AllReduce"
                self.sync.drain()
                if self.shards is not None:
                    self.shards.drain()
                if verdict:
                    raise RankFailure(verdict)
        except RankFailure:
            raise
        except Exception as e:
            raise self._failure(step, e) from e
        if self._timeline is not None:
            self._timeline.end_step()
        return rows

    def _compute_part(self, step: int, inputs: Any, targets: torch.Tensor) -> None:
        """Everything before the step point; then wait for the step's sends."""
        assert self.ex is not None
        for p in self.params:
            p.grad = None
        if self.shards is not None:
            self.shards.begin_step()
        self.ex.begin_step(inputs, targets, step)
        self.guard.begin_step()
        if self.loads is not None:
            self.loads.begin_step()
        with self.precision.weight_cache():  # autocast: one cast of the weights per step
            self._execute(self._compute)
        self._at = "the step's sends"
        self.ex.finish_sends()

    def _execute(self, ops: list[_Op]) -> None:
        for op in ops:
            self._at = op
            op.run(op.action)

    def _meet(
        self, step: int, inputs: Any, targets: torch.Tensor
    ) -> tuple[str | None, list[list[float]]]:
        """The step point: every rank's verdict, measurements and part of the gradient norm in
        one world collective, read once; the norm's sum stays on the device for clipping."""
        self._at = "the step's collective (non-finite check and metrics, all ranks)"
        extra = self._extra(targets)
        summed = self.loads.vector() if self.loads is not None else None
        verdict, rows, table = self.guard.agree_finite(
            step, extra, grad_sq_norm=self._sq_norm, replay=lambda: self._replay(inputs, targets),
            summed=summed,
        )  # fmt: skip
        if self.loads is not None:
            self.expert_load = self.loads.layout.split(self.guard.sums)
        self.probe.lap()
        if verdict is None:
            norm = global_norm(rows) if self.update.norm_due(step) else None
            self.update.set_norm(self._sq_total(table), norm)
        return verdict, rows

    def _post(self, targets: torch.Tensor) -> list[list[float]] | None:
        """The step point without the guard: the previous step's rows read, this step's posted
        (no rank waits for another's row)."""
        assert self.late is not None
        self._at = "the step's collective (metrics, all ranks, read a step late)"
        rows = self._take()
        row = device_row(self.guard.row(self._extra(targets), self._sq_norm), self.guard.device)
        self.late.post(row, self.loads.vector() if self.loads is not None else None)
        self.probe.lap()
        return rows

    def _take(self) -> list[list[float]] | None:
        """The posted step's rows (None: none pending); its expert loads into
        :attr:`expert_load`."""
        assert self.late is not None
        got = self.late.take()
        if got is None:
            return None
        rows, _, sums = got
        if self.loads is not None:
            self.expert_load = self.loads.layout.split(sums)
        return rows

    def finish(self) -> list[list[float]] | None:
        """After the run's last step: with ``on_nonfinite="off"`` that step's rows (read now;
        None when no step ran), else None (every step's rows came with it).

        Raises:
            RankFailure: a peer failed before joining the last step's collective.
        """
        if self._timeline is not None:
            self._timeline.write()
        if self.late is None:
            return None
        self._at = "the last step's collective (metrics, all ranks)"
        try:
            return self._take()
        except Exception as e:
            raise self._failure(self._step, e) from e

    def _extra(self, targets: torch.Tensor) -> tuple[float | torch.Tensor, ...]:
        """This rank's measurements in the step's row: its loss part (once per tensor group:
        its ranks all compute the same one), peak, resident peak and baseline bytes, and the
        batch's target tokens (-1: not a token workload)."""
        counts = self.ex is not None and getattr(self.ex, "tensor_rank", 0) == 0
        loss_part = self.ex.loss_sum if counts and self.ex is not None else 0.0
        tokens = target_token_count(targets)
        return (loss_part, float(self.probe.peak_bytes()), float(self.probe.resident_peak_bytes()),
                float(self.probe.baseline_bytes), -1.0 if tokens is None else tokens)  # fmt: skip

    def _sq_total(self, table: torch.Tensor | None) -> torch.Tensor | None:
        """``||g||_2^2`` on the device, every rank's part summed (the gathered rows' ``table``;
        None: a world of one, whose part is the total), for clipping only (None without)."""
        if not self.update.clips:
            return None
        if table is not None:
            return table[:, ROW_SQ_NORM].sum()
        return torch.as_tensor(self._sq_norm, dtype=torch.float64, device=self.update.device)

    def _replay(self, inputs: Any, targets: torch.Tensor) -> None:
        """The step's compute part again, from its start (what is in flight dropped before and
        after): :meth:`NonFiniteGuard.agree_finite` checks every backward of it to name the
        micro-batch that left a non-finite gradient."""
        self.sync.drain()
        if self.shards is not None:
            self.shards.drain()
        if self.ex is not None:
            self._compute_part(self._step, inputs, targets)
        self._at = "the step's collective (naming the non-finite micro-batch, all ranks)"
        self.sync.drain()
        if self.shards is not None:
            self.shards.drain()

    # -- handlers of F, B, AR and OPT (the sends and receives are the executor's) -----------
    def _forward(self, a: Action) -> None:
        """``F``; the last stage's rank keeps the loss so far for the guard."""
        assert self.ex is not None
        self.ex.forward(a)
        self.guard.watch(a, self.ex.loss_sum)

    def _backward(self, a: Action) -> None:
        """``B`` or ``W``: the parameters' gradients of a micro-batch."""
        assert self.ex is not None
        zero2 = (
            self.shards if self.shards is not None and self.shards.parallel.shards_grads else None
        )
        if zero2 is not None:  # every micro-batch's gradients are reduce-scattered into the shard
            zero2.arm(self._chunk_parameters(a))
        if a.kind is K.BACKWARD:
            self.ex.backward(a)
        else:
            self.ex.backward_weight(a)
        if zero2 is not None:
            zero2.after_backward()
        if self.guard.naming:  # a replay: the guard checks the gradients after each backward
            self.guard.watch(a, self.ex.loss_sum)

    def _backward_input(self, a: Action) -> None:
        """``I``: the input gradients only (the parameters' follow in the ``W``)."""
        assert self.ex is not None
        self.ex.backward_input(a)

    def _grad_ready(self, p: torch.Tensor) -> None:
        """A ``W`` completed ``p``'s gradient: what autograd's hooks say after a ``B``."""
        self.sync.on_grad(p)
        if self.shards is not None:
            self.shards.on_grad(p)

    def _last_backward(self, a: Action) -> None:
        """A chunk's last ``B``/``W``: from now on its parameters' buckets start as they
        become final (a rank holding several chunks arms each at its own last backward)."""
        params = self._chunk_parameters(a)
        self.sync.arm(params)
        if self.shards is not None and not self.shards.parallel.shards_grads:
            self.shards.arm(params)
        self._backward(a)

    def _chunk_parameters(self, a: Action) -> list[nn.Parameter] | None:
        """The parameters of the chunk that runs ``a`` (None: the rank holds one stage)."""
        if not isinstance(self.ex, RankChunks):
            return None
        return list(self.ex.chunks[a.stage].module.parameters())

    def _allreduce(self, a: Action) -> None:
        self.sync.finish()  # AR(P_s, g_s): wait for the overlapped buckets
        if self.shards is not None:  # ZeRO-1: the overlapped reduce-scatters (ZeRO-2: none)
            self.shards.finish()

    def _prepare_update(self, a: Action) -> None:
        """OPT before the step point: the final gradients and this rank's part of the norm."""
        self.sync.tied()
        if self.shards is not None:  # the tied pieces' gradients: slices of the sums
            self.shards.point_tied()
        self.precision.unscale_grads(self.update.params)  # fp16: gradients / S (loss was x S)
        if self.update.norm_due(self._step):
            self._sq_norm = self.update.local_sq_norm()
        elif self.late is None:  # the guard's gradient verdict without the norm
            self._sq_norm = self.update.local_nonfinite_part()

    def _apply_update(self, a: Action) -> None:
        """OPT after the step point (every rank's gradients finite)."""
        self.precision.clean_step()  # fp16: one more step without overflow
        self.update.step(self._step)  # clipping, lr_at(step), optimizer step
        if self.shards is not None:  # ZeRO: every replica's updated chunks to every replica
            self.shards.gather()

    # -- test hook -----------------------------------------------------------------------------
    def die_mid_step(self, step: int) -> None:
        """Test hook: from now on this rank exits (``os._exit(1)``) before its second action
        of step ``step``. Installed by wrapping that action's handler, so the loop itself
        checks nothing."""
        if len(self._compute) < 2:
            return
        op = self._compute[1]

        def die_then_run(a: Action) -> None:
            if self._step == step:
                os._exit(1)
            op.run(a)

        self._compute[1] = op._replace(run=die_then_run)

    # -- failures ------------------------------------------------------------------------------
    def _failure(self, step: int, e: BaseException) -> RankFailure:
        """The one-line account of a failure, then (inside an action) the marked grid."""
        waiting = self.ex.waiting_on if self.ex is not None else None
        peer = waiting[1] if waiting else -1
        at = self._at
        if waiting:
            what = f"waiting for {waiting[0]}"
        elif isinstance(at, _Op):
            phase = self._phases.get(at.action.kind)
            what = f"during action {at.action}" + (f" ({phase})" if phase else "")
        else:
            what = f"during {at}"
        lost = f"; lost peer {describe_rank(self.plan, peer)}" if peer >= 0 else ""
        msg = f"step {step}: {describe_rank(self.plan, self.rank)} failed {what}{lost} ({short_error(e)})"
        if isinstance(at, _Op):
            msg += "\n" + failure_grid(self.schedule, self.rank, at.position, peer)
        return RankFailure(msg)

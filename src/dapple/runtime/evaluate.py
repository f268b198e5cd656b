"""Forward-only evaluation through the training pipeline: the mean validation loss over a fixed
set of K global batches.

Every ``TrainConfig.eval_every`` steps (and after the last step) each rank runs its
forward-only program, :func:`dapple.schedule.forward.lower_forward` - the same stages, replicas
and split-concat transfers as training, ``RECV_F``/``F``/``SEND_F`` only - once per eval batch
k in [0, K), through its :class:`~dapple.runtime.stage.StageExecutor` under ``torch.no_grad()``
with the stage in ``eval()`` mode (every rank of a tensor group runs its group's program,
:func:`~dapple.runtime.parallel.stage_mesh.tensor_programs`, and only tensor rank 0 counts the loss).
Nothing is kept for a backward pass: a micro-batch's tensors are dropped after its last send
(on the last stage, after its loss). The last stage's slices
contribute ``loss_fn * slice_samples / G`` each, as in training, so the parts summed over ranks
and divided by K are the mean loss over the K batches; one world ``all_reduce`` that every rank
joins (ranks beyond the plan with 0) sums them. No gradient, AllReduce or optimizer step runs,
and the CPU (and the stage's CUDA) RNG state is restored afterwards, so evaluation leaves the
training run bit for bit unchanged.

Eval batch k is a *global* batch of G samples (``TrainConfig.eval_batch_size`` sets another
size G_e: the same stages, replicas and placement then evaluate with the micro-batching of
:func:`eval_plan`, through a second executor over the same layers): ``eval_data(k)`` when ``eval_data`` is a
callable, samples ``[k G, (k+1) G)`` of a map-style dataset of ``(inputs, targets)`` samples
(collated with ``torch.utils.data.default_collate``), or by default
``workload.make_batch(G, EVAL_SEED_BASE + k)``. Every rank builds it itself and slices its rows,
as in training.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from dapple.core.plan import Plan
from dapple.core.slicing import proportional_shares
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.runtime import comm
from dapple.runtime.chunks import Executor
from dapple.runtime.interpreter import _compile, _Op
from dapple.runtime.launch.failure import RankFailure, describe_rank, failure_grid, short_error
from dapple.runtime.parallel.stage_mesh import tensor_programs
from dapple.schedule.forward import lower_forward
from dapple.schedule.ir import Action, ActionKind

__all__ = ["EVAL_SEED_BASE", "EvalBatch", "Evaluation", "eval_batch_fn", "eval_plan"]

K = ActionKind

EVAL_SEED_BASE = 1_000_000_000
"""Default eval batch k is ``workload.make_batch(G, EVAL_SEED_BASE + k)``. Training step t uses
``seed + t``, so the eval set is disjoint from the training batches of any run with
``seed + steps < EVAL_SEED_BASE``, and it is the same set for every training seed."""

EvalBatch = Callable[[int], tuple[Any, torch.Tensor]]
"""``k -> (inputs, targets)``: eval global batch k (G rows)."""


def eval_plan(plan: Plan, eval_batch_size: int | None) -> Plan:
    """The plan evaluation runs: ``plan`` itself for G_e = G (or None), else the same stages,
    replicas and placement with G_e samples in the most micro-batches M_e <= M that divide G_e
    into micro-batches of at least max_s r_s samples (every replica gets a slice); a stage's
    uneven shares are scaled to the new micro-batch size (:func:`proportional_shares`).

    Raises:
        ValidationError: G_e is smaller than the largest stage's replica count.
    """
    G_e = eval_batch_size
    if G_e is None or G_e == plan.global_batch_size:
        return plan
    r_max = max(st.replicas for st in plan.stages)
    fits = [m for m in range(plan.num_micro_batches, 0, -1) if G_e % m == 0 and G_e // m >= r_max]
    if not fits:
        raise ValidationError(
            f"eval batch size {G_e} is smaller than the {r_max} replicas of the plan's widest "
            f"stage ({plan.replication}): every replica needs at least one sample"
        )
    M_e = fits[0]
    b_e = G_e // M_e
    stages = tuple(
        st
        if st.shares is None
        else dataclasses.replace(st, shares=proportional_shares(st.shares, b_e))
        for st in plan.stages
    )
    return dataclasses.replace(
        plan, global_batch_size=G_e, micro_batch_size=b_e, num_micro_batches=M_e, stages=stages
    )


def _default_batch(workload: Workload, G: int, k: int) -> tuple[Any, torch.Tensor]:
    return workload.make_batch(G, EVAL_SEED_BASE + k)


def _dataset_batch(data: Any, G: int, k: int) -> tuple[Any, torch.Tensor]:
    inputs, targets = default_collate([data[i] for i in range(k * G, (k + 1) * G)])
    return inputs, targets


def eval_batch_fn(workload: Workload, G: int, batches: int, eval_data: Any = None) -> EvalBatch:
    """The eval batch function of a run with global batch ``G`` and ``batches`` (K) batches.

    Args:
        workload: the model (its ``make_batch`` is the default source).
        G: the global batch size.
        batches: K, the number of eval batches.
        eval_data: None (default source), a callable ``k -> (inputs, targets)`` of global
            batches, or a map-style dataset (``__len__``, ``__getitem__``) of samples.

    Raises:
        ValidationError: the dataset holds fewer than K x G samples, or ``eval_data`` is
            neither callable nor a dataset.
    """
    if eval_data is None:
        return functools.partial(_default_batch, workload, G)
    if callable(eval_data):
        return eval_data  # type: ignore[no-any-return]
    if not (hasattr(eval_data, "__len__") and hasattr(eval_data, "__getitem__")):
        raise ValidationError(
            f"eval data must be a callable of global batches or a map-style dataset, "
            f"got {type(eval_data).__name__}"
        )
    if len(eval_data) < batches * G:
        raise ValidationError(
            f"eval data holds {len(eval_data)} samples; {batches} eval batches of the global "
            f"batch {G} need {batches * G}"
        )
    return functools.partial(_dataset_batch, eval_data, G)


class Evaluation:
    """One rank's forward-only evaluation (see the module docstring).

    Every rank creates one, ranks beyond the plan too (``executor=None``): they join the loss
    reduction.
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        *,
        executor: Executor | None,
        module: nn.Module | None,
        device: torch.device,
        batch: EvalBatch,
        batches: int,
        every: int,
        steps: int,
    ) -> None:
        """Args:
        plan: the plan; rank ``r`` runs device ``r``.
        rank: this rank.
        executor: this rank's stage executor (None: a rank beyond the plan).
        module: this rank's stage layers (None: a rank beyond the plan).
        device: this rank's device (of the reduction's tensor).
        batch: eval batch k (see :func:`eval_batch_fn`).
        batches: K, the eval batches per evaluation.
        every: evaluate after every N steps (0: never).
        steps: the run's steps (it also evaluates after the last one).
        """
        self.plan, self.rank, self.ex, self.module = plan, rank, executor, module
        self.device, self.batch, self.batches = device, batch, batches
        self.every, self.steps = every, steps
        self.schedule = tensor_programs(plan, lower_forward(plan))
        program = self.schedule.get(rank, [])
        if program and executor is None:
            raise ValidationError(f"rank {rank} has a forward program but no stage executor")
        self._sends: dict[tuple[int, int], int] = {}
        """(stage, micro-batch) -> its SEND_F actions in the program."""
        for a in program:
            if a.kind is K.SEND_F:
                assert a.micro_batch is not None
                key = (a.stage, a.micro_batch)
                self._sends[key] = self._sends.get(key, 0) + 1
        self._left: dict[tuple[int, int], int] = {}
        table: dict[ActionKind, Callable[[Action], None]] = (
            {K.RECV_F: executor.recv_forward, K.FORWARD: self._forward, K.SEND_F: self._send}
            if executor is not None
            else {}
        )
        self._ops = _compile(program, lambda i: table[program[i].kind])
        self._at: _Op | str = "start of evaluation"

    def due(self, step: int) -> bool:
        """Whether the run evaluates after step ``step``."""
        return self.every > 0 and ((step + 1) % self.every == 0 or step == self.steps - 1)

    def run(self, step: int) -> float:
        """The mean loss over the K eval batches, on every rank.

        Collective: every rank calls it after the same steps (one world ``all_reduce``).

        Raises:
            RankFailure: an action, a peer or the reduction failed; names the step, the rank,
                the action or what it waited for (and shows the forward program's grid).
        """
        total: torch.Tensor | float = 0.0
        training = self.module.training if self.module is not None else False
        metering = self.ex.metering if self.ex is not None else False
        rng_devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=rng_devices):
                if self.module is not None:
                    self.module.eval()
                if self.ex is not None and self._ops:
                    self.ex.metering = False
                    for k in range(self.batches):
                        total = total + self._one_batch(k)
                self._at = "the evaluation's loss reduction (all ranks)"
                t = torch.zeros(1, dtype=torch.float64, device=self.device)
                t += total  # the loss parts stay on the device until the one read below
                comm.all_reduce(t)
        except RankFailure:
            raise
        except Exception as e:
            raise self._failure(step, e) from e
        finally:
            if self.module is not None:
                self.module.train(training)
            if self.ex is not None:
                self.ex.metering = metering
        return float(t.item()) / self.batches

    def _one_batch(self, k: int) -> torch.Tensor | float:
        """Run the forward program on eval batch ``k``; this rank's loss part."""
        assert self.ex is not None
        self._at = f"building eval batch {k}"
        inputs, targets = self.batch(k)
        self.ex.begin_step(inputs, targets)
        self._left = dict(self._sends)
        for op in self._ops:
            self._at = op
            op.run(op.action)
        self._at = "the evaluation's sends"
        self.ex.finish_sends()
        counts = getattr(self.ex, "tensor_rank", 0) == 0  # a tensor group's loss once
        return self.ex.loss_sum if counts else 0.0

    def _forward(self, a: Action) -> None:
        assert self.ex is not None and a.micro_batch is not None
        self.ex.forward(a)
        if self._left.get((a.stage, a.micro_batch), 0) == 0:  # last stage: only its loss
            self.ex.release(a)

    def _send(self, a: Action) -> None:
        assert self.ex is not None and a.micro_batch is not None
        self.ex.send_forward(a)
        key = (a.stage, a.micro_batch)
        self._left[key] -= 1
        if self._left[key] == 0:
            self.ex.release(a)

    def _failure(self, step: int, e: BaseException) -> RankFailure:
        waiting = self.ex.waiting_on if self.ex is not None else None
        peer = waiting[1] if waiting else -1
        at = self._at
        what = (
            f"waiting for {waiting[0]}"
            if waiting
            else f"during action {at.action}"
            if isinstance(at, _Op)
            else f"during {at}"
        )
        lost = f"; lost peer {describe_rank(self.plan, peer)}" if peer >= 0 else ""
        msg = (
            f"evaluation after step {step}: {describe_rank(self.plan, self.rank)} failed "
            f"{what}{lost} ({short_error(e)})"
        )
        if isinstance(at, _Op):
            msg += "\n" + failure_grid(self.schedule, self.rank, at.position, peer)
        return RankFailure(msg)

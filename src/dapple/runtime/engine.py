"""Training a plan on an initialised ``torch.distributed`` process group (section 6).

:func:`run_plan` starts one rank (:func:`~dapple.runtime.startup.start_rank`: its stage's
layers, the replica and tied-parameter groups (:class:`~dapple.runtime.sync.GradientSync`),
checkpoints and the non-finite guard (:class:`~dapple.runtime.longrun.LongRun`)), then runs
every step of its lowered program through
:class:`~dapple.runtime.interpreter.ProgramInterpreter` (F, B, sends and receives, the step's
one world collective, ``AR`` and ``OPT``), hands rank 0's measurements to a
:class:`~dapple.runtime.metrics.MetricsSink` and saves checkpoints between steps. At the end of
a run every rank meets at a barrier and destroys the run's groups and hooks. Each slice's loss
is scaled by ``slice_samples / global_batch_size`` so the accumulated, AllReduced gradient
equals the single-device gradient of the global batch.

Data: every rank calls ``workload.make_batch(G, seed + step)`` itself (deterministic) and slices
its rows: stage-0 replicas their inputs, last-stage replicas their targets - labels never travel.
With ``data`` (a dataset) every rank reads only those rows of the sampled global batch instead
(:mod:`dapple.runtime.data`). Shapes that change from step to step: the run's dynamic input
dimensions (:func:`dapple.models.shapes.run_dims`, declared and found) switch the executors to
shape-headed messages, and each step's batch is checked against the first before it computes
(:func:`dapple.models.shapes.check_batch`).

Every ``eval_every`` steps (and after the last) the run evaluates forward only through the same
pipeline (:mod:`dapple.runtime.evaluate`); rank 0's reporters (:mod:`dapple.runtime.reporting`:
progress bar, TensorBoard) receive each step's metrics beside ``on_step``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from dapple.core.plan import Plan
from dapple.errors import ValidationError
from dapple.models.split_backward import require_split_backward
from dapple.models.workload import Workload
from dapple.runtime.data import check_data, fit_data, fit_workload
from dapple.runtime.evaluate import Evaluation, eval_batch_fn, eval_plan
from dapple.runtime.launch.failure import RankFailure, describe_rank, short_error
from dapple.runtime.metrics import MetricsSink, StepProbe, announce, global_norm, row_tokens
from dapple.runtime.parallel.expert import expert_report
from dapple.runtime.parallel.stage_mesh import (
    check_mesh_run,
    whole_layers,
    whole_observer,
    zero_floored,
)
from dapple.runtime.reporting import open_reporters
from dapple.runtime.slowdown import slowdown_factor
from dapple.runtime.startup import RankParts, start_rank
from dapple.runtime.step_metrics import StepMetrics
from dapple.runtime.sync import GradientSync
from dapple.runtime.train_config import TrainConfig
from dapple.schedule.lower import plan_compute_order
from dapple.schedule.registry import get_schedule

__all__ = [
    "StageRun",
    "UpdateObserver",
    "run_plan",
    "validate_run",
]

UpdateObserver = Callable[[int, nn.Module, list[tuple[torch.Tensor, torch.Tensor, int]]], None]
"""``run_plan``'s ``on_update``: ``(step, layers, [(updated, stage parameter, offset)])``."""


class StageRun:
    """What one rank holds after :func:`run_plan`: its stage layers, rank 0's metrics and its
    optimizer (under ZeRO over this replica's pieces of the stage's sharded parameters)."""

    def __init__(
        self,
        stage: int | None,
        replica: int | None,
        module: nn.Module | None,
        metrics: list[StepMetrics],
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.stage, self.replica, self.module, self.metrics = stage, replica, module, metrics
        self.optimizer = optimizer
        self.whole: dict[int, dict[str, torch.Tensor]] | None = None
        """A cut stage's final weights whole by layer (only with ``on_update``)."""


def validate_run(
    plan: Plan, workload: Workload, world_size: int, *, exact: bool = True, zero_stage: int = 0
) -> None:
    """Checks before any compute: world size, layer count, batch split, what the schedule
    needs (ZB-H1: torch's split backward; interleaved: M a multiple of the device groups, at
    least two groups), and the ``DAPPLE_SLOWDOWN`` variable every rank reads.

    Raises:
        ValidationError: the plan does not fit the workload or the process group; a bad
            ``DAPPLE_SLOWDOWN``.
    """
    slowdown_factor(0)  # the whole variable, read before any worker starts
    if get_schedule(plan.schedule).split_backward:
        require_split_backward(plan.schedule)
    plan_compute_order(plan)  # e.g. interleaved: M a multiple of the device groups
    if plan.virtual_stages > 1 and plan.num_groups == 1:
        raise ValidationError(
            f"interleaved plan with v={plan.virtual_stages} chunks on one device group "
            f"({plan.replication}): there is no pipeline to interleave (each chunk would send "
            "to itself); use --schedule dapple"
        )
    n_dev = len(plan.devices)
    if exact and world_size != n_dev:
        raise ValidationError(
            f"world size {world_size} != {n_dev} devices in the plan ({plan.replication}); "
            f"launch exactly {n_dev} processes"
        )
    plan.validate_for(workload.num_layers, world_size)
    if plan.micro_batch_size * plan.num_micro_batches != plan.global_batch_size:
        raise ValidationError(  # pragma: no cover - Plan already enforces it
            f"global batch {plan.global_batch_size} != {plan.micro_batch_size} x {plan.num_micro_batches}"
        )


def run_plan(
    plan: Plan,
    workload: Workload,
    config: TrainConfig,
    *,
    device: torch.device,
    exact_world: bool = True,
    on_step: Callable[[StepMetrics], None] | None = None,
    data: Dataset[Any] | None = None,
    eval_data: Any = None,
    on_update: UpdateObserver | None = None,
) -> StageRun:
    """Train ``config.steps`` steps of ``plan`` on the current process group.

    Args:
        plan: the plan; rank ``r`` runs device ``r``.
        workload: the model, data and loss.
        config: steps, seed, optimizer, reporting.
        device: this rank's torch device.
        exact_world: require world size == plan devices; when False, ranks beyond the plan
            idle through the collectives (used by tests that loop over plans in one group).
        on_step: called on rank 0 with each step's metrics.
        data: training samples ``(inputs, targets)`` (e.g. a
            :class:`~dapple.datasets.TokenFile`); None: ``workload.make_batch``.
        eval_data: the eval batches when ``config.eval_every > 0``: a map-style dataset of
            samples (each rank reads its rows of the fixed batches,
            :meth:`~dapple.runtime.rank.Batches.eval_batch`), a callable ``k -> (inputs,
            targets)`` of global batches, or None: ``workload.make_batch`` (see
            :mod:`dapple.runtime.evaluate`).
        on_update: called on every rank that updates parameters, at each ``OPT`` before the
            update, with the step, the rank's layers and what its optimizer updates as
            ``(parameter, stage parameter it is part of, offset in that one flattened)``
            (ZeRO: this replica's pieces; otherwise whole parameters at offset 0).

    Raises:
        ValidationError: the plan does not fit (before any compute).
        RankFailure: a peer died or timed out, or a layer failed; names step, rank and peer
            (and shows the schedule grid with the failing action marked).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    workload = fit_workload(workload, data)  # documents: their loss and dynamic length
    plan = zero_floored(plan, config.zero_stage)  # the run's floor, ZeRO-3 in the plan's stages
    validate_run(plan, workload, world, exact=exact_world, zero_stage=config.zero_stage)
    check_mesh_run(plan, workload, config)
    G = plan.global_batch_size
    ev_plan = eval_plan(plan, config.eval_batch_size)  # plan itself unless G_e != G
    G_e = ev_plan.global_batch_size
    eval_set = None if callable(eval_data) else eval_data  # a dataset of samples
    check_data(workload, data, G, config.seed, eval_data=eval_set, eval_batch_size=G_e)
    evaluates = config.eval_every > 0
    batch_fn = eval_batch_fn(workload, G_e, config.eval_batches, eval_data if evaluates else None)
    data, eval_set = (
        fit_data(workload, data, config.seed),
        fit_data(workload, eval_set, config.seed),
    )
    r = start_rank(plan, workload, config, device, rank, world, data, eval_set, ev_plan)
    if on_update is not None and r.layers.module is not None:
        r.update.observer = _observer(r, on_update, plan, rank)
    if eval_set is not None and evaluates:
        batch_fn = r.batches.eval_batch  # this rank's rows of the fixed batches, from the dataset
    evaluation = Evaluation(ev_plan, rank, executor=r.eval_executor, module=r.layers.module,
                            device=device, batch=batch_fn, batches=config.eval_batches,
                            every=config.eval_every, steps=config.steps)  # fmt: skip
    reporters = open_reporters(config, rank=rank, start=r.start)
    callbacks: list[Callable[[StepMetrics], None]] = [*reporters]
    if on_step is not None:
        callbacks.append(on_step)
    sink = MetricsSink(plan, config, rank=rank, memory_kind=r.probe.memory_kind,
                       resident_kind=r.probe.resident_kind, callbacks=callbacks)  # fmt: skip
    clean = False
    if rank == 0:
        announce(f"start-up: first step (step {r.start})", config.echo)
    records = _Records(sink, r)
    try:
        for step in range(r.start, config.steps):
            inputs, targets = r.batches.batch(step)
            r.probe.begin(inputs, targets)
            rows = r.interpreter.run_step(step, inputs, targets)
            eval_loss = _evaluate(evaluation, step, r.probe)
            report = r.update.take_report() if rank == 0 else {}  # lr, grad_norm
            records.add(step, rows, dict(step_ms=r.probe.step_ms, eval_loss=eval_loss, **report))
            r.longrun.after_step(step)
        records.finish()
        clean = True
    finally:
        _close_run(r, [*reporters, sink], clean)
    layers = r.layers
    whole = None  # a cut stage's final weights whole (for dapple verify): gathered in its groups
    if on_update is not None and r.mesh.cut and layers.module is not None:
        whole = whole_layers(r.mesh, layers.module, plan.layers_of_device(rank), grads=False)
    _teardown(r.sync, plan, rank)
    run = StageRun(
        layers.stage, layers.replica, layers.module, sink.metrics, r.interpreter.optimizer
    )
    run.whole = whole
    return run


class _Records:
    """Each step's metrics into the sink: at once, from the rows of its collective, or with
    ``on_nonfinite="off"`` when those rows arrive (with the next step's,
    :meth:`ProgramInterpreter.run_step`, and the last step's from
    :meth:`ProgramInterpreter.finish`); its gradient norm is then read off them."""

    def __init__(self, sink: MetricsSink, r: RankParts) -> None:
        self.sink, self.r = sink, r
        self.late = r.interpreter.late is not None
        self._held: tuple[int, dict[str, Any]] | None = None
        """The step whose rows have not arrived, and the fields known at its end."""

    def add(self, step: int, rows: list[list[float]] | None, fields: dict[str, Any]) -> None:
        """Step ``step`` ran: ``rows`` are its own (the guard's collective) or the held step's
        (None: no step was held)."""
        if not self.late:
            assert rows is not None
            self._record(step, rows, fields)
            return
        if self._held is not None and rows is not None:
            self._record(self._held[0], rows, self._held[1])
        self._held = (step, fields)

    def finish(self) -> None:
        """After the last step: the held step's rows read and recorded."""
        rows = self.r.interpreter.finish()
        if self._held is not None and rows is not None:
            self._record(self._held[0], rows, self._held[1])
        self._held = None

    def _record(self, step: int, rows: list[list[float]], fields: dict[str, Any]) -> None:
        if self.late and "grad_norm" in fields and self.r.update.norm_due(step):
            fields = {**fields, "grad_norm": global_norm(rows)}  # rank 0's: no update read it
        r = self.r
        self.sink.record(step, rows, target_tokens=row_tokens(rows), **fields,
                         **expert_report(r.mesh.loads, r.interpreter.expert_load))  # fmt: skip


def _close_run(r: RankParts, outputs: Sequence[Any], clean: bool) -> None:
    """After the steps (or a failure): the reporters and metrics sink closed, the data feed
    stopped, ZeRO's pending gathers settled, and without ``clean`` the gradient hooks dropped
    waiting for nothing (peers may be gone)."""
    for out in outputs:
        out.close()
    r.batches.feed.close()
    if r.interpreter.shards is not None:
        r.interpreter.shards.close(clean=clean)
    if not clean:
        r.sync.close(clean=False)


def _observer(
    r: RankParts, on_update: UpdateObserver, plan: Plan, rank: int
) -> Callable[[int], None]:
    """``on_update`` bound to this rank's layers and updated parameters (a cut stage's whole,
    :func:`~dapple.runtime.parallel.stage_mesh.whole_observer`)."""
    if r.mesh.cut and r.layers.module is not None:
        return whole_observer(r.mesh, r.layers.module, plan.layers_of_device(rank), on_update,
                              r.interpreter.shards)  # fmt: skip
    shards = r.interpreter.shards
    pieces: list[tuple[torch.Tensor, torch.Tensor, int]] = (
        [(pc.param, pc.origin, pc.offset) for pc in shards.pieces] if shards else []
    )
    sharded = {id(p) for p, _, _ in pieces}
    held = pieces + [(p, p, 0) for p in r.update.params if id(p) not in sharded]
    module = r.layers.module
    assert module is not None
    return lambda step: on_update(step, module, held)


def _evaluate(evaluation: Evaluation, step: int, probe: StepProbe) -> float | None:
    """The eval loss after ``step`` when one is due (its time is left out of the next step's)."""
    if not evaluation.due(step):
        return None
    t0 = time.perf_counter()
    loss = evaluation.run(step)
    probe.exclude(time.perf_counter() - t0)
    return loss


def _teardown(sync: GradientSync, plan: Plan, rank: int) -> None:
    """End of a run on every rank: a barrier (every rank is done with every collective of
    this run), then the run's hooks and process groups go, so that many runs in one process
    group leave no groups, threads or in-flight work behind.

    Raises:
        RankFailure: a peer died at the end of the run.
    """
    try:
        dist.barrier()
        sync.close(clean=True)
        # destroyed groups held in reference cycles (hooks <-> modules) would otherwise live,
        # worker threads and all, until a collection at interpreter exit: see
        # dapple.runtime.launch.local.shutdown_distributed
        gc.collect()
    except Exception as e:
        sync.close(clean=False)
        raise RankFailure(
            f"end of run: {describe_rank(plan, rank)} failed ({short_error(e)})"
        ) from e

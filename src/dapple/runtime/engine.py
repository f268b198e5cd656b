"""Training a plan on an initialised ``torch.distributed`` process group (section 6).

:func:`run_plan` sets up one rank - its stage's layers, the replica and tied-parameter groups
(:class:`~dapple.runtime.sync.GradientSync`), checkpoints and the non-finite guard
(:class:`~dapple.runtime.longrun.LongRun`) - then runs every step of its lowered program through
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
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from dapple.core.plan import Plan
from dapple.errors import ValidationError
from dapple.models.shapes import input_shapes
from dapple.models.split_backward import require_split_backward
from dapple.models.workload import Workload
from dapple.runtime.chunks import Executor
from dapple.runtime.config import StepMetrics, TrainConfig
from dapple.runtime.data import RankData, check_data, data_state, fit_data, fit_workload
from dapple.runtime.evaluate import Evaluation, eval_batch_fn, eval_plan
from dapple.runtime.interpreter import ProgramInterpreter
from dapple.runtime.launch.failure import RankFailure, describe_rank, short_error
from dapple.runtime.longrun import LongRun, first_attempt
from dapple.runtime.memory import ActivationMeter
from dapple.runtime.metrics import MetricsSink, StepProbe, announce, resident_bytes, row_tokens
from dapple.runtime.optim import ModelUpdate, make_optimizer
from dapple.runtime.parallel.expert import expert_report, gradient_sync
from dapple.runtime.parallel.sharded_state import CutStage
from dapple.runtime.parallel.stage_mesh import (
    StageMesh,
    check_mesh_run,
    make_groups,
    tensor_programs,
    whole_layers,
    whole_observer,
    zero_floored,
)
from dapple.runtime.parallel.zero import FlatShards, unsharded_stages
from dapple.runtime.precision import Precision
from dapple.runtime.rank import (
    Batches,
    ExecutorFactory,
    StageLayers,
    batch_dims,
    build_layers,
    build_optimizer,
    build_shards,
    cut_layers,
    first_batch,
    norm_parameters,
    probe_boundaries,
    select_zero,
)
from dapple.runtime.reporting import open_reporters
from dapple.runtime.sync import GradientSync
from dapple.schedule.lower import lower, plan_compute_order
from dapple.schedule.registry import get_schedule

__all__ = [
    "FAIL_RANK_ENV",
    "FAIL_STEP_ENV",
    "RankFailure",
    "StageRun",
    "make_optimizer",
    "run_plan",
    "validate_run",
]

FAIL_RANK_ENV = "DAPPLE_TEST_FAIL_RANK"
"""Test hook: the rank that dies (``os._exit(1)``) mid-step at step ``FAIL_STEP_ENV``."""
FAIL_STEP_ENV = "DAPPLE_TEST_FAIL_STEP"

logger = logging.getLogger(__name__)


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
    least two groups).

    Raises:
        ValidationError: the plan does not fit the workload or the process group.
    """
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
    r = _setup(plan, workload, config, device, rank, world, data, eval_set, ev_plan)
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
    try:
        for step in range(r.start, config.steps):
            inputs, targets = r.batches.batch(step)
            r.probe.begin(inputs, targets)
            rows = r.interpreter.run_step(step, inputs, targets)
            eval_loss = _evaluate(evaluation, step, r.probe)
            report = r.update.take_report() if rank == 0 else {}  # lr, grad_norm
            sink.record(step, rows, r.probe.step_ms, target_tokens=row_tokens(rows),
                        eval_loss=eval_loss, **report,
                        **expert_report(r.mesh.loads, r.interpreter.expert_load))  # fmt: skip
            r.longrun.after_step(step)
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


def _close_run(r: _Rank, outputs: Sequence[Any], clean: bool) -> None:
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


def _observer(r: _Rank, on_update: UpdateObserver, plan: Plan, rank: int) -> Callable[[int], None]:
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


@dataclass(frozen=True)
class _Rank:
    """One rank's part of a run, as :func:`_setup` builds it (:mod:`dapple.runtime.rank`)."""

    layers: StageLayers
    """Its stage, replica and layers."""
    batches: Batches
    """Each step's global batch and the evaluation batches."""
    sync: GradientSync
    """Its process groups and end-of-step gradient reductions."""
    update: ModelUpdate
    """What ``OPT`` updates (ZeRO: this replica's pieces) and the gradient norm counts."""
    interpreter: ProgramInterpreter
    """Runs a step of its lowered program (its optimizer and ZeRO shards with it)."""
    probe: StepProbe
    """Times a step and meters its memory."""
    eval_executor: Executor | None
    """The executor evaluation runs: the training one, or one over the same layers for an
    eval batch size of its own (:func:`dapple.runtime.evaluate.eval_plan`)."""
    longrun: LongRun
    """Checkpoints and the non-finite guard between steps."""
    start: int
    """The first step to run (after a resume: the checkpoint's step)."""
    mesh: StageMesh
    """How its stage is cut over a tensor group and sharded over replicas (t_s > 1, ZeRO-3)."""


def _setup(
    plan: Plan,
    workload: Workload,
    config: TrainConfig,
    device: torch.device,
    rank: int,
    world: int,
    data: Dataset[Any] | None = None,
    eval_data: Dataset[Any] | None = None,
    ev_plan: Plan | None = None,
) -> _Rank:
    """Build one rank's stage, groups, optimizer, executor and interpreter; resume if asked.

    Collective: every rank, in the same order (the boundary probe, the groups of
    :class:`GradientSync`, ZeRO's shards).
    """
    baseline = resident_bytes(device, peak=False)  # before this rank builds anything
    G, echo = plan.global_batch_size, config.echo
    inputs, targets = first_batch(workload, G, config.seed, data)
    if _announces_build(plan, rank):
        announce(f"start-up: building {stages_text(plan, rank)}", echo)
    layers = build_layers(plan, workload, config.seed, device, rank)
    dims = batch_dims(workload, G, config.seed, data)
    precision = Precision(config.precision, device)
    if rank == 0:
        announce("start-up: probing the stage boundaries", echo)
    specs = probe_boundaries(plan, rank, layers, inputs, device, precision)
    if rank == 0:
        _announce_weights(plan, workload, echo)
        announce("start-up: process groups and optimizer", echo)
    groups = make_groups(plan)  # replica groups per tensor index, tensor groups: collective
    layers, mesh = cut_layers(plan, workload, layers, groups, rank, device,
                              autocast=precision.dtype is not None)  # fmt: skip
    if mesh.cut:
        gc.collect()  # the uncut layers sit in reference cycles (traced graphs): free them now
    zero = select_zero(plan, workload, layers, _zero_stage(plan, config, rank, layers.stage), mesh)
    fsdp = frozenset(id(p) for unit in mesh.fsdp_units() for p in unit.parameters())
    sync = gradient_sync(mesh.experts, plan, workload, rank, layers.module, layers.stage,
                         exclude=zero.flat_ids | fsdp, stage_pg=groups.replica,
                         tensor_index=mesh.tensor_rank,
                         extra_pg=[*groups.tensor.values(), *groups.expert.all()])  # fmt: skip
    torch.manual_seed(config.seed * 7919 + rank)  # random ops other than the keyed sites
    params = list(layers.module.parameters()) if layers.module is not None else []
    shards = build_shards(plan, layers, zero, sync.pg, mesh.tensor_rank)
    updated, opt = build_optimizer(config, params, zero.sharded, shards)
    meter = ActivationMeter(exclude=params)
    executor = ExecutorFactory(layers, specs, workload.loss_fn, device, config.recompute, meter,
                               precision, dynamic=bool(dims), seed=config.seed,
                               mesh=mesh)  # fmt: skip
    ex = executor(plan, True)
    longrun = _long_run(plan, workload, config, rank, world, layers, opt, device, precision,
                        shards, data, mesh)  # fmt: skip
    start = longrun.resume()
    probe = StepProbe(device, meter, ex, baseline)
    counted = norm_parameters(plan, workload, layers, zero.sharded, shards, mesh)
    update = ModelUpdate(config, opt, updated, counted, device)
    interpreter = ProgramInterpreter(plan, tensor_programs(plan, lower(plan)), rank, executor=ex, sync=sync,
                                     guard=longrun.guard, optimizer=opt, params=params, probe=probe,
                                     update=update, precision=precision, shards=shards,
                                     loads=mesh.loads)  # fmt: skip
    _inject_failure(interpreter, rank)
    ev_plan = ev_plan or plan
    ev_ex = ex if ev_plan is plan else executor(ev_plan, False)
    feed = RankData(plan, rank, config.seed, data, eval_data, stop=config.steps,
                    prefetch=device.type != "cpu", eval_plan=ev_plan)  # fmt: skip
    batches = Batches(workload, config.seed, G, (inputs, targets), feed, input_shapes(inputs), dims)
    return _Rank(layers, batches, sync, update, interpreter, probe, ev_ex, longrun, start, mesh)


def _long_run(
    plan: Plan,
    workload: Workload,
    config: TrainConfig,
    rank: int,
    world: int,
    layers: StageLayers,
    optimizer: torch.optim.Optimizer | None,
    device: torch.device,
    precision: Precision,
    shards: FlatShards | None,
    data: Dataset[Any] | None,
    mesh: StageMesh,
) -> LongRun:
    """The rank's checkpoints and non-finite guard (:class:`LongRun`), recording the training
    data's sampler state in its checkpoints; a cut stage's checkpoints go through
    :class:`~dapple.runtime.parallel.sharded_state.CutStage` (whole layers, written by its first device)."""
    cut = None
    if mesh.cut and layers.module is not None:
        cut = CutStage(mesh, layers.module, plan.layers_of_device(rank),
                       writes=layers.replica == 0 and mesh.tensor_rank == 0,
                       shards=shards)  # fmt: skip
    longrun = LongRun(plan, workload, config, rank=rank, world=world, stage=layers.stage,
                      replica=layers.replica, module=layers.module, optimizer=optimizer,
                      device=device, precision=precision, shards=shards, cut=cut)  # fmt: skip
    longrun.data_state = data_state(data, config.seed, plan.global_batch_size)
    return longrun


def _inject_failure(interpreter: ProgramInterpreter, rank: int) -> None:
    """Test hook: rank ``$DAPPLE_TEST_FAIL_RANK`` dies mid-step at step
    ``$DAPPLE_TEST_FAIL_STEP``, on a run's first attempt only."""
    if first_attempt() and int(os.environ.get(FAIL_RANK_ENV, "-1")) == rank:
        interpreter.die_mid_step(int(os.environ.get(FAIL_STEP_ENV, "-1")))


def _layers_text(layers: tuple[int, int]) -> str:
    """``layers 3-5`` for the chain's layers ``[3, 6)`` (``layer 3`` for ``[3, 4)``)."""
    first, end = layers
    return f"layer {first}" if end - first == 1 else f"layers {first}-{end - 1}"


def _announces_build(plan: Plan, rank: int) -> bool:
    """Whether ``rank`` says its stage is being built: one line per stage, from its first device
    (replica 0's tensor rank 0)."""
    return rank in plan.devices and plan.stages[plan.stage_of_device(rank)[0]].devices[0] == rank


def stages_text(plan: Plan, rank: int) -> str:
    """The stages ``rank`` holds, in words: ``stage 1 (layers 3-5)``, or with several chunks
    ``stages 0, 2 (layers 0-1, 4-5)``."""
    mine = plan.stages_of_device(rank)
    layers = ", ".join(_layers_text(plan.stages[k].layers) for k in mine)
    head = f"stage {mine[0]}" if len(mine) == 1 else f"stages {', '.join(map(str, mine))}"
    return f"{head} ({layers})"


def _announce_weights(plan: Plan, workload: Workload, echo: bool) -> None:
    """Rank 0, once every stage is built (the boundary probe's gather waits for every rank's
    build): where the pretrained weights came from and how many of their tensors each stage
    read (:func:`dapple.models.split.loaded_tensors`; nothing without ``--weights``)."""
    split = sys.modules.get("dapple.models.split")  # not imported: no traced model, no weights
    if split is None:
        return
    per_stage = [split.loaded_tensors(workload, *st.layers) for st in plan.stages]
    if any(p is None for p in per_stage):
        return
    source = per_stage[0][0]
    counts = ", ".join(f"stage {k} {n}" for k, (_, n) in enumerate(per_stage))
    announce(f"weights loaded: {source}: tensors per stage: {counts}", echo)


def _zero_stage(plan: Plan, config: TrainConfig, rank: int, s: int | None) -> int:
    """The zero stage of this rank's stage: the run's ``zero_stage`` or the stage's own
    ``StagePlan.zero_stage``, the larger; 0 on a stage with one replica (and off the plan).
    Rank 0 says once which stages the run's ``zero_stage`` leaves alone (nothing to shard)."""
    single = unsharded_stages(plan)
    if rank == 0 and single and config.zero_stage:
        logger.warning(
            "zero stage %d is a no-op on stage(s) %s: one replica each (plan %s)",
            config.zero_stage, ", ".join(map(str, single)), plan.replication,
        )  # fmt: skip
    if s is None or plan.stages[s].replicas == 1:
        return 0
    mine = plan.stages_of_device(rank)  # the chunks of an interleaved plan: one device group
    return max(config.zero_stage, *(plan.stages[k].zero_stage for k in mine))


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

"""The start-up of one rank of a run: everything :func:`~dapple.runtime.engine.run_plan` does
before the first step.

:func:`start_rank` builds the rank's stage layers (cut over its tensor group where the plan
asks), the boundary specs, the process groups and gradient reductions
(:class:`~dapple.runtime.sync.GradientSync`), ZeRO's shards and the optimizer, the executor and
the :class:`~dapple.runtime.interpreter.ProgramInterpreter` of its lowered program, the
checkpoints and non-finite guard (:class:`~dapple.runtime.longrun.LongRun`, resuming when
asked) and the data feed, in one fixed order on every rank (some steps are collectives), from
the building blocks of :mod:`dapple.runtime.rank`. Rank 0 says what it is doing
(``start-up: ...`` lines); each stage's first device says its stage is being built.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from dapple.core.plan import Plan
from dapple.models.shapes import input_shapes
from dapple.models.workload import Workload
from dapple.runtime.chunks import Executor
from dapple.runtime.data import RankData, data_state
from dapple.runtime.interpreter import ProgramInterpreter
from dapple.runtime.longrun import LongRun, first_attempt
from dapple.runtime.memory import ActivationMeter
from dapple.runtime.metrics import StepProbe, announce, resident_bytes
from dapple.runtime.optim import ModelUpdate
from dapple.runtime.parallel.expert import gradient_sync
from dapple.runtime.parallel.sharded_state import CutStage
from dapple.runtime.parallel.stage_mesh import StageMesh, make_groups, tensor_programs
from dapple.runtime.parallel.zero import FlatShards
from dapple.runtime.parallel.zero.select import build_shards, select_zero, zero_stage_of
from dapple.runtime.precision import Precision
from dapple.runtime.rank import (
    Batches,
    ExecutorFactory,
    StageLayers,
    batch_dims,
    build_layers,
    build_optimizer,
    cut_layers,
    first_batch,
    norm_parameters,
    probe_boundaries,
)
from dapple.runtime.sync import GradientSync
from dapple.runtime.train_config import TrainConfig
from dapple.schedule.lower import lower

__all__ = [
    "FAIL_RANK_ENV",
    "FAIL_STEP_ENV",
    "RankParts",
    "announces_build",
    "stages_text",
    "start_rank",
]

FAIL_RANK_ENV = "DAPPLE_TEST_FAIL_RANK"
"""Test hook: the rank that dies (``os._exit(1)``) mid-step at step ``FAIL_STEP_ENV``."""
FAIL_STEP_ENV = "DAPPLE_TEST_FAIL_STEP"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankParts:
    """One rank's part of a run, as :func:`start_rank` builds it (:mod:`dapple.runtime.rank`)."""

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


def start_rank(
    plan: Plan,
    workload: Workload,
    config: TrainConfig,
    device: torch.device,
    rank: int,
    world: int,
    data: Dataset[Any] | None = None,
    eval_data: Dataset[Any] | None = None,
    ev_plan: Plan | None = None,
) -> RankParts:
    """Build one rank's stage, groups, optimizer, executor and interpreter; resume if asked.

    Collective: every rank, in the same order (the boundary probe, the groups of
    :class:`GradientSync`, ZeRO's shards).
    """
    baseline = resident_bytes(device, peak=False)  # before this rank builds anything
    G, echo = plan.global_batch_size, config.echo
    inputs, targets = first_batch(workload, G, config.seed, data)
    if announces_build(plan, rank):
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
    zero = select_zero(
        plan, workload, layers, zero_stage_of(plan, config, rank, layers.stage), mesh
    )
    fsdp = frozenset(id(p) for unit in mesh.fsdp_units() for p in unit.parameters())
    sync = gradient_sync(mesh.experts, plan, workload, rank, layers.module, layers.stage,
                         exclude=zero.flat_ids | fsdp, stage_pg=groups.replica,
                         tensor_index=mesh.tensor_rank,
                         extra_pg=[*groups.tensor.values(), *groups.expert.all()])  # fmt: skip
    torch.manual_seed(config.seed * 7919 + rank)  # random ops other than the keyed sites
    params = list(layers.module.parameters()) if layers.module is not None else []
    shards = build_shards(plan, layers, zero, sync.pg, mesh.tensor_rank)
    updated, opt = build_optimizer(config, params, zero.sharded, shards)
    units = mesh.fsdp_units()
    meter = ActivationMeter(exclude=params, gathered=(
        (lambda: [p for u in units for p in u.parameters()]) if units else None))  # fmt: skip
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
    programs = tensor_programs(plan, lower(plan, on_nonfinite=config.on_nonfinite))
    interpreter = ProgramInterpreter(plan, programs, rank, executor=ex, sync=sync,
                                     guard=longrun.guard, optimizer=opt, params=params, probe=probe,
                                     update=update, precision=precision, shards=shards,
                                     loads=mesh.loads)  # fmt: skip
    _inject_failure(interpreter, rank)
    ev_plan = ev_plan or plan
    ev_ex = ex if ev_plan is plan else executor(ev_plan, False)
    feed = RankData(plan, rank, config.seed, data, eval_data, stop=config.steps,
                    prefetch=device.type != "cpu", eval_plan=ev_plan)  # fmt: skip
    batches = Batches(workload, config.seed, G, (inputs, targets), feed, input_shapes(inputs), dims)
    return RankParts(layers, batches, sync, update, interpreter, probe, ev_ex, longrun, start, mesh)


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


def announces_build(plan: Plan, rank: int) -> bool:
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

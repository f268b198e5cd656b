"""Interpreter of a lowered plan on an initialised ``torch.distributed`` process group (section 6).

Every rank runs ``dapple.schedule.lower(plan)[rank]`` - the same per-device program the
simulator runs - action by action: ``RECV_F``/``RECV_B`` post ``irecv``s (up to
:data:`RECV_AHEAD` actions early, so transfers overlap compute), ``F``/``B`` wait for
them and compute, ``SEND_F``/``SEND_B`` post ``isend``s (waited on at the latest before the
AllReduce), ``AR`` waits for the sums of the stage's gradients over its replica group
(``dist.new_group``, created by every rank in stage order), which started in buckets during the
rank's last backward, then sums tied parameters (see :mod:`dapple.runtime.sync`). At the end of
a run every rank meets at a barrier and destroys the run's groups and hooks. Each slice's loss
is scaled by ``slice_samples / global_batch_size`` so the accumulated, AllReduced gradient
equals the single-device gradient of the global batch.

One small collective per step: before the first ``AR``/``OPT`` action every rank - ranks beyond
the plan too - joins one world ``all_gather`` (:meth:`LongRun.agree_finite`) of its non-finite
verdict, loss part and peak memory. So every rank stops or skips on a NaN before ``OPT`` steps
the optimizer in lock-step, and rank 0 logs one :class:`StepMetrics` line per step. Its step
time is rank 0's wall time from the previous step's collective to this one's (the first step of
a run: from its start): the period between consecutive synchronisation points, i.e. the
throughput a user sees - it includes the previous step's AllReduce wait, optimizer step,
checkpoint save and ``make_batch``. The CUDA peak covers the same period.

Data: every rank calls ``workload.make_batch(G, seed + step)`` itself (deterministic) and slices
its rows: stage-0 replicas their inputs, last-stage replicas their targets - labels never travel.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from dapple.core.plan import Plan
from dapple.errors import DappleError, ValidationError
from dapple.models.workload import Workload
from dapple.runtime.config import StepMetrics, TrainConfig
from dapple.runtime.longrun import LongRun, first_attempt
from dapple.runtime.memory import ActivationMeter
from dapple.runtime.stage import StageExecutor
from dapple.runtime.sync import GradientSync
from dapple.runtime.transport import flatten, infer_boundary_specs
from dapple.schedule.ir import ActionKind
from dapple.schedule.lower import lower

__all__ = [
    "FAIL_RANK_ENV",
    "FAIL_STEP_ENV",
    "RankFailure",
    "StageRun",
    "make_optimizer",
    "run_plan",
    "validate_run",
]

logger = logging.getLogger(__name__)
K = ActionKind

RECV_AHEAD = 4
"""Program positions ahead of the current action whose RECV_F/RECV_B are posted early."""
_RECVS = (ActionKind.RECV_F, ActionKind.RECV_B)
_SYNCS = (ActionKind.ALLREDUCE, ActionKind.STEP)

FAIL_RANK_ENV = "DAPPLE_TEST_FAIL_RANK"
"""Test hook: the rank that dies (``os._exit(1)``) mid-step at step ``FAIL_STEP_ENV``."""
FAIL_STEP_ENV = "DAPPLE_TEST_FAIL_STEP"


class RankFailure(DappleError):
    """A rank could not finish a step (lost peer, timeout, error in a layer)."""


class StageRun:
    """What one rank holds after :func:`run_plan`: its stage layers and rank 0's metrics."""

    def __init__(
        self,
        stage: int | None,
        replica: int | None,
        module: nn.Module | None,
        metrics: list[StepMetrics],
    ) -> None:
        self.stage, self.replica, self.module, self.metrics = stage, replica, module, metrics


def validate_run(plan: Plan, workload: Workload, world_size: int, *, exact: bool = True) -> None:
    """Checks before any compute: world size, layer count, batch split.

    Raises:
        ValidationError: the plan does not fit the workload or the process group.
    """
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


def _describe(plan: Plan, rank: int) -> str:
    if rank < 0:
        return ""
    try:
        s, j = plan.stage_of_device(rank)
    except ValidationError:
        return f"rank {rank}"
    return f"rank {rank} (stage {s} replica {j})"


def _short(e: BaseException) -> str:
    """First line of an exception without gloo/NCCL source-location noise."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    text = text.split(". This is typically")[0]
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def make_optimizer(name: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The optimizer every rank (and the single-process reference) uses: SGD or Adam."""
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr)


def run_plan(
    plan: Plan,
    workload: Workload,
    config: TrainConfig,
    *,
    device: torch.device,
    exact_world: bool = True,
    on_step: Callable[[StepMetrics], None] | None = None,
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

    Raises:
        ValidationError: the plan does not fit (before any compute).
        RankFailure: a peer died or timed out, or a layer failed; names step, rank and peer.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    validate_run(plan, workload, world, exact=exact_world)
    G = plan.global_batch_size
    in_plan = rank in plan.devices
    s: int | None = None
    j: int | None = None
    if in_plan:
        s, j = plan.stage_of_device(rank)
    inputs, targets = workload.make_batch(G, config.seed)
    rows = {int(t.shape[0]) for t in (*flatten(inputs), targets)}
    if rows != {G}:
        raise ValidationError(
            f"workload {workload.name!r}: make_batch({G}) returned {sorted(rows)} rows, expected {G}"
        )
    module: nn.Module | None = None
    if in_plan:
        assert s is not None
        lo, hi = plan.stages[s].layers
        module = workload.build_stage(lo, hi, config.seed).to(device)
        module.train()
    probe = tuple(t[:1] for t in flatten(inputs))
    specs = infer_boundary_specs(
        plan, rank, module, probe if isinstance(inputs, (tuple, list)) else probe[0], device
    )
    sync = GradientSync(plan, workload, rank, module, s)  # collective: creates the groups
    torch.manual_seed(config.seed * 7919 + rank)  # per-rank RNG for dropout-like layers
    program = lower(plan)[rank] if in_plan else []
    backwards = [i for i, a in enumerate(program) if a.kind is K.BACKWARD]
    last_backward = backwards[-1] if backwards else -1
    params = list(module.parameters()) if module is not None else []
    opt = make_optimizer(config.optimizer, params, config.lr) if params else None
    meter = ActivationMeter(exclude=params)
    ex: StageExecutor | None = None
    if in_plan:
        assert s is not None and j is not None and module is not None
        recompute = config.recompute or plan.stages[s].recompute
        ex = StageExecutor(plan, s, j, module, specs, workload.loss_fn, device, recompute, meter)
    # checkpoints, resume under any plan, non-finite guard (issue #10)
    longrun = LongRun(plan, workload, config, rank=rank, world=world, stage=s, replica=j,
                      module=module, optimizer=opt, device=device)  # fmt: skip
    start = longrun.resume()
    fail_rank = int(os.environ.get(FAIL_RANK_ENV, "-1"))
    fail_step = int(os.environ.get(FAIL_STEP_ENV, "-1")) if first_attempt() else -1
    cuda = device.type == "cuda"
    metrics: list[StepMetrics] = []
    # CPU held-activation peak: the lowered program is the same every step, so the peak only
    # changes with the batch shapes; meter the first step and any step whose shapes differ
    # from the last metered one, and reuse that peak otherwise (the hooks cost ~5% of a step).
    metered_shapes: object = None
    known_peak = 0
    # The program up to its first AR/OPT action, then the step's collective, then the rest.
    n_body = next((i for i, a in enumerate(program) if a.kind in _SYNCS), len(program))
    body, tail = program[:n_body], program[n_body:]
    if any(a.kind not in _SYNCS for a in tail):  # lower() puts AR and OPT last
        raise ValueError(f"rank {rank}: program has actions after its first AR/OPT: {tail}")
    ar_ranks = list(plan.stages[s].devices) if s is not None else []
    ar_where = f"gradient AllReduce over ranks {ar_ranks}"
    sink = open(config.metrics_path, "w") if (rank == 0 and config.metrics_path) else None  # noqa: SIM115
    clean = False
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    t_meet = time.perf_counter()  # the previous step's collective (first step: its start)
    try:
        for step in range(start, config.steps):
            if step > 0:
                inputs, targets = workload.make_batch(G, config.seed + step)
            shapes = None if cuda else [(t.shape, t.dtype) for t in (*flatten(inputs), targets)]
            metering = not cuda and shapes != metered_shapes
            if ex is not None:
                ex.metering = metering
            meter.reset_peak()
            where: object = "start of step"  # formatted only on failure (hot loop)
            try:
                if ex is not None:
                    for p in params:
                        p.grad = None
                    ex.begin_step(inputs, targets)
                    longrun.begin_step()
                    early: set[int] = set()  # program positions of receives already posted
                    for n_done, a in enumerate(body):
                        if n_done == 1 and rank == fail_rank and step == fail_step:
                            os._exit(1)  # test hook: die mid-step
                        where = a  # "action <a>" is built only if the step fails
                        if n_done in early:
                            continue
                        if n_done == last_backward:
                            sync.arm()  # reduce gradient buckets as they become final
                        ex.run(a)
                        longrun.watch(a, ex.loss_sum)
                        # Pre-post the receives of the next few actions: gloo moves a
                        # message only once its irecv is posted, so a just-in-time irecv
                        # exposes the whole transfer; posted early it overlaps compute.
                        for k in range(n_done + 1, min(n_body, n_done + 1 + RECV_AHEAD)):
                            if body[k].kind in _RECVS and k not in early:
                                ex.run(body[k])
                                early.add(k)
                    ex.finish_sends()
                if metering:
                    known_peak, metered_shapes = meter.peak_bytes, shapes
                peak = torch.cuda.max_memory_allocated(device) if cuda else known_peak
                # The step's one collective (every rank, plan or not): verdicts and metrics.
                where = "the step's collective (non-finite check and metrics, all ranks)"
                loss_part = ex.loss_sum if ex is not None else 0.0
                verdict, gathered = longrun.agree_finite(step, (loss_part, float(peak)))
                now = time.perf_counter()
                step_ms, t_meet = (now - t_meet) * 1e3, now
                if cuda:  # the next peak: from here to the next step's collective
                    torch.cuda.reset_peak_memory_stats(device)
                if verdict is not None:  # stop or skip: drop the bucket AllReduces
                    where = "dropping the gradient AllReduce"
                    sync.drain()
                    if verdict:
                        raise RankFailure(verdict)
                elif ex is not None:  # (a skipped step has no update, on every rank)
                    where = ar_where
                    sync.finish()  # AR(P_s, g_s): wait for the overlapped buckets
                    where = "tied-parameter gradient AllReduce"
                    sync.tied()
                    for a in tail:  # AR was done above, with the overlapped buckets
                        where = a
                        if a.kind is K.STEP and opt is not None:
                            opt.step()
            except RankFailure:
                raise
            except Exception as e:
                waiting = ex.waiting_on if ex is not None else None
                peer = waiting[1] if waiting else -1
                what = (
                    f"waiting for {waiting[0]}"
                    if waiting
                    else f"during {'action ' if not isinstance(where, str) else ''}{where}"
                )
                lost = f"; lost peer {_describe(plan, peer)}" if peer >= 0 else ""
                raise RankFailure(
                    f"step {step}: {_describe(plan, rank)} failed {what}{lost} ({_short(e)})"
                ) from e
            if rank == 0:
                peaks = [0] * plan.num_stages
                for r in gathered:
                    if r[1] >= 0:  # rows: [kind, stage, micro-batch, rank, loss part, peak]
                        peaks[int(r[1])] = max(peaks[int(r[1])], int(r[5]))
                sm = StepMetrics(
                    step=step,
                    loss=sum(r[4] for r in gathered),
                    step_ms=step_ms,
                    samples_per_s=G / (step_ms / 1e3) if step_ms > 0 else float("inf"),
                    peak_memory_bytes=tuple(peaks),
                    memory_kind="cuda_max_allocated" if cuda else "held_activations",
                    predicted_step_ms=None
                    if config.predicted_step_ms != config.predicted_step_ms
                    else config.predicted_step_ms,
                )
                metrics.append(sm)
                logger.info(sm.line())
                if config.echo:
                    print(sm.line(), flush=True)
                if sink is not None:
                    sink.write(json.dumps(sm.to_dict()) + "\n")
                    sink.flush()
                if on_step is not None:
                    on_step(sm)
            longrun.after_step(step)
        clean = True
    finally:
        if sink is not None:
            sink.close()
        if not clean:  # peers may be gone: drop the hooks, wait for nothing
            sync.close(clean=False)
    _teardown(sync, plan, rank)
    return StageRun(s, j, module, metrics)


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
        # dapple.runtime.launch.shutdown_distributed
        gc.collect()
    except Exception as e:
        sync.close(clean=False)
        raise RankFailure(f"end of run: {_describe(plan, rank)} failed ({_short(e)})") from e

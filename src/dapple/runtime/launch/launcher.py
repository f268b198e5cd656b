"""Process launch: under ``torchrun`` (env RANK/WORLD_SIZE/MASTER_ADDR) or standalone, where the
local worker processes are started here (:func:`spawn`).

Backend: NCCL when the run uses CUDA with a GPU per rank; gloo on CPU, and gloo with device
tensors staged through host memory when ranks share a GPU (:mod:`dapple.runtime.comm`). ``init_process_group(timeout=...)`` bounds
every wait on a peer; a failing worker prints ``dapple: error: step S: rank R (stage s
replica j) failed during ...; lost peer rank P ...`` and exits 1 instead of hanging. A rank that
failed on its own adds the schedule grid with its action marked; a rank that only lost a peer
prints that one line (:func:`dapple.runtime.launch.failure.rank_report`).

The standalone launcher (:mod:`dapple.runtime.launch.local`): its workers end when it ends, however
it ends (SIGKILL included); SIGTERM or SIGINT to it stops every worker first; each worker runs in a
session of its own (:mod:`dapple.host.own_session`: Ctrl-C reaches only the launcher, which stops
them) and ignores SIGINT; the rendezvous and gloo listen on ``127.0.0.1`` only. It waits for all
workers (at most ``timeout_s`` plus a grace period after the first failure, then kills stragglers)
and reports every rank's exit code or signal. Rank 0 (and the first replica of each stage) prints
each start-up phase as it starts (:func:`dapple.runtime.metrics.announce`).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapple.core.plan import Plan
from dapple.errors import DappleError, ValidationError
from dapple.host.cpu_cores import threads_per_worker
from dapple.host.host_memory import keep_freed_memory
from dapple.host.own_session import Deferred, run_in_own_session
from dapple.models.workload import Workload
from dapple.runtime.comm import set_host_staged, transport_for
from dapple.runtime.engine import run_plan, validate_run
from dapple.runtime.launch.early import EarlyWorkers, preloaded
from dapple.runtime.launch.failure import RankFailure, lost_peer, rank_report
from dapple.runtime.launch.local import (
    StopSignals,
    exit_text,
    heartbeats,
    listener,
    local_store,
    not_while_importing_main,
    pin_cores,
    processes_text,
    run_worker,
    shutdown_distributed,
    silent_ranks,
    stop_workers,
)
from dapple.runtime.launch.refusal import (
    end_if_refused,
    error_file,
    hand_over,
    is_refusal,
    refusal_folder,
    refused,
)
from dapple.runtime.launch.run_checks import check_batches, check_datasets
from dapple.runtime.launch.stop_line import stop_line
from dapple.runtime.longrun import elastic_store
from dapple.runtime.metrics import announce, metrics_from_dict
from dapple.runtime.parallel.stage_mesh import check_mesh_run
from dapple.runtime.precision import check_precision
from dapple.runtime.step_metrics import StepMetrics
from dapple.runtime.train_config import TrainConfig

if TYPE_CHECKING:
    from dapple.runtime.launch.elastic import ElasticPolicy

__all__ = [
    "free_port",
    "init_distributed",
    "resolve_workload",
    "shutdown_distributed",
    "spawn",
    "train",
]

logger = logging.getLogger(__name__)

GRACE_S = 10.0
"""Extra seconds the standalone launcher waits, after the first failure, beyond the timeout."""


def resolve_workload(spec: str | Workload) -> Workload:
    """A :class:`Workload` as given, or loaded from a spec by :func:`dapple.models.spec.load` (zoo name,
    ``module:factory`` or ``file.py:factory``; the result pickles as its spec for spawned workers).

    Raises:
        ValidationError: the module, factory or zoo name does not exist.
    """
    if isinstance(spec, Workload):
        return spec
    from dapple.models.spec import load

    return load(spec)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pick_device(kind: str, local_rank: int) -> torch.device:
    if kind == "cuda" or (kind == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValidationError("device 'cuda' requested but CUDA is not available")
        dev = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def init_distributed(config: TrainConfig, local_world: int) -> torch.device:
    """Join the process group; returns the device.

    In a worker started by :func:`spawn` the ranks meet at rank 0's TCPStore on loopback
    (:func:`dapple.runtime.launch.local.local_store`); anywhere else as the env says (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT, e.g. from ``torchrun``, on any host). A CPU rank also sets its
    intra-op threads (the cores over the local processes) and keeps freed memory for the next
    step (:func:`dapple.host.host_memory.keep_freed_memory`)."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    device = _pick_device(config.device, local_rank)
    pinned = pin_cores(local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", local_world)))
    if device.type == "cpu":
        # the cores granted to this process (its affinity), not the host's: threads beyond
        # them oversubscribe and every parallel region waits for a descheduled thread
        torch.set_num_threads(len(pinned) if pinned else threads_per_worker(local_world))
        keep_freed_memory()  # no page faults for each step's fresh activations
    if not dist.is_initialized():
        timeout = timedelta(seconds=config.timeout_s)
        store = local_store(timeout)
        if store is None:
            store = elastic_store(timeout)
        devices = torch.cuda.device_count() if device.type == "cuda" else 0
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", local_world))
        backend, staged = transport_for(device.type, ranks, devices)
        set_host_staged(staged)
        dist.init_process_group(
            backend=backend,
            timeout=timeout,
            **store,  # spawned: loopback store; torchrun restarts: a fresh key prefix
        )
    return device


def _die(msg: str, kind: str = "error: ") -> None:
    """Print ``dapple: error: msg`` (``kind`` after ``dapple: ``) in a single write (ranks share
    stderr) and exit 1; under ``torchrun`` the line is also the rank's error in torch's error
    file (:func:`~dapple.runtime.launch.refusal.error_file`)."""
    line = f"dapple: {kind}{msg}"
    error_file(line)
    sys.stdout.flush()
    os.write(2, f"{line}\n".encode())
    os._exit(1)


def spawn(
    fn: Callable[..., None],
    nprocs: int,
    *args: Any,
    timeout_s: float = 300.0,
    early: EarlyWorkers | None = None,
    closing: Callable[[str], str] | None = None,
) -> None:
    """Run ``fn(rank, world, *args)`` in ``nprocs`` fresh local processes with the env set.

    The workers end with this process however it ends, meet on loopback only, and are stopped
    by SIGTERM or SIGINT to it (see the module docstring). Each starts a session of its own
    before it imports anything heavy, as ``torchrun``'s workers do
    (:mod:`dapple.host.own_session`: on a busy machine they get torchrun's share of the CPU).
    With ``early`` (``nprocs`` of them, started before the run was known,
    :class:`~dapple.runtime.launch.early.EarlyWorkers`) they get the run instead of new processes.
    ``closing`` makes the line written to stderr when a signal stopped them (its name given).
    A worker's refusal (:mod:`dapple.runtime.launch.refusal`) ends them all at once.

    Raises:
        DappleError: a worker's refusal, as the worker raised it (every worker killed).
        RankFailure: a worker exited non-zero or was killed (or hung ``timeout_s + GRACE_S``
            after a failure); the message lists every failing rank's exit code or signal.
    """
    not_while_importing_main()
    sock: socket.socket | None = None
    beats = heartbeats(nprocs) if early is None else early.beats
    folder = refusal_folder() if early is None else early.refusals
    if early is None:
        ctx = mp.get_context("spawn")  # the launcher itself is each worker's parent
        sock = listener()  # the store's address, bound before any worker looks for it
        port = int(sock.getsockname()[1])
        me = os.getpid()
        procs = [
            ctx.Process(target=run_in_own_session,  # ends with me, own session, then imports
                        args=(Deferred(run_worker, fn, r, nprocs, port, me,
                                       sock if r == 0 else None, args, beats, folder), me))
            for r in range(nprocs)
        ]  # fmt: skip
    else:
        procs = early.procs
    hung: list[int] = []
    silent: list[int] = []
    refusal: DappleError | None = None
    with StopSignals(closing) as signals:
        try:
            if early is not None:
                early.hand(fn, args)
            for p in procs if early is None else []:
                if signals.received is None:
                    p.start()
            if sock is not None:
                sock.close()  # rank 0 holds its copy
            hung, silent, refusal = _wait(procs, timeout_s, signals, beats, folder)
        finally:
            if sock is not None:
                sock.close()
            stop_workers(procs)
            shutil.rmtree(folder, ignore_errors=True)  # before a stop signal ends this process
    if refusal is not None:
        raise refusal
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        parts = [f"rank {r} " + _end_text(r, c, hung, silent, timeout_s) for r, c in bad]
        raise RankFailure(
            f"{len(bad)} of {nprocs} workers failed: {', '.join(parts)}",
            {r: None if r in hung else c for r, c in bad},
        )


def _end_text(
    r: int, code: int | None, hung: list[int], silent: list[int], timeout_s: float
) -> str:
    if r in silent:
        return f"stopped responding (no heartbeat for {timeout_s:g} s: killed, a lost device)"
    return "hung (killed)" if r in hung else exit_text(code)


def _wait(
    procs: list[Any], timeout_s: float, signals: StopSignals, beats: Any, folder: str
) -> tuple[list[int], list[int], DappleError | None]:
    """Wait until every worker has ended, a stop signal came or a worker handed a refusal
    over into ``folder`` (then every worker is killed at once, SIGKILL). Returns ``(hung,
    silent, refusal)``: the ranks still alive ``timeout_s + GRACE_S`` after the first failure,
    those whose heartbeat (:func:`~dapple.runtime.launch.local.heartbeats`) stopped for more
    than ``timeout_s`` (both killed here, SIGKILL), and the refusal. A silent worker is frozen (stopped, or starved of every
    core), so it counts as a lost device: its exit code is SIGKILL's, and its peers, waiting
    for it in a collective, fail as soon as its sockets close - the run ends about
    ``timeout_s`` after the worker froze, not after the peers' own timeouts and this grace."""
    first_fail: float | None = None
    silent: list[int] = []
    while signals.received is None and any(p.is_alive() for p in procs):
        refusal = refused(folder)
        if refusal is not None:
            for p in procs:
                if p.is_alive():
                    p.kill()
            return [], silent, refusal
        for r in silent_ranks(procs, beats, timeout_s):
            logger.warning("rank %d: no heartbeat for %.0f s, killing it", r, timeout_s)
            procs[r].kill()
            procs[r].join()
            silent.append(r)
        if first_fail is None and any(p.exitcode not in (None, 0) for p in procs):
            first_fail = time.monotonic()
        if first_fail is not None and time.monotonic() - first_fail > timeout_s + GRACE_S:
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for r in hung:
                procs[r].kill()
            return hung, silent, None
        time.sleep(0.05)
    return [], silent, refused(folder)


def _worker(
    rank: int,
    world: int,
    plan_d: dict[str, Any],
    wl: bytes,
    cfg: TrainConfig,
    out: str | None,
    datasets: tuple[Any, Any] = (None, None),
    elastic: bool = False,
) -> None:
    """A spawned rank. ``wl`` is the workload pickled (a spec string or a :class:`Workload`,
    which pickles as its spec): loading it here, not while the process unpickles its
    arguments, lets rank 0 say so first. In an ``elastic`` attempt a rank that lost a peer
    says so as the loss's consequence, not as an error (the launcher re-plans)."""
    try:
        workload = preloaded(wl)  # an early worker loaded it already
        if workload is None:
            if rank == 0:
                announce(f"start-up: loading the model in {processes_text(world)}", cfg.echo)
            workload = resolve_workload(pickle.loads(wl))
        if rank == 0:
            announce("start-up: rendezvous", cfg.echo)
        device = init_distributed(cfg, world)
        plan = Plan.from_dict(plan_d)
        data, eval_data = datasets
        run = run_plan(plan, workload, cfg, device=device, data=data, eval_data=eval_data)
        if out and rank == 0:
            Path(out).write_text(json.dumps([m.to_dict() for m in run.metrics]))
        shutdown_distributed()
    except Exception as e:
        if elastic and lost_peer(e):
            _die(f"rank {rank} stops with its lost peer ({rank_report(e)})", kind="")
        if is_refusal(e):
            hand_over(e, rank)  # the launcher ends every worker and raises it
        _die(rank_report(e, rank))


def train(
    plan: Plan | str | Path,
    workload: Workload | str,
    config: TrainConfig,
    *,
    data: Any = None,
    eval_data: Any = None,
    early: EarlyWorkers | None = None,
    elastic: ElasticPolicy | None = None,
    elastic_attempt: bool = False,
) -> list[StepMetrics]:
    """Train ``config.steps`` synchronous steps of ``plan`` (the runtime behind
    :func:`dapple.api.train` and ``dapple train``).

    Under ``torchrun`` (RANK/WORLD_SIZE in the env) this process is one rank; otherwise one
    process per plan device is started locally (or, with ``early``, those started before the
    checks run it: ``dapple train`` starts them first thing, :mod:`dapple.runtime.launch.early`).

    Args:
        plan: a :class:`Plan` or the path of a plan JSON file.
        workload: a :class:`Workload` (must be picklable when processes are spawned), a
            ``module:factory`` spec or a zoo model name.
        config: how to run it (steps, seed, optimizer, limits, reporting), as the API
            resolved it (:func:`dapple.api.run_config.resolve_train_config`).
        data: training samples (a map-style dataset of ``(inputs, targets)``, e.g. a
            :class:`~dapple.datasets.TokenFile`); None: ``workload.make_batch``.
        eval_data: evaluation samples handed to the runtime (see ``run_plan``).
        early: workers already started for this run (one per plan device; ended when the
            run is refused).
        elastic: re-plan for the devices there are (:mod:`dapple.runtime.launch.elastic`): under
            ``torchrun`` for ``WORLD_SIZE`` devices, always resuming from the newest
            checkpoint; standalone whenever a device is lost (:func:`train_elastic`, which
            returns only the metrics here).
        elastic_attempt: one launch of such a run (:func:`train_elastic`'s): a rank that
            loses a peer reports it as the loss's consequence, not as an error.

    Returns:
        Rank 0's per-step metrics (empty on other torchrun ranks).

    Raises:
        ValidationError: bad plan/workload/options, before any compute.
        RankFailure: a worker failed (standalone launch).
    """
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if elastic is not None and not _under_torchrun():
        from dapple.runtime.launch.elastic import train_elastic

        first = [early]  # workers started early serve the first attempt only

        def attempt(p: Plan, c: TrainConfig) -> None:
            ready, first[0] = first[0], None
            train(p, workload, c, data=data, eval_data=eval_data, early=ready,
                  elastic_attempt=True)  # fmt: skip

        return train_elastic(plan, config, attempt, policy=elastic).metrics
    cfg = config
    if elastic is not None:
        plan, cfg = _elastic_worker(plan, elastic, cfg)
    check_precision(cfg.precision, cfg.device)  # fp16 on the CPU etc.: before any compute
    if _under_torchrun():
        return _torchrun_rank(plan, workload, cfg, data, eval_data, elastic=elastic is not None)
    world = len(plan.devices)
    resolved = resolve_workload(workload)
    validate_run(plan, resolved, world, zero_stage=cfg.zero_stage)
    check_mesh_run(plan, resolved, cfg)  # once here, not by every worker after its start-up
    check_datasets(plan, resolved, cfg, data, eval_data, verify_files=not elastic_attempt)
    check_batches(plan, resolved, cfg, data)
    try:
        payload = pickle.dumps(workload)
    except Exception as e:
        raise ValidationError(
            f"workload {resolved.name!r} cannot be sent to spawned workers ({e}); "
            "pass it as a 'module:factory' spec string"
        ) from e
    if early is not None and early.nprocs != world:
        early.close()  # started for another plan
        early = None
    if early is None:
        announce(f"start-up: starting {world} process{'es' if world != 1 else ''}", cfg.echo)
    else:
        announce(f"start-up: checks done, the run goes to {processes_text(world, 'the')}", cfg.echo)
    with tempfile.TemporaryDirectory(prefix="dapple-train-") as tmp:
        out = str(Path(tmp) / "metrics.json")

        def closing(name: str) -> str:
            shutil.rmtree(tmp, ignore_errors=True)  # the signal ends this process in here
            return stop_line(name, metrics_path=cfg.metrics_path, checkpoint_dir=cfg.checkpoint_dir)

        spawn(_worker, world, plan.to_dict(), payload, cfg, out, (data, eval_data),
              elastic_attempt, timeout_s=cfg.timeout_s, early=early, closing=closing)  # fmt: skip
        return [metrics_from_dict(d) for d in json.loads(Path(out).read_text())]


def _torchrun_rank(
    plan: Plan, workload: Any, cfg: TrainConfig, data: Any, eval_data: Any, *, elastic: bool
) -> list[StepMetrics]:
    """This ``torchrun`` worker's rank of the run: checked, joined, run; a failure ends the
    process with its one line (with restarts left in an ``elastic`` run, a lost peer is what
    happens next, not an error)."""
    wl = resolve_workload(workload)
    validate_run(plan, wl, int(os.environ["WORLD_SIZE"]), zero_stage=cfg.zero_stage)
    check_datasets(plan, wl, cfg, data, eval_data)
    check_batches(plan, wl, cfg, data)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if int(os.environ["RANK"]) == 0:
        announce("start-up: rendezvous", cfg.echo)
    try:
        device = init_distributed(cfg, local_world)
        run = run_plan(plan, wl, cfg, device=device, data=data, eval_data=eval_data)
    except Exception as e:  # peers may be gone: report and leave without PG teardown
        end_if_refused(e)  # the job's one line, or a peer's
        if elastic and lost_peer(e) and _restarts_left():
            _die(f"rank {os.environ['RANK']} stops with its lost peer ({rank_report(e)}); "
                 "torchrun restarts the workers and dapple re-plans", kind="")  # fmt: skip
        _die(rank_report(e))
    shutdown_distributed()
    return run.metrics


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _restarts_left() -> bool:
    """Whether torchrun's elastic agent restarts this worker's group once it fails
    (``TORCHELASTIC_RESTART_COUNT`` below ``TORCHELASTIC_MAX_RESTARTS``)."""
    try:
        done = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return done < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return False


def _elastic_worker(
    plan: Plan, policy: ElasticPolicy, config: TrainConfig
) -> tuple[Plan, TrainConfig]:
    """A ``torchrun`` worker of an elastic run: the plan for ``WORLD_SIZE`` devices, resuming
    from the newest checkpoint (none: step 0)."""
    from dapple.runtime.launch.elastic import worker_plan

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    return worker_plan(plan, world, policy, config, announce_it=rank == 0)

"""Process launch: under ``torchrun`` (env RANK/WORLD_SIZE/MASTER_ADDR) or standalone, where the
local worker processes are started here (:func:`spawn`).

Backend: NCCL when the run uses CUDA, gloo on CPU. ``init_process_group(timeout=...)`` bounds
every wait on a peer; a failing worker prints ``dapple: error: step S: rank R (stage s
replica j) failed during ...; lost peer rank P ...`` and exits 1 instead of hanging. A rank that
failed on its own adds the schedule grid with its action marked; a rank that only lost a peer
prints that one line (:func:`dapple.runtime.failure.rank_report`).

The standalone launcher (:mod:`dapple.runtime.local`): its workers end when it ends, however it
ends (SIGKILL included); SIGTERM or SIGINT to it stops every worker first; the workers ignore
SIGINT (Ctrl-C reaches the whole process group: the launcher handles it); the rendezvous and
gloo listen on ``127.0.0.1`` only. It waits for all workers (at most ``timeout_s`` plus a grace
period after the first failure, then kills stragglers) and reports every rank's exit code or
signal.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dapple.core.host_memory import keep_freed_memory
from dapple.core.plan import Plan
from dapple.errors import ValidationError
from dapple.models.shapes import check_steps, run_dims
from dapple.models.workload import Workload
from dapple.runtime.config import StepMetrics, TrainConfig
from dapple.runtime.data import check_data, check_data_resume, data_state
from dapple.runtime.engine import RankFailure, run_plan, validate_run
from dapple.runtime.evaluate import eval_batch_fn, eval_plan
from dapple.runtime.failure import rank_report
from dapple.runtime.local import (
    LOOPBACK,
    StopSignals,
    end_with_launcher,
    exit_text,
    join_loopback,
    listener,
    local_store,
    stop_workers,
)
from dapple.runtime.longrun import elastic_store
from dapple.runtime.precision import check_precision

__all__ = [
    "free_port",
    "init_distributed",
    "resolve_workload",
    "shutdown_distributed",
    "spawn",
    "train",
]

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
    (:func:`dapple.runtime.local.local_store`); anywhere else as the env says (RANK,
    WORLD_SIZE, MASTER_ADDR/PORT, e.g. from ``torchrun``, on any host). A CPU rank also sets its
    intra-op threads (the cores over the local processes) and keeps freed memory for the next
    step (:func:`dapple.core.host_memory.keep_freed_memory`)."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    device = _pick_device(config.device, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        keep_freed_memory()  # no page faults for each step's fresh activations
    if not dist.is_initialized():
        timeout = timedelta(seconds=config.timeout_s)
        store = local_store(timeout)
        if store is None:
            store = elastic_store(timeout)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timeout,
            **store,  # spawned: loopback store; torchrun restarts: a fresh key prefix
        )
    return device


def shutdown_distributed() -> None:
    """Leave the default process group: a barrier, ``destroy_process_group``, then a garbage
    collection, so every gloo group is gone while Python is still fully alive.

    Why: a gloo group's worker thread drops its last reference to a finished collective (e.g.
    an ``all_gather`` whose tensors are Python objects) on its own; if that happens while the
    interpreter is finalizing - the group kept alive by a reference cycle that only the exit-time
    collection frees - the thread needs the GIL, is told to exit, and the C++ runtime aborts the
    process ("terminate called without an active exception", SIGABRT; core dump backtrace:
    ``~AsyncAllgatherWork`` -> ``take_gil`` -> ``pthread_exit`` in ``ProcessGroupGloo::runLoop``).
    The barrier keeps a rank from tearing down while a peer is still in the last collective.
    Call it on every rank, only when the group is healthy (after a failure peers may be gone).
    """
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


def _die(msg: str) -> None:
    """Print ``dapple: error: msg`` in a single write (ranks share stderr) and exit 1."""
    sys.stdout.flush()
    os.write(2, f"dapple: error: {msg}\n".encode())
    os._exit(1)


def _entry(
    fn: Callable[..., None],
    rank: int,
    world: int,
    port: int,
    launcher: int,
    sock: socket.socket | None,
    args: tuple[Any, ...],
) -> None:
    """A spawned worker: bind its life to the launcher's, then set the env and run ``fn``."""
    end_with_launcher(launcher)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the launcher stops the workers
    os.environ.update(
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        **join_loopback(port, sock),
    )
    fn(rank, world, *args)


def spawn(fn: Callable[..., None], nprocs: int, *args: Any, timeout_s: float = 300.0) -> None:
    """Run ``fn(rank, world, *args)`` in ``nprocs`` fresh local processes with the env set.

    The workers end with this process however it ends, meet on loopback only, and are stopped
    by SIGTERM or SIGINT to it (see the module docstring).

    Raises:
        RankFailure: a worker exited non-zero or was killed (or hung ``timeout_s + GRACE_S``
            after a failure); the message lists every failing rank's exit code or signal.
    """
    ctx = mp.get_context("spawn")  # the launcher itself is each worker's parent
    sock = listener()  # the store's address, bound before any worker looks for it
    port = int(sock.getsockname()[1])
    me = os.getpid()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, nprocs, port, me, sock if r == 0 else None, args))
        for r in range(nprocs)
    ]  # fmt: skip
    hung: list[int] = []
    with StopSignals() as signals:
        try:
            for p in procs:
                if signals.received is None:
                    p.start()
            sock.close()  # rank 0 holds its copy
            hung = _wait(procs, timeout_s, signals)
        finally:
            sock.close()
            stop_workers(procs)
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        parts = [f"rank {r} " + ("hung (killed)" if r in hung else exit_text(c)) for r, c in bad]
        raise RankFailure(f"{len(bad)} of {nprocs} workers failed: {', '.join(parts)}")


def _wait(procs: list[Any], timeout_s: float, signals: StopSignals) -> list[int]:
    """Wait until every worker has ended, or a stop signal came; returns the ranks still alive
    ``timeout_s + GRACE_S`` after the first failure (killed here)."""
    first_fail: float | None = None
    while signals.received is None and any(p.is_alive() for p in procs):
        if first_fail is None and any(p.exitcode not in (None, 0) for p in procs):
            first_fail = time.monotonic()
        if first_fail is not None and time.monotonic() - first_fail > timeout_s + GRACE_S:
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for r in hung:
                procs[r].kill()
            return hung
        time.sleep(0.05)
    return []


def _worker(
    rank: int,
    world: int,
    plan_d: dict[str, Any],
    wl: Any,
    cfg: TrainConfig,
    out: str | None,
    datasets: tuple[Any, Any] = (None, None),
) -> None:
    try:
        device = init_distributed(cfg, world)
        plan = Plan.from_dict(plan_d)
        data, eval_data = datasets
        run = run_plan(
            plan, resolve_workload(wl), cfg, device=device, data=data, eval_data=eval_data
        )
        if out and rank == 0:
            Path(out).write_text(json.dumps([m.to_dict() for m in run.metrics]))
        shutdown_distributed()
    except Exception as e:
        _die(rank_report(e, rank))


def _metrics_from(d: dict[str, Any]) -> StepMetrics:
    d = dict(d)
    d["peak_memory_bytes"] = tuple(d["peak_memory_bytes"])
    return StepMetrics(**d)


def train(
    plan: Plan | str | Path,
    workload: Workload | str,
    steps: int = 1,
    *,
    data: Any = None,
    eval_data: Any = None,
    **options: Any,
) -> list[StepMetrics]:
    """Train ``steps`` synchronous steps of ``plan`` (Python API behind ``dapple train``).

    Under ``torchrun`` (RANK/WORLD_SIZE in the env) this process is one rank; otherwise one
    process per plan device is started locally.

    Args:
        plan: a :class:`Plan` or the path of a plan JSON file.
        workload: a :class:`Workload` (must be picklable when processes are spawned), a
            ``module:factory`` spec or a zoo model name.
        steps: optimizer steps.
        data: training samples (a map-style dataset of ``(inputs, targets)``, e.g. a
            :class:`~dapple.datasets.TokenFile`); None: ``workload.make_batch``.
        eval_data: evaluation samples handed to the runtime (see ``run_plan``).
        **options: the other :class:`TrainConfig` fields (seed, optimizer, lr, timeout_s,
            recompute, metrics_path, echo, device, predicted_step_ms, precision).

    Returns:
        Rank 0's per-step metrics (empty on other torchrun ranks).

    Raises:
        ValidationError: bad plan/workload/options, before any compute.
        RankFailure: a worker failed (standalone launch).
    """
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    cfg = TrainConfig(steps=steps, **options)
    check_precision(cfg.precision, cfg.device)  # fp16 on the CPU etc.: before any compute
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        wl = resolve_workload(workload)
        validate_run(plan, wl, int(os.environ["WORLD_SIZE"]), zero_stage=cfg.zero_stage)
        _check_datasets(plan, wl, cfg, data, eval_data)
        _check_shapes(plan, wl, cfg, data)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        try:
            device = init_distributed(cfg, local_world)
            run = run_plan(plan, wl, cfg, device=device, data=data, eval_data=eval_data)
        except ValidationError:
            raise
        except Exception as e:  # peers may be gone: report and leave without PG teardown
            _die(rank_report(e))
        shutdown_distributed()
        return run.metrics
    world = len(plan.devices)
    resolved = resolve_workload(workload)
    validate_run(plan, resolved, world, zero_stage=cfg.zero_stage)
    _check_datasets(plan, resolved, cfg, data, eval_data)
    _check_shapes(plan, resolved, cfg, data)
    if not isinstance(workload, str):
        try:
            pickle.dumps(workload)
        except Exception as e:
            raise ValidationError(
                f"workload {workload.name!r} cannot be sent to spawned workers ({e}); "
                "pass it as a 'module:factory' spec string"
            ) from e
    with tempfile.TemporaryDirectory(prefix="dapple-train-") as tmp:
        out = str(Path(tmp) / "metrics.json")
        spawn(_worker, world, plan.to_dict(), workload, cfg, out, (data, eval_data),
              timeout_s=cfg.timeout_s)  # fmt: skip
        return [_metrics_from(d) for d in json.loads(Path(out).read_text())]


def _check_shapes(plan: Plan, wl: Workload, cfg: TrainConfig, data: Any) -> None:
    """A model whose input shapes change from step to step (:mod:`dapple.models.shapes`): every
    step's batch fits it, checked here before any worker starts (the workers check each step
    again; a model with static shapes is left to them).

    Raises:
        ValidationError: the first step whose batch the model cannot take.
    """
    if data is None and run_dims(wl, plan.global_batch_size, cfg.seed):
        check_steps(wl, plan.global_batch_size, cfg.seed, cfg.steps)


def _check_datasets(plan: Plan, wl: Workload, cfg: TrainConfig, data: Any, eval_data: Any) -> None:
    """The datasets fit the model and the batch, and a resume continues the same data stream.

    Raises:
        ValidationError: see :func:`dapple.runtime.data.check_data`.
        CheckpointError: the checkpoint to resume was saved on other data.
    """
    G_e = eval_plan(plan, cfg.eval_batch_size).global_batch_size
    check_data(wl, data, plan.global_batch_size, cfg.seed, eval_data=eval_data, eval_batch_size=G_e)
    if cfg.eval_every > 0 and eval_data is not None:  # enough eval batches, before any worker
        eval_batch_fn(wl, G_e, cfg.eval_batches, eval_data)
    if cfg.resume and cfg.checkpoint_dir is not None:
        from dapple.runtime.checkpoint import latest_checkpoint

        ck = latest_checkpoint(cfg.checkpoint_dir)
        if ck is not None:
            check_data_resume(
                ck.meta.extra.get("data"),
                data_state(data, cfg.seed, plan.global_batch_size),
                ck.path,
            )

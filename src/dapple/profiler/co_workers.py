"""Co-workers for CPU profiling: N - 1 forked processes training the model meanwhile.

:func:`dapple.profiler.measure.profile_workload` with ``co_workers=N`` times each layer while
these processes run forward + backward of the whole chain in a loop, as N local runtime workers
will run side by side (see its ``co_workers`` argument).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

import torch

from dapple.host.parent_death import end_with_parent
from dapple.models.workload import Workload

__all__ = ["CoWorkers"]

Cast = Callable[[], contextlib.AbstractContextManager[Any]]
"""A fresh autocast context for one forward (or a null context in fp32)."""


class CoWorkers:
    """``n`` forked processes training ``workload`` at batch ``b`` until :meth:`stop`.

    Each ends with this process however it ends (SIGKILL included):
    :func:`dapple.host.parent_death.end_with_parent` is its first act. ``daemon=True`` alone
    covers only a parent that exits through Python's shutdown.
    """

    def __init__(
        self, workload: Workload, n: int, b: int, seed: int, cast: Cast = contextlib.nullcontext
    ) -> None:
        ctx = mp.get_context("fork")  # the workload's factories need not pickle
        self._stop = ctx.Event()
        self._ready = ctx.Barrier(n + 1)
        threads = torch.get_num_threads()
        self._procs = [
            ctx.Process(
                target=_train_loop,
                args=(workload, b, seed, threads, self._stop, self._ready, cast, os.getpid()),
                daemon=True,
            )
            for _ in range(n)
        ]
        for p in self._procs:
            p.start()
        self._ready.wait(timeout=120)  # every co-worker built its layers and is computing

    def stop(self) -> None:
        self._stop.set()
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():  # pragma: no cover - a stuck co-worker
                p.kill()


def _as_float(x: Any) -> Any:
    """``x`` with its floating-point tensors in fp32 (the loss of an autocast output)."""
    if isinstance(x, torch.Tensor):
        return x.float() if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(_as_float(item) for item in x)
    return x


def _train_loop(
    workload: Workload,
    b: int,
    seed: int,
    threads: int,
    stop: Any,
    ready: Any,
    cast: Cast = contextlib.nullcontext,
    parent: int | None = None,
) -> None:
    """A co-worker: forward (under ``cast``) + backward of the whole chain at batch ``b`` until
    ``stop``, or until the process ``parent`` (None: this one's parent now) ends."""
    end_with_parent(os.getppid() if parent is None else parent)
    torch.set_num_threads(threads)
    layers = [workload.build_layer(i, seed).train() for i in range(workload.num_layers)]
    inputs, targets = workload.make_batch(b, seed)
    ready.wait(timeout=120)
    while not stop.is_set():
        x = inputs
        with cast():
            for layer in layers:
                x = layer(x)
        loss = workload.loss_fn(_as_float(x), targets)
        if loss.requires_grad:
            loss.backward()  # type: ignore[no-untyped-call]
        for layer in layers:
            layer.zero_grad(set_to_none=True)

"""How the demo runs its jobs: the progress of a training run in the worker processes, read
from its metrics file (:func:`run_progress`); one intra-op thread for what runs in this process
(:func:`one_thread`); the median step time (:func:`median_step_ms`)."""

from __future__ import annotations

import json
import statistics
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from dapple.cli._console import StepProgress

__all__ = ["median_step_ms", "one_thread", "run_progress"]


def median_step_ms(metrics: list[Any], skip: int) -> float:
    """The median step time after the first ``skip`` steps (all of them in a shorter run)."""
    return float(statistics.median(m.step_ms for m in metrics[min(skip, len(metrics) - 1) :]))


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch in this process on one intra-op thread, as each of the demo's workers. On a loaded
    machine a second thread waits for a core at every operation: greedy generation took 78 s
    with 2 threads and 1.3 s with 1 on 2 cores under a load of 15."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _steps_written(path: Path) -> tuple[int, str | None]:
    """Steps in a run's metrics file so far (rank 0 appends one JSON line per step; a line
    being written is not counted) and the last one's loss."""
    try:
        text = path.read_text()
    except OSError:
        return 0, None
    lines = text.split("\n")[:-1]  # the complete lines
    try:
        return len(lines), f"loss {json.loads(lines[-1])['loss']:.3f}" if lines else None
    except (ValueError, KeyError, TypeError):
        return len(lines), None


@contextmanager
def run_progress(con: Console, what: str, steps: int, metrics: Path) -> Iterator[None]:
    """A :class:`StepProgress` of a training run in the worker processes, fed from its metrics
    file: a bar in a terminal, plain lines off one."""
    metrics.unlink(missing_ok=True)
    stop = threading.Event()
    with StepProgress(what, steps, console=con) as bar:

        def poll() -> None:
            while not stop.wait(1.0):
                done, detail = _steps_written(metrics)
                bar(done, detail=detail)

        watcher = threading.Thread(target=poll, name="demo-progress", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()
            done, detail = _steps_written(metrics)
            bar(done, detail=detail)

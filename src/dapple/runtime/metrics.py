"""Per-step measurements and where they go: a probe on every rank, a sink on rank 0.

:class:`StepProbe` measures one rank's step: its peak memory (CUDA: ``max_memory_allocated``;
CPU: the held activations of :class:`~dapple.runtime.memory.ActivationMeter`), the process's
peak resident memory (CPU: ``VmHWM``; CUDA: peak reserved) beside what it was before the rank
built its stage, and the wall time between consecutive step collectives. The step's one world collective carries every rank's loss
part and peak (see :mod:`dapple.runtime.interpreter`), so rank 0 sees the whole step without
another message, and :class:`MetricsSink` turns the gathered rows into one
:class:`~dapple.runtime.train_config.StepMetrics` per step: kept in a list, logged, echoed to stdout
(``TrainConfig.echo``), appended to a JSON-lines file (``TrainConfig.metrics_path``) and handed
to callbacks - in the spirit of torchtitan's metrics processor.

The run's events between the step lines - each start-up phase as it starts, weights loaded, a
checkpoint saved, a resume - take the same path, one line each from the rank that knows
(:func:`announce`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import struct
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import IO, Any

import torch

from dapple.core.plan import Plan
from dapple.files.output_path import make_parent_dirs
from dapple.runtime.chunks import Executor
from dapple.runtime.memory import ActivationMeter
from dapple.runtime.step_metrics import StepMetrics
from dapple.runtime.train_config import TrainConfig
from dapple.runtime.transport import flatten

__all__ = [
    "ROW_SQ_NORM",
    "ROW_TOKENS",
    "MetricsSink",
    "PeakResident",
    "StepProbe",
    "announce",
    "cuda_bytes",
    "device_row",
    "global_norm",
    "host_row",
    "read_rows",
    "resident_bytes",
    "row_tokens",
    "step_metrics",
]

logger = logging.getLogger(__name__)

ROW_SQ_NORM = 2
"""Column of a step's collective row (:meth:`NonFiniteGuard.agree_finite`'s ``[loss, stage,
squared gradient norm part, rank]`` then the interpreter's ``[loss part, peak bytes, peak
resident bytes, baseline bytes, target tokens]``): the rank's part of the squared global
gradient norm (also the guard's gradient verdict)."""
ROW_TOKENS = 8
"""Column of a step's collective row: the target tokens of the rank's batch (-1: not a token
workload)."""


def announce(line: str, echo: bool) -> None:
    """One event of the run (``start-up: rendezvous``, ``checkpoint saved: ...``), as the step
    lines go: logged at INFO and, with ``echo`` (``TrainConfig.echo``), printed to stdout in a
    single flushed write (ranks share stdout). The caller is the one rank that knows."""
    logger.info(line)
    if echo:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def device_row(values: Sequence[float | torch.Tensor], device: torch.device) -> torch.Tensor:
    """``values`` as one float64 vector on ``device`` without reading any on the host: the
    numbers go in one host-to-device copy, each (one-element) tensor is copied into its slot
    on the device (``copy_`` converts its dtype)."""
    row = torch.tensor(
        [0.0 if isinstance(v, torch.Tensor) else float(v) for v in values],
        dtype=torch.float64,
        device=device,
    )
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            row[i] = v if v.dim() == 0 else v.reshape(())
    return row


_READ_VECTORS: dict[tuple[torch.device, int], tuple[torch.Tensor, list[torch.Tensor]]] = {}
"""``(device, n)`` -> a float64 vector of ``n`` elements and its elements as views:
:func:`host_row`'s copy on that device, written in place at every read (made once)."""


def _read_vector(device: torch.device, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    held = _READ_VECTORS.get((device, n))
    if held is None:
        vec = torch.zeros(n, dtype=torch.float64, device=device)
        held = _READ_VECTORS[device, n] = (vec, list(vec.unbind()))
    return held


def host_row(values: Sequence[float | torch.Tensor]) -> list[float]:
    """``values`` as floats on the host, their (one-element, detached) tensors read in one copy
    per device (a world of one: a step's row needs no gather, :meth:`NonFiniteGuard.agree_finite`;
    only the accelerator's copy waits for it).

    Each distinct tensor is copied (``copy_`` converts its dtype) into its element of a float64
    vector held for the device and the row's number of tensors, which is read at once; a tensor
    that stands at several places of the row (the loss and the loss part of a rank that is the
    whole last stage) is copied once."""
    row = [0.0 if isinstance(v, torch.Tensor) else float(v) for v in values]
    tensors: list[torch.Tensor] = []  # each distinct tensor once, with its places in the row
    places: list[list[int]] = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            for k, t in enumerate(tensors):
                if t is v:
                    places[k].append(i)
                    break
            else:
                tensors.append(v)
                places.append([i])
    devices = {t.device for t in tensors}  # one copy per device: a CUDA step's row also holds
    for device in devices:  # host tensors (counts, the resident peak)
        at = [k for k, t in enumerate(tensors) if t.device == device]
        vec, slots = _read_vector(device, len(at))
        for slot, k in zip(slots, at, strict=True):
            t = tensors[k]
            slot.copy_(t if t.dim() == 0 else t.reshape(()))
        for x, k in zip(vec.tolist(), at, strict=True):
            for i in places[k]:
                row[i] = x
    return row


def read_rows(table: torch.Tensor, n: int) -> tuple[list[list[float]], torch.Tensor, list[float]]:
    """A gathered ``table`` (one row per rank: its ``n``-column row of the step's collective,
    then a vector to be summed over the ranks, if any) read on the host at once: the rows, the
    rows as they stand on the device, and the vector's sum over the ranks (empty without)."""
    head = table[:, :n]
    if table.shape[1] == n:
        return head.tolist(), head, []
    flat = torch.cat([head.reshape(-1), table[:, n:].sum(0)]).tolist()
    ranks = len(table)
    return [flat[i * n : (i + 1) * n] for i in range(ranks)], head, flat[n * ranks :]


def global_norm(rows: Sequence[Sequence[float]]) -> float:
    """``||g||_2`` from the rows' parts: summed in float64 in rank order, its square root
    rounded to float32 (as the norm clipping uses; no tensor is read)."""
    norm = math.sqrt(sum(r[ROW_SQ_NORM] for r in rows))
    try:
        return float(struct.unpack("f", struct.pack("f", norm))[0])
    except OverflowError:  # beyond float32's range: inf, as a float32 tensor would hold
        return math.inf


def row_tokens(rows: Sequence[Sequence[float]]) -> int | None:
    """Rank 0's target tokens from the rows (None: not a token workload)."""
    n = rows[0][ROW_TOKENS] if rows and len(rows[0]) > ROW_TOKENS else -1.0
    return None if n < 0 else int(n)


def resident_bytes(device: torch.device, peak: bool) -> int:
    """This process's resident memory: CPU ``VmHWM`` (``peak``) or ``VmRSS`` from
    ``/proc/self/status``; CUDA ``max_memory_reserved`` or ``memory_reserved`` (0 when neither
    can be read).

    Not ``getrusage``'s ``ru_maxrss`` alone: it survives ``execve``, so a spawned worker's
    starts at its launcher's resident size at the fork, where ``VmHWM`` is the worker's own
    (:class:`PeakResident` reads the file when it moves)."""
    if device.type == "cuda":
        return cuda_bytes(device, "reserved_bytes", "peak" if peak else "current")
    key = b"VmHWM:" if peak else b"VmRSS:"
    try:
        status = os.pread(_status_fd(), 8192, 0)
    except OSError:  # pragma: no cover - not Linux
        return 0
    at = status.find(key)
    if at < 0:  # pragma: no cover - a kernel without the field
        return 0
    return int(status[at + len(key) : status.index(b"kB", at)]) * 1024


def cuda_bytes(device: torch.device, kind: str, which: str) -> int:
    """CUDA's caching allocator's ``kind`` (``allocated_bytes``, ``reserved_bytes``) over all
    pools, ``which`` (``peak``, ``current``): ``torch.cuda.max_memory_allocated``'s,
    ``max_memory_reserved``'s and ``memory_reserved``'s numbers, read from
    ``torch.cuda.memory_stats_as_nested_dict`` (they flatten and sort every statistic first,
    hundreds of Python calls per read; 0 before CUDA is initialised, as they give)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    return int(stats.get(kind, {}).get("all", {}).get(which, 0))


class PeakResident:
    """This process's peak resident bytes, ``VmHWM`` of ``/proc/self/status``
    (:func:`resident_bytes`, whose kernel side formats the whole file: ~20 us), read again only
    when ``getrusage``'s ``ru_maxrss`` (one system call, ~1 us) has moved since the last read.

    ``ru_maxrss`` is the kernel's peak from its per-CPU counters (``VmHWM`` sums them exactly,
    so the two differ by a few hundred KiB on a small machine), at least the peak the process
    had before its last ``execve`` (a spawned worker's: its launcher's size at the fork). While
    that inherited peak hides the process's own (``ru_maxrss`` at or below its value at
    creation, when it exceeded ``VmHWM``), every reading goes to the file. A reading can lag
    ``VmHWM`` by at most the counters' slack, until ``ru_maxrss`` next moves. Linux only
    (elsewhere always :func:`resident_bytes`); made in the process that reads it."""

    def __init__(self) -> None:
        self._linux = sys.platform.startswith("linux")
        self._floor_kib = -1
        """``ru_maxrss`` (KiB) at or below this is the inherited peak: read the file."""
        self._ru_kib = -1
        """``ru_maxrss`` at the last read of the file (-1: none yet)."""
        self._bytes = 0
        """``VmHWM`` at that read."""
        if self._linux:
            hwm = resident_bytes(_CPU, peak=True) // 1024
            ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self._floor_kib = ru if ru > hwm else -1

    def __call__(self) -> int:
        if not self._linux:
            return resident_bytes(_CPU, peak=True)
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if ru <= self._floor_kib or ru != self._ru_kib:
            self._ru_kib, self._bytes = ru, resident_bytes(_CPU, peak=True)
        return self._bytes


_CPU = torch.device("cpu")
_STATUS: list[int] = []
"""``[pid, fd]`` of this process's open ``/proc/self/status`` (read again from offset 0 each
time: a third of the cost of opening it per step)."""


def _status_fd() -> int:
    """This process's ``/proc/<pid>/status``, opened once per process (a forked child opens
    its own)."""
    pid = os.getpid()
    if not _STATUS or _STATUS[0] != pid:
        _STATUS[:] = [pid, os.open(f"/proc/{pid}/status", os.O_RDONLY)]
    return _STATUS[1]


class StepProbe:
    """Peak memory and wall time of each step of one rank.

    The step time is the period between consecutive step collectives (the first step: from the
    probe's creation), i.e. the throughput a user sees - it includes the previous step's
    AllReduce wait, optimizer step, checkpoint save and ``make_batch``. The CUDA peak covers the
    same period. On CPU the lowered program is the same every step, so the held-activation peak
    changes only with the batch shapes: the probe meters the first step of each distinct set
    of batch shapes and reuses that shape's peak afterwards (the saved-tensor hooks cost ~5% of
    a CPU step), so lengths that alternate are metered once each.
    """

    def __init__(
        self,
        device: torch.device,
        meter: ActivationMeter,
        executor: Executor | None,
        baseline_bytes: int = 0,
    ) -> None:
        """Args:
        device: this rank's device.
        meter: the held-activation meter (CPU).
        executor: this rank's stage executor (None: a rank beyond the plan).
        baseline_bytes: resident bytes before the rank built its stage (:func:`resident_bytes`).
        """
        self.device, self.meter, self.executor = device, meter, executor
        self.cuda = device.type == "cuda"
        self.memory_kind = "cuda_max_allocated" if self.cuda else "held_activations"
        self.resident_kind = "cuda_max_reserved" if self.cuda else "VmHWM"
        self.baseline_bytes = baseline_bytes
        self.step_ms = 0.0
        """The last finished step's wall time (set by :meth:`lap`)."""
        self._metering = False
        self._shapes: tuple[object, ...] = ()  # the shapes of this step's batch
        self._peaks: dict[tuple[object, ...], int] = {}  # metered peak by batch shapes
        self._peak_resident = None if self.cuda else PeakResident()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        self._t = time.perf_counter()

    def begin(self, inputs: Any, targets: torch.Tensor) -> None:
        """Before a step: meter it when its batch shapes are new (CPU)."""
        if not self.cuda:
            self._shapes = tuple((t.shape, t.dtype) for t in (*flatten(inputs), targets))
        self._metering = not self.cuda and self._shapes not in self._peaks
        if self.executor is not None:
            self.executor.metering = self._metering
        self.meter.reset_peak()

    def peak_bytes(self) -> int:
        """This step's peak so far (called just before the step's collective)."""
        if self.cuda:
            return cuda_bytes(self.device, "allocated_bytes", "peak")
        if self._metering:
            self._peaks[self._shapes] = self.meter.peak_bytes
        return self._peaks.get(self._shapes, 0)

    def resident_peak_bytes(self) -> int:
        """The process's peak resident memory so far (CPU ``VmHWM``, :class:`PeakResident`;
        CUDA peak reserved)."""
        if self._peak_resident is None:
            return resident_bytes(self.device, peak=True)
        return self._peak_resident()

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` spent since the last :meth:`lap` (an evaluation) out of the
        current step's time."""
        self._t += seconds

    def lap(self) -> None:
        """Right after the step's collective: the step ends here, the next one starts."""
        now = time.perf_counter()
        self.step_ms, self._t = (now - self._t) * 1e3, now
        if self.cuda:  # the next peak: from here to the next step's collective
            torch.cuda.reset_peak_memory_stats(self.device)


def step_metrics(
    plan: Plan,
    step: int,
    rows: Sequence[Sequence[float]],
    step_ms: float,
    memory_kind: str,
    predicted_step_ms: float | None,
    resident_kind: str = "",
    *,
    target_tokens: int | None = None,
    eval_loss: float | None = None,
    **fields: Any,
) -> StepMetrics:
    """One step's metrics from the rows of its collective.

    Args:
        plan: the plan (its stage count and global batch).
        step: the step index.
        rows: one row per rank, ``[loss, stage, squared gradient norm part, rank, loss part,
            peak bytes, peak resident bytes, resident bytes before the stage was built]`` (stage -1: a rank
            beyond the plan; the last two may be absent), as :meth:`NonFiniteGuard.agree_finite`
            gathers them.
        step_ms: rank 0's wall time of the step.
        memory_kind: what the peaks measure (``cuda_max_allocated`` or ``held_activations``).
        predicted_step_ms: a prediction shown beside the measured time (None: none).
        resident_kind: what the resident peaks measure (``VmHWM`` or ``cuda_max_reserved``).
        target_tokens: target tokens the global batch trains on (None: not a token workload):
            every target but the ``IGNORE_INDEX`` ones (padding), as
            :func:`~dapple.runtime.reporting.target_tokens` counts them, so a window of
            ``seq_len + 1`` tokens counts its ``seq_len`` targets; gives ``tokens`` and
            ``tokens_per_s``.
        eval_loss: the mean validation loss measured after the step (None: none).
        fields: the other :class:`StepMetrics` fields rank 0 knows itself (``lr``,
            ``grad_norm``, the expert loads).
    """
    S = plan.num_groups  # a device group's chunks (interleaved) share its processes
    peaks, resident, grown = [0] * S, [0] * S, [0] * S
    for r in rows:
        if r[1] < 0:
            continue
        s = int(r[1])
        peaks[s] = max(peaks[s], int(r[5]))
        if len(r) > 7:
            resident[s] = max(resident[s], int(r[6]))
            grown[s] = max(grown[s], int(r[6]) - int(r[7]))
    G = plan.global_batch_size
    has_resident = any(len(r) > 7 for r in rows)
    return StepMetrics(
        step=step,
        loss=sum(r[4] for r in rows),
        step_ms=step_ms,
        samples_per_s=G / (step_ms / 1e3) if step_ms > 0 else float("inf"),
        peak_memory_bytes=tuple(peaks),
        memory_kind=memory_kind,
        predicted_step_ms=predicted_step_ms,
        peak_resident_bytes=tuple(resident) if has_resident else (),
        stage_resident_bytes=tuple(grown) if has_resident else (),
        resident_kind=resident_kind if has_resident else "",
        eval_loss=eval_loss,
        tokens_per_s=(
            target_tokens / (step_ms / 1e3) if target_tokens is not None and step_ms > 0 else None
        ),
        tokens=target_tokens,
        **fields,
    )


def metrics_from_dict(d: dict[str, Any]) -> StepMetrics:
    """A :class:`StepMetrics` from its :meth:`~StepMetrics.to_dict` (a metrics-file line)."""
    d = dict(d)
    d["peak_memory_bytes"] = tuple(d["peak_memory_bytes"])
    for key in ("expert_layers", "expert_imbalance", "expert_aux_loss"):
        d[key] = tuple(d.get(key, ()))
    d["expert_load"] = tuple(tuple(x) for x in d.get("expert_load", ()))
    return StepMetrics(**d)


class MetricsSink:
    """Rank 0's per-step metrics: kept, logged, echoed, written as JSON lines, handed on.

    On other ranks it records nothing. Call :meth:`close` at the end of the run (it closes the
    JSON-lines file).

    Attributes:
        metrics: every recorded step, in order.
    """

    def __init__(
        self,
        plan: Plan,
        config: TrainConfig,
        *,
        rank: int,
        memory_kind: str,
        resident_kind: str = "",
        callbacks: Iterable[Callable[[StepMetrics], None]] = (),
    ) -> None:
        self.plan, self.memory_kind, self.active = plan, memory_kind, rank == 0
        self.resident_kind = resident_kind
        self.echo = config.echo
        p = config.predicted_step_ms
        self.predicted_step_ms = None if p != p else p  # NaN: no prediction
        self.callbacks = list(callbacks)
        self.metrics: list[StepMetrics] = []
        self._file: IO[str] | None = None
        if self.active and config.metrics_path:
            mode = "a" if config.resume else "w"  # a resumed run continues its record
            path = make_parent_dirs(config.metrics_path)
            self._file = open(path, mode)  # noqa: SIM115 - closed by close()

    def record(
        self,
        step: int,
        rows: Sequence[Sequence[float]],
        step_ms: float,
        *,
        target_tokens: int | None = None,
        eval_loss: float | None = None,
        **fields: Any,
    ) -> None:
        """Rank 0: one step, from the rows of its collective (see :func:`step_metrics`) and
        the :class:`StepMetrics` ``fields`` rank 0 knows itself (``lr``, ``grad_norm``)."""
        if not self.active:
            return
        sm = step_metrics(
            self.plan,
            step,
            rows,
            step_ms,
            self.memory_kind,
            self.predicted_step_ms,
            self.resident_kind,
            target_tokens=target_tokens,
            eval_loss=eval_loss,
            **fields,
        )
        self.metrics.append(sm)
        if self.echo or logger.isEnabledFor(logging.INFO):  # the line only for a reader
            line = sm.line()
            logger.info(line)
            if self.echo:
                print(line, flush=True)
        if self._file is not None:
            self._file.write(json.dumps(sm.to_dict()) + "\n")
            self._file.flush()
        for callback in self.callbacks:
            callback(sm)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

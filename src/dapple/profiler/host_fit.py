"""Whether profiling a model fits host memory, judged before any of its layers is built for real.

Each layer factory runs under ``torch.device("meta")``: its parameters and buffers get shapes
and dtypes but no storage, so a model of any size is sized in milliseconds. Profiling holds one
layer at a time (:func:`dapple.profiler.measure.profile_workload` builds it on the host, then
moves it to the device), with the gradients of its trainable parameters; each of N - 1
co-workers (``--co-workers N``) holds the whole chain with its gradients. The sum is a lower
bound of the need (activations, batches and the framework come on top), so a refusal is never
wrong: :func:`check_host_memory` refuses when it exceeds the memory the kernel reports
available. :func:`check_local_processes` bounds the number of processes a command starts on this
host the same way, by what each process holds at the least, whatever the model.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from dapple.errors import ValidationError
from dapple.models.workload import Workload

__all__ = [
    "LayerBytes",
    "available_host_bytes",
    "check_batch_memory",
    "check_device_available",
    "check_host_memory",
    "check_local_processes",
    "check_training_memory",
    "meta_layer_bytes",
]

log = logging.getLogger(__name__)

SPAWNED_PROCESS_BYTES = 128 * 2**20
"""A lower bound of the private memory of a spawned local process (Python with torch imported,
before any model: 143 MiB of private anonymous pages measured with CPU torch 2.x on Linux)."""
FORKED_PROCESS_BYTES = 32 * 2**20
"""A lower bound of the private memory of a process forked from one that imported torch (a
profiling co-worker), once its collector has run over the inherited objects (61 MiB measured)."""


@dataclass(frozen=True, slots=True)
class LayerBytes:
    """One layer's storage, from its build on ``meta``."""

    name: str
    parameter_bytes: int
    trainable_bytes: int
    """Of ``parameter_bytes``, the parameters that get a gradient of their size."""
    buffer_bytes: int

    @property
    def training_bytes(self) -> int:
        """Parameters, their gradients and buffers: the layer held for a backward pass."""
        return self.parameter_bytes + self.trainable_bytes + self.buffer_bytes


def meta_layer_bytes(workload: Workload) -> list[LayerBytes] | None:
    """Each layer of ``workload`` built on ``meta`` and sized; None when a factory cannot run
    there (it makes real tensors itself, or calls what ``meta`` lacks): no estimate."""
    from dapple.models.split import piece_template

    out = []
    for i, factory in enumerate(workload.layer_factories):
        layer = piece_template(workload, i)  # a traced model's piece: on meta already
        if layer is None:
            try:
                with torch.random.fork_rng(devices=[]), torch.device("meta"):
                    layer = factory()
            except Exception as e:  # any failure only means no estimate: the run reports its own
                log.debug("layer %d does not build on meta (%s): no host memory estimate", i, e)
                return None
        params = list(layer.parameters())
        if not isinstance(layer, torch.nn.Module) or any(not p.is_meta for p in params):
            return None  # a factory that made real tensors itself: nothing to add
        out.append(
            LayerBytes(
                name=workload.name_of(i),
                parameter_bytes=sum(_nbytes(p) for p in params),
                trainable_bytes=sum(_nbytes(p) for p in params if p.requires_grad),
                buffer_bytes=sum(_nbytes(b) for b in layer.buffers()),
            )
        )
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def available_host_bytes() -> int | None:
    """Memory the kernel can give without swapping: ``MemAvailable`` of ``/proc/meminfo``
    (Linux), else the free physical pages (``os.sysconf``); None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB ({n:,} bytes)"


def _short_of(need: int, available: int | None) -> int | None:
    """The bytes available (``available``, None: :func:`available_host_bytes`) when ``need``
    exceeds them; None when it fits or nothing is known."""
    avail = available_host_bytes() if available is None else available
    return avail if avail is not None and need > avail else None


def check_host_memory(
    workload: Workload, co_workers: int = 1, available: int | None = None, what: str = "profiling"
) -> int | None:
    """Refuse ``workload`` when holding its largest layer with gradients, plus the whole chain
    with gradients in each of ``co_workers - 1`` co-workers, exceeds the host memory available.

    Args:
        workload: the layer chain (nothing of it is built for real here).
        co_workers: processes holding the model (the profiling one and N - 1 training ones).
        available: bytes available (None: :func:`available_host_bytes`).
        what: the work named in the message.

    Returns:
        The estimated bytes, or None when they cannot be estimated (nothing checked).

    Raises:
        ValidationError: the estimate exceeds the memory available, naming both.
    """
    sizes = meta_layer_bytes(workload)
    if not sizes:
        return None
    largest = max(sizes, key=lambda x: x.training_bytes)
    whole = sum(x.training_bytes for x in sizes)
    need = largest.training_bytes + (co_workers - 1) * whole
    avail = _short_of(need, available)
    if avail is None:
        return need
    workers = (
        f" and {co_workers - 1} co-worker(s) holding all {whole:,} bytes" if co_workers > 1 else ""
    )
    raise ValidationError(
        f"{what} {workload.name!r} needs at least {_gib(need)} of host memory (layer "
        f"{largest.name!r}: {largest.parameter_bytes:,} bytes of parameters, their gradients "
        f"and buffers{workers}), more than the {_gib(avail)} available: give a smaller model"
    )


def check_batch_memory(
    workload: Workload, batch_size: int, what: str, available: int | None = None
) -> int:
    """Refuse a batch of ``batch_size`` samples whose inputs and targets alone exceed the host
    memory available, before it is made: one sample's tensors (``make_batch(1)``) times
    ``batch_size``. A lower bound of what measuring at that size holds (the layers' activations
    come on top), so a batch refused here could never be measured; one that passes may still
    fail later.

    Args:
        workload: the model whose batches are made.
        batch_size: samples of the largest batch asked for.
        what: the option that asks for it, named in the message.
        available: bytes available (None: :func:`available_host_bytes`).

    Returns:
        The batch's estimated bytes.

    Raises:
        ValidationError: they exceed the memory available, naming both.
    """
    from dapple.profiler.layer_measure import tensor_bytes

    need = batch_size * tensor_bytes(workload.make_batch(1, 0))
    avail = _short_of(need, available)
    if avail is not None:
        raise ValidationError(
            f"{what}: a batch of {batch_size:,} samples of {workload.name!r} needs at least "
            f"{_gib(need)} of host memory for its inputs and targets alone, more than the "
            f"{_gib(avail)} available: give smaller batch sizes"
        )
    return need


def check_local_processes(
    n: int, what: str, *, forked: bool = False, available: int | None = None
) -> None:
    """Refuse starting ``n`` processes on this host when their least memory each
    (:data:`SPAWNED_PROCESS_BYTES`, :data:`FORKED_PROCESS_BYTES` when ``forked``) exceeds the
    host memory available: the bound holds whatever the model, so a refusal is never wrong.

    Args:
        n: processes to start.
        what: the option that asks for them, named in the message (``--nproc 100000``).
        forked: the processes are forked from this one (they share its pages until written).
        available: bytes available (None: :func:`available_host_bytes`).

    Raises:
        ValidationError: the processes cannot fit, naming the count and both sizes.
    """
    each = FORKED_PROCESS_BYTES if forked else SPAWNED_PROCESS_BYTES
    need = n * each
    avail = _short_of(need, available)
    if avail is None:
        return
    raise ValidationError(
        f"{what}: {n:,} local processes need at least {_gib(need)} of host memory "
        f"({each // 2**20} MiB each before any model), more than the {_gib(avail)} available: "
        f"at most {avail // each:,} fit"
    )


def check_device_available(device: str, what: str = "--device") -> None:
    """Refuse a run on ``device`` (``cuda`` or ``cuda:N``) where torch sees no CUDA device,
    before any process starts (each worker would otherwise find it out on its own, after its
    imports). ``auto`` and ``cpu`` always pass.

    Args:
        device: the device the run asks for.
        what: the option that asks for it, named in the message.

    Raises:
        ValidationError: CUDA asked for and not available, naming why.
    """
    if not device.startswith("cuda") or torch.cuda.is_available():
        return
    why = (
        f"this torch {torch.__version__} is built without CUDA"
        if torch.version.cuda is None
        else "torch sees no CUDA device"
    )
    raise ValidationError(
        f"{what} {device}: CUDA is not available on this host ({why}): use --device cpu, or "
        "auto (CUDA when available)"
    )


def check_training_memory(
    workload: Workload,
    state_factor: float,
    available: int | None = None,
    what: str = "training",
) -> int | None:
    """Refuse a run whose processes all live on this host when the model, held once with its
    gradients and optimizer state, exceeds the host memory available.

    Every parameter and buffer is held by at least one process of the run, with its gradient
    and optimizer state when trainable (sharding over replicas divides copies, never below one),
    so this sum is a lower bound of what the run needs: a refusal is never wrong.

    Args:
        workload: the layer chain (nothing of it is built for real here).
        state_factor: bytes of gradient and optimizer state per trainable parameter byte
            (:func:`dapple.runtime.train_config.state_factor`).
        available: bytes available (None: :func:`available_host_bytes`).
        what: the work named in the message.

    Returns:
        The estimated bytes, or None when they cannot be estimated (nothing checked).

    Raises:
        ValidationError: the estimate exceeds the memory available, naming both.
    """
    sizes = meta_layer_bytes(workload)
    if not sizes:
        return None
    params = sum(x.parameter_bytes + x.buffer_bytes for x in sizes)
    state = int(state_factor * sum(x.trainable_bytes for x in sizes))
    need = params + state
    avail = _short_of(need, available)
    if avail is None:
        return need
    if state == 0:  # the model alone (inference: no gradients, no optimizer)
        raise ValidationError(
            f"{what} {workload.name!r} needs at least {_gib(need)} of host memory (its "
            f"{params:,} bytes of parameters and buffers), more than the {_gib(avail)} "
            "available: give a smaller model"
        )
    raise ValidationError(
        f"{what} {workload.name!r} needs at least {_gib(need)} of host memory (its "
        f"{params:,} bytes of parameters and buffers, held once by the run's processes, and "
        f"{state:,} bytes of gradients and optimizer state), more than the {_gib(avail)} "
        "available: give a smaller model, or run it over several hosts (torchrun)"
    )

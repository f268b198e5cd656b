"""Torch measurements of one layer: forward and backward times, kept and output bytes.

A layer runs on a given input (a previous layer's real output): forward and backward are timed
(warm-up, then the median of the repeats; CUDA events with synchronisation on GPUs), optionally
the backward's two halves as the runtime's zero-bubble schedules split it, the output's bytes
are counted, and the tensors autograd saves for backward are captured with
:func:`torch.autograd.graph.saved_tensors_hooks` (storages deduplicated, parameters excluded).
The optimizer update of a layer's parameters is timed on a bounded sample of them.

Precision: the forwards run under the given autocast (:func:`autocast_for`), as the runtime's
stages do (:mod:`dapple.runtime.precision`). Autocast's cast copies of the weights are not
activations (the planner adds them as the weight cast cache, :mod:`dapple.planner.memory`) and
are left out of the kept bytes, like the parameters themselves.
:mod:`dapple.profiler.measure` runs this over a whole model and fits the profile.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from dapple.core.precision import ComputePrecision
from dapple.models.split_backward import input_gradients, weight_gradients
from dapple.profiler.co_workers import Cast

__all__ = [
    "Timer",
    "as_leaf",
    "autocast_for",
    "cast_parameter_bytes",
    "map_tensors",
    "measure_layer",
    "optimizer_update_ms",
    "tensor_bytes",
    "trainable_params",
]


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x`` with ``fn`` applied to every tensor in it (nested tuples and lists kept)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(map_tensors(item, fn) for item in x)
    return x


def as_leaf(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, requiring grad when it is floating point: a layer's input."""
    t = t.detach()
    return t.requires_grad_(True) if t.is_floating_point() else t


def tensor_bytes(x: Any) -> int:
    """Bytes of the tensors in ``x`` (nested tuples and lists)."""
    return sum(t.numel() * t.element_size() for t in _tensors(x))


class Timer:
    """Times a call in ms: CUDA events on a GPU, else wall time or the calling thread's CPU time.

    CPU time is the calling thread's (``time.thread_time``), not the process's
    (``time.process_time``): with t intra-op threads the process's CPU time sums all t threads,
    spinning ones included, and reads about t times the time the call takes on its cores.
    The calling thread takes part in every parallel region and waits for the others at its end,
    so its CPU time is the call's time while it was scheduled: wall time without the waits of
    time-slicing, which the cost model adds back (``Cluster.compute_cores_per_server``).
    """

    def __init__(self, dev: torch.device, cpu_time: bool = False) -> None:
        self.cuda = dev.type == "cuda"
        self.clock = time.thread_time if cpu_time else time.perf_counter

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Run ``fn`` and return (elapsed ms, its result)."""
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return float(start.elapsed_time(end)), out
        t0 = self.clock()
        out = fn()
        return (self.clock() - t0) * 1e3, out


_AUTOCAST_DTYPES = {
    p.value: getattr(torch, p.dtype_name) for p in ComputePrecision if p.trains and p.autocast
}
"""Autocast dtype of each low precision a profile is measured in, by name (as
:data:`dapple.runtime.precision.AUTOCAST_DTYPES`)."""


def autocast_for(precision: str, dev: torch.device) -> Cast:
    """The autocast context of ``precision`` on ``dev`` (a no-op context for fp32)."""
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext
    return partial(torch.autocast, dev.type, dtype=dtype)


def _cast_of(fn: Any) -> int | None:
    """The id of the tensor autograd node ``fn`` copies when it is a cast of a leaf (autocast's
    copy of a parameter: ``ToCopyBackward`` fed by its ``AccumulateGrad``), else None."""
    if fn is None or not fn.name().startswith("ToCopyBackward") or not fn.next_functions:
        return None
    src = fn.next_functions[0][0]
    leaf = getattr(src, "variable", None) if src is not None else None
    return None if leaf is None else id(leaf)


def _is_weight_cast(t: torch.Tensor, params: set[int]) -> bool:
    """``t`` is autocast's cast copy of one of the parameters (ids in ``params``)."""
    return _cast_of(t.grad_fn) in params


def cast_parameter_bytes(out: Any, layer: nn.Module) -> int:
    """Bytes of ``layer``'s parameters that autocast cast to 16 bits in the forward that
    made ``out`` (``LayerProfile.cast_parameter_bytes``): those reached from the output's
    autograd graph through a ``ToCopyBackward`` node (a linear's weight, not an embedding table
    that is looked up, nor a norm's weight that runs in fp32). Each counts once, whatever the
    number of uses: autocast caches its copy."""
    params = {id(p): p for p in layer.parameters()}
    cast: dict[int, int] = {}
    seen: set[Any] = set()
    stack = [t.grad_fn for t in _tensors(out) if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        leaf = _cast_of(fn)
        if leaf in params:
            cast[leaf] = params[leaf].numel() * params[leaf].element_size()
        stack.extend(n for n, _ in fn.next_functions if n is not None)
    return sum(cast.values())


def _saved_bytes(
    layer: nn.Module, inp: Any, cast: Cast = contextlib.nullcontext
) -> tuple[int, Any]:
    """Bytes autograd saves for backward in one forward of ``layer`` (and the output);
    parameters and their autocast copies are not counted."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    param_ids = {id(p) for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in param_ptrs and ptr != 0 and not _is_weight_cast(t, param_ids):
            seen[ptr] = storage.nbytes()
        return t.detach()  # the tensor itself would cycle through its grad_fn and leak the layer

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast():
        out = layer(inp)
    return sum(seen.values()), out


def _backward(out: Any, grads: list[torch.Tensor]) -> None:
    outs = [t for t in _tensors(out) if t.requires_grad]
    if outs:
        torch.autograd.backward(outs, grads[: len(outs)])


def _split_ms(
    layer: nn.Module, out: Any, inputs: list[torch.Tensor], grads: list[torch.Tensor], timer: Timer
) -> tuple[float, float]:
    """``(I, W)`` ms of one backward of ``out`` split as the runtime splits it
    (:mod:`dapple.models.split_backward`: torch.distributed.pipelining's halves, whose graph
    walks and captured gradients cost beyond a whole backward). A layer whose inputs carry no
    gradient runs its whole backward as ``W``, as the runtime's first stage does."""
    outs = [t.clone() for t in _tensors(out) if t.requires_grad]  # the runtime's outputs
    weights = [p for p in layer.parameters() if p.requires_grad]
    g = grads[: len(outs)]
    if not inputs:
        return 0.0, timer(partial(torch.autograd.backward, outs, g))[0]
    ms_i, groups = timer(partial(input_gradients, outs, g, inputs, weights))
    ms_w, _ = timer(partial(weight_gradients, groups, weights))
    return ms_i, ms_w


_UPDATE_SAMPLE_BYTES = 8 << 20
"""At most this many bytes of a layer's parameters are updated when timing the optimizer:
the update's time is proportional to the bytes, so a larger layer is timed on a prefix of its
parameters and scaled, and timing it costs at most 4x this much memory (weights, gradients and
two moments), not 4x the largest layer."""


def trainable_params(layer: nn.Module) -> list[torch.Tensor]:
    """``layer``'s parameters the optimizer updates, as meta tensors (shapes and dtypes)."""
    return [
        p.detach().to("meta")
        for p in layer.parameters()
        if p.requires_grad and p.is_floating_point()
    ]


def optimizer_update_ms(
    params: Sequence[torch.Tensor], dev: torch.device, timer: Timer, warmup: int, repeats: int
) -> float:
    """Median time of one optimizer update of parameters shaped like ``params`` as the runtime
    makes it (fused Adam), after at least one step that allocates the moments. It runs on
    zero-filled tensors on ``dev``, up to :data:`_UPDATE_SAMPLE_BYTES` of them (the last one cut
    flat), scaled to all of the parameters' bytes."""
    total = sum(p.numel() * p.element_size() for p in params)
    if not total:
        return 0.0
    sample: list[torch.Tensor] = []
    sampled = 0
    for p in params:
        room = (_UPDATE_SAMPLE_BYTES - sampled) // p.element_size()
        if room <= 0:
            break
        shape = p.shape if p.numel() <= room else (room,)
        sample.append(nn.Parameter(torch.zeros(shape, dtype=p.dtype, device=dev)))
        sampled += sample[-1].numel() * p.element_size()
    for t in sample:
        t.grad = torch.zeros_like(t)
    opt = torch.optim.Adam(sample, lr=1e-3, fused=True)
    for _ in range(max(1, warmup)):
        opt.step()
    times = [timer(opt.step)[0] for _ in range(repeats)]
    return statistics.median(times) * total / sampled


def measure_layer(
    layer: nn.Module,
    inp: Any,
    timer: Timer,
    warmup: int,
    repeats: int,
    cast: Cast = contextlib.nullcontext,
    split_backward: bool = False,
) -> tuple[float, float, float, float, int, int, Any]:
    """Median forward, backward, input-gradient and weight-gradient ms (the last two 0 unless
    ``split_backward``), kept bytes, output bytes and the output of one layer (forwards under
    ``cast``)."""
    kept, out = _saved_bytes(layer, inp, cast)
    grads = [torch.randn_like(t) for t in _tensors(out) if t.requires_grad]
    inputs = [t for t in _tensors(inp) if t.requires_grad]
    fwd: list[float] = []
    bwd: list[float] = []
    bwd_in: list[float] = []
    bwd_w: list[float] = []

    def forward() -> Any:
        with cast():
            return layer(inp)

    for r in range(warmup + repeats):
        ms, o = timer(forward)
        if r >= warmup:
            fwd.append(ms)
        if grads:
            ms_b, _ = timer(partial(_backward, o, grads))
            if r >= warmup:
                bwd.append(ms_b)
        if grads and split_backward:
            ms_i, ms_w = _split_ms(layer, forward(), inputs, grads, timer)
            if r >= warmup:
                bwd_in.append(ms_i)
                bwd_w.append(ms_w)
    layer.zero_grad(set_to_none=True)
    out = map_tensors(out, as_leaf)
    bwd_ms = statistics.median(bwd) if bwd else 0.0
    in_ms = statistics.median(bwd_in) if bwd_in else 0.0
    w_ms = statistics.median(bwd_w) if bwd_w else 0.0
    return statistics.median(fwd), bwd_ms, in_ms, w_ms, kept, tensor_bytes(out), out

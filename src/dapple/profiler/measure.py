"""Torch profiler (paper section 3.3): per-layer times, activation and parameter sizes.

Each layer of a :class:`Workload` is run on the *real* output of the previous layer, at each
requested batch size ``b``: forward and backward are timed (warm-up, then the median of the
repeats; CUDA events with synchronisation on GPUs), the output's bytes are counted, and the
tensors autograd saves for backward are captured with
:func:`torch.autograd.graph.saved_tensors_hooks` (storages deduplicated, parameters excluded).
Times and sizes are then fitted affine in ``b`` with :func:`dapple.core.profile.fit_affine`.
With ``seq_lens`` this is done at each length of the model's dynamic dimension, on its own
batches cut or tiled to that length (:mod:`dapple.profiler.lengths`), and the profile holds
every length (``ModelProfile.by_length``). A layer the runtime can cut over a tensor group -
a traced piece that the model's TP plan matches (:func:`dapple.models.tp_plan.cut_by`) - is
marked ``LayerProfile.tensor_parallel``; a model without a TP plan, or with tied parameters
(which the runtime does not cut yet), marks none.

Precision: with ``precision="bf16"``/``"fp16"`` every forward (timed, and the one whose saved
tensors are counted) runs under ``torch.autocast`` as the runtime's stages do
(:mod:`dapple.runtime.precision`), each layer on the previous layer's autocast output, so times,
output bytes and kept bytes are those of the run. Autocast's cast copies of the weights are
not activations (the planner adds them as the weight cast cache, :mod:`dapple.planner.memory`)
and are left out of the kept bytes, like the parameters themselves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from dapple.core.profile import (
    PROFILE_PRECISIONS,
    AffineTime,
    LayerProfile,
    ModelProfile,
    fit_affine,
)
from dapple.errors import ValidationError
from dapple.models.split_backward import input_gradients, weight_gradients
from dapple.models.tp_plan import cut_by, tp_plan_of
from dapple.models.workload import Workload
from dapple.profiler.co_workers import Cast, CoWorkers
from dapple.profiler.lengths import (
    check_seq_lens,
    combine_lengths,
    length_passes,
    workload_at_length,
)

__all__ = ["ProgressFn", "profile_workload", "resolve_device", "tied_layer_bytes"]

log = logging.getLogger(__name__)

ProgressFn = Callable[[int, int, str], None]
"""``progress(done, total, description)``, called after each (batch size, layer) step."""


def resolve_device(device: str) -> torch.device:
    """Parse ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:1``), checking that it exists.

    ``auto`` is ``cuda`` when CUDA is available, else ``cpu``.

    Raises:
        ValidationError: unknown device string or CUDA requested but unavailable.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValidationError(f"unknown device {device!r}: use auto, cpu or cuda[:N]") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValidationError(f"device {device!r} requested but CUDA is not available here")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValidationError(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) present"
            )
    elif dev.type != "cpu":
        raise ValidationError(f"unsupported device {device!r}: use auto, cpu or cuda[:N]")
    return dev


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    return []


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map(item, fn) for item in x)
    return x


def _leaf(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.requires_grad_(True) if t.is_floating_point() else t


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(x))


class _Timer:
    def __init__(self, dev: torch.device, cpu_time: bool = False) -> None:
        self.cuda = dev.type == "cuda"
        self.clock = time.process_time if cpu_time else time.perf_counter

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


_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""Autocast dtype of each low precision (as :data:`dapple.runtime.precision.AUTOCAST_DTYPES`)."""


def _autocast(precision: str, dev: torch.device) -> Cast:
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        return contextlib.nullcontext
    return partial(torch.autocast, dev.type, dtype=dtype)


def _check_precision(precision: str, dev: torch.device) -> None:
    if precision not in PROFILE_PRECISIONS:
        raise ValidationError(
            f"precision must be one of {', '.join(PROFILE_PRECISIONS)}, got {precision!r}"
        )
    if precision == "fp16" and dev.type == "cpu":
        raise ValidationError(
            "precision fp16: fp16 autocast on CPU is not supported for training "
            "(profile bf16 on the CPU, or fp32)"
        )


def _is_weight_cast(t: torch.Tensor, params: set[int]) -> bool:
    """``t`` is autocast's cast copy of one of the parameters (ids in ``params``)."""
    fn = t.grad_fn
    if fn is None or not fn.name().startswith("ToCopyBackward"):
        return False
    src = fn.next_functions[0][0] if fn.next_functions else None
    return src is not None and id(getattr(src, "variable", None)) in params


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
    layer: nn.Module, out: Any, inputs: list[torch.Tensor], grads: list[torch.Tensor], timer: _Timer
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


def _trainable(layer: nn.Module) -> list[torch.Tensor]:
    """``layer``'s parameters the optimizer updates, as meta tensors (shapes and dtypes)."""
    return [
        p.detach().to("meta")
        for p in layer.parameters()
        if p.requires_grad and p.is_floating_point()
    ]


def _update_ms(
    params: Sequence[torch.Tensor], dev: torch.device, timer: _Timer, warmup: int, repeats: int
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


def _measure_layer(
    layer: nn.Module,
    inp: Any,
    timer: _Timer,
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
    out = _map(out, _leaf)
    bwd_ms = statistics.median(bwd) if bwd else 0.0
    in_ms = statistics.median(bwd_in) if bwd_in else 0.0
    w_ms = statistics.median(bwd_w) if bwd_w else 0.0
    return statistics.median(fwd), bwd_ms, in_ms, w_ms, kept, _nbytes(out), out


def _slope(batch_sizes: Sequence[int], values: Sequence[float]) -> float:
    """Per-sample part of a size measured at several batch sizes (affine fit)."""
    return fit_affine(list(batch_sizes), list(values)).per_sample_ms


def profile_workload(
    workload: Workload,
    batch_sizes: Sequence[int],
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    progress: ProgressFn | None = None,
    seed: int = 0,
    num_threads: int | None = None,
    co_workers: int = 1,
    precision: str = "fp32",
    split_backward: bool = False,
    seq_lens: Sequence[int] | None = None,
) -> ModelProfile:
    """Measure every layer of ``workload`` at each batch size and fit the profile.

    Args:
        workload: the layer chain to profile.
        batch_sizes: batch sizes of one forward/backward call (positive, at least one).
        device: ``cpu``, ``cuda[:N]`` or ``auto`` (``cuda`` when available, else ``cpu``).
        warmup: untimed runs before the timed ones.
        repeats: timed runs; the median is kept.
        progress: optional callback ``(done, total, description)``.
        seed: seed of the weights and the synthetic batches.
        num_threads: torch intra-op threads while profiling on CPU (``None``: unchanged).
            One thread gives stable timings on a shared machine and matches one CPU process
            per pipeline device.
        co_workers: CPU only. With N > 1 the profile is taken the way N local runtime
            workers will run: N - 1 forked processes train the same model (forward + backward
            of the whole chain, same threads) in a loop meanwhile, and every time is the
            *CPU time* of this process (``time.process_time``), not wall time. Co-located
            workers slow each other beyond time-slicing (caches, memory bandwidth), most at
            small batches; that inflation is in these times, and the time-slicing itself is
            the cluster's ``compute_cores_per_server`` (processor sharing in the simulator).
            The profile's ``device`` then reads ``cpu (CPU time, N co-workers)``.
        precision: ``fp32``, or ``bf16``/``fp16``: every forward under that autocast, as
            ``dapple train --precision`` runs it (fp16 needs CUDA); recorded in the profile.
        split_backward: also time the two halves of each backward as the runtime's ZB-H1 runs
            them (:func:`_split_ms`, after an untimed forward) and record them as
            ``LayerProfile.backward_input`` and ``backward_weight``. Without it zero-bubble
            schedules use the documented assumed split (:meth:`LayerProfile.backward_split`).
        seq_lens: lengths of the model's dynamic dimension (tokens per sample) to measure at,
            each at every batch size: the workload's own batches cut or tiled to the length
            along every dynamic dimension, same layers (:mod:`dapple.profiler.lengths`). The
            profile's ``by_length`` holds them and its ``layers`` are the longest's. None: the
            workload's batches as they come. Co-workers train at the workload's own length.

    Raises:
        ValidationError: bad batch sizes, repeats, device or precision, or CUDA unavailable;
            lengths on a model without a dynamic dimension or outside its range.
    """
    sizes, dev = _check_options(batch_sizes, warmup, repeats, device, precision, num_threads,
                                co_workers)  # fmt: skip
    lens = sorted(set(seq_lens)) if seq_lens is not None else None
    dims = check_seq_lens(workload, lens, sizes[0], seed) if lens is not None else {}
    shared = co_workers > 1 and dev.type == "cpu"
    old_threads = torch.get_num_threads()
    if num_threads is not None and dev.type == "cpu":
        torch.set_num_threads(num_threads)
    cast = _autocast(precision, dev)
    load = (
        CoWorkers(workload, co_workers - 1, sizes[len(sizes) // 2], seed, cast) if shared else None
    )
    try:
        run = partial(_profile, sizes=sizes, dev=dev, warmup=warmup, repeats=repeats, seed=seed,
                      cpu_time=shared, precision=precision, split_backward=split_backward)  # fmt: skip
        if lens is None:
            prof = run(workload, progress=progress)
        else:
            prof = combine_lengths(
                [
                    (L, run(workload_at_length(workload, dims, L), progress=step))
                    for L, step in length_passes(progress, lens)
                ]
            )
    finally:
        torch.set_num_threads(old_threads)
        if load is not None:
            load.stop()
    if shared:
        prof = dataclasses.replace(prof, device=f"cpu (CPU time, {co_workers} co-workers)")
    return prof


def _check_options(
    batch_sizes: Sequence[int],
    warmup: int,
    repeats: int,
    device: str,
    precision: str,
    num_threads: int | None,
    co_workers: int,
) -> tuple[list[int], torch.device]:
    """:func:`profile_workload`'s options checked, in this order: the distinct batch sizes,
    sorted, and the device.

    Raises:
        ValidationError: batch sizes that are not positive integers, ``repeats < 1`` or
            ``warmup < 0``, a bad device or precision (or CUDA unavailable), ``num_threads <
            1`` or ``co_workers`` not an integer >= 1.
    """
    sizes = sorted(set(batch_sizes))
    if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
        raise ValidationError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
    if repeats < 1 or warmup < 0:
        raise ValidationError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    dev = resolve_device(device)
    _check_precision(precision, dev)
    if num_threads is not None and num_threads < 1:
        raise ValidationError(f"num_threads must be >= 1, got {num_threads}")
    if not isinstance(co_workers, int) or co_workers < 1:
        raise ValidationError(f"co_workers must be an integer >= 1, got {co_workers!r}")
    return sizes, dev


def _profile(
    workload: Workload,
    sizes: list[int],
    dev: torch.device,
    warmup: int,
    repeats: int,
    progress: ProgressFn | None,
    seed: int,
    cpu_time: bool = False,
    precision: str = "fp32",
    split_backward: bool = False,
) -> ModelProfile:
    timer = _Timer(dev, cpu_time)
    cast = _autocast(precision, dev)
    n = workload.num_layers
    fwd = [[0.0] * len(sizes) for _ in range(n)]
    bwd = [[0.0] * len(sizes) for _ in range(n)]
    bwd_in = [[0.0] * len(sizes) for _ in range(n)]
    bwd_w = [[0.0] * len(sizes) for _ in range(n)]
    kept = [[0.0] * len(sizes) for _ in range(n)]
    out_b = [[0.0] * len(sizes) for _ in range(n)]
    xs = [_map(workload.make_batch(b, seed)[0], lambda t: _leaf(t.to(dev))) for b in sizes]
    input_bytes = [float(_nbytes(x)) for x in xs]
    param_bytes: list[int] = []
    tied: list[tuple[int, tuple[int, ...]]] = []
    param_dtypes: set[torch.dtype] = set()
    classes: list[str] = []
    # the runtime cuts no layer of a model with tied parameters (runtime/stage_mesh.py)
    tp_plan = {} if workload.tied_parameters else tp_plan_of(workload)
    shards = [False] * n
    total, done = n * len(sizes), 0
    update_ms = 0.0  # one optimizer update of every layer's parameters
    for i in range(n):  # one layer at a time: the peak is the largest layer, not the model
        layer = workload.build_layer(i, seed).to(dev).train()
        for k, b in enumerate(sizes):
            f_ms, b_ms, i_ms, w_ms, kept_bytes, nbytes, xs[k] = _measure_layer(
                layer, xs[k], timer, warmup, repeats, cast, split_backward
            )
            fwd[i][k], bwd[i][k], kept[i][k], out_b[i][k] = f_ms, b_ms, kept_bytes, nbytes
            bwd_in[i][k], bwd_w[i][k] = i_ms, w_ms
            done += 1
            log.debug("b=%d layer %d: fwd %.3f ms bwd %.3f ms", b, i, f_ms, b_ms)
            if progress is not None:
                progress(done, total, f"b={b} {workload.name_of(i)}")
        trainable = _trainable(layer)
        param_bytes.append(sum(p.numel() * p.element_size() for p in layer.parameters()))
        tied.append(tied_layer_bytes(workload, i, layer))
        param_dtypes |= {p.dtype for p in layer.parameters()}
        classes.append(type(layer).__name__)
        shards[i] = _shards(layer, tp_plan, workload.name_of(i))
        del layer
        gc.collect()  # traced pieces hold reference cycles: free this layer before the next
        update_ms += _update_ms(trainable, dev, timer, warmup, repeats)
    del xs
    dtype = (
        str(next(iter(param_dtypes))).replace("torch.", "") if len(param_dtypes) == 1 else "mixed"
    )
    profiles = tuple(
        LayerProfile(
            name=workload.name_of(i) if workload.layer_names else f"{i}.{classes[i]}",
            forward=_positive(fit_affine(sizes, fwd[i])),
            backward=fit_affine(sizes, bwd[i]),
            output_bytes_per_sample=_slope(sizes, out_b[i]),
            parameter_bytes=param_bytes[i],
            kept_activation_bytes_per_sample=_slope(sizes, kept[i]),
            backward_input=fit_affine(sizes, bwd_in[i]) if split_backward else None,
            backward_weight=fit_affine(sizes, bwd_w[i]) if split_backward else None,
            tied_parameter_bytes=tied[i][0],
            tied_layers=tied[i][1],
            tensor_parallel=shards[i],
        )
        for i in range(n)
    )
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return ModelProfile(
        model_name=workload.name,
        layers=profiles,
        input_bytes_per_sample=_slope(sizes, input_bytes),
        dtype=dtype,
        device=dev_name,
        batch_sizes=tuple(sizes),
        precision=precision,
        update_ms_per_parameter_byte=update_ms / sum(param_bytes) if sum(param_bytes) else 0.0,
    )


def _shards(layer: nn.Module, tp_plan: dict[str, str], name: str) -> bool:
    """Whether the runtime cuts ``layer`` over a tensor group (:func:`cut_by`); a layer the plan
    gives a style the runtime does not implement (a mixture of experts') is not cut."""
    try:
        return cut_by(layer, tp_plan)
    except ValidationError as e:
        log.warning("layer %s is not marked tensor parallel: %s", name, e)
        return False


def tied_layer_bytes(workload: Workload, i: int, layer: nn.Module) -> tuple[int, tuple[int, ...]]:
    """Bytes of layer ``i``'s copies of tied parameters (``workload.tied_parameters``) and the
    other layers holding copies of them."""
    groups = [g for g in workload.tied_parameters if any(int(k) == i for k, _ in g)]
    names = {str(name) for g in groups for k, name in g if int(k) == i}
    mine = {layer.get_parameter(name) for name in names}  # tensors hash by identity
    others = sorted({int(k) for g in groups for k, _ in g if int(k) != i})
    return sum(p.numel() * p.element_size() for p in mine), tuple(others)


def _positive(t: AffineTime) -> AffineTime:
    """Guard against a zero fit (timer resolution): at least 1 ns per sample."""
    if t.fixed_ms + t.per_sample_ms > 0:
        return t
    return AffineTime(fixed_ms=0.0, per_sample_ms=1e-6)

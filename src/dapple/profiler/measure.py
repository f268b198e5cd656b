"""Torch profiler (paper section 3.3): per-layer times, activation and parameter sizes.

Each layer of a :class:`Workload` is built alone and run on the *real* output of the previous
layer, at each requested batch size ``b``, by :func:`dapple.profiler.layer_measure.measure_layer`
(timed forward and backward, output bytes, the bytes autograd keeps for backward). Times and
sizes are then fitted affine in ``b`` with :func:`dapple.core.layer_profile.fit_affine`.
With ``seq_lens`` this is done at each length of the model's dynamic dimension, on its own
batches cut or tiled to that length (:mod:`dapple.profiler.length_passes`), and the profile holds
every length (``ModelProfile.by_length``). A layer the runtime can cut over a tensor group -
a traced piece that the model's TP plan matches (:func:`dapple.models.tp_plan.cut_by`) - is
marked ``LayerProfile.tensor_parallel``; a model without a TP plan marks none.

Precision: with ``precision="bf16"``/``"fp16"`` every forward (timed, and the one whose saved
tensors are counted) runs under ``torch.autocast`` as the runtime's stages do, each layer on
the previous layer's autocast output, so times, output bytes and kept bytes are those of the
run.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from dapple.core.layer_profile import AffineTime, LayerProfile, fit_affine
from dapple.core.precision import TRAINING_PRECISIONS, precision_of
from dapple.core.profile import ModelProfile
from dapple.core.tensor_layout import TENSOR_WIDTHS
from dapple.errors import ValidationError, positive_integers
from dapple.models.fingerprint import model_fingerprint
from dapple.models.shapes import DimsMap
from dapple.models.tp_plan import cut_by, hf_tensor_widths, tp_plan_of
from dapple.models.workload import Workload
from dapple.profiler.co_workers import CoWorkers
from dapple.profiler.layer_measure import (
    Timer,
    as_leaf,
    autocast_for,
    cast_parameter_bytes,
    map_tensors,
    measure_layer,
    optimizer_update_ms,
    tensor_bytes,
    trainable_params,
)
from dapple.profiler.length_passes import (
    check_seq_lens,
    combine_lengths,
    length_passes,
    workload_at_length,
)

__all__ = [
    "ProgressFn",
    "bucketed_parameter_sizes",
    "profile_workload",
    "resolve_device",
    "tied_layer_bytes",
]

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


def _check_precision(precision: str, dev: torch.device) -> None:
    if precision not in TRAINING_PRECISIONS:
        raise ValidationError(
            f"precision must be one of {', '.join(TRAINING_PRECISIONS)}, got {precision!r}"
        )
    if not precision_of(precision).trains_on_cpu and dev.type == "cpu":
        raise ValidationError(
            f"precision {precision}: {precision} autocast on CPU is not supported for training "
            "(profile bf16 on the CPU, or fp32)"
        )


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
    passes: int = 1,
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
            *CPU time* of the profiling thread (``time.thread_time``: with t intra-op threads
            the process's CPU time would count each call about t times), not wall time. Co-located
            workers slow each other beyond time-slicing (caches, memory bandwidth), most at
            small batches; that inflation is in these times, and the time-slicing itself is
            the cluster's ``compute_cores_per_server`` (processor sharing in the simulator).
            The profile's ``device`` then reads ``cpu (CPU time, N co-workers)`` and its
            ``clock`` ``cpu``.
        precision: ``fp32``, or ``bf16``/``fp16``: every forward under that autocast, as
            ``dapple train --precision`` runs it (fp16 needs CUDA); recorded in the profile.
        split_backward: also time the two halves of each backward as the runtime's ZB-H1 runs
            them (:func:`~dapple.profiler.layer_measure.measure_layer`, after an untimed
            forward) and record them as ``LayerProfile.backward_input`` and
            ``backward_weight``. Without it zero-bubble schedules use the documented assumed
            split (:meth:`LayerProfile.backward_split`).
        seq_lens: lengths of the model's dynamic dimension (tokens per sample) to measure at,
            each at every batch size: the workload's own batches cut or tiled to the length
            along every dynamic dimension, same layers (:mod:`dapple.profiler.length_passes`). The
            profile's ``by_length`` holds them and its ``layers`` are the longest's. None: the
            workload's batches as they come. Co-workers train at the workload's own length.
        passes: with co-workers, profile the whole chain this many times, each pass with its
            co-workers forked afresh, and keep per layer the pass whose forward + backward at
            the middle batch size is the median (:func:`median_layers`). On 2 shared cores
            (zoo transformer of ``benchmarks/fidelity.py``, b = 8 summed over the layers) one
            pass per process read 119-158 ms over 11 processes (this code, 81351c0's and
            this one on ``process_time``), three passes 136.9-141.6 ms over 4 (the passes of
            one process 4-5% apart): a small sample. Ignored without co-workers; only with one
            length (no ``seq_lens``).

    Raises:
        ValidationError: bad batch sizes, repeats, device or precision, or CUDA unavailable;
            lengths on a model without a dynamic dimension or outside its range.
    """
    sizes, dev = _check_options(batch_sizes, warmup, repeats, device, precision, num_threads,
                                co_workers, passes, seq_lens)  # fmt: skip
    lens = sorted(set(seq_lens)) if seq_lens is not None else None
    dims = check_seq_lens(workload, lens, sizes[0], seed) if lens is not None else {}
    shared = co_workers > 1 and dev.type == "cpu"
    old_threads = torch.get_num_threads()
    if num_threads is not None and dev.type == "cpu":
        torch.set_num_threads(num_threads)
    cast = autocast_for(precision, dev)
    mid = sizes[len(sizes) // 2]  # the co-workers' batch and the passes' median key
    run = partial(_profile, sizes=sizes, dev=dev, warmup=warmup, repeats=repeats, seed=seed,
                  cpu_time=shared, precision=precision, split_backward=split_backward)  # fmt: skip
    taken = []
    try:
        for k in range(passes if shared else 1):
            load = CoWorkers(workload, co_workers - 1, mid, seed, cast) if shared else None
            try:
                taken.append(_one_pass(run, workload, lens, dims, progress))
            finally:
                if load is not None:
                    load.stop()
            log.debug("profile pass %d: %.3f ms", k, sum(map(_layer_key(mid), taken[-1].layers)))
    finally:
        torch.set_num_threads(old_threads)
    prof = median_layers(taken, mid)
    if shared:
        prof = dataclasses.replace(
            prof, device=f"cpu (CPU time, {co_workers} co-workers)", clock="cpu"
        )
    return dataclasses.replace(
        prof, model_fingerprint=model_fingerprint(workload), tensor_widths=_tensor_widths(workload)
    )


def _one_pass(
    run: Callable[..., ModelProfile],
    workload: Workload,
    lens: list[int] | None,
    dims: DimsMap,
    progress: ProgressFn | None,
) -> ModelProfile:
    """One pass over the chain with ``run`` (:func:`_profile`): on the workload's own batches,
    or at each length of ``lens`` (its dynamic dimensions ``dims``) combined into one profile."""
    if lens is None:
        return run(workload, progress=progress)
    return combine_lengths([
        (L, run(workload_at_length(workload, dims, L), progress=step))
        for L, step in length_passes(progress, lens)
    ])  # fmt: skip


def _layer_key(b: int) -> Callable[[LayerProfile], float]:
    """A layer's forward + backward ms at batch ``b``: what passes are ranked by."""
    return lambda layer: layer.forward.at(b) + layer.backward.at(b)


def median_layers(passes: Sequence[ModelProfile], b: int) -> ModelProfile:
    """One profile from several passes over the same chain: per layer, the pass whose
    forward + backward at batch ``b`` is the median (the lower middle of an even count),
    whole (its times, split halves and lengths stay together); ``passes[0]`` elsewhere.

    Raises:
        ValidationError: no pass.
    """
    if not passes:
        raise ValidationError("no profile pass to take the median of")
    if len(passes) == 1:
        return passes[0]
    key = _layer_key(b)
    layers = []
    for i in range(passes[0].num_layers):
        ranked = sorted((p.layers[i] for p in passes), key=key)
        layers.append(ranked[(len(ranked) - 1) // 2])
    return dataclasses.replace(passes[0], layers=tuple(layers))


def _tensor_widths(workload: Workload) -> tuple[int, ...] | None:
    """The tensor widths a Hugging Face model's sizes allow (heads, key/value heads, MLP
    units: :func:`~dapple.models.tp_plan.hf_tensor_widths`); None for other models."""
    from dapple.models.hf import hf_config

    config = hf_config(workload) if not workload.tp_plan else None
    return None if config is None else hf_tensor_widths(config, TENSOR_WIDTHS)


def _check_options(
    batch_sizes: Sequence[int],
    warmup: int,
    repeats: int,
    device: str,
    precision: str,
    num_threads: int | None,
    co_workers: int,
    passes: int,
    seq_lens: Sequence[int] | None,
) -> tuple[list[int], torch.device]:
    """:func:`profile_workload`'s options checked, in this order: the distinct batch sizes,
    sorted, and the device.

    Raises:
        ValidationError: batch sizes that are not positive integers, ``repeats < 1`` or
            ``warmup < 0``, a bad device or precision (or CUDA unavailable), ``num_threads <
            1``, ``co_workers`` or ``passes`` not an integer >= 1, or ``passes > 1`` with
            ``seq_lens``.
    """
    sizes = sorted(set(batch_sizes))
    if not positive_integers(sizes):
        raise ValidationError(f"batch sizes must be positive integers, got {list(batch_sizes)}")
    if repeats < 1 or warmup < 0:
        raise ValidationError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    dev = resolve_device(device)
    _check_precision(precision, dev)
    if num_threads is not None and num_threads < 1:
        raise ValidationError(f"num_threads must be >= 1, got {num_threads}")
    if not isinstance(co_workers, int) or co_workers < 1:
        raise ValidationError(f"co_workers must be an integer >= 1, got {co_workers!r}")
    if not isinstance(passes, int) or isinstance(passes, bool) or passes < 1:
        raise ValidationError(f"passes must be an integer >= 1, got {passes!r}")
    if passes > 1 and seq_lens is not None:
        raise ValidationError("profile passes > 1 take one length; give passes=1 with seq_lens")
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
    timer = Timer(dev, cpu_time)
    cast = autocast_for(precision, dev)
    n = workload.num_layers
    fwd = [[0.0] * len(sizes) for _ in range(n)]
    bwd = [[0.0] * len(sizes) for _ in range(n)]
    bwd_in = [[0.0] * len(sizes) for _ in range(n)]
    bwd_w = [[0.0] * len(sizes) for _ in range(n)]
    kept = [[0.0] * len(sizes) for _ in range(n)]
    out_b = [[0.0] * len(sizes) for _ in range(n)]
    xs = [map_tensors(workload.make_batch(b, seed)[0], lambda t: as_leaf(t.to(dev))) for b in sizes]
    input_bytes = [float(tensor_bytes(x)) for x in xs]
    param_bytes: list[int] = []
    tied: list[tuple[int, tuple[int, ...]]] = []
    bucketed: list[tuple[int, ...]] = []
    param_dtypes: set[torch.dtype] = set()
    classes: list[str] = []
    tp_plan = tp_plan_of(workload)
    shards = [False] * n
    total, done = n * len(sizes), 0
    update_ms = 0.0  # one optimizer update of every layer's parameters
    casts: list[int | None] = [None] * n  # bytes of the parameters autocast casts
    for i in range(n):  # one layer at a time: the peak is the largest layer, not the model
        layer = workload.build_layer(i, seed).to(dev).train()
        if precision_of(precision).autocast:
            with cast():
                casts[i] = cast_parameter_bytes(layer(xs[0]), layer)
        for k, b in enumerate(sizes):
            f_ms, b_ms, i_ms, w_ms, kept_bytes, nbytes, xs[k] = measure_layer(
                layer, xs[k], timer, warmup, repeats, cast, split_backward
            )
            fwd[i][k], bwd[i][k], kept[i][k], out_b[i][k] = f_ms, b_ms, kept_bytes, nbytes
            bwd_in[i][k], bwd_w[i][k] = i_ms, w_ms
            done += 1
            log.debug("b=%d layer %d: fwd %.3f ms bwd %.3f ms", b, i, f_ms, b_ms)
            if progress is not None:
                progress(done, total, f"b={b} {workload.name_of(i)}")
        trainable = trainable_params(layer)
        param_bytes.append(sum(p.numel() * p.element_size() for p in layer.parameters()))
        tied.append(tied_layer_bytes(workload, i, layer))
        bucketed.append(bucketed_parameter_sizes(workload, i, layer))
        param_dtypes |= {p.dtype for p in layer.parameters()}
        classes.append(type(layer).__name__)
        shards[i] = _shards(layer, tp_plan, workload.name_of(i))
        del layer
        gc.collect()  # traced pieces hold reference cycles: free this layer before the next
        update_ms += optimizer_update_ms(trainable, dev, timer, warmup, repeats)
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
            cast_parameter_bytes=casts[i],
            tensor_parallel=shards[i],
            parameter_sizes=bucketed[i],
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


def _tied_of(workload: Workload, i: int, layer: nn.Module) -> tuple[set[nn.Parameter], list[int]]:
    """Layer ``i``'s copies of tied parameters (``workload.tied_parameters``) and the other
    layers holding copies of them."""
    groups = [g for g in workload.tied_parameters if any(int(k) == i for k, _ in g)]
    names = {str(name) for g in groups for k, name in g if int(k) == i}
    mine = {layer.get_parameter(name) for name in names}  # tensors hash by identity
    others = sorted({int(k) for g in groups for k, _ in g if int(k) != i})
    return mine, others


def tied_layer_bytes(workload: Workload, i: int, layer: nn.Module) -> tuple[int, tuple[int, ...]]:
    """Bytes of layer ``i``'s copies of tied parameters (``workload.tied_parameters``) and the
    other layers holding copies of them."""
    mine, others = _tied_of(workload, i, layer)
    return sum(p.numel() * p.element_size() for p in mine), tuple(others)


def bucketed_parameter_sizes(workload: Workload, i: int, layer: nn.Module) -> tuple[int, ...]:
    """Bytes of each of layer ``i``'s trainable parameters outside tied groups, in
    registration order (``LayerProfile.parameter_sizes``): what a replicated stage's gradient
    buckets hold (``dapple.runtime.parallel.zero.flat_parameters``)."""
    tied = {id(p) for p in _tied_of(workload, i, layer)[0]}
    return tuple(
        p.numel() * p.element_size()
        for p in layer.parameters()
        if p.requires_grad and id(p) not in tied
    )


def _positive(t: AffineTime) -> AffineTime:
    """Guard against a zero fit (timer resolution): at least 1 ns per sample."""
    if t.fixed_ms + t.per_sample_ms > 0:
        return t
    return AffineTime(fixed_ms=0.0, per_sample_ms=1e-6)

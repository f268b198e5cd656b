"""Profiling at several sequence lengths: the workload's batches resized along their dynamic
dimensions, and the per-length profiles combined into one.

A workload is profiled at length ``L`` with its own layers (same parameters, same traced
pieces) and its own ``make_batch``, whose inputs are cut or tiled along every dynamic dimension
(:func:`dapple.models.shapes.run_dims`: declared in ``Workload.dynamic_dims`` or found by
drawing batches) to ``L`` (:func:`resize_inputs`). This is what the runtime does with a batch of
another length - the same model on other data - so the factory is not re-run (a re-run would
change the position table and re-trace the pieces). Tiled token ids are still valid ids, and
only the inputs matter to the profiler (the targets are not used).

The measured profiles are combined by :func:`combine_lengths`: each layer's terms are made
non-decreasing in the length (a running maximum over the lengths, shortest first, against
timing noise; a no-op on measurements that already are), so that the planner's interpolation
in tokens (:mod:`dapple.cost.at_length`) is monotone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.profile import LengthProfile, ModelProfile
from dapple.errors import ValidationError, positive_integers
from dapple.models.shapes import DimsMap, run_dims
from dapple.models.workload import Workload

__all__ = [
    "check_seq_lens",
    "combine_lengths",
    "length_passes",
    "resize_inputs",
    "workload_at_length",
]


def check_seq_lens(
    workload: Workload, seq_lens: Sequence[int], batch_size: int, seed: int
) -> DimsMap:
    """The workload's dynamic dimensions, checked to accept every length of ``seq_lens``.

    Raises:
        ValidationError: a length that is not a positive integer, a workload without a
            dynamic dimension, or a length outside a dimension's range (named).
    """
    if not positive_integers(seq_lens):
        raise ValidationError(f"sequence lengths must be positive integers, got {list(seq_lens)}")
    dims = run_dims(workload, batch_size, seed)
    if not dims:
        raise ValidationError(
            f"model {workload.name!r} has no dynamic input dimension to profile at lengths "
            f"{list(seq_lens)}: declare one (dynamic_dims=, e.g. {{0: {{1: 'seq'}}}}; the zoo "
            "transformer and Hugging Face models take seq_choices=[...])"
        )
    for i, ds in dims.items():
        for d, dim in ds.items():
            bad = [L for L in seq_lens if not dim.accepts(L)]
            if bad:
                raise ValidationError(
                    f"model {workload.name!r}: input {i} dimension {d} ({dim.name}) takes sizes "
                    f"in {dim.range_text()}, not the lengths {bad}"
                )
    return dims


def _fit(t: torch.Tensor, d: int, L: int) -> torch.Tensor:
    """``t`` cut (or tiled, then cut) to size ``L`` along dimension ``d``."""
    n = t.shape[d]
    if n < L:
        t = t.repeat(*[-(-L // n) if k == d else 1 for k in range(t.dim())])
    return t.narrow(d, 0, L).contiguous()


def resize_inputs(inputs: Any, dims: DimsMap, L: int) -> Any:
    """``inputs`` (a tensor or a tuple of them) with every dynamic dimension of ``dims`` of
    size ``L``."""
    flat = list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]
    for i, ds in dims.items():
        for d in ds:
            flat[i] = _fit(flat[i], d, L)
    return type(inputs)(flat) if isinstance(inputs, (tuple, list)) else flat[0]


def workload_at_length(workload: Workload, dims: DimsMap, L: int) -> Workload:
    """``workload`` whose batches have length ``L`` along ``dims`` (same layers)."""
    make_batch = workload.make_batch

    def at_length(batch_size: int, seed: int) -> tuple[Any, torch.Tensor]:
        inputs, targets = make_batch(batch_size, seed)
        return resize_inputs(inputs, dims, L), targets

    return dataclasses.replace(workload, make_batch=at_length)


def _running_max(values: Sequence[float]) -> list[float]:
    out: list[float] = []
    for v in values:
        out.append(max(v, out[-1]) if out else v)
    return out


def _monotone_layers(layers: Sequence[LayerProfile]) -> list[LayerProfile]:
    """One layer's profiles at increasing lengths, each term non-decreasing in the length."""

    def terms(get: Callable[[LayerProfile], float]) -> list[float]:
        return _running_max([get(x) for x in layers])

    ff = terms(lambda x: x.forward.fixed_ms)
    fp = terms(lambda x: x.forward.per_sample_ms)
    bf = terms(lambda x: x.backward.fixed_ms)
    bp = terms(lambda x: x.backward.per_sample_ms)
    out_b = terms(lambda x: x.output_bytes_per_sample)
    kept = terms(lambda x: x.kept_activation_bytes_per_sample)
    return [
        dataclasses.replace(
            x,
            forward=AffineTime(fixed_ms=ff[k], per_sample_ms=fp[k]),
            backward=AffineTime(fixed_ms=bf[k], per_sample_ms=bp[k]),
            output_bytes_per_sample=out_b[k],
            kept_activation_bytes_per_sample=kept[k],
        )
        for k, x in enumerate(layers)
    ]


def combine_lengths(profiles: Sequence[tuple[int, ModelProfile]]) -> ModelProfile:
    """One profile from profiles measured at increasing lengths ``(L, profile)``.

    Its ``by_length`` holds every length (terms made non-decreasing in the length); its
    ``layers`` are those at the longest length, so a plan made without stating a length fits
    every measured one in memory.
    """
    lens = [L for L, _ in profiles]
    per_layer = [
        _monotone_layers([p.layers[i] for _, p in profiles])
        for i in range(profiles[0][1].num_layers)
    ]
    inputs = _running_max([p.input_bytes_per_sample for _, p in profiles])
    by_length = tuple(
        LengthProfile(
            seq_len=L,
            layers=tuple(layer[k] for layer in per_layer),
            input_bytes_per_sample=inputs[k],
        )
        for k, L in enumerate(lens)
    )
    last = by_length[-1]
    return dataclasses.replace(
        profiles[-1][1],
        layers=last.layers,
        input_bytes_per_sample=last.input_bytes_per_sample,
        seq_len=last.seq_len,
        by_length=by_length,
    )


Progress = Callable[[int, int, str], None]
"""``progress(done, total, description)`` (:data:`dapple.profiler.measure.ProgressFn`)."""


def length_passes(
    progress: Progress | None, lens: Sequence[int]
) -> list[tuple[int, Progress | None]]:
    """Each length with the ``progress`` of its pass: one equal pass per length, in order, the
    ``k``-th reporting ``k * total + done`` of ``K * total`` with ``L=<length>`` before its
    description (None without ``progress``)."""
    return [(L, _offset(progress, k, len(lens), f"L={L} ")) for k, L in enumerate(lens)]


def _offset(progress: Progress | None, k: int, K: int, prefix: str) -> Progress | None:
    """``progress`` for the ``k``-th of ``K`` equal passes (one per length)."""
    if progress is None:
        return None
    call = progress

    def step(done: int, total: int, desc: str) -> None:
        call(k * total + done, K * total, prefix + desc)

    return step

"""Bytes in the cost model: cut activations, parameter state, kept activations (section 5.1);
the step peak they add up to, and D, are :mod:`dapple.cost.peak_memory`'s.

Pure functions (no torch). Activations are as profiled, in the profile's precision
(``ModelProfile.precision``); parameters, gradients and optimizer state are fp32 in every
precision, plus autocast's weight cast cache in bf16/fp16.
Activation memory reads the layers at the longest planned length,
:attr:`ModelProfile.for_memory <dapple.core.profile.ModelProfile.for_memory>`
(:mod:`dapple.cost.at_length`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from dapple.core.buckets import BUCKET_BYTES, MAX_STAGED, bucket_runs
from dapple.core.layer_profile import LayerProfile
from dapple.core.parallelism import ONE_DEVICE, Parallelism
from dapple.core.plan import StagePlan
from dapple.core.precision import precision_of
from dapple.core.profile import ModelProfile

__all__ = [
    "TP_REPLICATED_OUTPUTS",
    "UNBOUNDED_IN_FLIGHT",
    "boundary_bytes",
    "device_state_bytes",
    "gradients_in_flight_bytes",
    "held_activation_bytes",
    "kept_bytes_per_sample",
    "parameter_state_bytes",
    "sharded_layer_bytes",
    "sharded_parameter_bytes",
    "state_bytes_per_parameter_byte",
    "tensor_kept_bytes_per_sample",
    "tied_state_bytes_per_parameter_byte",
    "uncast_bytes",
    "weight_cast_bytes",
    "weight_cast_factor",
    "zero2_bucket_bytes",
    "zero2_in_flight_bytes",
    "zero_saved_bytes",
]

UNBOUNDED_IN_FLIGHT = 10**9
"""D of a stage whose activations take no memory."""


def boundary_bytes(profile: ModelProfile, cut: int, samples: int) -> float:
    """Activation bytes crossing the cut placed before layer ``cut`` for ``samples`` samples.

    That is the output of layer ``cut - 1`` (the model input when ``cut == 0``).
    """
    per_sample = (
        profile.input_bytes_per_sample
        if cut == 0
        else profile.layers[cut - 1].output_bytes_per_sample
    )
    return per_sample * samples


TP_REPLICATED_OUTPUTS = 5.0
"""Kept activation bytes of a tensor-parallel block held whole on every rank, in units of its
output bytes: ``10 sbh`` of Korthikanti et al. 2022 (equation 2) over the ``2 sbh`` output."""


def sharded_layer_bytes(layer: LayerProfile, t: int) -> float:
    """Parameter bytes one tensor rank holds of ``layer``: ``tied + (P - tied) / t`` when it
    shards, all of P otherwise."""
    if t == 1 or not layer.tensor_parallel:
        return float(layer.parameter_bytes)
    tied = layer.tied_parameter_bytes
    return tied + (layer.parameter_bytes - tied) / t


def sharded_parameter_bytes(profile: ModelProfile, layers: tuple[int, int], t: int) -> float:
    """``P_s / t``: parameter (and gradient) bytes of layers ``[start, end)`` on one tensor rank."""
    s, e = layers
    return sum(sharded_layer_bytes(layer, t) for layer in profile.layers[s:e])


def tensor_kept_bytes_per_sample(layer: LayerProfile, t: int) -> float:
    """Kept activation bytes per sample of ``layer`` on one of t tensor ranks (Korthikanti et
    al. 2022, equation 2): ``W + (kept - W) / t`` with ``W = min(kept, 5 x output)`` held
    whole (:data:`TP_REPLICATED_OUTPUTS`); all of it for a layer that does not shard."""
    kept = layer.kept_activation_bytes_per_sample
    if t == 1 or not layer.tensor_parallel:
        return kept
    whole = min(kept, TP_REPLICATED_OUTPUTS * layer.output_bytes_per_sample)
    return whole + (kept - whole) / t


def _cast_factor(profile: ModelProfile) -> float:
    """Bytes of autocast's weight cast cache per (fp32) parameter byte: a 2-byte copy of every
    4-byte parameter under bf16/fp16 autocast, none in fp32."""
    return weight_cast_factor(profile.precision)


@functools.cache
def weight_cast_factor(precision: str) -> float:
    """:attr:`ComputePrecision.weight_cast_factor <dapple.core.precision.ComputePrecision>` of
    the precision named ``precision``, remembered (a planner asks it per layer of each stage
    it costs).

    Raises:
        ValidationError: no precision has that name.
    """
    return precision_of(precision).weight_cast_factor


def state_bytes_per_parameter_byte(
    profile: ModelProfile, parallel: Parallelism = ONE_DEVICE
) -> float:
    """Bytes one replica holds per parameter byte for the whole step, activations aside.

    ``1 + optimizer_state_factor`` (fp32 parameters, gradients and optimizer state, whatever
    the compute precision: master weights stay fp32); the weight cast cache of a
    ``bf16``/``fp16`` profile (parameter count x 2 bytes); and on a
    replicated stage (``parallel.data_parallel``) one more copy of the gradient - the flat buffers its
    AllReduce AR(P_s, g_s) reduces in (the runtime's gradient buckets, :mod:`dapple.runtime.sync`).

    On a replicated stage with ZeRO-1 (:mod:`dapple.runtime.parallel.zero`) the gradients
    accumulate in the flat buckets themselves (no extra copy), each replica holds the reduced
    gradient of its ``1/r_s`` chunk, and the optimizer state (the factor less the gradient's 1)
    is held ``1/r_s`` on each replica: ``1 + 1 + (factor - 1 + 1) / r_s``. With 2 the
    gradients are held only as the ``1/r_s`` shard: ``1 + factor / r_s``. The gradients in
    flight during a backward (ZeRO-2's staged ones included) are a per-stage term
    (:func:`gradients_in_flight_bytes`, added by :func:`parameter_state_bytes`).

    With 3 (FSDP, :mod:`dapple.runtime.parallel.fsdp`) each replica keeps the ``1/r_s`` shard of the
    parameters, gradients and optimizer state, ``(1 + factor) / r_s``. Without ``regather``
    the runtime gathers the parameters at the first forward and keeps them, and the
    unsharded gradients, until the last backward of the step (no re-shard between
    micro-batches), and the gradient shard exists only from the step's reduce-scatter on:
    ``2 + factor / r_s`` plus the whole cast cache (the reduce-scatter's buffers are in
    :func:`gradients_in_flight_bytes`). With ``regather`` only the pieces being computed are
    whole (:func:`gradients_in_flight_bytes`), the cast cache sharded too.
    """
    cast = _cast_factor(profile)
    factor = profile.optimizer_state_factor
    replicas = parallel.replicas
    if parallel.shards_params:
        if parallel.regather:
            return (1.0 + factor + cast) / replicas
        return 2.0 + factor / replicas + cast
    if parallel.shards_grads:
        return 1.0 + factor / replicas + cast
    if parallel.shards_optimizer:
        return 1.0 + 1.0 + factor / replicas + cast
    ar_buffers = 1.0 if parallel.data_parallel else 0.0
    return 1.0 + factor + cast + ar_buffers


def weight_cast_bytes(profile: ModelProfile, layers: tuple[int, int]) -> float:
    """Autocast's low-precision copy of the weights of layers ``[start, end)`` (0 in fp32):
    cast parameter count x 2 bytes, the parameters being fp32 (``cast_parameter_bytes`` / 4,
    all of ``parameter_bytes`` when the profile does not say)."""
    s, e = layers
    params = sum(_cast_of(layer) for layer in profile.layers[s:e])
    return params * _cast_factor(profile)


def _cast_of(layer: LayerProfile) -> int:
    c = layer.cast_parameter_bytes
    return layer.parameter_bytes if c is None else c


def uncast_bytes(
    profile: ModelProfile, layers: tuple[int, int], tensor_width: int = 1, shards: int = 1
) -> float:
    """What :func:`state_bytes_per_parameter_byte`'s cast cache over-counts for layers
    ``[start, end)``: 2 bytes per parameter autocast never casts (an embedding table is looked
    up, a norm weight multiplied element-wise: ``parameter_bytes - cast_parameter_bytes``),
    on one of ``tensor_width`` ranks (a shardable layer's share ``1/t``) and ``shards`` ZeRO-3
    replicas re-gathering; 0 in fp32 or when the profile does not say."""
    s, e = layers
    total = 0.0
    for layer in profile.layers[s:e]:
        n = layer.parameter_bytes - _cast_of(layer)
        total += n / tensor_width if layer.tensor_parallel else n
    return total * _cast_factor(profile) / shards


def tied_state_bytes_per_parameter_byte(
    profile: ModelProfile, parallel: Parallelism = ONE_DEVICE, *, cross_stage: bool = False
) -> float:
    """:func:`state_bytes_per_parameter_byte` for a copy of a tied parameter
    (``LayerProfile.tied_parameter_bytes``), whose gradient the runtime keeps whole and sums
    over the copies outside the flat buckets.

    On one replica, as any parameter. On a replicated stage the AllReduce buffer is held only
    when every copy is in the stage (``cross_stage`` False): copies in other stages are
    summed over all their devices at once, into a transient tensor. Under ZeRO-1/2 the
    gradient stays whole (1) and only the optimizer state beyond it (``factor - 1``) is held
    ``1/r_s``, each replica updating its slice in place of the whole gradient.
    """
    if not parallel.data_parallel:
        return state_bytes_per_parameter_byte(profile)
    cast = _cast_factor(profile)
    factor = profile.optimizer_state_factor
    ar_buffers = 0.0 if cross_stage else 1.0
    if parallel.shards_optimizer:
        return 1.0 + 1.0 + (factor - 1.0) / parallel.replicas + cast + ar_buffers
    return 1.0 + factor + cast + ar_buffers


def tied_bytes(profile: ModelProfile, layers: tuple[int, int]) -> tuple[int, int]:
    """``(within, cross)``: parameter bytes of layers ``[start, end)`` that are copies of tied
    parameters, those whose other copies are all in the range and those with copies outside."""
    s, e = layers
    within = cross = 0
    for layer in profile.layers[s:e]:
        if layer.tied_parameter_bytes:
            if all(s <= t < e for t in layer.tied_layers):
                within += layer.tied_parameter_bytes
            else:
                cross += layer.tied_parameter_bytes
    return within, cross


def parameter_state_bytes(
    profile: ModelProfile, layers: tuple[int, int], parallel: Parallelism = ONE_DEVICE
) -> float:
    """Parameters + gradients + optimizer state (+ weight cast cache, + AllReduce buffers) of
    layers ``[start, end)`` on one replica of a stage laid out as ``parallel``
    (:func:`state_bytes_per_parameter_byte`; 16 bytes per fp32 Adam parameter with the default
    factor 3 and no replicas, 18 under bf16/fp16 autocast; copies of tied parameters by
    :func:`tied_state_bytes_per_parameter_byte`), plus the gradients in flight during a
    backward (:func:`gradients_in_flight_bytes`), less the cast cache of the parameters
    autocast never casts (:func:`uncast_bytes`). On one rank of a tensor group of t_s, a
    shardable layer's untied parameters count ``1/t`` (:func:`sharded_parameter_bytes`); under
    ZeRO-3 with ``regather`` the parameters are re-gathered per micro-batch."""
    s, e = layers
    t = parallel.tensor_width
    within, cross = tied_bytes(profile, layers)
    if not parallel.tensor_parallel:
        params: float = sum(layer.parameter_bytes for layer in profile.layers[s:e])
    else:
        params = sharded_parameter_bytes(profile, layers, t)
    untied = params - within - cross
    shards = parallel.replicas if parallel.regather else 1  # regather: ZeRO-3 on r_s > 1
    uncast = uncast_bytes(profile, layers, t, shards)
    if parallel.shards_params or parallel.tensor_parallel:
        return (
            untied * state_bytes_per_parameter_byte(profile, parallel)
            + _tied_and_in_flight(profile, layers, parallel)
            - uncast
        )
    return -uncast + (
        untied * state_bytes_per_parameter_byte(profile, parallel)
        + within * tied_state_bytes_per_parameter_byte(profile, parallel)
        + cross * tied_state_bytes_per_parameter_byte(profile, parallel, cross_stage=True)
        + gradients_in_flight_bytes(profile, layers, parallel)
    )


def _tied_and_in_flight(
    profile: ModelProfile, layers: tuple[int, int], parallel: Parallelism
) -> float:
    """The tied copies' state and the gradients in flight of :func:`parameter_state_bytes`."""
    within, cross = tied_bytes(profile, layers)
    return (
        within * tied_state_bytes_per_parameter_byte(profile, parallel)
        + cross * tied_state_bytes_per_parameter_byte(profile, parallel, cross_stage=True)
        + gradients_in_flight_bytes(profile, layers, parallel)
    )


ZERO3_GATHERED_LAYERS = 2
"""ZeRO-3 with re-gathering: whole parameters held at once, in units of the stage's largest
layer: the layer being computed and the next one, whose all-gather FSDP prefetches."""


def zero2_bucket_bytes(
    profile: ModelProfile,
    layers: tuple[int, int],
    parallel: Parallelism,
    bucket_bytes: float = BUCKET_BYTES,
) -> list[float]:
    """The bytes of each flat bucket of layers ``[start, end)`` on one replica, in the order a
    backward makes them final, as the runtime cuts the stage's parameters
    (``dapple.runtime.parallel.zero.FlatShards``): every layer's bucketed tensors
    (:meth:`LayerProfile.bucketed_sizes <dapple.core.layer_profile.LayerProfile.bucketed_sizes>`:
    its untied trainable parameters one by one, tied copies are not in buckets), the stage's
    last tensor first, cut by :func:`dapple.core.buckets.bucket_runs` at ``bucket_bytes``.
    On a tensor rank a layer that shards has ``1/t`` of each. A layer whose profile does not
    list its parameters one by one is one tensor of its untied bytes: larger than the cap it is
    one bucket here, where the runtime cuts it at its parameters."""
    s, e = layers
    t = parallel.tensor_width
    sizes: list[float] = []
    for layer in reversed(profile.layers[s:e]):
        share = t if parallel.tensor_parallel and layer.tensor_parallel else 1
        sizes += [x / share for x in reversed(layer.bucketed_sizes()) if x > 0]
    return [sum(sizes[i] for i in run) for run in bucket_runs(sizes, bucket_bytes)]


def zero2_in_flight_bytes(
    profile: ModelProfile,
    layers: tuple[int, int],
    parallel: Parallelism,
    bucket_bytes: float = BUCKET_BYTES,
) -> float:
    """ZeRO-2's gradients in flight during a backward of layers ``[start, end)`` on one
    replica, bucket by bucket (:func:`zero2_bucket_bytes`, S_k bytes each), as
    ``FlatShards`` allocates them: bucket k is staged only when all its gradients are final,
    so its fresh gradients (S_k) are alive beside its staging copy (S_k), and beside the
    :data:`~dapple.core.buckets.MAX_STAGED` buckets before it still being reduced, each a
    staging copy and its reduce-scatter output (``1/r_s`` of it): the peak is the largest over
    k of ``2 S_k + (1 + 1/r_s) (S_{k-1} + S_{k-2})``. On gloo the runtime reduces in place,
    without the outputs' ``1/r_s``. Plus the largest tied copy's gradient, which autograd
    produces before adding it to the accumulated whole one (tied copies are outside the
    buckets). 0 unless ``parallel`` is ZeRO-2 on a replicated stage."""
    if not parallel.reduces_each_backward:
        return 0.0
    sizes = zero2_bucket_bytes(profile, layers, parallel, bucket_bytes)
    staged = 1.0 + 1.0 / parallel.replicas  # a staging copy and its output chunk
    peak = max(
        (2 * b + staged * sum(sizes[max(0, k - MAX_STAGED) : k]) for k, b in enumerate(sizes)),
        default=0.0,
    )
    s, e = layers
    return peak + max((layer.tied_parameter_bytes for layer in profile.layers[s:e]), default=0)


def gradients_in_flight_bytes(
    profile: ModelProfile, layers: tuple[int, int], parallel: Parallelism = ONE_DEVICE
) -> float:
    """Gradients held during a backward of layers ``[start, end)`` beyond the accumulated ones:
    the gradient autograd produces before adding it to the accumulated one (or copying it into
    a bucket) - at most the largest layer's parameters (its ``1/t`` shard under tensor
    parallelism); under ZeRO-2, whose accumulated gradients are the ``1/r_s`` shard, the
    buckets' fresh gradients and staging copies instead (:func:`zero2_in_flight_bytes`). Under
    ZeRO-3 FSDP2's reduce-scatter copies the gradients it reduces into a flat input and a
    ``1/r_s`` output after re-sharding their parameters: without ``regather`` the whole
    stage's at once after the last backward (the freed whole parameters make room for the
    input, so the stage grows by its ``1/r_s`` output), with ``regather`` one piece's after
    each backward, beside the whole parameters of :data:`ZERO3_GATHERED_LAYERS` pieces."""
    s, e = layers
    if parallel.reduces_each_backward:
        return zero2_in_flight_bytes(profile, layers, parallel)
    sizes = [sharded_layer_bytes(layer, parallel.tensor_width) for layer in profile.layers[s:e]]
    big = max(sizes)
    if not parallel.shards_params:
        return big
    replicas = parallel.replicas
    scatter = 1.0 + 1.0 / replicas
    if parallel.regather:
        return big + ZERO3_GATHERED_LAYERS * big + scatter * big
    return max(big, sum(sizes) / replicas)


def device_state_bytes(profile: ModelProfile, stages: Sequence[StagePlan]) -> float:
    """The parameter state one device holds for ``stages`` (its stage, or its chunks under
    interleaving): each stage's :func:`parameter_state_bytes` at its own zero stage, with the
    gradients in flight (:func:`gradients_in_flight_bytes`) counted once - one backward runs at
    a time on a device, and the runtime's chunks share one set of ZeRO-2 staging buffers."""
    staging = [_of_stage(gradients_in_flight_bytes, profile, st) for st in stages]
    whole = sum(_of_stage(parameter_state_bytes, profile, st) for st in stages)
    return whole - sum(staging) + max(staging, default=0.0)


def _of_stage(fn: Callable[..., float], profile: ModelProfile, st: StagePlan) -> float:
    """``fn`` (a per-stage memory term) of ``st``'s layers and layout."""
    return fn(profile, st.layers, st.parallel)


def zero_saved_bytes(
    profile: ModelProfile, layers: tuple[int, int], parallel: Parallelism
) -> float:
    """Bytes ``parallel``'s ZeRO sharding saves on one replica of layers ``[start, end)``
    against none (0 on a stage with one replica)."""
    return parameter_state_bytes(profile, layers, parallel.unsharded()) - parameter_state_bytes(
        profile, layers, parallel
    )


def held_activation_bytes(profile: ModelProfile, stage: StagePlan, samples: int) -> float:
    """Activation bytes held from forward to backward for one slice of ``samples`` samples.

    All layers' kept activations, or only the stage input when the stage re-computes (at the
    profile's memory length, :attr:`ModelProfile.for_memory`); on one rank of a tensor group
    (t_s > 1) each layer's :func:`tensor_kept_bytes_per_sample`.
    """
    profile = profile.for_memory
    if stage.recompute:
        return boundary_bytes(profile, stage.layers[0], samples)
    return kept_bytes_per_sample(profile, stage.layers, stage.tensor_width) * samples


def kept_bytes_per_sample(profile: ModelProfile, layers: tuple[int, int], t: int = 1) -> float:
    """Kept activation bytes per sample of layers ``[start, end)`` on one of t tensor ranks."""
    s, e = layers
    if t == 1:
        return sum(layer.kept_activation_bytes_per_sample for layer in profile.layers[s:e])
    return sum(tensor_kept_bytes_per_sample(layer, t) for layer in profile.layers[s:e])

"""Bytes in the cost model: cut activations, parameter state, kept activations, D (section 5.1).

Pure functions (no torch), re-exported by :mod:`dapple.planner.cost`.
"""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.plan import StagePlan, split_sizes
from dapple.core.profile import ModelProfile

__all__ = [
    "activation_bytes",
    "boundary_bytes",
    "device_memory_bytes",
    "max_in_flight_fitting",
    "parameter_state_bytes",
]


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


def parameter_state_bytes(profile: ModelProfile, layers: tuple[int, int]) -> float:
    """Parameters + gradients + optimizer state of layers ``[start, end)`` on one replica.

    ``params x (1 + optimizer_state_factor)``: 16 bytes per fp32 Adam parameter with the
    default factor 3.
    """
    s, e = layers
    params = sum(layer.parameter_bytes for layer in profile.layers[s:e])
    return params * (1.0 + profile.optimizer_state_factor)


def activation_bytes(profile: ModelProfile, stage: StagePlan, samples: int) -> float:
    """Activation bytes kept from forward to backward for one slice of ``samples`` samples.

    All layers' kept activations, or only the stage input when the stage re-computes.
    """
    s, e = stage.layers
    if stage.recompute:
        return boundary_bytes(profile, s, samples)
    return sum(layer.kept_activation_bytes_per_sample for layer in profile.layers[s:e]) * samples


def device_memory_bytes(
    profile: ModelProfile, stage: StagePlan, micro_batch_size: int, in_flight: int
) -> float:
    """Peak memory of one replica of ``stage`` with ``in_flight`` micro-batches (K_i) in flight.

    Parameters, gradients and optimizer state, plus ``in_flight`` slices of kept activations,
    plus, when re-computing, the full activations of the one micro-batch being re-computed.

    Args:
        profile: sizes.
        stage: layers, replicas and re-computation flag.
        micro_batch_size: b (a replica keeps the largest slice ``split_sizes(b, r)[0]``).
        in_flight: K_i, micro-batches whose activations are held at once.
    """
    samples = split_sizes(micro_batch_size, stage.replicas)[0]
    mem = parameter_state_bytes(profile, stage.layers)
    mem += in_flight * activation_bytes(profile, stage, samples)
    if stage.recompute:
        s, e = stage.layers
        mem += (
            sum(layer.kept_activation_bytes_per_sample for layer in profile.layers[s:e]) * samples
        )
    return mem


def max_in_flight_fitting(
    profile: ModelProfile, cluster: Cluster, stage: StagePlan, micro_batch_size: int
) -> int:
    """D: the most micro-batches whose activations fit next to the stage's parameter state.

    Returns 0 when not even one fits; a large number (10**9) when activations take no memory.
    """
    samples = split_sizes(micro_batch_size, stage.replicas)[0]
    per_mb = activation_bytes(profile, stage, samples)
    free = cluster.device_memory_bytes - device_memory_bytes(profile, stage, micro_batch_size, 0)
    if free < 0:
        return 0
    if per_mb <= 0:
        return 10**9
    return int(free // per_mb)

"""Compute in the cost model: F_s, B_s of a stage's slice, and the split backward's I and W.

Pure functions (no torch) over a profile's per-layer affine times (paper section 5.1), scaled
by ``Cluster.compute_slowdown``. A micro-batch of b samples is split over the r_s replicas of a
stage with :func:`dapple.core.plan.split_sizes` (evenly, or by the stage's shares); F_s, B_s of
the stage are those of its slowest replica: the largest slice, or on a cluster with device kinds
the largest time of a slice at its device's speed (or from its kind's own profile,
:mod:`dapple.core.kind_profiles`).
"""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.kind_profiles import profile_of
from dapple.core.layer_profile import LayerProfile
from dapple.core.plan import StagePlan
from dapple.core.profile import ModelProfile

__all__ = ["compute_ms", "split_backward_ms", "stage_compute_ms", "tensor_share"]


def tensor_share(layer: LayerProfile, t: int) -> int:
    """t_l: the ranks a layer's work is divided over in a width-t tensor group (t for a
    shardable layer, :attr:`LayerProfile.tensor_parallel`; 1 for one every rank runs whole)."""
    return t if layer.tensor_parallel else 1


def compute_ms(
    profile: ModelProfile,
    cluster: Cluster,
    layers: tuple[int, int],
    samples: int,
    *,
    recompute: bool = False,
    tensor_width: int = 1,
) -> tuple[float, float]:
    """Forward and backward time of one call of layers ``[start, end)`` on ``samples`` samples.

    Args:
        profile: per-layer affine times.
        cluster: supplies ``compute_slowdown``.
        layers: ``(start, end)`` layer range.
        samples: samples of the call (0 gives 0, 0: no call).
        recompute: the backward re-runs the forward first (activation re-computation), so it
            includes the forward time.
        tensor_width: t, one rank of a width-t group: each layer's time divided by its
            :func:`tensor_share` (the group's collectives are not included here).

    Returns:
        ``(forward_ms, backward_ms)``.
    """
    s, e = layers
    ls, t, sd = profile.layers[s:e], tensor_width, cluster.compute_slowdown
    f = sum(layer.forward.at(samples) / tensor_share(layer, t) for layer in ls) * sd
    b = sum(layer.backward.at(samples) / tensor_share(layer, t) for layer in ls) * sd
    return f, b + (f if recompute else 0.0)


def stage_compute_ms(
    profile: ModelProfile, cluster: Cluster, stage: StagePlan, micro_batch_size: int
) -> tuple[float, float]:
    """F_s, B_s of a computation stage: its slowest replica's, on its slice of b
    (:meth:`~dapple.core.plan.StagePlan.slice_sizes`: even, ``split_sizes(b, r_s)[0]`` the
    largest, or the stage's shares) at its device's speed (:meth:`Cluster.speed_of`), from its
    kind's own profile where the kind has one (:func:`~dapple.core.kind_profiles.profile_of`).

    Args:
        profile: per-layer times.
        cluster: supplies ``compute_slowdown`` and the devices' speeds.
        stage: layer range, replicas and re-computation flag.
        micro_batch_size: b, samples of one micro-batch before the split.
    """
    out = (0.0, 0.0)
    for d, n in zip(stage.replica_devices, stage.slice_sizes(micro_batch_size), strict=True):
        own = profile_of(cluster, d, profile)  # its kind's own profile, if it has one
        f, b = compute_ms(own, cluster, stage.layers, n, recompute=bool(stage.recompute))
        v = cluster.speed_of(d)
        if (f + b) / v > sum(out):
            out = (f / v, b / v)
    return out


def split_backward_ms(
    profile: ModelProfile,
    cluster: Cluster,
    layers: tuple[int, int],
    samples: int,
    *,
    recompute: bool = False,
    tensor_width: int = 1,
) -> tuple[float, float]:
    """``(I, W)``: the input- and weight-gradient halves of the backward of layers
    ``[start, end)`` on ``samples`` samples (:meth:`LayerProfile.backward_split`: measured, or
    the documented assumed split). A re-computed forward runs before ``I`` and counts there.
    ``tensor_width``: as in :func:`compute_ms`.
    The first stage's inputs carry no gradient: the runtime runs its whole backward as ``W``
    (:mod:`dapple.models.split_backward`), and so does this.
    """
    s, e = layers
    i = w = 0.0
    for layer in profile.layers[s:e]:
        li, lw = (0.0, layer.backward.at(samples)) if s == 0 else layer.backward_split(samples)
        t = tensor_share(layer, tensor_width)
        i, w = i + li / t, w + lw / t
    f = (
        compute_ms(profile, cluster, layers, samples, tensor_width=tensor_width)[0]
        if recompute
        else 0.0
    )
    return i * cluster.compute_slowdown + f, w * cluster.compute_slowdown

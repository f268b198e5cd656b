"""Tensor parallelism and ZeRO-3 in the cost model: a stage of width t_s and sharded parameters.

Beyond the paper (DAPPLE plans whole-layer replicas). Pure functions, no torch; each one term:

* Megatron-LM tensor parallelism (Shoeybi et al. 2019, section 3): a layer that shards
  (``LayerProfile.tensor_parallel``, a transformer block) runs ``1/t`` of its compute on each
  of the t ranks of its tensor group, and costs two all-reduces of its output activation per
  forward (``g`` after the attention's and the MLP's row-parallel products) and two per
  backward (``f`` before their column-parallel ones) - what dapple's runtime runs
  (``dapple.runtime.parallel.tp``: 2 + 2 ``allreduce`` per block, measured). Each is a ring all-reduce
  inside one server (:func:`ring_allreduce_ms`): ``2(t-1)/t x bytes / B_intra + 2(t-1) x
  latency``; the latency term dominates small activations. Layers that do not shard run whole
  on every rank (redundantly). A split backward's ``I`` carries the backward all-reduces
  (they reduce input gradients).
* Parameters and optimizer state of a shardable layer divide by t (its tied copies stay
  whole); the gradient AllReduce over the r_s replicas moves these ``P_s / t`` bytes, once per
  tensor rank: t replica groups in parallel, whose cross-server phases share each server's
  network interface (:func:`replica_sync_ms`).
* Kept activations under tensor parallelism without sequence parallelism (Korthikanti et al.
  2022, "Reducing Activation Recomputation in Large Transformer Models", section 4.2,
  equation 2: ``sbh (10 + 24/t + 5as/(ht))`` per layer against ``sbh (34 + 5as/h)``): the
  ``10 sbh`` - the inputs of the two layer norms and of the QKV and first MLP products, and the
  two dropout masks, all at the block's boundary width h - stay whole on every rank; the rest
  divides by t. With the block output being ``2 sbh`` bytes, the whole part is
  :data:`TP_REPLICATED_OUTPUTS` x the layer's output bytes (:func:`tensor_kept_bytes_per_sample`).
* ZeRO-3 (FSDP, ``dapple.runtime.parallel.fsdp``) over the replicas: once per step an all-gather of the
  stage's (tensor-sharded) parameters before the first forward and a reduce-scatter of its
  gradients after the last backward - each half a ring AllReduce, AR in all, in AR_s; with
  ``regather`` per micro-batch an all-gather before the forward (in F) and an all-gather and a
  reduce-scatter around the backward (in B): :func:`fsdp_pass_ms`.
"""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.parallelism import Parallelism
from dapple.core.plan import StagePlan
from dapple.core.profile import ModelProfile
from dapple.cost.comm import allreduce_ms, server_counts, stage_sync_ms
from dapple.cost.compute import compute_ms, split_backward_ms
from dapple.cost.memory import (
    TP_REPLICATED_OUTPUTS,
    sharded_layer_bytes,
    sharded_parameter_bytes,
    tensor_kept_bytes_per_sample,
)

__all__ = [
    "TP_ALLREDUCES_PER_PASS",
    "TP_REPLICATED_OUTPUTS",
    "fsdp_pass_ms",
    "replica_sync_ms",
    "ring_allreduce_ms",
    "sharded_layer_bytes",
    "sharded_parameter_bytes",
    "tensor_comm_ms",
    "tensor_compute_ms",
    "tensor_kept_bytes_per_sample",
    "tensor_split_backward_ms",
]

TP_ALLREDUCES_PER_PASS = 2
"""All-reduces of a shardable block's output per forward, and per backward (Megatron-LM's ``g``
and ``f``, Shoeybi et al. 2019, figure 3)."""


def ring_allreduce_ms(cluster: Cluster, nbytes: float, n: int) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` devices of one server:
    ``2(n-1)/n x bytes / B_intra + 2(n-1) x latency_intra``; 0 for n = 1 or no bytes."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bpms = cluster.intra_server_bandwidth_gbps * 1e9 / 8 / 1e3
    return 2 * (n - 1) / n * nbytes / bpms + 2 * (n - 1) * cluster.intra_server_latency_ms


def tensor_comm_ms(
    profile: ModelProfile, cluster: Cluster, layers: tuple[int, int], samples: int, t: int
) -> float:
    """The tensor-parallel all-reduces of one forward (or one backward) of layers ``[start,
    end)`` on ``samples`` samples: per shardable layer :data:`TP_ALLREDUCES_PER_PASS` ring
    all-reduces of its output (:func:`ring_allreduce_ms`); 0 for t = 1 or no samples."""
    if t == 1 or samples <= 0:
        return 0.0
    s, e = layers
    return sum(
        TP_ALLREDUCES_PER_PASS
        * ring_allreduce_ms(cluster, layer.output_bytes_per_sample * samples, t)
        for layer in profile.layers[s:e]
        if layer.tensor_parallel
    )


def tensor_compute_ms(
    profile: ModelProfile,
    cluster: Cluster,
    layers: tuple[int, int],
    samples: int,
    t: int,
    *,
    recompute: bool = False,
) -> tuple[float, float]:
    """F, B of layers ``[start, end)`` on ``samples`` samples on one rank of a width-t group:
    ``sum(F_l / t_l) x slowdown + TP all-reduces`` (t_l = t for a shardable layer, else 1;
    :func:`tensor_comm_ms`), B likewise, plus F when re-computing.

    Args:
        profile: per-layer times and the ``tensor_parallel`` flags.
        cluster: ``compute_slowdown`` and the intra-server links.
        layers: ``(start, end)``.
        samples: the replica's slice (0: no call, 0 ms).
        t: tensor width.
        recompute: the backward repeats the forward (its all-reduces included).
    """
    f, b = compute_ms(profile, cluster, layers, samples, tensor_width=t)
    comm = tensor_comm_ms(profile, cluster, layers, samples, t)
    f, b = f + comm, b + comm
    return f, b + (f if recompute else 0.0)


def tensor_split_backward_ms(
    profile: ModelProfile,
    cluster: Cluster,
    layers: tuple[int, int],
    samples: int,
    t: int,
    *,
    recompute: bool = False,
) -> tuple[float, float]:
    """``(I, W)`` of the split backward on one rank of a width-t group (as
    :func:`dapple.cost.compute.split_backward_ms`, each layer's halves divided by its t_l): the
    backward all-reduces reduce input gradients and count in I (in W on the first stage, which
    runs its whole backward as W); a re-computed forward counts in I."""
    i, w = split_backward_ms(profile, cluster, layers, samples, tensor_width=t)
    comm = tensor_comm_ms(profile, cluster, layers, samples, t)
    if layers[0] == 0:
        w += comm
    else:
        i += comm
    f = tensor_compute_ms(profile, cluster, layers, samples, t)[0] if recompute else 0.0
    return i + f, w


def _parallel_allreduce_ms(cluster: Cluster, nbytes: float, stage: StagePlan) -> float:
    """AR of ``nbytes`` over each of the stage's t replica groups at once: one group's
    AllReduce (:func:`~dapple.cost.comm.allreduce_ms`), with its cross-server phase moving t
    times the bytes (the t groups of a server share its network interface)."""
    t = stage.tensor_width
    group = stage.replica_group(0)
    one = allreduce_ms(cluster, nbytes, group)
    k = len(server_counts(cluster, group))
    if not stage.parallel.tensor_parallel or k == 1:
        return one
    inter_bpms = cluster.inter_server_bandwidth_gbps * 1e9 / 8 / 1e3
    return one + (t - 1) * 2 * (k - 1) / k * nbytes / inter_bpms


def replica_sync_ms(
    cluster: Cluster, nbytes: float, stage: StagePlan, parallel: Parallelism, micro_batches: int
) -> float:
    """AR_s of a stage of width t_s over its r_s replicas sharded as ``parallel`` says (the
    stage's own layout, or it under a run-wide ZeRO floor), ``nbytes`` being its tensor-sharded
    gradient bytes (:func:`sharded_parameter_bytes`).

    t_s = 1 without ZeRO-3: :func:`~dapple.cost.comm.stage_sync_ms` exactly. Otherwise per
    tensor rank, the t_s groups in parallel (:func:`_parallel_allreduce_ms`): no ZeRO and
    ZeRO-1 AR, ZeRO-2 ``(M + 1) / 2`` AR, ZeRO-3 AR (one all-gather, one reduce-scatter per
    step), ZeRO-3 with ``regather`` 0 here (its traffic is per micro-batch,
    :func:`fsdp_pass_ms`).
    """
    reductions = parallel.gradient_reductions(micro_batches)
    if not parallel.tensor_parallel and not parallel.shards_params:
        return stage_sync_ms(cluster, nbytes, stage.devices, reductions)
    if parallel.regather:
        return 0.0
    ar = _parallel_allreduce_ms(cluster, nbytes, stage)
    return ar * (reductions + 1) / 2 if parallel.reduces_each_backward else ar


def fsdp_pass_ms(cluster: Cluster, nbytes: float, stage: StagePlan) -> tuple[float, float]:
    """ZeRO-3 with ``regather``: the traffic added to one forward and to one backward of a
    replica, ``(AG, AG + RS)``, each of all-gather and reduce-scatter half a ring AllReduce of
    the tensor-sharded parameter bytes ``nbytes`` (no overlap with compute: dapple's runtime;
    :func:`dapple.cost.overlap.exposed_fsdp_pass_ms` gives what a framework that prefetches
    leaves exposed); ``(0, 0)`` otherwise."""
    if not stage.parallel.regather:  # regather: ZeRO-3 only
        return 0.0, 0.0
    half = _parallel_allreduce_ms(cluster, nbytes, stage) / 2
    return half, 2 * half

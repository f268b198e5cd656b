"""Communication a training framework hides under compute: the exposed part of the data-parallel
and ZeRO traffic of a stage. Beyond the paper. Pure functions, no torch.

dapple's own runtime all-reduces (or reduce-scatters and gathers) a stage's gradients as a
separate action after its last backward, so its plans keep every byte on the critical path:
:data:`NO_OVERLAP`, the default of :func:`dapple.cost.terms.stage_terms` and of everything
that plans or reproduces the paper. A :class:`CommOverlap` describes another framework's
setting (:data:`FRAMEWORKS`), where the traffic runs on its own stream, layer by layer, under
the compute of the same pass:

* **gradient reduce** (``grad_reduce``): a layer's gradients are reduced (all-reduced, or
  reduce-scattered under ZeRO) as soon as its backward has produced them, while the backward
  of the layers before it runs. Megatron-core's ``overlap_grad_reduce`` ("the DP communication
  is chunked by the granularity of a Transformer layer and overlaps each communication chunk
  with computation. This overlap method exposes only one DP communication chunk", NeMo and
  Megatron-Bridge docs, *Communication Overlap*); FSDP2's reduce-scatter after each
  ``fully_shard`` unit's backward. With gradient accumulation only the last micro-batch's
  backward hides it (the reduce waits for the last gradients).
* **parameter gather** (``param_gather``): the all-gather of layer i+1's parameters runs
  during layer i's compute. FSDP2's implicit prefetch ("layer 1 all-gather can overlap with
  layer 0 forward compute ... The 1st all-gather will not be able to overlap with anything",
  PyTorch docs, *FSDP Notes*, FSDP prefetch nuances), once per pass of a re-gathering stage;
  Megatron's distributed optimizer gathers the updated parameters during the next step's
  first forward (``overlap_param_gather``).

Tensor-parallel all-reduces inside a block stay on the critical path (they sit between two
GEMMs of the same layer; no setting here hides them).

The model of one pass (:func:`layered_pass_exposed_ms`): a compute stream and one link, the
stage's layers in execution order; the traffic of the stage is split over its layers by their
parameter bytes (:func:`split_by_bytes`). With k equal layers of compute f and traffic c, of
totals F = k f and C = k c, it gives the two-stage flow shop's closed form
``C / k + (k - 1) / k x max(0, C - F)`` (:func:`equal_chunks_exposed_ms`): one chunk always
exposed, the rest hidden as long as the link keeps up with the compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dapple.core.parallelism import Parallelism
from dapple.errors import ValidationError

__all__ = [
    "FRAMEWORKS",
    "NO_OVERLAP",
    "CommOverlap",
    "equal_chunks_exposed_ms",
    "exposed_fsdp_pass_ms",
    "exposed_sync_ms",
    "layered_pass_exposed_ms",
    "split_by_bytes",
]


@dataclass(frozen=True, slots=True)
class CommOverlap:
    """Which of a stage's data-parallel and ZeRO traffic a framework runs under compute."""

    name: str
    grad_reduce: bool = False
    """Gradients reduced layer by layer during the (last) backward."""
    param_gather: bool = False
    """Parameters gathered one layer ahead during the forward (ZeRO-3: and the backward; ZeRO-1:
    the next step's first forward)."""
    source: str = ""
    """Where the framework documents the behaviour."""

    @property
    def any(self) -> bool:
        """Whether any traffic is hidden (False: the cost model's terms as without it)."""
        return self.grad_reduce or self.param_gather


NO_OVERLAP = CommOverlap(
    "dapple", source="dapple.runtime: the gradient AllReduce is an action after the last backward"
)
"""dapple's own runtime: nothing hidden."""

FRAMEWORKS: dict[str, CommOverlap] = {
    "dapple": NO_OVERLAP,
    "megatron": CommOverlap(
        "megatron",
        grad_reduce=True,
        param_gather=True,
        source="Megatron-core DistributedDataParallelConfig overlap_grad_reduce and "
        "overlap_param_gather (NeMo docs, Communication Overlap: chunked by transformer layer, "
        "one chunk exposed; NeMo-Framework-Launcher gpt3 configs: overlap_grad_sync and "
        "overlap_param_sync true)",
    ),
    "fsdp2": CommOverlap(
        "fsdp2",
        grad_reduce=True,
        param_gather=True,
        source="PyTorch FSDP2 fully_shard per block: implicit prefetch of the next all-gather "
        "(PyTorch docs, FSDP Notes), reduce-scatter after each unit's backward",
    ),
}
"""The overlap settings by framework name."""


def split_by_bytes(total_ms: float, layer_bytes: Sequence[float]) -> list[float]:
    """``total_ms`` of traffic split over layers in proportion to their bytes (all on the first
    layer when no layer has bytes)."""
    if not layer_bytes:
        return []
    whole = float(sum(layer_bytes))
    if whole <= 0:
        return [total_ms] + [0.0] * (len(layer_bytes) - 1)
    return [total_ms * (b / whole) for b in layer_bytes]  # the share first: no denormal product


def layered_pass_exposed_ms(
    compute: Sequence[float],
    gather: Sequence[float] | None = None,
    reduce: Sequence[float] | None = None,
) -> float:
    """The traffic of one pass over layers that its compute does not hide: the pass's end minus
    the sum of its compute.

    Layers in execution order (a backward: last layer first). Layer i computes once layer i-1
    has and its gather ``gather[i]`` is done; its reduce ``reduce[i]`` follows its compute. One
    link carries them in issue order ``G_0, G_1, R_0, G_2, R_1, ...``, each as soon as the link
    is free and its input is ready; ``G_{i+1}`` is issued when layer i starts computing (one
    layer ahead: not before layer i-1 has finished). Without gathers and reduces it is 0; with
    equal layers it is :func:`equal_chunks_exposed_ms`.

    Raises:
        ValidationError: the lists differ in length or hold a negative time.
    """
    k = len(compute)
    g = [0.0] * k if gather is None else list(gather)
    r = [0.0] * k if reduce is None else list(reduce)
    if len(g) != k or len(r) != k:
        raise ValidationError(
            f"compute, gather and reduce need one time per layer, got {k}, {len(g)}, {len(r)}"
        )
    if min([*compute, *g, *r], default=0.0) < 0:
        raise ValidationError(f"times must be >= 0, got compute {compute}, gather {g}, reduce {r}")
    if k == 0:
        return 0.0
    link = g[0]  # G_0 ends
    gathered = link
    done = 0.0  # the end of layer i-1's compute
    for i in range(k):
        before = done
        done = max(done, gathered) + compute[i]
        if i + 1 < k:  # G_{i+1} under layer i's compute
            link = max(link, before) + g[i + 1]
            gathered = link
        if r[i] > 0:
            link = max(link, done) + r[i]
    return max(done, link) - float(sum(compute))


def equal_chunks_exposed_ms(comm_ms: float, compute_ms: float, chunks: int) -> float:
    """The closed form of :func:`layered_pass_exposed_ms` for ``chunks`` equal layers with only
    gathers (or only reduces): ``C / k + (k - 1) / k x max(0, C - F)`` for C = ``comm_ms``,
    F = ``compute_ms`` and k = ``chunks``.

    Raises:
        ValidationError: ``chunks`` < 1 or a negative time.
    """
    if chunks < 1 or comm_ms < 0 or compute_ms < 0:
        raise ValidationError(
            f"need chunks >= 1 and times >= 0, got chunks={chunks}, comm={comm_ms}, "
            f"compute={compute_ms}"
        )
    return comm_ms / chunks + (chunks - 1) / chunks * max(0.0, comm_ms - compute_ms)


def exposed_sync_ms(
    overlap: CommOverlap,
    sync_ms: float,
    parallel: Parallelism,
    micro_batches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    layer_bytes: Sequence[float],
) -> float:
    """The exposed part of a stage's once-per-step synchronisation AR_s (``sync_ms``, as
    :func:`dapple.cost.tensor.replica_sync_ms` gives it).

    ``forward`` and ``backward``: per layer of the stage, in layer order, one micro-batch's
    compute on the slowest replica; ``layer_bytes``: the layers' gradient bytes (the traffic
    splits by them, :func:`split_by_bytes`); ``parallel``: how the stage's replicas shard
    their state. No ZeRO: the AllReduce under the last backward when ``grad_reduce``. ZeRO-1
    and 3 (once per step): AR_s is a reduce-scatter and an all-gather, half each; the
    reduce-scatter under the last backward (``grad_reduce``), the all-gather under the first
    forward (``param_gather``). ZeRO-2: ``(M + 1) / 2`` AR, a reduce-scatter under each of the
    M backwards and the all-gather.
    Without overlap (or no traffic): ``sync_ms`` unchanged.
    """
    if not overlap.any or sync_ms <= 0:
        return sync_ms
    fwd, bwd = list(forward), list(reversed(backward))
    fbytes, bbytes = list(layer_bytes), list(reversed(layer_bytes))
    if not parallel.shards_optimizer:
        if not overlap.grad_reduce:
            return sync_ms
        return layered_pass_exposed_ms(bwd, reduce=split_by_bytes(sync_ms, bbytes))
    reductions = parallel.gradient_reductions(micro_batches)
    half = sync_ms / (reductions + 1)
    rs = (
        layered_pass_exposed_ms(bwd, reduce=split_by_bytes(half, bbytes))
        if overlap.grad_reduce
        else half
    )
    ag = (
        layered_pass_exposed_ms(fwd, gather=split_by_bytes(half, fbytes))
        if overlap.param_gather
        else half
    )
    return reductions * rs + ag


def exposed_fsdp_pass_ms(
    overlap: CommOverlap,
    gather_ms: float,
    reduce_ms: float,
    forward: Sequence[float],
    backward: Sequence[float],
    layer_bytes: Sequence[float],
) -> tuple[float, float]:
    """The exposed traffic of one forward and one backward of a re-gathering ZeRO-3 stage:
    ``(forward extra, backward extra)``. The forward gathers every layer (``gather_ms`` in
    all); the backward gathers each again and reduce-scatters its gradients (``reduce_ms``).
    ``param_gather`` hides the gathers one layer ahead, ``grad_reduce`` the reduce-scatters
    (:func:`layered_pass_exposed_ms`); what is not hidden counts whole. Arguments as
    :func:`exposed_sync_ms`."""
    fwd, bwd = list(forward), list(reversed(backward))
    fbytes, bbytes = list(layer_bytes), list(reversed(layer_bytes))
    if overlap.param_gather:
        f_extra = layered_pass_exposed_ms(fwd, gather=split_by_bytes(gather_ms, fbytes))
        gather = split_by_bytes(gather_ms, bbytes)
    else:
        f_extra, gather = gather_ms, None
    reduce = split_by_bytes(reduce_ms, bbytes) if overlap.grad_reduce else None
    b_extra = layered_pass_exposed_ms(bwd, gather, reduce)
    b_extra += (0.0 if gather is not None else gather_ms) + (
        0.0 if reduce is not None else reduce_ms
    )
    return f_extra, b_extra

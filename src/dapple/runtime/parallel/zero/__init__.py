"""Sharded training state inside a replicated stage (ZeRO-1 and ZeRO-2, per stage).

DAPPLE replicates stage ``s`` on ``r_s`` devices and all-reduces its gradients, AR(P_s, g_s);
without sharding every replica then runs the same optimizer update on the whole stage and
keeps the whole optimizer state (Adam: two fp32 moments, 8 of the 16 bytes per parameter).
With ``TrainConfig.zero_stage`` (every replicated stage) or ``StagePlan.zero_stage`` (that
stage, as ``dapple plan --zero-stage`` records it) at 1 or 2, each replica of a stage with
``r_s > 1`` keeps and updates ``1/r_s`` of the stage's parameters (:class:`FlatShards`):

- ZeRO-1: the gradients accumulate over the step's micro-batches, in place, in flat bucket
  buffers (``p.grad`` is a view of its bucket: a parameter's first gradient of the step is
  copied in - no zeroing, no full-size add - later ones add to it); from the last backward on
  each bucket is reduce-scattered (``torch.distributed.reduce_scatter_single``, SUM) as soon
  as its gradients are final, so every replica receives the reduced gradient of its own chunk
  of the bucket - the bytes of the AllReduce's reduce-scatter half - while backward still runs.
- ZeRO-2: no full-size gradient buffer: after *every* micro-batch's backward each bucket is
  copied into a staging buffer, the parameters' gradients are freed and the bucket is
  reduce-scattered and added to this replica's gradient shard - M times ZeRO-1's gradient
  traffic, for ``1/r_s`` of the gradient memory (at most :data:`MAX_STAGED` buckets are staged
  at once).

In both, the optimizer's parameters are views of this replica's chunks of the flat parameter
buffers (:attr:`FlatShards.pieces`, cut at parameter boundaries so each keeps its weight-decay
group), their gradients views of the gradient shard; after the update every bucket is
all-gathered in place (``torch.distributed.all_gather_single``, :meth:`FlatShards.gather`),
the first layers' buckets first, and waited for by each layer as it next runs forward (a
forward pre-hook), so the gather overlaps the next step up to and during its forward.
torch 2.13 runs both on gloo (CPU) and NCCL (they are the ``reduce_scatter_tensor`` /
``all_gather_into_tensor`` of earlier releases, which 2.13 deprecates), but gloo's are slow: 4
CPU processes on 2 cores took 590-750 ms to reduce-scatter 29.5M floats - twice the 330-390 ms
of an AllReduce of them, with a temporary the size of the input - and 210-270 ms to all-gather
them. On gloo, the stage's group therefore reduces each chunk to its owner
(``torch.distributed.reduce``, one per replica, asynchronous: 175 ms, the reduce-scatter's
bytes, in place) and gathers by one ``broadcast`` per chunk from its owner (86-95 ms).

Design choices:
    - Layout: the stage's trainable parameters, in reverse order (the order backward makes
      their gradients final), are cut into buckets of about :data:`~dapple.core.buckets.BUCKET_BYTES`;
      a bucket of ``n`` elements is padded to ``P = r * ceil(n / r)`` and replica ``j`` owns
      its chunk ``[j P / r, (j + 1) P / r)``. The parameters become views of their bucket's
      flat buffer (built one bucket at a time, so the copy adds one bucket to the peak, not
      the stage). Each replica thus updates exactly ``1/r_s`` of every bucket, and a bucket's
      reduce-scatter can start while backward computes earlier layers.
    - The update of each element is the unsharded one (Adam/AdamW/SGD are elementwise), so a
      sharded run equals an unsharded one to rounding; the global gradient norm counts every
      replica's gradient shard (each element once over the replicas), clipping and fp16
      unscaling scale the shard.
    - Parameters of tied groups (``Workload.tied_parameters``, e.g. an embedding and the LM
      head that reuses it) keep whole gradients: they are summed across copies and stages
      (:mod:`dapple.runtime.sync`, the same traffic at every zero stage). Their optimizer
      state is sharded all the same: replica ``j`` updates elements ``[j c, (j + 1) c)``,
      ``c = ceil(n / r)``, of each copy from the summed gradient and broadcasts them to the
      stage's other replicas with the gather.
    - Parameters fewer replicas hold (an expert-parallel stage's expert shards, each held by
      the r_s / e_s replicas of its shard, :mod:`dapple.runtime.parallel.expert`) go into
      buckets of their own, laid out, reduce-scattered and gathered over those replicas only
      (:class:`ShardGroup`): each keeps ``e_s / r_s`` of their state.
    - Interleaved plans: a rank's chunks (virtual stages of one device group) share one
      :class:`FlatShards` over all their layers; no bucket spans two chunks, and each chunk's
      buckets are armed at its own backward (ZeRO-1: its last of the step; ZeRO-2: each), as
      the stage AllReduce arms them (:mod:`dapple.runtime.sync`).
    - Checkpoints stay complete and layer-keyed: at a save every replica sends the optimizer
      state of its pieces to replica 0 (:meth:`FlatShards.layer_states`), which writes each
      parameter's state whole; at a resume each replica slices its pieces' state out of the
      layer files (:func:`dapple.runtime.checkpoint.restore_stage`), so a checkpoint saved
      under any plan or zero stage resumes under any other.
"""

from dapple.runtime.parallel.zero.select import (
    ZeroSelection,
    build_shards,
    flat_parameters,
    select_zero,
    tied_parameters,
    unsharded_stages,
    zero_stage_of,
)
from dapple.runtime.parallel.zero.shards import (
    MAX_STAGED,
    TENSOR_COLLECTIVES_ENV,
    FlatShards,
    Piece,
    ShardGroup,
)

__all__ = [
    "MAX_STAGED",
    "TENSOR_COLLECTIVES_ENV",
    "FlatShards",
    "Piece",
    "ShardGroup",
    "ZeroSelection",
    "build_shards",
    "flat_parameters",
    "select_zero",
    "tied_parameters",
    "unsharded_stages",
    "zero_stage_of",
]

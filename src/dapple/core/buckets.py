"""The runtime's gradient buckets as data: their size, how many ZeRO-2 stages at once, and how
tensors are cut into them.

The runtime (:mod:`dapple.runtime.sync`'s AllReduce, :mod:`dapple.runtime.parallel.zero`'s
ZeRO-1/2 shards) cuts a replicated stage's parameters into buckets with :func:`bucket_runs`;
the memory model (:mod:`dapple.cost.memory`) cuts the stage's layers with the same function
and size. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["BUCKET_BYTES", "MAX_STAGED", "bucket_runs"]

BUCKET_BYTES = 25 * 2**20
"""Target size of one gradient bucket (the last one may be smaller, a large tensor larger).

DDP's default cap. Smaller buckets start earlier but each collective has a fixed cost: on a
2-core CPU box with 4 gloo processes (7 MB of gradients) 4 MiB buckets were 2.4% and 0.5 MiB
buckets 16% slower per step than one bucket, which there matches DDP (paired A/B in one group).
"""

MAX_STAGED = 2
"""ZeRO-2: buckets being reduced at once; launching another first waits for the oldest (so the
staged gradients take at most this many buckets, not the stage)."""


def bucket_runs(
    sizes: Sequence[float], cap_bytes: float, kinds: Sequence[object] | None = None
) -> list[list[int]]:
    """Consecutive runs of the indices of ``sizes`` (bytes, in bucket order) of one kind, each
    about ``cap_bytes``: a run takes the next tensor while it fits under the cap, so a run holds
    at least one tensor, and one larger than the cap is a run of its own.

    Args:
        sizes: each tensor's bytes.
        cap_bytes: the bucket size (:data:`BUCKET_BYTES` in the runtime).
        kinds: each tensor's kind, compared with ``!=`` (None: all one); a run never mixes
            kinds.

    Returns:
        The runs, as indices into ``sizes``.
    """
    runs: list[list[int]] = []
    size = 0.0
    for i, nbytes in enumerate(sizes):
        new_kind = kinds is not None and bool(runs) and kinds[runs[-1][0]] != kinds[i]
        if not runs or size + nbytes > cap_bytes or new_kind:
            runs.append([])
            size = 0.0
        runs[-1].append(i)
        size += nbytes
    return runs

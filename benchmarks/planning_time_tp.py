"""Planning time with the tensor-width search (issue 30): 80 shardable blocks on 512 H100s.

Times :func:`dapple.planner.search.dapple_search` side by side with widths {1} (today's search)
and {1, 2, 4, 8} (one search per width, :mod:`dapple.planner.widths`). The profile is a
synthetic Llama-70B-like block (bf16, sequence 2048, hidden 8192), all blocks
``tensor_parallel``. Run: ``.venv/bin/python benchmarks/planning_time_tp.py``.
"""

from __future__ import annotations

import time

from dapple.core.cluster import load_cluster
from dapple.core.profile import AffineTime, LayerProfile, ModelProfile
from dapple.planner.search import dapple_search

SEQ, HIDDEN = 2048, 8192


def _profile(n: int = 80) -> ModelProfile:
    block = LayerProfile(
        name="block",
        forward=AffineTime(fixed_ms=0.05, per_sample_ms=2.0),
        backward=AffineTime(fixed_ms=0.1, per_sample_ms=4.0),
        output_bytes_per_sample=2 * SEQ * HIDDEN,
        parameter_bytes=4 * 218_000_000,
        kept_activation_bytes_per_sample=34 * SEQ * HIDDEN * 2 / 4,
        tensor_parallel=True,
    )
    layers = tuple(LayerProfile(**{**_fields(block), "name": f"b{i}"}) for i in range(n))
    return ModelProfile(model_name=f"blocks{n}", layers=layers, precision="bf16")


def _fields(x: LayerProfile) -> dict[str, object]:
    return {f: getattr(x, f) for f in x.__slots__}  # type: ignore[attr-defined]


def main() -> None:
    prof, cluster = _profile(), load_cluster("h100-8x", servers=64)
    print("| widths | seconds | plan | widths chosen | M | L (ms) |")
    print("|---|---:|---|---|---:|---:|")
    for widths in ([1], None):
        t0 = time.perf_counter()
        plan = dapple_search(prof, cluster, 1024, tensor_widths=widths)
        dt = time.perf_counter() - t0
        chosen = sorted({s.tensor_width for s in plan.stages})
        name = "{1}" if widths else "{1, 2, 4, 8}"
        print(
            f"| {name} | {dt:.2f} | {plan.replication} | {chosen} | {plan.num_micro_batches} "
            f"| {plan.predicted_step_ms:.1f} |"
        )


if __name__ == "__main__":
    main()

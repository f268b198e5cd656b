"""Planning time with tensor widths: 80 shardable blocks on 512 H100s (64 servers of 8).

Times :func:`dapple.planner.search.dapple_search` with widths {1} (no tensor parallelism),
{1, 2, 4, 8} with every stage of one width (``stage_widths=False``: one search per width,
:mod:`dapple.planner.widths`), {1, 2, 4, 8} with per-stage widths (the default: each width's
plan refined stage by stage, :mod:`dapple.planner.stage_widths`), and that with interleaved 1F1B
(``interleaved=True``, :mod:`dapple.planner.interleaving`), also under ZeRO-3 (``zero_stage=3``:
the grid's FSDP points join), on two profiles:

* ``blocks80``: a synthetic Llama-70B-like block (bf16, sequence 2048, hidden 8192) repeated 80
  times, every block ``tensor_parallel``;
* ``llama3-70b``: the analytic H100 profile (:func:`dapple.profiler.analytic.analytic_profile`),
  80 shardable blocks between an embedding and an LM head that do not shard.

Run: ``.venv/bin/python benchmarks/planning_time_tp.py``. Seconds are wall-clock (as in
``planning_time.md``) and CPU seconds of this process (less sensitive to other jobs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import load_cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.profile import ModelProfile
from dapple.planner.search import dapple_search
from dapple.profiler.analytic import analytic_profile

SEQ, HIDDEN = 2048, 8192
GLOBAL_BATCH = 1024


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


def _widths(stages: Sequence[int]) -> str:
    """Per-group widths, runs of one width compressed: ``2x3, 8x2`` for 2, 2, 2, 8, 8."""
    runs: list[list[int]] = []
    for t in stages:
        if runs and runs[-1][0] == t:
            runs[-1][1] += 1
        else:
            runs.append([t, 1])
    return ", ".join(f"{t}x{n}" for t, n in runs)


def _row(name: str, prof: ModelProfile, cluster: Cluster, label: str, kw: dict[str, object]) -> str:
    t0, c0 = time.perf_counter(), time.process_time()
    plan = dapple_search(prof, cluster, GLOBAL_BATCH, **kw)  # type: ignore[arg-type]
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    widths = _widths([s.tensor_width for s in plan.stages[: plan.num_groups]])
    chunks = f" interleaved v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return (
        f"| {name} | {label} | {wall:.2f} | {cpu:.2f} | {plan.replication}{chunks} | {widths} "
        f"| {plan.num_micro_batches} | {plan.predicted_step_ms:.1f} |"
    )


def table() -> list[str]:
    """The markdown table, one row per profile and widths (printed as each row is done)."""
    cluster = load_cluster("h100-8x", servers=64)
    lines = [
        "| profile | widths | seconds | CPU s | plan (replicas per group) | widths per group | M | L (ms) |",
        "|---|---|---:|---:|---|---|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    runs: list[tuple[str, dict[str, object]]] = [
        ("{1}", {"tensor_widths": [1]}),
        ("{1, 2, 4, 8} uniform", {"stage_widths": False}),
        ("{1, 2, 4, 8} per stage", {}),
        ("{1, 2, 4, 8} per stage, interleaved", {"interleaved": True}),
        ("{1, 2, 4, 8} per stage, ZeRO-3, interleaved", {"zero_stage": 3, "interleaved": True}),
    ]
    for name, prof in (("blocks80", _profile()), ("llama3-70b", analytic_profile("llama3-70b"))):
        for label, kw in runs:
            lines.append(_row(name, prof, cluster, label, kw))
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    table()


if __name__ == "__main__":
    main()

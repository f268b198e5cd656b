"""Cost by sequence length: is a layer's time affine in tokens, and how well does the planner's
interpolation in tokens predict a length it was not measured at?

Profiles the zoo transformer (its token dimension declared dynamic) at several lengths and
batch sizes on one CPU thread (``profile_workload(seq_lens=...)``), then reports:

* the whole model's forward + backward time at each (length, batch size) and per token, with a
  least-squares line ``t = c0 + c1 * tokens`` over all points and each point's deviation;
* held-out lengths: the profile without a length (only the shortest and longest, or all the
  others) predicts it (:func:`dapple.cost.at_length.length_profile`), beside the plain
  per-sample chord between its neighbours;
* the planner for a length distribution: predicted step time and peak stage memory of plans
  for a mean of the shortest, the middle and the longest length, and for the middle length
  with the longest as maximum.

Usage: ``python benchmarks/seq_lengths.py [--lengths 128,256,512,1024] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from _bench_common import HERE, header
from dapple.core.profile import ModelProfile
from dapple.cost.at_length import length_profile
from dapple.cost.pipeline import pipeline_latency
from dapple.models.zoo import transformer
from dapple.planner import make_plan
from dapple.profiler.measure import profile_workload

MODEL = {"layers": 2, "hidden": 256, "heads": 4, "vocab": 1024}


def _ms(layers: tuple, b: int) -> float:  # type: ignore[type-arg]
    return sum(x.forward.at(b) + x.backward.at(b) for x in layers)


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - slope * mx, slope


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="128,256,512,1024")
    ap.add_argument("--batch-sizes", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "seq_lengths.md"))
    args = ap.parse_args()
    lens = sorted(int(x) for x in args.lengths.split(","))
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    wl = transformer(**MODEL, seq=lens[-1], seq_choices=[lens[0], lens[-1]])
    prof = profile_workload(wl, sizes, "cpu", warmup=1, repeats=args.repeats, num_threads=1,
                            seq_lens=lens)  # fmt: skip
    cmd = "python benchmarks/seq_lengths.py " + " ".join(sys.argv[1:])
    out = header("Cost by sequence length: time in tokens, interpolation, plans", cmd.strip())
    out += [
        f"Zoo transformer {MODEL}, token dimension dynamic; `profile_workload` at lengths "
        f"{lens} x batch sizes {sizes}, one thread, median of {args.repeats} after 1 warm-up, "
        "affine fit in the batch size at each length (the profile's terms).",
        "",
        "## Whole model forward + backward by length",
        "",
        "| length | batch | tokens | fwd+bwd ms | us/token | us/token vs the shortest length |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    first = {b: _ms(prof.by_length[0].layers, b) / (b * prof.seq_lens[0]) for b in sizes}
    points = []
    for x in prof.by_length:
        for b in sizes:
            n, ms = b * x.seq_len, _ms(x.layers, b)
            points.append((float(n), ms))
            out.append(f"| {x.seq_len:g} | {b} | {n:g} | {ms:.2f} | {ms * 1e3 / n:.1f} | "
                       f"{ms / n / first[b]:.2f}x |")  # fmt: skip
    c0, c1 = _line(points)
    worst = max(abs(c0 + c1 * n - ms) / ms for n, ms in points)
    out += [
        "",
        f"One line through all points, t = c0 + c1 tokens (least squares): c0 = {c0:.2f} ms, "
        f"c1 = {c1 * 1e3:.2f} us/token, worst deviation {100 * worst:.0f}% of the measured time.",
        "",
    ]
    out += ["Kept activations per token (all layers): " + ", ".join(
        f"{sum(y.kept_activation_bytes_per_sample for y in x.layers) / x.seq_len / 1024:.1f} KiB"
        f" at {x.seq_len:g}" for x in prof.by_length) + ".", ""]  # fmt: skip
    out += _held_out(prof, sizes)
    out += _plans(prof, lens)
    Path(args.out).write_text("\n".join(out) + "\n")
    print("\n".join(out))
    return 0


def _held_out(prof: ModelProfile, sizes: list[int]) -> list[str]:
    first, last = prof.seq_lens[0], prof.seq_lens[-1]
    out = [
        "## Held-out lengths: predicted without their measurement",
        "",
        f"| length | batch | measured ms | from {first:g} and {last:g} | error | from all other "
        "lengths | error | chord from the others (per-sample linear) | error |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ends = dataclasses.replace(prof, by_length=(prof.by_length[0], prof.by_length[-1]))
    for k, x in enumerate(prof.by_length[1:-1], start=1):
        others = dataclasses.replace(prof, by_length=prof.by_length[:k] + prof.by_length[k + 1 :])
        lo, hi = prof.by_length[k - 1], prof.by_length[k + 1]
        w = (x.seq_len - lo.seq_len) / (hi.seq_len - lo.seq_len)
        a, c = length_profile(ends, x.seq_len), length_profile(others, x.seq_len)
        for b in sizes:
            m = _ms(x.layers, b)
            chord = (1 - w) * _ms(lo.layers, b) + w * _ms(hi.layers, b)
            row = [f"{x.seq_len:g}", str(b), f"{m:.2f}"]
            for p in (_ms(a.layers, b), _ms(c.layers, b), chord):
                row += [f"{p:.2f}", f"{100 * (p - m) / m:+.1f}%"]
            out.append("| " + " | ".join(row) + " |")
    return [*out, ""]


def _plans(prof: ModelProfile, lens: list[int]) -> list[str]:
    from dapple.core.cluster_presets import load_cluster

    cluster, gbs = load_cluster("local-cpu"), 8
    mid = lens[len(lens) // 2]
    out = [
        f"## Plans on `local-cpu` ({cluster.num_devices} devices), global batch {gbs}",
        "",
        "| --mean-seq-len | plan | predicted L ms | peak stage memory MiB |",
        "|---|---|---:|---:|",
    ]
    for mean, top in [(lens[0], lens[0]), (mid, mid), (lens[-1], lens[-1]), (mid, lens[-1])]:
        plan = make_plan(prof, cluster, gbs, mean_seq_len=mean, max_seq_len=top)
        r = pipeline_latency(plan, prof, cluster)
        peak = max(s.memory_bytes for s in r.stages) / 2**20
        out.append(f"| {mean},{top} | {plan.replication} M={plan.num_micro_batches} | "
                   f"{plan.predicted_step_ms:.1f} | {peak:.1f} |")  # fmt: skip
    return [*out, ""]


if __name__ == "__main__":
    raise SystemExit(main())

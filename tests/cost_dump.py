"""Dump every number the cost model and the simulator give for the paper's profiles, as JSON.

A behaviour check for refactors of the cost model (:mod:`dapple.cost`), not a pytest test:
dump before a change, dump after, and compare - every number must be equal, bit for bit
(floats are written with ``repr``, which round-trips exactly).

    python tests/cost_dump.py --out /tmp/cost_before.json
    python tests/cost_dump.py --out /tmp/cost_after.json
    python tests/cost_dump.py --compare /tmp/cost_before.json /tmp/cost_after.json

A full dump takes an hour on a loaded machine; ``--out-dir`` writes each model x cluster pair
(``MODEL@CLUSTER.json``) and the extra cases (``extra.json``) as each one ends, skipping files
already there, so it can run one pair at a time (``--pairs bert48/paper-a --no-extra``) and
resume. ``--compare`` takes two such folders as well and compares the files both hold:

    python tests/cost_dump.py --out-dir /tmp/before --pairs vgg19/paper-b
    python tests/cost_dump.py --compare /tmp/before /tmp/after

For each paper profile (``paper:NAME``) and cluster (``paper-a``, ``paper-b``, ``paper-c``,
``h100-8x``) and every planner of :data:`dapple.planner.PLANNERS`: the plan (``to_dict``), the
scorer's answer for its stages (the plan it builds), :func:`pipeline_latency` (every field),
:func:`schedule_latency`, the simulated step, and :func:`best_per_schedule` on the plan (each
variant's plan, predicted and simulated step, per-group memory); :func:`best_schedule` on the
DAPPLE plan. Then cases the paper clusters do not reach: ZeRO stages, CPU hosts with host terms
and shared compute, and a profile measured at several sequence lengths. Last (``profiles``):
analytic profiles across models, devices and options, the DAPPLE plan of some of them, and the
sizes of tiny measured profiles, for refactors of the profilers.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

from dapple.core.cluster import Cluster
from dapple.core.cluster_presets import PRESETS
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan
from dapple.core.profile import LengthProfile, ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.cost.schedule_step import (
    activation_peak_bytes,
    device_memory_by_group,
    schedule_latency,
)
from dapple.errors import DappleError
from dapple.planner import PLANNERS, make_plan
from dapple.planner.schedule_choice import best_per_schedule, best_schedule
from dapple.planner.scorer import Scorer
from dapple.profiler.paper_models import PAPER_GLOBAL_BATCH, PAPER_MODELS, load_profile
from dapple.simulate.engine import SimResult, simulate

CLUSTERS = ("paper-a", "paper-b", "paper-c", "h100-8x")


def _err(e: Exception) -> dict[str, str]:
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def _sim(res: SimResult) -> dict[str, Any]:
    return {
        "step_ms": res.step_ms,
        "L_ms": res.L_ms,
        "peak_memory_bytes": res.peak_memory_bytes,
        "devices": [dataclasses.asdict(d) for d in res.devices],
        "events": _events_digest(res),
    }


def _events_digest(res: SimResult) -> dict[str, Any]:
    """The events as a count and a SHA-256 of their exact ``repr`` (the full list is large)."""
    rows = [(e.device, str(e.action), e.start_ms, e.end_ms, e.nbytes) for e in res.events]
    return {"count": len(rows), "sha256": hashlib.sha256(repr(rows).encode()).hexdigest()}


def _costs(plan: Plan, profile: ModelProfile, cluster: Cluster, events: bool) -> dict[str, Any]:
    """Every cost-model number of one plan."""
    out: dict[str, Any] = {"plan": plan.to_dict()}
    try:
        out["pipeline_latency"] = dataclasses.asdict(pipeline_latency(plan, profile, cluster))
    except DappleError as e:
        out["pipeline_latency"] = _err(e)
    try:
        out["schedule_latency"] = schedule_latency(plan, profile, cluster)
    except DappleError as e:
        out["schedule_latency"] = _err(e)
    try:
        out["memory_by_group"] = device_memory_by_group(plan, profile)
        out["activation_peaks"] = activation_peak_bytes(plan, profile)
    except DappleError as e:
        out["memory_by_group"] = _err(e)
    try:
        sim = _sim(simulate(plan, profile, cluster))
        if not events:
            del sim["events"]
        out["simulate"] = sim
    except DappleError as e:
        out["simulate"] = _err(e)
    if plan.virtual_stages == 1 and plan.schedule in ("dapple", "gpipe"):
        sc = Scorer(profile, cluster, plan.global_batch_size)
        stages = [(*st.layers, st.devices) for st in plan.stages]
        got = sc.score(stages, plan.num_micro_batches, schedule=plan.schedule)
        # as the plan it builds: L, and per stage re-computation, D, zero stage and regather
        out["scorer"] = (
            None
            if got is None
            else sc.build_plan("scorer", stages, plan.num_micro_batches, got).to_dict()
        )
    return out


def _choices(choices: list[Any], profile: ModelProfile, cluster: Cluster) -> list[Any]:
    out = []
    for c in choices:
        row: dict[str, Any] = {"label": c.label, "note": c.note}
        if c.plan is not None and c.result is not None:
            row["result"] = _sim(c.result)
            del row["result"]["events"]
            row.update(_costs(c.plan, profile, cluster, events=False))
        out.append(row)
    return out


def _planned(
    profile: ModelProfile,
    cluster: Cluster,
    gbs: int,
    planner: str,
    counts: list[int] | None = None,
    **plan_kw: Any,
) -> tuple[Plan | None, dict[str, Any]]:
    """A planner's plan and its row: every cost-model number and :func:`best_per_schedule` over
    the micro-batch counts ``counts`` (default: its own), or the error that stopped it."""
    try:
        plan = make_plan(profile, cluster, gbs, planner, **plan_kw)
    except DappleError as e:
        return None, _err(e)
    row = _costs(plan, profile, cluster, events=True)
    row["best_per_schedule"] = _choices(
        best_per_schedule([plan], profile, cluster, counts), profile, cluster
    )
    return plan, row


def dump_pair(model: str, cname: str, best: bool) -> dict[str, Any]:
    """Every planner's plan and numbers for one paper profile on one cluster preset."""
    profile = load_profile(f"paper:{model}")
    gbs = PAPER_GLOBAL_BATCH[model]
    cluster = PRESETS[cname]
    entry: dict[str, Any] = {}
    for planner in PLANNERS:
        plan, row = _planned(profile, cluster, gbs, planner)
        if best and plan is not None and planner == "dapple":
            try:
                chosen, every = best_schedule(plan, profile, cluster)
                row["best_schedule"] = {
                    "chosen": chosen.label,
                    "choices": _choices(every, profile, cluster),
                }
            except DappleError as e:
                row["best_schedule"] = _err(e)
        entry[planner] = row
    return entry


def dump_paper(pairs: list[tuple[str, str]], best: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, cname in pairs:
        t0 = time.perf_counter()
        out[f"{model}/{cname}"] = dump_pair(model, cname, best)
        print(f"{model}/{cname}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def _lengths_profile() -> ModelProfile:
    """Six layers measured at three lengths (times and bytes linear in the tokens)."""

    def layer(i: int, L: float) -> LayerProfile:
        return LayerProfile(
            name=f"l{i}",
            forward=AffineTime(fixed_ms=0.1, per_sample_ms=0.01 * (1 + i % 3) * L),
            backward=AffineTime(fixed_ms=0.2, per_sample_ms=0.02 * (1 + i % 3) * L),
            output_bytes_per_sample=4.0 * 64 * L,
            parameter_bytes=40_000 * (1 + i),
            kept_activation_bytes_per_sample=2048.0 * L,
        )

    by_length = tuple(
        LengthProfile(
            seq_len=L,
            layers=tuple(layer(i, L) for i in range(6)),
            input_bytes_per_sample=8.0 * L,
        )
        for L in (128, 512, 1024)
    )
    return ModelProfile(
        model_name="lm",
        layers=by_length[-1].layers,
        input_bytes_per_sample=by_length[-1].input_bytes_per_sample,
        batch_sizes=(1, 2, 4),
        seq_len=1024,
        by_length=by_length,
        update_ms_per_parameter_byte=1e-6,
    )


def dump_extra() -> dict[str, Any]:
    """ZeRO stages, host terms and shared compute, sequence lengths, a measured update."""
    out: dict[str, Any] = {}
    bert = load_profile("paper:bert48")
    gnmt = load_profile("paper:gnmt16")
    small_mem = dataclasses.replace(PRESETS["paper-a"], device_memory_bytes=8 * 2**30)
    for zero in (1, 2, "auto"):
        for name, profile, gbs in (("bert48", bert, 64), ("gnmt16", gnmt, 1024)):
            key = f"zero{zero}/{name}"
            try:
                plan = make_plan(profile, small_mem, gbs, "dapple", zero_stage=zero)
            except DappleError as e:
                out[key] = _err(e)
                continue
            row = _costs(plan, profile, small_mem, events=True)
            for z in (1, 2):
                row[f"pipeline_latency_zero{z}"] = dataclasses.asdict(
                    pipeline_latency(plan, profile, small_mem, zero_stage=z)
                )
            out[key] = row
    cpu = dataclasses.replace(
        PRESETS["local-cpu"],
        action_overhead_ms=0.124,
        step_overhead_ms=4.71,
        comm_cpu_ms_per_mb=0.163,
    )
    shared = dataclasses.replace(cpu, compute_cores_per_server=1.95, background_load_per_server=0.3)
    cores_only = dataclasses.replace(PRESETS["local-cpu"], compute_cores_per_server=2.5)
    updating = dataclasses.replace(gnmt, update_ms_per_parameter_byte=2e-9)
    for cname, cluster in (("host", cpu), ("shared", shared), ("cores", cores_only)):
        for pname, profile, gbs in (("gnmt16", gnmt, 64), ("gnmt16-update", updating, 64)):
            for planner in ("dapple", "dp", "straight", "gpipe"):
                _, out[f"{cname}/{pname}/{planner}"] = _planned(
                    profile, cluster, gbs, planner, [4, 8]
                )
    lm = _lengths_profile()
    lm_cluster = dataclasses.replace(PRESETS["local-cpu"], device_memory_bytes=2**26)
    for planner in ("dapple", "dp", "straight"):
        for seq in ((None, None), (320.0, 1024.0), (700.0, 900.0)):
            _, out[f"lengths/{planner}/{seq[0]}"] = _planned(
                lm, lm_cluster, 16, planner, [2, 4], mean_seq_len=seq[0], max_seq_len=seq[1]
            )
    return out


_TIMES = ("forward", "backward", "backward_input", "backward_weight")


def _measured_sizes(profile: ModelProfile) -> dict[str, Any]:
    """A measured profile without its times (they differ run to run): sizes, names, flags."""
    d: dict[str, Any] = profile.to_dict()
    for layer in d["layers"]:
        for k in _TIMES:
            layer.pop(k, None)
    for k in ("update_ms_per_parameter_byte", "by_length"):
        d.pop(k, None)
    return d


def dump_profiles() -> dict[str, Any]:
    """Analytic profiles (:func:`analytic_profile`, one option varied at a time from each
    model's base, on every device and precision) with the DAPPLE plan of a few of them, and
    the sizes of measured tiny zoo profiles (:func:`profile_workload`, one thread)."""
    from dapple.models.zoo import get_workload
    from dapple.profiler.analytic import analytic_profile
    from dapple.profiler.analytic_devices import DEVICES
    from dapple.profiler.measure import profile_workload

    out: dict[str, Any] = {}
    models: dict[str, dict[str, Any]] = {
        "llama3-8b": {"seq_len": 2048},
        "mixtral-8x7b": {"seq_len": 1024},
        "transformer": {"overrides": {"layers": 4, "hidden": 64, "heads": 4, "seq": 32}},
    }
    variants: list[dict[str, Any]] = [{}, {"fold_ends": True}, {"batch_sizes": (2, 3, 5)}]
    variants += [{"recompute": r} for r in ("selective", "full")]
    variants += [{"attention": a} for a in ("flash", "eager", "masked")]
    variants += [{"kernels": k} for k in ("eager", "fused")]
    for model, base in models.items():
        for dev in DEVICES:
            for prec in ("fp32", "bf16", "fp16", "fp8"):
                for v in variants:
                    kw = {**base, **v, "precision": prec}
                    key = f"analytic/{model}/{dev}/{prec}/{sorted(v.items())}"
                    try:
                        out[key] = analytic_profile(model, dev, **kw).to_dict()
                    except DappleError as e:
                        out[key] = _err(e)
    h100 = PRESETS["h100-8x"]
    clusters = {"h100-8x": h100, "h100-32": dataclasses.replace(h100, servers=4)}
    for model, base in models.items():
        profile = analytic_profile(model, "h100", **base)
        for cname, cluster in clusters.items():
            for kw in ({}, {"interleave": True}, {"zero_stage": "auto"}, {"zero_stage": 3}):
                key = f"plan/{model}/{cname}/{sorted(kw.items())}"
                _, out[key] = _planned(profile, cluster, 64, "dapple", **kw)
    for name, over in (
        ("transformer", {"layers": 2, "hidden": 32, "heads": 2, "seq": 8, "vocab": 64}),
        ("gnmt", {"layers": 4, "hidden": 8, "vocab": 20, "seq": 4}),
        ("mlp", {}),
    ):
        w = get_workload(name, **over)
        for kw in ({}, {"split_backward": True}, {"precision": "bf16"}):
            prof = profile_workload(w, [1, 2], warmup=0, repeats=1, num_threads=1, **kw)
            out[f"measured/{name}/{sorted(kw.items())}"] = _measured_sizes(prof)
    return out


def _walk(a: Any, b: Any, path: str, stats: dict[str, int], diffs: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                diffs.append(f"{path}/{k}: only in {'after' if k in b else 'before'}")
                continue
            _walk(a[k], b[k], f"{path}/{k}", stats, diffs)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            diffs.append(f"{path}: length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _walk(x, y, f"{path}[{i}]", stats, diffs)
    elif isinstance(a, (int, float)) and not isinstance(a, bool):
        stats["numbers"] += 1
        same = type(a) is type(b) and (a == b or (math.isnan(a) and math.isnan(b)))
        if same:
            stats["equal"] += 1
        else:
            diffs.append(f"{path}: {a!r} != {b!r}")
    else:
        stats["other"] += 1
        if a != b:
            diffs.append(f"{path}: {a!r} != {b!r}")


def _kind(path: str) -> str:
    """A difference's path without list indices: the field it is, for counting by kind."""
    return re.sub(r"\[\d+\]", "[]", path)


def _compare_trees(a: Any, b: Any, name: str) -> tuple[dict[str, int], list[str]]:
    stats = {"numbers": 0, "equal": 0, "other": 0}
    diffs: list[str] = []
    _walk(a, b, name, stats, diffs)
    return stats, diffs


def _load_pairs(folder: Path) -> dict[str, Any]:
    return {f.stem: json.loads(f.read_text()) for f in sorted(folder.glob("*.json"))}


def compare(before: Path, after: Path, limit: int = 50) -> int:
    """Compare two dumps (files, or ``--out-dir`` folders file by file); 1 if any differ."""
    if before.is_dir() and after.is_dir():
        a, b = _load_pairs(before), _load_pairs(after)
        for name in sorted(set(a) ^ set(b)):
            print(f"{name}: only in {'after' if name in b else 'before'} (not compared)")
        common = sorted(set(a) & set(b))
        a = {k: a[k] for k in common}
        b = {k: b[k] for k in common}
    else:
        a, b = json.loads(before.read_text()), json.loads(after.read_text())
    stats, diffs = _compare_trees(a, b, "")
    print(
        f"{stats['numbers']} numbers compared, {stats['equal']} equal; "
        f"{stats['other']} other values; {len(diffs)} differences"
    )
    kinds: dict[str, int] = {}
    for d in diffs:
        k = _kind(d.split(": ", 1)[0])
        kinds[k] = kinds.get(k, 0) + 1
    for k, n in sorted(kinds.items()):
        print(f"  {n:6d}  {k}")
    for d in diffs[:limit]:
        print("  " + d)
    return 0 if not diffs else 1


def _pairs(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.pairs is None:
        return [(m, c) for m in args.models for c in args.clusters]
    out = []
    for p in args.pairs:
        model, _, cname = p.partition("/")
        if model not in PAPER_MODELS or cname not in CLUSTERS:
            raise SystemExit(
                f"--pairs {p!r}: want MODEL/CLUSTER with MODEL in {', '.join(PAPER_MODELS)} "
                f"and CLUSTER in {', '.join(CLUSTERS)}"
            )
        out.append((model, cname))
    return out


def _write(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".part")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def dump_to_dir(folder: Path, pairs: list[tuple[str, str]], best: bool, extra: bool) -> None:
    """Write each pair, then the extra cases, to its own file as it ends; skip files present."""
    folder.mkdir(parents=True, exist_ok=True)
    jobs: list[tuple[str, Any]] = [
        (f"{m}@{c}", lambda m=m, c=c: dump_pair(m, c, best)) for m, c in pairs
    ]
    if extra:
        jobs += [("extra", dump_extra), ("profiles", dump_profiles)]
    for name, job in jobs:
        path = folder / f"{name}.json"
        if path.exists():
            print(f"{name}: {path} exists, skipped", file=sys.stderr, flush=True)
            continue
        t0 = time.perf_counter()
        _write(path, job())
        print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--out-dir", type=Path, help="one JSON file per pair, written as each ends")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--limit", type=int, default=50, help="differences printed by --compare")
    ap.add_argument("--models", nargs="*", default=list(PAPER_MODELS))
    ap.add_argument("--clusters", nargs="*", default=list(CLUSTERS))
    ap.add_argument("--pairs", nargs="*", metavar="MODEL/CLUSTER", help="instead of the grid")
    ap.add_argument("--no-extra", action="store_true", help="skip the extra cases")
    ap.add_argument("--no-best", action="store_true", help="skip best_schedule (slow)")
    args = ap.parse_args(argv)
    if args.compare:
        before, after = args.compare
        return compare(before, after, limit=args.limit)
    pairs = _pairs(args)
    t0 = time.perf_counter()
    if args.out_dir:
        dump_to_dir(args.out_dir, pairs, not args.no_best, not args.no_extra)
    else:
        data: dict[str, Any] = {"paper": dump_paper(pairs, not args.no_best)}
        if not args.no_extra:
            data["extra"] = dump_extra()
            data["profiles"] = dump_profiles()
        text = json.dumps(data, indent=1, sort_keys=True)
        if args.out:
            args.out.write_text(text)
        else:
            print(text)
    print(f"done in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

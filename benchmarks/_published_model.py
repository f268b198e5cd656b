"""A published run as a dapple plan, and dapple's prediction of it (``published.py``).

Loads and checks ``published_runs.toml``; builds each row's analytic profile
(:func:`dapple.profiler.analytic.analytic_profile`, torchtitan's checkpointing policies from
:mod:`_published_ac`), its cluster, and its own configuration as a dapple :class:`Plan`
(:func:`plan_for`): ``pp`` stages, each of ``dp x fsdp`` replicas of tensor width ``tp``
(Megatron's and torchtitan's rank order: tensor groups of consecutive GPUs inside a node,
replicas next, pipeline stages outermost), ZeRO-3 over the replicas for FSDP (re-gathered
per micro-batch without pipelining, as FSDP2's ``reshard_after_forward`` and Megatron's FSDP
do; gathered once per step with pipelining, torchtitan's default there), ZeRO-1 for Megatron's
distributed optimizer, interleaving for ``vp``. :func:`predict` simulates it
(:func:`dapple.simulate.simulate`) and costs L (:func:`dapple.cost.schedule_latency`).

Efficiencies: the library's (:mod:`dapple.profiler.analytic_devices`; on the H100 in 16 bits
its ``fused`` fit, :func:`kernels_for`), except that each
(part, precision) of :data:`FIT_ROWS` has its ``matmul`` efficiency fitted on exactly that row
(:func:`efficiency_for`): re-fitted here by bisection when the library's constant is a prior.
A part is the GPU, or ``gpu@<W>W`` for a row whose cluster states a power limit
(``power_w``): torchtitan's H100s run at 500 W, not the 700 W of a DGX H100.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _bench_common import HERE
from _published_ac import TORCHTITAN_POLICIES, apply_policy
from dapple.core.cluster import GIB, Cluster
from dapple.core.plan import Plan, StagePlan, interleave
from dapple.core.profile import ModelProfile
from dapple.core.recompute import Recompute
from dapple.cost import schedule_latency
from dapple.cost.overlap import FRAMEWORKS, NO_OVERLAP, CommOverlap
from dapple.profiler.analytic import analytic_profile
from dapple.profiler.analytic_devices import (
    DEVICES,
    FITTED,
    HOPPER,
    DeviceSpec,
    Efficiency,
    fitted_efficiency,
)
from dapple.profiler.analytic_presets import PRESETS, resolve_spec
from dapple.simulate import simulate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DATA = HERE / "published_runs.toml"

FIT_ROWS: dict[tuple[str, str], str] = {
    ("v100", "fp32"): "dapple-paper-bert48-dapple-m16",
    ("v100", "fp16"): "megatron-v1-gpt2-1.2b",
    ("h100", "fp8"): "nemo-2407-llama2-7b",
    ("h100@500W", "bf16"): "torchtitan-h100-8b-fsdp8",
    ("h100@500W", "fp8"): "torchtitan-h100-8b-fsdp8-compile-float8",
    ("a100", "bf16"): "torchtitan-a100-llama2-13b-none",
}
"""The one row each fitted (part, precision) efficiency comes from."""

REFUSED_FITS: dict[tuple[str, str], str] = {}
"""Fits tried and not used: the row's predicted throughput stays below the published one
even at matmul efficiency 1 (published.md says why); the (part, precision) keeps its prior.
None today: the A100 bf16 fit, refused while FSDP's traffic was all charged on the critical
path, fits once FSDP2's overlap is modelled (:func:`overlap_for`)."""

_CHECKPOINT = {"none": "none", "stage": "none", "full": "full", "selective": "selective",
               "selective-op": "none", "selective-layer": "none"}  # fmt: skip
"""A row's checkpointing -> the analytic profile's (``stage``: the plan re-computes whole
stages; torchtitan's op and layer policies are then applied by :mod:`_published_ac`)."""

_REQUIRED = {
    "cluster": ("gpu", "detail", "gpus", "gpus_per_node", "nodes", "memory_gib"),
    "parallel": ("dp", "fsdp", "tp", "pp", "cp", "vp", "schedule", "micro_batch",
                 "global_batch", "seq_len", "checkpoint", "precision"),
}  # fmt: skip
_METRICS = ("tokens_per_s_per_gpu", "samples_per_s", "step_ms", "model_tflops_per_gpu", "mfu",
            "memory_gib", "memory_gb_avg", "oom")  # fmt: skip


def load_runs(path: Path = DATA) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """``(sources, runs)`` of the data file, checked (:func:`check_runs`)."""
    data = tomllib.loads(path.read_text())
    sources, runs = data.get("sources", {}), data.get("run", [])
    check_runs(sources, runs)
    return sources, runs


def _row_problems(r: dict[str, Any], sources: dict[str, dict[str, Any]]) -> list[str]:
    rid = r.get("id", "?")
    bad = []
    src = sources.get(r.get("source", ""))
    if src is None or not r.get("locator") or not (src.get("repo") or src.get("where")):
        bad.append(f"{rid}: no source with a repository or paper, or no locator")
    if r.get("model") not in PRESETS:
        bad.append(f"{rid}: model {r.get('model')!r} is not a preset")
    for group, keys in _REQUIRED.items():
        missing = [k for k in keys if k not in r.get(group, {})]
        if missing:
            bad.append(f"{rid}: {group} lacks {missing}")
    c, p = r.get("cluster", {}), r.get("parallel", {})
    if c.get("gpu") not in DEVICES:
        bad.append(f"{rid}: unknown gpu {c.get('gpu')!r}")
    width = math.prod(p.get(k, 1) for k in ("dp", "fsdp", "tp", "pp", "cp"))
    if width != c.get("gpus") or c.get("gpus") != c.get("gpus_per_node", 0) * c.get("nodes", 0):
        bad.append(f"{rid}: dp x fsdp x tp x pp x cp = {width} GPUs, cluster {c.get('gpus')}")
    pub = r.get("published", {})
    if not pub or any(k not in _METRICS for k in pub):
        bad.append(f"{rid}: published must hold some of {_METRICS}, got {sorted(pub)}")
    return bad


def check_runs(sources: dict[str, dict[str, Any]], runs: list[dict[str, Any]]) -> None:
    """Every row names a known source and locator, a preset model, a full cluster and parallel
    configuration consistent with its GPU count, and at least one published number.

    Raises:
        ValueError: one line per problem.
    """
    bad: list[str] = []
    seen: set[str] = set()
    for i, r in enumerate(runs):
        rid = r.get("id", f"row {i}")
        if rid in seen:
            bad.append(f"{rid}: duplicate id")
        seen.add(rid)
        bad += _row_problems(dict(r, id=rid), sources)
    if bad:
        raise ValueError("published_runs.toml:\n" + "\n".join(bad))


def blockers(run: dict[str, Any]) -> list[str]:
    """Why dapple's plan space cannot express ``run`` (empty: it can)."""
    p = run["parallel"]
    out = []
    if p["cp"] > 1:
        out.append(f"context parallelism (CP {p['cp']})")
    if p.get("async_tp"):
        out.append("async TP (all-gather / reduce-scatter fused into the TP matmuls)")
    if p["fsdp"] > 1 and p["dp"] > 1:
        out.append(f"hybrid sharding (DP {p['dp']} x FSDP {p['fsdp']})")
    return out


def unmodelled(run: dict[str, Any]) -> list[str]:
    """What of ``run``'s configuration the expressed plan and profile leave out (the row is
    predicted without it)."""
    p = run["parallel"]
    out = []
    if p.get("compile"):
        out.append("torch.compile")
    if p.get("packed"):
        out.append("packed sequences")
    if p["tp"] > 1:
        out.append("sequence parallelism")
    return out


def part_of(run: dict[str, Any]) -> str:
    """The row's GPU as efficiencies are keyed: ``gpu``, or ``gpu@<W>W`` under a power limit."""
    c = run["cluster"]
    return f"{c['gpu']}@{c['power_w']}W" if "power_w" in c else str(c["gpu"])


def device_for(run: dict[str, Any]) -> DeviceSpec:
    """The datasheet part, with the row's HBM bandwidth and memory when they differ."""
    c = run["cluster"]
    dev = DEVICES[c["gpu"]]
    hbm = c.get("hbm_tb_per_s")
    return dataclasses.replace(
        dev,
        hbm_bytes_per_s=dev.hbm_bytes_per_s if hbm is None else hbm * 1e12,
        memory_bytes=int(c["memory_gib"] * GIB),
    )


def kernels_for(part: str, precision: str) -> str | None:
    """The kernel setting a part's rows are predicted with: ``fused`` on the Hopper parts where
    the library has a fused fit for ``precision`` (Megatron's Transformer Engine, torchtitan's
    kernels; the GEMM efficiency measured on the H200, :mod:`gpu_fit`), None elsewhere (the
    part's own efficiencies)."""
    fused = part.split("@")[0] in HOPPER and (precision, "fused") in FITTED
    return "fused" if fused else None


def base_efficiency(part: str, precision: str) -> Efficiency:
    """The library's efficiencies of a part and precision before any fit on a row: the fused
    fit where :func:`kernels_for` says so, else the device's own."""
    gpu = part.split("@")[0]
    kernels = kernels_for(part, precision)
    if kernels is not None:
        return fitted_efficiency(gpu, precision, kernels)
    return DEVICES[gpu].efficiency_for(precision)


def library_efficiency(run: dict[str, Any]) -> Efficiency:
    """The library's efficiencies of the row's GPU and precision (:func:`base_efficiency`)."""
    return base_efficiency(part_of(run), run["parallel"]["precision"])


def efficiency_for(run: dict[str, Any]) -> Efficiency:
    """The efficiencies ``run`` is predicted with: the library's, with ``matmul`` fitted here
    on the :data:`FIT_ROWS` row of its (part, precision) when the library's is not that fit."""
    base = library_efficiency(run)
    rid = FIT_ROWS.get((part_of(run), run["parallel"]["precision"]))
    if rid is None or rid in base.note:
        return base
    eff = with_matmul(base, fitted_matmul(rid), part_of(run))
    return dataclasses.replace(eff, note=f"matmul fitted here on {rid}")


def with_matmul(base: Efficiency, matmul: float, part: str) -> Efficiency:
    """``base`` with ``matmul``; on a power-limited part (``gpu@<W>W``) the attention kernel's
    efficiency is scaled by the same factor: a power limit lowers the clocks of every Tensor
    Core kernel alike, so the one number fitted on the part's row is a throttle of both."""
    if "@" not in part:
        return dataclasses.replace(base, matmul=matmul)
    attention = min(1.0, base.attention * matmul / base.matmul)
    return dataclasses.replace(base, matmul=matmul, attention=attention)


@functools.cache
def fitted_matmul(rid: str) -> float:
    """The matmul efficiency fitted on row ``rid`` (:func:`fit_matmul`), once per run."""
    _, runs = load_runs()
    return fit_matmul(next(r for r in runs if r["id"] == rid))


def profile_for(run: dict[str, Any], efficiency: Efficiency | None = None) -> ModelProfile:
    """The row's analytic profile (``fold_ends``: Megatron-style stages hold whole blocks).

    Under tensor parallelism every layer shards, the embedding and head included: Megatron's
    vocabulary-parallel embedding and column-parallel output layer, torchtitan's TP plan for
    ``tok_embeddings`` and ``output`` (the analytic profile marks only the blocks, as dapple's
    runtime shards them)."""
    p = run["parallel"]
    mb, dev = p["micro_batch"], device_for(run)
    eff = efficiency or efficiency_for(run)
    kw: dict[str, Any] = dict(
        precision=p["precision"], seq_len=p["seq_len"], attention=p.get("attention"),
        batch_sizes=sorted({1, mb, 2 * mb}), efficiency=eff,
        fold_ends=run["source"] != "dapple-paper" and p["pp"] > 1,
    )  # fmt: skip
    prof = analytic_profile(run["model"], dev, recompute=_CHECKPOINT[p["checkpoint"]], **kw)
    if p["checkpoint"] in TORCHTITAN_POLICIES:
        full = analytic_profile(run["model"], dev, recompute="full", **kw)
        spec = resolve_spec(run["model"], p["seq_len"])
        prof = apply_policy(p["checkpoint"], prof, full, spec, p["precision"], dev, eff)
    if p["tp"] == 1:
        return prof
    shard = [dataclasses.replace(x, tensor_parallel=True) for x in prof.layers]
    return dataclasses.replace(prof, layers=tuple(shard))


def cluster_for(run: dict[str, Any]) -> Cluster:
    """The row's cluster: nodes x GPUs per node, its memory and links."""
    c = run["cluster"]
    return Cluster(
        name=run["id"],
        servers=c["nodes"],
        devices_per_server=c["gpus_per_node"],
        device_memory_bytes=int(c["memory_gib"] * GIB),
        intra_server_bandwidth_gbps=c.get("intra_gbps", 2400),
        inter_server_bandwidth_gbps=c.get("inter_gbps", 800),
        device_name=c["detail"],
    )


def plan_for(run: dict[str, Any], prof: ModelProfile, cluster: Cluster) -> Plan:
    """The row's configuration as a dapple plan (module docstring): micro-batch ``micro_batch
    x r`` split over the r = dp x fsdp replicas, M from the global batch; blocks split evenly
    (Megatron), or the DAPPLE paper's 2-stage cut at dapple's best L.

    Raises:
        ValueError: the row is not expressible (:func:`blockers`) or its global batch is not
            M whole micro-batches.
    """
    if blockers(run):
        raise ValueError(f"{run['id']}: not expressible ({', '.join(blockers(run))})")
    p = run["parallel"]
    S, t, r = p["pp"], p["tp"], p["dp"] * p["fsdp"]
    b = p["micro_batch"] * r
    M, rest = divmod(p["global_batch"], b)
    if rest or M < 1:
        raise ValueError(
            f"{run['id']}: global batch {p['global_batch']} is not M micro-batches of {b}"
        )
    N, n = prof.num_layers, r * t
    zero = 3 if p["fsdp"] > 1 else 1 if p.get("distributed_optimizer") and r > 1 else 0
    schedule = "gpipe" if p["schedule"] == "gpipe" else "dapple"

    rc = Recompute.FULL if p["checkpoint"] == "stage" else Recompute.NONE

    def make(cuts: list[int]) -> Plan:
        stages = tuple(
            StagePlan(layers=(cuts[g], cuts[g + 1]), devices=tuple(range(g * n, (g + 1) * n)),
                      recompute=rc, zero_stage=zero, tensor_width=t, regather=zero == 3 and S == 1)
            for g in range(S)
        )  # fmt: skip
        plan = Plan(planner="published", global_batch_size=b * M, micro_batch_size=b,
                    num_micro_batches=M, stages=stages, schedule=schedule, model_name=prof.model_name)  # fmt: skip
        return interleave(plan, p["vp"]) if p["vp"] > 1 else plan

    if S == 1:
        return make([0, N])
    if run["source"] != "dapple-paper":
        return make([g * N // S for g in range(S)] + [N])
    best = min(range(1, N), key=lambda c: schedule_latency(make([0, c, N]), prof, cluster))
    return make([0, best, N])


def describe(plan: Plan) -> str:
    """A plan in one line: replicas per stage (``x t`` for tensor width), layer ranges or chunk
    sizes, b, M, schedule, re-computation and ZeRO."""
    groups = plan.stages[: plan.num_groups]
    n = plan.stages[0].layers[1] - plan.stages[0].layers[0]
    if plan.virtual_stages > 1:
        cuts = f"{plan.num_stages} chunks of {n} layer{'s' if n > 1 else ''}"
    elif len(groups) > 8:
        sizes = [st.layers[1] - st.layers[0] for st in groups]
        span = f"{min(sizes)}" if min(sizes) == max(sizes) else f"{min(sizes)}-{max(sizes)}"
        cuts = f"{span} layers each"
    else:
        cuts = ", ".join(f"{st.layers[0]}-{st.layers[1] - 1}" for st in groups)
    rep = ":".join(str(st.replicas) for st in groups)
    if len(groups) > 8 and len({st.replicas for st in groups}) == 1:
        rep = f"{len(groups)} x {groups[0].replicas}"
    ts = sorted({st.tensor_width for st in groups})
    width = "" if ts == [1] else " t=" + "/".join(map(str, ts))
    zs = sorted({st.zero_stage + (0.5 if st.regather else 0) for st in groups})
    zero = "".join(f" ZeRO-{int(z)}{'+regather' if z % 1 else ''}" for z in zs if z)
    rc = sum(bool(st.recompute) for st in groups)
    recompute = "" if not rc else " RC" if rc == len(groups) else f" RC {rc}/{len(groups)}"
    v = f" v={plan.virtual_stages}" if plan.virtual_stages > 1 else ""
    return (f"{rep}{width} ({cuts}) b={plan.micro_batch_size} M={plan.num_micro_batches} "
            f"{plan.schedule}{v}{recompute}{zero}")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Prediction:
    """dapple's numbers for one plan of a row."""

    plan: str
    step_ms: float
    L_ms: float
    samples_per_s: float
    tokens_per_s_per_gpu: float
    peak_gib_max: float
    peak_gib_avg: float
    oom: bool


@functools.cache
def _frameworks() -> dict[str, str]:
    sources, _ = load_runs()
    return {k: str(v.get("framework", "dapple")) for k, v in sources.items()}


def overlap_for(run: dict[str, Any]) -> CommOverlap:
    """The communication the row's framework hides under compute: its source's ``framework``
    (:data:`dapple.cost.overlap.FRAMEWORKS`; ``dapple`` when the source names none)."""
    return FRAMEWORKS[_frameworks()[run["source"]]]


def simulate_plan(
    run: dict[str, Any],
    plan: Plan,
    prof: ModelProfile,
    cluster: Cluster,
    overlap: CommOverlap = NO_OVERLAP,
) -> Prediction:
    """Simulate ``plan`` of ``run``: step, L, throughput and memory, with the traffic
    ``overlap`` leaves exposed (default: dapple's runtime, all of it)."""
    sim = simulate(plan, prof, cluster, overlap=overlap)
    L = schedule_latency(plan, prof, cluster, overlap)
    peaks = [d.peak_memory_bytes / GIB for d in sim.devices]
    gbs, gpus, seq = plan.global_batch_size, run["cluster"]["gpus"], run["parallel"]["seq_len"]
    return Prediction(
        plan=describe(plan), step_ms=sim.step_ms, L_ms=L, samples_per_s=gbs / sim.step_ms * 1e3,
        tokens_per_s_per_gpu=gbs * seq / sim.step_ms * 1e3 / gpus, peak_gib_max=max(peaks),
        peak_gib_avg=sum(peaks) / len(peaks),
        oom=max(peaks) * GIB > cluster.usable_memory_bytes,
    )  # fmt: skip


def predict(run: dict[str, Any], efficiency: Efficiency | None = None) -> Prediction:
    """Simulate the row's own configuration on its cluster with its analytic profile and its
    framework's communication overlap (:func:`overlap_for`)."""
    prof = profile_for(run, efficiency)
    cluster = cluster_for(run)
    return simulate_plan(run, plan_for(run, prof, cluster), prof, cluster, overlap_for(run))


def no_overlap_step_ms(run: dict[str, Any]) -> float:
    """The simulated step of the row's configuration with all its communication on the
    critical path (dapple's runtime, :data:`~dapple.cost.overlap.NO_OVERLAP`)."""
    prof, cluster = profile_for(run), cluster_for(run)
    return float(simulate(plan_for(run, prof, cluster), prof, cluster).step_ms)


def free_comm_step_ms(run: dict[str, Any]) -> float:
    """The simulated step of the row's configuration with free communication (links of
    unbounded bandwidth and no latency): a bound on what overlapping it could recover."""
    prof, cluster = profile_for(run), cluster_for(run)
    free = dataclasses.replace(
        cluster, intra_server_bandwidth_gbps=1e15, inter_server_bandwidth_gbps=1e15,
        intra_server_latency_ms=0.0, inter_server_latency_ms=0.0,
    )  # fmt: skip
    return float(simulate(plan_for(run, prof, cluster), prof, free).step_ms)


def published_samples_per_s(run: dict[str, Any]) -> float | None:
    """The row's published throughput in samples/s (None: not published, e.g. an OOM row)."""
    pub, p = run["published"], run["parallel"]
    if "samples_per_s" in pub:
        return float(pub["samples_per_s"])
    if "tokens_per_s_per_gpu" in pub:
        return float(pub["tokens_per_s_per_gpu"] * run["cluster"]["gpus"] / p["seq_len"])
    if "step_ms" in pub:
        return float(p["global_batch"] / pub["step_ms"] * 1e3)
    return None


def fit_matmul(run: dict[str, Any], lo: float = 0.05, hi: float = 1.0) -> float:
    """The matmul efficiency at which the row's predicted throughput equals the published
    one (bisection; the throughput rises with the efficiency; on a power-limited part the
    attention efficiency moves with it, :func:`with_matmul`)."""
    target = published_samples_per_s(run)
    assert target is not None, run["id"]
    base = library_efficiency(run)
    for _ in range(40):
        mid = (lo + hi) / 2
        got = predict(run, with_matmul(base, mid, part_of(run))).samples_per_s
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return (lo + hi) / 2

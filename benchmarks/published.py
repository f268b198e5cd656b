"""Published GPU training runs beside dapple's predictions (issue 31, parts 2 and 3).

Loads ``published_runs.toml`` (each row: model, cluster, parallel configuration, the published
throughput and memory, and where they were read), builds every row's analytic profile
(:func:`dapple.profiler.analytic.analytic_profile`) and, for the rows dapple's plan space
expresses today - pipeline x data parallel, no tensor, sharded-parameter or context
parallelism - predicts step time, throughput and memory with the row's own configuration as
a dapple plan: the cost model's L (equations 1-3, :func:`dapple.cost.schedule_latency`) and
the simulator (:func:`dapple.simulate.simulate`). The other rows are listed with the reason.

Efficiencies are the library's (:mod:`dapple.profiler.analytic_devices`). Each
(device, precision) that a row dapple can express exists for has its ``matmul`` efficiency
fitted on exactly one row (:data:`FIT_ROWS`, re-fitted here by bisection and compared with
the library's constant); those rows are marked ``fit`` and left out of every error summary.

Usage: ``python benchmarks/published.py [--out benchmarks/published.md]``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _bench_common import HERE, header, spearman, write_report
from dapple.core.cluster import GIB, Cluster
from dapple.core.plan import Plan, StagePlan, interleave
from dapple.core.profile import ModelProfile
from dapple.cost import schedule_latency
from dapple.profiler.analytic import analytic_profile
from dapple.profiler.analytic_devices import DEVICES, DeviceSpec, Efficiency
from dapple.profiler.analytic_models import PRESETS
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
}
"""The one row each fitted (device, precision) efficiency comes from."""

_CHECKPOINT = {"none": "none", "stage": "none", "full": "full", "selective": "selective",
               "selective-op": "selective", "selective-layer": "selective"}  # fmt: skip
"""A row's checkpointing -> the profile's (``stage``: the plan re-computes whole stages;
torchtitan's op / layer policies are approximated by the selective profile)."""

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
    if bad:
        raise ValueError("published_runs.toml:\n" + "\n".join(bad))


def blockers(run: dict[str, Any]) -> list[str]:
    """Why dapple's plan space cannot express ``run`` today (empty: it can)."""
    p = run["parallel"]
    out = []
    if p["tp"] > 1:
        out.append(f"tensor parallelism (TP {p['tp']})")
    if p["fsdp"] > 1:
        out.append(f"sharded parameters (FSDP {p['fsdp']})")
    if p["cp"] > 1:
        out.append(f"context parallelism (CP {p['cp']})")
    if p.get("async_tp"):
        out.append("async TP")
    if p["checkpoint"] in ("selective-op", "selective-layer"):
        out.append(f"torchtitan's {p['checkpoint']} checkpointing policy")
    return out


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


def profile_for(run: dict[str, Any], efficiency: Efficiency | None = None) -> ModelProfile:
    """The row's analytic profile (``fold_ends``: Megatron-style stages hold whole blocks)."""
    p = run["parallel"]
    mb = p["micro_batch"]
    return analytic_profile(
        run["model"],
        device_for(run),
        precision=p["precision"],
        seq_len=p["seq_len"],
        checkpoint=_CHECKPOINT[p["checkpoint"]],
        attention=p.get("attention"),
        batch_sizes=sorted({1, mb, 2 * mb}),
        efficiency=efficiency,
        fold_ends=run["source"] != "dapple-paper" and p["pp"] > 1,
    )


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
    """The row's configuration as a dapple plan: pp stages of dp replicas (consecutive devices),
    micro-batch ``micro_batch x dp`` split over the replicas, M from the global batch; blocks
    split evenly (Megatron), or the DAPPLE paper's 2-stage cut at dapple's best L."""
    p = run["parallel"]
    P, r = p["pp"], p["dp"]
    b = p["micro_batch"] * r
    M = p["global_batch"] // b
    N = prof.num_layers
    zero = 1 if p.get("distributed_optimizer") and r > 1 else 0
    schedule = "gpipe" if p["schedule"] == "gpipe" else "dapple"

    def make(cuts: list[int]) -> Plan:
        stages = tuple(
            StagePlan(layers=(cuts[g], cuts[g + 1]), devices=tuple(range(g * r, (g + 1) * r)),
                      recompute=p["checkpoint"] == "stage", zero_stage=zero)
            for g in range(P)
        )  # fmt: skip
        plan = Plan(planner="published", global_batch_size=b * M, micro_batch_size=b,
                    num_micro_batches=M, stages=stages, schedule=schedule, model_name=prof.model_name)  # fmt: skip
        return interleave(plan, p["vp"]) if p["vp"] > 1 else plan

    if P == 1:
        return make([0, N])
    if run["source"] != "dapple-paper":
        return make([g * N // P for g in range(P)] + [N])
    best = min(range(1, N), key=lambda c: schedule_latency(make([0, c, N]), prof, cluster))
    return make([0, best, N])


@dataclass(frozen=True, slots=True)
class Prediction:
    """dapple's numbers for one row."""

    plan: str
    step_ms: float
    L_ms: float
    samples_per_s: float
    tokens_per_s_per_gpu: float
    peak_gib_max: float
    peak_gib_avg: float
    oom: bool


def predict(run: dict[str, Any], efficiency: Efficiency | None = None) -> Prediction:
    """Simulate the row's plan on its cluster with its analytic profile."""
    prof = profile_for(run, efficiency)
    cluster = cluster_for(run)
    plan = plan_for(run, prof, cluster)
    sim = simulate(plan, prof, cluster)
    L = schedule_latency(plan, prof, cluster)
    peaks = [d.peak_memory_bytes / GIB for d in sim.devices]
    gbs, gpus, seq = plan.global_batch_size, run["cluster"]["gpus"], run["parallel"]["seq_len"]
    if plan.virtual_stages > 1:
        n = plan.stages[0].layers[1] - plan.stages[0].layers[0]
        cuts = f"{plan.num_stages} chunks of {n} layer{'s' if n > 1 else ''}"
    else:
        cuts = ", ".join(f"{st.layers[0]}-{st.layers[1] - 1}" for st in plan.stages)
    desc = (
        f"{plan.replication} ({cuts}) b={plan.micro_batch_size} M={plan.num_micro_batches} "
        f"{plan.schedule}{f' v={plan.virtual_stages}' if plan.virtual_stages > 1 else ''}"
        f"{' RC' if plan.stages[0].recompute else ''}{' ZeRO-1' if plan.stages[0].zero_stage else ''}"
    )
    return Prediction(
        plan=desc, step_ms=sim.step_ms, L_ms=L, samples_per_s=gbs / sim.step_ms * 1e3,
        tokens_per_s_per_gpu=gbs * seq / sim.step_ms * 1e3 / gpus, peak_gib_max=max(peaks),
        peak_gib_avg=sum(peaks) / len(peaks),
        oom=max(peaks) * GIB > cluster.usable_memory_bytes,
    )  # fmt: skip


def published_samples_per_s(run: dict[str, Any]) -> float | None:
    """The row's published throughput in samples/s (None: not published, e.g. an OOM row)."""
    pub, p = run["published"], run["parallel"]
    if "samples_per_s" in pub:
        return float(pub["samples_per_s"])
    if "tokens_per_s_per_gpu" in pub:
        return float(pub["tokens_per_s_per_gpu"]) * run["cluster"]["gpus"] / p["seq_len"]
    if "step_ms" in pub:
        return p["global_batch"] / pub["step_ms"] * 1e3
    return None


def fit_matmul(run: dict[str, Any], lo: float = 0.05, hi: float = 1.0) -> float:
    """The matmul efficiency at which the row's predicted throughput equals the published
    one (bisection; the throughput rises with the efficiency)."""
    target = published_samples_per_s(run)
    assert target is not None, run["id"]
    base = device_for(run).efficiency_for(run["parallel"]["precision"])
    for _ in range(40):
        mid = (lo + hi) / 2
        got = predict(run, dataclasses.replace(base, matmul=mid)).samples_per_s
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return (lo + hi) / 2


def _pct(pred: float, pub: float) -> str:
    return f"{100 * (pred / pub - 1):+.1f}%"


def _published_text(run: dict[str, Any]) -> str:
    pub = run["published"]
    parts = []
    for key, fmt in (("tokens_per_s_per_gpu", "{:,} tok/s/GPU"), ("samples_per_s", "{} samples/s"),
                     ("step_ms", "{} ms/step"), ("model_tflops_per_gpu", "{} TFLOP/s/GPU"),
                     ("mfu", "MFU {:.1%}"), ("memory_gib", "{} GiB"), ("memory_gb_avg", "avg {} GB")):  # fmt: skip
        if key in pub:
            parts.append(fmt.format(pub[key]))
    return "; ".join(parts) or ("OOM" if pub.get("oom") else "-")


def _config_text(run: dict[str, Any]) -> str:
    p = run["parallel"]
    dims = " ".join(
        f"{k.upper()}{p[k]}" for k in ("dp", "fsdp", "tp", "pp", "cp", "vp") if p[k] > 1
    )
    flags = [p["precision"], f"AC {p['checkpoint']}"] + [
        f for f in ("compile", "float8") if p.get(f)
    ]
    return (f"{dims or 'single GPU'}; mb {p['micro_batch']}, gbs {p['global_batch']}, seq "
            f"{p['seq_len']}; {', '.join(flags)}")  # fmt: skip


def _memory_cells(run: dict[str, Any], pred: Prediction) -> tuple[str, str, float | None]:
    pub = run["published"]
    if "memory_gib" in pub:
        return (
            f"{pub['memory_gib']} GiB (max)",
            f"{pred.peak_gib_max:.1f}",
            pred.peak_gib_max / pub["memory_gib"] - 1,
        )
    if "memory_gb_avg" in pub:
        return (
            f"{pub['memory_gb_avg']} (avg)",
            f"{pred.peak_gib_avg:.1f}",
            pred.peak_gib_avg / pub["memory_gb_avg"] - 1,
        )
    if pub.get("oom"):
        return "OOM", "OOM" if pred.oom else f"fits ({pred.peak_gib_max:.1f})", None
    return "-", f"{pred.peak_gib_max:.1f}{' OOM' if pred.oom else ''}", None


def report(
    sources: dict[str, dict[str, Any]], runs: list[dict[str, Any]], command: str
) -> list[str]:
    """The markdown of ``published.md``."""
    lines = header("Published GPU training runs and dapple's predictions", command)
    lines[-2] = "- predictions are analytic (no GPU was used); the machine only runs the arithmetic"
    fits = {rid: key for key, rid in FIT_ROWS.items()}
    by_id = {r["id"]: r for r in runs}
    lines += ["## Efficiencies", "",
              "| device | precision | matmul | attention | memory | source | re-fitted here |",
              "|---|---|---:|---:|---:|---|---:|"]  # fmt: skip
    for name, dev in DEVICES.items():
        for prec, eff in dev.efficiency.items():
            rid = FIT_ROWS.get((name, prec))
            refit = f"{fit_matmul(by_id[rid]):.3f}" if rid else "-"
            lines.append(f"| {name} | {prec} | {eff.matmul:.3f} | {eff.attention:.2f} | "
                         f"{eff.memory:.2f} | {eff.note} | {refit} |")  # fmt: skip
    expressible = [r for r in runs if not blockers(r)]
    rows, tput_err, mem_err = [], [], []
    per_source: dict[str, list[tuple[float, float]]] = {}
    for r in expressible:
        pred = predict(r)
        pub_s = published_samples_per_s(r)
        role = "fit" if r["id"] in fits else "judged"
        pm, dm, merr = _memory_cells(r, pred)
        terr = "-" if pub_s is None else _pct(pred.samples_per_s, pub_s)
        if role == "judged" and pub_s is not None:
            tput_err.append(pred.samples_per_s / pub_s - 1)
        if role == "judged" and merr is not None:
            mem_err.append(merr)
        if pub_s is not None:
            per_source.setdefault(r["source"], []).append((pred.samples_per_s, pub_s))
        lines_pub = f"{pub_s:.2f}" if pub_s is not None else "-"
        rows.append(
            f"| {r['id']} | {role} | {r['cluster']['gpus']} x {r['cluster']['gpu']} | "
            f"{pred.plan} | {lines_pub} | {pred.samples_per_s:.2f} | {terr} | "
            f"{r['parallel']['global_batch'] / pred.L_ms * 1e3:.2f} | "
            f"{pm} | {dm} | {'-' if merr is None else f'{100 * merr:+.1f}%'} |"
        )
    within = sum(abs(e) <= 0.15 for e in tput_err)
    mwithin = sum(abs(e) <= 0.10 for e in mem_err)
    lines += ["", "## Summary", "",
              f"- {len(runs)} published rows from {len(sources)} sources; {len(expressible)} "
              f"dapple can express today, {len(runs) - len(expressible)} need parallelism it lacks.",
              f"- throughput (judged rows, fit rows excluded): {within} of {len(tput_err)} within "
              f"15%; median |error| {100 * _median([abs(e) for e in tput_err]):.1f}%.",
              f"- memory (judged rows with a published number): {mwithin} of {len(mem_err)} within 10%.",
              ]  # fmt: skip
    for src, pairs in per_source.items():
        if len(pairs) >= 3:
            rho = spearman([a for a, _ in pairs], [b for _, b in pairs])
            lines.append(
                f"- Spearman (predicted vs published throughput, {src}, {len(pairs)} rows, fit row included): {rho:.2f}"
            )
    lines += ["", "## Rows dapple expresses today", "",
              "Throughput in samples/s (published tokens/s/GPU and ms/step converted); predicted = "
              "simulated step; `L` = the cost model's latency (equations 1-3) as samples/s; memory in "
              "GiB, the simulator's peak (max over GPUs, or the average where the source averages).",
              "", "| row | role | GPUs | dapple plan | published | predicted | error | L | "
              "memory published | predicted | error |", "|---|---|---|---|---:|---:|---:|---:|---|---:|---:|",
              *rows]  # fmt: skip
    lines += [
        "",
        "## Rows that need parallelism dapple lacks today",
        "",
        "| row | model | GPUs | configuration | published | needs |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        why = blockers(r)
        if why:
            lines.append(f"| {r['id']} | {r['model']} | {r['cluster']['gpus']} x {r['cluster']['gpu']} | "
                         f"{_config_text(r)} | {_published_text(r)} | {', '.join(why)} |")  # fmt: skip
    lines += ["", "## Sources", "", "| key | where | tables |", "|---|---|---|"]
    for key, s in sources.items():
        where = f"{s['repo']} `{s['path']}` @ {s['commit']}" if "repo" in s else s["where"]
        lines.append(f"| {key} | {s['title']}: {where} | {s['tables']} |")
    lines += [
        "",
        "## Every row's published numbers",
        "",
        "| row | source, locator | model | configuration | published | assumed |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(f"| {r['id']} | {r['source']}: {r['locator']} | {r['model']} | {_config_text(r)} | "
                     f"{_published_text(r)} | {r.get('assumed', '')} |")  # fmt: skip
    return [*lines, "", *NOTES]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return (
        math.nan
        if not s
        else (s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2)
    )


NOTES: list[str] = """## The model

- FLOPs and bytes per operation (`dapple.profiler.analytic_ops`): linear layers `2 s n_in n_out`
  forward, twice that backward; flash attention `4 s s_kv a d` with `s_kv = (s+1)/2` when
  causal, 2.5x backward; eager attention the full `s x s` scores and context GEMMs plus softmax
  and dropout over `a s^2` probabilities; norms, activations, residual adds, rotary, embedding,
  cross entropy as bytes moved by eager PyTorch kernels. Kept activations as autograd saves
  them (Korthikanti et al.'s `34 s h + 5 a s^2` for a GPT block with eager attention and
  dropout in 16 bits), with `none`, `selective` or `full` checkpointing.
- Time (`dapple.profiler.analytic`): per op `max(FLOPs / (eff x peak), bytes / (eff x HBM))`
  plus 4 us per kernel, summed per layer and fitted affine in the batch size. Peaks and HBM
  bandwidth from the V100, A100 and H100 datasheets (`dapple.profiler.analytic_devices`).
- Each row's own configuration is the dapple plan: `pp` stages of `dp` replicas on consecutive
  GPUs, micro-batch `micro_batch x dp` split over the replicas, `M = global_batch / (micro_batch
  x dp)`, 1F1B as DAPPLE's schedule (policy A, Megatron's warm-up), interleaved 1F1B with `vp`
  chunks, GPipe, whole-stage re-computation for the paper's RC, ZeRO-1 for Megatron's
  distributed optimizer; Megatron rows split blocks evenly (embedding with the first block,
  head with the last), the DAPPLE paper's split is dapple's best 2-stage cut (not published).

## What the misses say (nothing below is tuned per row)

- DAPPLE paper, throughput: with the one efficiency fitted at DAPPLE M=16, the M=2 rows come
  out 12% fast and the re-computation rows at M=8/16 8-10% slow. The paper's steps carry about
  85 ms per step more than the model (its M=2 step is 784 ms; the model's is 699 ms, of which
  13 ms is the modelled Adam update): framework work per step the analytic profile does not
  see. Re-computation costs the paper 17% at M=16 and the model 25%: the model re-runs a full
  forward, a third of F + B with its 2:1 backward; the paper's kernels have a heavier backward
  (softmax, dropout and LayerNorm backward in TF 1.x), so the same re-run is a smaller share.
  The ranking is right (Spearman above).
- DAPPLE paper, memory (the paper's GB read as GiB, as `paper.md` does; read as 10^9 bytes
  each predicted value is 7% larger): within 10% without re-computation (-7% to -9%: the
  allocator pool, cuDNN workspaces and the CUDA context are not modelled) and for DAPPLE + RC
  (-5%). GPipe + RC misses (-19% at M=2, -39% at M=5): the paper's GPipe + RC grows by 1.1 GB
  per extra micro-batch (9.9 GB at M=2, 13.2 GB at M=5), while keeping only stage inputs grows
  by 4 MB, so TF's re-computation kept more than the stage inputs. The two OOM rows are
  predicted to fit: GPipe M=3 at 14.8 GiB on its fuller GPU, 1.2 GiB under the 16 GiB (the
  unmodelled overhead above is larger), GPipe + RC M=8 at 8.3 GiB (the growth just described).
- NeMo, throughput: the pretraining rows (GPT-3 5B on 64 GPUs, Llama 2 13B with interleaved
  PP4 x DP4) are within 4%. The SFT rows are slow: they pack SQuAD examples into 4,096-token
  sequences and attend within each example, while the model charges causal attention over
  the whole pack (13.7% of a 7B block's time); NeMo's own model-FLOP counts show it (7.74e10
  FLOPs per token for 13B SFT against 8.72e10 for 13B pretraining at the same 754 TFLOP/s).
  The 7B SFT step also carries its gradient synchronisation unoverlapped in the model (105 ms
  of 1,059 ms with 4 micro-batches; Megatron overlaps it). The 13B SFT row's -22% is mostly
  the 1F1B bubble (3/19 of the step) of the plain 1F1B assumed because the finetuning table
  prints no VP; equal TFLOP/s to the interleaved pretraining row suggests NeMo interleaved it.
- NeMo, memory: the Llama 2 7B rows are predicted not to fit in 80 GiB (92 GiB) although they
  ran: dapple's memory model is dapple's runtime's (fp32 weights and gradients on every
  replica plus a 2-byte autocast copy; ZeRO-1 shards only the Adam moments: 11.5 bytes per
  parameter at DP 8), while Megatron's distributed optimizer keeps bf16 weights and fp32
  gradients and shards the fp32 master weights with the moments (7.5 bytes per parameter).
- Fitted efficiencies: V100 fp32 GEMMs at 62% of 15.7 TFLOP/s; V100 fp16 at 83% of 125 TFLOP/s
  (the DGX-2H V100 peaks higher, and Megatron's fused kernels move fewer bytes than the eager
  element-wise model charges, which the one fitted number absorbs); H100 fp8 at 48% of
  1,979 TFLOP/s (Transformer Engine's casts and amax reductions are not modelled as ops).
  A100 and H100 bf16 have priors only: no published A100 or H100 bf16 run is pipeline x data
  parallel. torchtitan's 33-39% H100 MFU (its Table 1 note) is far below the 0.7 prior, so the
  first FSDP row fitted in part 3 will move it a lot.

## What predicting the other rows needs (part 3)

- Tensor parallelism (Megatron and NeMo TP 2-8, torchtitan TP 8): per-layer FLOPs and weights
  divided by TP, two all-reduces (or reduce-scatter + all-gather with sequence parallelism)
  of `s h e` bytes per block forward and backward on NVLink, overlapped or not (AsyncTP,
  `tp_comm_overlap`).
- Sharded parameters (FSDP / ZeRO-3: every torchtitan row, Megatron-Bridge's Llama 3 8B):
  parameter all-gather before each block's forward and backward and gradient reduce-scatter,
  overlapped with compute; memory of 1/N of parameters, gradients and optimizer state plus the
  gathered blocks in flight.
- Context parallelism (NeMo CP 2, torchtitan CP 2-8, Megatron-Bridge 405B): attention over
  sequence shards with ring exchange of K and V.
- The memory model of the frameworks' optimizers (Megatron's distributed optimizer above) and
  the frameworks' kernel fusion / `torch.compile` (fewer element-wise bytes) and Float8
  (torchao, Transformer Engine) as profile options rather than per-row factors; torchtitan's
  selective-op and selective-layer checkpointing policies as checkpoint modes.

## Sources looked for and not used

- Narayanan et al. 2021 (Megatron-LM, SC '21) table 1: the paper's text was not reachable
  from this machine and Megatron-LM's README shows its scaling results as images
  (`images/model_table.png`, `images/weak_scaling.png` at d086a2e3b020ff78db9d29915f7cfe886e085f13);
  the rows were left out rather than typed from memory. Its configurations need TP anyway.
""".splitlines()
"""Hand-written notes appended to the report."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    sources, runs = load_runs()
    command = "python benchmarks/published.py" + (f" --out {args.out}" if args.out else "")
    write_report(report(sources, runs, command), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

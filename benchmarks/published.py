"""Published GPU training runs beside dapple's predictions and dapple's own plans.

Loads ``published_runs.toml`` (each row: model, cluster, parallel configuration, the published
throughput and memory, and where they were read). For every row dapple's plan space expresses
- pipeline x data x tensor parallel, FSDP as ZeRO-3 over the replicas, Megatron's distributed
optimizer as ZeRO-1, interleaving; not context parallelism or async TP - it predicts step
time, throughput and memory of the row's own configuration as a dapple plan
(:mod:`_published_model`: the simulator and the cost model's L, equations 1-3), and plans the
row's model, cluster and global batch with dapple's own search (:mod:`_published_search`).
The other rows are listed with the reason.

Efficiencies are the library's (:mod:`dapple.profiler.analytic_devices`), with each fitted
(part, precision) fitted on exactly one row (:data:`FIT_ROWS`); those rows are marked ``fit``
and left out of every error summary.

Usage: ``python benchmarks/published.py [--out benchmarks/published.md] [--no-search]``
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any

from _bench_common import header, spearman, write_report
from _published_loo import loo_lines
from _published_misses import miss_lines
from _published_model import (
    DATA,
    FIT_ROWS,
    REFUSED_FITS,
    Prediction,
    base_efficiency,
    blockers,
    check_runs,
    efficiency_for,
    fit_matmul,
    fitted_matmul,
    free_comm_step_ms,
    kernels_for,
    load_runs,
    no_overlap_step_ms,
    overlap_for,
    part_of,
    predict,
    published_samples_per_s,
    unmodelled,
)
from _published_notes import NOTES
from _published_search import Searched, search_row
from dapple.profiler.analytic_devices import DEVICES

__all__ = [
    "DATA",
    "FIT_ROWS",
    "Judged",
    "blockers",
    "check_runs",
    "fit_matmul",
    "judge",
    "load_runs",
    "predict",
    "published_samples_per_s",
    "report",
    "unmodelled",
]


@dataclass(frozen=True, slots=True)
class Judged:
    """One expressed row: dapple's prediction against the published numbers."""

    run: dict[str, Any]
    pred: Prediction
    role: str
    """``fit`` (an efficiency was fitted on it) or ``judged``."""
    published: float | None
    """Published samples/s (None: not published)."""
    free_comm: float
    """Predicted samples/s with free communication (:func:`free_comm_step_ms`)."""
    no_overlap: float
    """Predicted samples/s with all communication on the critical path
    (:func:`no_overlap_step_ms`)."""
    memory: tuple[str, str, float | None]
    """Published memory, predicted memory, relative error (None: nothing to compare)."""

    @property
    def error(self) -> float | None:
        return None if self.published is None else self.pred.samples_per_s / self.published - 1


def judge(run: dict[str, Any]) -> Judged:
    """Predict an expressible row and compare it with its published numbers."""
    pred = predict(run)
    gbs = run["parallel"]["global_batch"]
    role = "fit" if run["id"] in FIT_ROWS.values() else "judged"
    return Judged(run, pred, role, published_samples_per_s(run),
                  gbs / free_comm_step_ms(run) * 1e3, gbs / no_overlap_step_ms(run) * 1e3,
                  _memory_cells(run, pred))  # fmt: skip


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


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
        return (f"{pub['memory_gib']} GiB (max)", f"{pred.peak_gib_max:.1f}",
                pred.peak_gib_max / pub["memory_gib"] - 1)  # fmt: skip
    if "memory_gb_avg" in pub:
        return (f"{pub['memory_gb_avg']} (avg)", f"{pred.peak_gib_avg:.1f}",
                pred.peak_gib_avg / pub["memory_gb_avg"] - 1)  # fmt: skip
    if pub.get("oom"):
        return "OOM", "OOM" if pred.oom else f"fits ({pred.peak_gib_max:.1f})", None
    return "-", f"{pred.peak_gib_max:.1f}{' OOM' if pred.oom else ''}", None


def _efficiency_lines(runs: list[dict[str, Any]]) -> list[str]:
    by_id = {r["id"]: r for r in runs}
    lines = ["## Efficiencies", "",
             "`base`: the library's efficiencies before any fit on a row: on the H100 in 16 bits "
             "the `fused` kernel setting (GEMMs at the bf16 8192^3 GEMM measured on the H200, "
             "`benchmarks/gpu_fit.md`), elsewhere the device's own. On a power-limited part "
             "(`@500W`) the fitted number scales the attention efficiency too (a throttle of "
             "every Tensor Core kernel): `attention` shows the value used.", "",
             "| part | precision | kernels | matmul used | base matmul | attention | memory | source |",
             "|---|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    keys = [(n, p) for n, dev in DEVICES.items() for p in dev.efficiency]
    keys += sorted(k for k in FIT_ROWS if k not in keys)
    for part, prec in keys:
        base = base_efficiency(part, prec)
        rid = FIT_ROWS.get((part, prec))
        used = efficiency_for(by_id[rid]).matmul if rid else base.matmul
        note = base.note if not rid or rid in base.note else f"matmul fitted here on {rid}"
        if (part, prec) in REFUSED_FITS:
            fid = REFUSED_FITS[(part, prec)]
            note += f"; a fit on {fid} reaches {fitted_matmul(fid):.3f} (the bound): not used"
        kernels = kernels_for(part, prec) or "-"
        att = efficiency_for(by_id[rid]).attention if rid else base.attention
        lines.append(f"| {part} | {prec} | {kernels} | {used:.3f} | {base.matmul:.3f} | "
                     f"{att:.2f} | {base.memory:.2f} | {note} |")  # fmt: skip
    return lines


def _bracketed(j: Judged) -> bool:
    """The published throughput lies between the prediction and its free-communication bound."""
    return j.published is not None and j.pred.samples_per_s <= j.published <= j.free_comm


def _scored(judged: list[Judged]) -> list[Judged]:
    """The judged rows (fit rows left out) that publish a throughput."""
    return [j for j in judged if j.role == "judged" and j.error is not None]


def _within(js: list[Judged], tol: float = 0.15) -> int:
    return sum(abs(j.error or 0.0) <= tol for j in js)


def _memory_errors(js: list[Judged]) -> list[float]:
    return [j.memory[2] for j in js if j.role == "judged" and j.memory[2] is not None]


def _source_row(src: str, runs: list[dict[str, Any]], judged: list[Judged]) -> str:
    """One source's line of the summary table."""
    js = [j for j in judged if j.run["source"] == src]
    sc, ms = _scored(js), _memory_errors(js)
    pairs = [(j.pred.samples_per_s, j.published) for j in js if j.published is not None]
    rho = spearman([a for a, _ in pairs], [b for _, b in pairs]) if len(pairs) >= 3 else None
    med = _median([abs(j.error or 0.0) for j in sc])
    cells = [
        src,
        str(sum(r["source"] == src for r in runs)),
        str(len(js)),
        str(len(sc)),
        str(_within(sc)),
        "-" if math.isnan(med) else f"{100 * med:.1f}%",
        f"{sum(abs(e) <= 0.10 for e in ms)} of {len(ms)}" if ms else "-",
        "-" if rho is None else f"{rho:.2f} ({len(pairs)} rows)",
    ]
    return "| " + " | ".join(cells) + " |"


def _summary_lines(
    sources: dict[str, dict[str, Any]], runs: list[dict[str, Any]], judged: list[Judged]
) -> list[str]:
    pub_rows = [r for r in runs if published_samples_per_s(r) is not None]
    scored, mem = _scored(judged), _memory_errors(judged)
    clean = [j for j in scored if not unmodelled(j.run)]
    median = 100 * _median([abs(j.error or 0.0) for j in scored])
    lines = ["## Summary", "",
             f"- {len(runs)} published rows from {len(sources)} sources; dapple expresses "
             f"{len(judged)}, {len(runs) - len(judged)} need parallelism it lacks.",
             f"- throughput, judged rows (fit rows excluded): {_within(scored)} of {len(scored)} "
             f"within 15% (goal: 80%); median |error| {median:.1f}%.",
             f"- of those with nothing left unmodelled (no torch.compile, packing or sequence "
             f"parallelism): {_within(clean)} of {len(clean)} within 15%.",
             f"- over every row publishing a throughput (not expressed rows count as misses, fit rows "
             f"excluded): {_within(scored)} of {len(pub_rows) - len(FIT_ROWS)} within 15%.",
             f"- with all communication on the critical path (no overlap, as dapple's runtime runs "
             f"it): {sum(abs(j.no_overlap / (j.published or 1) - 1) <= 0.15 for j in scored)} of "
             f"{len(scored)} within 15% (the efficiencies as fitted with overlap).",
             f"- the published throughput lies between the prediction and the prediction with free "
             f"communication on {sum(_bracketed(j) for j in scored)} of {len(scored)} judged rows.",
             f"- memory, judged rows with a published number: {sum(abs(e) <= 0.10 for e in mem)} of "
             f"{len(mem)} within 10%.",
             "", "| source | rows | expressed | judged | within 15% | median abs. error | memory within 10% "
             "| Spearman (fit rows included) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    return lines + [_source_row(src, runs, judged) for src in sources]


def _expressed_lines(judged: list[Judged]) -> list[str]:
    lines = ["## Rows dapple expresses", "",
             "Throughput in samples/s (published tokens/s/GPU and ms/step converted); predicted = "
             "simulated step of the row's configuration as a dapple plan, with the communication "
             "its framework overlaps with compute left out (`dapple.cost.overlap`: `megatron` "
             "hides the data-parallel reduce-scatters and gathers, `fsdp2` FSDP's gathers and "
             "reduce-scatters, layer by layer; tensor-parallel all-reduces stay exposed); `L` = "
             "the cost model's latency (equations 1-3) as samples/s; `no overlap` = the same "
             "plan with all communication on the critical path (dapple's runtime), its error; "
             "`free comm` = the same plan with free communication, its error and the share of "
             "the predicted step that exposed communication takes; memory "
             "in GiB, the simulator's peak (max over GPUs, or the average where the source "
             "averages). `left out`: what of the row the prediction does not model.", "",
             "| row | role | GPUs | dapple plan | left out | published | predicted | error | L | "
             "no overlap | free comm | comm share | memory published | predicted | error |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    for j in judged:
        r, p = j.run, j.pred
        free_err = None if j.published is None else j.free_comm / j.published - 1
        none_err = None if j.published is None else j.no_overlap / j.published - 1
        share = 1 - p.samples_per_s / j.free_comm
        lines.append(
            f"| {r['id']} | {j.role} | {r['cluster']['gpus']} x {part_of(r)} | {p.plan} | "
            f"{', '.join(unmodelled(r)) or '-'} | "
            f"{'-' if j.published is None else f'{j.published:.2f}'} | {p.samples_per_s:.2f} | "
            f"{_pct(j.error)} | {r['parallel']['global_batch'] / p.L_ms * 1e3:.2f} | "
            f"{_pct(none_err)} | {_pct(free_err)} | {100 * share:.0f}% | {j.memory[0]} | "
            f"{j.memory[1]} | "
            f"{_pct(j.memory[2])} |"
        )
    return lines


def _miss_row(j: Judged) -> dict[str, Any]:
    """What :func:`_published_misses.miss_lines` reads of a judged row."""
    return {"id": j.run["id"], "framework": overlap_for(j.run).name, "published": j.published,
            "pred": j.pred.samples_per_s, "no_overlap": j.no_overlap, "free": j.free_comm,
            "left_out": ", ".join(unmodelled(j.run))}  # fmt: skip


def _search_lines(judged: list[Judged], searched: dict[str, Searched] | None) -> list[str]:
    lines = ["## dapple's own plans for the expressed rows", ""]
    if searched is None:
        return [*lines, "Not run (`--no-search`).", ""]
    lines += ["For each expressed row's model (its profile), cluster and global batch: "
              "`dapple_search` over partition, replication, placement, M, tensor widths 1-8 and "
              "ZeRO per stage where memory asks for it, simulated beside the row's own "
              "configuration expressed as a dapple plan (same profile and cluster). Speed-up = "
              "published configuration's simulated step / dapple plan's. `slower` marks a dapple "
              "plan predicted slower than the published configuration that fits in memory under "
              "the same model: a search defect.", "",
              *_search_summary(judged, searched),
              "| row | published configuration | predicted | dapple's plan | predicted | speed-up | "
              "what differs | planning s |", "|---|---|---:|---|---:|---:|---|---:|"]  # fmt: skip
    for j in judged:
        s = searched[j.run["id"]]
        pub = s.published
        pub_text = f"{pub.samples_per_s:.2f}{' (OOM in the model)' if pub.oom else ''}"
        if s.own is None:
            lines.append(f"| {j.run['id']} | {pub.plan} | {pub_text} | no plan fits | - | - | "
                         f"{s.infeasible} | {s.planning_s:.1f} |")  # fmt: skip
            continue
        speedup = pub.step_ms / s.own.step_ms
        flag = " **slower**" if speedup < 0.999 and not pub.oom else ""
        lines.append(
            f"| {j.run['id']} | {pub.plan} | {pub_text} | {s.own.plan} | "
            f"{s.own.samples_per_s:.2f} | {speedup:.2f}x{flag} | {s.differs} | "
            f"{s.planning_s:.1f} |"
        )
    return lines


def _search_summary(judged: list[Judged], searched: dict[str, Searched]) -> list[str]:
    """Counts over the planned rows: faster, equal, slower (the published configuration fitting
    in the model's memory or not), no plan; planning times."""
    got = [(j.run["id"], searched[j.run["id"]]) for j in judged]
    none = [rid for rid, s in got if s.own is None]
    speed = {rid: s.published.step_ms / s.own.step_ms for rid, s in got if s.own is not None}
    fits = {rid for rid, s in got if not s.published.oom}
    slower = [rid for rid, x in speed.items() if x < 0.999 and rid in fits]
    oom_slower = [x for rid, x in speed.items() if x < 0.999 and rid not in fits]
    times = sorted(s.planning_s for _, s in got)

    def span(xs: list[float]) -> str:
        return f"{min(xs):.2f}-{max(xs):.2f}x" if xs else "-"

    return [
        f"- {len(got)} rows planned: dapple's plan is faster on {sum(x > 1.001 for x in speed.values())} "
        f"(up to {max(speed.values()):.2f}x), the same within 0.1% on "
        f"{sum(0.999 <= x <= 1.001 for x in speed.values())}, slower on {len(slower) + len(oom_slower)}; "
        f"no plan fits on {len(none)} ({', '.join(none) or '-'}).",
        f"- slower where the published configuration fits in dapple's memory model (search defects): "
        f"{len(slower)} ({', '.join(f'{r} {speed[r]:.2f}x' for r in slower) or '-'}).",
        f"- slower where it does not fit (dapple's plan is the best that does): {len(oom_slower)} "
        f"({span(oom_slower)}).",
        f"- planning time: median {_median(times):.1f} s, longest {times[-1]:.1f} s.",
        "",
    ]


def report(
    sources: dict[str, dict[str, Any]],
    runs: list[dict[str, Any]],
    command: str,
    *,
    search: bool = True,
    loo: bool = True,
) -> list[str]:
    """The markdown of ``published.md`` (``search``: also plan every expressed row; ``loo``:
    leave-one-out errors of the fit rows)."""
    lines = header("Published GPU training runs and dapple's predictions", command)
    lines.insert(
        -1, "- predictions are analytic (no GPU was used); the machine only runs the arithmetic"
    )
    judged = [judge(r) for r in runs if not blockers(r)]
    searched = {j.run["id"]: search_row(j.run) for j in judged} if search else None
    lines += _efficiency_lines(runs)
    lines += ["", *_summary_lines(sources, runs, judged), "", *_expressed_lines(judged)]
    lines += ["", *miss_lines([_miss_row(j) for j in _scored(judged)])]
    lines += [
        "",
        *(loo_lines(runs) if loo else ["## Leave-one-out", "", "Not run (`--no-loo`).", ""]),
    ]
    lines += ["", *_search_lines(judged, searched)]
    lines += ["", "## Rows dapple does not express", "",
              "| row | model | GPUs | configuration | published | needs |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        if blockers(r):
            lines.append(f"| {r['id']} | {r['model']} | {r['cluster']['gpus']} x {r['cluster']['gpu']} | "
                         f"{_config_text(r)} | {_published_text(r)} | {', '.join(blockers(r))} |")  # fmt: skip
    lines += ["", "## Sources", "", "| key | where | tables |", "|---|---|---|"]
    for key, s in sources.items():
        where = f"{s['repo']} `{s['path']}` @ {s['commit']}" if "repo" in s else s["where"]
        lines.append(f"| {key} | {s['title']}: {where} | {s['tables']} |")
    lines += ["", "## Every row's published numbers", "",
              "| row | source, locator | model | configuration | published | assumed |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        lines.append(f"| {r['id']} | {r['source']}: {r['locator']} | {r['model']} | {_config_text(r)} | "
                     f"{_published_text(r)} | {r.get('assumed', '')} |")  # fmt: skip
    return [*lines, "", *NOTES]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="also write the markdown here")
    ap.add_argument("--no-search", action="store_true", help="skip dapple's own plans (part 4)")
    ap.add_argument("--no-loo", action="store_true", help="skip the fit rows' leave-one-out")
    args = ap.parse_args(argv)
    sources, runs = load_runs()
    command = "python benchmarks/published.py" + (f" --out {args.out}" if args.out else "")
    command += " --no-search" if args.no_search else ""
    command += " --no-loo" if args.no_loo else ""
    write_report(
        report(sources, runs, command, search=not args.no_search, loo=not args.no_loo), args.out
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

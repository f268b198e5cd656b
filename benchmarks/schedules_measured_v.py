"""V schedules measured: dapple's ZB-V and DualPipeV vs ``torch.distributed.pipelining``'s
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` on the same straight partition (CPU, gloo),
with dapple's interleaved 1F1B vs ``ScheduleInterleaved1F1B`` as the noise reference.

Model: the zoo ``transformer`` of :data:`_bench_common.BENCH_MODEL` with ``--blocks`` blocks
(default 14: 16 chain layers). Partition: the straight pipeline over P ranks (``--ranks``,
default 2) cut into S = 2P chunks of equal layer counts. V schedules (Qi et al. section 6;
DeepSeek-V3 section 3.2.1): rank g holds chunks g and 2P-1-g (``dapple.schedule.zbv.v_shape``,
torch's V placement), so rank 0 holds the embedding and the LM head. Interleaved: rank g holds
chunks g and g+P (dapple's ``interleave(straight, 2)``, torch's loop placement). Same global
batch, M, plain SGD, intra-op threads (``cores // P``) for every runner, all cases in ONE gloo
group of P processes, in rounds whose order alternates (:func:`_schedules_worker.worker`,
shared with ``schedules_measured.py``).

Each pair's speed ratio is torch's step time over dapple's in the same round (>= 1.00: dapple at
least as fast), its median and range over rounds. The interleaved pair runs the same runtimes on
the same chunks with schedules both sides have matched before (``schedules_measured.md``), so
its spread over rounds is the noise a V ratio is judged against.

The report goes into ``schedules_measured.md`` between the markers of :data:`BEGIN` and
:data:`END` (replacing that section; ``schedules_measured.py`` keeps it when it rewrites the
file).

Usage: ``python benchmarks/schedules_measured_v.py [--rounds 8 --steps 5 --skip 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (
    BENCH_MODEL,
    HERE,
    WARM_UP,
    bench_transformer,
    header,
    load_note,
    run_worker_group,
    splice_between,
)
from _schedules_worker import ACTION_KINDS, TORCH_SCHEDULES, worker
from dapple.core.plan import Plan, interleave, straight_plan
from dapple.simulate.plan_variants import with_schedule
from vs_torch_pipelining import LR, describe, even_bounds

CLIP = 1.0
"""The max norm of the pair that clips on both sides."""
WORLD = 2
"""Ranks (processes) by default; ``--ranks`` sets another count."""
BEGIN = "<!-- schedules_measured_v.py: begin -->"
END = "<!-- schedules_measured_v.py: end -->"
PAIRS: tuple[tuple[str, str, str, dict[str, Any], dict[str, Any]], ...] = (
    ("interleaved", "interleaved1f1b", "noise reference", {}, {}),
    ("zbv", "zbv", "goal", {}, {}),
    ("dualpipev", "dualpipev", "goal", {}, {}),
    ("zbv", "zbv", "no guard, measured separately", {"on_nonfinite": "off"}, {}),
    (
        "zbv",
        "zbv",
        "both clip: torch by torchtitan's norm over the pipeline ranks",
        {"clip_grad_norm": CLIP},
        {"clip": CLIP},
    ),
)
"""(dapple schedule, torch runner kind, role, dapple's TrainConfig options, the torch runner's
options) of each pair. The fourth runs dapple's ZB-V without the non-finite guard
(``on_nonfinite="off"``: no rank waits for the others' verdict before its optimizer step, as
torch's schedules do not). The fifth clips the global gradient norm on both sides: dapple under
its guard (the norm travels in the guard's one collective), torch as torchtitan clips a pipeline
(each rank's squared norm all-reduced over the pipeline ranks before its optimizer step,
:meth:`_schedules_worker.TorchPipe.step`); both sides then wait for every rank's last weight
gradient before any update."""


def build_cases(blocks: int, G: int, M: int, ranks: int = WORLD) -> list[dict[str, Any]]:
    """The dapple and torch case of each pair in :data:`PAIRS`, on the same chunks."""
    wl = bench_transformer(layers=blocks)
    b = even_bounds(wl.num_layers, ranks)
    straight = straight_plan(wl.num_layers, b[:-1], global_batch_size=G, num_micro_batches=M)
    grp = f"straight {ranks} ranks {b[1:-1]}"
    cases: list[dict[str, Any]] = []
    for schedule, kind, _, train, peer in PAIRS:
        plan = (
            interleave(straight, 2)
            if schedule == "interleaved"
            else with_schedule(straight, schedule)
        )
        chunks = [list(st.layers) for st in plan.stages]
        place = [plan.group_of_stage(k) for k in range(len(chunks))]
        cases.append(
            {
                "group": grp,
                "label": _label(schedule, train),
                "runner": "dapple",
                "plan": plan.to_dict(),
                "kind": kind,
                "train": train,
            }
        )
        cases.append(
            {
                "group": grp,
                "label": f"torch {TORCH_SCHEDULES[kind]}"
                + "".join(f", {k} {v}" for k, v in peer.items()),
                "runner": "torch",
                "kind": kind,
                "torch": peer,
                "chunks": chunks,
                "placement": place,
            }
        )
    return cases


def _label(schedule: str, train: dict[str, str]) -> str:
    """A dapple case's label: its schedule and the TrainConfig options it sets."""
    return f"dapple {schedule}" + "".join(f", {k} {v}" for k, v in train.items())


def _per_round(r: dict[str, Any], skip: int) -> list[float]:
    """Each round's median step ms after the warm-up steps."""
    return [statistics.median(x[skip:]) for x in r["ms"]]


def action_cpu(r: dict[str, Any], skip: int) -> dict[str, float]:
    """Main-thread CPU ms per step of each kind of :data:`ACTION_KINDS`, summed over the ranks:
    each round's median after the warm-up steps, then the median over rounds."""
    return {
        k: statistics.median(statistics.median(rnd[i][skip:]) for rnd in r["actions"])
        for i, k in enumerate(ACTION_KINDS)
    }


def _action_rows(cases: list[dict[str, Any]], got: dict[str, Any], skip: int) -> list[str]:
    """A table of each pair's CPU per action kind, dapple beside torch."""
    head = " | ".join(f"{k} dapple / torch" for k in ACTION_KINDS)
    rows = [
        f"| pair | {head} | main thread outside F, B, I, W: dapple / torch | all threads "
        "(process CPU): dapple / torch |",
        "|---|" + "---:|" * (len(ACTION_KINDS) + 2),
    ]
    for d, t in zip(cases[0::2], cases[1::2], strict=True):
        rd, rt = got[str(cases.index(d))], got[str(cases.index(t))]
        if rd["error"] or rt["error"] or not rd["actions"] or not rt["actions"]:
            continue
        a, b = action_cpu(rd, skip), action_cpu(rt, skip)
        cells = " | ".join(f"{a[k]:.0f} / {b[k]:.0f}" for k in ACTION_KINDS)
        rest = [x["main"] - sum(x[k] for k in "FBIW") for x in (a, b)]
        cpu = [statistics.median(statistics.median(x[skip:]) for x in r["cpu"]) for r in (rd, rt)]
        rows.append(
            f"| {d['label']} vs {t['label']} | {cells} | {rest[0]:.0f} / {rest[1]:.0f} | "
            f"{cpu[0]:.0f} / {cpu[1]:.0f} |"
        )
    return rows


def _placement(c: dict[str, Any]) -> str:
    per = [
        [k for k, g in enumerate(c["placement"]) if g == r] for r in range(max(c["placement"]) + 1)
    ]
    return "; ".join(
        f"r{r}: " + " + ".join(f"{c['chunks'][k][0]}-{c['chunks'][k][1]}" for k in ks)
        for r, ks in enumerate(per)
    )


def report(
    cases: list[dict[str, Any]], got: dict[str, Any], args: argparse.Namespace, run_s: float
) -> list[str]:
    """The markdown section: one row per pair, then the verdicts against the noise reference."""
    G, M, skip = args.global_batch, args.micro_batches, args.skip
    rows = [
        "| pair (role) | chunks per rank (layers) | dapple plan | dapple ms/step | torch ms/step "
        "| speed dapple / torch: median [range over rounds] | per-round ratios |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    ratios: dict[str, list[float]] = {}
    for (_, _, role, _, _), d, t in zip(PAIRS, cases[0::2], cases[1::2], strict=True):
        rd, rt = got[str(cases.index(d))], got[str(cases.index(t))]
        name = f"{d['label']} vs {t['label']} ({role})"
        err = rd["error"] or rt["error"]
        if err:
            rows.append(f"| {name} | {_placement(t)} | - | not run: {err} | - | - | - |")
            continue
        md, mt = _per_round(rd, skip), _per_round(rt, skip)
        paired = [b / a for a, b in zip(md, mt, strict=True)]
        ratios[d["label"]] = paired
        rows.append(
            f"| {name} | {_placement(t)} | {describe(Plan.from_dict(d['plan']))} | "
            f"{statistics.median(md):.1f} | {statistics.median(mt):.1f} | "
            f"**{statistics.median(paired):.2f}x** [{min(paired):.2f}-{max(paired):.2f}] | "
            f"{', '.join(f'{x:.2f}' for x in paired)} |"
        )
    lines = [
        f"## V schedules vs torch.distributed.pipelining ({args.ranks} ranks)",
        "",
        f"Model: zoo `transformer` {{**{BENCH_MODEL}, 'layers': {args.blocks}}}, global batch "
        f"{G}, M = {M} (micro-batch {G // M}), plain SGD lr {LR}, {args.ranks} gloo processes. All "
        f"{2 * len(PAIRS)} cases in ONE process group, {args.rounds} rounds x {args.steps} steps per case, "
        f"the round order alternating, the first {skip} step(s) of each round dropped. Step "
        "time: the slowest rank's period between consecutive step ends, steps back to back "
        "(dapple: between its `run_step` ends). Speed dapple / "
        "torch = torch ms / dapple ms in the same round (>= 1.00: dapple at least as fast). "
        f"Measurements took {run_s:.0f} s.",
        "",
        *rows,
        "",
        "CPU per step by action kind (ms, main thread, all ranks summed; median over steps "
        "after the warm-up, then over rounds): F forward, B whole backward, I input gradient, "
        "W weight gradient, main the whole step on the main thread (`time.thread_time` inside "
        "dapple's `run_step`, around torch's `schedule.step` + optimizer step). The CPU of a wait "
        "for a message (gloo's wait path; a sleep adds none) counts in the main thread outside "
        "the actions on both sides (dapple waits inside F, B and I, torch before them: taken "
        "out of dapple's); the communication threads are counted only in the "
        "last column (`time.process_time` of each process, all its threads).",
        "",
        *_action_rows(cases, got, skip),
        "",
        "### Verdicts",
        "",
    ]
    ref = ratios.get(_label(PAIRS[0][0], PAIRS[0][3]))
    for schedule, _, role, train, _ in PAIRS[1:]:
        label = _label(schedule, train)
        if label not in ratios:
            lines.append(f"- {label}: **not measured** (a side did not run, row above).")
            continue
        r = ratios[label]
        med = statistics.median(r)
        if ref is None:
            noise = "no noise reference (the interleaved pair did not run)"
        else:
            lo, hi = min(ref), max(ref)
            noise = (
                f"the interleaved reference's rounds span {lo:.2f}-{hi:.2f}x (median "
                f"{statistics.median(ref):.2f}x): "
                f"{'within or above' if med >= lo else 'below'} that noise"
            )
        lines.append(
            f"- {label} vs torch (goal >= 1.00x, {role}): "
            f"**{'met' if med >= 1.0 else 'missed'}** ({med:.3f}x, rounds "
            f"{min(r):.2f}-{max(r):.2f}x); {noise}."
        )
    lines += ["", f"End: {load_note()}.", ""]
    return lines


def _commit() -> str:
    """The checkout's HEAD (short hash), with ``+dirty`` when tracked files differ from it."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=HERE).stdout
        except OSError:  # no git (a copy of the tree elsewhere)
            return ""

    dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    return git("rev-parse", "--short", "HEAD").strip() + ("+dirty" if dirty else "")


def splice(md: Path, section: list[str]) -> None:
    """Write ``section`` into ``md`` between :data:`BEGIN` and :data:`END`
    (:func:`_bench_common.splice`)."""
    splice_between(md, section, BEGIN, END)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8, help="alternating rounds")
    ap.add_argument("--steps", type=int, default=5, help="steps per case per round")
    ap.add_argument("--skip", type=int, default=WARM_UP, help="warm-up steps dropped per round")
    ap.add_argument("--blocks", type=int, default=14, help="transformer blocks (+2 layers)")
    ap.add_argument("--ranks", type=int, default=WORLD, help="processes: the V over P ranks")
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--out", default=str(HERE / "schedules_measured.md"))
    args = ap.parse_args(argv)
    G, M = args.global_batch, args.micro_batches
    P = args.ranks
    if P < 2 or M < 2 * P or M % P or G % M:
        raise SystemExit(
            f"need ranks >= 2, M >= {2 * P} (DualPipeV), a multiple of {P} (interleaved), dividing "
            f"G; got G={G} M={M}"
        )
    args_text = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"python benchmarks/schedules_measured_v.py {args_text}".strip()
    head = header("V schedules vs torch (CPU, gloo)", command)
    commit = _commit()  # the checkout the workers import
    cases = build_cases(args.blocks, G, M, P)
    opts = {k: getattr(args, k) for k in ("rounds", "steps", "skip", "blocks")} | {"G": G, "M": M}
    t0 = time.perf_counter()
    got = run_worker_group(worker, P, cases, opts)
    section = report(cases, got, args, time.perf_counter() - t0)
    # the header's first line is the title; keep its facts as the section's list
    section[1:1] = [
        "",
        *head[2:-1],
        f"- commit: `{commit}` at start (`+dirty`: the working tree as run differs from it)",
    ]
    splice(Path(args.out), section)
    print("\n".join(section))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

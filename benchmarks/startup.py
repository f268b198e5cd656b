"""Where a short ``dapple train`` spends its time before step 0: standalone against ``torchrun``.

Each run is a fresh ``dapple train`` of the same small plan (4 processes, 1 step), started
standalone (``python -m dapple train ...``: the launcher starts the 4 workers), standalone with
``DAPPLE_SHARED_SESSION=1`` (the workers stay in the launcher's session, as before
:mod:`dapple.host.own_session`), or by ``torchrun --standalone --nproc-per-node 4 -m dapple
train ...`` (``python -m torch.distributed.run``: each of the 4 processes runs the command as
one rank). The three alternate, ``--repeats`` rounds. Every line a run prints is stamped when it
arrives here; the ``start-up: ...`` lines (printed as each phase starts, see
``dapple.runtime.metrics.announce``) split the time into phases:

- ``launch -> first start-up: line``: Python and the CLI's imports (under torchrun also the
  agent's start, the 4 processes' start and the CLI imports in each);
- standalone only, side by side: the launcher loads (imports, builds, traces) the model and
  checks the plan against it (to ``start-up: checks done``), while the workers start (a new
  session, the runtime's imports; :mod:`dapple.runtime.launch.early`);
- ``ranks: load the model``: every rank loads (and traces) the model itself (standalone: then
  waits for the launcher's checks);
- ``rendezvous`` (``init_process_group``), ``building the stages`` (the stage's layers,
  materialised), ``boundary probe`` (one sample through the pipeline, stage by stage),
  ``process groups and optimizer``, ``first step`` (to the ``step 0`` line);
- ``end``: from the ``step 0`` line to the exit (teardown, the summary).

CPU seconds are those of every process of the run (each launcher waits for its workers, so
theirs count). Medians over the repetitions; the ratio is standalone / torchrun.

Two conditions, one after the other: the cores as they are, then with ``--busy`` processes
spinning, each in a session of its own (stand-ins for other users' sessions: with
``kernel.sched_autogroup_enabled = 1`` Linux shares the CPU between sessions, so what a run
gets depends on how many sessions its processes take).

    python benchmarks/startup.py [--repeats 3] [--busy 6] [-o benchmarks/startup.md]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE)]

from _bench_common import header, load_note, write_report  # noqa: E402

MODEL = ["-m", "dapple.models.hf:gpt2", "--set", "layers=2"]
"""GPT-2 from its config with 2 blocks: 4 traced pieces (embeddings, 2 blocks, head)."""
WORLD = 4

MARKS: dict[str, Callable[[str], bool]] = {
    # a mark: the arrival of the first line that matches
    "first": lambda x: x.startswith("start-up: "),
    "launcher load": lambda x: (
        x.startswith("start-up: loading the model ") and " in each " not in x
    ),
    "starting": lambda x: x.startswith("start-up: starting"),
    "ranks load": lambda x: x.startswith("start-up: loading the model in each"),
    "checks done": lambda x: x.startswith("start-up: checks done"),
    "rendezvous": lambda x: x.startswith("start-up: rendezvous"),
    "building": lambda x: x.startswith("start-up: building"),
    "probing": lambda x: x.startswith("start-up: probing"),
    "groups": lambda x: x.startswith("start-up: process groups"),
    "first step": lambda x: x.startswith("start-up: first step"),
    "step 0": lambda x: x.startswith("step 0 "),
}
PHASES: list[tuple[str, str, str]] = [
    # (row, the mark that starts it, the mark that ends it); "" = launch / exit
    ("launch -> first `start-up:` line", "", "first"),
    ("launcher: load the model, check the plan", "launcher load", "checks done"),
    ("workers: start (session, imports)", "starting", "ranks load"),
    ("ranks: load the model (and wait for the checks)", "@ranks", "rendezvous"),
    ("rendezvous", "rendezvous", "building"),
    ("building the stages", "building", "probing"),
    ("boundary probe", "probing", "groups"),
    ("process groups and optimizer", "groups", "first step"),
    ("first step", "first step", "step 0"),
    ("end (teardown, summary)", "step 0", ""),
]


def _run(argv: list[str], env: dict[str, str]) -> tuple[dict[str, float], float]:
    """One run: the arrival time of each line's first occurrence (and ``""``: the exit), and
    the CPU seconds of all its processes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    seen: dict[str, float] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        t = time.monotonic() - t0
        for mark, matches in MARKS.items():
            if matches(line):
                seen.setdefault(mark, t)
        if os.environ.get("STARTUP_ECHO"):
            print(f"{t:7.2f} {line}", end="", flush=True)
    rc = proc.wait()
    seen[""] = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if rc != 0 or "step 0" not in seen:
        raise SystemExit(f"run failed (exit {rc}): {' '.join(argv)}")
    return seen, cpu


def _phases(seen: dict[str, float]) -> dict[str, float]:
    """Seconds per phase row (absent phases left out)."""
    ranks = seen.get("ranks load", seen.get("launcher load"))  # torchrun: rank 0's own line
    out = {}
    for row, start, end in PHASES:
        a = 0.0 if start == "" else ranks if start == "@ranks" else seen.get(start)
        b = seen.get(end)
        if a is not None and b is not None:
            out[row] = b - a
    return out


def _spinners(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes that spin, each in a session of its own."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(n)]  # fmt: skip


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def _rounds(
    commands: dict[str, tuple[list[str], dict[str, str]]], env: dict[str, str], repeats: int
) -> tuple[dict[str, list[dict[str, float]]], dict[str, list[float]], list[str]]:
    """``repeats`` rounds of every command, alternating: line times, CPU seconds, loads."""
    times: dict[str, list[dict[str, float]]] = {k: [] for k in commands}
    cpus: dict[str, list[float]] = {k: [] for k in commands}
    loads = []
    for r in range(repeats):
        for name, (argv, extra) in commands.items():
            seen, cpu = _run(argv, {**env, **extra})
            times[name].append(seen)
            cpus[name].append(cpu)
            print(f"round {r} {name}: step 0 at {seen['step 0']:.1f} s, exit {seen['']:.1f} s, "
                  f"CPU {cpu:.1f} s", flush=True)  # fmt: skip
        loads.append(load_note())
    return times, cpus, loads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", type=int, default=6, help="spinning sessions of the 2nd condition")
    ap.add_argument("-o", "--out", default=None)
    args = ap.parse_args()
    from dapple.core.plan import straight_plan
    from dapple.host.own_session import SHARED_SESSION_ENV

    tmp = Path(tempfile.mkdtemp(prefix="dapple-startup-"))
    plan = tmp / "plan.json"
    straight_plan(4, [0, 1, 2, 3], global_batch_size=8, num_micro_batches=4).save(plan)
    train = ["train", "--plan", str(plan), *MODEL, "--steps", "1"]
    standalone = [sys.executable, "-m", "dapple", *train]
    commands = {  # name -> (argv, extra env)
        "standalone": (standalone, {}),
        "standalone, one session": (standalone, {SHARED_SESSION_ENV: "1"}),
        "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node", str(WORLD), "-m", "dapple", *train], {}),
    }  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop(SHARED_SESSION_ENV, None)
    flags = (f" --repeats {args.repeats}" if args.repeats != 3 else "") + (
        f" --busy {args.busy}" if args.busy != 6 else "") + (f" -o {args.out}" if args.out else "")  # fmt: skip
    lines = header("start-up: standalone `dapple train` against torchrun",
                   "python benchmarks/startup.py" + flags)  # fmt: skip
    lines += [_intro(args.repeats, train)]
    for busy in (0, args.busy):
        spinners = _spinners(busy)
        try:
            times, cpus, loads = _rounds(commands, env, args.repeats)
        finally:
            _stop(spinners)
        title = "the cores as they are" if busy == 0 else f"{busy} spinning sessions beside"
        lines += ["", f"## {title}", ""]
        lines += _table(times, cpus)
        lines += ["", "Load after each round: " + "; ".join(loads) + "."]
        lines += _notes(times, cpus)
    lines += _mechanism()
    write_report(lines, args.out)


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f}" if xs else "-"


def _intro(repeats: int, train: list[str]) -> str:
    shown = " ".join(a if "/" not in a else "plan.json" for a in train)
    return (
        f"`dapple {shown}`: GPT-2 from its config with 2 blocks (4 traced pieces), plan 1:1:1:1 "
        f"(one piece per process), global batch 8 in 4 micro-batches, gloo, {WORLD} processes, "
        "1 step; OMP_NUM_THREADS=1 for all (torchrun's default). Columns: standalone (each "
        "worker in a session of its own, as torchrun's), standalone with "
        "`DAPPLE_SHARED_SESSION=1` (the workers in the launcher's session, as before "
        f"`dapple.host.own_session`), torchrun. {repeats} runs of each, alternating; seconds, "
        "median [min-max]."
    )


def _table(times: dict[str, list[dict[str, float]]], cpus: dict[str, list[float]]) -> list[str]:
    names = list(times)
    lines = [
        "| phase | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    per = {k: [_phases(s) for s in v] for k, v in times.items()}
    for row, _, _ in PHASES:
        cells = []
        for k in names:
            xs = [p[row] for p in per[k] if row in p]
            cells.append(f"{_median(xs)} [{min(xs):.1f}-{max(xs):.1f}]" if xs else "-")
        lines.append(f"| {row} | {' | '.join(cells)} |")
    start = {k: [s["step 0"] for s in v] for k, v in times.items()}
    total = {k: [s[""] for s in v] for k, v in times.items()}
    for label, d in (("**start-up: launch -> step 0 line**", start),
                     ("whole run: launch -> exit", total), ("CPU seconds, all processes", cpus)):  # fmt: skip
        cells = [f"{_median(d[k])} [{min(d[k]):.1f}-{max(d[k]):.1f}]" for k in names]
        lines.append(f"| {label} | {' | '.join(cells)} |")
    t = statistics.median(start["torchrun"])
    lines.append("")
    for k in names[:-1]:
        s = statistics.median(start[k])
        pairs = [a / b for a, b in zip(start[k], start["torchrun"], strict=True)]
        lines.append(
            f"- start-up (launch to the `step 0` line), {k} / torchrun: **{s / t:.2f}x** "
            f"(medians {s:.1f} s / {t:.1f} s); per round " + ", ".join(f"{p:.2f}x" for p in pairs)
        )
    return lines


def _notes(times: dict[str, list[dict[str, float]]], cpus: dict[str, list[float]]) -> list[str]:
    """What the table shows, with its own numbers."""
    cpu = {k: statistics.median(v) for k, v in cpus.items()}
    per = {k: [_phases(s) for s in v] for k, v in times.items()}

    def med(k: str, row: str) -> float:
        xs = [p[row] for p in per[k] if row in p]
        return statistics.median(xs) if xs else float("nan")

    own, shared, tr = "standalone", "standalone, one session", "torchrun"
    after = ("rendezvous", "building the stages", "boundary probe",
             "process groups and optimizer", "first step")  # fmt: skip
    rest = [sum(med(k, row) for row in after) for k in times]
    ranks = "ranks: load the model (and wait for the checks)"
    end = "end (teardown, summary)"
    return [
        "",
        f"- CPU: {cpu[own]:.1f} s standalone, {cpu[shared]:.1f} s in one session, "
        f"{cpu[tr]:.1f} s under torchrun ({cpu[own] / cpu[tr]:.2f}x): the launcher's own load "
        f"of the model ({med(own, 'launcher: load the model, check the plan'):.1f} s standalone, "
        "beside the workers' start). From the rendezvous to the `step 0` line: "
        f"{min(rest):.1f}-{max(rest):.1f} s in every column.",
        f"- The ranks' load of the model: {med(own, ranks):.1f} s in sessions of their own, "
        f"{med(shared, ranks):.1f} s in the launcher's session, {med(tr, ranks):.1f} s under "
        f"torchrun; the end of the run {med(own, end):.1f}, {med(shared, end):.1f} and "
        f"{med(tr, end):.1f} s.",
    ]


def _mechanism() -> list[str]:
    """Why the columns differ (the same for both conditions)."""
    try:
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        autogroup = "unreadable"
    return [
        "",
        "## Why",
        "",
        "- **Work.** Standalone, the launcher loads and traces the model once to check the plan, "
        "the data and the checkpoints against it before any compute; every rank then loads it "
        "itself to build its stage, as each torchrun rank does (torchrun has no launcher-side "
        "load). The workers are started first (`dapple.runtime.launch.early`), so the "
        "launcher's load runs beside their start and their own load, not before them: the two "
        "standalone-only rows overlap in time. What is left is the launcher's load as CPU the "
        "torchrun run does not spend.",
        f"- **Sessions.** `kernel.sched_autogroup_enabled` is {autogroup} here: Linux then shares "
        "the CPU equally between sessions, not between processes. torch's elastic agent starts "
        "every torchrun worker with `start_new_session=True`; standalone workers that stay in the "
        "launcher's session (`DAPPLE_SHARED_SESSION=1`, how they ran before "
        "`dapple.host.own_session`) share one session's slot when other sessions want the CPU. "
        "Each standalone worker now starts a session of its own before it imports anything.",
    ]


if __name__ == "__main__":
    main()

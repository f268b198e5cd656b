"""Shared helpers of the benchmark scripts: the CPU benchmark model, machine header, statistics.

The scripts run as ``python benchmarks/<name>.py``; this directory is then ``sys.path[0]`` in
the parent and (``spawn`` passes ``sys.path`` on) in every worker, so workers resolve the
benchmark model as the spec ``_bench_common:bench_transformer``.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import random

    from dapple.core.cluster import Cluster
    from dapple.models.workload import Workload

__all__ = [
    "BENCH_MODEL",
    "BENCH_SPEC",
    "HERE",
    "back_to_back_ms",
    "bench_transformer",
    "header",
    "json_child",
    "load_note",
    "max_over_ranks",
    "median_after_warmup",
    "random_server",
    "run_worker_group",
    "spearman",
    "write_report",
]

HERE = Path(__file__).resolve().parent

BENCH_MODEL: dict[str, Any] = {"layers": 8, "hidden": 128, "heads": 4, "seq": 64, "vocab": 512}
"""The CPU benchmark model: zoo ``transformer`` with 8 blocks of width 128 (10 chain layers)."""

BENCH_SPEC = "_bench_common:bench_transformer"
"""``module:factory`` spec of :func:`bench_transformer` for spawned workers."""


WARM_UP = 2
"""Steps dropped at the start of each round (or chunk), both sides. dapple's cases start a new
run each round (:func:`dapple.runtime.run_plan`: the stages built, the step's memory allocated
anew), torch's schedules and DDP are built once and kept; a fresh ZB-V run's second step still takes ~3,600
minor page faults per rank (counted on 2026-12-01, ``RUSAGE_THREAD``), its third ~400, later
ones ~3 (the allocator keeps freed memory, :mod:`dapple.host.host_memory`). With one step
dropped, the measured steps of dapple's V cases carried those faults (~5,000 per step on both
ranks, all in its I actions, against torch's 2-123): the I's +6% CPU of the runs up to then."""


def bench_transformer(**overrides: Any) -> Workload:
    """The zoo transformer at :data:`BENCH_MODEL` sizes (keyword overrides allowed)."""
    from dapple.models.zoo import transformer

    kw = {**BENCH_MODEL, "name": "bench-transformer", **overrides}
    return transformer(**kw)


def random_server(rng: random.Random, devices: int) -> Cluster:
    """One server of ``devices`` devices with 64 GiB each, links of 8 or 80 GB/s (drawn from
    ``rng``) and 0.1 ms latency: the cluster of the random-plan benchmarks (pure Python)."""
    from dapple.core.cluster import Cluster

    return Cluster(
        name="rand",
        servers=1,
        devices_per_server=devices,
        device_memory_bytes=2**36,
        intra_server_bandwidth_gbps=rng.choice([8.0, 80.0]),
        inter_server_bandwidth_gbps=8.0,
        intra_server_latency_ms=0.1,
        inter_server_latency_ms=0.1,
    )


def load_note() -> str:
    """``uptime``'s load averages and the core count, as one line."""
    try:
        one, five, fifteen = os.getloadavg()
        return f"load average (1/5/15 min) {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"
    except OSError:  # pragma: no cover
        return "load average unavailable"


def header(title: str, command: str) -> list[str]:
    """Markdown lines: title, exact command, machine, torch version, date and load."""
    import torch

    try:
        uname = subprocess.run(["uname", "-a"], capture_output=True, text=True, check=False)
        un = uname.stdout.strip()
    except OSError:  # pragma: no cover
        un = platform.platform()
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"# {title}",
        "",
        f"- command: `{command}`",
        f"- machine: `{un}`; nproc {os.cpu_count()}; Python {sys.version.split()[0]}; "
        f"torch {torch.__version__}",
        f"- date: {now}",
        f"- {load_note()} at start (other engineers share these cores: absolute times are "
        "noisy, compare the side-by-side ratios)",
        "",
    ]


def median_after_warmup(values: Sequence[float], warmup: int) -> float:
    """Median of ``values[warmup:]`` (of all values when there are no more)."""
    tail = list(values[warmup:]) or list(values)
    return statistics.median(tail) if tail else math.nan


def _ranks(xs: Sequence[float]) -> list[float]:
    """Average ranks (1-based), ties sharing the mean of their positions."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    ranks = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation: Pearson correlation of the average ranks.

    Raises:
        ValueError: the sequences differ in length or have fewer than 2 items.
    """
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(
            f"spearman needs two equal-length sequences of >= 2, got {len(a)}, {len(b)}"
        )
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = math.sqrt(sum((x - ma) ** 2 for x in ra))
    vb = math.sqrt(sum((y - mb) ** 2 for y in rb))
    return cov / (va * vb) if va > 0 and vb > 0 else math.nan


def error_spread(errs: Sequence[float]) -> tuple[str, int]:
    """Relative errors as two table cells, the 90th percentile of |error| and ``min / max``,
    and how many lie within 10%."""
    a = sorted(abs(e) for e in errs)
    cells = (
        f"{100 * a[int(0.9 * (len(a) - 1))]:.1f}% | "
        f"{100 * min(errs):+.1f}% / {100 * max(errs):+.1f}%"
    )
    return cells, sum(x <= 0.10 for x in a)


def error_row(name: str, errs: Sequence[float]) -> str:
    """One markdown row of relative errors: name, count, median |error|, :func:`error_spread`'s
    cells and how many lie below -5%."""
    import statistics

    spread, within = error_spread(errs)
    return (
        f"| {name} | {len(errs)} | {100 * statistics.median(abs(e) for e in errs):.1f}% "
        f"| {spread} | {within} | {sum(e < -0.05 for e in errs)} |"
    )


def back_to_back_ms(step: Callable[[int], None], steps: Sequence[int]) -> list[float]:
    """This rank's ms per step over back-to-back ``step(k)`` calls after one barrier: the period
    between consecutive step ends, as dapple's ``step_ms`` (no barrier inside the chunk, whose
    cost would otherwise sit outside the timed region). Needs an initialised process group."""
    import time

    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    out = []
    for k in steps:
        step(k)
        now = time.perf_counter()
        out.append((now - t) * 1e3)
        t = now
    return out


def max_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks of the default process group."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.tolist()]


def join_worker_group(rank: int, world: int, port: int) -> None:
    """In a worker of :func:`run_worker_group`: set up this process as dapple's launcher sets up
    a CPU rank (a session of its own, intra-op threads ``cores // world``, freed memory kept by
    the C allocator) and join the gloo group on 127.0.0.1:``port``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dapple.host.cpu_cores import threads_per_worker
    from dapple.host.host_memory import keep_freed_memory
    from dapple.host.own_session import SHARED_SESSION_ENV
    from dapple.runtime.launch.local import pin_cores

    if os.environ.get(SHARED_SESSION_ENV) != "1":  # the footing of dapple's and torchrun's
        os.setsid()  # workers: a session (CPU share under sched_autogroup) of its own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    pinned = pin_cores(rank, world)  # DAPPLE_PIN_CORES=1: each rank on its own cores
    torch.set_num_threads(len(pinned) if pinned else threads_per_worker(world))  # as the runtime
    keep_freed_memory()
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))


def run_worker_group(target: Callable[..., None], world: int, *args: Any) -> dict[str, Any]:
    """Run ``target(rank, world, port, *args, out)`` in ``world`` spawned processes (one gloo
    group on 127.0.0.1) and return the JSON object rank 0 wrote to ``out``.

    Args:
        target: the worker; rank 0 writes its results to the path ``out`` before teardown.
        world: number of processes.
        *args: passed to every worker after ``port``.

    Raises:
        RuntimeError: a worker exited non-zero (workers leave their group with
            ``dapple.runtime.shutdown_distributed``, so teardown is clean too).
    """
    import tempfile

    import torch.multiprocessing as mp

    from dapple.runtime import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        procs = [
            ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode]
        written = Path(out).exists()
        if bad:
            kept = " after writing the results" if written else ""
            raise RuntimeError(f"benchmark workers failed{kept}: {bad} (rank, exit code)")
        return dict(json.loads(Path(out).read_text()))


def git_in(src: Path, *args: str) -> str:
    """``git -C src args``'s output, stripped ('' where git fails)."""
    return subprocess.run(
        ["git", "-C", str(src), *args], capture_output=True, text=True, check=False
    ).stdout.strip()


def json_child(script: str, src: Path, args: Sequence[str], what: str) -> Any:
    """Run ``python script --child *args`` in a process of its own, with ``src`` (a version's
    ``src/`` folder) on its import path and one OpenMP thread, and return its last line of
    standard output parsed as JSON (the child prints its result there).

    Raises:
        RuntimeError: the child failed; names ``what`` and ends with its last standard error.
    """
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    cmd = [sys.executable, script, "--child", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def write_report(lines: Sequence[str], out: str | None) -> None:
    """Print the markdown ``lines`` and write them to ``out`` when given."""
    text = "\n".join(lines) + "\n"
    if out:
        Path(out).write_text(text)
    print(text)


def kept_section(out: Path, heading: str) -> list[str]:
    """The section of an earlier report ``out`` from the line ``heading`` to its end, led by
    a blank line (empty when there is no such report or line): a hand-written reading kept
    when the script writes the report again."""
    if not out.exists():
        return []
    text = out.read_text().splitlines()
    return ["", *text[text.index(heading) :]] if heading in text else []


def splice_between(md: Path, section: list[str], begin: str, end: str) -> None:
    """Write ``section`` into ``md`` between the marker lines ``begin`` and ``end``, replacing what
    was there (appended at the end, with the markers, when they are absent)."""
    text = md.read_text() if md.exists() else ""
    block = "\n".join([begin, *section, end])
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    md.write_text(text)

"""Instructions per training step, dapple against a plain loop, counted by callgrind (issue 46).

Counts, not times: a loaded machine does not move them. One process per version runs the tiny
model of ``runtime_overhead.py`` (traced pieces, 1 stage, M = 4, fp32, fused AdamW, metrics
and the non-finite guard on) under ``valgrind --tool=callgrind`` with instrumentation off, and
turns it on for windows of exactly one step (``CALLGRIND_START_INSTRUMENTATION`` /
``CALLGRIND_DUMP_STATS_AT`` from a small C helper loaded with ``ctypes``):

- ``dapple``: one step of :func:`dapple.runtime.run_plan`, from the end of the previous step's
  ``on_step`` to the start of its own (batch, interpreter, collective, optimizer, metrics);
- ``plain``: one step of the plain loop over the same pieces (``runtime_overhead._plain_step``),
  run inside that ``on_step`` after an unmeasured warm-up step of its own.

Steps ``WARMUP`` and ``WARMUP + 1`` are counted. Each dump's ``totals`` is the user-space
instructions (``Ir``) of its window: the kernel's work (system calls) is not counted, nor are
cache misses, so the count ranks the work a step does, not its time.

Needs ``valgrind`` (with ``valgrind/callgrind.h``) and a C compiler. Takes minutes per version.

Usage::

    python benchmarks/step_instructions.py --before-src /tmp/before/src [--out FILE.md]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _bench_common import git_in

ROOT = Path(__file__).resolve().parent.parent
WARMUP = 3
_HELPER = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void cg_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def _helper(folder: Path) -> Path:
    """The callgrind client-request helper, compiled into ``folder``."""
    src, lib = folder / "cgctl.c", folder / "libcgctl.so"
    src.write_text(_HELPER)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def child(lib_path: str, every: int = 1) -> None:
    """Under callgrind: the counted windows (see the module docstring); dapple's runs with
    ``grad_norm_every`` ``every``."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    import runtime_overhead as ro

    ro.GRAD_NORM_EVERY = every

    lib = ctypes.CDLL(lib_path)
    torch.set_num_threads(1)
    size = dict(ro.MODELS["tiny"])
    wl, _ = ro._model(size)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    plain = ro._plain_step(wl.build_model(ro.SEED + 1), wl, size, WARMUP + 4)

    def on_step(m: object) -> None:
        step = m.step  # type: ignore[attr-defined]
        if step >= WARMUP:
            lib.cg_dump(f"dapple {step}".encode())
        plain(step)  # the plain loop's own warm-up for this step's batch
        if step >= WARMUP:
            lib.cg_start()
            plain(step)
            lib.cg_dump(f"plain {step}".encode())
        if step >= WARMUP - 1:
            lib.cg_start()

    try:
        ro._dapple(wl, size, WARMUP + 2, on_step)
    finally:
        dist.destroy_process_group()


def _count(src: Path, folder: Path, lib: Path, name: str, every: int = 1) -> dict[str, int]:
    """Window name -> instructions, from one callgrind run of ``src``'s dapple."""
    out = folder / f"{name}.out"
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
           sys.executable, __file__, "--child", str(lib), "--grad-norm-every", str(every)]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"callgrind of {src} failed:\n{res.stderr[-3000:]}")
    counts: dict[str, int] = {}
    for dump in sorted(folder.glob(f"{name}.out.*")):
        text = dump.read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.M)
        totals = re.search(r"^totals: (\d+)", text, re.M)
        if trigger and totals:
            counts[trigger.group(1)] = int(totals.group(1))
    return counts


def _report(res: dict[str, dict[str, int]], args: argparse.Namespace) -> str:
    versions = ", ".join(f"{v} = {git_in(s, 'rev-parse', '--short', 'HEAD')} ({s})"
                         for v, s in (("before", args.before_src), ("after", ROOT / "src")))  # fmt: skip
    lines = [
        f"Command: `python benchmarks/step_instructions.py --before-src {args.before_src}"
        + (f" --grad-norm-every {args.grad_norm_every}" if args.grad_norm_every != 1 else "")
        + "`; "
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; valgrind callgrind, "
        f"{os.cpu_count()} CPU cores (counts do not depend on the load); versions: {versions}",
        "",
        "| version | step | dapple instructions | plain instructions | dapple - plain | "
        "dapple / plain |",
        "|---|---|---|---|---|---|",
    ]
    for v, counts in res.items():
        for k in (WARMUP, WARMUP + 1):
            d, p = counts.get(f"dapple {k}"), counts.get(f"plain {k}")
            if d is None or p is None:
                lines.append(f"| {v} | {k} | missing | missing | | |")
                continue
            lines.append(f"| {v} | {k} | {d:,} | {p:,} | {d - p:+,} | {d / p:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--before-src", type=Path, default=Path("/tmp/before/src"))
    ap.add_argument("--out", type=Path, default=None, help="write the table here too")
    ap.add_argument("--grad-norm-every", type=int, default=1,
                    help="the after version's TrainConfig.grad_norm_every (default 1)")  # fmt: skip
    args = ap.parse_args()
    if args.child:
        child(args.child, args.grad_norm_every)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        lib = _helper(folder)
        srcs = {"before": args.before_src, "after": ROOT / "src"}
        with ThreadPoolExecutor(len(srcs)) as pool:  # one valgrind process per version at once
            every = {"before": 1, "after": args.grad_norm_every}
            runs = {
                v: pool.submit(_count, src, folder, lib, v, every[v]) for v, src in srcs.items()
            }
            res = {v: run.result() for v, run in runs.items()}
    text = _report(res, args)
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

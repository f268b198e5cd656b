"""The GPU check: one prepared run that proves dapple's CUDA path, step by step, in ~9 minutes.

Run by ``benchmarks/gpu_check.sh`` (which installs dapple without touching the network) on a
machine with one GPU. Each step runs in its own process under its own time limit; after every
step ``OUT/gpu.md`` is rewritten with what is known so far (a step that fails or runs out of
time is recorded as such and the next one starts). Steps:

1. ``versions``: Python, torch, CUDA, NCCL, cuDNN, transformers, the GPU; the transport dapple
   picks for 4 ranks on this node (:func:`dapple.runtime.comm.transport_for`).
2. ``verify``: ``dapple verify`` on CUDA (fp32, TF32 off) of the zoo transformer and a GPT-2
   from its config, 2 ranks on the one GPU (host-staged gloo: NCCL refuses two ranks on one
   device), plans 1:1 under dapple and ZB-H1 and 2 (data parallel) under ZeRO-1 and ZeRO-2.
3. ``profile``: ``dapple profile --device cuda`` of both models at batch sizes 1, 2, 4 and at 8,
   16: does the affine fit of the small batches predict the large ones? Then planned vs
   measured peak memory per stage (``torch.cuda.max_memory_allocated``) of a 1:1 plan, fp32 and
   bf16.
4. ``vs_plain``: one rank, one stage, dapple's runtime vs a plain PyTorch loop of the same
   model, AdamW and precision, interleaved in one process run (goal: dapple >= 0.97x).
5. ``cpu_pipelining`` and ``cpu_fidelity``: ``benchmarks/vs_torch_pipelining.py`` and
   ``benchmarks/fidelity.py`` on the CPU, 4 processes each pinned to its own cores
   (``DAPPLE_PIN_CORES=1``).

``--dry-run`` (CI, no GPU): every step builds its inputs; CUDA steps stop there, each recorded
as skipped with the reason; the CPU steps check their benchmark's command line.

    python benchmarks/gpu_check.py --out OUT [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SKIPPED = 3
"""Exit code of a step that skipped itself (its reason is its last output line)."""

LIMITS_S = {
    "versions": 40,
    "verify": 150,
    "profile": 120,
    "vs_plain": 90,
    "cpu_pipelining": 70,
    "cpu_fidelity": 70,
}
"""Each step's time limit; 540 s in all."""

TRANSFORMER = {"layers": 4, "hidden": 128, "heads": 4, "seq": 64, "vocab": 512}
GPT2 = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 32}


STAND_IN_ENV = "DAPPLE_GPU_CHECK_DEVICE"
"""``cpu``: the CUDA steps run on the CPU instead (to try the script's own code without a GPU)."""


def _cuda(dry: bool) -> str:
    """The device of a CUDA step: ``cuda``, or the stand-in; without either (or in a dry run)
    stop the step here: exit ``SKIPPED`` with the reason."""
    import torch

    if os.environ.get(STAND_IN_ENV) == "cpu":
        return "cpu"
    if dry or not torch.cuda.is_available():
        print("skipped: no CUDA device" + (" (dry run)" if dry else ""))
        sys.exit(SKIPPED)
    return "cuda"


def _workloads() -> dict[str, Any]:
    from dapple import api

    return {
        "transformer": api.load("transformer", **TRANSFORMER),
        "gpt2": api.load("dapple.models.hf:gpt2", **GPT2),
    }


def step_versions(out: Path, dry: bool) -> list[str]:
    import torch

    import dapple
    from dapple.runtime.comm import transport_for

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "not installed"
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    rows = [
        ("Python", sys.version.split()[0]),
        ("torch", torch.__version__),
        ("CUDA (torch built with)", str(torch.version.cuda)),
        ("NCCL", ".".join(map(str, torch.cuda.nccl.version())) if cuda else "-"),
        ("cuDNN", str(torch.backends.cudnn.version()) if cuda else "-"),
        ("transformers", tf),
        ("dapple", f"{dapple.__version__} at {Path(dapple.__file__).parent}"),
        ("GPU", ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) or "none"),
        ("CPU cores", str(os.cpu_count())),
        ("transport for 4 ranks here", str(transport_for("cuda" if cuda else "cpu", 4, gpus))),
    ]
    return ["| what | version |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def step_verify(out: Path, dry: bool) -> list[str]:
    from dapple.core.plan import straight_plan
    from dapple.runtime.verify import verify_many

    wls = _workloads()
    groups: list[tuple[str, dict[str, Any], list[tuple[str, Any, Any]]]] = []
    for zero in (0, 1, 2):
        cases = []
        for name, wl in wls.items():
            n = wl.num_layers
            if zero == 0:
                for sched in ("dapple", "zbh1"):
                    plan = straight_plan(n, [0, n // 2], global_batch_size=8,
                                         num_micro_batches=2, schedule=sched)  # fmt: skip
                    cases.append((f"{name} 1:1 {sched}", plan, wl))
            else:
                plan = straight_plan(n, [0], global_batch_size=8, num_micro_batches=2,
                                     replicas=[2])  # fmt: skip
                cases.append((f"{name} 2 (data parallel) ZeRO-{zero}", plan, wl))
        groups.append((f"zero {zero}", {"zero_stage": zero}, cases))
    device = _cuda(dry)
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"  # TF32 off in cuBLAS/cuDNN, workers included
    lines = [
        "| case | gradient diff / scale | weight diff | verdict | seconds |",
        "|---|---|---|---|---|",
    ]
    for _, opts, cases in groups:
        t0 = time.perf_counter()
        reports = verify_many([(p, w) for _, p, w in cases], 2, device=device,
                              optimizer="adamw", lr=1e-3, **opts)  # fmt: skip
        dt = (time.perf_counter() - t0) / len(cases)
        for (label, _, _), r in zip(cases, reports, strict=True):
            verdict = "OK" if r.ok else "MISMATCH: " + "; ".join(r.failures)
            lines.append(f"| {label} | {r.max_grad_diff:.2g} | {r.max_abs_diff:.2g} | "
                         f"{verdict} | {dt:.0f} |")  # fmt: skip
            print(lines[-1], flush=True)
    return lines


def _fb_ms(profile: Any, b: float) -> float:
    return sum(lp.forward.at(b) + lp.backward.at(b) for lp in profile.layers)


def step_profile(out: Path, dry: bool) -> list[str]:
    from dapple import api
    from dapple.core.cluster import PRESETS
    from dapple.core.plan import straight_plan
    from dapple.cost.pipeline import pipeline_latency

    wls = _workloads()
    device = _cuda(dry)
    lines = [
        "Is time affine in the batch size? The affine fit of batch sizes 1, 2, 4 extrapolated to "
        "8 and 16, against a profile at 8 and 16 (forward + backward of the whole model, ms).",
        "",
        "| model | precision | fit(1,2,4) at 8 | measured 8 | fit at 16 | measured 16 |",
        "|---|---|---|---|---|---|",
    ]
    small: dict[tuple[str, str], Any] = {}
    for name, wl in wls.items():
        for precision in ("fp32", "bf16"):
            a = api.profile(wl, (1, 2, 4), device=device, precision=precision)
            b = api.profile(wl, (8, 16), device=device, precision=precision)
            small[(name, precision)] = a
            lines.append(
                f"| {name} | {precision} | {_fb_ms(a, 8):.3f} | {_fb_ms(b, 8):.3f} | "
                f"{_fb_ms(a, 16):.3f} | {_fb_ms(b, 16):.3f} |"
            )
            print(lines[-1], flush=True)
    lines += [
        "",
        "Planned vs measured peak memory per stage, 1:1 plan, global batch 8, 2 micro-batches, "
        "AdamW, 3 steps (measured: `torch.cuda.max_memory_allocated` of each rank).",
        "",
        "| model | precision | stage | planned MiB | measured MiB | measured / planned |",
        "|---|---|---|---|---|---|",
    ]
    cluster = PRESETS["h100-8x"]
    for (name, precision), prof in small.items():
        wl = wls[name]
        n = wl.num_layers
        plan = straight_plan(n, [0, n // 2], global_batch_size=8, num_micro_batches=2)
        costs = pipeline_latency(plan, prof, cluster).stages
        planned = [s.memory_bytes for s in costs if s.kind == "compute"]
        metrics = api.train(plan, wl, 3, device=device, optimizer="adamw", lr=1e-3,
                            precision=precision)  # fmt: skip
        measured = metrics[-1].peak_memory_bytes
        for s, (p, m) in enumerate(zip(planned, measured, strict=False)):
            lines.append(f"| {name} | {precision} | {s} | {p / 2**20:.1f} | {m / 2**20:.1f} | "
                         f"{m / p if p else float('nan'):.2f} |")  # fmt: skip
            print(lines[-1], flush=True)
    return lines


def _plain_ms(wl: Any, precision: str, steps: int, device: str) -> list[float]:
    """A plain PyTorch loop: the same model, batches, AdamW and autocast; ms per step."""
    import torch

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    model = wl.build_model(0).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device == "cuda")
    dtype = torch.bfloat16 if precision == "bf16" else None
    times = []
    for t in range(steps):
        inputs, targets = wl.make_batch(16, t)
        sync()
        t0 = time.perf_counter()
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            out = model(inputs)
        wl.loss_fn(out.float(), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def step_vs_plain(out: Path, dry: bool) -> list[str]:
    from dapple import api
    from dapple.core.plan import straight_plan

    wl = api.load("transformer", layers=8, hidden=512, heads=8, seq=128, vocab=4096)
    plan = straight_plan(wl.num_layers, [0], global_batch_size=16, num_micro_batches=1)
    device = _cuda(dry)
    lines = [
        "One rank, one stage, global batch 16, AdamW; median ms per step after 5 warm-up steps "
        "(dapple: `StepMetrics.step_ms`; plain: `torch.cuda.synchronize()` around each step).",
        "",
        "| precision | plain PyTorch ms | dapple ms | dapple speed / plain (goal >= 0.97) |",
        "|---|---|---|---|",
    ]
    for precision in ("fp32", "bf16"):
        plain, mine = [], []
        for _ in range(2):  # interleaved rounds
            plain += _plain_ms(wl, precision, 15, device)[5:]
            ms = [m.step_ms for m in api.train(plan, wl, 15, device=device, optimizer="adamw",
                                                lr=1e-3, precision=precision)]  # fmt: skip
            mine += ms[5:]
        p, d = statistics.median(plain), statistics.median(mine)
        lines.append(f"| {precision} | {p:.2f} | {d:.2f} | {p / d:.3f} |")
        print(lines[-1], flush=True)
    return lines


def _cpu_benchmark(script: str, out: Path, dry: bool) -> list[str]:
    """Run a CPU benchmark with its 4 processes pinned to their own cores; a dry run checks its
    command line only (the benchmarks take minutes on 2 shared cores)."""
    report = out / f"{Path(script).stem}.md"
    extra = ["--no-planned"] if "pipelining" in script else []
    cmd = [sys.executable, str(HERE / script), "--rounds", "2", "--chunk", "2", *extra,
           "--out", str(report)]  # fmt: skip
    if dry:
        subprocess.run([*cmd, "--help"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return [f"dry run: `{' '.join(cmd[1:])} --help` parsed; the benchmark runs without "
                "--dry-run"]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, env={**os.environ, "DAPPLE_PIN_CORES": "1"}, check=True, cwd=ROOT)
    return [f"4 processes, each pinned to its own cores: [{report.name}]({report.name})", ""] + [
        line for line in report.read_text().splitlines() if line.startswith("|")
    ]


def step_cpu_pipelining(out: Path, dry: bool) -> list[str]:
    return _cpu_benchmark("vs_torch_pipelining.py", out, dry)


def step_cpu_fidelity(out: Path, dry: bool) -> list[str]:
    return _cpu_benchmark("fidelity.py", out, dry)


STEPS: dict[str, Callable[[Path, bool], list[str]]] = {
    "versions": step_versions,
    "verify": step_verify,
    "profile": step_profile,
    "vs_plain": step_vs_plain,
    "cpu_pipelining": step_cpu_pipelining,
    "cpu_fidelity": step_cpu_fidelity,
}


def _summary(out: Path, results: dict[str, dict[str, Any]], dry: bool) -> None:
    lines = [
        "# GPU check" + (" (dry run: no GPU)" if dry else ""),
        "",
        f"- command: `bash benchmarks/gpu_check.sh {out}{' --dry-run' if dry else ''}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        "| step | status | seconds | limit s |",
        "|---|---|---|---|",
    ]
    for name in STEPS:
        r = results.get(name)
        status = r["status"] if r else "not run yet"
        secs = f"{r['seconds']:.0f}" if r else "-"
        lines.append(f"| {name} | {status} | {secs} | {LIMITS_S[name]} |")
    for name in STEPS:
        r = results.get(name)
        if r and r.get("lines"):
            lines += ["", f"## {name}", "", *r["lines"]]
    (out / "gpu.md").write_text("\n".join(lines) + "\n")


def _run_step(name: str, out: Path, dry: bool) -> dict[str, Any]:
    log = out / f"{name}.log"
    cmd = [sys.executable, __file__, "--step", name, "--out", str(out)] + (
        ["--dry-run"] if dry else []
    )
    t0 = time.perf_counter()
    with log.open("w") as f:  # a session of its own: a timeout ends its workers too
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)  # fmt: skip
        try:
            rc: int | None = proc.wait(timeout=LIMITS_S[name])
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    dt = time.perf_counter() - t0
    text = log.read_text().strip().splitlines()
    part = out / f"{name}.json"
    lines = json.loads(part.read_text()) if part.exists() else []
    if rc == 0:
        status = "ok"
    elif rc == SKIPPED:
        status = text[-1] if text else "skipped"
    elif rc is None:
        status = f"timed out after {LIMITS_S[name]} s (partial output in {log.name})"
    else:
        status = f"failed (exit {rc}): {text[-1] if text else ''} (see {log.name})"
    return {"status": status, "seconds": dt, "lines": lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--step", choices=list(STEPS), help="run one step (internal)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(HERE)]
    if args.step:
        lines = STEPS[args.step](out, args.dry_run)
        (out / f"{args.step}.json").write_text(json.dumps(lines))
        return
    results: dict[str, dict[str, Any]] = {}
    for name in STEPS:
        print(f"== {name} (limit {LIMITS_S[name]} s)", flush=True)
        results[name] = _run_step(name, out, args.dry_run)
        print(f"== {name}: {results[name]['status']} in {results[name]['seconds']:.0f} s",
              flush=True)  # fmt: skip
        _summary(out, results, args.dry_run)
    print((out / "gpu.md").read_text())


if __name__ == "__main__":
    main()

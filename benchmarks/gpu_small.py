"""GPU check, the first version's steps on small models: ``versions``, ``verify``, ``profile``
and ``vs_plain`` (``../shared/evidence/h200-2026-11-28/run1-gpu_check.md`` is their first run).

1. ``versions``: Python, torch, CUDA, NCCL, cuDNN, transformers (against dapple's minimum), the
   GPU, this process's cores; the transport dapple picks for 4 ranks on this node.
2. ``verify``: ``dapple verify`` on CUDA (fp32, TF32 off) of the zoo transformer and a GPT-2
   from its config, 2 ranks on the one GPU (host-staged gloo), plans 1:1 under dapple and ZB-H1
   and 2 (data parallel) under ZeRO-1 and ZeRO-2. The dry run verifies the zoo transformer, 1:1 only.
3. ``profile``: CUDA profiles of both models at batch sizes 1, 2, 4 and at 8, 16: does the
   affine fit of the small batches predict the large ones? Then planned vs measured peak memory
   per stage of a 1:1 plan, fp32 and bf16. Profiles are saved as JSON beside the report.
4. ``vs_plain``: one rank, one stage, dapple's runtime vs a plain PyTorch loop of the same
   model, AdamW and precision, interleaved (goal: dapple >= 0.97x).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gpu_common import Ctx, cores

TRANSFORMER = {"layers": 4, "hidden": 128, "heads": 4, "seq": 64, "vocab": 512}
GPT2 = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 128, "seq": 32}


def _workloads(dry: bool) -> dict[str, Any]:
    """The two small models (the dry run: the zoo transformer only)."""
    from dapple import api

    wls = {"transformer": api.load("transformer", **TRANSFORMER)}
    if not dry:
        wls["gpt2"] = api.load("dapple.models.hf:gpt2", **GPT2)
    return wls


def step_versions(ctx: Ctx) -> list[str]:
    import torch

    import dapple
    from dapple.errors import ValidationError
    from dapple.models.hf import MIN_TRANSFORMERS, _transformers
    from dapple.runtime.comm import transport_for

    need = ".".join(map(str, MIN_TRANSFORMERS))
    try:
        tf = f"{_transformers().__version__} (dapple needs >= {need}: ok)"
    except ValidationError as e:
        tf = f"**refused**: {e}"
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
        ("CPU cores (this process's)", cores()),
        ("transport for 4 ranks here", str(transport_for("cuda" if cuda else "cpu", 4, gpus))),
    ]
    return ["| what | version |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]]


def step_verify(ctx: Ctx) -> list[str]:
    from dapple.core.plan import straight_plan
    from dapple.runtime.train_config import TrainConfig
    from dapple.runtime.verify import verify_many

    wls = _workloads(ctx.dry)
    groups: list[tuple[str, dict[str, Any], list[tuple[str, Any, Any]]]] = []
    for zero in (0,) if ctx.dry else (0, 1, 2):
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
    device = ctx.device
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"  # TF32 off in cuBLAS/cuDNN, workers included
    lines = [
        "| case | gradient diff / scale | weight diff | verdict | seconds |",
        "|---|---|---|---|---|",
    ]
    for _, opts, cases in groups:
        t0 = time.perf_counter()
        cfg = TrainConfig(steps=2, device=device, optimizer="adamw", lr=1e-3, timeout_s=120.0,
                          **opts)  # fmt: skip
        reports = verify_many([(p, w) for _, p, w in cases], cfg)
        dt = (time.perf_counter() - t0) / len(cases)
        for (label, _, _), r in zip(cases, reports, strict=True):
            verdict = "OK" if r.ok else "MISMATCH: " + "; ".join(r.failures)
            lines.append(f"| {label} | {r.max_grad_diff:.2g} | {r.max_abs_diff:.2g} | "
                         f"{verdict} | {dt:.0f} |")  # fmt: skip
            print(lines[-1], flush=True)
    return lines


def _fb_ms(profile: Any, b: float) -> float:
    return sum(lp.forward.at(b) + lp.backward.at(b) for lp in profile.layers)


def step_profile(ctx: Ctx) -> list[str]:
    from dapple import api
    from dapple.core.cluster_presets import PRESETS
    from dapple.core.plan import straight_plan
    from dapple.cost.pipeline import pipeline_latency

    wls = _workloads(ctx.dry)
    device = ctx.device
    lines = [
        "Is time affine in the batch size? The affine fit of batch sizes 1, 2, 4 extrapolated to "
        "8 and 16, against a profile at 8 and 16 (forward + backward of the whole model, ms).",
        "",
        "| model | precision | fit(1,2,4) at 8 | measured 8 | fit at 16 | measured 16 |",
        "|---|---|---|---|---|---|",
    ]
    small: dict[tuple[str, str], Any] = {}
    for name, wl in wls.items():
        for precision in ("bf16",) if ctx.dry else ("fp32", "bf16"):
            a = api.profile(wl, (1, 2, 4), device=device, precision=precision, **ctx.timing)
            b = api.profile(wl, (8, 16), device=device, precision=precision, **ctx.timing)
            a.save(ctx.path(f"profile_small_{name}_{precision}_1-4.json"))
            b.save(ctx.path(f"profile_small_{name}_{precision}_8-16.json"))
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
    cluster.save(ctx.path("cluster_h100-8x.json"))
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
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


def step_vs_plain(ctx: Ctx) -> list[str]:
    from dapple import api
    from dapple.core.plan import straight_plan

    size = (
        {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 256}
        if ctx.dry
        else {"layers": 8, "hidden": 512, "heads": 8, "seq": 128, "vocab": 4096}
    )
    steps, skip = (4, 1) if ctx.dry else (15, 5)
    wl = api.load("transformer", **size)
    plan = straight_plan(wl.num_layers, [0], global_batch_size=16, num_micro_batches=1)
    device = ctx.device
    lines = [
        f"Zoo transformer {size}, one rank, one stage, global batch 16, AdamW; median ms per "
        f"step after {skip} warm-up steps (dapple: `StepMetrics.step_ms`; plain: `torch.cuda.synchronize()` around each step).",
        "",
        "| precision | plain PyTorch ms | dapple ms | dapple speed / plain (goal >= 0.97) |",
        "|---|---|---|---|",
    ]
    for precision in ("bf16",) if ctx.dry else ("fp32", "bf16"):
        plain, mine = [], []
        for _ in range(ctx.rounds):  # interleaved rounds
            plain += _plain_ms(wl, precision, steps, device)[skip:]
            ms = [m.step_ms for m in api.train(plan, wl, steps, device=device, optimizer="adamw",
                                                lr=1e-3, precision=precision)]  # fmt: skip
            mine += ms[skip:]
        p, d = statistics.median(plain), statistics.median(mine)
        lines.append(f"| {precision} | {p:.2f} | {d:.2f} | {p / d:.3f} |")
        print(lines[-1], flush=True)
    return lines

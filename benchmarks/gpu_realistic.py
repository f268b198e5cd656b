"""GPU check, step ``realistic``: Llama-3-8B shapes (2 blocks, seq 4096, global batch 2, AdamW
fused, bf16 autocast) trained by a plain Hugging Face loop, by the same plain loop over dapple's
traced pieces of the model (``Workload.build_model``) and by dapple's runtime (1 stage), the
traced model as it comes and with ``attention=causal``, in interleaved rounds; then planned vs
measured peak memory for 1 stage and a 1:1 plan (2 ranks sharing the GPU).

Measured: median ms per step after :data:`WARMUP` steps (plain loops: ``torch.cuda.synchronize()``
around each step; dapple: ``StepMetrics.step_ms``) and ``torch.cuda.max_memory_allocated``
(dapple: each rank's ``StepMetrics.peak_memory_bytes``). Planned: the memory of each compute
stage of :func:`dapple.cost.pipeline.pipeline_latency`, fed dapple's measured CUDA profile and
every analytic profile of the shapes (``h100``, and ``h200`` where that datasheet exists).
Inputs written beside the report: the HF config, the profiles, the cluster, the plans.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from gpu_common import (
    GLOBAL_BATCH,
    Ctx,
    llama_config,
    llama_spec,
    peak_mib,
    reset_peak,
    save_json,
    sync,
)
from gpu_common import say as _say

STEPS = 10
"""Steps per run; the first :data:`WARMUP` are dropped."""
WARMUP = 4
DRY_STEPS = 3
"""Steps per run in the dry run (1 dropped)."""
PIPE_STEPS = 3
"""Steps of the 1:1 memory run (memory only: its peak is reached in the first step)."""
ANALYTIC_DEVICES = ("h100", "h200")
"""Analytic datasheets compared where they exist (``h200`` is added by issue 41's item 2)."""


def analytic_devices() -> list[str]:
    """The names of :data:`ANALYTIC_DEVICES` that ``analytic_devices.DEVICES`` defines."""
    from dapple.profiler.analytic_devices import DEVICES

    return [d for d in ANALYTIC_DEVICES if d in DEVICES] or ["h100"]


def plain_run(ctx: Ctx, steps: int, pieces: bool = False) -> tuple[list[float], list[float], float]:
    """A plain loop: ``AutoModelForCausalLM.from_config`` (``pieces``: dapple's traced pieces
    of it, ``Workload.build_model``), fp32 weights, bf16 autocast, fused AdamW; dapple's batches
    and loss. Step ms, forward+backward ms, peak MiB."""
    import torch

    from dapple import api
    from dapple.models.hf import _transformers, causal_lm_loss

    s, dev = ctx.shapes, ctx.device
    wl = api.load(llama_spec(ctx), seq=s["seq"])
    reset_peak(dev)
    if pieces:
        model = wl.build_model(0).to(dev)
    else:
        with torch.device(dev):
            model = _transformers().AutoModelForCausalLM.from_config(llama_config(s))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_ms, fb_ms = [], []
    for t in range(steps):
        (ids, mask), targets = wl.make_batch(GLOBAL_BATCH, t)
        sync(dev)
        t0 = time.perf_counter()
        ids, mask, targets = ids.to(dev), mask.to(dev), targets.to(dev)
        with torch.autocast(dev, dtype=torch.bfloat16):
            if pieces:
                logits = model((ids, mask))
            else:
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        causal_lm_loss(logits.float(), targets).backward()
        sync(dev)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        step_ms.append(1e3 * (time.perf_counter() - t0))
        fb_ms.append(1e3 * (t1 - t0))
    peak = peak_mib(dev)
    del model, opt
    reset_peak(dev)
    return step_ms, fb_ms, peak


def dapple_run(
    ctx: Ctx, spec: str, plan: Any, steps: int, attention: str = "masked"
) -> tuple[list[float], list[float]]:
    """dapple's runtime (the traced model's ``attention``, :mod:`dapple.models.hf_attention`):
    step ms of each step, each rank's peak MiB at the last step."""
    from dapple import api

    reset_peak(ctx.device)
    overrides = {"seq": ctx.shapes["seq"], "attention": attention}
    m = api.train(plan, spec, steps, overrides=overrides, device=ctx.device,
                  optimizer="adamw", lr=1e-4, precision="bf16")  # fmt: skip
    return [x.step_ms for x in m], [b / 2**20 for b in m[-1].peak_memory_bytes]


RUNNERS = ("plain", "pieces", "dapple", "dapple causal")
"""The timed loops: plain HF, a plain loop over dapple's traced pieces (the model dapple runs,
without its runtime), dapple's runtime, and dapple's runtime with ``--set attention=causal`` (SDPA
with ``is_causal`` and no mask, as the plain HF loop calls it)."""


def _timing(ctx: Ctx, spec: str, one: Any, lines: list[str]) -> float:
    """Plain HF, plain over the traced pieces and dapple, interleaved; the 1-stage run's
    measured peak MiB."""
    steps, skip = (DRY_STEPS, 1) if ctx.dry else (STEPS, WARMUP)
    ms_of: dict[str, list[float]] = {who: [] for who in RUNNERS}
    fb_of: dict[str, list[float]] = {"plain": [], "pieces": []}
    peaks: dict[str, float] = dict.fromkeys(RUNNERS, 0.0)
    rows = []
    for r in range(ctx.rounds):  # the order alternates
        for who in RUNNERS if r % 2 == 0 else RUNNERS[::-1]:
            if who.startswith("dapple"):
                mode = "causal" if who == "dapple causal" else "masked"
                ms, mem = dapple_run(ctx, spec, one, steps, attention=mode)
                p = mem[0]
            else:
                ms, f, p = plain_run(ctx, steps, pieces=who == "pieces")
                fb_of[who] += f[skip:]
            ms_of[who] += ms[skip:]
            peaks[who] = max(peaks[who], p)
            rows.append(f"| {r} | {who} | {statistics.median(ms[skip:]):.1f} | {p:.0f} |")
            print(rows[-1], flush=True)
    say = lambda s="": _say(lines, s)  # noqa: E731
    say(f"Plain HF loop, a plain loop over dapple's traced pieces and dapple's runtime (1 stage), "
        f"{ctx.rounds} interleaved rounds of {steps} steps, median after {skip} warm-up steps; "
        "peak = `max_memory_allocated`.")  # fmt: skip
    say()
    say("| round | run | median step ms | peak MiB |")
    say("|---|---|---|---|")
    for row in rows:
        lines.append(row)
    p, q, d, c = (statistics.median(ms_of[w]) for w in RUNNERS)
    fb_p, fb_q = (statistics.median(fb_of[w]) for w in ("plain", "pieces"))
    say()
    say(f"- plain HF: {p:.1f} ms per step (forward+backward {fb_p:.1f} ms); plain over the traced "
        f"pieces: {q:.1f} ms (forward+backward {fb_q:.1f} ms); dapple: {d:.1f} ms; "
        f"**dapple speed / plain: {p / d:.3f}** (goal >= 0.97); dapple / pieces {q / d:.3f} "
        f"(what the runtime costs); pieces / plain HF {p / q:.3f} (what the traced model "
        f"costs); dapple with attention=causal: {c:.1f} ms, **speed / plain "
        f"{p / c:.3f}**")  # fmt: skip
    save_json(ctx, "realistic_times.json",
              {"plain_step_ms": ms_of["plain"], "plain_fb_ms": fb_of["plain"],
               "pieces_step_ms": ms_of["pieces"], "pieces_fb_ms": fb_of["pieces"],
               "dapple_step_ms": ms_of["dapple"],
               "dapple_causal_step_ms": ms_of["dapple causal"], "peak_mib": peaks})  # fmt: skip
    return peaks["dapple"]


def _planned(plan: Any, profile: Any, cluster: Any) -> list[float]:
    from dapple.cost.pipeline import pipeline_latency

    stages = pipeline_latency(plan, profile, cluster).stages
    return [s.memory_bytes / 2**20 for s in stages if s.kind == "compute"]


def step_realistic(ctx: Ctx) -> list[str]:
    from dapple import api
    from dapple.core.cluster_presets import PRESETS
    from dapple.core.plan import straight_plan
    from dapple.profiler.analytic import analytic_profile

    lines: list[str] = []
    s = ctx.shapes
    spec = llama_spec(ctx)
    _say(lines, f"Llama-3-8B shapes {s}, global batch {GLOBAL_BATCH}, AdamW (fused), bf16 "
                f"autocast, on {ctx.device}; config: `{spec.split('/')[-1]}/config.json`")  # fmt: skip
    _say(lines)
    n = api.load(spec, seq=s["seq"]).num_layers
    one = straight_plan(n, [0], global_batch_size=GLOBAL_BATCH, num_micro_batches=1)
    two = straight_plan(n, [0, n // 2], global_batch_size=GLOBAL_BATCH, num_micro_batches=2)
    one.save(ctx.path("plan_1stage.json"))
    two.save(ctx.path("plan_1to1.json"))
    one_peak = _timing(ctx, spec, one, lines)

    t0 = time.perf_counter()
    measured = api.profile(spec, (1, 2), device=ctx.device, precision="bf16",
                           overrides={"seq": s["seq"]}, **ctx.timing)  # fmt: skip
    measured.save(ctx.path("profile_llama_measured.json"))
    profiles = {"measured": measured}
    for d in analytic_devices():
        profiles[f"analytic {d}"] = analytic_profile(spec, d, precision="bf16",
                                                     batch_sizes=(1, 2), seq_len=s["seq"])  # fmt: skip
        profiles[f"analytic {d}"].save(ctx.path(f"profile_llama_analytic_{d}.json"))
    fb = sum(lp.forward.at(2) + lp.backward.at(2) for lp in measured.layers)
    _say(lines)
    _say(lines, f"- dapple's {ctx.device} profile (1, 2) in {time.perf_counter() - t0:.0f} s: forward + "
                f"backward of every layer at b=2 sums to {fb:.1f} ms")  # fmt: skip
    name = "h200-8x" if "h200-8x" in PRESETS else "h100-8x"
    cluster = PRESETS[name]
    cluster.save(ctx.path(f"cluster_{name}.json"))
    pipe_steps = DRY_STEPS if ctx.dry else PIPE_STEPS
    _, two_peaks = dapple_run(ctx, spec, two, pipe_steps)
    cols = list(profiles)
    _say(lines)
    _say(lines, f"Planned (`pipeline_latency` on cluster `{name}`) vs measured peak memory per "
                "stage (MiB; ratio = measured / planned). 1:1: 2 ranks sharing the device, "
                f"M = 2, {pipe_steps} steps.")  # fmt: skip
    _say(lines)
    _say(lines, "| plan | stage | measured | " + " | ".join(f"planned ({c}) | ratio" for c in cols)
         + " |")  # fmt: skip
    _say(lines, "|---|---|---|" + "---|---|" * len(cols))
    table = []
    for label, plan, mem in (("1 stage", one, [one_peak]), ("1:1", two, two_peaks)):
        planned = {c: _planned(plan, p, cluster) for c, p in profiles.items()}
        for i, m in enumerate(mem):
            cells = " | ".join(f"{planned[c][i]:.1f} | {m / planned[c][i]:.2f}" for c in cols)
            _say(lines, f"| {label} | {i} | {m:.1f} | {cells} |")
            table.append({"plan": label, "stage": i, "measured_mib": m,
                          "planned_mib": {c: planned[c][i] for c in cols}})  # fmt: skip
    save_json(ctx, "realistic_memory.json", table)
    return lines

"""GPU check, step ``layers``: dapple's analytic (roofline) layer times against the same layers
measured by dapple's own CUDA profiler (bf16 autocast), per layer, forward and backward, at
batch sizes 1 and 2, for three models at the Llama's width cut to 2 blocks:

- Llama-3-8B shapes (HF LLaMA, SDPA attention), the traced model as it comes (SDPA given the
  causal mask) and with ``--set attention=causal`` (SDPA's ``is_causal``,
  :mod:`dapple.models.hf_attention`): the rows a fit of the causal kernel needs;
- GPT-2 shapes at width 4096 (HF GPT-2, vocabulary 50,257);
- dapple's zoo transformer at width 4096 (eager attention), half the sequence.

First the machine's own ceilings (``calibration.json``): a bf16 GEMM's TFLOP/s and a
device-to-device copy's bandwidth, beside the datasheet numbers of each analytic device
(``h100``, and ``h200`` where it exists). Every profile is saved as JSON, and ``layers.json``
holds every row (the data issue 41's item 2 fits its efficiencies on).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from gpu_common import Ctx, gpt2_spec, llama_spec, save_json, sync
from gpu_common import say as _say
from gpu_realistic import analytic_devices

SIZES = (1, 2)
"""Batch sizes profiled."""


def _gemm_and_copy(ctx: Ctx) -> dict[str, float]:
    """A bf16 GEMM's FLOP/s (8192^3 on CUDA, 512^3 in a dry run) and a copy's bytes/s (read +
    written), each the mean of 10 after 3 warm-ups."""
    import torch

    n, mib = (512, 8) if ctx.dry else (8192, 2048)
    a = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=ctx.device, dtype=torch.bfloat16)
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)

    def timed(fn: Any) -> float:
        for _ in range(3):
            fn()
        sync(ctx.device)
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        sync(ctx.device)
        return (time.perf_counter() - t0) / 10

    gemm = timed(lambda: a @ b)
    copy = timed(lambda: dst.copy_(src))
    return {"gemm_n": n, "gemm_bf16_flops_per_s": 2 * n**3 / gemm,
            "copy_bytes": src.numel(), "copy_bytes_per_s": 2 * src.numel() / copy}  # fmt: skip


def _models(ctx: Ctx) -> list[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """``(label, spec, load overrides, analytic keyword arguments)`` of each model."""
    s = ctx.shapes
    seq = s["seq"]
    zoo = {"layers": s["layers"], "hidden": s["hidden"], "heads": s["heads"], "seq": seq // 2,
           "vocab": 32000 if not ctx.dry else s["vocab"]}  # fmt: skip
    return [
        ("Llama-3-8B shapes, 2 blocks (HF, SDPA)", llama_spec(ctx), {"seq": seq},
         {"seq_len": seq}),
        ("Llama-3-8B shapes, 2 blocks (HF, SDPA, attention=causal)", llama_spec(ctx),
         {"seq": seq, "attention": "causal"},
         {"seq_len": seq, "overrides": {"attention": "causal"}}),
        ("GPT-2 shapes, width 4096, 2 blocks (HF, SDPA)", gpt2_spec(ctx), {"seq": seq},
         {"seq_len": seq}),
        ("zoo transformer, width 4096, 2 blocks (eager attention)", "transformer", zoo,
         {"overrides": zoo, "attention": "eager"}),
    ]  # fmt: skip


def _compare(ctx: Ctx, label: str, spec: str, load: dict[str, Any], an_kw: dict[str, Any],
             lines: list[str], rows: list[dict[str, Any]]) -> None:  # fmt: skip
    from dapple import api
    from dapple.profiler.analytic import analytic_profile

    say = lambda s="": _say(lines, s)  # noqa: E731
    tag = label.split(",")[0].split()[0].lower().replace("-", "")
    tag += "_causal" if load.get("attention") == "causal" else ""
    say(f"### {label}")
    say()
    t0 = time.perf_counter()
    meas = api.profile(spec, SIZES, device=ctx.device, precision="bf16", overrides=load,
                       **ctx.timing)  # fmt: skip
    meas.save(ctx.path(f"profile_{tag}_measured.json"))
    devs = analytic_devices()
    an = {d: analytic_profile(spec, d, precision="bf16", batch_sizes=SIZES, **an_kw) for d in devs}
    for d, p in an.items():
        p.save(ctx.path(f"profile_{tag}_analytic_{d}.json"))
    say(f"measured by `dapple profile` in {time.perf_counter() - t0:.0f} s on {meas.device}; "
        f"ratio = measured / analytic")  # fmt: skip
    say()
    if len(an[devs[0]].layers) != len(meas.layers):
        say(f"layer counts differ: measured {len(meas.layers)}, analytic "
            f"{len(an[devs[0]].layers)}; the first ones are compared")  # fmt: skip
    head = " | ".join(f"{d} F ms | F ratio | {d} B ms | B ratio" for d in devs)
    say(f"| layer (measured / analytic) | b | meas F ms | meas B ms | {head} |")
    say("|---|---|---|---|" + "---|---|---|---|" * len(devs))
    tot = {b: {"measured": 0.0, **{d: 0.0 for d in devs}} for b in SIZES}
    for i, lp in enumerate(meas.layers[: len(an[devs[0]].layers)]):
        for b in SIZES:
            mf, mb = lp.forward.at(b), lp.backward.at(b)
            cells, row = [], {"model": label, "layer": lp.name, "b": b, "measured_f_ms": mf,
                              "measured_b_ms": mb}  # fmt: skip
            tot[b]["measured"] += mf + mb
            for d in devs:
                al = an[d].layers[i]
                af, ab = al.forward.at(b), al.backward.at(b)
                tot[b][d] += af + ab
                cells.append(f"{af:.3f} | {mf / af:.2f} | {ab:.3f} | {mb / ab:.2f}")
                row[f"{d}_f_ms"], row[f"{d}_b_ms"], row["analytic_layer"] = af, ab, al.name
            say(f"| {lp.name} / {an[devs[0]].layers[i].name} | {b} | {mf:.3f} | {mb:.3f} | "
                + " | ".join(cells) + " |")  # fmt: skip
            rows.append(row)
    say()
    for b in SIZES:
        m = tot[b]["measured"]
        parts = "; ".join(f"{d} {tot[b][d]:.2f} ms (ratio {m / tot[b][d]:.2f})" for d in devs)
        say(f"- whole model, b={b}: measured F+B {m:.2f} ms; analytic {parts}")
    say()


def step_layers(ctx: Ctx) -> list[str]:
    from dapple.profiler.analytic_devices import DEVICES

    lines: list[str] = []
    cal = _gemm_and_copy(ctx)
    devs = analytic_devices()
    cal["datasheets"] = {d: dataclasses.asdict(DEVICES[d]) for d in devs}
    if ctx.device == "cuda":
        import torch

        cal["gpu"] = torch.cuda.get_device_name(0)
    save_json(ctx, "calibration.json", cal)
    _say(lines, f"Measured here: bf16 GEMM {cal['gemm_n']}^3 at "
                f"{cal['gemm_bf16_flops_per_s'] / 1e12:.3g} TFLOP/s, copy "
                f"{cal['copy_bytes_per_s'] / 1e12:.3g} TB/s (read + written); datasheets: "
                + "; ".join(f"{d} {DEVICES[d].peak_flops['bf16'] / 1e12:.0f} TFLOP/s bf16, "
                            f"{DEVICES[d].hbm_bytes_per_s / 1e12:.2f} TB/s" for d in devs)
                + " (`calibration.json`)")  # fmt: skip
    _say(lines)
    rows: list[dict[str, Any]] = []
    for label, spec, load, an_kw in _models(ctx):
        try:
            _compare(ctx, label, spec, load, an_kw, lines, rows)
        except Exception as e:  # record and go on to the next model
            _say(lines, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            _say(lines)
            import traceback

            traceback.print_exc()
        if ctx.device == "cuda":
            import torch

            torch.cuda.empty_cache()
    save_json(ctx, "layers.json", rows)
    if len(rows) == 0:
        raise RuntimeError("no model was compared (see the log)")
    return lines

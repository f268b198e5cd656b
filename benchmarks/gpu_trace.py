"""GPU check, step ``trace``: ``torch.profiler`` of one dapple step beside one plain HF step, at
the realistic size (Llama-3-8B shapes, 2 blocks, seq 4096, global batch 2, AdamW, bf16).

dapple's step runs in this process as a one-rank ``torchrun``-style job (RANK, WORLD_SIZE,
MASTER_ADDR/PORT set here; :func:`dapple.runtime.launch.launcher.init_distributed` then
:func:`dapple.runtime.engine.run_plan`), so the profiler sees the runtime's own host work
(interpreter, hooks, metrics) as well as the kernels. Both sides run :data:`STEPS` steps under
``torch.profiler.schedule(wait=STEPS - 2, warmup=1, active=1)``: the profiler keeps exactly the
last step. Tables (``key_averages().table``, top :data:`ROWS` by self CPU time, and by self
device time on CUDA) and Chrome traces are written beside the report.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from gpu_common import GLOBAL_BATCH, Ctx, llama_config, llama_spec, reset_peak
from gpu_common import say as _say

STEPS = 4
"""Steps per side; the profiler keeps the last one."""
ROWS = 20
"""Rows of each table in the files (the report shows the top 10)."""


def _profiler(device: str) -> Any:
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    return profile(activities=acts, schedule=schedule(wait=STEPS - 2, warmup=1, active=1))


def _dapple_step(ctx: Ctx, spec: str) -> Any:
    """One dapple step under the profiler (1 stage, in this process)."""
    import torch.distributed as dist

    from dapple import api
    from dapple.core.plan import straight_plan
    from dapple.runtime.engine import run_plan
    from dapple.runtime.launch.launcher import free_port, init_distributed
    from dapple.runtime.train_config import TrainConfig

    wl = api.load(spec, seq=ctx.shapes["seq"])
    plan = straight_plan(wl.num_layers, [0], global_batch_size=GLOBAL_BATCH, num_micro_batches=1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))  # fmt: skip
    cfg = TrainConfig(steps=STEPS, device=ctx.device, optimizer="adamw", lr=1e-4,
                      precision="bf16")  # fmt: skip
    device = init_distributed(cfg, 1)
    prof = _profiler(ctx.device)
    try:
        with prof:
            run_plan(plan, wl, cfg, device=device, on_step=lambda _m: prof.step())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return prof


def _plain_step(ctx: Ctx, spec: str) -> Any:
    """One plain HF step under the profiler (as :func:`gpu_realistic.plain_run`)."""
    import torch

    from dapple import api
    from dapple.models.hf import _transformers, causal_lm_loss

    dev = ctx.device
    wl = api.load(spec, seq=ctx.shapes["seq"])
    with torch.device(dev):
        model = _transformers().AutoModelForCausalLM.from_config(llama_config(ctx.shapes))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    prof = _profiler(dev)
    with prof:
        for t in range(STEPS):
            (ids, mask), targets = wl.make_batch(GLOBAL_BATCH, t)
            ids, mask, targets = ids.to(dev), mask.to(dev), targets.to(dev)
            with torch.autocast(dev, dtype=torch.bfloat16):
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            causal_lm_loss(logits.float(), targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if dev == "cuda":
                torch.cuda.synchronize()
            prof.step()
    del model, opt
    return prof


def _tables(ctx: Ctx, who: str, prof: Any) -> dict[str, str]:
    """Write the tables and the Chrome trace of one side; the tables by sort key."""
    ka = prof.key_averages()
    keys = ["self_cpu_time_total"] + (["self_device_time_total"] if ctx.device == "cuda" else [])
    out = {}
    for key in keys:
        out[key] = ka.table(sort_by=key, row_limit=ROWS, max_name_column_width=60)
    text = "\n\n".join(f"## {who}: top {ROWS} by {k}\n\n{t}" for k, t in out.items())
    ctx.path(f"trace_{who}.txt").write_text(text + "\n")
    prof.export_chrome_trace(str(ctx.path(f"trace_{who}.json")))
    return out


def _top(table: str, n: int) -> list[str]:
    """The header and first ``n`` rows of a ``key_averages().table``."""
    rows = table.splitlines()
    body = [r for r in rows[3:] if r.strip() and not r.startswith("-")]
    return rows[:3] + body[:n]


def step_trace(ctx: Ctx) -> list[str]:
    lines: list[str] = []
    spec = llama_spec(ctx)
    tables = {}
    for who, fn in (("plain", _plain_step), ("dapple", _dapple_step)):
        t0 = time.perf_counter()
        reset_peak(ctx.device)
        tables[who] = _tables(ctx, who, fn(ctx, spec))
        print(f"{who}: profiled in {time.perf_counter() - t0:.0f} s", flush=True)
    _say(lines, f"`torch.profiler` of step {STEPS - 1} of {STEPS} (1 stage, global batch "
                f"{GLOBAL_BATCH}, bf16, AdamW) on {ctx.device}; full tables (top {ROWS}) in "
                "`trace_plain.txt` and `trace_dapple.txt`, Chrome traces in "
                "`trace_*.json`.")  # fmt: skip
    for key in tables["plain"]:
        for who in ("plain", "dapple"):
            _say(lines)
            _say(lines, f"#### {who}: top 10 by {key}")
            _say(lines)
            _say(lines, "```")
            for row in _top(tables[who][key], 10):
                _say(lines, row)
            _say(lines, "```")
    return lines


if __name__ == "__main__":  # a quick look: python benchmarks/gpu_trace.py DIR (CPU, tiny)
    import sys

    d = Path(sys.argv[1])
    d.mkdir(parents=True, exist_ok=True)
    print("\n".join(step_trace(Ctx(d, True, "cpu"))))

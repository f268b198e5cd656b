"""GPU check, step ``trace``: ``torch.profiler`` of one dapple step beside one plain HF step and
one step of a plain loop over dapple's traced pieces, at the realistic size (Llama-3-8B shapes,
2 blocks, seq 4096, global batch 2, AdamW, bf16); and which attention kernels each model calls.

Three sides, so a gap to the plain HF loop splits in two (issue 46): ``pieces`` - ``plain`` is
what the traced model costs (the same HF blocks as ``torch.export`` leaves them), ``dapple`` -
``pieces`` what dapple's runtime adds around the same model.

dapple's step runs in this process as a one-rank ``torchrun``-style job (RANK, WORLD_SIZE,
MASTER_ADDR/PORT set here; :func:`dapple.runtime.launch.launcher.init_distributed` then
:func:`dapple.runtime.engine.run_plan`), so the profiler sees the runtime's own host work
(interpreter, hooks, metrics) as well as the kernels. Every side runs :data:`STEPS` steps under
``torch.profiler.schedule(wait=STEPS - 2, warmup=1, active=1)``: the profiler keeps exactly the
last step. Each side waits for the device before the profiler's step mark (dapple: in
``on_step``, after its step's optimizer kernels are queued), so the kept window holds one step's
kernels, not the previous step's optimizer too. Tables (``key_averages().table``, top
:data:`ROWS` by self CPU time, and by self device time on CUDA) and Chrome traces are written
beside the report.

The attention census (:func:`attention_calls`) runs one forward of the plain HF model and of the
traced pieces under a ``TorchDispatchMode`` and lists every scaled-dot-product-attention kernel
op they reach, with its mask (or bias) argument, ``is_causal`` and the key's shape: a traced HF
model that passes its materialised causal mask cannot reach the flash kernel, and a key with as
many heads as the query has been copied per head (``repeat_kv``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from gpu_common import GLOBAL_BATCH, Ctx, llama_config, llama_spec, reset_peak, sync
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

    def on_step(_m: Any) -> None:
        sync(ctx.device)  # the step's optimizer kernels end inside its own window
        prof.step()

    try:
        with prof:
            run_plan(plan, wl, cfg, device=device, on_step=on_step)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return prof


def _hf_model(ctx: Ctx) -> Any:
    """The plain HF model of the Llama shapes on the device, in train mode."""
    import torch

    from dapple.models.hf import _transformers

    with torch.device(ctx.device):
        model = _transformers().AutoModelForCausalLM.from_config(llama_config(ctx.shapes))
    return model.train()


def _plain_loop(ctx: Ctx, spec: str, forward: Any, model: Any) -> Any:
    """:data:`STEPS` steps of a plain loop under the profiler: ``forward(model, ids, mask)``
    gives the logits; dapple's batches and loss, bf16 autocast, fused AdamW, the device waited
    for before each profiler step mark."""
    import torch

    from dapple import api
    from dapple.models.hf import causal_lm_loss

    dev = ctx.device
    wl = api.load(spec, seq=ctx.shapes["seq"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    prof = _profiler(dev)
    with prof:
        for t in range(STEPS):
            (ids, mask), targets = wl.make_batch(GLOBAL_BATCH, t)
            ids, mask, targets = ids.to(dev), mask.to(dev), targets.to(dev)
            with torch.autocast(dev, dtype=torch.bfloat16):
                logits = forward(model, ids, mask)
            causal_lm_loss(logits.float(), targets).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync(dev)
            prof.step()
    del opt
    return prof


def _plain_step(ctx: Ctx, spec: str) -> Any:
    """One plain HF step under the profiler (as :func:`gpu_realistic.plain_run`)."""
    return _plain_loop(ctx, spec, _hf_forward, _hf_model(ctx))


def _pieces_step(ctx: Ctx, spec: str) -> Any:
    """One step of the same plain loop over dapple's traced pieces (``Workload.build_model``):
    the model dapple runs, without dapple's runtime."""
    return _plain_loop(ctx, spec, _pieces_forward, _pieces_model(ctx, spec))


def _hf_forward(model: Any, ids: Any, mask: Any) -> Any:
    return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _pieces_forward(model: Any, ids: Any, mask: Any) -> Any:
    return model((ids, mask))


def _pieces_model(ctx: Ctx, spec: str) -> Any:
    from dapple import api

    return api.load(spec, seq=ctx.shapes["seq"]).build_model(0).to(ctx.device).train()


def attention_calls(forward: Any, model: Any, ids: Any, mask: Any, device: str) -> list[str]:
    """Every scaled-dot-product-attention kernel op one forward of ``model`` reaches (under bf16
    autocast on CUDA), as ``op | calls | mask or bias | is_causal | query | key`` cells."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[tuple[str, ...], int] = {}

    def shape(x: Any) -> str:
        return "none" if not isinstance(x, torch.Tensor) else "x".join(map(str, x.shape))

    class Census(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = kwargs or {}
            name = str(func.overloadpacket.__name__)
            if "attention" in name and "backward" not in name:
                named = dict(zip((a.name for a in func._schema.arguments), args, strict=False))
                named.update(kwargs)
                bias = named.get("attn_mask", named.get("attn_bias"))
                key = (name, shape(bias), str(named.get("is_causal", "-")),
                       shape(named.get("query")), shape(named.get("key")))  # fmt: skip
                seen[key] = seen.get(key, 0) + 1
            return func(*args, **kwargs)

    dtype = torch.bfloat16 if device == "cuda" else None
    with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=dtype is not None), Census():
        forward(model, ids, mask)
    return [f"{k[0]} | {n} | {' | '.join(k[1:])}" for k, n in seen.items()]


def _census(ctx: Ctx, spec: str) -> list[str]:
    """The attention census of the plain HF model and of dapple's traced pieces, as table rows."""
    from dapple import api

    (ids, mask), _ = api.load(spec, seq=ctx.shapes["seq"]).make_batch(GLOBAL_BATCH, 0)
    ids, mask = ids.to(ctx.device), mask.to(ctx.device)
    rows = []
    for who, forward, build in (("plain HF", _hf_forward, lambda: _hf_model(ctx)),
                                ("traced pieces", _pieces_forward,
                                 lambda: _pieces_model(ctx, spec))):  # fmt: skip
        model = build()
        calls = attention_calls(forward, model, ids, mask, ctx.device)
        rows += [f"| {who} | {c} |" for c in calls] or [f"| {who} | none | 0 | | | | |"]
        del model
    return rows


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


SIDES = (("plain", _plain_step), ("pieces", _pieces_step), ("dapple", _dapple_step))
"""The profiled sides: plain HF, a plain loop over dapple's traced pieces, dapple's runtime."""


def step_trace(ctx: Ctx) -> list[str]:
    lines: list[str] = []
    spec = llama_spec(ctx)
    _say(lines, "Attention kernel ops of one forward (bf16 autocast on CUDA): a mask or bias "
                "argument keeps SDPA off its flash kernel; a key with the query's head count "
                "was copied per head (`repeat_kv`).")  # fmt: skip
    _say(lines)
    _say(lines, "| model | op | calls | mask or bias | is_causal | query | key |")
    _say(lines, "|---|---|---|---|---|---|---|")
    for row in _census(ctx, spec):
        _say(lines, row)
    _say(lines)
    tables = {}
    for who, fn in SIDES:
        t0 = time.perf_counter()
        reset_peak(ctx.device)
        tables[who] = _tables(ctx, who, fn(ctx, spec))
        print(f"{who}: profiled in {time.perf_counter() - t0:.0f} s", flush=True)
    _say(lines, f"`torch.profiler` of step {STEPS - 1} of {STEPS} (1 stage, global batch "
                f"{GLOBAL_BATCH}, bf16, AdamW) on {ctx.device}: plain HF, a plain loop over "
                "dapple's traced pieces, dapple's runtime; full tables (top "
                f"{ROWS}) in `trace_plain.txt`, `trace_pieces.txt` and `trace_dapple.txt`, "
                "Chrome traces in `trace_*.json`.")  # fmt: skip
    for key in tables["plain"]:
        for who, _ in SIDES:
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

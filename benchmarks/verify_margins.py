"""How far ``dapple verify``'s verdicts sit from its tolerances: correct runs (SGD, Adam, AdamW,
ZeRO-1, ZB-H1, bf16) and runs with one injected defect each, step by step against one process.

For every run: the largest gradient difference as a fraction of its layer's scale (tolerance
``GRAD_RTOL``, bf16: 1.6e-2), the largest weight difference after an update from the same
gradients (``ATOL`` + ``RTOL`` x |w|), the first check out of tolerance, and the verdict. The
defects come from ``tests/verify_defects.py`` (the tests that assert them live in
``tests/test_verify_method.py``).

    python benchmarks/verify_margins.py [-o benchmarks/verify_margins.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # workers inherit sys.path

from _bench_common import header, write_report  # noqa: E402

ADAMW = dict(optimizer="adamw", lr=0.003, lr_schedule="cosine", warmup_steps=3, clip_grad_norm=1.0)


def _cases() -> list[tuple[str, str, str, dict[str, object], str, int]]:
    """(label, model spec, plan shape, options, defect, defect rank)."""
    tr = "dapple.models.zoo:transformer"
    return [
        ("transformer 3:1 AdamW (key bias: true gradient 0)", tr, "3:1", ADAMW, "", -1),
        ("transformer 3:1 SGD", tr, "3:1", dict(optimizer="sgd", lr=0.05), "", -1),
        ("transformer 3:1 AdamW bf16", tr, "3:1", {**ADAMW, "precision": "bf16"}, "", -1),
        ("GPT-2 1:3 Adam ZeRO-1", "gpt2", "1:3", dict(optimizer="adam", lr=0.003, zero_stage=1), "", -1),
        ("MLP 2:2 ZB-H1 AdamW", "runtime_workloads:mlp", "2:2 zbh1", ADAMW, "", -1),
        ("MLP 2:2, micro-batch 0 dropped on rank 2", "runtime_workloads:mlp", "2:2", ADAMW, "drop_microbatch", 2),
        ("MLP 2:2, rank 1 keeps its local gradients", "runtime_workloads:mlp", "2:2", ADAMW, "skip_allreduce", 1),
        ("MLP 3:1, rows swapped at the split-concat", "runtime_workloads:mlp", "3:1", ADAMW, "swap_rows", 3),
        ("tied MLP 2:2, tied gradient not summed", "runtime_workloads:tied_mlp", "2:2", ADAMW, "tied_unsummed", -1),
        ("MLP 2:2 ZeRO-1, rank 1's shard stale", "runtime_workloads:mlp", "2:2", {**ADAMW, "zero_stage": 1}, "stale_shard", 1),
    ]  # fmt: skip


def _plan(shape: str, n: int):  # type: ignore[no-untyped-def]
    import dataclasses

    from dapple.core.plan import straight_plan

    reps, _, schedule = shape.partition(" ")
    r = [int(x) for x in reps.split(":")]
    cuts = [0, n - 2] if r == [3, 1] else [0, 1] if r == [1, 3] else [0, n // 2]
    plan = straight_plan(n, cuts, global_batch_size=12, num_micro_batches=2, replicas=r)
    return dataclasses.replace(plan, schedule=schedule) if schedule else plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-o", "--out", default=None)
    args = ap.parse_args()
    import verify_defects
    from dapple import api
    from dapple.runtime.verify import WORKER_SETUP_ENV

    lines = header("verify: margins of correct runs and injected defects",
                   "python benchmarks/verify_margins.py" + (f" -o {args.out}" if args.out else ""))  # fmt: skip
    lines += [
        "3 steps each, global batch 12, 2 micro-batches, 4 gloo processes; zoo transformer "
        "`seq=32 vocab=256`, GPT-2 from its config (2 blocks x 32, vocabulary 64). Tolerances: "
        "gradients 1e-4 of their layer's scale (bf16 1.6e-2), weights after an update from the "
        "same gradients 1e-5 + 1.3e-6 |w|.",
        "",
        "| run | gradient diff / scale | weight diff after update | first out of tolerance | verdict | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for label, spec, shape, opts, defect, rank in _cases():
        if spec == "gpt2":
            wl = api.load("dapple.models.hf:gpt2", layers=2, hidden=32, heads=2, vocab=64, seq=16)
        elif spec.endswith("transformer"):
            wl = api.load("transformer", seq=32, vocab=256)
        else:
            wl = api.load(spec)
        os.environ.pop(WORKER_SETUP_ENV, None)
        if defect:
            os.environ[WORKER_SETUP_ENV] = f"verify_defects:{defect}"
            os.environ[verify_defects.DEFECT_RANK_ENV] = str(rank)
        t0 = time.perf_counter()
        rep = api.verify(_plan(shape, wl.num_layers), wl, 3, device="cpu", **opts)
        dt = time.perf_counter() - t0
        first = "; ".join(rep.failures) or "-"
        lines.append(
            f"| {label} | {rep.max_grad_diff:.2g} | {rep.max_abs_diff:.2g} | {first} | "
            f"{'OK' if rep.ok else 'MISMATCH'} | {dt:.0f} |"
        )
        print(lines[-1], flush=True)
    os.environ.pop(WORKER_SETUP_ENV, None)
    write_report(lines, args.out)


if __name__ == "__main__":
    main()

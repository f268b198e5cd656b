"""Multi-process driver of the evaluation tests (spawned once; loops over its cases inside)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import runtime_workloads as rw

B, M, STEPS, SEED, LR, K = 5, 3, 2, 1, 0.05, 3
"""Micro-batch size (uneven slices over 3 replicas), micro-batches, steps, seed, lr, eval K."""

CASES = [
    # (name, plan, workload, recompute, eval data[, eval batch size G_e])
    ("3:1-mlp", "3:1", "mlp", False, "default"),
    ("straight2-mlp", "straight2", "mlp", False, "default"),
    ("3:1-tuple-recompute", "3:1", "tuple", True, "default"),
    ("1:3-mlp-dataset", "1:3", "mlp", False, "dataset"),
    ("straight2-mlp-callable", "straight2", "mlp", False, "callable"),
    ("3:1-dropout", "3:1", "dropout", False, "default"),
    ("3:1-mlp-eval-batch-7", "3:1", "mlp", False, "dataset", 7),  # M_e = 1, slices 3/2/2
    ("1:3-mlp-eval-batch-12", "1:3", "mlp", False, "default", 12),  # M_e = 3, b_e = 4
]
"""The dropout case trains with per-rank RNG (no one-process reference); it checks that
evaluation turns dropout off, restores train mode and leaves the RNG streams untouched."""


def dropout_mlp():
    """:func:`runtime_workloads.mlp` with dropout (p=0.3) after every block."""
    from torch import nn

    from dapple.models.workload import Workload

    base = rw.mlp()

    def layer(i: int):
        return lambda: nn.Sequential(base.layer_factories[i](), nn.Dropout(0.3))

    return Workload(
        name="test-dropout-mlp",
        layer_factories=[layer(i) for i in range(base.num_layers)],
        make_batch=base.make_batch,
        loss_fn=base.loss_fn,
    )


WORKLOADS = {**rw.WORKLOADS, "dropout": dropout_mlp}


def eval_samples(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (input, target) samples of the mlp workload (the map-style eval dataset)."""
    x, y = rw.mlp().make_batch(n, 4242)
    return [(x[i], y[i]) for i in range(n)]


def callable_batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eval global batch ``k`` as a callable source."""
    return rw.mlp().make_batch(B * M, 777 + k)


def eval_data(kind: str):
    if kind == "dataset":
        return eval_samples(K * B * M)
    if kind == "callable":
        return callable_batch
    return None


def _params(module) -> dict[str, list]:
    return {n: p.detach().flatten().tolist() for n, p in module.named_parameters()}


def eval_worker(rank: int, world: int, out_dir: str) -> None:
    """Per case: a run that evaluates after every step and one that never does; this rank
    writes its stage's parameters of both and rank 0 the metrics."""
    from dapple.runtime import TrainConfig, init_distributed, run_plan, shutdown_distributed

    device = init_distributed(TrainConfig(timeout_s=60), world)
    out: dict[str, dict] = {}
    for name, plan_name, wl_name, recompute, data, *eval_bs in CASES:
        plan = rw.make_plan(plan_name, "dapple", "A", recompute, B, M)
        wl = WORKLOADS[wl_name]()
        res: dict = {}
        for every in (1, 0):
            cfg = TrainConfig(steps=STEPS, seed=SEED, lr=LR, timeout_s=60, eval_every=every,
                              eval_batches=K, eval_batch_size=eval_bs[0] if eval_bs else None)  # fmt: skip
            run = run_plan(
                plan, wl, cfg, device=device, exact_world=False, eval_data=eval_data(data)
            )
            res[f"params{every}"] = _params(run.module) if run.module is not None else {}
            if rank == 0:
                res[f"metrics{every}"] = [m.to_dict() for m in run.metrics]
            if every and run.module is not None:  # back in train mode after evaluating
                res["training_mode"] = run.module.training
        out[name] = res
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    shutdown_distributed()

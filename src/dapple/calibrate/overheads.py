"""Measure the runtime's host CPU overheads on this machine (for :mod:`dapple.calibrate`).

The cost model's host terms (:mod:`dapple.cost.host`): ``action_overhead_ms``,
``step_overhead_ms`` and ``comm_cpu_ms_per_mb``. All are *CPU time* (``time.process_time``:
every thread of the process, gloo's included), so they hold however many workers share the
cores; the simulator shares them like compute.

* ``comm_cpu_ms_per_mb``: CPU time of both ends of a ping-pong between ranks 0 and 1 per
  message, at the calibration's message sizes; the slope of the affine fit over bytes, halved
  (each message costs its sender and its receiver), per MiB.
* ``action_overhead_ms`` and ``step_overhead_ms``: the real runtime
  (:func:`dapple.runtime.run_plan`) trains a tiny MLP whose layers cost next to nothing, so
  its CPU per step is the runtime's own: pure data parallelism over all ranks (2 actions per
  rank: one F, one B) and a straight pipeline over all ranks with M micro-batches (each rank
  runs F, B and its sends and receives: 4M or 6M actions). CPU per step is taken as the
  difference between a long and a short run (after a warm-up run), so setup costs cancel. With ``a`` the per-action
  and ``o`` the per-step overhead, rank means give ``dp = o + 2a`` and ``pipe = o + n a``,
  solved for (a, o). One process alone measures only the DP run: ``a`` = 0.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dapple.core.layer_profile import fit_affine
from dapple.core.plan import Plan, straight_plan
from dapple.cost.host import MIB

__all__ = ["comm_cpu_fit", "runtime_overheads"]

_PIPE_M = 8
"""Micro-batches of the straight tiny pipeline."""


def comm_cpu_fit(sizes: Sequence[int], cpu_ms_both_ends: Sequence[float]) -> float:
    """``comm_cpu_ms_per_mb`` from the CPU time of both ends per message at each size (>= 0)."""
    if len(sizes) < 2:
        return 0.0
    slope = fit_affine(list(sizes), list(cpu_ms_both_ends)).per_sample_ms
    return max(0.0, slope / 2 * MIB)


def _cpu_per_step(plan: Plan, steps: tuple[int, int]) -> float:
    """This rank's process CPU ms per step of ``plan``: a long run minus a short run."""
    from dapple.models.zoo import mlp
    from dapple.runtime import TrainConfig, run_plan

    wl = mlp(layers=max(1, plan.num_layers - 1), in_features=4, hidden=4, num_classes=2)
    used = []
    for n in (1, *steps):  # the first run warms up (first-call costs would skew the short run)
        dist.barrier()
        c0 = time.process_time()
        cfg = TrainConfig(steps=n, seed=0, optimizer="sgd", device="cpu")
        run_plan(plan, wl, cfg, device=torch.device("cpu"))
        used.append(time.process_time() - c0)
    return max(0.0, (used[2] - used[1]) * 1e3 / (steps[1] - steps[0]))


def runtime_overheads(
    rank: int, world: int, steps: tuple[int, int] = (5, 45)
) -> tuple[float, float]:
    """``(action_overhead_ms, step_overhead_ms)`` of the runtime on this machine (module
    docstring). Call on every rank of an initialised gloo group; every rank gets the result."""
    n_layers = max(2, world)
    dp = straight_plan(n_layers, [0], global_batch_size=2 * world, num_micro_batches=1,
                       replicas=[world], model_name="tiny-mlp")  # fmt: skip
    mine = [_cpu_per_step(dp, steps), 0.0, 0.0]
    if world > 1:
        pipe = straight_plan(n_layers, list(range(world)), global_batch_size=_PIPE_M,
                             num_micro_batches=_PIPE_M, replicas=[1] * world,
                             model_name="tiny-mlp")  # fmt: skip
        edge = rank in (0, world - 1)
        mine[1] = _cpu_per_step(pipe, steps)
        mine[2] = float(_PIPE_M * (4 if edge else 6))  # F, B + their sends and receives
    rows = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(rows, torch.tensor(mine, dtype=torch.float64))
    dp_ms = statistics.mean(float(r[0]) for r in rows)
    if world == 1:
        return 0.0, dp_ms
    pipe_ms = statistics.mean(float(r[1]) for r in rows)
    n_actions = statistics.mean(float(r[2]) for r in rows)
    a = max(0.0, (pipe_ms - dp_ms) / (n_actions - 2))
    return a, max(0.0, dp_ms - 2 * a)

"""Gradient AllReduce overlapped with the last backward, and run teardown.

One 4-process gloo group runs replicated plans with one bucket per parameter (so the overlap
path is exercised with many buckets) and compares the trained parameters and losses with the
single-process reference; it also records when each bucket's AllReduce started (during the
last backward vs. at the ``AR`` action), how many small collectives each run makes (one per step)
and, after many runs, how many process groups are left.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import runtime_workloads as rw
from dapple.models.workload import Workload
from dapple.runtime import spawn
from dapple.runtime.sync import _make_buckets

B, M, STEPS, SEED, LR = 5, 3, 3, 1, 0.05


class _WithUnused(nn.Module):
    """Linear + Tanh with a parameter no forward uses (its gradient stays None)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def unused_mlp() -> Workload:
    """``rw.mlp`` whose layer 1 also holds an unused parameter (a bucket that never fires)."""
    base = rw.mlp(4)
    facs = list(base.layer_factories)
    inner = facs[1]
    facs[1] = lambda: _WithUnused(inner())
    return Workload(
        name="test-unused",
        layer_factories=facs,
        make_batch=base.make_batch,
        loss_fn=base.loss_fn,
    )


def _frozen_first() -> nn.Module:
    block = rw.mlp(4).layer_factories[0]()
    block[0].weight.requires_grad_(False)
    return block


def frozen_mlp() -> Workload:
    """``rw.mlp`` whose first weight is frozen (no hook, no gradient, never updated)."""
    base = rw.mlp(4)
    return Workload(
        name="test-frozen",
        layer_factories=[_frozen_first, *base.layer_factories[1:]],
        make_batch=base.make_batch,
        loss_fn=base.loss_fn,
    )


WORKLOADS = {**rw.WORKLOADS, "unused": unused_mlp, "frozen": frozen_mlp}

# (id, plan name, workload, optimizer, micro-batch size)
CASES: list[tuple[str, str, str, str, int]] = [
    ("dp4-mlp-sgd", "dp4", "mlp", "sgd", B),
    ("dp4-tuple-adam", "dp4", "tuple", "adam", B),
    ("dp4-b3-empty-replica-adam", "dp4", "mlp", "adam", 3),  # replica 3 has no samples
    ("3:1-tuple-sgd", "3:1", "tuple", "sgd", B),
    ("1:3-tied-local-adam", "1:3", "tied", "adam", B),  # both tied copies in the replicated stage
    ("2:1:1-tied-cross-sgd", "2:1:1", "tied", "sgd", B),  # tied copies in two stages
    ("dp4-unused-sgd", "dp4", "unused", "sgd", B),
    ("3:1-frozen-adam", "3:1", "frozen", "adam", B),
    ("straight2-mlp-sgd", "straight2", "mlp", "sgd", B),  # ranks 2 and 3 are not in the plan
]
# every collective of torch.distributed other than the gradient AllReduce
SMALL = ("all_gather", "all_gather_into_tensor", "all_gather_object", "gather", "scatter")
SMALL += ("broadcast", "broadcast_object_list", "reduce", "barrier", "all_to_all")


def _counting(f: Any, name: str, calls: list[str]) -> Any:
    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(name)
        return f(*args, **kw)

    return counted


def overlap_worker(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import dapple.runtime.sync as sync_mod
    from dapple.runtime import TrainConfig, init_distributed, run_plan, shutdown_distributed

    device = init_distributed(TrainConfig(timeout_s=60), world)
    groups_before = len(c10d._world.pg_map)
    sync_mod.BUCKET_BYTES = 1  # one bucket per parameter
    launches: list[tuple[bool, list[int]]] = []
    original = sync_mod.GradientSync._launch

    def recording(self: Any, bk: Any) -> None:
        launches.append((self._armed, [id(p) for p in bk.params]))
        original(self, bk)

    sync_mod.GradientSync._launch = recording  # type: ignore[method-assign]
    small: list[str] = []  # calls of the SMALL collectives (run_plan calls them as dist.<name>)
    for name in SMALL:
        setattr(dist, name, _counting(getattr(dist, name), name, small))
    results: dict[str, Any] = {}
    for cid, plan_name, wl_name, optimizer, b in CASES:
        launches.clear()
        small.clear()
        plan = rw.make_plan(plan_name, "dapple", "A", False, b, M)
        wl = WORKLOADS[wl_name]()
        cfg = TrainConfig(steps=STEPS, seed=SEED, optimizer=optimizer, lr=LR, timeout_s=60)
        run = run_plan(plan, wl, cfg, device=device, exact_world=False)
        ref_model, ref_losses = rw.reference_run(wl, optimizer, LR, SEED, b * M, STEPS)
        res: dict[str, Any] = {"ok": True, "checked": 0, "launches": len(launches)}
        res["small"] = list(small)
        res["armed"] = sum(armed for armed, _ in launches)
        try:
            if run.module is not None:
                lo, hi = plan.stages[run.stage].layers
                ref_stage = dict(nn.Sequential(*list(ref_model)[lo:hi]).named_parameters())
                for name, p in run.module.named_parameters():
                    torch.testing.assert_close(p.detach(), ref_stage[name].detach(), msg=name)
                    res["checked"] += 1
                # buckets start in reverse parameter order (the order backward finishes them)
                ids = [i for _, ps in launches[: len(launches) // STEPS] for i in ps]
                mine = [id(p) for p in run.module.parameters()]
                res["reverse_order"] = ids == [i for i in mine[::-1] if i in set(ids)]
            if rank == 0:
                got = [mm.loss for mm in run.metrics]
                torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses))
        except AssertionError as e:
            res = {"ok": False, "error": str(e)[:3000]}
        results[cid] = res
    for plan_name in ("dp4", "straight2"):  # the same runs for one step: setup and teardown
        small.clear()
        plan = rw.make_plan(plan_name, "dapple", "A", False, B, M)
        cfg = TrainConfig(steps=1, seed=SEED, lr=LR, timeout_s=60)
        run_plan(plan, rw.mlp(), cfg, device=device, exact_world=False)
        results[f"small-1-step-{plan_name}"] = list(small)
    results["groups"] = [groups_before, len(c10d._world.pg_map)]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown_distributed()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("overlap")
    spawn(overlap_worker, 4, str(out), timeout_s=60)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_overlapped_allreduce_matches_reference(spawned: list[dict[str, Any]], case) -> None:
    cid, plan_name, _wl, _opt, b = case
    plan = rw.make_plan(plan_name, "dapple", "A", False, b, M)
    for rank, rep in enumerate(spawned):
        res = rep[cid]
        assert res["ok"], f"rank {rank}: {res.get('error')}"
        if rank not in plan.devices:
            continue
        s, j = plan.stage_of_device(rank)
        assert res["checked"] > 0
        if plan.stages[s].replicas == 1:
            assert res["launches"] == 0  # nothing to reduce
            continue
        assert res["launches"] > 0 and res["launches"] % STEPS == 0
        assert res["reverse_order"]
        empty = b < plan.stages[s].replicas and j >= b  # this replica's slices are empty
        if empty:
            assert res["armed"] == 0  # no backward: every bucket starts at the AR action
        else:
            # most buckets start during the last backward (only those behind a parameter
            # without a gradient wait for the AR action)
            assert res["armed"] >= res["launches"] // 2, res


@pytest.mark.slow
@pytest.mark.parametrize("plan_name", ["dp4", "straight2"])
def test_one_small_collective_per_step_on_every_rank(
    spawned: list[dict[str, Any]], plan_name: str
) -> None:
    # the non-finite guard and the step metrics share one all_gather per step, which ranks
    # beyond the plan (straight2: ranks 2 and 3) join too; a run of STEPS steps makes
    # STEPS - 1 more small collectives than the same run of one step
    for rank, rep in enumerate(spawned):
        one = rep[f"small-1-step-{plan_name}"]
        many = rep[f"{plan_name}-mlp-sgd"]["small"]
        extra = list(many)
        for name in one:
            extra.remove(name)
        assert extra == ["all_gather"] * (STEPS - 1), f"rank {rank}: {one} vs {many}"


@pytest.mark.slow
def test_runs_leave_no_process_groups_behind(spawned: list[dict[str, Any]]) -> None:
    # the runs created stage and tied groups; all are destroyed at the end of each run
    for rank, rep in enumerate(spawned):
        before, after = rep["groups"]
        assert after == before, f"rank {rank}: {before} groups before the runs, {after} after"


def test_buckets_group_consecutive_parameters_by_size_and_dtype() -> None:
    ps = [
        nn.Parameter(torch.zeros(4)),  # 16 B
        nn.Parameter(torch.zeros(4)),  # 16 B
        nn.Parameter(torch.zeros(8)),  # 32 B
        nn.Parameter(torch.zeros(2, dtype=torch.float64)),  # dtype change
        nn.Parameter(torch.zeros(100)),  # larger than the cap: a bucket of its own
    ]
    bks = _make_buckets(ps, cap_bytes=32)
    assert [[id(p) for p in bk.params] for bk in bks] == [
        [id(ps[0]), id(ps[1])],
        [id(ps[2])],
        [id(ps[3])],
        [id(ps[4])],
    ]
    assert [bk.offsets for bk in bks] == [[0, 4], [0], [0], [0]]
    assert [(bk.flat.numel(), bk.flat.dtype) for bk in bks] == [
        (8, torch.float32),
        (8, torch.float32),
        (2, torch.float64),
        (100, torch.float32),
    ]

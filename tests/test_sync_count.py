"""At most one host synchronisation per training step, counted in the workers (issue 46).

On CUDA every read of a device tensor on the host (``item``, ``float``, ``int``, ``bool``,
``tolist``, ``cpu``, ``numpy``) and every ``torch.cuda.synchronize`` or event/stream wait
drains the launch queue. On CPU the same calls are cheap, but they are the same calls: each
worker of a gloo group patches them to count every call (and where it came from), then runs
a plan for a few steps and for more steps with metrics written to a file, the non-finite guard
on (its default, ``stop``), gradient clipping and AdamW. The runs differ only in their step
count, so set-up and teardown cancel out: the extra calls of the longer run are what its
extra steps make, and each step may make at most one. Plans (:data:`PLANS`), on a token
workload (its metrics count target tokens) over two ranks: one stage on one rank (the other
rank beyond the plan, joining the step's collective); one stage on two replicas, plain and
under ZeRO-1, -2 and -3; one stage split over a tensor-parallel group of two; two-stage
pipelines under DAPPLE's early backward (M = 3), GPipe and ZB-H1; four chunks interleaved
over the two ranks (M = 4). Over four ranks (:data:`PLANS4`, M = 4): a straight 4-stage
pipeline, and two stages of two replicas each. One stage in a world of one: its own test.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from dapple.core.plan import Plan, StagePlan

FEW, MANY = 2, 5
SEED, B, M = 3, 2, 3

SYNC_METHODS = ("item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy")
"""The ``torch.Tensor`` methods that read a tensor on the host (a device sync on CUDA)."""

Stages = tuple[tuple[tuple[int, int], tuple[int, ...], dict[str, Any]], ...]
PLANS: dict[str, tuple[Stages, str, int]] = {
    # name: ((layers, devices, StagePlan options) per stage, schedule, M)
    "1-stage": ((((0, 4), (0,), {}),), "dapple", M),  # rank 1 beyond the plan
    "1-stage-dp2": ((((0, 4), (0, 1), {}),), "dapple", M),
    "zero1-dp2": ((((0, 4), (0, 1), {"zero_stage": 1}),), "dapple", M),
    "zero2-dp2": ((((0, 4), (0, 1), {"zero_stage": 2}),), "dapple", M),
    "zero3-dp2": ((((0, 4), (0, 1), {"zero_stage": 3}),), "dapple", M),
    "tp2": ((((0, 4), (0, 1), {"tensor_width": 2}),), "dapple", M),
    "2-stage": ((((0, 2), (0,), {}), ((2, 4), (1,), {})), "dapple", M),
    "2-stage-gpipe": ((((0, 2), (0,), {}), ((2, 4), (1,), {})), "gpipe", M),
    "2-stage-zbh1": ((((0, 2), (0,), {}), ((2, 4), (1,), {})), "zbh1", M),
    "interleaved": (tuple(((k, k + 1), (k % 2,), {}) for k in range(4)), "interleaved", 4),
}
PLANS4: dict[str, tuple[Stages, str, int]] = {
    # over four ranks: a straight 4-stage pipeline, and two stages of two replicas each
    "4-stage": (tuple(((k, k + 1), (k,), {}) for k in range(4)), "dapple", 4),
    "2-stage-dp2": ((((0, 2), (0, 1), {}), ((2, 4), (2, 3), {})), "dapple", 4),
}


def _plan(name: str) -> Plan:
    stages, schedule, m = {**PLANS, **PLANS4}[name]
    return Plan(
        planner="test",
        global_batch_size=B * m,
        micro_batch_size=B,
        num_micro_batches=m,
        schedule=schedule,
        virtual_stages=2 if schedule == "interleaved" else 1,
        policy="A",
        stages=tuple(StagePlan(layers=lay, devices=dev, **opt) for lay, dev, opt in stages),
    )


def _site() -> str:
    """The first caller outside torch's own Python code: who read."""
    f = sys._getframe(2)  # 0: here, 1: the counting wrapper
    while f is not None and "/torch/" in f.f_code.co_filename:
        f = f.f_back  # type: ignore[assignment]
    if f is None:
        return "?"
    return f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"


def _counting(f: Any, name: str, calls: list[str]) -> Any:
    def counted(*args: Any, **kw: Any) -> Any:
        calls.append(f"{name} at {_site()}")
        return f(*args, **kw)

    return counted


def patch_syncs(calls: list[str]) -> None:
    """Count every host read of a tensor and every CUDA synchronisation in this process."""
    for name in SYNC_METHODS:
        setattr(torch.Tensor, name, _counting(getattr(torch.Tensor, name), name, calls))
    torch.cuda.synchronize = _counting(torch.cuda.synchronize, "cuda.synchronize", calls)
    for cls in (torch.cuda.Event, torch.cuda.Stream):
        wait = getattr(cls, "synchronize", None)
        if wait is not None:
            cls.synchronize = _counting(wait, f"{cls.__name__}.synchronize", calls)  # type: ignore[method-assign]


def sync_worker(rank: int, world: int, out_dir: str, names: tuple[str, ...] = tuple(PLANS)) -> None:
    from dapple.models.zoo.transformer import transformer_tp
    from dapple.runtime import TrainConfig, init_distributed, run_plan, shutdown_distributed

    device = init_distributed(TrainConfig(timeout_s=60), world)
    calls: list[str] = []
    patch_syncs(calls)
    wl = transformer_tp(layers=2, hidden=16, heads=2, seq=8, vocab=32)  # with its TP plan
    results: dict[str, dict[int, list[str]]] = {}
    for name in names:
        results[name] = {}
        for steps in (FEW, MANY):
            cfg = TrainConfig(
                steps=steps, seed=SEED, optimizer="adamw", lr=1e-3, clip_grad_norm=1.0,
                metrics_path=str(Path(out_dir, f"{name}-{steps}-{rank}.jsonl")), timeout_s=60,
            )  # fmt: skip
            calls.clear()
            run = run_plan(_plan(name), wl, cfg, device=device, exact_world=False)
            results[name][steps] = list(calls)
            if rank == 0:  # the metrics are all there
                assert [m.step for m in run.metrics] == list(range(steps))
                assert all(m.grad_norm is not None and m.grad_norm > 0 for m in run.metrics)
                m = _plan(name).num_micro_batches
                assert all(x.tokens == B * m * 8 for x in run.metrics)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown_distributed()


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from dapple.runtime import spawn

    out = tmp_path_factory.mktemp("syncs")
    spawn(sync_worker, 2, str(out), timeout_s=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS))
def test_at_most_one_host_sync_per_step(counted: list[dict[str, Any]], plan: str) -> None:
    for rank, res in enumerate(counted):
        few, many = res[plan][str(FEW)], res[plan][str(MANY)]
        extra = Counter(many) - Counter(few)
        per_step = (len(many) - len(few)) / (MANY - FEW)
        where = ", ".join(f"{n // (MANY - FEW)} x {site}" for site, n in extra.most_common())
        assert per_step <= 1, f"{plan}, rank {rank}: {per_step:g} host syncs per step: {where}"


@pytest.fixture(scope="module")
def counted4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from dapple.runtime import spawn

    out = tmp_path_factory.mktemp("syncs4")
    spawn(sync_worker, 4, str(out), tuple(PLANS4), timeout_s=900)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("plan", list(PLANS4))
def test_at_most_one_host_sync_per_step_on_four_ranks(
    counted4: list[dict[str, Any]], plan: str
) -> None:
    """Every rank of a 4-stage pipeline and of a 2 x 2 plan (stages x replicas) reads at most
    once per step, with metrics, the guard and clipping on."""
    assert len(counted4) == 4
    for rank, res in enumerate(counted4):
        few, many = res[plan][str(FEW)], res[plan][str(MANY)]
        extra = Counter(many) - Counter(few)
        per_step = (len(many) - len(few)) / (MANY - FEW)
        where = ", ".join(f"{n // (MANY - FEW)} x {site}" for site, n in extra.most_common())
        assert per_step <= 1, f"{plan}, rank {rank}: {per_step:g} host syncs per step: {where}"


def test_the_counter_counts_every_kind_of_read() -> None:
    calls: list[str] = []
    saved = {n: getattr(torch.Tensor, n) for n in SYNC_METHODS}
    cuda_sync = torch.cuda.synchronize
    try:
        patch_syncs(calls)
        t = torch.ones(2)
        t.sum().item(), float(t[0]), int(t[0]), bool(t[0]), t.tolist(), t.cpu(), t.numpy()
        assert [c.split()[0] for c in calls] == list(SYNC_METHODS)
        assert all("test_sync_count.py" in c for c in calls), calls
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        torch.cuda.synchronize = cuda_sync


# -- the pieces of the one read, on one process ----------------------------------------------
def test_device_row_places_numbers_and_tensors_in_order() -> None:
    from dapple.runtime.metrics import device_row

    row = device_row(
        [1, torch.tensor(2.5), 3.0, torch.tensor([4], dtype=torch.int64)], torch.device("cpu")
    )
    assert row.dtype == torch.float64 and row.tolist() == [1.0, 2.5, 3.0, 4.0]
    assert device_row([7, 8], torch.device("cpu")).tolist() == [7.0, 8.0]


def test_host_row_reads_numbers_and_tensors_in_order() -> None:
    from dapple.runtime.metrics import host_row

    calls: list[str] = []
    saved = {n: getattr(torch.Tensor, n) for n in SYNC_METHODS}
    cuda_sync = torch.cuda.synchronize
    try:
        patch_syncs(calls)
        row = host_row([1, torch.tensor(2.5), 3.0, torch.tensor([4], dtype=torch.int64)])
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        torch.cuda.synchronize = cuda_sync
    assert row == [1.0, 2.5, 3.0, 4.0] and all(type(x) is float for x in row)
    assert len(calls) == 1, calls  # both tensors in one read
    assert host_row([7, 8]) == [7.0, 8.0]


def _one_process_run(steps: int, clip: float, calls: list[str]) -> tuple[Any, list[Any]]:
    """A 1-stage plan (M = 3) in a gloo group of one with metrics, the guard and clipping, its
    host reads counted; and its stage's parameters after the run."""
    import socket

    import torch.distributed as dist

    import runtime_workloads as rw
    from dapple.runtime import TrainConfig, run_plan

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    saved = {n: getattr(torch.Tensor, n) for n in SYNC_METHODS}
    cuda_sync = torch.cuda.synchronize
    try:
        patch_syncs(calls)
        plan = Plan(planner="test", global_batch_size=B * M, micro_batch_size=B,
                    num_micro_batches=M, schedule="dapple", policy="A",
                    stages=(StagePlan(layers=(0, 4), devices=(0,)),))  # fmt: skip
        cfg = TrainConfig(steps=steps, seed=SEED, optimizer="sgd", lr=0.1, clip_grad_norm=clip,
                          timeout_s=60)  # fmt: skip
        run = run_plan(plan, rw.mlp(4), cfg, device=torch.device("cpu"))
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        torch.cuda.synchronize = cuda_sync
        dist.destroy_process_group()
    assert run.module is not None
    return run, [p.detach().clone() for p in run.module.parameters()]


def test_a_world_of_one_reads_once_per_step_and_clips_as_torch_does() -> None:
    """One process (no gather: the step's row is read on the host in one copy): at most one
    host read per step, and the clipped SGD steps of a plain loop with ``clip_grad_norm_``."""
    import runtime_workloads as rw
    from dapple.runtime import TrainConfig
    from dapple.runtime.optim import make_optimizer

    few: list[str] = []
    many: list[str] = []
    _one_process_run(FEW, 0.05, few)
    run, weights = _one_process_run(MANY, 0.05, many)
    per_step = (len(many) - len(few)) / (MANY - FEW)
    assert per_step <= 1, f"{per_step:g} host reads per step: {Counter(many) - Counter(few)}"

    wl = rw.mlp(4)
    model = wl.build_model(SEED)
    params = list(model.parameters())
    opt = make_optimizer(TrainConfig(optimizer="sgd", lr=0.1), params)
    norms = []
    for step in range(MANY):
        x, y = wl.make_batch(B * M, SEED + step)
        opt.zero_grad(set_to_none=True)
        for m in range(M):
            rows = slice(m * B, (m + 1) * B)
            (wl.loss_fn(model(x[rows]), y[rows]) * (1 / M)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.05)))
        opt.step()
    assert min(norms) > 0.05  # the clipping binds on every step
    assert [m.grad_norm for m in run.metrics] == pytest.approx(norms, rel=1e-5)
    for got, want in zip(weights, params, strict=True):
        torch.testing.assert_close(got, want.detach())


def test_global_norm_is_the_float32_root_of_the_summed_parts() -> None:
    from dapple.runtime.metrics import ROW_SQ_NORM, global_norm, row_tokens

    parts = [0.1, 2.0 / 3.0, 0.0]
    rows = [[0.0] * ROW_SQ_NORM + [p] for p in parts]
    want = torch.tensor(parts, dtype=torch.float64).sum().sqrt().float().item()
    assert global_norm(rows) == want
    assert global_norm([[0.0] * ROW_SQ_NORM + [1e300]]) == float("inf")  # float32's range
    assert row_tokens([[0.0] * 8]) is None  # a row without the token column
    assert row_tokens([[0.0] * 8 + [12.0, 0.0], [0.0] * 8 + [5.0, 0.0]]) == 12  # rank 0's
    assert row_tokens([[0.0] * 8 + [-1.0, 0.0]]) is None  # not a token workload


def test_guard_verdict_names_the_first_bad_micro_batch() -> None:
    from torch import nn

    import runtime_workloads as rw
    from dapple.runtime import TrainConfig
    from dapple.runtime.longrun import LongRun
    from dapple.schedule.ir import Action, ActionKind

    plan = Plan(planner="test", global_batch_size=4, micro_batch_size=1, num_micro_batches=4,
                schedule="dapple", policy="A",
                stages=(StagePlan(layers=(0, 4), devices=(0,)),))  # fmt: skip
    module = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    lr = LongRun(plan, rw.mlp(), TrainConfig(), rank=0, world=1, stage=0, replica=0,
                 module=module, optimizer=None, device=torch.device("cpu"))  # fmt: skip
    nan = float("nan")

    def run(losses: list[float], grads: list[float]) -> None:
        """One step: ``losses`` are the loss so far after each micro-batch (as the last stage
        keeps them: non-finite from the first non-finite one on)."""
        lr.guard.begin_step()
        for m, (loss, g) in enumerate(zip(losses, grads, strict=True)):
            lr.guard.watch(
                Action(stage=0, kind=ActionKind.FORWARD, micro_batch=m),
                torch.tensor(loss, dtype=torch.float64),
            )
            for q in module.parameters():
                q.grad = torch.full_like(q, g)
            lr.guard.watch(Action(stage=0, kind=ActionKind.BACKWARD, micro_batch=m), 0.0)

    def step(losses: list[float], grads: list[float], sq_norm: float) -> str | None:
        run(losses, grads)
        assert lr.guard._grad_mbs == []  # a step checks no backward: the norm is the check
        sq = torch.tensor(sq_norm, dtype=torch.float64)
        return lr.guard.agree_finite(7, grad_sq_norm=sq)[0]  # no replay: a gradient is not named

    def named(losses: list[float], grads: list[float]) -> list[tuple[int, int, int, int]]:
        return lr.guard._name_micro_batch(lambda: run(losses, grads))

    grad = "step 7: non-finite gradient at stage 0 (rank 0); stopped"
    assert step([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0], 4.0) is None
    assert str(step([1.0, 2.0, 3.0, 4.0], [1.0, nan, float("inf"), 1.0], nan)).startswith(grad)
    assert str(step([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0], float("inf"))).startswith(grad)
    assert str(step([1.0, 2.0, nan, nan], [1.0, nan, 1.0, 1.0], nan)).startswith(
        "step 7: non-finite loss in micro-batch 2 at stage 0 (rank 0); stopped"  # the loss first
    )
    assert str(step([1.0, float("inf"), nan, nan], [1.0] * 4, 4.0)).startswith(
        "step 7: non-finite loss in micro-batch 1 at stage 0 (rank 0); stopped"
    )
    # the replay checks each backward: the first that left a non-finite gradient is named
    assert named([1.0, 2.0, 3.0, 4.0], [1.0, nan, float("inf"), 1.0]) == [(1, 1, 0, 0)]
    assert named([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, float("inf")]) == [(1, 3, 0, 0)]
    assert named([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0]) == []
    assert not lr.guard._naming
    assert step([1.0, 2.0, 3.0, 4.0], [1.0, 1.0, 1.0, 1.0], 4.0) is None  # flags reset

    def verdict(grads: list[float], sq_norm: float) -> str | None:
        run([1.0, 2.0, 3.0, 4.0], grads)
        sq = torch.tensor(sq_norm, dtype=torch.float64)
        got, _, _ = lr.guard.agree_finite(7, grad_sq_norm=sq, replay=lambda: run([1.0] * 4, grads))
        return got

    assert verdict([1.0] * 4, 4.0) is None
    assert str(verdict([1.0, 1.0, nan, 1.0], nan)).startswith(
        "step 7: non-finite gradient in micro-batch 2 at stage 0 (rank 0); stopped before"
    )
    # finite gradients whose norm is not: no micro-batch to name, and the message says why
    assert str(verdict([1e30] * 4, float("inf"))).startswith(
        "step 7: non-finite gradient at stage 0 (rank 0) (a replay of the step left every "
        "micro-batch's gradients finite"
    )


def test_the_naming_replay_starts_from_the_steps_random_state_and_leaves_no_trace() -> None:
    """The replay draws what the step drew (CPU random state of the step's start), and after
    it the random state and the module's buffers are as the step left them."""
    from torch import nn

    import runtime_workloads as rw
    from dapple.runtime import TrainConfig
    from dapple.runtime.longrun import LongRun

    plan = Plan(planner="test", global_batch_size=2, micro_batch_size=1, num_micro_batches=2,
                schedule="dapple", policy="A",
                stages=(StagePlan(layers=(0, 2), devices=(0,)),))  # fmt: skip
    module = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    lr = LongRun(plan, rw.mlp(), TrainConfig(), rank=0, world=1, stage=0, replica=0,
                 module=module, optimizer=None, device=torch.device("cpu"))  # fmt: skip
    lr.guard.begin_step()
    drawn = torch.rand(4)
    module.train()(torch.randn(3, 2))  # the step moves the running statistics
    stats = module[1].running_mean.clone()
    after = torch.get_rng_state()
    replayed: list[torch.Tensor] = []

    def replay() -> None:
        lr.guard.begin_step()
        replayed.append(torch.rand(4))
        module(torch.randn(3, 2) * 100)

    assert lr.guard._name_micro_batch(replay) == []
    assert torch.equal(replayed[0], drawn)
    assert torch.equal(torch.get_rng_state(), after)
    assert torch.equal(module[1].running_mean, stats)

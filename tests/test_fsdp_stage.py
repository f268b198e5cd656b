"""Sharded parameters (FSDP2) on a dapple stage (:mod:`dapple.runtime.parallel.fsdp`), alone and with TP.

Slow tier, gloo: a stage of the zoo transformer (two blocks and the head) ZeRO-3-sharded over
2 replicas trains 2 micro-batches per step with gradient accumulation - one all-gather and one
reduce-scatter per step, or one per micro-batch with ``regather`` - and AdamW steps on the
shards; then the LLaMA stage on a (replica 2 x tensor 2) mesh of 4 ranks: TP inside
(:mod:`dapple.runtime.parallel.tp`), FSDP over the replicas. Each step is checked against the whole stage
in one process as ``dapple verify`` does: the reference takes the run's weights, its full-batch
loss and gradients must match the run's, it applies the run's gradients, and the weights must
then match.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dapple.errors import ValidationError
from dapple.runtime.verify.report import ATOL, GRAD_NORM_RTOL, GRAD_RTOL, RTOL

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tensor_parallel import _counts, _gaps, _load, llama, save_llama, zoo

G, M, STEPS = 8, 2, 2
"""Global batch, micro-batches per step, optimizer steps."""


def _rows(x: Any, lo: int, hi: int) -> Any:
    return tuple(t[lo:hi] for t in x) if isinstance(x, tuple) else x[lo:hi]


def _train(
    stage: nn.Module,
    ref: nn.Module,
    wl: Any,
    replica: int,
    replicas: int,
    whole: Any,
    dp_group: dist.ProcessGroup,
    regather: bool = False,
) -> list[dict[str, Any]]:
    """``STEPS`` steps of ``M`` micro-batches on ``stage`` (FSDP over ``dp_group``; whole
    parameters from ``whole(grads)``), each checked against ``ref`` step by step."""
    from torch.distributed.tensor.debug import CommDebugMode

    from dapple.runtime.parallel.fsdp import begin_micro_batch

    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    b = G // M
    lo, hi = replica * b // replicas, (replica + 1) * b // replicas
    prologue = wl.build_stage(0, 1)
    out = []
    for step in range(STEPS):
        inputs, targets = wl.make_batch(G, step)
        with torch.no_grad():
            x = prologue(inputs)
        loss = torch.zeros(())
        comm: list[list[dict[str, int]]] = []  # per micro-batch: forward's, backward's
        for m in range(M):
            begin_micro_batch(stage, m, M, regather=regather)  # type: ignore[arg-type]
            rows = slice(m * b + lo, m * b + hi)
            with CommDebugMode() as fwd:  # one mode per pass: its module tracker needs it
                y = stage(_rows(x, rows.start, rows.stop))
            part = wl.loss_fn(y, targets[rows]) * (hi - lo) / G
            with CommDebugMode() as bwd:
                part.backward()
            loss += part.detach()
            comm.append([_counts(fwd), _counts(bwd)])
        dist.all_reduce(loss, group=dp_group)
        grads = whole(True)
        weights = whole(False)
        _load(ref, weights)
        ref_opt.zero_grad()
        ref_loss = wl.loss_fn(ref(x), targets)
        ref_loss.backward()
        grad_gaps = _gaps(grads, {n: p.grad for n, p in ref.named_parameters()})
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        out.append({
            "losses": [float(loss), float(ref_loss.detach())],
            "grads": grad_gaps,
            "params": _gaps(whole(False), {n: p.detach() for n, p in ref.named_parameters()}),
            "comm": comm,
        })  # fmt: skip
    return out


def fsdp_worker(rank: int, world: int, out_dir: str) -> None:
    """2 replicas of the zoo stage, ZeRO-3: accumulate-then-reduce and regather."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from dapple.runtime import TrainConfig, init_distributed, shutdown_distributed
    from dapple.runtime.parallel.fsdp import full_parameters, shard_stage

    init_distributed(TrainConfig(timeout_s=120), world)
    mesh = init_device_mesh("cpu", (world,))
    wl, _ = zoo()
    res: dict[str, Any] = {}
    for regather in (False, True):
        stage = wl.build_stage(1, 4)
        ref = copy.deepcopy(stage)
        full = sum(p.numel() for p in stage.parameters())
        sharded = shard_stage(stage, mesh, regather=regather)
        held = sum(p.to_local().numel() for p in sharded.parameters())  # type: ignore[operator]
        steps = _train(
            stage,
            ref,
            wl,
            rank,
            world,
            lambda grads, s=stage: full_parameters(s, grads),
            dist.group.WORLD,  # type: ignore[arg-type]
            regather,
        )
        res["regather" if regather else "accumulate"] = {
            "steps": steps,
            "held": held,
            "full": full,
        }
    lone = init_device_mesh("cpu", (1, world), mesh_dim_names=("one", "all"))["one"]
    try:
        shard_stage(wl.build_stage(1, 2), lone)
    except ValidationError as e:  # a one-rank replica mesh: nothing to shard
        res["one_rank"] = str(e)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    shutdown_distributed()


def tp_fsdp_worker(rank: int, world: int, out_dir: str, llama_path: str) -> None:
    """The LLaMA stage (two blocks and the head) on a (replica 2, tensor 2) mesh."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from dapple.runtime import TrainConfig, init_distributed, shutdown_distributed
    from dapple.runtime.parallel.fsdp import full_parameters, shard_stage
    from dapple.runtime.parallel.tp import parallelize_stage

    init_distributed(TrainConfig(timeout_s=300), world)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    wl, plan = llama(Path(llama_path))
    stage = wl.build_stage(1, 4)
    ref = copy.deepcopy(stage)
    tp = parallelize_stage(stage, plan, mesh["tp"])
    shard_stage(tp.module, mesh["dp"])

    def whole(grads: bool) -> dict[str, torch.Tensor]:
        return tp.full_parameters(local=full_parameters(tp.module, grads))

    steps = _train(
        tp.module, ref, wl, mesh["dp"].get_local_rank(), 2, whole, mesh["dp"].get_group()
    )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"steps": steps}))
    shutdown_distributed()


def _check_steps(steps: list[dict[str, Any]], what: str) -> None:
    for k, step in enumerate(steps):
        got, ref = step["losses"]
        assert got == pytest.approx(ref, rel=GRAD_NORM_RTOL), (what, k)
        for name, (gap, scale) in step["grads"].items():
            assert gap <= GRAD_RTOL * scale, (what, k, name, gap, scale)
        for name, (gap, scale) in step["params"].items():
            assert gap <= ATOL + RTOL * scale, (what, k, name, gap)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from dapple.runtime import spawn

    out = tmp_path_factory.mktemp("fsdp2")
    spawn(fsdp_worker, 2, str(out), timeout_s=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["accumulate", "regather"])
def test_zero3_stage_equals_one_process(fsdp2: list[dict[str, Any]], mode: str) -> None:
    for rank, res in enumerate(fsdp2):
        _check_steps(res[mode]["steps"], f"rank {rank} {mode}")
        assert res[mode]["held"] * 2 == pytest.approx(res[mode]["full"], abs=64)  # half each


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_gathers_once_per_step_when_accumulating(fsdp2: list[dict[str, Any]]) -> None:
    gather, scatter = {"c10d._allgather_base_": 1}, {"c10d._reduce_scatter_base_": 1}
    for res in fsdp2:
        for step in res["accumulate"]["steps"]:  # [[forward, backward] per micro-batch]
            assert step["comm"] == [[gather, {}], [{}, scatter]]
        # regather: each of the stage's 3 pieces (layers 1-3) is a unit: per micro-batch it
        # gathers in the forward, again in the backward, and reduce-scatters its gradients
        per_piece = {k: 3 * v for k, v in gather.items()}, {k: 3 * v for k, v in scatter.items()}
        for step in res["regather"]["steps"]:
            assert step["comm"] == [[per_piece[0], {**per_piece[0], **per_piece[1]}]] * M
        assert "at least 2 ranks" in res["one_rank"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_by_zero3_on_four_ranks_equals_one_process(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from dapple.runtime import spawn

    out = tmp_path_factory.mktemp("tp_fsdp")
    path = save_llama(out / "llama")
    spawn(tp_fsdp_worker, 4, str(out), str(path), timeout_s=300)
    tp = {"c10d.allreduce_": 4}  # 2 blocks x Megatron's 2, each way, every micro-batch
    gather, scatter = {"c10d._allgather_base_": 1}, {"c10d._reduce_scatter_base_": 1}
    for r in range(4):
        steps = json.loads((out / f"rank{r}.json").read_text())["steps"]
        _check_steps(steps, f"rank {r}")
        for step in steps:
            assert step["comm"] == [[{**gather, **tp}, tp], [tp, {**tp, **scatter}]]

"""Transport choice (NCCL, gloo, gloo host staged) and the host-staged path on gloo/CPU."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dapple.runtime import comm

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.mark.parametrize(
    ("device", "ranks", "gpus", "want"),
    [
        ("cpu", 4, 0, ("gloo", False)),
        ("cuda", 1, 1, ("nccl", False)),
        ("cuda", 4, 8, ("nccl", False)),
        ("cuda", 8, 8, ("nccl", False)),
        ("cuda", 2, 1, ("gloo", True)),  # two ranks on one GPU: NCCL refuses, stage via host
        ("cuda", 4, 1, ("gloo", True)),
        ("cuda", 9, 8, ("gloo", True)),
    ],
)
def test_ranks_sharing_a_gpu_get_gloo_with_host_staging(
    device: str, ranks: int, gpus: int, want: tuple[str, bool]
) -> None:
    assert comm.transport_for(device, ranks, gpus) == want


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv(comm.HOST_STAGED_ENV, "1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_staged_collectives_copy_their_results_back(one_rank: None) -> None:
    assert comm.host_staged()
    t = torch.arange(6.0)
    work = comm.all_reduce(t, async_op=True)
    assert work.wait()
    assert torch.equal(t, torch.arange(6.0))  # world 1: the sum is the tensor itself
    out = torch.zeros(6)
    comm.all_gather_single(out, t, async_op=True).wait()
    assert torch.equal(out, t)
    part = torch.zeros(6)
    comm.reduce_scatter_single(part, t, async_op=False)
    assert torch.equal(part, t)
    gathered = [torch.zeros(6)]
    comm.all_gather(gathered, t)
    assert torch.equal(gathered[0], t)
    moved = torch.zeros(6, 1)
    comm.all_to_all_single(moved, t.view(6, 1), [6], [6])  # world 1: every row to itself
    assert torch.equal(moved.view(-1), t)
    b = torch.full((3,), 7.0)
    comm.broadcast(b, src=0, async_op=True).wait()
    comm.reduce(b, dst=0)
    assert torch.equal(b, torch.full((3,), 7.0))


@pytest.mark.slow
def test_plans_train_like_one_process_with_every_tensor_host_staged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every p2p message and collective of the runtime through the staged path (gloo, CPU):
    split-concat, AllReduce, ZeRO-1/2 reductions and gathers, ZB-H1's split backward."""
    from dataclasses import replace

    from dapple import api
    from dapple.runtime.train_config import TrainConfig
    from dapple.runtime.verify import verify_many
    from runtime_workloads import make_plan

    monkeypatch.setenv(comm.HOST_STAGED_ENV, "1")
    wl = api.load("runtime_workloads:mlp")  # by spec: the workers rebuild it
    base = make_plan("1:3", "dapple", "A", False, 6, 2)
    zb = make_plan("2:1:1", "zbh1", "A", False, 6, 2)
    cfg = TrainConfig(steps=2, optimizer="adamw", lr=0.01, device="cpu", timeout_s=120.0)
    reports = [
        *verify_many([(base, wl), (zb, wl)], cfg),
        *verify_many([(base, wl)], replace(cfg, zero_stage=1)),
        *verify_many([(base, wl)], replace(cfg, zero_stage=2)),
    ]
    assert [r.ok for r in reports] == [True] * 4, [r.failures for r in reports]

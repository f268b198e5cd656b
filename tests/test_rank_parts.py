"""One rank's parts, each from its own builder (runtime/rank.py), the ZeRO layout
(runtime/parallel/zero/layout.py) and the tied groups of the gradient sync, on one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import runtime_workloads as rw
from dapple.core.plan import interleave, straight_plan
from dapple.core.recompute import Recompute
from dapple.errors import ValidationError
from dapple.models.shapes import input_shapes
from dapple.models.workload import Workload
from dapple.runtime.memory import ActivationMeter
from dapple.runtime.parallel.zero import (
    FlatShards,
    ZeroSelection,
    build_shards,
    flat_parameters,
    select_zero,
)
from dapple.runtime.parallel.zero.layout import flat_layout, replica_slices, tied_slices
from dapple.runtime.precision import Precision
from dapple.runtime.rank import (
    Batches,
    ExecutorFactory,
    batch_dims,
    build_layers,
    build_optimizer,
    first_batch,
    norm_parameters,
)
from dapple.runtime.stage import StageExecutor
from dapple.runtime.sync import tied_stages
from dapple.runtime.train_config import TrainConfig
from dapple.runtime.transport import BoundarySpec

CPU = torch.device("cpu")


def test_layers_are_the_ranks_stages_with_the_single_process_weights() -> None:
    wl = rw.mlp()
    plan = straight_plan(4, [0, 1, 3], global_batch_size=8, num_micro_batches=2, replicas=[1, 2, 1])
    whole = wl.build_model(0)
    layers = build_layers(plan, wl, 0, CPU, 2)  # stage 1, replica 1: layers 1-2
    assert (layers.stage, layers.replica, list(layers.chunks)) == (1, 1, [1])
    assert layers.module is layers.chunks[1] and layers.module.training
    for got, want in zip(layers.module, list(whole)[1:3], strict=True):
        for p, q in zip(got.parameters(), want.parameters(), strict=True):
            assert torch.equal(p, q)
    outside = build_layers(plan, wl, 0, CPU, 7)
    assert (outside.stage, outside.replica, outside.chunks, outside.module) == (
        None,
        None,
        {},
        None,
    )


def test_an_interleaved_rank_holds_its_chunks_layers_in_chain_order() -> None:
    wl = rw.mlp()
    plan = interleave(
        straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[1, 1]), 2
    )
    layers = build_layers(plan, wl, 0, CPU, 0)
    assert sorted(layers.chunks) == list(plan.stages_of_device(0)) and len(layers.chunks) == 2
    assert isinstance(layers.module, nn.Sequential)
    assert len(layers.module) == sum(len(c) for c in layers.chunks.values())
    assert list(layers.module) == [m for k in sorted(layers.chunks) for m in layers.chunks[k]]


def _rows(wl: Workload, n: int) -> Workload:
    return Workload(wl.name, wl.layer_factories, lambda b, s: wl.make_batch(n, s), wl.loss_fn)


def test_first_batch_checks_the_rows_of_make_batch() -> None:
    wl = rw.mlp()
    inputs, targets = first_batch(wl, 6, 3, None)
    assert torch.equal(inputs, wl.make_batch(6, 3)[0]) and targets.shape[0] == 6
    with pytest.raises(ValidationError, match=r"make_batch\(6\) returned \[5\] rows, expected 6"):
        first_batch(_rows(wl, 5), 6, 3, None)
    assert batch_dims(wl, 6, 3, None) == {}


def test_batches_give_step_0_as_drawn_then_draw_each_step() -> None:
    wl = rw.mlp()
    first = wl.make_batch(4, 0)
    no_data = SimpleNamespace(source=None, eval_batch=lambda k: ("eval", k))
    batches = Batches(wl, 0, 4, first, no_data, input_shapes(first[0]), {})  # type: ignore[arg-type]
    assert batches.batch(0) is first
    assert torch.equal(batches.batch(2)[0], wl.make_batch(4, 2)[0])
    assert batches.eval_batch(3) == ("eval", 3)


def test_zero_selection_and_what_the_optimizer_updates() -> None:
    wl = rw.mlp()
    plan = straight_plan(4, [0, 1], global_batch_size=12, num_micro_batches=2, replicas=[1, 2])
    layers = build_layers(plan, wl, 0, CPU, 1)  # stage 1, replica 0
    off = select_zero(plan, wl, layers, 0)
    assert off == ZeroSelection(0, [], []) and not off.sharded
    assert build_shards(plan, layers, off, None) is None
    assert layers.module is not None
    params = list(layers.module.parameters())
    updated, opt = build_optimizer(TrainConfig(), params, off.sharded, None)
    assert updated == params and opt is not None
    counted = norm_parameters(plan, wl, layers, off.sharded, None)
    assert [id(p) for p in counted] == [id(p) for p in params]  # replica 0 counts its stage

    on = select_zero(plan, wl, layers, 1)
    assert on.flat == flat_parameters(plan, wl, 1, layers.module) and not on.tied
    assert on.sharded == on.flat_ids == frozenset(id(p) for p in on.flat)
    shards = build_shards(plan, layers, on, None)
    assert isinstance(shards, FlatShards)
    updated, _ = build_optimizer(TrainConfig(), params, on.sharded, shards)
    assert updated == [pc.param for pc in shards.pieces]  # every parameter is sharded
    shards.close()


def test_executor_factory_makes_one_executor_per_chunk_and_none_off_the_plan() -> None:
    wl = rw.mlp()
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[1, 1])
    specs = [BoundarySpec.of(torch.zeros(1, rw.HID))]  # stage 0's output

    def factory(rank: int, recompute: Recompute | None) -> ExecutorFactory:
        layers = build_layers(plan, wl, 0, CPU, rank)
        return ExecutorFactory(layers, specs, wl.loss_fn, CPU, recompute, ActivationMeter(),
                               Precision("fp32", CPU), dynamic=False, seed=0)  # fmt: skip

    ex = factory(1, Recompute.FULL)(plan, True)
    assert isinstance(ex, StageExecutor) and (ex.s, ex.j) == (1, 0) and ex.recompute
    ev = factory(1, Recompute.FULL)(plan, False)
    assert isinstance(ev, StageExecutor) and not ev.recompute  # evaluation never recomputes
    assert factory(5, None)(plan, True) is None  # a rank outside the plan


def test_tied_stages_are_the_stages_holding_a_copy() -> None:
    plan = straight_plan(4, [0, 2, 3], global_batch_size=4, num_micro_batches=2)
    assert tied_stages(plan, [(1, "0.weight"), (2, "0.weight")]) == [0, 1]
    assert tied_stages(plan, [(0, "w"), (1, "w")]) == [0]
    assert tied_stages(plan, [(3, "w"), (0, "w")]) == [0, 2]


def test_replica_slices_cover_a_tensor_once() -> None:
    assert replica_slices(10, 3) == [(0, 4), (4, 8), (8, 10)]
    assert replica_slices(2, 3) == [(0, 1), (1, 2), (2, 2)]  # the last one empty
    t = nn.Parameter(torch.arange(5.0))
    pieces = [tied_slices([t], j, 3) for j in range(3)]
    assert [len(p) for p in pieces] == [1, 1, 1]
    assert torch.equal(torch.cat([p[0].param.detach() for p in pieces]), t.detach())
    assert [p[0].offset for p in pieces] == [0, 2, 4]
    assert tied_slices([nn.Parameter(torch.zeros(2))], 2, 3) == []


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_flat_layout_makes_parameters_views_and_splits_each_bucket_in_r_chunks(
    zero_stage: int,
) -> None:
    r = 3
    layer = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    before = [p.detach().clone() for p in layer.parameters()]
    runs = [list(layer[1].parameters()), list(layer[0].parameters())]
    held = []
    for j in range(r):
        copy = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        copy.load_state_dict(layer.state_dict())
        runs_j = [list(copy[1].parameters()), list(copy[0].parameters())]
        with torch.no_grad():
            held.append(
                (runs_j, flat_layout(runs_j, j, r, zero_stage == 1, {"dtype": torch.float32}))
            )
    for runs_j, lay in held:
        for k, run in enumerate(runs_j):
            bk = lay.buckets[k]
            assert bk.padded % r == 0 and bk.padded >= sum(p.numel() for p in run)
            assert (bk.grads is not None) == (zero_stage == 1)
            for i, p in enumerate(run):
                kk, ii, off = lay.where[id(p)]
                assert (kk, ii) == (k, i)
                assert p.data_ptr() == bk.flat[off:].data_ptr()  # a view of its bucket
        assert lay.grad_shard.numel() == sum(bk.padded // r for bk in lay.buckets)
        for pc in lay.pieces:
            assert pc.param.grad is not None
            assert pc.param.grad.data_ptr() >= lay.grad_shard.data_ptr()
    for runs_j, _ in held:  # the weights are unchanged by the layout
        flat_now = [p.detach() for run in reversed(runs_j) for p in run]
        for a, b in zip(flat_now, before, strict=True):
            assert torch.equal(a, b)
    # the replicas' pieces cover every element of every parameter exactly once
    total = sum(p.numel() for run in runs for p in run)
    assert sum(pc.param.numel() for _, lay in held for pc in lay.pieces) == total

"""ZB-V and DualPipeV in the runtime: the message a rank sends itself at the turn of the V, and
``verify`` against one device under AdamW: GPT-2 with dropout on a straight and an uneven (2:1)
plan, on an odd layer count, and both with a ZeRO-3 and a tensor-parallel device group."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dapple import api
from dapple.core.plan import StagePlan, straight_plan
from dapple.runtime import comm
from dapple.simulate.plan_variants import with_schedule


def test_a_message_to_oneself_is_matched_by_tag_in_either_order(tmp_path: Path) -> None:
    """The runtime's loopback (ZB-V's turn): send then receive, receive then send, FIFO per
    tag; a receive waited for before its send is an error, not a hang."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
        assert comm.isend(a, dst=0, tag=7).is_completed()
        comm.isend(b, dst=0, tag=7)
        a.add_(10)  # the message is what was sent, not the tensor's later value
        got = [torch.empty(2), torch.empty(2)]
        for buf in got:
            comm.irecv(buf, src=0, tag=7).wait()
        assert got[0].tolist() == [1.0, 2.0] and got[1].tolist() == [3.0, 4.0]
        early = torch.empty(2)
        work = comm.irecv(early, src=0, tag=9)
        assert not work.is_completed()
        comm.isend(torch.tensor([5.0, 6.0]), dst=0, tag=9)
        assert work.wait() and early.tolist() == [5.0, 6.0]
        with pytest.raises(RuntimeError, match="message to itself"):
            comm.irecv(torch.empty(2), src=0, tag=11).wait()
    finally:
        comm._Loopback._recvs.clear()  # the refused receive's, left by the error above
        dist.destroy_process_group()


def _turn_links() -> tuple[Any, Any]:
    """The messages of rank 1's chunks 1 and 2 of a ZB-V over 2 ranks (the turn of the V), built
    without a process group: both chunks' links say they are rank 1's."""
    from dapple.runtime.stage_links import StageLinks
    from dapple.runtime.transport import BoundarySpec, TensorSpec

    plan = with_schedule(straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2), "zbv")
    assert plan.stages_of_group(1) == (1, 2)
    spec = BoundarySpec(is_tuple=False, tensors=(TensorSpec(torch.float32, (3,)),))
    links = [StageLinks(plan, s, 0, [spec] * 3, torch.device("cpu")) for s in (1, 2)]
    for x in links:
        x.p2p.rank = 1
    return links[0], links[1]


def test_the_turn_of_the_v_hands_its_tensors_over_without_a_copy() -> None:
    """Chunk 2 receives chunk 1's activations, and chunk 1 chunk 2's input gradients, as the
    tensors themselves (their storage): no buffer, no copy, no message posted (counted: the only
    aten op is the activations' detach); a receive waited for before its send is an error."""
    from dapple.profiler.op_counts import OpCounter

    one, two = _turn_links()
    out = torch.randn(2, 3, requires_grad=True) * 2  # chunk 1's output of micro-batch 0
    grad = torch.ones(2, 3)  # chunk 2's input gradient
    counter = OpCounter()
    counter.start()
    two.post_recv(0, 0, False, None)  # posted early, as the interpreter does
    sends = one.send_forward(0, 0, (out,))
    (x,) = two.wait_concat(0, False)
    x.requires_grad_(True)
    x.grad = grad
    two.keep_grads(0, (x,))
    one.post_recv(0, 0, True, (out,))
    two.send_backward(0, 0)
    (g,) = one.wait_concat(0, True, (out,))
    ops = counter.stop().ops
    assert sends == [] and two.pending == [] and one.pending == []
    assert x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert g is x.grad
    assert dict(ops) == {"aten::detach": 1}, ops
    two.post_recv(1, 0, False, None)
    with pytest.raises(RuntimeError, match=r"rank 1 waits for a message to itself \(tag \d+\)"):
        two.wait_concat(1, False)
    one.finish()


def test_the_split_backward_detaches_a_stage_output_itself_unless_a_view_or_a_leaf() -> None:
    """The forward keeps a stage's output for the split backward as it is (no copy), a copy only
    of a view (torch refuses to detach one in place) or of a leaf (an input passed through); I
    then W on an output that its own node saved (tanh) give autograd's gradients."""
    from dapple.models.split_backward import input_gradients, weight_gradients
    from dapple.runtime.stage import _detachable

    lin = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    out = torch.tanh(lin(x))
    assert _detachable((out,))[0] is out
    view, leaf = out.view(3, 2), torch.ones(2, requires_grad=True)
    for t in (view, leaf):
        (copy,) = _detachable((t,))
        assert copy is not t and torch.equal(copy, t) and not copy._is_view()
    g = torch.randn_like(out)
    want = torch.autograd.grad(out, [x, lin.weight, lin.bias], g, retain_graph=True)
    groups = input_gradients([out], [g], [x], list(lin.parameters()))
    weight_gradients(groups, list(lin.parameters()))
    assert out.grad_fn is None  # detached in place by I
    for got, ref in zip((x.grad, lin.weight.grad, lin.bias.grad), want, strict=True):
        torch.testing.assert_close(got, ref)


def test_the_split_backward_copies_outputs_when_one_may_be_saved_by_anothers_node() -> None:
    """Outputs ``(a, a * w)``: ``a`` is saved by the product's node, so detaching it in place
    would break W; both are copied, and I then W give autograd's gradients."""
    from dapple.models.split_backward import input_gradients, weight_gradients
    from dapple.runtime.stage import _detachable

    lin, w = torch.nn.Linear(3, 3), torch.nn.Parameter(torch.randn(3))
    x = torch.randn(2, 3, requires_grad=True)
    a = lin(x)
    outs = (a, a * w)
    kept = _detachable(outs)
    assert all(k is not o and torch.equal(k, o) for k, o in zip(kept, outs, strict=True))
    params = [*lin.parameters(), w]
    gs = [torch.randn_like(t) for t in kept]
    want = torch.autograd.grad(kept, [x, *params], gs, retain_graph=True)
    groups = input_gradients(list(kept), gs, [x], params)
    weight_gradients(groups, params)
    for got, ref in zip((x.grad, *(p.grad for p in params)), want, strict=True):
        torch.testing.assert_close(got, ref)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("schedule", "M"), [("zbv", 3), ("dualpipev", 4)])
def test_verify_v_schedules_equal_one_device_under_adamw_with_dropout(schedule: str, M: int):
    """GPT-2 (dropout 0.1, its tied wte and LM head on the first and the last stage: rank 0's
    two chunks) after 2 AdamW steps: straight (one device per group) and 2:1 (rank 0's chunks
    replicated twice, split-concat into rank 1's), every parameter and loss equal to one
    device's. The turn of the V (rank 1's chunk 0 into its chunk 1) is a message to itself;
    DualPipeV runs some backwards whole and some split on the same chunk."""
    wl = api.load("dapple.models.hf:gpt2", layers=2, hidden=32, heads=2, vocab=64, seq=16,
                  dropout=0.1)  # fmt: skip
    n = wl.num_layers
    bases = [
        straight_plan(n, [0, n // 2], global_batch_size=4 * M, num_micro_batches=M, replicas=reps)
        for reps in ([1, 1], [2, 1])
    ]
    plans = [with_schedule(b, schedule) for b in bases]
    assert [p.stages_of_group(0) for p in plans] == [(0, 3), (0, 3)]
    reports = api.verify_many([(p, wl) for p in plans], 2, device="cpu", optimizer="adamw",
                              lr=1e-3)  # fmt: skip
    for plan, rep in zip(plans, reports, strict=True):
        assert rep.ok, (plan.replication, rep.max_abs_diff)
        assert rep.grad_norms_ok, (plan.replication, rep.grad_norms, rep.reference_grad_norms)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)
        assert rep.losses[0] != pytest.approx(rep.losses[1], rel=1e-4)  # the steps differ


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_v_schedules_on_an_odd_layer_count() -> None:
    """GPT-2 of 5 chain layers (an odd count, which the planner offers the V schedules): groups
    of 2 and 3 layers cut into chunks of 1, 2, 1 and 1 layers; ZB-V and DualPipeV after 2 AdamW
    steps with dropout equal one device."""
    wl = api.load("dapple.models.hf:gpt2", layers=3, hidden=32, heads=2, vocab=64, seq=16,
                  dropout=0.1)  # fmt: skip
    assert wl.num_layers == 5
    base = straight_plan(5, [0, 2], global_batch_size=16, num_micro_batches=4)
    plans = [with_schedule(base, s) for s in ("zbv", "dualpipev")]
    for p in plans:
        assert [st.layers for st in p.stages] == [(0, 1), (1, 3), (3, 4), (4, 5)]
    reports = api.verify_many([(p, wl) for p in plans], 2, device="cpu", optimizer="adamw",
                              lr=1e-3)  # fmt: skip
    for plan, rep in zip(plans, reports, strict=True):
        assert rep.ok, (plan.schedule, rep.max_abs_diff)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("schedule", "M"), [("zbv", 2), ("dualpipev", 4)])
def test_verify_v_schedules_with_zero3_and_tensor_parallel_groups(schedule: str, M: int) -> None:
    """ZB-V and DualPipeV (M >= 2P) on the zoo transformer traced into embedding, block, block,
    head: 2:1 with ZeRO-3 (no per-micro-batch re-gather) on the replicated group 0, and a TP2
    group 1 holding both blocks (the turn of the V: each tensor rank's message to itself),
    equal to one device's under AdamW. DualPipeV runs whole and split backwards on the same
    ZeRO-3 and TP chunks."""
    from test_tp_runtime import plan_of, zoo_spec

    wl = zoo_spec()
    n = wl.num_layers
    zero3 = plan_of([StagePlan(layers=(0, 2), devices=(0, 1), zero_stage=3),
                     StagePlan(layers=(2, n), devices=(2,))])  # fmt: skip
    tp = plan_of([StagePlan(layers=(0, 2), devices=(0,)),
                  StagePlan(layers=(2, n), devices=(1, 2), tensor_width=2)])  # fmt: skip
    G = zero3.global_batch_size
    plans = [
        with_schedule(dataclasses.replace(p, num_micro_batches=M, micro_batch_size=G // M),
                      schedule)
        for p in (zero3, tp)
    ]  # fmt: skip
    assert plans[0].stages[0].zero_stage == plans[0].stages[3].zero_stage == 3
    assert plans[1].stages[1].tensor_width == plans[1].stages[2].tensor_width == 2
    reports = api.verify_many([(p, wl) for p in plans], 2, device="cpu", optimizer="adamw",
                              lr=1e-3)  # fmt: skip
    for plan, rep in zip(plans, reports, strict=True):
        assert rep.ok, (plan.replication, rep.max_abs_diff)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)

"""ZB-H1 and interleaved 1F1B in the runtime. ZB-H1's backward split into ``I`` (input
gradients) and ``W`` (weight gradients) is checked half by half against autograd in one
process; both schedules then end to end by ``verify`` against one device on straight, 2:1:1 and
1:2:1 plans, interleaved also on 2 devices x 2 chunks (zoo transformer and Hugging Face GPT-2,
ZeRO-1/2 - interleaved too -, re-computation, a tied weight split across device groups). Tuple boundaries with an integer
member and a tied weight inside a stage run ZB-H1 in ``test_runtime``'s equivalence configs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dapple import api
from dapple.core.plan import Plan, interleave, straight_plan
from dapple.models.split_backward import input_gradients, weight_gradients
from dapple.models.zoo import load_workload
from dapple.schedule.lower import lower


def _zb(plan: Plan, zero: int = 0, recompute: bool = False) -> Plan:
    return dataclasses.replace(_sharded(plan, zero, recompute), schedule="zbh1")


def _sharded(plan: Plan, zero: int, recompute: bool = False) -> Plan:
    """``plan`` with ``zero`` on its replicated stages (and re-computation on every stage)."""
    stages = tuple(
        dataclasses.replace(
            s, zero_stage=zero if s.replicas > 1 else 0, recompute="full" if recompute else "none"
        )
        for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages)


def test_split_backward_equals_autograd_and_reports_each_parameter_once() -> None:
    """A middle stage of a transformer: I gives autograd's input gradient and leaves the
    parameters untouched; W gives autograd's parameter gradients, telling ``on_ready`` of each
    parameter exactly once and before the last group is done (the reduction can overlap)."""
    wl = load_workload("transformer", layers=2, hidden=16, heads=2, seq=8)
    stage = wl.build_stage(1, 3, seed=0)
    x = torch.randn(3, 8, 16, requires_grad=True)
    g = torch.randn(3, 8, 16)
    weights = [p for p in stage.parameters() if p.requires_grad]
    ref = torch.autograd.grad(stage(x), [x, *weights], g)

    out = stage(x).clone()  # not a view: the split backward detaches it in place
    groups = input_gradients([out], [g], [x], weights)
    assert x.grad is not None and torch.allclose(x.grad, ref[0], atol=1e-6)
    assert all(p.grad is None for p in weights) and len(groups) > 1

    ready: list[torch.Tensor] = []
    pending_at_first: list[int] = []

    def on_ready(p: torch.Tensor) -> None:
        if not ready:
            pending_at_first.append(sum(q.grad is None for q in weights))
        ready.append(p)

    weight_gradients(groups, weights, on_ready)
    assert sorted(map(id, ready)) == sorted(map(id, weights))  # each once
    assert pending_at_first[0] > 0  # told before the other groups computed theirs
    for p, r in zip(weights, ref[1:], strict=True):
        assert p.grad is not None and torch.allclose(p.grad, r, atol=1e-6)


def test_lowered_zbh1_sends_input_gradients_after_i_and_nothing_after_w() -> None:
    plan = _zb(straight_plan(3, [0, 1, 2], global_batch_size=4, num_micro_batches=4))
    prog = [str(a) for a in lower(plan)[1]]
    i = prog.index("1I0")
    assert prog[i + 1] == "1.0SEND_B0@0"
    w = prog.index("1W0")
    assert not prog[w + 1].startswith("1.0SEND")


def _shapes(n: int, G: int, M: int, v: int) -> list[Plan]:
    """Straight 4, 2:1:1 and 1:2:1 over ``n`` layers (interleaved with v chunks when v > 1)."""
    shapes = [([0, 1, 2, 3], [1, 1, 1, 1]), ([0, 2, 3], [2, 1, 1]), ([0, 1, 3], [1, 2, 1])]
    plans = []
    for cuts, reps in shapes:
        groups = len(cuts)
        m = M * groups // math.gcd(M, groups) if v > 1 else M  # interleaved: a multiple of P
        p = straight_plan(n, [c * n // 4 for c in cuts], global_batch_size=G * m // M,
                          num_micro_batches=m, replicas=reps)  # fmt: skip
        plans.append(interleave(p, v) if v > 1 else _zb(p))
    return plans


def _two_by_two(n: int) -> Plan:
    """v = 2 chunks on each of 2 devices (4 virtual stages)."""
    return interleave(straight_plan(n, [0, n // 2], global_batch_size=8, num_micro_batches=4), 2)


def _check(reports: list[api.VerifyReport]) -> None:
    for rep in reports:
        plan = rep.plan
        what = (rep.model_name, plan.schedule, plan.virtual_stages, plan.replication,
                [s.zero_stage for s in plan.stages], [s.recompute for s in plan.stages])  # fmt: skip
        assert rep.ok, (what, rep.max_abs_diff)
        assert rep.grad_norms_ok, (what, rep.grad_norms, rep.reference_grad_norms)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), what


@pytest.mark.slow
def test_verify_zbh1_and_interleaved_zoo_transformer() -> None:
    """ZB-H1 and interleaved v=2 on straight 4, 2:1:1 and 1:2:1 (interleaved also with ZeRO-1
    and ZeRO-2 on the replicated device group), and v=2 on 2 devices x 2 chunks: every
    parameter after 3 steps of SGD with momentum and a binding clip equals one device's."""
    zoo = api.load("transformer", layers=6, hidden=16, heads=2, seq=8)
    n = zoo.num_layers
    inter = _shapes(n, 8, 4, 2)
    plans = [*_shapes(n, 8, 4, 1), *inter, _two_by_two(n)]
    plans += [_sharded(inter[1], 1), _sharded(inter[2], 2)]
    assert [p.schedule for p in plans] == ["zbh1"] * 3 + ["interleaved"] * 6
    free = api.load("runtime_workloads:paramfree_mlp")  # stage 1 is a Tanh alone: an empty W
    free_plan = _zb(straight_plan(5, [0, 2, 3], global_batch_size=8, num_micro_batches=4))
    reports = api.verify_many(
        [*((p, zoo) for p in plans), (free_plan, free)],
        3,
        device="cpu",
        momentum=0.9,
        clip_grad_norm=0.5,
    )
    _check(reports)


@pytest.mark.slow
def test_verify_zbh1_and_interleaved_gpt2() -> None:
    """GPT-2 (its wte and LM head one tied weight, on different device groups) after 3 steps
    of SGD with momentum and a binding clip: ZB-H1 on straight, 2:1:1 and 1:2:1, with ZeRO-1
    and ZeRO-2 on the replicated stage and with re-computation; interleaved v=2 on 2 devices x
    2 chunks and (6 blocks) on straight, 2:1:1 and 1:2:1, and 2:1:1 with ZeRO-1 (the tied wte
    sharded in slices over the first device group)."""
    pytest.importorskip("transformers")
    gpt2 = api.load("dapple.models.hf:gpt2", layers=2, hidden=32, heads=2, vocab=64, seq=16)
    gpt6 = api.load("dapple.models.hf:gpt2", layers=6, hidden=32, heads=2, vocab=64, seq=16)
    n = gpt2.num_layers
    zb = _shapes(n, 8, 4, 1)
    cases = [(p, gpt2) for p in zb]
    cases += [
        (_zb(zb[2], zero=1), gpt2),
        (_zb(zb[1], zero=2), gpt2),
        (_zb(zb[2], recompute=True), gpt2),
        (_two_by_two(n), gpt2),
        *((p, gpt6) for p in _shapes(gpt6.num_layers, 8, 4, 2)),
        (_sharded(_shapes(gpt6.num_layers, 8, 4, 2)[1], 1), gpt6),
    ]
    # SGD with momentum (sharded under ZeRO): AdamW turns float32 round-off in GPT-2's
    # near-zero gradients into lr-sized steps, up to 1.5e-4 here under every schedule
    reports = api.verify_many(cases, 3, device="cpu", momentum=0.9, clip_grad_norm=0.5)
    _check(reports)


@pytest.mark.slow
def test_interleaved_evaluates_and_trains_like_its_straight_plan() -> None:
    """v = 2 on 2 devices, evaluating after every step (forward-only, chunk after chunk) and
    with an eval batch of its own size, against the straight 2-stage plan of the same layers
    under 1F1B: the same training losses and the same eval losses."""
    zoo = api.load("transformer", layers=2, hidden=16, heads=2, seq=8)
    n = zoo.num_layers
    straight = straight_plan(n, [0, n // 2], global_batch_size=8, num_micro_batches=4)
    opts = dict(steps=3, eval_every=1, eval_batches=2, eval_batch_size=6, momentum=0.9)
    want = api.train(straight, zoo, **opts)
    got = api.train(interleave(straight, 2), zoo, **opts)
    assert [m.eval_loss for m in got] == pytest.approx([m.eval_loss for m in want], rel=1e-5)
    assert [m.loss for m in got] == pytest.approx([m.loss for m in want], rel=1e-5)
    assert len({m.eval_loss for m in got}) == 3  # the weights moved between evaluations
    # memory per device group (its two chunks), as for the straight plan's two stages
    assert len(got[-1].peak_memory_bytes) == 2 and min(got[-1].peak_memory_bytes) > 0

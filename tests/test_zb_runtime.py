"""ZB-H1 in the runtime: the backward split into ``I`` (input gradients) and ``W`` (weight
gradients), checked half by half against autograd in one process, then end to end by
``verify`` against one device on straight, 2:1:1 and 1:2:1 plans (zoo and Hugging Face GPT-2,
ZeRO-1/2, re-computation, a tied weight split across stages). Tuple boundaries with an integer
member and a tied weight inside a stage run ZB-H1 in ``test_runtime``'s equivalence configs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dapple import api
from dapple.core.plan import Plan, straight_plan
from dapple.models.zoo import load_workload
from dapple.runtime.split_backward import input_gradients, weight_gradients
from dapple.schedule.lower import lower


def _zb(plan: Plan, zero: int = 0, recompute: bool = False) -> Plan:
    stages = tuple(
        dataclasses.replace(s, zero_stage=zero if s.replicas > 1 else 0, recompute=recompute)
        for s in plan.stages
    )
    return dataclasses.replace(plan, schedule="zbh1", stages=stages)


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


def _cases(wl: object, n: int) -> list[tuple[Plan, object]]:
    shapes = [([0, 1, 2, 3], [1, 1, 1, 1]), ([0, 2, 3], [2, 1, 1]), ([0, 1, 3], [1, 2, 1])]
    plans = [
        straight_plan(
            n, [c * n // 4 for c in cuts], global_batch_size=8, num_micro_batches=4, replicas=reps
        )
        for cuts, reps in shapes
    ]
    return [(_zb(p), wl) for p in plans]


def _check(reports: list[api.VerifyReport]) -> None:
    for rep in reports:
        what = (rep.model_name, rep.plan.replication, [s.zero_stage for s in rep.plan.stages])
        assert rep.plan.schedule == "zbh1"
        assert rep.ok, (what, rep.max_abs_diff)
        assert rep.grad_norms_ok, (what, rep.grad_norms, rep.reference_grad_norms)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), what


@pytest.mark.slow
def test_verify_zbh1_straight_2_1_1_and_1_2_1_zoo_transformer() -> None:
    """Every parameter after 3 steps of SGD with momentum and a binding clip equals one
    device's."""
    zoo = api.load("transformer", layers=2, hidden=16, heads=2, seq=8)
    reports = api.verify_many(
        _cases(zoo, zoo.num_layers), 3, device="cpu", momentum=0.9, clip_grad_norm=0.5
    )
    _check(reports)


@pytest.mark.slow
def test_verify_zbh1_gpt2_with_zero_and_recomputation() -> None:
    """GPT-2 (its wte and LM head one tied weight on the first and last stage) after 3 AdamW
    steps with a binding clip, on straight, 2:1:1 and 1:2:1, ZeRO-1 and ZeRO-2 on the
    replicated stage, and re-computation."""
    pytest.importorskip("transformers")
    gpt2 = api.load("dapple.models.hf:gpt2", layers=2, hidden=32, heads=2, vocab=64, seq=16)
    n = gpt2.num_layers
    cases = _cases(gpt2, n)
    one_two_one = straight_plan(
        n, [0, 1, 3], global_batch_size=8, num_micro_batches=4, replicas=[1, 2, 1]
    )
    two_one_one = straight_plan(
        n, [0, 2, 3], global_batch_size=8, num_micro_batches=4, replicas=[2, 1, 1]
    )
    cases += [
        (_zb(one_two_one, zero=1), gpt2),
        (_zb(two_one_one, zero=2), gpt2),
        (_zb(one_two_one, recompute=True), gpt2),
    ]
    # Adam turns float32 round-off in near-zero gradients into lr-sized steps: atol 1e-4
    reports = api.verify_many(
        cases, 3, device="cpu", optimizer="adamw", lr=0.01, clip_grad_norm=0.5, atol=1e-4
    )
    _check(reports)

"""``TrainConfig.grad_norm_every``: the global gradient norm on steps 0, N, 2N, ... only, and on
the other steps the guard's gradient verdict from one fused finiteness check (issue 46).

One process (a gloo group of one) trains a 1-stage plan. What must hold: the steps that report
the norm report the same number as a run with the norm on every step, the others report None;
the weights and losses are those of that run bit for bit (the check leaves the gradients as they
are); a non-finite gradient on a step without the norm stops or skips the step as it does with
the norm; a step without the norm makes a fixed handful of aten ops where the norm makes three
per gradient; clipping, which needs every step's norm, is refused with N > 1.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import runtime_workloads as rw
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.profiler.op_counts import OpCounter
from dapple.runtime import RankFailure, TrainConfig, run_plan
from test_long_runs import NAN_STEP, grad_nan_mlp

B, M, SEED = 4, 2, 1
STEPS = 7
CHECK_OPS = 6
"""aten ops of a step's finiteness check in place of the norm: the flag's ``zero_``, one
``_amp_foreach_non_finite_check_and_unscale_`` per (device, dtype) group, ``neg``, ``log1p``
and the 0-d view (5 here), where the norm makes three per gradient."""


pytestmark = pytest.mark.usefixtures("world_of_one")


def _run(wl: Workload, steps: int = STEPS, on_step: Any = None, **options: Any) -> Any:
    plan = straight_plan(wl.num_layers, [0], global_batch_size=B * M, num_micro_batches=M)
    cfg = TrainConfig(steps=steps, seed=SEED, optimizer="adamw", lr=1e-3, **options)
    return run_plan(plan, wl, cfg, device=torch.device("cpu"), on_step=on_step)


@pytest.mark.parametrize("on_nonfinite", ["stop", "off"])
def test_the_norm_on_every_nth_step_and_the_same_training(on_nonfinite: str) -> None:
    every = _run(rw.mlp(4), on_nonfinite=on_nonfinite)
    third = _run(rw.mlp(4), on_nonfinite=on_nonfinite, grad_norm_every=3)
    norms = [m.grad_norm for m in every.metrics]
    assert all(n is not None and n > 0 for n in norms)
    assert [m.grad_norm for m in third.metrics] == [
        n if k % 3 == 0 else None for k, n in enumerate(norms)
    ]
    assert [m.loss for m in third.metrics] == [m.loss for m in every.metrics]
    for a, b in zip(every.module.parameters(), third.module.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_a_non_finite_gradient_on_a_step_without_the_norm(mode: str) -> None:
    """The bomb's NaN gradient lands on step 3, which computes no norm at N = 2: the check
    stops (or skips) it with the message the norm gives, naming the micro-batch."""
    assert NAN_STEP % 2 == 1
    outcomes = []
    for n in (1, 2):
        if mode == "stop":
            with pytest.raises(RankFailure) as err:
                _run(grad_nan_mlp(), steps=NAN_STEP + 2, grad_norm_every=n)
            outcomes.append(str(err.value))
        else:
            run = _run(grad_nan_mlp(), steps=NAN_STEP + 2, grad_norm_every=n, on_nonfinite=mode)
            outcomes.append(str([p.detach().tolist() for p in run.module.parameters()]))
    if mode == "stop":
        assert outcomes[0].startswith(f"step {NAN_STEP}: non-finite gradient in micro-batch ")
    assert outcomes[1] == outcomes[0]


def _norm_ops(**options: Any) -> int:
    """aten ops of step 2 whose names say norm or finiteness check (step 2: after warm-up)."""
    win, got = OpCounter(), {}

    def on_step(m: Any) -> None:
        if m.step == 1:
            win.start()
        elif m.step == 2:
            got["ops"] = win.stop().ops

    _run(rw.mlp(8), steps=4, on_step=on_step, **options)
    return got["ops"]


def test_a_step_without_the_norm_makes_a_few_ops_in_its_place() -> None:
    with_norm, without = _norm_ops(), _norm_ops(grad_norm_every=4)
    grads = 2 * 8  # weight and bias per layer
    assert with_norm["aten::linalg_vector_norm"] == grads  # once per step: guard and metric
    assert without["aten::linalg_vector_norm"] == 0
    assert without["aten::_amp_foreach_non_finite_check_and_unscale_"] == 1
    saved = sum(with_norm.values()) - sum(without.values())
    assert saved >= 3 * grads - CHECK_OPS, (with_norm - without, without - with_norm)


def test_the_norm_is_computed_once_per_step_with_clipping_and_the_guard() -> None:
    """Clipping, the ``grad_norm`` metric and the guard's verdict share one norm per step."""
    ops = _norm_ops(clip_grad_norm=1.0)
    assert ops["aten::linalg_vector_norm"] == 2 * 8
    assert ops.get("aten::_amp_foreach_non_finite_check_and_unscale_", 0) == 0


def test_grad_norm_every_is_refused_with_clipping_or_below_one() -> None:
    with pytest.raises(ValidationError, match="grad_norm_every 2 cannot go with clip_grad_norm"):
        TrainConfig(grad_norm_every=2, clip_grad_norm=1.0)
    with pytest.raises(ValidationError, match="grad_norm_every must be >= 1, got 0"):
        TrainConfig(grad_norm_every=0)
    assert TrainConfig(grad_norm_every=1, clip_grad_norm=1.0).grad_norm_every == 1

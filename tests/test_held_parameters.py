"""Held activations count activations only: not the whole parameters ZeRO-3 gathers.

Under ZeRO-3 FSDP gathers a stage's whole parameters before its forward and keeps them for the
backward; autograd saves them (or views of them) like activations. ``peak[held_activations]``
reported them as activations: a 2-replica MLP held 54,116 bytes under ZeRO-3 against 2,404
without sharding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dapple import api
from dapple.core.plan import straight_plan
from dapple.runtime.memory import ActivationMeter


def _held_peak(meter: ActivationMeter, weight: torch.Tensor, x: torch.Tensor) -> int:
    with meter.saved_tensors_hooks():
        y = (x @ weight.t()).sum()  # saves x and weight.t() (a view of the weight)
    peak = meter.peak_bytes
    y.backward()
    return peak


def test_a_gathered_parameter_is_not_an_activation() -> None:
    own = torch.nn.Parameter(torch.ones(2, 2))
    gathered = torch.nn.Parameter(torch.ones(64, 32))  # swapped in after the meter was built
    x = torch.ones(4, 32, requires_grad=True)  # its gradient needs the weight saved
    x_bytes = x.numel() * x.element_size()

    counted = _held_peak(ActivationMeter(exclude=[own]), gathered, x)
    assert counted == x_bytes + gathered.numel() * gathered.element_size()

    meter = ActivationMeter(exclude=[own], gathered=lambda: [own, gathered])
    assert _held_peak(meter, gathered, x) == x_bytes
    assert meter.current_bytes == 0


def _peaks(zero_stage: int, regather: bool = False) -> list[tuple[int, ...]]:
    plan = straight_plan(5, [0], global_batch_size=8, num_micro_batches=2, replicas=[2])
    stages = tuple(
        dataclasses.replace(s, zero_stage=zero_stage, regather=regather) for s in plan.stages
    )
    metrics = api.train(dataclasses.replace(plan, stages=stages), "mlp", 2, optimizer="adamw",
                        lr=1e-2, seed=3)  # fmt: skip
    assert {m.memory_kind for m in metrics} == {"held_activations"}
    return [m.peak_memory_bytes for m in metrics]


@pytest.mark.slow
def test_zero3_holds_the_activations_of_an_unsharded_run() -> None:
    plain = _peaks(0)
    assert all(p[0] > 0 for p in plain)
    assert _peaks(3) == plain
    assert _peaks(3, regather=True) == plain

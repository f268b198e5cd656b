"""Tied parameters in the profile and the memory model: the profiler records each layer's copies
of tied parameters and the layers holding the others; the planner counts their gradients whole
(the runtime sums them outside the flat buckets at every zero stage) and their AllReduce buffer
only when every copy is in the stage."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import runtime_workloads as rw
from builders import make_cluster, make_profile
from dapple import api
from dapple.core.layer_profile import LayerProfile
from dapple.core.parallelism import Parallelism
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.memory import (
    device_state_bytes,
    gradients_in_flight_bytes,
    parameter_state_bytes,
    tied_bytes,
    zero2_bucket_bytes,
    zero2_in_flight_bytes,
)
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import ValidationError
from dapple.profiler.measure import profile_workload

P = 10**6
"""Parameter bytes of each layer of the test profile."""


def _par(replicas: int, zero_stage: int = 0) -> Parallelism:
    return Parallelism(replicas=replicas, zero_stage=zero_stage)


def _tied_profile(
    n: int = 4, tied: tuple[int, int] = (0, 3), precision: str = "fp32"
) -> ModelProfile:
    """``make_profile``'s chain of ``n`` layers of ``P`` bytes, layers ``tied`` sharing one
    weight of all their bytes (GPT-2's embedding and LM head)."""
    base = make_profile(n=n, params=P)
    a, b = tied
    layers = list(base.layers)
    layers[a] = dataclasses.replace(layers[a], tied_parameter_bytes=P, tied_layers=(b,))
    layers[b] = dataclasses.replace(layers[b], tied_parameter_bytes=P, tied_layers=(a,))
    return dataclasses.replace(base, layers=tuple(layers), precision=precision)


def test_profiler_records_tied_copies_and_the_layers_holding_the_others() -> None:
    prof = profile_workload(rw.tied_mlp(), [2], warmup=0, repeats=1)
    weight = rw.HID * rw.HID * 4
    assert [x.tied_parameter_bytes for x in prof.layers] == [0, weight, weight, 0]
    assert [x.tied_layers for x in prof.layers] == [(), (2,), (1,), ()]
    assert prof.layers[1].parameter_bytes == weight + rw.HID * 4  # the bias is its own
    again = ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.layers == prof.layers


def test_profiler_finds_gpt2s_embedding_and_lm_head() -> None:
    wl = api.load("dapple.models.hf:gpt2", layers=2, hidden=32, heads=2, vocab=64, seq=16)
    prof = profile_workload(wl, [2], warmup=0, repeats=1)
    first, last = 0, prof.num_layers - 1
    assert prof.layers[first].tied_parameter_bytes == 64 * 32 * 4  # wte (vocab x hidden)
    assert prof.layers[first].tied_layers == (last,)
    assert prof.layers[last].tied_layers == (first,)
    assert all(x.tied_parameter_bytes == 0 for x in prof.layers[first + 1 : last])


def test_a_profile_without_tied_fields_reads_as_untied_and_bad_ones_are_named() -> None:
    d = make_profile().to_dict()
    assert "tied_parameter_bytes" not in d["layers"][0]
    assert all(x.tied_parameter_bytes == 0 for x in ModelProfile.from_dict(d).layers)
    layer = make_profile(params=100).layers[0]
    with pytest.raises(
        ValidationError, match=r"tied_parameter_bytes .*\[0, parameter_bytes = 100\], got 101"
    ):
        dataclasses.replace(layer, tied_parameter_bytes=101, tied_layers=(1,))
    with pytest.raises(ValidationError, match="given exactly when"):
        dataclasses.replace(layer, tied_parameter_bytes=50)
    with pytest.raises(ValidationError, match="given exactly when"):
        dataclasses.replace(layer, tied_layers=(2,))
    for bad in ((0,), (9,)):  # itself; past the last layer
        with pytest.raises(
            ValidationError, match=r"layer 0 .* each must be another of its 6 layers"
        ):
            tied = dataclasses.replace(layer, tied_parameter_bytes=50, tied_layers=bad)
            ModelProfile(model_name="m", layers=(tied, *make_profile().layers[1:]))


def test_tied_bytes_split_by_where_the_other_copies_are() -> None:
    prof = _tied_profile()
    assert tied_bytes(prof, (0, 4)) == (2 * P, 0)  # both copies in the stage
    assert tied_bytes(prof, (0, 2)) == (0, P)
    assert tied_bytes(prof, (1, 3)) == (0, 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tied_copies_keep_whole_gradients_in_the_memory_model(precision: str) -> None:
    """Bytes per parameter byte, Adam (gradient + two moments): parameters 1, gradient 1, moments 2,
    autocast's weight cast 0.5 in bf16; the AllReduce buffer 1 on a replicated stage. Every
    stage also holds the largest layer's gradient as autograd produces it (P here)."""
    prof = _tied_profile(precision=precision)
    untied = dataclasses.replace(prof, layers=make_profile(n=4, params=P).layers)
    c = 0.5 if precision == "bf16" else 0.0
    # one replica: a tied copy is any parameter
    assert parameter_state_bytes(prof, (0, 4)) == pytest.approx(4 * P * (4 + c) + P)
    # DP x4, every copy in the stage: AllReduce buffers for all; ZeRO shards only the moments
    # of the tied copies and keeps their gradient whole
    assert parameter_state_bytes(prof, (0, 4), _par(4)) == pytest.approx(4 * P * (5 + c) + P)
    tied_z = 1 + 1 + 2 / 4 + c + 1
    assert parameter_state_bytes(prof, (0, 4), _par(4, 1)) == pytest.approx(
        2 * P * (1 + 1 + 3 / 4 + c) + 2 * P * tied_z + P
    )
    assert parameter_state_bytes(prof, (0, 4), _par(4, 2)) == pytest.approx(
        2 * P * (1 + 3 / 4 + c) + 2 * P * tied_z + 2 * 2 * P + P
    )  # in flight: the 2 untied layers' bucket and its staging copy, and a tied gradient
    # 2:2, the other copy in the other stage: summed across the stages outside any bucket
    assert parameter_state_bytes(prof, (0, 2), _par(2)) == pytest.approx(
        P * (5 + c) + P * (4 + c) + P
    )
    assert parameter_state_bytes(prof, (0, 2), _par(2, 2)) == pytest.approx(
        P * (1 + 3 / 2 + c) + P * (1 + 1 + 2 / 2 + c) + 2 * P + P
    )  # in flight: its 1 untied layer's bucket and staging copy, and the tied gradient
    # against the same chain untied, ZeRO-2 holds the tied gradient's (1 - 1/r) more, and in
    # flight one layer's gradient and staging copy less but the tied gradient more
    gap = parameter_state_bytes(prof, (0, 2), _par(2, 2)) - parameter_state_bytes(
        untied, (0, 2), _par(2, 2)
    )
    assert gap == pytest.approx(P * (1 - 1 / 2) - P)


def test_gradients_in_flight_count_every_layer_and_buckets_only_untied_ones() -> None:
    prof = _tied_profile(n=3, tied=(0, 2))
    big = dataclasses.replace(prof.layers[0], parameter_bytes=5 * P, tied_parameter_bytes=P)
    prof = dataclasses.replace(prof, layers=(big, *prof.layers[1:]))
    # one bucket of layer 1's P and layer 0's untied 4 P; layer 2 is all tied
    assert zero2_bucket_bytes(prof, (0, 3), _par(2, 2)) == [5 * P]
    assert zero2_bucket_bytes(prof, (2, 3), _par(2, 2)) == []
    # the bucket's gradients and staging copy, and a tied gradient as autograd produces it
    # before adding it to the accumulated one
    assert zero2_in_flight_bytes(prof, (0, 3), _par(2, 2)) == 2 * 5 * P + P
    assert zero2_in_flight_bytes(prof, (0, 2), _par(2, 2)) == 2 * 5 * P + P
    assert zero2_in_flight_bytes(prof, (1, 3), _par(2, 2)) == 2 * P + P
    assert gradients_in_flight_bytes(prof, (0, 3), _par(2)) == 5 * P
    assert gradients_in_flight_bytes(prof, (0, 3), _par(2, 2)) == 2 * 5 * P + P
    assert gradients_in_flight_bytes(prof, (2, 3), _par(2, 2)) == P


def test_plan_and_simulator_memory_count_tied_gradients_whole() -> None:
    from dapple.simulate import simulate

    prof, untied = _tied_profile(n=6, tied=(0, 5)), make_profile(n=6, params=P)
    cluster = make_cluster()
    plan = straight_plan(6, [0, 3], global_batch_size=8, num_micro_batches=2, replicas=[2, 2])
    plan = dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(st, zero_stage=2) for st in plan.stages)
    )

    def compute(p: ModelProfile) -> list[float]:
        rows = pipeline_latency(plan, p, cluster).stages
        return [r.memory_bytes for r in rows if r.kind == "compute"]

    # each stage's tied copy keeps its gradient whole (+ P - P / 2) and its fresh gradient in
    # flight (+ P), outside the one bucket, which is P smaller: its gradients and staging copy
    # (- 2 P)
    assert [a - b for a, b in zip(compute(prof), compute(untied), strict=True)] == pytest.approx(
        [-P / 2, -P / 2]
    )
    static = {d.device: d.static_memory_bytes for d in simulate(plan, prof, cluster).devices}
    assert static[0] == pytest.approx(device_state_bytes(prof, [plan.stages[0]]))
    assert static[0] - device_state_bytes(untied, [plan.stages[0]]) == pytest.approx(-P / 2)


def test_layer_at_length_keeps_the_tied_fields() -> None:
    from dapple.cost.at_length import layer_at_length

    layer = _tied_profile().layers[0]
    mid = layer_at_length([8.0, 16.0], [layer, layer], 12.0)
    assert (mid.tied_parameter_bytes, mid.tied_layers) == (P, (3,))
    assert isinstance(mid, LayerProfile)
    cast = dataclasses.replace(layer, cast_parameter_bytes=P // 2)  # autocast's part
    assert layer_at_length([8.0, 16.0], [cast, cast], 12.0).cast_parameter_bytes == P // 2


def test_cli_profile_shows_and_saves_the_tied_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dapple.cli import main

    out = tmp_path / "gpt2.json"
    args = ["--set", "layers=2", "--set", "hidden=32", "--set", "heads=2", "--set", "vocab=64"]
    rc = main(["profile", "--model", "dapple.models.hf:gpt2", *args, "--set", "seq=16",
               "--batch-sizes", "2", "--repeats", "1", "--warmup", "0", "-o", str(out)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tied" in printed  # the column of the layers holding the other copies
    prof = ModelProfile.load(out)
    assert [x.tied_layers for x in prof.layers] == [(3,), (), (), (0,)]

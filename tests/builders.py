"""Small pure-data builders shared by the tests: layer chains and test clusters."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest

from dapple.core.cluster import Cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile


def make_profile(
    n: int = 6,
    fwd: float = 1.0,
    bwd: float = 2.0,
    act: float = 1000.0,
    params: int = 4000,
    name: str = "toy",
) -> ModelProfile:
    """A uniform chain of ``n`` layers with per-sample times ``fwd``/``bwd`` ms."""
    return ModelProfile(
        model_name=name,
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward=AffineTime(fixed_ms=0.0, per_sample_ms=fwd),
                backward=AffineTime(fixed_ms=0.0, per_sample_ms=bwd),
                output_bytes_per_sample=act,
                parameter_bytes=params,
                kept_activation_bytes_per_sample=act,
            )
            for i in range(n)
        ),
        batch_sizes=(1, 2, 4),
    )


def make_cluster(servers: int = 1, per_server: int = 4, gbps: float = 100.0) -> Cluster:
    return Cluster(
        name="test",
        servers=servers,
        devices_per_server=per_server,
        device_memory_bytes=16 * 1024**3,
        intra_server_bandwidth_gbps=gbps,
        inter_server_bandwidth_gbps=gbps / 4,
    )


def link_cluster(
    name: str, servers: int, per_server: int, memory_gib: float, gib: int = 2**30
) -> Cluster:
    """8 Gbit/s = 1e6 bytes per ms inside a server, a quarter of it between servers, 0.01 ms
    latency: links slow enough that tensor and data parallel traffic matter."""
    return Cluster(
        name=name,
        servers=servers,
        devices_per_server=per_server,
        device_memory_bytes=int(memory_gib * gib),
        intra_server_bandwidth_gbps=8.0,
        inter_server_bandwidth_gbps=2.0,
        intra_server_latency_ms=0.01,
        inter_server_latency_ms=0.01,
    )


def llm_layer(name: str, tp: bool, params_gib: float, fwd: float = 4.0) -> LayerProfile:
    """One layer of a hand-made LLM chain: ``fwd`` ms per sample forward, twice that backward,
    ``params_gib`` of parameters, 0.5 GB kept per sample; ``tp``: it shards over a tensor
    group."""
    return LayerProfile(
        name=name,
        forward=AffineTime(fixed_ms=0.1, per_sample_ms=fwd),
        backward=AffineTime(fixed_ms=0.2, per_sample_ms=2 * fwd),
        output_bytes_per_sample=2e5,
        parameter_bytes=int(params_gib * 2**30),
        kept_activation_bytes_per_sample=5e8,
        tensor_parallel=tp,
    )


NO_COMM = Cluster(
    name="no-comm",
    servers=1,
    devices_per_server=16,
    device_memory_bytes=2**40,
    intra_server_bandwidth_gbps=1e12,
    inter_server_bandwidth_gbps=1e12,
    intra_server_latency_ms=0.0,
    inter_server_latency_ms=0.0,
)
"""16 devices with free communication: step times are compute alone."""


def per_call_profile(
    fwd: list[float], bwd: list[float], params: int = 0, act: float = 1.0
) -> ModelProfile:
    """Layers with per-call times (``fixed_ms``, the same on any batch), zero-byte boundaries."""
    return ModelProfile(
        model_name="p",
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward=AffineTime(fixed_ms=f, per_sample_ms=0.0),
                backward=AffineTime(fixed_ms=b, per_sample_ms=0.0),
                output_bytes_per_sample=0.0,
                parameter_bytes=params,
                kept_activation_bytes_per_sample=act,
            )
            for i, (f, b) in enumerate(zip(fwd, bwd, strict=True))
        ),
    )


def with_in_flight(plan: Plan, D: Sequence[int | None]) -> Plan:
    """``plan`` with stage i's in-flight bound ``max_in_flight`` set to ``D[i]``."""
    stages = tuple(
        dataclasses.replace(st, max_in_flight=d) for st, d in zip(plan.stages, D, strict=True)
    )
    return dataclasses.replace(plan, stages=stages)


def plan_file(tmp_path: Path, devices: int = 2) -> str:
    """``tmp_path/plan.json``: 4 layers in ``devices`` (1, 2 or 4) single stages, B = 4 in
    M = 2 micro-batches (a zoo transformer of ``layers=2``)."""
    path = tmp_path / "plan.json"
    straight_plan(4, list(range(0, 4, 4 // devices)), global_batch_size=4,
                  num_micro_batches=2).save(path)  # fmt: skip
    return str(path)


def boom(*_: Any, **__: Any) -> NoReturn:
    """Stands in for work that must not start: a refused input never reaches it."""
    raise AssertionError("work started although the input should have been refused")


def one_error_line(capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    """The captured stderr: exactly one ``dapple: error:`` line holding every needle."""
    err = capsys.readouterr().err
    assert err.startswith("dapple: error: ") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err

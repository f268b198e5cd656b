"""Small pure-data builders shared by the tests: a uniform layer chain and a test cluster."""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.profile import AffineTime, LayerProfile, ModelProfile


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

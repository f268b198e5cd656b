"""Named clusters and ``--cluster SPEC``: the paper's table 2 configurations, modern servers,
and the resolution of a spec (a preset name or a JSON/TOML cluster file) to a
:class:`~dapple.core.cluster.Cluster`.

Pure data, no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dapple.core._json import load_json_file, require
from dapple.core.cluster import GIB, Cluster
from dapple.core.device_kinds import DATASHEET_TFLOPS, DeviceKind
from dapple.errors import ValidationError
from dapple.files.text_file import read_text_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["PRESETS", "describe_presets", "load_cluster"]

_V100 = 16 * GIB
PRESETS: dict[str, Cluster] = {
    # Paper table 2, config A: servers of 8 V100 (16 GiB) with NVLink (~130 GB/s), 25 Gbps
    # Ethernet.
    "paper-a": Cluster(
        name="paper-a",
        servers=2,
        devices_per_server=8,
        device_memory_bytes=_V100,
        intra_server_bandwidth_gbps=130 * 8,
        inter_server_bandwidth_gbps=25,
        device_name="V100",
    ),
    # Config B: 16 servers with one V100 each, 25 Gbps Ethernet.
    "paper-b": Cluster(
        name="paper-b",
        servers=16,
        devices_per_server=1,
        device_memory_bytes=_V100,
        intra_server_bandwidth_gbps=130 * 8,
        inter_server_bandwidth_gbps=25,
        device_name="V100",
    ),
    # Config C: as B with 10 Gbps Ethernet.
    "paper-c": Cluster(
        name="paper-c",
        servers=16,
        devices_per_server=1,
        device_memory_bytes=_V100,
        intra_server_bandwidth_gbps=130 * 8,
        inter_server_bandwidth_gbps=10,
        device_name="V100",
    ),
    # A modern server: 8 H100 (80 GiB) with NVLink 4 (~450 GB/s per direction), 400 Gbps between
    # servers.
    "h100-8x": Cluster(
        name="h100-8x",
        servers=1,
        devices_per_server=8,
        device_memory_bytes=80 * GIB,
        intra_server_bandwidth_gbps=450 * 8,
        inter_server_bandwidth_gbps=400,
        intra_server_latency_ms=0.003,
        inter_server_latency_ms=0.01,
        device_name="H100",
    ),
    # The same server with H200s: 141 GB (HBM3e) each, the same NVLink 4 and 400 Gbps; its
    # analytic profile is `analytic_profile(..., "h200")` (benchmarks/gpu_fit.md).
    "h200-8x": Cluster(
        name="h200-8x",
        servers=1,
        devices_per_server=8,
        device_memory_bytes=141 * 10**9,
        intra_server_bandwidth_gbps=450 * 8,
        inter_server_bandwidth_gbps=400,
        intra_server_latency_ms=0.003,
        inter_server_latency_ms=0.01,
        device_name="H200",
    ),
    # A mixed cluster (issue #43): a server of 8 H100 (80 GiB) and one of 8 A100 40GB, the A100
    # at its datasheet speed (312 / 989.4 dense 16-bit TFLOP/s) of the H100 a profile is made on;
    # NVLink 3 (~300 GB/s per direction, the slower server's), 400 Gbps between servers.
    "mixed-h100-a100": Cluster(
        name="mixed-h100-a100",
        servers=2,
        devices_per_server=8,
        device_memory_bytes=40 * GIB,
        intra_server_bandwidth_gbps=300 * 8,
        inter_server_bandwidth_gbps=400,
        intra_server_latency_ms=0.003,
        inter_server_latency_ms=0.01,
        device_name="H100+A100",
        kinds=(
            DeviceKind(name="H100", servers=1, speed=1.0, device_memory_bytes=80 * GIB),
            DeviceKind(
                name="A100-40GB",
                servers=1,
                speed=DATASHEET_TFLOPS["a100"] / DATASHEET_TFLOPS["h100"],
                device_memory_bytes=40 * GIB,
            ),
        ),
    ),
    # One CPU machine running several local processes over gloo (loopback), 4 GiB each; a rough default,
    # replace with `dapple calibrate` output for real numbers.
    "local-cpu": Cluster(
        name="local-cpu",
        servers=1,
        devices_per_server=4,
        device_memory_bytes=4 * GIB,
        intra_server_bandwidth_gbps=20,
        inter_server_bandwidth_gbps=20,
        intra_server_latency_ms=0.05,
        inter_server_latency_ms=0.05,
        device_name="cpu-process",
    ),
}


def load_cluster(spec: str, servers: int | None = None) -> Cluster:
    """A preset name or a JSON/TOML file path, optionally with another number of servers.

    Raises:
        ValidationError: unknown preset, unreadable or invalid file.
    """
    if spec in PRESETS:
        c = PRESETS[spec]
    else:
        p = Path(spec)
        if not p.exists():
            raise ValidationError(
                f"unknown cluster {spec!r}: not a preset ({', '.join(sorted(PRESETS))}) nor an existing file"
            )
        if p.suffix == ".toml":
            text = read_text_file(p, "cluster file")
            try:
                data = tomllib.loads(text)
            except tomllib.TOMLDecodeError as e:
                raise ValidationError(f"cluster file {spec!r} is not valid TOML: {e}") from None
            except RecursionError:
                raise ValidationError(f"cluster file {spec!r} is nested too deeply") from None
        else:
            data = load_json_file(p, "cluster")
        c = Cluster.from_dict(data, name=p.stem)
    if servers is not None:
        require(servers >= 1, f"--servers must be >= 1, got {servers}")
        c = c.with_servers(servers)
    return c


def describe_presets() -> str:
    """The presets as ``name (servers x devices per server, memory per device)``, for help."""
    return ", ".join(
        f"{name} ({c.servers} x {c.devices_per_server} devices of "
        f"{c.device_memory_bytes / 2**30:g} GiB)"
        for name, c in PRESETS.items()
    )

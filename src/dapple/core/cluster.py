"""Cluster topology: servers x devices, intra/inter-server links, device memory.

Pure data model, no torch. Device ``d`` lives on server ``d // devices_per_server``. A mixed
cluster lists device ``kinds`` (:mod:`dapple.core.device_kinds`), each a run of servers with its
own compute speed and memory. Bandwidths are in gigabits per second (Gbps) as network gear is rated; latencies in ms; device
memory in bytes, written to cluster files in GiB (``device_memory_gib``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapple.core._json import check_schema_version, get_field, require, save_json_file
from dapple.core.device_kinds import DeviceKind, check_cluster_kinds, kinds_from_dicts, layerwise

__all__ = ["CLUSTER_SCHEMA_VERSION", "GIB", "Cluster"]

CLUSTER_SCHEMA_VERSION = 1
GIB = 1024**3
"""Bytes in a gibibyte (GiB); cluster files give device memory in GiB."""

_MEMORY_KEYS = ("device_memory_bytes", "device_memory_gib", "device_memory_gb")
"""Ways a cluster file may give device memory: bytes, GiB, or ``device_memory_gb``, the
key of older files, which held GiB too."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """G = servers * devices_per_server devices connected hierarchically."""

    name: str = "custom"
    """Preset or file name, for reports."""
    servers: int
    """Number of servers (machines)."""
    devices_per_server: int
    """Devices (GPUs or processes) per server, N_s in the paper's table 2."""
    device_memory_bytes: int
    """Memory of one device in bytes."""
    reserved_memory_bytes: int = 0
    """Memory of each device the runtime itself takes besides the stage it runs: process-group
    buffers, threads, allocator slack, a CUDA context. The planner fits a stage's parameters,
    gradients, optimizer state and activations into :attr:`usable_memory_bytes`."""
    intra_server_bandwidth_gbps: float
    """Device-to-device bandwidth inside a server (NVLink, PCIe, shared memory), Gbps."""
    inter_server_bandwidth_gbps: float
    """Bandwidth between servers (Ethernet/InfiniBand), Gbps."""
    intra_server_latency_ms: float = 0.005
    """Per-message latency inside a server, ms."""
    inter_server_latency_ms: float = 0.02
    """Per-message latency between servers, ms."""
    compute_slowdown: float = 1.0
    """Factor applied to every profiled compute time: how much slower one device computes than
    the profile measured when it runs *alone* (e.g. a CPU worker with fewer intra-op threads
    than the profile used); 1.0 for dedicated devices and for a profile taken at the workers'
    thread count. With ``compute_cores_per_server = None`` it is the only sharing term, so old
    calibrations put the all-busy slowdown here."""
    compute_cores_per_server: float | None = None
    """Shared compute capacity: the devices of one server share this many compute units, in
    full-speed devices (for local CPU workers: cores / intra-op threads per worker). When k
    devices of a server compute at once each progresses at rate ``min(1, c / k)`` (processor
    sharing, on top of ``compute_slowdown``; see :meth:`compute_rate`). None: dedicated
    devices (GPUs), never shared."""
    background_load_per_server: float = 0.0
    """E: runnable work of *other* programs competing for a server's compute units, in device
    units (only with ``compute_cores_per_server``): k devices computing at once then each get
    ``min(1, c / (k + E))`` of a unit, relative to ``min(1, c / (1 + E))`` for one alone."""
    lone_wall_per_cpu: float = 1.0
    """W: wall ms per CPU ms of one device computing alone on a server, other programs' load
    included. It converts what was timed in CPU time - the layers of a CPU-clock profile
    (``ModelProfile.clock``) and the host terms below - to a lone device's wall time
    (:func:`dapple.cost.cpu_clock.on_wall_clock`); :meth:`compute_rate` is relative to that
    lone device. 1.0 (at least): dedicated devices, or CPU cores no other program uses.
    Measured by ``dapple calibrate`` (a lone worker's matmul in both clocks)."""
    action_overhead_ms: float = 0.0
    """Host CPU time the runtime spends per program action (F, B, SEND, RECV) beyond the
    profiled layer time: Python, autograd bookkeeping, posting a message. It competes for the
    server's compute units like F/B (shared-core CPU hosts); 0 for devices whose host work
    overlaps device compute (GPUs). Measured by ``dapple calibrate``."""
    step_overhead_ms: float = 0.0
    """Host CPU time per device per step outside its actions: optimizer step, the non-finite
    check and step collective, building the batch. Same sharing and measurement as
    ``action_overhead_ms``."""
    comm_cpu_ms_per_mb: float = 0.0
    """Host CPU time per MiB a device sends or receives (copies through host memory and
    sockets, gloo), for point-to-point transfers and the bytes it moves in a ring AllReduce.
    Same sharing and measurement as ``action_overhead_ms``."""
    device_name: str = "device"
    """Kind of device, for reports."""
    kinds: tuple[DeviceKind, ...] = ()
    """Device kinds of a mixed cluster, in server order, their servers summing to ``servers``;
    ``device_memory_bytes`` is then the smallest kind's. Empty: every device alike, speed 1."""
    schema_version: int = CLUSTER_SCHEMA_VERSION

    def __post_init__(self) -> None:
        for f in ("servers", "devices_per_server"):
            v = getattr(self, f)
            require(
                isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                f"cluster {self.name!r}: {f} must be an integer >= 1, got {v!r}",
            )
        require(
            isinstance(self.device_memory_bytes, int) and self.device_memory_bytes > 0,
            f"cluster {self.name!r}: device memory must be an integer > 0 bytes, got {self.device_memory_bytes!r}",
        )
        r = self.reserved_memory_bytes
        require(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.device_memory_bytes,
            f"cluster {self.name!r}: reserved memory must be an integer >= 0 bytes and below the "
            f"device memory {self.device_memory_bytes}, got {r!r}",
        )
        for f in ("intra_server_bandwidth_gbps", "inter_server_bandwidth_gbps", "compute_slowdown"):
            v = getattr(self, f)
            require(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0,
                f"cluster {self.name!r}: {f} must be a number > 0, got {v!r}",
            )
        for f in ("intra_server_latency_ms", "inter_server_latency_ms"):
            v = getattr(self, f)
            require(
                isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                f"cluster {self.name!r}: {f} must be a number >= 0, got {v!r}",
            )
        for f in ("action_overhead_ms", "step_overhead_ms", "comm_cpu_ms_per_mb"):
            v = getattr(self, f)
            require(
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and math.isfinite(v)
                and v >= 0,
                f"cluster {self.name!r}: {f} must be a number >= 0, got {v!r}",
            )
        e = self.background_load_per_server
        require(
            isinstance(e, (int, float)) and not isinstance(e, bool) and math.isfinite(e) and e >= 0,
            f"cluster {self.name!r}: background_load_per_server must be a number >= 0, got {e!r}",
        )
        w = self.lone_wall_per_cpu
        require(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 1,
            f"cluster {self.name!r}: lone_wall_per_cpu must be a number >= 1, got {w!r}",
        )
        c = self.compute_cores_per_server
        require(
            c is None
            or (
                isinstance(c, (int, float))
                and not isinstance(c, bool)
                and math.isfinite(c)
                and c > 0
            ),
            f"cluster {self.name!r}: compute_cores_per_server must be None or a number > 0, got {c!r}",
        )
        if self.kinds:  # a list from a caller, kept hashable
            object.__setattr__(self, "kinds", tuple(self.kinds))
            check_cluster_kinds(self.kinds, self.servers, self.device_memory_bytes,
                                self.reserved_memory_bytes, self.name)  # fmt: skip

    @property
    def host_overheads(self) -> bool:
        """Whether any host CPU overhead term (``action_overhead_ms``, ``step_overhead_ms``,
        ``comm_cpu_ms_per_mb``) is set."""
        return bool(self.action_overhead_ms or self.step_overhead_ms or self.comm_cpu_ms_per_mb)

    def compute_rate(self, busy: float) -> float:
        """Speed of each of ``busy`` devices of one server computing at once, relative to one
        device computing alone (processor sharing; 1.0 for dedicated devices).

        ``min(1, c / (k + E)) / min(1, c / (1 + E))`` with c = ``compute_cores_per_server``,
        E = ``background_load_per_server``, k = ``max(1, busy)``; ``min(1, c / k)`` when E = 0
        and c >= 1. Fractional ``busy`` (a mean concurrency) is allowed.
        """
        c = self.compute_cores_per_server
        if c is None:
            return 1.0
        e = self.background_load_per_server
        return min(1.0, c / (max(1.0, busy) + e)) / min(1.0, c / (1.0 + e))

    def kind_of(self, device: int) -> DeviceKind | None:
        """The kind of device id ``device`` (None on a cluster without kinds)."""
        server = self.server_of(device)
        for k in self.kinds:
            if server < k.servers:
                return k
            server -= k.servers
        return None

    def speed_of(self, device: int) -> float:
        """Compute speed of device id ``device`` relative to the profile's device (1.0 on a
        cluster without kinds); its compute takes ``1 / speed`` of the profiled time."""
        k = self.kind_of(device)
        return 1.0 if k is None else k.speed

    def usable_memory_of(self, device: int) -> int:
        """Memory a stage may fill on device id ``device``: its kind's less the reserved."""
        k = self.kind_of(device)
        memory = self.device_memory_bytes if k is None else k.device_memory_bytes
        return memory - self.reserved_memory_bytes

    @property
    def mixed(self) -> bool:
        """Whether the devices differ in speed or memory, or compute at two or more kinds' own
        profiles."""
        own = sum(k.profile is not None for k in self.kinds)
        return own > 1 or len({(k.speed, k.device_memory_bytes) for k in self.kinds}) > 1

    def slowest_kind(self) -> Cluster:
        """The cluster as users without device kinds plan it: every device as slow as the
        slowest kind and with the smallest kind's memory (itself when it has no kinds).

        Kinds scaled by a speed: no kinds, ``compute_slowdown`` divided by the lowest speed.
        Kinds with their own profiles (:mod:`dapple.core.kind_profiles`): one kind over every
        server whose profile takes each layer at its slowest kind's fixed and per-sample times
        (:func:`~dapple.core.device_kinds.layerwise`), so every device computes at it whatever
        profile the cluster is planned with.
        """
        if not self.kinds:
            return self
        name = f"{self.name} (as its slowest kind)"
        own = [k.profile for k in self.kinds if k.profile is not None]
        if own:
            slowest = DeviceKind(
                name=f"slowest of {'+'.join(k.name for k in self.kinds)}",
                servers=self.servers,
                device_memory_bytes=self.device_memory_bytes,
                profile=layerwise(own[0], own, max),
            )
            return dataclasses.replace(self, name=name, kinds=(slowest,))
        low = min(k.speed for k in self.kinds)
        return dataclasses.replace(
            self, name=name, kinds=(), compute_slowdown=self.compute_slowdown / low
        )

    @property
    def num_devices(self) -> int:
        """G, the total number of devices."""
        return self.servers * self.devices_per_server

    def server_of(self, device: int) -> int:
        """Server index of device id ``device``."""
        return device // self.devices_per_server

    def same_server(self, a: int, b: int) -> bool:
        return self.server_of(a) == self.server_of(b)

    def bandwidth_bytes_per_ms(self, a: int, b: int) -> float:
        """Link bandwidth between devices ``a`` and ``b`` in bytes per millisecond."""
        gbps = (
            self.intra_server_bandwidth_gbps
            if self.same_server(a, b)
            else self.inter_server_bandwidth_gbps
        )
        return gbps * 1e9 / 8 / 1e3

    def latency_ms(self, a: int, b: int) -> float:
        return (
            self.intra_server_latency_ms if self.same_server(a, b) else self.inter_server_latency_ms
        )

    @property
    def usable_memory_bytes(self) -> int:
        """Device memory a stage may fill: ``device_memory_bytes - reserved_memory_bytes``."""
        return self.device_memory_bytes - self.reserved_memory_bytes

    def with_servers(self, servers: int) -> Cluster:
        """The same cluster with another number of servers (the ``--servers`` override).

        Raises:
            ValidationError: a cluster with device kinds (their servers are counted per kind).
        """
        require(
            not self.kinds,
            f"cluster {self.name!r} has device kinds "
            f"({', '.join(f'{k.name}: {k.servers} servers' for k in self.kinds)}): change their "
            f"servers in the file, not with --servers {servers}",
        )
        return dataclasses.replace(self, servers=servers, name=f"{self.name} ({servers} servers)")

    def without_servers(self, lost: Iterable[int]) -> Cluster:
        """The cluster less the servers ``lost`` (their indices), its devices numbered again
        from 0; on a cluster with device kinds each kind keeps its other servers, in order
        (a kind left with none is dropped), and the device memory is the smallest kept kind's.

        Raises:
            ValidationError: an index that is no server of the cluster, or no server left.
        """
        gone = set(lost)
        bad = sorted(s for s in gone if not (isinstance(s, int) and 0 <= s < self.servers))
        require(not bad, f"cluster {self.name!r}: no server(s) {bad} of its {self.servers}")
        require(
            len(gone) < self.servers,
            f"cluster {self.name!r}: no server left without servers {sorted(gone)}",
        )
        kinds: list[DeviceKind] = []
        first = 0
        for k in self.kinds:
            kept = sum(s not in gone for s in range(first, first + k.servers))
            if kept:
                kinds.append(dataclasses.replace(k, servers=kept))
            first += k.servers
        memory = min((k.device_memory_bytes for k in kinds), default=self.device_memory_bytes)
        return dataclasses.replace(
            self, servers=self.servers - len(gone), kinds=tuple(kinds), device_memory_bytes=memory
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "name": self.name,
            "servers": self.servers,
            "devices_per_server": self.devices_per_server,
            "device_memory_gib": self.device_memory_bytes / GIB,
            "reserved_memory_gib": self.reserved_memory_bytes / GIB,
            "intra_server_bandwidth_gbps": self.intra_server_bandwidth_gbps,
            "inter_server_bandwidth_gbps": self.inter_server_bandwidth_gbps,
            "intra_server_latency_ms": self.intra_server_latency_ms,
            "inter_server_latency_ms": self.inter_server_latency_ms,
            "compute_slowdown": self.compute_slowdown,
            "compute_cores_per_server": self.compute_cores_per_server,
            "background_load_per_server": self.background_load_per_server,
            **(
                {"lone_wall_per_cpu": self.lone_wall_per_cpu} if self.lone_wall_per_cpu != 1 else {}
            ),
            "action_overhead_ms": self.action_overhead_ms,
            "step_overhead_ms": self.step_overhead_ms,
            "comm_cpu_ms_per_mb": self.comm_cpu_ms_per_mb,
            "device_name": self.device_name,
            **({"kinds": [k.to_dict() for k in self.kinds]} if self.kinds else {}),
        }

    @staticmethod
    def from_dict(d: dict[str, Any], name: str = "custom") -> Cluster:
        what = f"cluster {name!r}"
        require(isinstance(d, dict), f"{what} must be an object, got {type(d).__name__}")
        check_schema_version(d, CLUSTER_SCHEMA_VERSION, what)
        known = {f.name for f in dataclasses.fields(Cluster)} | set(_MEMORY_KEYS)
        known = (known - {"reserved_memory_bytes"}) | {"reserved_memory_gib", "profile_device"}
        unknown = sorted(set(d) - known)
        require(not unknown, f"{what}: unknown field(s) {unknown}")

        def num(key: str, default: float | None = None) -> float:
            v = d.get(key, default) if default is not None else get_field(d, key, what)
            require(
                isinstance(v, (int, float)) and not isinstance(v, bool),
                f"{what}: {key} must be a number, got {v!r}",
            )
            require(  # JSON and TOML files may spell NaN and Infinity
                math.isfinite(v), f"{what}: {key} must be a finite number, got {v!r}"
            )
            return float(v)

        def integer(key: str) -> int:
            v = get_field(d, key, what)
            require(
                isinstance(v, int) and not isinstance(v, bool),
                f"{what}: {key} must be an integer, got {v!r}",
            )
            return int(v)

        kinds = (
            kinds_from_dicts(d["kinds"], d.get("profile_device"), str(d.get("name", name)))
            if "kinds" in d
            else ()
        )
        require(
            "profile_device" not in d or bool(kinds),
            f"{what}: profile_device is read by device kinds' datasheets; the file has no kinds",
        )
        if kinds:  # servers and memory follow from the kinds unless the file repeats them
            d = {"servers": sum(k.servers for k in kinds), **d}
            if not any(k in d for k in _MEMORY_KEYS):
                d["device_memory_bytes"] = min(k.device_memory_bytes for k in kinds)
        given = [k for k in _MEMORY_KEYS if k in d]
        require(
            len(given) <= 1,
            f"{what}: give device memory once, got {', '.join(f'{k}={d[k]!r}' for k in given)}",
        )
        if given == ["device_memory_bytes"]:
            mem = _bytes(num("device_memory_bytes"), 1, "device_memory_bytes", what)
        elif given:
            mem = _bytes(num(given[0]), GIB, given[0], what)
        else:
            mem = _bytes(num("device_memory_gib"), GIB, "device_memory_gib", what)
        return Cluster(
            name=str(d.get("name", name)),
            servers=integer("servers"),
            devices_per_server=integer("devices_per_server"),
            device_memory_bytes=mem,
            reserved_memory_bytes=_bytes(
                num("reserved_memory_gib", 0.0), GIB, "reserved_memory_gib", what
            ),
            intra_server_bandwidth_gbps=num("intra_server_bandwidth_gbps"),
            inter_server_bandwidth_gbps=num("inter_server_bandwidth_gbps"),
            intra_server_latency_ms=num("intra_server_latency_ms", 0.005),
            inter_server_latency_ms=num("inter_server_latency_ms", 0.02),
            compute_slowdown=num("compute_slowdown", 1.0),
            compute_cores_per_server=(
                None
                if d.get("compute_cores_per_server") is None
                else num("compute_cores_per_server")
            ),
            background_load_per_server=num("background_load_per_server", 0.0),
            lone_wall_per_cpu=num("lone_wall_per_cpu", 1.0),
            action_overhead_ms=num("action_overhead_ms", 0.0),
            step_overhead_ms=num("step_overhead_ms", 0.0),
            comm_cpu_ms_per_mb=num("comm_cpu_ms_per_mb", 0.0),
            device_name=str(
                d.get("device_name", "+".join(k.name for k in kinds) if kinds else "device")
            ),
            kinds=kinds,
        )

    def save(self, path: str | Path) -> None:
        save_json_file(path, self.to_dict(), "cluster")


def _bytes(value: float, unit: int, key: str, what: str) -> int:
    """A memory size of a cluster file, ``value`` in units of ``unit`` bytes, in whole bytes;
    refused past 1 EiB per device (or not finite)."""
    require(
        math.isfinite(value) and value * unit <= 2**60,
        f"{what}: {key}={value!r} is more than 1 EiB per device",
    )
    return int(value * unit)

"""Clusters with device kinds (issue #43): parsing, per-device speed and memory, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapple.core.cluster import GIB, Cluster
from dapple.core.cluster_presets import PRESETS, load_cluster
from dapple.core.device_kinds import DATASHEET_MEMORY_BYTES, DATASHEET_TFLOPS, DeviceKind
from dapple.errors import ValidationError
from dapple.profiler.analytic_devices import DEVICES

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "mixed.json"


def _file(tmp_path: Path, **changes: object) -> str:
    d = json.loads(EXAMPLE.read_text())
    d.update(changes)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(d))
    return str(p)


def test_example_file_has_two_kinds_by_server() -> None:
    c = load_cluster(str(EXAMPLE))
    assert [k.name for k in c.kinds] == ["H100", "A100-40GB"]
    assert c.servers == 2 and c.num_devices == 16 and c.mixed
    assert c.device_memory_bytes == 40 * GIB  # the smallest kind's
    assert [c.speed_of(d) for d in (0, 7)] == [1.0, 1.0]
    assert c.speed_of(8) == pytest.approx(312 / 989.4) == c.speed_of(15)
    assert c.usable_memory_of(0) == 80 * GIB and c.usable_memory_of(8) == 40 * GIB
    assert c.kind_of(9) is c.kinds[1]


def test_round_trip_and_preset() -> None:
    for c in (load_cluster(str(EXAMPLE)), PRESETS["mixed-h100-a100"]):
        assert Cluster.from_dict(c.to_dict()) == c
    assert PRESETS["mixed-h100-a100"].kinds == load_cluster(str(EXAMPLE)).kinds


def test_homogeneous_cluster_has_speed_one() -> None:
    c = PRESETS["paper-a"]
    assert not c.kinds and not c.mixed and c.kind_of(3) is None
    assert c.speed_of(15) == 1.0 and c.usable_memory_of(15) == c.usable_memory_bytes
    assert c.slowest_kind() is c


def test_slowest_kind_view() -> None:
    c = load_cluster(str(EXAMPLE))
    v = c.slowest_kind()
    assert not v.kinds and v.num_devices == 16
    assert v.compute_slowdown == pytest.approx(989.4 / 312)
    assert v.usable_memory_bytes == 40 * GIB


def test_datasheets_agree_with_the_analytic_profiler() -> None:
    for name, tflops in DATASHEET_TFLOPS.items():
        spec = DEVICES[name]
        assert tflops * 1e12 == pytest.approx(spec.matmul_peak(spec.default_precision))
        assert DATASHEET_MEMORY_BYTES[name] == spec.memory_bytes


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kinds": []}, "non-empty list"),
        ({"kinds": [{"name": "X", "servers": 1, "datasheet": "b200"}]}, "unknown datasheet 'b200'"),
        ({"profile_device": "tpu"}, "unknown profile_device 'tpu'"),
        ({"profile_device": None}, "name it as the cluster's profile_device"),
        ({"kinds": [{"name": "X", "servers": 1, "speed": 0.5}]}, "missing device_memory_gib"),
        ({"kinds": [{"servers": 1, "speed": -1, "device_memory_gib": 8}]}, "speed must be"),
        (
            {"kinds": [{"name": "X", "servers": 1, "speed": 1, "datasheet": "a100"}]},
            "speed or datasheet, not both",
        ),
        ({"kinds": [{"name": "X", "servers": 0, "datasheet": "a100"}]}, "servers must be"),
        ({"kinds": [{"name": "X", "servers": 1, "datasheet": "a100", "gpus": 8}]}, "'gpus'"),
        (
            {"kinds": [{"name": "X", "servers": 1, "datasheet": "a100"}] * 2},
            "named twice",
        ),
        ({"servers": 3}, "hold 2 servers"),
        ({"device_memory_gib": 80}, "must be the smallest kind's, 40 GiB"),
        ({"reserved_memory_gib": 40}, "reserved memory"),
    ],
)
def test_bad_kinds_are_refused(tmp_path: Path, changes: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        load_cluster(_file(tmp_path, **changes))


def test_profile_device_without_kinds_and_servers_override(tmp_path: Path) -> None:
    d = PRESETS["paper-a"].to_dict() | {"profile_device": "h100"}
    (tmp_path / "p.json").write_text(json.dumps(d))
    with pytest.raises(ValidationError, match="has no kinds"):
        load_cluster(str(tmp_path / "p.json"))
    with pytest.raises(ValidationError, match="change their servers in the file"):
        load_cluster(str(EXAMPLE), servers=4)


def test_kind_record_checks() -> None:
    with pytest.raises(ValidationError, match="device memory must be"):
        DeviceKind(name="x", servers=1, device_memory_bytes=0)
    k = DeviceKind(name="x", servers=1, device_memory_bytes=GIB)
    with pytest.raises(ValidationError, match="hold 1 servers"):
        Cluster(
            servers=2,
            devices_per_server=1,
            device_memory_bytes=GIB,
            intra_server_bandwidth_gbps=1,
            inter_server_bandwidth_gbps=1,
            kinds=(k,),
        )

"""Pure data model: JSON round-trips and validation errors naming the offending value."""

from __future__ import annotations

import json

import pytest

from builders import make_cluster, make_profile
from dapple.core.cluster import GIB, Cluster
from dapple.core.cluster_presets import PRESETS, load_cluster
from dapple.core.layer_profile import AffineTime, fit_affine
from dapple.core.plan import Plan, StagePlan, slice_bounds, split_sizes, straight_plan, transfers
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError


def test_profile_round_trip(tmp_path):
    p = make_profile()
    p.save(tmp_path / "p.json")
    assert ModelProfile.load(tmp_path / "p.json") == p


def test_profile_rejects_newer_schema():
    d = make_profile().to_dict()
    d["schema_version"] = 99
    with pytest.raises(ValidationError, match="schema_version 99 is newer"):
        ModelProfile.from_dict(d)


def test_profile_names_bad_field():
    d = make_profile().to_dict()
    d["layers"][2]["parameter_bytes"] = -5
    with pytest.raises(ValidationError, match=r"'l2'.*parameter_bytes.*-5"):
        ModelProfile.from_dict(d)
    del d["layers"][1]["forward"]
    with pytest.raises(ValidationError, match="layer 1: missing field 'forward'"):
        ModelProfile.from_dict(d)


def test_malformed_json_file(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text("{not json")
    with pytest.raises(ValidationError, match="not valid JSON"):
        ModelProfile.load(f)


def test_fit_affine_recovers_line():
    t = fit_affine([1, 2, 4, 8], [3.0 + 0.5 * b for b in [1, 2, 4, 8]])
    assert t.fixed_ms == pytest.approx(3.0)
    assert t.per_sample_ms == pytest.approx(0.5)
    assert t.at(10) == pytest.approx(8.0)
    assert t.at(0) == 0.0


def test_fit_affine_never_negative():
    t = fit_affine([1, 2, 4], [5.0, 4.0, 3.0])
    assert t.per_sample_ms == 0.0 and t.fixed_ms == pytest.approx(4.0)
    with pytest.raises(ValidationError):
        AffineTime(fixed_ms=-1.0, per_sample_ms=0.0)


def test_cluster_round_trip_and_presets(tmp_path):
    for c in PRESETS.values():
        assert Cluster.from_dict(json.loads(json.dumps(c.to_dict())), c.name) == c
    c = make_cluster(2, 4)
    c.save(tmp_path / "c.json")
    assert load_cluster(str(tmp_path / "c.json")) == c
    assert load_cluster("paper-a").num_devices == 16
    assert load_cluster("h100-8x", servers=4).num_devices == 32


def test_cluster_toml(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(
        "servers = 2\ndevices_per_server = 2\ndevice_memory_gb = 8\n"
        "intra_server_bandwidth_gbps = 100\ninter_server_bandwidth_gbps = 10\n"
    )
    c = load_cluster(str(f))
    assert c.num_devices == 4 and c.device_memory_bytes == 8 * 1024**3


def test_cluster_memory_is_written_in_gib_and_old_gb_files_read_the_same():
    c = PRESETS["paper-a"]
    d = c.to_dict()
    assert d["device_memory_gib"] == 16.0 and "device_memory_gb" not in d
    assert c.device_memory_bytes == 16 * GIB
    old = {k: v for k, v in d.items() if k != "device_memory_gib"}
    old["device_memory_gb"] = 16.0  # the key files carried before, in GiB too
    assert Cluster.from_dict(old, c.name) == c
    in_bytes = {**old, "device_memory_bytes": 5 * GIB}
    del in_bytes["device_memory_gb"]
    assert Cluster.from_dict(in_bytes).device_memory_bytes == 5 * GIB
    with pytest.raises(
        ValidationError,
        match=r"give device memory once, got device_memory_gib=16\.0, device_memory_gb=8",
    ):
        Cluster.from_dict({**d, "device_memory_gb": 8})
    del old["device_memory_gb"]
    with pytest.raises(ValidationError, match="missing field 'device_memory_gib'"):
        Cluster.from_dict(old)


def test_cluster_toml_in_gib(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text(
        "servers = 1\ndevices_per_server = 2\ndevice_memory_gib = 1.5\n"
        "intra_server_bandwidth_gbps = 100\ninter_server_bandwidth_gbps = 10\n"
    )
    assert load_cluster(str(f)).device_memory_bytes == 3 * 2**29


def test_cluster_zero_devices():
    d = PRESETS["paper-b"].to_dict()
    d["devices_per_server"] = 0
    with pytest.raises(ValidationError, match="devices_per_server must be an integer >= 1, got 0"):
        Cluster.from_dict(d)
    with pytest.raises(ValidationError, match="unknown cluster 'nope'"):
        load_cluster("nope")


def test_plan_round_trip(tmp_path):
    p = straight_plan(6, [0, 2, 4], global_batch_size=8, num_micro_batches=4, replicas=[2, 1, 1])
    p.save(tmp_path / "plan.json")
    q = Plan.load(tmp_path / "plan.json")
    assert q.stages == p.stages and q.replication == "2:1:1" and q.split_positions == (2, 4)


def test_plan_validation_errors():
    with pytest.raises(ValidationError, match="overlap"):
        Plan(
            planner="m",
            global_batch_size=4,
            micro_batch_size=2,
            num_micro_batches=2,
            stages=(StagePlan(layers=(0, 3), devices=(0,)), StagePlan(layers=(2, 5), devices=(1,))),
        )
    with pytest.raises(ValidationError, match="device 0 is used by stage 0 and stage 1"):
        Plan(
            planner="m",
            global_batch_size=4,
            micro_batch_size=2,
            num_micro_batches=2,
            stages=(StagePlan(layers=(0, 3), devices=(0,)), StagePlan(layers=(3, 5), devices=(0,))),
        )
    with pytest.raises(ValidationError, match=r"micro_batch_size \(3\) x num_micro_batches \(2\)"):
        Plan(
            planner="m",
            global_batch_size=4,
            micro_batch_size=3,
            num_micro_batches=2,
            stages=(StagePlan(layers=(0, 3), devices=(0,)),),
        )
    p = straight_plan(6, [0, 3], global_batch_size=4, num_micro_batches=2)
    with pytest.raises(ValidationError, match="model has 7 layers"):
        p.validate_for(7)
    with pytest.raises(ValidationError, match=r"device id\(s\) \[1\]"):
        p.validate_for(6, num_devices=1)


def test_split_sizes_and_transfers():
    assert split_sizes(7, 3) == (3, 2, 2)
    assert slice_bounds(7, 3) == ((0, 3), (3, 5), (5, 7))
    assert split_sizes(2, 3) == (1, 1, 0)
    # 3 -> 2 replicas of a 7-sample micro-batch: [0,3)[3,5)[5,7) -> [0,4)[4,7)
    assert transfers(7, 3, 2) == ((0, 0, 0, 3), (1, 0, 3, 4), (1, 1, 4, 5), (2, 1, 5, 7))
    # every sample crosses exactly once
    for b in range(1, 12):
        for r1 in range(1, 5):
            for r2 in range(1, 5):
                covered = sorted(x for _, _, lo, hi in transfers(b, r1, r2) for x in range(lo, hi))
                assert covered == list(range(b))


def test_save_to_unwritable_path_is_one_clear_error(tmp_path):
    """A folder missing above the file is made; a path under a file is one clear error."""
    p = straight_plan(6, [0, 3], global_batch_size=4, num_micro_batches=2)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValidationError, match=r"cannot write plan file .*file/plan\.json"):
        p.save(blocker / "plan.json")
    with pytest.raises(ValidationError, match="cannot write profile file"):
        make_profile().save(blocker / "p.json")
    p.save(tmp_path / "missing" / "plan.json")
    assert (tmp_path / "missing" / "plan.json").is_file()

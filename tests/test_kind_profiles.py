"""Per-kind profiles on a mixed cluster (issue #43): each kind's replicas compute at their own
per-layer times in the cost model, the simulator and the planner's shares, and the planner
uses them where one scaled profile would mislead it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dapple.cli._kinds_show import shares_line
from dapple.core.cluster import GIB, Cluster
from dapple.core.device_kinds import DeviceKind
from dapple.core.kind_profiles import (
    fastest_layers,
    parse_profile_set,
    profile_of,
    with_kind_profiles,
)
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.cost.compute import stage_compute_ms
from dapple.cost.pipeline import pipeline_latency
from dapple.cost.terms import stage_terms
from dapple.errors import ValidationError
from dapple.planner import make_plan
from dapple.planner.shares import with_kind_shares
from dapple.simulate.engine import simulate


def _profile(fwd: list[float], name: str = "toy", fp: str | None = None) -> ModelProfile:
    """Layers of forward ``fwd[i]`` ms per sample and twice that backward, no fixed part."""
    return ModelProfile(
        model_name=name,
        layers=tuple(
            LayerProfile(
                name=f"l{i}",
                forward=AffineTime(fixed_ms=0.0, per_sample_ms=f),
                backward=AffineTime(fixed_ms=0.0, per_sample_ms=2 * f),
                output_bytes_per_sample=1000.0,
                parameter_bytes=4_000_000,
                kept_activation_bytes_per_sample=1000.0,
            )
            for i, f in enumerate(fwd)
        ),
        batch_sizes=(1, 2, 4),
        model_fingerprint=fp,
    )


H = _profile([1.0, 1.0, 1.0, 1.0])
A = _profile([4.0, 4.0, 1.0, 1.0])
"""The A kind: 4x slower on the compute-bound layers 0 and 1, as fast on the memory-bound 2, 3."""


def _cluster(slow_speed: float = 0.4) -> Cluster:
    kinds = (
        DeviceKind(name="H", servers=1, speed=1.0, device_memory_bytes=GIB),
        DeviceKind(name="A", servers=1, speed=slow_speed, device_memory_bytes=GIB),
    )
    return Cluster(servers=2, devices_per_server=2, device_memory_bytes=GIB,
                   intra_server_bandwidth_gbps=100, inter_server_bandwidth_gbps=100,
                   kinds=kinds)  # fmt: skip


SCALED = _cluster()
KINDS = with_kind_profiles(SCALED, {"H": H, "A": A})


def _plan(stage: StagePlan, b: int = 8) -> Plan:
    return Plan(planner="test", model_name="toy", global_batch_size=b, micro_batch_size=b,
                num_micro_batches=1, predicted_step_ms=0.0, stages=(stage,))  # fmt: skip


def test_each_kind_computes_at_its_own_times() -> None:
    """Layers [0, 2) on one H (device 0) and one A (device 2), b = 8. Per sample, F + B is
    2 x (1 + 2) = 6 ms on H and 2 x (4 + 8) = 24 ms on A. Shares (6, 2): H 6 x 2 = 12 F,
    24 B (36); A 2 x 8 = 16 F, 32 B (48): the A replica paces the stage. Shares (7, 1): H 14,
    28 (42); A 8, 16 (24): H paces it. Under the scaled profile (A at speed 0.4) A's slice of
    2 is 2 x 6 / 0.4 = 30 ms and H's 36 paces it."""
    h, a = _profile([1.0, 1.0]), _profile([4.0, 4.0])
    kinds = with_kind_profiles(SCALED, {"H": h, "A": a})
    st = StagePlan(layers=(0, 2), devices=(0, 2), shares=(6, 2))
    assert stage_compute_ms(h, kinds, st, 8) == pytest.approx((16.0, 32.0))
    assert stage_compute_ms(h, SCALED, st, 8) == pytest.approx((12.0, 24.0))
    seven = dataclasses.replace(st, shares=(7, 1))
    assert stage_compute_ms(h, kinds, seven, 8) == pytest.approx((14.0, 28.0))
    terms = stage_terms(_plan(st), h, kinds).stages[0]
    assert (terms.terms.forward_ms, terms.terms.backward_ms) == pytest.approx((16.0, 32.0))
    got = [x for r in terms.replicas for x in (r.forward_ms, r.backward_ms)]
    assert got == pytest.approx([12.0, 24.0, 16.0, 32.0])
    # the balanced shares: (7, 1) at 42 ms beats (6, 2) at 48 ms; the simulator agrees
    priced = with_kind_shares(_plan(st), h, kinds)
    assert priced.stages[0].shares == (7, 1)
    assert shares_line(priced, kinds) == (
        "shares by device speed: stage 0: 7 on 1 H (own profile), 1 on 1 A (own profile)"
    )
    assert simulate(priced, h, kinds).step_ms == pytest.approx(
        pipeline_latency(priced, h, kinds).L_ms
    )
    assert with_kind_shares(_plan(st), h, SCALED).stages[0].shares == (6, 2)


def test_per_kind_profiles_change_the_plan() -> None:
    """One profile scaled by A's speed 0.4 prices A at 2.5x on every layer: the planner gives
    the A devices only the last layer (L = simulated 74.51; all four layers on all four devices
    with A taking smaller shares reads 74.61). With A's own times (4x on layers 0, 1, 1x on
    2, 3) it pipelines layers 0, 1 on the H devices and 2, 3 on the A devices, and that plan is
    faster on the cluster as it is."""
    scaled = make_plan(H, SCALED, 16)
    own = make_plan(H, KINDS, 16)
    assert [(s.layers, s.devices) for s in scaled.stages] == [((0, 3), (0, 1)), ((3, 4), (2, 3))]
    assert [(s.layers, s.devices) for s in own.stages] == [((0, 2), (0, 1)), ((2, 4), (2, 3))]
    truth = pipeline_latency(scaled, H, KINDS).L_ms
    assert own.predicted_step_ms == pytest.approx(pipeline_latency(own, H, KINDS).L_ms)
    assert own.predicted_step_ms < 0.8 * truth


def test_layout_labels_a_kind_with_its_own_profile() -> None:
    from dapple.simulate.layout import server_label

    assert server_label(KINDS, 1) == "server 1\nA own profile"
    assert server_label(SCALED, 1) == "server 1\nA x0.4"


def test_fastest_layers_bound_every_kind() -> None:
    fast = fastest_layers(H, KINDS)
    slow_first = _profile([1.0, 0.5, 2.0, 1.0])
    mixed = with_kind_profiles(SCALED, {"H": H, "A": slow_first})
    got = fastest_layers(H, mixed)
    assert [x.forward.per_sample_ms for x in got.layers] == [1.0, 0.5, 1.0, 1.0]
    assert [x.forward.per_sample_ms for x in fast.layers] == [1.0] * 4
    assert fastest_layers(H, SCALED) is H
    assert profile_of(KINDS, 0, H) is H and profile_of(KINDS, 3, H) is A
    assert profile_of(SCALED, 3, H) is H
    assert [k.speed for k in KINDS.kinds] == [1.0, 1.0]


def test_profile_set_spec() -> None:
    assert parse_profile_set("paper:bert48") is None
    assert parse_profile_set("H=h.json,A=a.json") == {"H": "h.json", "A": "a.json"}
    with pytest.raises(ValidationError, match=r"each part must be KIND=FILE, got 'a\.json'"):
        parse_profile_set("H=h.json,a.json")
    with pytest.raises(ValidationError, match="kind 'H' given twice"):
        parse_profile_set("H=h.json,H=a.json")


@pytest.mark.parametrize(
    ("profiles", "message"),
    [
        ({"H": H}, "device kind 'A' has no profile; give one per kind \\(H=FILE, A=FILE\\)"),
        ({"H": H, "A": A, "B": A}, "no device kind 'B' \\(its kinds: H, A\\)"),
        ({"H": H, "A": _profile([1.0] * 3)}, "different models: 4 vs 3 layers"),
        (
            {"H": _profile([1.0] * 4, fp="abc"), "A": _profile([1.0] * 4, fp="def")},
            "different models: fingerprints abc vs def",
        ),
    ],
)
def test_mismatches_are_refused_in_one_line(profiles: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as e:
        with_kind_profiles(SCALED, profiles)
    assert "\n" not in str(e.value)


def test_a_cluster_without_kinds_refuses_them() -> None:
    plain = dataclasses.replace(SCALED, kinds=())
    with pytest.raises(ValidationError, match="has no device kinds"):
        with_kind_profiles(plain, {"H": H})


def test_a_kind_with_a_profile_has_speed_one() -> None:
    with pytest.raises(ValidationError, match="has speed 1"):
        dataclasses.replace(KINDS.kinds[1], speed=0.5)


def _write(tmp_path: Path) -> tuple[str, str, str]:
    cluster = SCALED.to_dict()
    cluster["kinds"] = [k.to_dict() for k in SCALED.kinds]
    paths = []
    for name, obj in (("c.json", cluster), ("h.json", H.to_dict()), ("a.json", A.to_dict())):
        (tmp_path / name).write_text(json.dumps(obj))
        paths.append(str(tmp_path / name))
    return paths[0], paths[1], paths[2]


def test_cli_plan_and_simulate_take_a_profile_per_kind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dapple.cli import main

    c, h, a = _write(tmp_path)
    out = str(tmp_path / "plan.json")
    args = ["--profile", f"H={h}", "--profile", f"A={a}", "--cluster", c]
    assert main(["plan", *args, "--global-batch-size", "16", "--output", out]) == 0
    plan = Plan.load(out)
    assert [(s.layers, s.devices) for s in plan.stages] == [((0, 2), (0, 1)), ((2, 4), (2, 3))]
    assert plan.predicted_step_ms == pytest.approx(make_plan(H, KINDS, 16).predicted_step_ms)
    capsys.readouterr()
    assert main(["simulate", "--plan", out, *args]) == 0
    shown = capsys.readouterr().out
    assert f"step time {plan.predicted_step_ms:.3f} ms" in shown
    assert "(simulated / L = 1.000)" in shown
    assert main(["plan", "--profile", f"H={h}", "--cluster", c, "--global-batch-size", "16"]) == 2
    assert "device kind 'A' has no profile" in capsys.readouterr().err


def test_api_simulate_and_train_flags_take_a_profile_set(tmp_path: Path) -> None:
    """The API's simulate (what train's predicted step time runs) prices a profile set with
    each kind's own; train's --profile joins KIND=FILE flags as plan's does."""
    import argparse

    from dapple.api import simulate as api_simulate
    from dapple.api._inputs import as_profile
    from dapple.cli import train_cmd

    c, h, a = _write(tmp_path)
    plan = make_plan(H, KINDS, 16)
    spec = f"H={h},A={a}"
    assert as_profile(spec).layers == H.layers
    own = api_simulate(plan, spec, c).step_ms
    assert own == pytest.approx(simulate(plan, H, KINDS).step_ms, rel=1e-9)
    assert own == pytest.approx(plan.predicted_step_ms, rel=1e-4)  # the simulator is near L
    assert api_simulate(plan, h, c).step_ms > 1.1 * own  # one profile, scaled: A slower throughout
    parser = argparse.ArgumentParser()
    train_cmd.register(parser.add_subparsers())
    run = ["train", "--plan", "p.json", "-m", "mlp"]
    assert parser.parse_args([*run, "--profile", f"H={h}", "--profile", f"A={a}"]).profile == spec
    assert parser.parse_args([*run, "--profile", h, "--profile", a]).profile == a


@pytest.mark.parametrize("gbs", [8, 12])
def test_search_is_no_worse_than_the_oracle_with_per_kind_profiles(gbs: int) -> None:
    """2 servers of 2 devices, the second kind 4x slower on layers 0, 1 and as fast on 2, 3:
    the DP's L at most the exhaustive oracle's (every partition, replication and placement,
    scored alike), both the cost model's L of their plans."""
    from dapple.cost.schedule_step import schedule_latency

    dp, oracle = make_plan(H, KINDS, gbs), make_plan(H, KINDS, gbs, "exhaustive")
    assert dp.predicted_step_ms <= oracle.predicted_step_ms * (1 + 1e-9)
    for p in (dp, oracle):
        assert p.predicted_step_ms == pytest.approx(schedule_latency(p, H, KINDS))


def test_simulate_warns_by_each_kinds_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """Layers [0, 4) (about 70 MB: 4 x 16 MB of state) on an H device of 1 GiB fits; on an A
    device of 48 MiB it does not: only that device is warned of, against its own memory (the
    warning compared every device with the smallest kind's)."""
    from rich.console import Console

    from dapple.cli.simulate_cmd import _print_run

    small = dataclasses.replace(KINDS.kinds[1], device_memory_bytes=48 * 2**20)
    c = dataclasses.replace(KINDS, kinds=(KINDS.kinds[0], small), device_memory_bytes=48 * 2**20)
    con = Console(width=200)
    for d, warned in ((0, False), (2, True)):
        plan = _plan(StagePlan(layers=(0, 4), devices=(d,)), b=1)
        _print_run(con, "t", simulate(plan, H, c), c)
        out = " ".join(capsys.readouterr().out.split())
        assert (
            "warning: peak memory exceeds the 0.0469 GiB device memory on device(s) 2" in out
        ) == warned
        assert "exceeds" in out if warned else "exceeds" not in out


# -- the slowest-kind view and a cluster saved with its kinds' profiles ------------------------
PLAIN = dataclasses.replace(SCALED, kinds=())
"""The cluster without kinds: every device alike, at the profile's times."""


def test_slowest_kind_computes_each_layer_at_its_slowest_kinds_times() -> None:
    """A at [1, 0.5, 2, 1] ms per sample forward against H's [1, 1, 1, 1]: the view's one kind
    takes [1, 1, 2, 1] (backward twice that) on every device, with the smallest kind's memory."""
    mixed = with_kind_profiles(SCALED, {"H": H, "A": _profile([1.0, 0.5, 2.0, 1.0])})
    view = mixed.slowest_kind()
    assert [(k.name, k.servers, k.speed) for k in view.kinds] == [("slowest of H+A", 2, 1.0)]
    assert mixed.mixed and KINDS.mixed and not view.mixed and view.num_devices == 4
    assert view.usable_memory_of(3) == mixed.usable_memory_bytes
    for d in range(4):
        got = profile_of(view, d, H)
        assert [x.forward.per_sample_ms for x in got.layers] == [1.0, 1.0, 2.0, 1.0]
        assert [x.backward.per_sample_ms for x in got.layers] == [2.0, 2.0, 4.0, 2.0]


def test_slowest_kind_plan_with_per_kind_profiles_is_the_plan_on_the_slowest_profile() -> None:
    """A is at least as slow as H on every layer, so the slowest-kind plan of the cluster with
    per-kind profiles is the plan of A's profile on the cluster without kinds, whatever profile
    it is planned with (a view at H's times would plan 4x faster layers 0, 1)."""
    slow = make_plan(H, KINDS.slowest_kind(), 16)
    want = make_plan(A, PLAIN, 16)
    assert [(s.layers, s.devices, s.shares) for s in slow.stages] == [
        (s.layers, s.devices, s.shares) for s in want.stages
    ]
    assert slow.predicted_step_ms == pytest.approx(want.predicted_step_ms, rel=1e-9)
    assert slow.predicted_step_ms > 1.5 * make_plan(H, PLAIN, 16).predicted_step_ms
    # priced on the cluster as it is, the plan made with the kinds' own profiles is faster
    own = make_plan(H, KINDS, 16)
    assert own.predicted_step_ms < 0.9 * pipeline_latency(slow, H, KINDS).L_ms


def test_a_cluster_saved_with_its_kinds_profiles_plans_alike_when_loaded(tmp_path: Path) -> None:
    from dapple.core.cluster_presets import load_cluster

    path = tmp_path / "kinds.json"
    KINDS.save(path)
    back = load_cluster(str(path))
    assert back == KINDS and [k.profile for k in back.kinds] == [H, A]
    assert make_plan(H, back, 16) == make_plan(H, KINDS, 16)
    assert Cluster.from_dict(SCALED.to_dict()).kinds[1].profile is None  # none given, none saved


def test_cli_plans_with_the_profiles_of_a_saved_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One ``--profile`` on a cluster file whose kinds carry their own: each kind computes at
    its own; a profile of another model is refused in one line."""
    from dapple.cli import main

    c, h, _ = _write(tmp_path)
    KINDS.save(c)
    out = str(tmp_path / "plan.json")
    args = ["--cluster", c, "--global-batch-size", "16"]
    assert main(["plan", "--profile", h, *args, "--output", out]) == 0
    assert Plan.load(out) == make_plan(H, KINDS, 16)
    other = tmp_path / "other.json"
    _profile([1.0] * 3).save(other)
    capsys.readouterr()
    assert main(["plan", "--profile", str(other), *args]) == 2
    err = capsys.readouterr().err
    assert "different models: 4 vs 3 layers" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({1: {"profile": None}}, "kinds \\['H'\\] give their own profile and \\['A'\\] do not"),
        ({1: {"speed": 0.4}}, "give no datasheet and no speed but 1 .*speed 0.4"),
        (
            {1: {"datasheet": "a100", "speed": None}},
            "give no datasheet and no speed but 1 .*datasheet 'a100'",
        ),
        ({1: {"profile": {"layers": 3}}}, "device kind 'A': profile: "),
        ({1: {"profile": _profile([1.0] * 3).to_dict()}}, "different models: 4 vs 3 layers"),
    ],
)
def test_bad_profiles_in_a_cluster_file_are_refused_in_one_line(
    change: dict[int, dict], message: str
) -> None:
    d = KINDS.to_dict()
    for i, fields in change.items():
        d["kinds"][i].update(fields)
        d["kinds"][i] = {k: v for k, v in d["kinds"][i].items() if v is not None}
    with pytest.raises(ValidationError, match=message) as e:
        Cluster.from_dict(d, name="bad")
    assert "\n" not in str(e.value)

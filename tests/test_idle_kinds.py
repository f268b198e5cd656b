"""A device kind a plan leaves idle is said, with its devices and why; a "no plan fits" names
the kinds that could hold nothing (issue #43)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from builders import make_profile
from dapple.cli._plan_show import idle_line
from dapple.core.cluster import GIB, Cluster
from dapple.core.device_kinds import DeviceKind
from dapple.errors import InfeasibleError
from dapple.planner import make_plan
from dapple.planner.idle_kinds import idle_kinds, layer_needs, unfit_kinds_clause

PROF = make_profile(4, fwd=1.0, bwd=2.0, params=4_000_000)
"""Four layers of 4 MB of parameters: about 16 MB each with fp32 Adam."""


def _cluster(second_bytes: int, second_speed: float = 1.0, per_server: int = 2) -> Cluster:
    kinds = (
        DeviceKind(name="big", servers=1, speed=1.0, device_memory_bytes=GIB),
        DeviceKind(name="small", servers=1, speed=second_speed, device_memory_bytes=second_bytes),
    )
    return Cluster(servers=2, devices_per_server=per_server, device_memory_bytes=second_bytes,
                   intra_server_bandwidth_gbps=100, inter_server_bandwidth_gbps=10,
                   kinds=kinds)  # fmt: skip


def test_layer_needs_are_the_memory_model_s() -> None:
    """Each layer: 4 MB parameters x 4 (parameters, gradients, Adam's two moments) held, and
    at most the gradients and one sample's activations besides; every layer needs at least
    its state."""
    needs = layer_needs(PROF)
    assert len(needs) == 4
    assert all(16e6 <= n < 16e6 + 4e6 + 10_000 for n in needs)


def test_a_kind_no_layer_fits_is_named_with_its_memory() -> None:
    c = _cluster(8 * 2**20)  # 8 MiB: below every layer's 16 MB
    plan = make_plan(PROF, c, 8)
    assert set(plan.devices) <= {0, 1}
    (line,) = idle_kinds(plan, PROF, c)
    assert line.startswith("device kind small: its 2 devices left idle: no layer alone holds one")
    assert "in their 0.00781 GiB usable (the smallest needs 0.0" in line
    shown = idle_line(plan, PROF, c)
    assert shown is not None and "\n" not in shown
    assert shown.startswith("2 of 4 devices left idle (the plan uses 2); device kind small")


def test_a_slow_kind_the_search_does_not_use() -> None:
    c = _cluster(GIB, second_speed=0.01)
    plan = make_plan(PROF, c, 8)
    assert set(plan.devices) <= {0, 1}
    assert idle_kinds(plan, PROF, c) == [
        "device kind small: its 2 devices left idle: the search found no faster plan using "
        "them (speed 0.01 of the fastest kind)"
    ]


def test_a_kind_beyond_what_the_batch_keeps_busy() -> None:
    """Two layers and a global batch of 1 keep at most 2 devices busy: the search looks at the
    first server only, the second kind's."""
    prof = make_profile(2, fwd=1.0, bwd=2.0, params=4_000_000)
    c = _cluster(GIB)
    plan = make_plan(prof, c, 1)
    assert idle_kinds(plan, prof, c) == [
        "device kind small: its 2 devices left idle: a global batch of 1 keeps at most 2 "
        "devices busy, the search looked at the first 2"
    ]


def test_a_used_kind_and_no_kinds_say_nothing() -> None:
    c = _cluster(GIB)
    plan = make_plan(PROF, c, 8)
    assert set(plan.devices) & {2, 3}
    assert idle_kinds(plan, PROF, c) == []
    plain = make_plan(PROF, c.slowest_kind(), 8)
    assert idle_kinds(plain, PROF, c.slowest_kind()) == []
    assert unfit_kinds_clause(PROF, c) == ""


def test_no_plan_names_the_kind_that_could_not_be_used() -> None:
    """Kinds of 12 MiB and 8 MiB, below every layer's 16 MB of state: no plan, and each kind
    is named as unusable."""
    kinds = (
        DeviceKind(name="big", servers=1, speed=1.0, device_memory_bytes=12 * 2**20),
        DeviceKind(name="small", servers=1, speed=0.5, device_memory_bytes=8 * 2**20),
    )
    c = Cluster(servers=2, devices_per_server=2, device_memory_bytes=8 * 2**20,
                intra_server_bandwidth_gbps=100, inter_server_bandwidth_gbps=10,
                kinds=kinds)  # fmt: skip
    with pytest.raises(InfeasibleError) as e:
        make_plan(PROF, c, 8)
    msg = str(e.value)
    assert "\n" not in msg
    assert (
        "; device kind(s) big (2 devices of 0.0117 GiB), small (2 devices of 0.00781 GiB) "
        "could not be used: no layer alone holds one sample there (the smallest needs 0.0"
    ) in msg


def test_cli_plan_prints_the_idle_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dapple.cli import main

    c = _cluster(8 * 2**20).to_dict()
    (tmp_path / "c.json").write_text(json.dumps(c))
    (tmp_path / "p.json").write_text(json.dumps(PROF.to_dict()))
    args = ["plan", "--profile", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json")]
    assert main([*args, "--global-batch-size", "8"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "device kind small: its 2 devices left idle: no layer alone holds one sample" in out

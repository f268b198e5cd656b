"""What a new user following the README meets (issue 47, item 9): ``--zero-stage auto`` leaves a
stage unsharded where it fits, the zoo transformer's TP plan, elastic and SIGTERM wording,
``generate``'s cut prompts, step ETAs, TP plans drawn per device and the prediction's basis."""

from __future__ import annotations

import dataclasses

from builders import make_cluster, make_profile
from dapple.planner.evaluate import ZERO_AUTO
from dapple.planner.search import dapple_search


def _with_update(u: float):
    """The test profile with a measured optimizer update of ``u`` ms per parameter byte, which
    ZeRO divides by r_s: by L alone a sharded stage is then always faster."""
    p = make_profile(params=10**6)
    return dataclasses.replace(p, update_ms_per_parameter_byte=u)


def test_auto_leaves_a_stage_unsharded_where_it_fits() -> None:
    profile, cluster = _with_update(1e-6), make_cluster()
    sharded = dapple_search(profile, cluster, 8, zero_stage=1)
    assert any(st.zero_stage == 1 for st in sharded.stages)  # ZeRO-1's 1/r update is cheaper
    auto = dapple_search(profile, cluster, 8, zero_stage=ZERO_AUTO)
    assert any(st.replicas > 1 for st in auto.stages)
    assert all(st.zero_stage == 0 for st in auto.stages)
    assert sharded.predicted_step_ms < auto.predicted_step_ms  # so L alone would have sharded


def test_auto_still_shards_where_memory_asks() -> None:
    profile = _with_update(1e-6)
    profile = dataclasses.replace(
        profile,
        layers=tuple(dataclasses.replace(x, parameter_bytes=10**8) for x in profile.layers),
    )
    tight = dataclasses.replace(make_cluster(), device_memory_bytes=int(2.15e9))
    plan = dapple_search(profile, tight, 8, max_stages=1, zero_stage=ZERO_AUTO)
    assert plan.stages[0].replicas > 1 and plan.stages[0].zero_stage in (1, 2)

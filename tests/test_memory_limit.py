"""A device-memory limit that pure data parallelism exceeds: the planner returns a plan that
fits, and training that plan stays under the limit on every rank (measured)."""

from __future__ import annotations

import dataclasses

import pytest

from builders import make_cluster, make_profile
from dapple import api
from dapple.core.cluster import Cluster
from dapple.core.parallelism import Parallelism
from dapple.cost.memory import parameter_state_bytes
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import InfeasibleError, ValidationError

MIB = 2**20
MODEL = {"layers": 7, "in_features": 1024, "hidden": 3072, "num_classes": 10}
"""About 9.4M fp32 parameters (36 MiB) per hidden layer: training state dominates memory."""
RESERVED = 160 * MIB
"""What a CPU rank's runtime adds besides its stage (gloo groups, threads, allocator): about
120 MiB measured with Adam, see benchmarks/memory.md."""
G = 8


@pytest.mark.slow
def test_a_limit_pure_dp_exceeds_gets_a_plan_whose_run_stays_under_it() -> None:
    prof = api.profile("mlp", batch_sizes=(1, 2), overrides=MODEL, repeats=1, warmup=1)
    prof = dataclasses.replace(prof, optimizer_state_factor=3.0)  # Adam
    dp_bytes = parameter_state_bytes(prof, (0, prof.num_layers), Parallelism(replicas=4))
    limit = int(0.45 * dp_bytes)
    cluster = dataclasses.replace(
        make_cluster(1, 4), device_memory_bytes=limit, reserved_memory_bytes=RESERVED
    )

    roomy = dataclasses.replace(cluster, device_memory_bytes=int(10 * dp_bytes))
    dp = api.plan(prof, roomy, G, "dp")
    assert not pipeline_latency(dp, prof, cluster).fits_memory  # pure DP exceeds the limit
    plan = api.plan(prof, cluster, G)
    estimate = pipeline_latency(plan, prof, cluster)
    assert plan.num_stages > 1 and estimate.fits_memory

    metrics = api.train(plan, "mlp", steps=3, overrides=MODEL, optimizer="adam", lr=1e-3)
    grown = metrics[-1].stage_resident_bytes
    assert len(grown) == plan.num_stages
    for s, measured in enumerate(grown):
        # what building and training stage s added to its worst replica's process
        assert measured <= limit, (s, measured / MIB, limit / MIB, plan.replication)
    # the measurement sees the stages' training state (it is not vacuous)
    state = [
        parameter_state_bytes(prof, st.layers, Parallelism(replicas=st.replicas))
        for st in plan.stages
    ]
    assert max(grown) >= 0.7 * max(state), ([g / MIB for g in grown], [b / MIB for b in state])


def test_reserved_memory_is_kept_from_the_stages() -> None:
    prof = make_profile(4, act=10.0, params=1000)
    # parameters and Adam's moments (3 B a parameter byte) and, at the first layer's backward,
    # the other three layers' gradients, its own in flight and 20 B of activations: 100 B to spare
    base = dataclasses.replace(make_cluster(1, 1), device_memory_bytes=4000 * 3 + 4020 + 100)
    assert pipeline_latency(api.plan(prof, base, 1), prof, base).fits_memory
    tight = dataclasses.replace(base, reserved_memory_bytes=200)
    assert Cluster.from_dict(tight.to_dict()) == tight
    with pytest.raises(InfeasibleError, match="reserved for the runtime"):
        api.plan(prof, tight, 1)
    with pytest.raises(ValidationError, match="reserved memory"):
        dataclasses.replace(base, reserved_memory_bytes=base.device_memory_bytes)

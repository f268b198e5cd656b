"""Where a plan's tensor-parallel groups may sit on a cluster: each inside one server.

A stage with tensor width t_s runs each replica on a group of t_s devices
(:attr:`dapple.core.plan.StagePlan.tensor_width`); its per-block all-reduces (Megatron-LM,
Shoeybi et al. 2019: two forward and two backward per transformer block) are latency-bound and
run on the server's own links (NVLink), so a group never spans servers.
:func:`check_tensor_widths` refuses, before the planner runs, widths it cannot search. Pure, no
torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from dapple.core._json import require
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError

__all__ = ["TENSOR_WIDTHS", "check_tensor_groups", "check_tensor_widths"]

TENSOR_WIDTHS = (1, 2, 4, 8)
"""The widths t_s the planner searches (those dividing the server size)."""


def check_tensor_groups(plan: Plan, cluster: Cluster) -> None:
    """Refuse a plan whose tensor groups do not fit the cluster's servers.

    Args:
        plan: the plan; stages without tensor parallelism pass unchecked.
        cluster: servers of ``devices_per_server`` devices.

    Raises:
        ValidationError: a tensor width above the server size, or a tensor group whose devices
            lie in more than one server (naming the stage, the group and the servers).
    """
    for s, st in enumerate(plan.stages[: plan.num_groups]):
        if not st.parallel.tensor_parallel:
            continue
        t = st.tensor_width
        require(
            t <= cluster.devices_per_server,
            f"plan stage {s} {list(st.layers)}: tensor_width={t} is wider than a server of "
            f"{cluster.name} ({cluster.devices_per_server} devices)",
        )
        for j in range(st.replicas):
            group = st.tensor_group(j)
            servers = sorted({cluster.server_of(d) for d in group})
            require(
                len(servers) == 1,
                f"plan stage {s} {list(st.layers)}: tensor group {j} on devices {list(group)} "
                f"spans servers {servers}; a tensor group must sit inside one server",
            )


def check_tensor_widths(widths: Sequence[int], profile: ModelProfile, cluster: Cluster) -> None:
    """Refuse tensor widths t the planner cannot search for ``profile`` on ``cluster``.

    Args:
        widths: the widths asked for (each of :data:`TENSOR_WIDTHS`).
        profile: the model profile; a width t > 1 needs a layer that shards
            (``LayerProfile.tensor_parallel``, set where the model has a TP plan).
        cluster: servers of ``devices_per_server`` devices, which every t must divide.

    Raises:
        ValidationError: a width outside :data:`TENSOR_WIDTHS`, one that does not divide the
            server size, or t > 1 for a profile with no layer that shards or on a cluster of
            shared compute cores (whose cost model has no tensor groups).
    """
    asked = list(widths)
    require(
        len(asked) > 0 and all(t in TENSOR_WIDTHS and not isinstance(t, bool) for t in asked),
        f"tensor widths must each be one of {', '.join(map(str, TENSOR_WIDTHS))}, got {asked}",
    )
    n = cluster.devices_per_server
    bad = [t for t in asked if n % t]
    require(
        not bad,
        f"tensor width(s) {bad} do not divide the {n} devices of a server of {cluster.name} "
        f"(a tensor group sits inside one server); widths that fit: "
        f"{[t for t in TENSOR_WIDTHS if n % t == 0]}",
    )
    if not any(t > 1 for t in asked):
        return
    require(
        any(x.tensor_parallel for x in profile.layers),
        f"tensor widths {asked}: no layer of profile {profile.model_name!r} shards over a "
        "tensor group (none is tensor_parallel: the model has no TP plan); plan with width 1",
    )
    cores = cluster.compute_cores_per_server
    if cores is not None:
        raise ValidationError(
            f"tensor widths {asked}: the devices of cluster {cluster.name} share {cores:g} "
            "compute cores per server, where the cost model has no tensor groups; plan with "
            "width 1"
        )

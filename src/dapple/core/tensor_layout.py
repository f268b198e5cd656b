"""Where a plan's tensor-parallel groups may sit on a cluster: each inside one server.

A stage with tensor width t_s runs each replica on a group of t_s devices
(:attr:`dapple.core.plan.StagePlan.tensor_width`); its per-block all-reduces (Megatron-LM,
Shoeybi et al. 2019: two forward and two backward per transformer block) are latency-bound and
run on the server's own links (NVLink), so a group never spans servers. Pure, no torch.
"""

from __future__ import annotations

from dapple.core._json import require
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan

__all__ = ["TENSOR_WIDTHS", "check_tensor_groups"]

TENSOR_WIDTHS = (1, 2, 4, 8)
"""The widths t_s the planner searches (those dividing the server size)."""


def check_tensor_groups(plan: Plan, cluster: Cluster) -> None:
    """Refuse a plan whose tensor groups do not fit the cluster's servers.

    Args:
        plan: the plan; stages with ``tensor_width == 1`` pass unchecked.
        cluster: servers of ``devices_per_server`` devices.

    Raises:
        ValidationError: a tensor width above the server size, or a tensor group whose devices
            lie in more than one server (naming the stage, the group and the servers).
    """
    for s, st in enumerate(plan.stages[: plan.num_groups]):
        t = st.tensor_width
        if t == 1:
            continue
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

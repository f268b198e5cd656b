"""DAPPLE planner (paper section 5): DP search, baselines and an exhaustive oracle.

``make_plan(profile, cluster, global_batch_size, planner)`` is the entry point; every planner
returns a :class:`dapple.core.plan.Plan` whose ``predicted_step_ms`` is the cost model's L
(:mod:`dapple.cost`). A profile measured at several sequence lengths is planned for a mean and
a maximum length (:func:`dapple.cost.at_length.profile_for_lengths`; the plan records both).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dapple.core.cluster import Cluster
from dapple.core.kind_profiles import fastest_layers
from dapple.core.plan import Plan
from dapple.core.planning_options import PlanningOptions, ZeroChoice
from dapple.core.profile import ModelProfile
from dapple.core.tensor_layout import check_tensor_widths
from dapple.cost.at_length import profile_for_lengths
from dapple.cost.host import has_host_terms
from dapple.errors import ValidationError, renamed_keywords
from dapple.planner.baselines import dp_plan, gpipe_plan, pipedream_plan, straight_plan_baseline
from dapple.planner.batches import check_batch_argument
from dapple.planner.grid import grid_plan
from dapple.planner.oracle import exhaustive_plan
from dapple.planner.registry import DEFAULT_PLANNER, PLANNERS, get_planner
from dapple.planner.search import Progress, dapple_search
from dapple.planner.shares import search_cluster, with_kind_shares

__all__ = [
    "PLANNERS",
    "dapple_search",
    "dp_plan",
    "exhaustive_plan",
    "gpipe_plan",
    "grid_plan",
    "make_plan",
    "pipedream_plan",
    "straight_plan_baseline",
]


@renamed_keywords(seq_len="mean_seq_len", interleaved="interleave")
def make_plan(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    planner: str = DEFAULT_PLANNER,
    *,
    progress: Progress | None = None,
    zero_stage: ZeroChoice = 0,
    mean_seq_len: float | None = None,
    max_seq_len: float | None = None,
    tensor_widths: Sequence[int] | None = None,
    interleave: bool = False,
) -> Plan:
    """Plan ``profile`` on ``cluster`` for ``global_batch_size`` samples per step.

    Args:
        profile: model profile.
        cluster: devices and links.
        global_batch_size: samples per optimizer step.
        planner: one of :data:`~dapple.planner.registry.PLANNERS`.
        progress: ``progress(done, total)`` callback (DAPPLE search only).
        zero_stage: 1: replicated stages shard their optimizer state (ZeRO-1); 2: their
            gradients too (ZeRO-2); 3: their parameters too (ZeRO-3), gathered once per step or
            per micro-batch, whichever gives the lower L; ``auto``: per stage, where memory
            asks for it. DAPPLE search only, the baselines plan unsharded.
        mean_seq_len: plan for samples of this mean length in tokens (time), from a profile
            measured at several lengths (:func:`~dapple.cost.at_length.profile_for_lengths`);
            None: the profile as it is (a profile already for a length keeps its lengths).
        max_seq_len: the longest sample in tokens (memory); default ``mean_seq_len``.
        tensor_widths: the tensor widths t to search (DAPPLE search only,
            :func:`~dapple.planner.search.dapple_search`); None: 1, and every width dividing the
            server size when some layer shards (:func:`~dapple.planner.widths.width_candidates`).
        interleave: also offer interleaved 1F1B plans (v = 2) and the grid's interleaved
            points (DAPPLE search only, :mod:`dapple.planner.interleaving`); the plan may then
            have ``schedule == "interleaved"``, costed by its step rule.

    Returns:
        The plan, with ``mean_seq_len``/``max_seq_len`` the lengths its profile is for (None for a
        profile without lengths), ``planned_with`` these search options and the profile's
        ``model_fingerprint``. On a cluster with device kinds a stage whose replicas differ in
        speed takes balanced shares of each micro-batch (:mod:`dapple.planner.shares`); a
        kind with its own profile (:mod:`dapple.core.kind_profiles`) computes at its times.

    Raises:
        ValidationError: unknown planner, bad batch size (below 1, above
            :data:`~dapple.planner.search.MAX_GLOBAL_BATCH_SIZE`), lengths the profile
            cannot give, or tensor widths that cannot be searched
            (:func:`~dapple.core.tensor_layout.check_tensor_widths`; t > 1 with a baseline),
            ``interleave`` with a baseline or on a cluster with host terms (the interleaved
            step rule does not cost them).
        InfeasibleError: no plan fits.
    """
    spec = get_planner(planner)
    check_batch_argument(global_batch_size)
    if tensor_widths is not None:
        check_tensor_widths(tensor_widths, profile, cluster)
        if not spec.is_search and list(tensor_widths) != [1]:
            raise ValidationError(f"tensor widths {list(tensor_widths)} are searched by the "
                                  f"dapple planner only, not {planner!r}")  # fmt: skip
    if interleave:
        _check_interleave(planner, spec.is_search, cluster)
    if mean_seq_len is not None or max_seq_len is not None:
        if mean_seq_len is None:
            raise ValidationError(f"max_seq_len {max_seq_len} needs mean_seq_len")
        profile = profile_for_lengths(profile, mean_seq_len, max_seq_len)
    searched = search_cluster(cluster)  # device kinds: speeds <= 1 (dapple.planner.shares)
    fastest = fastest_layers(profile, cluster)  # per-kind profiles: each layer's least time
    if spec.rule is None:
        plan = dapple_search(fastest, searched, global_batch_size, progress=progress,
                             zero_stage=zero_stage, tensor_widths=tensor_widths,
                             interleaved=interleave)  # fmt: skip
    else:
        plan = spec.rule(fastest, searched, global_batch_size)
    plan = with_kind_shares(plan, profile, cluster)
    widths = None if tensor_widths is None else tuple(tensor_widths)
    plan = dataclasses.replace(
        plan,
        planned_with=PlanningOptions(planner=planner, zero_stage=zero_stage,
                                     tensor_widths=widths, interleave=interleave),
        model_fingerprint=profile.model_fingerprint,
    )  # fmt: skip
    if profile.seq_len is None:
        return plan
    return dataclasses.replace(
        plan, mean_seq_len=profile.seq_len, max_seq_len=profile.for_memory.seq_len
    )


def _check_interleave(planner: str, is_search: bool, cluster: Cluster) -> None:
    """Refuse ``interleave`` where it would not be searched (a baseline, host terms)."""
    if not is_search:
        raise ValidationError(
            f"interleaved plans are searched by the dapple planner only, not {planner!r}"
        )
    if has_host_terms(cluster):
        raise ValidationError(
            f"cluster {cluster.name!r} has host terms (CPU overheads or shared cores), which "
            "the interleaved step rule does not cost: plan it without interleaving"
        )

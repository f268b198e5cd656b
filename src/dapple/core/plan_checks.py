"""The invariants of a :class:`~dapple.core.plan.Plan`, checked when one is made.

Pure data model, no torch. Notation as in :mod:`dapple.core.plan`: S stages, P device groups,
v virtual stages per group (S = P·v), M micro-batches of b samples. :func:`check_plan` runs the
steps in order, so the first broken rule is the one reported; each message names the offending
stage, device or value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dapple.core._json import require
from dapple.core.schedule_rules import check_schedule
from dapple.core.slicing import check_shares

if TYPE_CHECKING:
    from dapple.core.moe_profile import MoEProfile
    from dapple.core.plan import Plan, StagePlan
    from dapple.core.profile import ModelProfile

__all__ = ["check_expert_widths", "check_plan"]


def check_plan(plan: Plan) -> None:
    """Check every invariant of ``plan``: schedule and policy, batch sizes, a contiguous layer
    cover, the virtual stages' device groups, the planned lengths, each device in one group,
    and the replicas' shares.

    Raises:
        ValidationError: the first broken invariant, naming the field, stage or device.
    """
    _check_schedule(plan)
    _check_batch(plan)
    _check_layers(plan)
    _check_groups(plan)
    _check_lengths(plan)
    _check_devices(plan)
    _check_shares(plan)


def _check_schedule(plan: Plan) -> None:
    """A schedule name, v >= 1 that the schedule takes, policy A or B."""
    require(
        isinstance(plan.schedule, str) and plan.schedule != "",
        f"plan: schedule must be a schedule name, got {plan.schedule!r}",
    )
    nv = plan.virtual_stages
    require(
        isinstance(nv, int) and not isinstance(nv, bool) and nv >= 1,
        f"plan: virtual_stages must be an integer >= 1, got {nv!r}",
    )
    check_schedule(plan)  # a registered schedule, v > 1 only with chunks
    require(plan.policy in ("A", "B"), f"plan: policy must be 'A' or 'B', got {plan.policy!r}")


def _check_batch(plan: Plan) -> None:
    """Positive integer batch sizes with b·M = global batch."""
    for f in ("global_batch_size", "micro_batch_size", "num_micro_batches"):
        v = getattr(plan, f)
        require(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            f"plan: {f} must be an integer >= 1, got {v!r}",
        )
    require(
        plan.micro_batch_size * plan.num_micro_batches == plan.global_batch_size,
        f"plan: micro_batch_size ({plan.micro_batch_size}) x num_micro_batches "
        f"({plan.num_micro_batches}) must equal global_batch_size ({plan.global_batch_size})",
    )


def _check_layers(plan: Plan) -> None:
    """The stages cover the chain from layer 0 without gap or overlap."""
    stages = plan.stages
    require(len(stages) >= 1, "plan has no stages")
    require(
        stages[0].layers[0] == 0,
        f"plan: stage 0 must start at layer 0, got {list(stages[0].layers)}",
    )
    for i in range(1, len(stages)):
        prev, cur = stages[i - 1].layers, stages[i].layers
        require(
            prev[1] == cur[0],
            f"plan: stage {i} layers {list(cur)} must start where stage {i - 1} {list(prev)} "
            f"ends ({'overlap' if cur[0] < prev[1] else 'gap'})",
        )


def _check_groups(plan: Plan) -> None:
    """S = P·v, and each virtual stage k >= P runs on the devices and tensor width of the
    device group its schedule places it on."""
    nv, stages = plan.virtual_stages, plan.stages
    require(
        len(stages) % nv == 0,
        f"plan: {len(stages)} stages are not virtual_stages={nv} chunks per device group",
    )
    P = len(stages) // nv
    for k in range(P, len(stages)):  # stage g < P is device group g
        g = plan.group_of_stage(k)
        require(
            0 <= g < P,
            f"plan: schedule {plan.schedule!r} places virtual stage {k} on device group {g}, "
            f"not one of the {P} groups (stages 0..{P - 1})",
        )
        require(
            stages[k].devices == stages[g].devices
            and stages[k].tensor_width == stages[g].tensor_width,
            f"plan: virtual stage {k} must run on the devices of stage {g} "
            f"{list(stages[g].devices)} (v={nv}, {P} device groups), got "
            f"{list(stages[k].devices)} (tensor_width {stages[k].tensor_width})",
        )


def _check_lengths(plan: Plan) -> None:
    """``mean_seq_len`` and ``max_seq_len`` positive or None, the mean at most the longest."""
    for f in ("mean_seq_len", "max_seq_len"):
        v = getattr(plan, f)
        require(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0),
            f"plan: {f} must be a number > 0 or null, got {v!r}",
        )
    require(
        plan.mean_seq_len is None
        or plan.max_seq_len is None
        or plan.mean_seq_len <= plan.max_seq_len,
        f"plan: mean_seq_len {plan.mean_seq_len} exceeds max_seq_len {plan.max_seq_len}",
    )


def _check_devices(plan: Plan) -> None:
    """No device in two device groups."""
    seen: dict[int, int] = {}
    for i, st in enumerate(plan.stages[: plan.num_groups]):
        for d in st.devices:
            require(d not in seen, f"plan: device {d} is used by stage {seen.get(d)} and stage {i}")
            seen[d] = i


def _check_shares(plan: Plan) -> None:
    """Each stage's shares sum to b; the virtual stages of one device group share them."""
    first: dict[tuple[int, ...], int] = {}
    for k, st in enumerate(plan.stages):
        if st.shares is not None:
            check_shares(st.shares, plan.micro_batch_size, st.replicas, f"plan: stage {k} shares")
        g = first.setdefault(st.devices, k)
        require(
            st.shares == plan.stages[g].shares,
            f"plan: stage {k} shares {st.shares} differ from those of stage {g} "
            f"{plan.stages[g].shares} on the same devices {list(st.devices)}",
        )


def check_expert_widths(plan: Plan, profile: ModelProfile, what: str) -> None:
    """Each stage of expert width e_s > 1 holds a mixture-of-experts layer of ``profile``, and
    e_s divides the experts of each of its MoE layers (the expert shards the runtime cuts).
    In a chunked plan (v > 1: interleaved, the V schedules) e_s is its device group's, which
    each chunk carries: a chunk without MoE layers is dense there (its all-to-alls and expert
    state are none) when another chunk of its group holds some.

    Args:
        plan: the plan, already checked against the profile's layer count.
        profile: the model profile it is simulated or costed with.
        what: the profile, named for the message (``--profile 'p.json'``).

    Raises:
        ValidationError: naming the stage, its e_s and the layers' experts.
    """

    def moe_of(st: StagePlan) -> list[MoEProfile]:
        return [x.moe for x in profile.layers[st.layers[0] : st.layers[1]] if x.moe is not None]

    expert_groups = {st.devices for st in plan.stages if moe_of(st)}
    for s, st in enumerate(plan.stages):
        if not st.parallel.expert_parallel:
            continue
        e = st.expert_width
        a, b = st.layers
        moe = moe_of(st)
        require(
            bool(moe) or (plan.virtual_stages > 1 and st.devices in expert_groups),
            f"plan stage {s} [{a}, {b}): expert_width {e}, but {what} has no mixture-of-experts "
            "layer there: expert parallelism would have nothing to shard",
        )
        bad = sorted({m.experts for m in moe if m.experts % e})
        require(
            not bad,
            f"plan stage {s} [{a}, {b}): expert_width {e} does not divide its layers' "
            f"{', '.join(map(str, bad))} experts ({what})",
        )

"""Cost model of the schedules beyond the paper: interleaved 1F1B and ZB-H1.

Pure, no torch. GPipe and DAPPLE keep the paper's latency L (equations 1-3,
:func:`dapple.planner.cost.pipeline_latency`); :func:`schedule_latency` dispatches on the
plan's schedule. For the newer schedules the step time follows their published bubbles, taken
over the slowest device group (or stage) so that uneven stages are covered conservatively:

* interleaved 1F1B (Narayanan et al., SC 2021, section 2.2.2): P device groups with v chunks;
  a group's per-micro-batch work is ``T_g = sum over its chunks of (F + B)``, the bubble
  ``(P-1)/v`` of it: ``L = (M + (P-1)/v) max_g T_g``;
* ZB-H1 (Qi et al., ICLR 2024, section 2.1): stage s's backward splits into I_s (input
  gradient) and W_s (weight gradient), the bubble is ``(S-1)(F + I - W)``:
  ``L = M max_s (F_s + I_s + W_s) + (S-1) max(0, max_s (F_s + I_s - W_s))``.

Both add the point-to-point time of one micro-batch through every stage boundary and back
(the fill and drain pay it once; the steady state overlaps it with compute) and the largest
gradient AllReduce of a device (the sum over its stages). With free communication and
uniform stages both equal the simulator's step time exactly; with uneven stages they are
estimates (the simulator is the reference): ZB-H1's W passes may not fit its bubbles when
W > F, and uneven interleaved chunks stall each other beyond the ``(P-1)/v`` bubble.

Memory: :func:`activation_peak_bytes` replays a plan's compute order and returns the largest
activation footprint of each device group, whatever the schedule.
"""

from __future__ import annotations

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, split_sizes, transfers
from dapple.core.profile import ModelProfile
from dapple.planner.comm import allreduce_ms, transfer_ms
from dapple.planner.cost import compute_ms, pipeline_latency, stage_compute_ms
from dapple.planner.lengths import profile_for_plan
from dapple.planner.memory import boundary_bytes, device_state_bytes, held_activation_bytes
from dapple.schedule.ir import ActionKind
from dapple.schedule.lower import plan_compute_order

__all__ = [
    "activation_peak_bytes",
    "device_memory_by_group",
    "schedule_latency",
    "split_backward_ms",
]

K = ActionKind


def split_backward_ms(
    profile: ModelProfile,
    cluster: Cluster,
    layers: tuple[int, int],
    samples: int,
    *,
    recompute: bool = False,
) -> tuple[float, float]:
    """``(I, W)``: the input- and weight-gradient halves of the backward of layers
    ``[start, end)`` on ``samples`` samples (:meth:`LayerProfile.backward_split`: measured, or
    the documented assumed split). A re-computed forward runs before ``I`` and counts there.
    The first stage's inputs carry no gradient: the runtime runs its whole backward as ``W``
    (:mod:`dapple.models.split_backward`), and so does this.
    """
    s, e = layers
    i = w = 0.0
    for layer in profile.layers[s:e]:
        li, lw = (0.0, layer.backward.at(samples)) if s == 0 else layer.backward_split(samples)
        i, w = i + li, w + lw
    f = compute_ms(profile, cluster, layers, samples)[0] if recompute else 0.0
    return i * cluster.compute_slowdown + f, w * cluster.compute_slowdown


def _boundary_ms(plan: Plan, profile: ModelProfile, cluster: Cluster) -> float:
    """One micro-batch's activations forward and gradients backward across every stage
    boundary, the slowest slice transfer of each boundary."""
    total = 0.0
    b = plan.micro_batch_size
    for s in range(plan.num_stages - 1):
        src, dst = plan.stages[s], plan.stages[s + 1]
        worst = 0.0
        for j, k, lo, hi in transfers(b, src.replicas, dst.replicas):
            nbytes = float(boundary_bytes(profile, dst.layers[0], hi - lo))
            worst = max(
                worst,
                transfer_ms(cluster, nbytes, src.devices[j], dst.devices[k])
                + transfer_ms(cluster, nbytes, dst.devices[k], src.devices[j]),
            )
        total += worst
    return total


def _allreduce_ms(plan: Plan, profile: ModelProfile, cluster: Cluster) -> float:
    """The largest sum of a device group's stage AllReduces, AR(P_s, g_s)."""
    worst = 0.0
    for g in range(plan.num_groups):
        group = 0.0
        for k in range(g, plan.num_stages, plan.num_groups):
            st = plan.stages[k]
            pbytes = sum(x.parameter_bytes for x in profile.layers[slice(*st.layers)])
            group += allreduce_ms(cluster, pbytes, st.devices)
        worst = max(worst, group)
    return worst


def schedule_latency(plan: Plan, profile: ModelProfile, cluster: Cluster) -> float:
    """Predicted step time of ``plan`` in ms under its schedule (module docstring).

    Raises:
        ValidationError: the plan does not fit the profile (from the cost model).
    """
    if plan.schedule in ("gpipe", "dapple"):
        return float(pipeline_latency(plan, profile, cluster).L_ms)
    profile = profile_for_plan(profile, plan)
    b, M = plan.micro_batch_size, plan.num_micro_batches
    fixed = _boundary_ms(plan, profile, cluster) + _allreduce_ms(plan, profile, cluster)
    if plan.schedule == "interleaved":
        P, v = plan.num_groups, plan.virtual_stages
        work = [
            sum(
                sum(stage_compute_ms(profile, cluster, plan.stages[k], b))
                for k in range(g, plan.num_stages, P)
            )
            for g in range(P)
        ]
        return (M + (P - 1) / v) * max(work) + fixed
    S = plan.num_stages
    per: list[float] = []
    bubble = 0.0
    for st in plan.stages:
        n = split_sizes(b, st.replicas)[0]
        f = compute_ms(profile, cluster, st.layers, n)[0]
        i, w = split_backward_ms(profile, cluster, st.layers, n, recompute=st.recompute)
        per.append(f + i + w)
        bubble = max(bubble, f + i - w)
    return M * max(per) + (S - 1) * bubble + fixed


def activation_peak_bytes(plan: Plan, profile: ModelProfile) -> list[float]:
    """Largest activation bytes each device group holds at once, by replaying the plan's
    compute order: F adds its stage's held activations (slowest replica's slice), B or W
    frees them (the weight gradient needs the layers' inputs, so ZB-H1 holds them until W).

    Returns:
        one value per device group (stage g of the first P stages).
    """
    profile = profile_for_plan(profile, plan).for_memory
    order = plan_compute_order(plan)
    peaks = []
    for g in range(plan.num_groups):
        n = split_sizes(plan.micro_batch_size, plan.stages[g].replicas)[0]
        level = peak = 0.0
        for a in order[g]:
            held = float(held_activation_bytes(profile, plan.stages[a.stage], n))
            if a.kind is K.FORWARD:
                level += held
                peak = max(peak, level)
            elif a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT):
                level -= held
        peaks.append(peak)
    return peaks


def device_memory_by_group(plan: Plan, profile: ModelProfile) -> list[float]:
    """Peak memory of each device group's first replica under the plan's schedule: the
    parameter state of all its stages (v chunks with interleaving), the activation peak of
    :func:`activation_peak_bytes`, and a re-computing stage's full activations of the one
    micro-batch being re-computed.

    Returns:
        one value per device group (stage g of the first P stages), bytes.
    """
    peaks = activation_peak_bytes(plan, profile)
    profile = profile_for_plan(profile, plan).for_memory
    out = []
    for g in range(plan.num_groups):
        n = split_sizes(plan.micro_batch_size, plan.stages[g].replicas)[0]
        mine = [plan.stages[k] for k in range(g, plan.num_stages, plan.num_groups)]
        static = float(device_state_bytes(profile, mine))
        transient = max(
            (
                sum(x.kept_activation_bytes_per_sample for x in profile.layers[slice(*st.layers)])
                * n
                for st in mine
                if st.recompute
            ),
            default=0.0,
        )
        out.append(static + peaks[g] + transient)
    return out

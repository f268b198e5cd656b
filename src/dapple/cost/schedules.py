"""Cost model of the schedules beyond the paper: interleaved 1F1B and ZB-H1.

Pure, no torch. GPipe and DAPPLE keep the paper's latency L (equations 1-3,
:func:`dapple.cost.pipeline.pipeline_latency`); :func:`schedule_latency` dispatches on the
plan's schedule, over the plan's terms (:func:`dapple.cost.terms.stage_terms`). For the newer
schedules the step time follows their published bubbles, taken over the slowest device group
(or stage) so that uneven stages are covered conservatively:

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
from dapple.core.plan import Plan, split_sizes
from dapple.core.profile import ModelProfile
from dapple.cost.lengths import profile_for_plan
from dapple.cost.memory import device_state_bytes, held_activation_bytes
from dapple.cost.pipeline import in_flight_bounds
from dapple.cost.terms import PlanTerms, stage_terms
from dapple.schedule.ir import ActionKind
from dapple.schedule.lower import plan_compute_order

__all__ = [
    "activation_peak_bytes",
    "device_memory_by_group",
    "schedule_latency",
    "schedule_step_ms",
]

K = ActionKind


def _boundary_ms(terms: PlanTerms) -> float:
    """One micro-batch's activations forward and gradients backward across every stage
    boundary, the slowest slice transfer of each boundary."""
    total = 0.0
    for boundary in terms.boundaries:
        worst = 0.0
        for x in boundary.transfers:
            worst = max(worst, x.forward_ms + x.backward_ms)
        total += worst
    return total


def _allreduce_ms(terms: PlanTerms) -> float:
    """The largest sum of a device group's stage AllReduces, AR(P_s, g_s)."""
    plan = terms.plan
    worst = 0.0
    for g in range(plan.num_groups):
        group = 0.0
        for k in range(g, plan.num_stages, plan.num_groups):
            group += terms.stages[k].allreduce_ms
        worst = max(worst, group)
    return worst


def schedule_step_ms(terms: PlanTerms) -> float:
    """Predicted step time in ms of the plan of ``terms`` under its schedule (module
    docstring): L (:meth:`PlanTerms.pipeline <dapple.cost.terms.PlanTerms.pipeline>`,
    equations 1-3) for GPipe and DAPPLE, the published bubbles for interleaved 1F1B and ZB-H1.
    """
    plan = terms.plan
    if plan.schedule in ("gpipe", "dapple"):
        return terms.pipeline(in_flight_bounds(plan)[1]).latency().L_ms
    M = plan.num_micro_batches
    fixed = _boundary_ms(terms) + _allreduce_ms(terms)
    if plan.schedule == "interleaved":
        P, v = plan.num_groups, plan.virtual_stages
        work = [
            sum(
                terms.stages[k].terms.forward_ms + terms.stages[k].terms.backward_ms
                for k in range(g, plan.num_stages, P)
            )
            for g in range(P)
        ]
        return (M + (P - 1) / v) * max(work) + fixed
    S = plan.num_stages
    per: list[float] = []
    bubble = 0.0
    for st in terms.stages:
        r = st.replicas[0]  # the slowest replica's slice
        f, i, w = r.forward_ms, r.input_grad_ms, r.weight_grad_ms
        per.append(f + i + w)
        bubble = max(bubble, f + i - w)
    return M * max(per) + (S - 1) * bubble + fixed


def schedule_latency(plan: Plan, profile: ModelProfile, cluster: Cluster) -> float:
    """Predicted step time of ``plan`` in ms under its schedule (:func:`schedule_step_ms` of
    :func:`~dapple.cost.terms.stage_terms`).

    Raises:
        ValidationError: the plan does not fit the profile (from the cost model).
    """
    return schedule_step_ms(stage_terms(plan, profile, cluster))


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

"""DAPPLE cost model (paper section 5.1): the terms of a plan and its step time. Pure, no torch.

One module per term, each a set of pure functions over frozen dataclasses
(:class:`~dapple.core.profile.ModelProfile`, :class:`~dapple.core.cluster.Cluster`,
:class:`~dapple.core.plan.Plan`):

* :mod:`~dapple.cost.compute` - F_s, B_s of a stage's slice and the split backward's I, W;
* :mod:`~dapple.cost.comm` - transfers, comm stages, AR(P_s, g_s), ZeRO's synchronisation, U_s;
* :mod:`~dapple.cost.memory` - parameter state, kept activations, D (micro-batches that fit);
* :mod:`~dapple.cost.tensor` - a stage of tensor width t_s (Megatron's all-reduces, compute and
  memory / t_s) and ZeRO-3's gathers (beyond the paper);
* :mod:`~dapple.cost.host` and :mod:`~dapple.cost.sharing` - host CPU overheads and shared
  compute cores (beyond the paper);
* :mod:`~dapple.cost.replica_shares` - replicas of different speeds: a stage's time as its
  slowest replica's on its share of a micro-batch, and the shares that balance them;
* :mod:`~dapple.cost.overlap` - the data-parallel and ZeRO traffic another training framework
  hides under compute (beyond the paper; dapple's runtime hides none, the default);
* :mod:`~dapple.cost.at_length` - a profile measured at several sequence lengths, at the
  lengths a plan is for;
* :mod:`~dapple.cost.latency` - L = T_w + T_s + T_e over per-stage arrays (equations 1-3);
* :mod:`~dapple.cost.terms` - the one assembly of a plan's terms (:func:`stage_terms`) and of
  the arrays of equations 1-3 (:func:`pipeline_terms`);
* :mod:`~dapple.cost.pipeline` - L of a GPipe or DAPPLE plan with per-stage rows
  (:func:`pipeline_latency`);
* :mod:`~dapple.cost.schedule_step` - the step time of every schedule (:func:`schedule_latency`) and
  memory per device group.

The planner (:mod:`dapple.planner`) searches with it; the simulator (:mod:`dapple.simulate`)
runs a plan's schedule with the same terms.
"""

from dapple.cost.latency import Latency, latency, steady_periods
from dapple.cost.pipeline import LatencyBreakdown, StageCost, pipeline_latency
from dapple.cost.schedule_step import schedule_latency, schedule_step_ms
from dapple.cost.terms import (
    PipelineTerms,
    PlanTerms,
    StageTerms,
    pipeline_terms,
    stage_terms,
)

__all__ = [
    "Latency",
    "LatencyBreakdown",
    "PipelineTerms",
    "PlanTerms",
    "StageCost",
    "StageTerms",
    "latency",
    "pipeline_latency",
    "pipeline_terms",
    "schedule_latency",
    "schedule_step_ms",
    "stage_terms",
    "steady_periods",
]

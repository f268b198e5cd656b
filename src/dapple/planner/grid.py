"""The torchtitan-style uniform grid as a baseline planner: G = dp x tp x pp, scored by the cost model.

torchtitan (and Megatron-LM) lay a job out on a device mesh ``[pp, dp, tp]``, tp innermost: every
pipeline stage gets the same dp x tp devices, a contiguous block (pipeline rank i the i-th
block), each replica a tensor group of tp consecutive devices inside one server. The grid tries
every factorisation G = dp x tp x pp with tp in :data:`~dapple.core.tensor_layout.TENSOR_WIDTHS`
dividing the server size, and for each:

* the layers split into pp stages (pp x v with interleaving) as torchtitan's
  ``generate_llm_fqn_per_model_part`` splits them (:func:`torchtitan_cuts`);
* the replicas plain DDP (ZeRO 0) or FSDP (ZeRO-3, gathering the parameters once per step, or
  re-gathering them per micro-batch where memory needs it, :data:`ZERO3_REGATHER`);
* every M the global batch B allows: each replica gets a whole local batch (dp divides B) and
  M divides it, so every micro-batch splits evenly over the replicas (pp = 1: M is gradient
  accumulation, no pipeline);
* 1F1B (DAPPLE's early backward, policy A: K_i = S - i) and, for pp > 1, interleaved 1F1B with
  v of :data:`INTERLEAVED_CHUNKS` chunks per rank (torchtitan's default for a multi-stage
  schedule is v = 2).

No re-computation or in-flight bound D is added: activation checkpointing is the profile's
(``analytic_profile(recompute=...)``), and a stage must hold the K_i micro-batches its schedule
keeps in flight. A stage of width > 1 holding no shardable layer (``LayerProfile.tensor_parallel``)
is refused, as the DAPPLE search refuses it (its t ranks would repeat its work). M runs over
:func:`~dapple.planner.search.micro_batch_candidates` of the local batch (every divisor up to 64
of them). Each candidate gets L and the memory fit from the same cost model as the
DAPPLE search: 1F1B through :class:`~dapple.planner.scorer.Scorer` (equations 1-3), interleaved
1F1B through :func:`~dapple.cost.schedule_latency` and
:func:`~dapple.cost.schedule_step.device_memory_by_group`. :func:`grid_plan` returns the feasible
candidate of least L. Pure, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from dapple.core.cluster import Cluster
from dapple.core.parallelism import Parallelism
from dapple.core.plan import DEFAULT_SCHEDULE, Plan, StagePlan
from dapple.core.planning_options import ZeroChoice
from dapple.core.profile import ModelProfile
from dapple.core.tensor_layout import TENSOR_WIDTHS
from dapple.cost.schedule_step import device_memory_by_group, schedule_latency
from dapple.errors import InfeasibleError, ValidationError
from dapple.planner.batches import (
    check_batch_argument,
    divisors,
    infeasible_message,
    micro_batch_candidates,
)
from dapple.planner.scorer import Scored, Scorer
from dapple.planner.zero_modes import ZERO3_REGATHER, ZeroMode, zero3_modes

__all__ = [
    "INTERLEAVED",
    "INTERLEAVED_CHUNKS",
    "MAX_INTERLEAVED_ACTIONS",
    "GridCandidate",
    "GridPoint",
    "factorisations",
    "grid_candidates",
    "grid_plan",
    "grid_points",
    "point_plan",
    "torchtitan_cuts",
]

MAX_INTERLEAVED_ACTIONS = 1 << 16
"""Most compute actions (M x pp x v per replica) an interleaved grid point may have: its memory
is found by replaying its compute order, so larger M are left out to keep planning bounded."""

INTERLEAVED_CHUNKS = (2,)
"""v, model chunks per pipeline rank of the interleaved candidates: torchtitan's default for a
multi-stage schedule without ``pipeline_parallel_layers_per_stage``."""

INTERLEAVED = "interleaved"
"""The schedule name of the interleaved grid points."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GridPoint:
    """One grid configuration: dp x tp x pp devices, M micro-batches, sharding and schedule."""

    dp: int
    """Replicas of every stage (r_s)."""
    tp: int
    """Tensor width of every stage (t_s)."""
    pp: int
    """Pipeline ranks (device groups)."""
    M: int
    """Micro-batches per step."""
    zero_stage: int
    """0: DDP; 3: FSDP, re-gathering per micro-batch only where memory needs it (per stage
    under 1F1B, on every stage under interleaved 1F1B)."""
    schedule: str = DEFAULT_SCHEDULE
    """``dapple`` (1F1B, policy A) or ``interleaved``."""
    v: int = 1
    """Model chunks per pipeline rank (interleaved only)."""

    @property
    def parallel(self) -> Parallelism:
        """Every stage's layout: dp replicas of tensor width tp, plain DDP or FSDP (ZeRO-3)."""
        return Parallelism(replicas=self.dp, tensor_width=self.tp, zero_stage=self.zero_stage)

    @property
    def label(self) -> str:
        """``dp8 x tp8 x pp1 FSDP M=2 1F1B``-style text."""
        shard = "FSDP" if self.parallel.shards_params else "DDP"
        sched = f"interleaved v={self.v}" if self.schedule == INTERLEAVED else "1F1B"
        return f"dp{self.dp} x tp{self.tp} x pp{self.pp} {shard} M={self.M} {sched}"


@dataclass(frozen=True, slots=True)
class GridCandidate:
    """A scored grid point."""

    point: GridPoint
    plan: Plan
    """The point as a plan (``planner="grid"``); ``predicted_step_ms`` is L, NaN when it does
    not fit."""
    L_ms: float
    """The cost model's L in ms; ``math.inf`` when the plan does not fit device memory."""

    @property
    def fits(self) -> bool:
        return math.isfinite(self.L_ms)


def torchtitan_cuts(num_layers: int, num_stages: int) -> list[int]:
    """Stage boundaries of torchtitan's split of N layers into S stages.

    ``generate_llm_fqn_per_model_part`` (torchtitan ``distributed/pipeline_parallel.py``) counts
    the embedding and the norm + output as one effective layer each (its default weights) and
    gives every stage ``N // S`` effective layers, the first ``N % S`` stages one more. A profile
    whose chain is embedding, blocks, head (``analytic_profile``) has exactly those N effective
    layers, so its layer i is torchtitan's effective layer i.

    Raises:
        ValidationError: S < 1 or S > N (a stage would be empty).
    """
    if not 1 <= num_stages <= num_layers:
        raise ValidationError(
            f"torchtitan's split needs 1 <= stages <= layers, got {num_stages} stages of "
            f"{num_layers} layers"
        )
    q, rem = divmod(num_layers, num_stages)
    cuts = [0]
    for i in range(num_stages):
        cuts.append(cuts[-1] + q + (1 if i < rem else 0))
    return cuts


def factorisations(profile: ModelProfile, cluster: Cluster) -> list[tuple[int, int, int]]:
    """``(dp, tp, pp)`` with dp x tp x pp = G: tp of :data:`TENSOR_WIDTHS` dividing the server
    size (1 alone when no layer shards, ``LayerProfile.tensor_parallel``) and, where the profile
    records them, the model's sizes (``ModelProfile.tensor_widths``), pp <= N."""
    G, N = cluster.num_devices, profile.num_layers
    shards = any(x.tensor_parallel for x in profile.layers)
    cuttable = profile.tensor_widths
    out = []
    for tp in TENSOR_WIDTHS:
        if cluster.devices_per_server % tp or (tp > 1 and not shards):
            continue
        if tp > 1 and cuttable is not None and tp not in cuttable:
            continue
        for pp in divisors(G // tp):
            if pp <= N:
                out.append((G // (tp * pp), tp, pp))
    return out


def grid_points(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    *,
    interleaved: bool = True,
    micro_batches: Sequence[int] | None = None,
) -> list[GridPoint]:
    """Every grid point (module docstring): factorisations x zero stage x M x schedule.

    ``interleaved=False`` leaves out the interleaved points; an interleaved point of more than
    :data:`MAX_INTERLEAVED_ACTIONS` compute actions (M x pp x v) is left out too (its memory
    replays its compute order). ``micro_batches``: M only among these (each dividing the local
    batch) instead of :func:`~dapple.planner.batches.micro_batch_candidates` of it.
    """
    B, N = global_batch_size, profile.num_layers
    out = []
    for dp, tp, pp in factorisations(profile, cluster):
        if B % dp:
            continue  # a replica's local batch must be whole
        local = B // dp
        Ms = (
            micro_batch_candidates(local)
            if micro_batches is None
            else [m for m in micro_batches if local % m == 0]
        )
        for z in (0, 3) if dp > 1 else (0,):
            for M in Ms:
                base = GridPoint(dp=dp, tp=tp, pp=pp, M=M, zero_stage=z)
                out.append(base)
                for v in INTERLEAVED_CHUNKS if pp > 1 and interleaved else ():
                    if pp * v <= N and M % pp == 0 and M * pp * v <= MAX_INTERLEAVED_ACTIONS:
                        out.append(dataclasses.replace(base, schedule=INTERLEAVED, v=v))
    return out


def point_plan(
    profile: ModelProfile, B: int, p: GridPoint, regather: Sequence[bool], L_ms: float
) -> Plan:
    """The plan of grid point ``p``: virtual stage k on pipeline rank k mod pp, whose dp x tp
    devices are the (k mod pp)-th contiguous block; ``regather`` per (virtual) stage. FSDP
    leaves whole a stage holding a tied parameter's copy (:func:`zero3_modes`)."""
    cuts = torchtitan_cuts(profile.num_layers, p.pp * p.v)
    width = p.dp * p.tp
    fsdp = p.parallel.shards_params

    def fsdp_on(k: int) -> bool:
        return fsdp and bool(zero3_modes(profile, cuts[k], cuts[k + 1]))

    stages = tuple(
        StagePlan(
            layers=(cuts[k], cuts[k + 1]),
            devices=tuple(range((k % p.pp) * width, (k % p.pp + 1) * width)),
            zero_stage=p.zero_stage if fsdp_on(k) or not fsdp else 0,
            tensor_width=p.tp,
            regather=regather[k] and fsdp_on(k),
        )
        for k in range(p.pp * p.v)
    )
    return Plan(
        planner="grid",
        model_name=profile.model_name,
        global_batch_size=B,
        micro_batch_size=B // p.M,
        num_micro_batches=p.M,
        stages=stages,
        schedule=p.schedule,
        virtual_stages=p.v,
        policy="A",
        predicted_step_ms=L_ms if math.isfinite(L_ms) else math.nan,
    )


class _Scorers:
    """One :class:`Scorer` per (tensor width, zero stage or mode), shared by the points (its
    caches)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, B: int) -> None:
        self.profile, self.cluster, self.B = profile, cluster, B
        self._by: dict[tuple[int, ZeroChoice | ZeroMode], Scorer] = {}

    def get(self, tp: int, zero_stage: ZeroChoice | ZeroMode) -> Scorer:
        key = (tp, zero_stage)
        if key not in self._by:
            self._by[key] = Scorer(self.profile, self.cluster, self.B, zero_stage, tp)
        return self._by[key]


def _score_1f1b(sc: _Scorers, p: GridPoint) -> tuple[float, tuple[bool, ...]]:
    """L and per-stage regather of a 1F1B point (inf when it does not fit): FSDP takes the
    better of the scorer's per-stage choice (gather once, re-gather where memory needs it)
    and re-gathering on every stage."""
    cuts = torchtitan_cuts(sc.profile.num_layers, p.pp)
    stages = [(cuts[i], cuts[i + 1], tuple(range(i * p.dp, (i + 1) * p.dp))) for i in range(p.pp)]
    best: tuple[float, tuple[bool, ...]] = (math.inf, (False,) * p.pp)
    zs: tuple[ZeroChoice | ZeroMode, ...] = (
        _fsdp_scorers(sc.profile) if p.parallel.shards_params else (0,)
    )
    for z in zs:
        got = sc.get(p.tp, z).score(stages, p.M, policies=("A",), recompute=False)
        if got is None or not _holds_schedule(got) or got.L_ms >= best[0]:
            continue
        best = (got.L_ms, tuple(m.regather for m in got.zero_modes))
    return best


def _fsdp_scorers(profile: ModelProfile) -> tuple[ZeroChoice | ZeroMode, ...]:
    """The scorers' zero stage for FSDP: 3 (each stage gathers once or re-gathers, whichever
    the scorer picks) and, where re-gathering is allowed, :data:`ZERO3_REGATHER` on every
    stage; none where a tied parameter's copy cannot be sharded (:func:`zero3_modes`)."""
    modes = zero3_modes(profile)
    if not modes:
        return ()
    return (3, ZERO3_REGATHER) if ZERO3_REGATHER in modes else (3,)


def _holds_schedule(got: Scored) -> bool:
    """The scored plan runs 1F1B unchanged: every stage holds its K_i (no bound D)."""
    return all(d is None for d in got.max_in_flight)


def _score_interleaved(sc: _Scorers, p: GridPoint) -> tuple[float, tuple[bool, ...]]:
    """L and per-stage regather of an interleaved point through the schedule's own step rule;
    FSDP gathers once per step where that fits, else re-gathers on every stage."""
    S = p.pp * p.v
    if p.parallel.tensor_parallel and not _every_stage_shards(sc.profile, p):
        return math.inf, (False,) * S
    if p.parallel.shards_params and any(x.tied_parameter_bytes for x in sc.profile.layers):
        return math.inf, (False,) * S  # FSDP on every chunk: the tied copies' too (none)
    regathers = ZERO3_REGATHER in zero3_modes(sc.profile) and p.parallel.shards_params
    for regather in (False, True) if regathers else (False,):
        flags = (regather,) * S
        plan = point_plan(sc.profile, sc.B, p, flags, math.nan)
        peak = max(device_memory_by_group(plan, sc.profile))
        if peak <= sc.cluster.usable_memory_bytes:
            return schedule_latency(plan, sc.profile, sc.cluster), flags
    return math.inf, (False,) * S


def _every_stage_shards(profile: ModelProfile, p: GridPoint) -> bool:
    """Each (virtual) stage holds a shardable layer; the scorer refuses a stage of width > 1
    without one (its t ranks would repeat its work), and so does the interleaved path."""
    cuts = torchtitan_cuts(profile.num_layers, p.pp * p.v)
    shards = [x.tensor_parallel for x in profile.layers]
    return all(any(shards[cuts[k] : cuts[k + 1]]) for k in range(p.pp * p.v))


def grid_candidates(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    *,
    interleaved: bool = True,
    micro_batches: Sequence[int] | None = None,
) -> list[GridCandidate]:
    """Every grid point of :func:`grid_points` (``interleaved`` and ``micro_batches`` as
    there) scored by the cost model, in enumeration order.

    Raises:
        ValidationError: the global batch size is not an integer >= 1 or above the planner's
            limit (:func:`~dapple.planner.batches.check_batch_argument`).
    """
    check_batch_argument(global_batch_size)
    sc = _Scorers(profile, cluster, global_batch_size)
    out = []
    points = grid_points(
        profile, cluster, global_batch_size, interleaved=interleaved, micro_batches=micro_batches
    )
    for p in points:
        score = _score_interleaved if p.schedule == INTERLEAVED else _score_1f1b
        L, regather = score(sc, p)
        out.append(GridCandidate(p, point_plan(profile, global_batch_size, p, regather, L), L))
    return out


def grid_plan(profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> Plan:
    """The torchtitan-style grid's best plan: the feasible grid point of least L (the earlier
    in :func:`grid_points` order on ties), ``planner="grid"``.

    Raises:
        ValidationError: bad global batch size (:func:`grid_candidates`).
        InfeasibleError: no grid point fits device memory.
    """
    best: GridCandidate | None = None
    for c in grid_candidates(profile, cluster, global_batch_size):
        if c.fits and (best is None or c.L_ms < best.L_ms):
            best = c
    if best is None:
        raise InfeasibleError("grid: " + infeasible_message(profile, cluster, global_batch_size))
    return best.plan

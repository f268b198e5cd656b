"""Fast scoring of candidate plans under the cost model, shared by search, baselines and oracle.

A candidate is a list of ``(start, end, devices)`` stages plus M. The :class:`Scorer` caches
per-stage terms (prefix sums over layers, AllReduce, split-concat link loads) so the DP can
score many candidates sharing stages, decides per stage whether to re-compute and the
in-flight bound D when memory demands it, tries warm-up policies A and B, and evaluates L
through the cost model's one assembly of equations 1-3, :func:`dapple.cost.terms.pipeline_terms`
(with the CPU-host pass where the cluster has host terms), from :class:`StageTerms` built of its
cached sums - the assembly :func:`dapple.cost.pipeline.pipeline_latency` runs for the resulting
:class:`Plan`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from dapple.core.cluster import Cluster
from dapple.core.parallelism import Parallelism
from dapple.core.plan import DEFAULT_SCHEDULE, Plan, Policy, StagePlan
from dapple.core.planning_options import ZeroChoice
from dapple.core.profile import ModelProfile
from dapple.core.recompute import full_if
from dapple.cost.comm import busiest_link_ms, link_loads, stage_sync_ms, stage_update_ms
from dapple.cost.cpu_clock import on_wall_clock
from dapple.cost.host import HostExtra, has_host_terms, stage_host_extras
from dapple.cost.memory import boundary_bytes, sharded_layer_bytes, tensor_kept_bytes_per_sample
from dapple.cost.peak_memory import in_flight_limit, stage_bytes, stage_state_bytes
from dapple.cost.sharing import slice_work
from dapple.cost.tensor import fsdp_pass_ms, replica_sync_ms
from dapple.cost.terms import StageTerms, pipeline_terms
from dapple.errors import ValidationError
from dapple.planner.shares import kind_shares, kind_stage
from dapple.planner.stage_options import LazyOptions, StageOption, StageOptions, stage_choice
from dapple.planner.widths import TensorSums, group_cluster, real_devices
from dapple.planner.zero_modes import UNSHARDED, ZeroMode, zero3_modes
from dapple.schedule.registry import get_schedule, in_flight_counts, schedules
from dapple.schedule.spec import ScheduleSpec

__all__ = [
    "Scored",
    "Scorer",
    "StageSpec",
    "in_flight",
    "score_options",
    "scored_plan",
]

StageSpec = tuple[int, int, tuple[int, ...]]
"""``(start, end, devices)`` of one computation stage; under a tensor width t > 1 the devices
are tensor groups of :func:`~dapple.planner.widths.group_cluster`."""


@dataclass(frozen=True, slots=True)
class Scored:
    """A scored candidate: L and the per-stage decisions that achieve it."""

    L_ms: float
    policy: Policy
    schedule: str
    recompute: tuple[bool, ...]
    max_in_flight: tuple[int | None, ...]
    zero_modes: tuple[ZeroMode, ...] = ()
    """Per stage: its :class:`ZeroMode` (empty: unsharded)."""


class Scorer:
    """Scores candidate plans of one (profile, cluster, global batch size)."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: Cluster,
        global_batch_size: int,
        zero_stage: ZeroChoice | ZeroMode = 0,
        tensor_width: int = 1,
    ) -> None:
        self.profile = profile
        cluster = on_wall_clock(profile, cluster)  # CPU-time inputs as wall time, as stage_terms
        self.tensor_width = tensor_width
        """t: every stage's tensor width; candidates' devices are then the tensor groups of
        :func:`~dapple.planner.widths.group_cluster` (:attr:`cluster`)."""
        self._tensor_parallel = Parallelism(tensor_width=tensor_width).tensor_parallel  # t > 1
        self.real_cluster = cluster
        cluster = group_cluster(cluster, tensor_width)
        self._tp = TensorSums(profile, cluster, tensor_width)
        self.zero_stage = zero_stage
        """1: replicated stages shard their optimizer state (memory and sync cost, ZeRO-1); 2:
        their gradients too (ZeRO-2); 3: their parameters too (ZeRO-3, gathered once per step
        or re-gathered per micro-batch); a :class:`ZeroMode`: that mode only (e.g.
        :data:`~dapple.planner.zero_modes.ZERO3_REGATHER`); ``auto``: per stage, only where
        the unsharded state leaves too little memory for the micro-batches the schedule keeps
        in flight there without re-computation, then the cheapest of ZeRO-1, ZeRO-2 (its
        M-fold gradient traffic in AR_s), ZeRO-3 and re-computation (M more forward passes)
        that holds them (:func:`~dapple.planner.stage_options.pick_zero_mode`)."""
        self.cluster = cluster
        self.global_batch_size = global_batch_size
        self.N = profile.num_layers
        self.G = cluster.num_devices
        ls = profile.layers
        sd = cluster.compute_slowdown

        def pre(xs: Sequence[float]) -> list[float]:
            return [0.0, *accumulate(xs)]

        t = tensor_width
        k = [t if x.tensor_parallel else 1 for x in ls]  # 1/k of a layer per tensor rank
        self._ff = pre([x.forward.fixed_ms * sd / n for x, n in zip(ls, k, strict=True)])
        self._fp = pre([x.forward.per_sample_ms * sd / n for x, n in zip(ls, k, strict=True)])
        self._bf = pre([x.backward.fixed_ms * sd / n for x, n in zip(ls, k, strict=True)])
        self._bp = pre([x.backward.per_sample_ms * sd / n for x, n in zip(ls, k, strict=True)])
        self._par = pre([sharded_layer_bytes(x, t) for x in ls])
        self._memory = profile.for_memory
        """The layers at the longest planned length: kept activations and stage inputs."""
        self._act = pre([tensor_kept_bytes_per_sample(x, t) for x in self._memory.layers])
        self._ar: dict[tuple[int, int, tuple[int, ...], ZeroMode, int], float] = {}
        self._links: dict[tuple[object, ...], list[tuple[float, float]]] = {}
        self._option_lists: dict[tuple[int, int, tuple[int, ...], int], StageOptions] = {}
        """Each stage's options (:meth:`stage_options`) by ``(s, e, devices, b)``."""
        self._sync_plans: dict[tuple[tuple[int, ...], ZeroMode], StagePlan] = {}
        self._states: dict[tuple[int, int, int, ZeroMode], tuple[float, float]] = {}
        self._memory_options: dict[
            tuple[int, int, int, int, ZeroMode, int, float], tuple[int, int, float]
        ] = {}
        self._zero3: dict[tuple[int, int], tuple[ZeroMode, ...]] = {}
        self._parallels: dict[tuple[int, ZeroMode], Parallelism] = {}
        self.evaluations = 0

    # -- per-stage terms ---------------------------------------------------------------------
    def fb_ms(self, s: int, e: int, samples: int) -> tuple[float, float]:
        """F, B (without re-computation) of layers [s, e) on ``samples`` samples."""
        if samples <= 0:
            return 0.0, 0.0
        f = (self._ff[e] - self._ff[s]) + (self._fp[e] - self._fp[s]) * samples
        b = (self._bf[e] - self._bf[s]) + (self._bp[e] - self._bp[s]) * samples
        if self._tensor_parallel:
            c = self._tp.comm_ms(s, e, samples)
            return f + c, b + c
        return f, b

    def param_bytes(self, s: int, e: int) -> float:
        return self._par[e] - self._par[s]

    def ar_ms(
        self, s: int, e: int, devices: tuple[int, ...], mode: ZeroMode = UNSHARDED, M: int = 1
    ) -> float:
        """AR_s of layers [s, e) on ``devices`` under ``mode`` with M micro-batches
        (:func:`~dapple.cost.comm.stage_sync_ms`)."""
        par = self.parallel(len(devices), mode)
        reductions = par.gradient_reductions(M)
        key = (s, e, devices, mode, reductions)
        v = self._ar.get(key)
        if v is None:
            if not par.tensor_parallel and not par.shards_params:
                v = stage_sync_ms(self.cluster, self.param_bytes(s, e), devices, reductions)
            else:
                v = replica_sync_ms(
                    self.real_cluster,
                    self.param_bytes(s, e),
                    self._sync_plan(devices, mode),
                    par,
                    M,
                )
            self._ar[key] = v
        return v

    def parallel(self, replicas: int, mode: ZeroMode) -> Parallelism:
        """The layout of ``replicas`` tensor groups of the scorer's width under ``mode``."""
        got = self._parallels.get((replicas, mode))
        if got is None:
            t, z, again = self.tensor_width, mode.stage, mode.regather
            got = Parallelism(replicas=replicas, tensor_width=t, zero_stage=z, regather=again)
            self._parallels[replicas, mode] = got
        return got

    def _sync_plan(self, devices: tuple[int, ...], mode: ZeroMode) -> StagePlan:
        """A :class:`StagePlan` on ``devices`` for the terms its layers do not enter (AR_s,
        ZeRO-3's gathers), cached: a plan's validation is linear in its devices. Modes that
        gather once per step share the plan of zero stage 0: AR_s takes the layout as an
        argument (:func:`~dapple.cost.tensor.replica_sync_ms`), only the re-gathering mode's
        terms read it from the plan (:func:`~dapple.cost.tensor.fsdp_pass_ms`)."""
        key = (devices, mode if mode.regather else mode._replace(stage=0))
        got = self._sync_plans.get(key)
        if got is None:
            got = self._sync_plans[key] = self.stage_plan(0, 1, devices, key[1])
        return got

    def stage_plan(self, s: int, e: int, devices: tuple[int, ...], mode: ZeroMode) -> StagePlan:
        """The :class:`StagePlan` of layers [s, e) on ``devices`` (tensor groups when t > 1)
        under a scored :class:`ZeroMode`."""
        return StagePlan(
            layers=(s, e),
            devices=real_devices(devices, self.tensor_width),
            zero_stage=mode.stage,
            tensor_width=self.tensor_width,
            regather=mode.regather,
        )

    def comm_ms(
        self,
        cut: int,
        src: tuple[int, ...],
        dst: tuple[int, ...],
        b: int,
        src_shares: tuple[int, ...] | None = None,
        dst_shares: tuple[int, ...] | None = None,
    ) -> float:
        """Comm stage time across ``cut`` (as :func:`dapple.cost.comm.comm_stage_ms`), the
        slices on either side even or the stages' shares (:func:`~dapple.planner.shares.
        kind_shares` on a cluster with device kinds).

        The split-concat link loads depend on the device sets, b and the shares only; they are
        cached (:func:`dapple.cost.comm.link_loads`) and scaled by the boundary bytes.
        """
        key = (src, dst, b, src_shares, dst_shares)
        links = self._links.get(key)
        if links is None:
            links = link_loads(self.cluster, src, dst, b, src_shares, dst_shares)
            self._links[key] = links
        return busiest_link_ms(links, boundary_bytes(self.profile, cut, 1))

    def _options(
        self,
        s: int,
        e: int,
        samples: int,
        replicas: int,
        mode: ZeroMode,
        M: int,
        usable: float | None = None,
    ) -> tuple[int, int, float]:
        """D without and with re-computation of layers [s, e) on slices of ``samples``
        (:func:`~dapple.cost.peak_memory.in_flight_limit` of the step peak), and a floor of
        the bytes one micro-batch needs under either that no longer stage on the same devices
        is below: the always-held state and one micro-batch's kept activations. ``usable``:
        the device memory a stage may fill (default the cluster's, the smallest kind's)."""
        usable = float(self.cluster.usable_memory_bytes) if usable is None else usable
        key = (s, e, samples, replicas, mode, M, usable)
        got = self._memory_options.get(key)
        if got is not None:  # placements of the same replica count share it
            return got
        par = self.parallel(replicas, mode)
        state = self._states.get((s, e, replicas, mode))
        if state is None:  # the same whatever the slice
            state = stage_state_bytes(self._memory, (s, e), par)
            self._states[s, e, replicas, mode] = state
        plain, redone = stage_bytes(self._memory, (s, e), samples, par, state=state)
        floor = plain.static + plain.shared + (self._act[e] - self._act[s]) * samples
        got = in_flight_limit(plain, usable, M), in_flight_limit(redone, usable, M), floor
        self._memory_options[key] = got
        return got

    def _stage(
        self, s: int, e: int, d: tuple[int, ...], b: int, mode: ZeroMode = UNSHARDED
    ) -> StageOption:
        """The terms of one stage under ``mode`` (kept with the stage's other options by
        :meth:`stage_options`)."""
        M = self.global_batch_size // b
        if self.cluster.kinds:  # replicas of unequal speed or memory: dapple.planner.shares
            f, bw, d_nr, d_r, floor = kind_stage(self, s, e, d, b, mode, M)
        else:
            n = -(-b // len(d))  # split_sizes(b, r)[0], the largest slice
            f, bw = self.fb_ms(s, e, n)
            d_nr, d_r, floor = self._options(s, e, n, len(d), mode, M)
        sync = self.ar_ms(s, e, d, mode, M)
        update = stage_update_ms(
            self.cluster, self.profile, self.param_bytes(s, e), self.parallel(len(d), mode)
        )
        ag, ag_rs = (0.0, 0.0)
        if mode.regather:
            st = self._sync_plan(d, mode)
            ag, ag_rs = fsdp_pass_ms(self.real_cluster, self.param_bytes(s, e), st)
            f, bw = f + ag, bw + ag_rs
        plain = StageTerms(
            forward_ms=f,
            backward_ms=bw,
            sync_ms=sync,
            update_ms=update,
            work=self._work(s, e, d, b, False),
        )
        recomputed = StageTerms(
            forward_ms=f,
            backward_ms=bw + f,
            sync_ms=sync,
            update_ms=update,
            work=self._work(s, e, d, b, True),
        )
        return StageOption(
            f, bw, sync + update, d_nr, d_r, plain, recomputed, floor, M * (ag + ag_rs)
        )

    def _work(
        self, s: int, e: int, d: tuple[int, ...], b: int, recompute: bool
    ) -> tuple[tuple[int, float], ...]:
        """``(device, F + B of its slice)`` per replica of layers [s, e) on ``d``
        (:func:`dapple.cost.sharing.slice_work`), on shared compute cores only (empty
        otherwise: only the CPU-host pass on shared cores reads it)."""
        if self.cluster.compute_cores_per_server is None:
            return ()
        return tuple(slice_work(d, b, lambda n: self.fb_ms(s, e, n), recompute))

    def stage_options(self, s: int, e: int, d: tuple[int, ...], b: int) -> StageOptions:
        """``(zero mode, _stage record)`` the scorer may pick from, unsharded first; none for
        a stage of width t > 1 with no layer that shards (t ranks would repeat its work).
        ZeRO-3 is offered gathering once per step and re-gathering (:func:`zero3_modes`).
        Remembered per ``(s, e, d, b)``: the options are shared, callers only read them; each
        mode is costed when first read (:class:`~dapple.planner.stage_options.LazyOptions`)."""
        key = (s, e, d, b)
        got = self._option_lists.get(key)
        if got is None:
            got = self._option_lists[key] = self._new_options(s, e, d, b)
        return got

    def _new_options(self, s: int, e: int, d: tuple[int, ...], b: int) -> StageOptions:
        if self._tensor_parallel and self._tp.blocks(s, e) == 0:
            return []
        return LazyOptions(self._modes(s, e, len(d)), functools.partial(self._stage, s, e, d, b))

    def _modes(self, s: int, e: int, replicas: int) -> tuple[ZeroMode, ...]:
        """The zero modes :meth:`stage_options` offers layers [s, e) on ``replicas`` devices:
        unsharded on one device, else those of the scorer's :attr:`zero_stage`."""
        z = self.zero_stage
        if replicas == 1:
            return (UNSHARDED,)
        if isinstance(z, ZeroMode):
            return (z,)
        if isinstance(z, str):  # auto
            return (UNSHARDED, ZeroMode(1), ZeroMode(2), *self._zero3_modes(s, e))
        return (self._zero3_modes(s, e) or (UNSHARDED,)) if z == 3 else (ZeroMode(z),)

    def _zero3_modes(self, s: int, e: int) -> tuple[ZeroMode, ...]:
        """:func:`zero3_modes` of layers [s, e), remembered (it reads each layer)."""
        got = self._zero3.get((s, e))
        if got is None:
            got = self._zero3[s, e] = zero3_modes(self.profile, s, e)
        return got

    # -- whole candidates --------------------------------------------------------------------
    def score(
        self,
        stages: Sequence[StageSpec],
        M: int,
        *,
        schedule: str = DEFAULT_SCHEDULE,
        policies: Sequence[Policy] = ("A", "B"),
        recompute: bool | None = None,
    ) -> Scored | None:
        """L of a candidate, or None when it does not fit in memory.

        Args:
            stages: ``(start, end, devices)`` per computation stage, covering all layers.
            M: number of micro-batches (must divide the global batch size).
            schedule: one costed by the paper's L (``dapple``, ``gpipe``: all M micro-batches
                in flight, or a plug-in without a step rule of its own).
            policies: warm-up policies to try (those the schedule has); the best is kept.
            recompute: force re-computation on (True) or off (False) for every stage; None
                re-computes a stage only when memory demands it.

        Raises:
            ValidationError: unknown schedule or policy, or a schedule with its own step rule.
        """
        spec = _scored_schedule(schedule)
        self.evaluations += 1
        b = self.global_batch_size // M
        options = [self.stage_options(s, e, d, b) for (s, e, d) in stages]
        if not all(options):
            return None
        shares = (  # the stages' shares on a cluster with kinds (None: even)
            [kind_shares(self, s, e, d, b) for s, e, d in stages]
            if self.cluster.kinds and len(stages) > 1
            else [None] * len(stages)
        )
        comm = [
            self.comm_ms(stages[i][1], stages[i][2], stages[i + 1][2], b, *shares[i : i + 2])
            for i in range(len(stages) - 1)
        ]
        extras = (  # the CPU-host pass: only where the cluster has host terms
            stage_host_extras(self.profile, self.cluster, [(s, e, len(d)) for s, e, d in stages], b)
            if has_host_terms(self.cluster)
            else None
        )
        return score_options(
            options, comm, extras, M, self.cluster, schedule, spec, policies, recompute
        )

    def build_plan(self, planner: str, stages: Sequence[StageSpec], M: int, scored: Scored) -> Plan:
        """The :class:`Plan` of a scored candidate, with ``predicted_step_ms`` = L
        (:func:`scored_plan`, whose errors it raises)."""
        bare = [
            self.stage_plan(s, e, d, z if len(d) > 1 else UNSHARDED)
            for (s, e, d), z in zip(
                stages, scored.zero_modes or [UNSHARDED] * len(stages), strict=True
            )
        ]
        return scored_plan(planner, self.profile, self.global_batch_size, bare, M, scored)


def score_options(
    options: Sequence[StageOptions],
    comm: Sequence[float],
    extras: Sequence[HostExtra] | None,
    M: int,
    cluster: Cluster,
    schedule: str,
    spec: ScheduleSpec,
    policies: Sequence[Policy] = ("A", "B"),
    recompute: bool | None = None,
) -> Scored | None:
    """L of a candidate from its stages' options (:meth:`Scorer.stage_options`), its comm
    stages and host extras: per warm-up policy, each stage's zero mode (:func:`stage_choice`) and
    re-computation for its K_i, then equations 1-3 (:func:`pipeline_terms`); the best policy,
    or None when no policy fits memory (arguments as :meth:`Scorer.score`)."""
    S = len(options)
    best: Scored | None = None
    for policy in policies if len(spec.policies) > 1 else spec.policies:
        nominal = in_flight(schedule, S, M, policy, None)
        rec: list[bool] = []
        ds: list[int | None] = []
        zs: list[ZeroMode] = []
        terms: list[StageTerms] = []
        for i in range(S):
            k = nominal[i]
            got = stage_choice(options[i], k, M, spec.bounded, recompute)
            if got is None:
                break
            z, r_i, use_r, d = got
            zs.append(z)
            rec.append(use_r)
            terms.append(r_i.recomputed if use_r else r_i.plain)
            ds.append(d if d < k else None)
        if len(terms) < S:
            continue
        ks = in_flight(schedule, S, M, policy, tuple(ds))
        bounds: Sequence[int | None] = ks if spec.bounded else [None] * S
        L = pipeline_terms(terms, comm, bounds, M, cluster, extras).latency().L_ms
        if best is None or best.L_ms > L:
            best = Scored(L, policy, schedule, tuple(rec), tuple(ds), tuple(zs))
    return best


@functools.lru_cache(maxsize=1 << 14)
def in_flight(
    schedule: str, S: int, M: int, policy: str, D: tuple[int | None, ...] | None
) -> tuple[int, ...]:
    """:func:`~dapple.schedule.registry.in_flight_counts`, remembered: a search asks for the
    same few (S, M, policy, D) again and again (D is mostly all None)."""
    return tuple(in_flight_counts(schedule, S, M, policy, D))


def scored_plan(
    planner: str,
    profile: ModelProfile,
    global_batch_size: int,
    bare: Sequence[StagePlan],
    M: int,
    scored: Scored,
) -> Plan:
    """The :class:`Plan` of a scored candidate whose stages are ``bare`` (layers, devices,
    tensor width, regather), each given the scored re-computation, D and zero stage, with
    ``predicted_step_ms`` = L.

    Raises:
        ValidationError: the scored schedule or policy is not one a plan can carry
            (:class:`Plan` names the value).
    """
    return Plan(
        planner=planner,
        model_name=profile.model_name,
        global_batch_size=global_batch_size,
        micro_batch_size=global_batch_size // M,
        num_micro_batches=M,
        schedule=scored.schedule,
        policy=scored.policy,
        predicted_step_ms=scored.L_ms,
        stages=tuple(
            dataclasses.replace(st, recompute=full_if(r), max_in_flight=k, zero_stage=z.stage)
            for st, r, k, z in zip(
                bare,
                scored.recompute,
                scored.max_in_flight,
                scored.zero_modes or [UNSHARDED] * len(bare),
                strict=True,
            )
        ),
    )


def _scored_schedule(name: str) -> ScheduleSpec:
    """The schedule ``name`` if the scorer can cost it (the paper's L over its K_i).

    Raises:
        ValidationError: unknown, or with a step rule of its own (the names it takes listed).
    """
    spec = get_schedule(name)
    if not spec.uses_pipeline_latency:
        ok = ", ".join(s.name for s in schedules() if s.uses_pipeline_latency)
        raise ValidationError(
            f"schedule {name!r} has a step rule of its own; the scorer costs L: choose {ok}"
        )
    return spec

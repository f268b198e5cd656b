"""Per-stage expert-parallel widths e_s: the scorer offers each MoE stage its widths as options.

Beyond the paper, as the ZeRO choice is (:class:`~dapple.planner.scorer.Scorer`): a stage on
r_s replicas holding mixture-of-experts layers may shard their experts over e_s of its replicas
(:class:`~dapple.core.stage_plan.StagePlan` ``expert_width``), each width a divisor of r_s and of
every such layer's E (:func:`~dapple.cost.moe.expert_widths`). :class:`ExpertScorer` offers a
stage, beside its zero modes, more options per width e_s > 1 - one per zero stage the scorer
allows among 0, 1 and 2 (tensor width 1, no ZeRO-3: the combinations the cost model prices,
:func:`~dapple.cost.moe.check_expert_stage`) - with the terms :mod:`dapple.cost.moe` gives it:

* F_s and B_s gain its all-to-alls A2A_s (and the busiest expert's compute);
* AR_s is AR(P_dense, r_s) + the experts' AllReduce over the r_s / e_s replicas of each shard
  (ZeRO-2: ``(M + 1) / 2`` times it);
* its memory holds ``P_dense + P_experts / e_s`` per rank, so D can only grow with e_s; under
  ZeRO-1/2 the dense state sharded over r_s and the experts' over r_s / e_s
  (:func:`~dapple.cost.peak_memory.expert_stage_state_bytes`), U_s then (P_dense +
  P_experts) / r_s.

The search then picks a stage's option as it picks its zero mode
(:func:`~dapple.planner.stage_options.stage_choice`): the first option when it is unsharded and
holds the stage's K_i, else the cheapest per step (AR_s + U_s + the M x A2A inside F and B) of
those that hold K_i. :meth:`ExpertScorer._new_options` puts the cheapest width at ZeRO 0 first
when it costs less per step than the unsharded option, so a width is taken where it is cheaper
or where memory asks for it (at ZeRO 1 or 2 too under ``auto``, where that is cheaper still). Each candidate's L is then the cost model's for the chosen widths, and the
plan records them (:meth:`ExpertScorer.stage_plan`). A profile without MoE layers gets the plain
:class:`Scorer` (:func:`make_scorer`): its search is unchanged. The DAPPLE search runs once with
the widths and once without, keeping the better plan (:func:`with_and_without_widths`); under
``auto`` its width-1 search runs once more with the widths at ZeRO 0 only
(:func:`zero_zero_twin`), a second start for the per-stage tensor widths. Pure,
no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Literal

from dapple.core.cluster import Cluster
from dapple.core.parallelism import Parallelism
from dapple.core.plan import Plan, StagePlan
from dapple.core.planning_options import ZeroChoice
from dapple.core.profile import ModelProfile
from dapple.cost.comm import stage_update_ms
from dapple.cost.moe import (
    expert_alltoall_ms,
    expert_group_shapes,
    expert_sharded_profile,
    expert_slice_times,
    expert_stage_sync_ms,
    expert_widths,
    stage_rank_parameter_bytes,
)
from dapple.cost.peak_memory import expert_stage_state_bytes, in_flight_limit, stage_bytes
from dapple.cost.terms import StageTerms
from dapple.errors import InfeasibleError
from dapple.planner.scorer import Scorer
from dapple.planner.stage_options import LazyOptions, StageOption, StageOptions
from dapple.planner.zero_modes import UNSHARDED, ZeroMode

__all__ = [
    "ExpertScorer",
    "has_experts",
    "make_scorer",
    "with_and_without_widths",
    "without_expert_widths",
    "zero_zero_twin",
]


def has_experts(profile: ModelProfile) -> bool:
    """Whether some layer of ``profile`` is a mixture of experts."""
    return any(x.moe is not None for x in profile.layers)


def make_scorer(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch_size: int,
    zero_stage: ZeroChoice | ZeroMode = 0,
    tensor_width: int = 1,
    *,
    experts: bool = True,
) -> Scorer:
    """The scorer of one tensor width: :class:`ExpertScorer` for a profile with MoE layers at
    width 1 (expert parallelism is costed without tensor parallelism) unless ``experts`` is
    False, else :class:`Scorer`."""
    if experts and tensor_width == 1 and has_experts(profile):
        return ExpertScorer(profile, cluster, global_batch_size, zero_stage)
    return Scorer(profile, cluster, global_batch_size, zero_stage, tensor_width)


def with_and_without_widths(search: Callable[[bool, float], Plan]) -> Plan:
    """The plan of lower L of ``search(True, inf)`` (EP widths offered) and
    ``search(False, L)`` (none), the first on ties: a search that prunes and keeps a beam may
    end higher with more options. The second is given the first's L as its bound ``L``: it
    returns only a plan below it (InfeasibleError otherwise), so its pruning starts there.

    Raises:
        InfeasibleError: neither finds a plan (the first's error).
    """
    try:
        plan = search(True, math.inf)
    except InfeasibleError:
        return search(False, math.inf)
    try:
        return search(False, plan.predicted_step_ms)
    except InfeasibleError:
        return plan


def without_expert_widths(plan: Plan) -> Plan:
    """``plan`` with every stage's experts whole (e_s = 1; ``plan`` itself when none is
    sharded): what the DAPPLE search interleaves, the runtime running expert parallelism under
    one chunk per device group only (``dapple.runtime.parallel.expert`` refuses an interleaved
    plan)."""
    if not any(st.parallel.expert_parallel for st in plan.stages):
        return plan
    return dataclasses.replace(
        plan, stages=tuple(dataclasses.replace(st, expert_width=1) for st in plan.stages)
    )


def zero_zero_twin(scorer: Scorer) -> ExpertScorer | None:
    """``scorer`` offering its EP widths at ZeRO 0 alone, when it offers them at ZeRO 1 or 2
    too (an :class:`ExpertScorer` under ``auto``); else None. The DAPPLE search runs it beside
    ``scorer`` (:func:`~dapple.planner.search.dapple_search`): its per-stage widths are a local
    search from the uniform plan, and the better uniform plan the ZeRO-1/2 widths give may
    refine to a higher L than the one without them (DeepSeek-V3 on 512 H100: 24,259 -> 20,324
    ms against 24,545 -> 19,873, ``benchmarks/moe.md``)."""
    if not isinstance(scorer, ExpertScorer) or scorer.zero_stage != "auto":
        return None
    if scorer.expert_zero is not None and scorer.expert_zero <= {0}:
        return None
    return ExpertScorer(scorer.profile, scorer.real_cluster, scorer.global_batch_size, "auto",
                        None if scorer.widths is None else sorted(scorer.widths), (0,))  # fmt: skip


class ExpertScorer(Scorer):
    """A width-1 :class:`Scorer` whose MoE stages are also offered each EP width e_s > 1."""

    def __init__(
        self,
        profile: ModelProfile,
        cluster: Cluster,
        global_batch_size: int,
        zero_stage: ZeroChoice | ZeroMode = 0,
        widths: Sequence[int] | None = None,
        expert_zero: Sequence[int] | None = None,
    ) -> None:
        super().__init__(profile, cluster, global_batch_size, zero_stage, 1)
        self.widths = None if widths is None else frozenset(widths)
        """The e_s offered (those a stage may take among them); None: every width. A uniform
        grid offers one (:mod:`dapple.planner.expert_grid`)."""
        self.expert_zero = None if expert_zero is None else frozenset(expert_zero)
        """The zero stages the widths are offered at, among those ``zero_stage`` allows; None:
        all of them (:func:`zero_zero_twin` offers ZeRO 0 alone)."""
        self._syncs: dict[tuple[int, int, tuple[int, ...], int, int, int], float] = {}
        self._sharded: dict[int, ModelProfile] = {}
        self._a2a: dict[tuple[int, int, frozenset[tuple[int, tuple[int, ...]]], int], float] = {}
        self._fits: dict[tuple[int, int, int, int, int, int, int], tuple[int, int, float]] = {}

    def expert_modes(self, s: int, e: int, replicas: int) -> list[ZeroMode]:
        """The EP options of layers [s, e) on ``replicas`` devices: at each width e_s > 1 the
        stage may take (:func:`~dapple.cost.moe.expert_widths`, among :attr:`widths`), one per
        zero stage the scorer's allows - 0, 1 or 2 as given, all three under ``auto``, those of
        :attr:`expert_zero` among them; none under ZeRO-3 (not costed with EP) or a fixed
        :class:`ZeroMode`."""
        z = self.zero_stage
        if replicas == 1 or isinstance(z, ZeroMode) or z not in (0, 1, 2, "auto"):
            return []
        stages: tuple[Literal[0, 1, 2], ...] = (0, 1, 2) if z == "auto" else (z,)
        if self.expert_zero is not None:
            stages = tuple(x for x in stages if x in self.expert_zero)
        return [
            ZeroMode(zs, False, w)
            for w in expert_widths(self.profile, (s, e), replicas)
            if w > 1 and (self.widths is None or w in self.widths)
            for zs in stages
        ]

    def _new_options(self, s: int, e: int, d: tuple[int, ...], b: int) -> StageOptions:
        """The zero modes' options, and each EP width's: the cheapest width at ZeRO 0 (AR_s +
        U_s + its traffic) first when it costs less per step than the unsharded option (then
        :func:`~dapple.planner.stage_options.pick_zero_mode` takes the cheapest option that
        holds K_i, ZeRO-1/2 widths included), else after the zero modes; the widths at ZeRO 1
        and 2 last, each costed when first read
        (:class:`~dapple.planner.stage_options.LazyOptions`: not where the unsharded option
        comes first and holds K_i); ``widths`` not containing 1 drops the unsharded option of a
        stage that has widths."""
        modes = self.expert_modes(s, e, len(d))
        if not modes:
            return super()._new_options(s, e, d, b)
        known = {m: self._stage(s, e, d, b, m) for m in modes if m.stage == 0}
        zero = sorted(known, key=lambda m: known[m].ar + known[m].traffic)
        rest = [m for m in modes if m.stage != 0]
        plain: list[ZeroMode] = []
        if self.widths is None or 1 in self.widths:
            plain = list(self._modes(s, e, len(d)))
        if plain and zero and plain[0] == UNSHARDED:
            known[UNSHARDED] = self._stage(s, e, d, b, UNSHARDED)
            if known[zero[0]].ar + known[zero[0]].traffic < known[UNSHARDED].ar:
                plain.insert(0, zero.pop(0))

        def make(mode: ZeroMode) -> StageOption:
            got = known.get(mode)
            return got if got is not None else self._stage(s, e, d, b, mode)

        return LazyOptions([*plain, *zero, *rest], make)

    def _stage(
        self, s: int, e: int, d: tuple[int, ...], b: int, mode: ZeroMode = UNSHARDED
    ) -> StageOption:
        """The terms of one stage under ``mode``; at an EP width, the cost model's
        (:mod:`dapple.cost.moe`) over the scorer's F and B."""
        w = mode.expert_width
        if w == 1:
            return super()._stage(s, e, d, b, mode)
        n = -(-b // len(d))  # split_sizes(b, r)[0], the largest slice
        M = self.global_batch_size // b
        f0, b0 = self.fb_ms(s, e, n)
        st = StagePlan(layers=(s, e), devices=d, expert_width=w)
        shapes = expert_group_shapes(self.real_cluster, st)
        a2a = self._a2a.get((s, e, shapes, n))
        if a2a is None:  # placements whose groups sit alike share it
            a2a = expert_alltoall_ms(self.profile, self.real_cluster, (s, e), shapes, n)
            self._a2a[s, e, shapes, n] = a2a
        (f, bw), _ = expert_slice_times(
            self.profile, self.real_cluster, st, {n: ((f0, b0), (0, 0))}, n, a2a
        )[n]
        z = mode.stage
        par = Parallelism(replicas=len(d), zero_stage=z, expert_width=w)
        reductions = par.gradient_reductions(M)
        key = (s, e, d, w, z, reductions)
        sync = self._syncs.get(key)
        if sync is None:
            sync = self._syncs[key] = expert_stage_sync_ms(
                self.profile, self.real_cluster, st, reductions
            )
        if not par.shards_optimizer:  # each replica updates P_dense + P_experts / e_s
            rank_bytes = stage_rank_parameter_bytes(self.profile, (s, e), w)
            update = stage_update_ms(self.cluster, self.profile, rank_bytes, par)
        else:  # (P_dense + P_experts) / r_s (dapple.cost.moe)
            update = stage_update_ms(self.cluster, self.profile, self.param_bytes(s, e), par)
        d_nr, d_r, floor = self._expert_memory(s, e, n, len(d), w, M, z)
        plain = StageTerms(
            forward_ms=f, backward_ms=bw, sync_ms=sync, update_ms=update,
            work=self._work(s, e, d, b, False),
        )  # fmt: skip
        recomputed = dataclasses.replace(
            plain, backward_ms=bw + f, work=self._work(s, e, d, b, True)
        )
        traffic = M * (f - f0 + bw - b0)  # the all-to-alls (and busiest expert) per step
        return StageOption(f, bw, sync + update, d_nr, d_r, plain, recomputed, floor, traffic)

    def _expert_memory(
        self, s: int, e: int, n: int, replicas: int, w: int, M: int, z: int = 0
    ) -> tuple[int, int, float]:
        """D without and with re-computation on slices of n, and the memory floor, of layers
        [s, e) at EP width w and zero stage z (:meth:`Scorer._options` on the profile as one
        rank holds it, :func:`~dapple.cost.moe.expert_sharded_profile`; under ZeRO-1/2 the
        state of :func:`~dapple.cost.peak_memory.expert_stage_state_bytes`)."""
        key = (s, e, n, replicas, w, M, z)
        got = self._fits.get(key)
        if got is not None:  # placements of the same replica count share it
            return got
        memory = self._sharded.get(w)
        if memory is None:
            memory = self._sharded[w] = expert_sharded_profile(self._memory, w)
        par = Parallelism(replicas=replicas, zero_stage=z, expert_width=w)
        state = (
            expert_stage_state_bytes(self._memory, (s, e), par) if par.shards_optimizer else None
        )
        plain, redone = stage_bytes(memory, (s, e), n, par, state=state)
        usable = float(self.cluster.usable_memory_bytes)
        floor = plain.static + plain.shared + (self._act[e] - self._act[s]) * n
        got = in_flight_limit(plain, usable, M), in_flight_limit(redone, usable, M), floor
        self._fits[key] = got
        return got

    def stage_plan(self, s: int, e: int, devices: tuple[int, ...], mode: ZeroMode) -> StagePlan:
        """The :class:`StagePlan` of layers [s, e) on ``devices`` under a scored mode, with its
        EP width."""
        st = super().stage_plan(s, e, devices, mode)
        w = mode.expert_width
        return st if w == 1 else dataclasses.replace(st, expert_width=w)

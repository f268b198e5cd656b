"""Fast scoring of candidate plans under the cost model, shared by search, baselines and oracle.

A candidate is a list of ``(start, end, devices)`` stages plus M. The :class:`Scorer` caches
per-stage terms (prefix sums over layers, AllReduce, split-concat comm) so the DP can score
many candidates sharing stages, decides per stage whether to re-compute and the in-flight
bound D when memory demands it, tries warm-up policies A and B, and returns L exactly as
:func:`dapple.planner.cost.pipeline_latency` computes it for the resulting :class:`Plan`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.planner.cost import (
    allreduce_ms,
    latency_from_stages,
    overlaps,
)
from dapple.planner.host import HostExtra, stage_host_extras
from dapple.planner.sharing import shared_compute_scale

__all__ = ["Scored", "Scorer", "StageSpec"]

StageSpec = tuple[int, int, tuple[int, ...]]
"""``(start, end, devices)`` of one computation stage."""

_BIG = 10**9


@dataclass(frozen=True, slots=True)
class Scored:
    """A scored candidate: L and the per-stage decisions that achieve it."""

    L_ms: float
    policy: str
    schedule: str
    recompute: tuple[bool, ...]
    max_in_flight: tuple[int | None, ...]


class Scorer:
    """Scores candidate plans of one (profile, cluster, global batch size)."""

    def __init__(self, profile: ModelProfile, cluster: Cluster, global_batch_size: int) -> None:
        self.profile = profile
        self.cluster = cluster
        self.global_batch_size = global_batch_size
        self.N = profile.num_layers
        self.G = cluster.num_devices
        ls = profile.layers
        sd = cluster.compute_slowdown

        def pre(xs: Sequence[float]) -> list[float]:
            return [0.0, *accumulate(xs)]

        self._ff = pre([x.forward.fixed_ms * sd for x in ls])
        self._fp = pre([x.forward.per_sample_ms * sd for x in ls])
        self._bf = pre([x.backward.fixed_ms * sd for x in ls])
        self._bp = pre([x.backward.per_sample_ms * sd for x in ls])
        self._par = pre([float(x.parameter_bytes) for x in ls])
        self._act = pre([x.kept_activation_bytes_per_sample for x in ls])
        self._ar: dict[tuple[int, int, tuple[int, ...]], float] = {}
        self._links: dict[
            tuple[tuple[int, ...], tuple[int, ...], int], list[tuple[float, float]]
        ] = {}
        self._stages: dict[
            tuple[int, int, tuple[int, ...], int], tuple[float, float, float, int, int]
        ] = {}
        self.evaluations = 0

    # -- per-stage terms ---------------------------------------------------------------------
    def fb_ms(self, s: int, e: int, samples: int) -> tuple[float, float]:
        """F, B (without re-computation) of layers [s, e) on ``samples`` samples."""
        if samples <= 0:
            return 0.0, 0.0
        f = (self._ff[e] - self._ff[s]) + (self._fp[e] - self._fp[s]) * samples
        b = (self._bf[e] - self._bf[s]) + (self._bp[e] - self._bp[s]) * samples
        return f, b

    def param_bytes(self, s: int, e: int) -> float:
        return self._par[e] - self._par[s]

    def ar_ms(self, s: int, e: int, devices: tuple[int, ...]) -> float:
        key = (s, e, devices)
        v = self._ar.get(key)
        if v is None:
            v = allreduce_ms(self.cluster, self.param_bytes(s, e), devices)
            self._ar[key] = v
        return v

    def comm_ms(self, cut: int, src: tuple[int, ...], dst: tuple[int, ...], b: int) -> float:
        """Comm stage time across ``cut`` (as :func:`dapple.planner.cost.comm_ms`).

        The split-concat link loads depend on the device sets and b only; they are cached
        as ``(latency, samples / bandwidth)`` pairs and scaled by the boundary bytes.
        """
        key = (src, dst, b)
        links = self._links.get(key)
        if links is None:
            links = _link_loads(self.cluster, src, dst, b)
            self._links[key] = links
        per_sample = (
            self.profile.input_bytes_per_sample
            if cut == 0
            else self.profile.layers[cut - 1].output_bytes_per_sample
        )
        if per_sample <= 0:
            return 0.0
        t = 0.0
        for lat, coef in links:
            v = lat + per_sample * coef
            if v > t:
                t = v
        return t

    def _options(
        self, s: int, e: int, samples: int
    ) -> tuple[int, int]:  # D without / with re-computation
        mem = float(self.cluster.device_memory_bytes)
        state = self.param_bytes(s, e) * (1.0 + self.profile.optimizer_state_factor)
        full = (self._act[e] - self._act[s]) * samples
        inp = (
            self.profile.input_bytes_per_sample
            if s == 0
            else self.profile.layers[s - 1].output_bytes_per_sample
        ) * samples

        def fit(free: float, per: float) -> int:
            if free < 0:
                return 0
            return _BIG if per <= 0 else int(free // per)

        return fit(mem - state, full), fit(mem - state - full, inp)

    def _stage(
        self, s: int, e: int, d: tuple[int, ...], b: int
    ) -> tuple[float, float, float, int, int]:
        """Cached ``(F, B, AR, D without re-computation, D with)`` of one stage."""
        key = (s, e, d, b)
        rec = self._stages.get(key)
        if rec is None:
            n = -(-b // len(d))  # split_sizes(b, r)[0], the largest slice
            f, bw = self.fb_ms(s, e, n)
            d_nr, d_r = self._options(s, e, n)
            rec = (f, bw, self.ar_ms(s, e, d), d_nr, d_r)
            self._stages[key] = rec
        return rec

    def _demand(
        self, stage: StageSpec, b: int, recompute: bool, extra_ms: float
    ) -> list[tuple[int, float]]:
        """``(device, F + B of its slice + extra_ms)`` per replica, as ``cost._slice_demand``."""
        s, e, devs = stage
        r = len(devs)
        out = []
        for j, d in enumerate(devs):
            f, bw = self.fb_ms(s, e, b // r + (1 if j < b % r else 0))
            out.append((d, f + bw + (f if recompute else 0.0) + extra_ms))
        return out

    # -- whole candidates --------------------------------------------------------------------
    def score(
        self,
        stages: Sequence[StageSpec],
        M: int,
        *,
        schedule: str = "dapple",
        policies: Sequence[str] = ("A", "B"),
        recompute: bool | None = None,
    ) -> Scored | None:
        """L of a candidate, or None when it does not fit in memory.

        Args:
            stages: ``(start, end, devices)`` per computation stage, covering all layers.
            M: number of micro-batches (must divide the global batch size).
            schedule: ``dapple`` or ``gpipe`` (all M micro-batches in flight).
            policies: warm-up policies to try (dapple schedule); the best is kept.
            recompute: force re-computation on (True) or off (False) for every stage; None
                re-computes a stage only when memory demands it.
        """
        self.evaluations += 1
        b = self.global_batch_size // M
        S = len(stages)
        recs = [self._stage(s, e, d, b) for (s, e, d) in stages]
        opts = [(r[3], r[4]) for r in recs]
        fb = [(r[0], r[1]) for r in recs]
        ar = [r[2] for r in recs]
        comm = [self.comm_ms(stages[i][1], stages[i][2], stages[i + 1][2], b) for i in range(S - 1)]
        host = (  # planner.host: CPU hosts only
            stage_host_extras(self.profile, self.cluster, [(s, e, len(d)) for s, e, d in stages], b)
            if self.cluster.host_overheads
            else [HostExtra()] * S
        )
        best: Scored | None = None
        for policy in policies if schedule == "dapple" else ("A",):
            nominal = _nominal_k(S, M, policy) if schedule == "dapple" else [M] * S
            rec: list[bool] = []
            ds: list[int | None] = []
            ok = True
            for i in range(S):
                d_nr, d_r = opts[i]
                k = nominal[i]
                if recompute is None:
                    if d_nr >= k:
                        use_r, d = False, d_nr
                    elif d_r >= k or d_r > d_nr:
                        use_r, d = True, d_r
                    else:
                        use_r, d = False, d_nr
                else:
                    use_r, d = recompute, (d_r if recompute else d_nr)
                if d < 1 or (schedule == "gpipe" and d < M):
                    ok = False
                    break
                rec.append(use_r)
                ds.append(d if d < k else None)
            if not ok:
                continue
            ks = _bounded_k(nominal, ds) if schedule == "dapple" else [M] * S
            F: list[float] = []
            B: list[float] = []
            AR: list[float] = []
            HS: list[float] = []  # host CPU per step, stretched with F and B below
            per: list[float] = []
            kk: list[int] = []
            for i in range(S):
                if i > 0:
                    F.append(comm[i - 1])
                    B.append(comm[i - 1])
                    AR.append(0.0)
                    HS.append(0.0)
                    kk.append(0)
                f, bw = fb[i]
                F.append(f + host[i].forward_ms)
                B.append(bw + (f if rec[i] else 0.0) + host[i].backward_ms)
                AR.append(ar[i])
                HS.append(host[i].step_ms)
                kk.append(ks[i])
            per = _periods(F, B, kk, schedule)
            if self.cluster.compute_cores_per_server is not None:  # planner.sharing
                devs = [
                    self._demand(stages[x // 2], b, rec[x // 2], host[x // 2].per_mb(M))
                    if x % 2 == 0
                    else None
                    for x in range(len(F))
                ]
                span, _, steady, _, _ = latency_from_stages(F, B, HS, M, per)
                scale = shared_compute_scale(span, steady, M, devs, self.cluster)
                F = [f * a for f, (a, _) in zip(F, scale, strict=True)]
                B = [v * a for v, (a, _) in zip(B, scale, strict=True)]
                HS = [v * a for v, (a, _) in zip(HS, scale, strict=True)]
                per = [p * beta for p, (_, beta) in zip(per, scale, strict=True)]
            AR = [a + h for a, h in zip(AR, HS, strict=True)]
            L = latency_from_stages(F, B, AR, M, per)[0]
            if best is None or best.L_ms > L:
                best = Scored(L, policy, schedule, tuple(rec), tuple(ds))
        return best

    def build_plan(self, planner: str, stages: Sequence[StageSpec], M: int, scored: Scored) -> Plan:
        """The :class:`Plan` of a scored candidate, with ``predicted_step_ms`` = L."""
        return Plan(
            planner=planner,
            model_name=self.profile.model_name,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.global_batch_size // M,
            num_micro_batches=M,
            schedule="gpipe" if scored.schedule == "gpipe" else "dapple",
            policy="B" if scored.policy == "B" else "A",
            predicted_step_ms=scored.L_ms,
            stages=tuple(
                StagePlan(layers=(s, e), devices=d, recompute=r, max_in_flight=k)
                for (s, e, d), r, k in zip(
                    stages, scored.recompute, scored.max_in_flight, strict=True
                )
            ),
        )


def _link_loads(
    cluster: Cluster, src: tuple[int, ...], dst: tuple[int, ...], b: int
) -> list[tuple[float, float]]:
    """``(latency_ms, samples / bytes_per_ms)`` of every busy link of a split-concat: device
    links inside a server, network interfaces across servers (see ``cost.comm_ms``)."""
    intra = cluster.intra_server_bandwidth_gbps * 1e9 / 8 / 1e3
    inter = cluster.inter_server_bandwidth_gbps * 1e9 / 8 / 1e3
    loads: dict[tuple[str, int], float] = {}
    for j, k, lo, hi in overlaps(b, len(src), len(dst)):
        a, c = src[j], dst[k]
        if a == c:
            continue
        if cluster.same_server(a, c):
            keys = [("do", a), ("di", c)]
        else:
            keys = [("no", cluster.server_of(a)), ("ni", cluster.server_of(c))]
        for key in keys:
            loads[key] = loads.get(key, 0.0) + (hi - lo)
    out = []
    for (kind, _), n in loads.items():
        if kind[0] == "d":
            out.append((cluster.intra_server_latency_ms, n / intra))
        else:
            out.append((cluster.inter_server_latency_ms, n / inter))
    return out


def _periods(F: list[float], B: list[float], kk: list[int], schedule: str) -> list[float]:
    """Steady period per stage, as ``cost._periods`` (bounded in-flight, dapple schedule)."""
    per = [F[x] + B[x] for x in range(len(F))]
    if schedule == "dapple":
        rt = 0.0
        for x in range(len(F) - 1, -1, -1):
            rt += F[x] + B[x]
            if kk[x] > 0:
                per[x] = max(per[x], rt / kk[x])
    return per


def _nominal_k(S: int, M: int, policy: str) -> list[int]:
    """K_i of :func:`warmup_counts` without a memory bound (already non-increasing)."""
    if policy == "A":
        return [min(S - i, M) for i in range(S)]
    return [min(2 * (S - i) - 1, M) for i in range(S)]


def _bounded_k(nominal: list[int], ds: list[int | None]) -> list[int]:
    """K_i of :func:`warmup_counts` with per-stage bounds D (kept non-increasing)."""
    out: list[int] = []
    for k, d in zip(nominal, ds, strict=True):
        if d is not None and d < k:
            k = d
        if out and out[-1] < k:
            k = out[-1]
        out.append(k)
    return out


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order (the candidate M)."""
    return [m for m in range(1, n + 1) if n % m == 0]

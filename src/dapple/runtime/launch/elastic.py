"""Elastic runs: a lost device costs a re-plan, not the run.

Standalone (:func:`train_elastic`, ``dapple train --elastic``): the launcher runs the plan.
When its workers end because a device was lost - a worker killed by a signal (``kill -9``, the
kernel's OOM killer, a dead GPU taking its process down), see
:meth:`~dapple.runtime.launch.failure.RankFailure.lost_ranks` - it re-plans with the planner's own
search for the devices left (the same profile, the cluster less the lost devices, the same
global batch G and memory limit; :func:`replan`) and starts the survivors again from the newest
complete checkpoint, which a resume reads under any plan. G and the data order stay those of
the uninterrupted run, so the loss curve continues as if nothing happened apart from the
steps re-run since that checkpoint. On GPUs the lost device's index leaves
``CUDA_VISIBLE_DEVICES`` for the next attempt.

Under ``torchrun`` (``torchrun --nnodes=MIN:MAX --max-restarts=K ... dapple train --elastic``)
torchrun's elastic agent restarts every worker when a node is lost or joins the rendezvous;
each restarted worker finds ``WORLD_SIZE`` devices and, where the plan names another count,
plans for them the same way (:func:`plan_for_world`; every rank plans alike, the search being
deterministic) and resumes from the newest checkpoint. A run that grows back thus re-plans for
the larger set at the restart torchrun makes when the new node arrives.

Bounds: at most ``max_restarts`` re-plans, and never below ``min_devices`` devices (then the
run stops with one line naming the checkpoint to resume from). Every re-plan is printed (old
plan, new plan, why) and written to the metrics file as an ``{"event": "replan", ...}`` line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.planning_options import ZeroChoice, zero_choice
from dapple.core.profile import ModelProfile
from dapple.errors import DappleError, InfeasibleError, ValidationError
from dapple.runtime.checkpoint import latest_checkpoint
from dapple.runtime.launch.failure import RankFailure
from dapple.runtime.launch.stop_line import RunClosing, stop_line
from dapple.runtime.metrics import announce, metrics_from_dict
from dapple.runtime.step_metrics import StepMetrics
from dapple.runtime.train_config import TrainConfig

if TYPE_CHECKING:
    from dapple.planner.plan_config import PlanConfig

PlanAgain = Callable[["PlanConfig", ModelProfile, Cluster], Plan]
"""``(asked, profile, cluster) -> plan``: the plan a :class:`PlanConfig` asks for on ``profile``
(already at its lengths) and ``cluster`` (:attr:`ElasticPolicy.plan_again`)."""

__all__ = [
    "ElasticPolicy",
    "ElasticResult",
    "ElasticStop",
    "Replan",
    "cluster_of",
    "plan_for_world",
    "replan",
    "servers_left",
    "train_elastic",
    "worker_plan",
]


class ElasticStop(DappleError):
    """An elastic run stopped: fewer devices left than its minimum, restarts used up, or no
    plan fits the devices left. The newest checkpoint stays for ``--resume``."""


@dataclass(frozen=True, slots=True)
class ElasticPolicy:
    """How an elastic run re-plans and when it gives up."""

    profile: ModelProfile
    """The model's profile (``dapple profile``), planned again for the devices left."""
    cluster: Cluster
    """The cluster the first plan was made for; re-plans take it less the lost devices. On a
    cluster with device kinds over several servers a standalone run carries it less the servers
    that lost a device (:func:`servers_left`)."""
    min_devices: int = 1
    """Stop (with a resumable checkpoint) rather than go on with fewer devices."""
    max_restarts: int = 3
    """Re-plans allowed in one run."""
    zero_stage: int = 0
    """The planner's ``zero_stage`` for re-plans of a plan that records no search options
    (:attr:`~dapple.core.plan.Plan.planned_with`; see :func:`replan`)."""
    plan_again: PlanAgain | None = None
    """How a re-plan is made from the options the plan records: :func:`dapple.api.train` gives
    :func:`dapple.api.planning.plan_again` (the planner's search, then the schedule asked for,
    as :func:`dapple.api.plan` makes a plan). None: the planner's search alone
    (:func:`dapple.planner.make_plan`), which leaves a schedule asked for unapplied."""

    def __post_init__(self) -> None:
        for name, low in (("min_devices", 1), ("max_restarts", 0)):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= low):
                raise ValidationError(f"elastic {name} must be an integer >= {low}, got {v!r}")


@dataclass(frozen=True, slots=True)
class Replan:
    """One re-plan of an elastic run."""

    resume_step: int
    """The step the run goes on from (the newest complete checkpoint's; 0 without one)."""
    lost: tuple[int, ...]
    """Ranks of the old plan whose devices were lost (empty when devices joined)."""
    old: Plan
    new: Plan
    why: str
    seconds: float = 0.0
    """Time to plan anew."""

    def line(self) -> str:
        return (
            f"re-plan: {_describe(self.old)} -> {_describe(self.new)}, resuming at step "
            f"{self.resume_step}: {self.why}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "event": "replan",
            "resume_step": self.resume_step,
            "lost_ranks": list(self.lost),
            "old_plan": self.old.to_dict(),
            "new_plan": self.new.to_dict(),
            "why": self.why,
            "plan_seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True, slots=True)
class ElasticResult:
    """What an elastic run did: rank 0's metrics of every attempt, in order (steps re-run after
    a re-plan appear again; those after re-plan k carry ``extra["replan"] = k`` and
    ``extra["replication"]``), and its re-plans."""

    metrics: list[StepMetrics]
    replans: tuple[Replan, ...]
    plan: Plan
    """The plan the run finished under."""


def _describe(plan: Plan) -> str:
    """``replication 3:1 on 4 devices (M=2)``."""
    return f"replication {plan.replication} on {len(plan.devices)} devices (M={plan.num_micro_batches})"


def cluster_of(cluster: Cluster, devices: int) -> Cluster:
    """``cluster`` with ``devices`` devices: a single server keeps that many; several servers
    keep the first whole servers those devices fill (a plan's tensor of links assumes servers
    alike, so a partly lost server's other devices are left idle), with their device kinds.

    Raises:
        ElasticStop: fewer devices than one server of a multi-server cluster.
    """
    if devices < 1:
        raise ElasticStop(f"no device left of cluster {cluster.name!r}")
    if cluster.servers == 1:
        return dataclasses.replace(cluster, devices_per_server=devices)
    servers = min(devices // cluster.devices_per_server, cluster.servers)
    if servers < 1:
        raise ElasticStop(
            f"{devices} devices left of cluster {cluster.name!r}, fewer than one server of "
            f"{cluster.devices_per_server}"
        )
    return cluster.without_servers(range(servers, cluster.servers))


def servers_left(cluster: Cluster, ranks: int, lost: Sequence[int]) -> tuple[Cluster, list[int]]:
    """``cluster`` less every server that lost a device or that the run's ``ranks`` ranks
    (its devices ``0 .. ranks - 1``) did not fill (:meth:`Cluster.without_servers`: each
    device kind keeps its other servers), and the ranks on the servers kept, in order: the
    new cluster's devices 0, 1, ... . On a cluster with kinds a device's kind follows from its
    server, so a survivor on a server that lost a device is left idle.

    Raises:
        ElasticStop: no whole server left.
    """
    dps = cluster.devices_per_server
    gone = {cluster.server_of(r) for r in lost}
    gone |= {s for s in range(cluster.servers) if (s + 1) * dps > ranks}
    if len(gone) >= cluster.servers:
        raise ElasticStop(
            f"no whole server of cluster {cluster.name!r} left after losing rank(s) "
            f"{', '.join(map(str, lost))} of {ranks} ({dps} devices per server)"
        )
    return cluster.without_servers(gone), [
        r for r in range(ranks) if cluster.server_of(r) not in gone
    ]


def replan(policy: ElasticPolicy, devices: int, plan: Plan) -> Plan:
    """The plan for ``devices`` devices of the policy's cluster that ``plan``'s
    :class:`~dapple.planner.plan_config.PlanConfig` asks for
    (:func:`~dapple.planner.plan_config.config_of`: G, the lengths, and what
    :attr:`Plan.planned_with` records - planner, ZeRO stage or auto, tensor widths,
    interleaving, the schedule asked for), made by :attr:`ElasticPolicy.plan_again`. A plan
    that records none (made by hand) is re-planned with the policy's ``zero_stage``. Tensor
    widths that no longer divide a server of the devices left are dropped (width 1 stays).

    Raises:
        ElasticStop: no plan fits the memory of the devices left.
    """
    from dapple.cost.at_length import profile_for_lengths
    from dapple.planner.plan_config import PlanConfig, config_of

    cluster = cluster_of(policy.cluster, devices)
    if plan.planned_with is None:
        asked = PlanConfig(global_batch_size=plan.global_batch_size,
                           zero_stage=_floor(policy.zero_stage))  # fmt: skip
    else:
        asked = config_of(plan)
    widths = asked.tensor_widths  # AUTO: the planner's candidates for the devices left
    if not isinstance(widths, str):
        widths = tuple(t for t in widths if cluster.devices_per_server % t == 0) or (1,)
    by_length = plan.mean_seq_len is not None and bool(policy.profile.by_length)
    asked = dataclasses.replace(asked, tensor_widths=widths,
                                mean_seq_len=plan.mean_seq_len if by_length else None,
                                max_seq_len=plan.max_seq_len if by_length else None)  # fmt: skip
    profile = policy.profile
    if asked.mean_seq_len is not None:
        profile = profile_for_lengths(profile, asked.mean_seq_len, asked.max_seq_len)
    try:
        return (policy.plan_again or _search)(asked, profile, cluster)
    except InfeasibleError as e:
        raise ElasticStop(f"no plan fits {cluster.num_devices} devices: {e}") from e


def _search(asked: PlanConfig, profile: ModelProfile, cluster: Cluster) -> Plan:
    """The planner's search for ``asked`` (:func:`dapple.planner.make_plan`), no schedule."""
    from dapple.planner import make_plan
    from dapple.planner.plan_config import tensor_width_list

    assert asked.global_batch_size is not None
    return make_plan(profile, cluster, asked.global_batch_size, asked.planner,
                     zero_stage=asked.zero_stage, interleave=asked.interleave,
                     tensor_widths=tensor_width_list(asked.tensor_widths))  # fmt: skip


def _floor(zero_stage: int) -> ZeroChoice:
    """The ZeRO stage of a re-plan for a plan that records none: the run's ZeRO floor.

    Raises:
        ValidationError: ``zero_stage`` is not 0-3.
    """
    zero = zero_choice(zero_stage)
    if zero is None:
        raise ValidationError(f"elastic zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    return zero


def plan_for_world(plan: Plan, world: int, policy: ElasticPolicy) -> Plan:
    """The plan a restarted ``torchrun`` worker runs: ``plan`` when it uses ``world`` devices,
    else the planner's plan for ``world`` (same G).

    Raises:
        ElasticStop: ``world`` is below the policy's minimum, or no plan fits.
    """
    if len(plan.devices) == world:
        return plan
    if world < policy.min_devices:
        raise ElasticStop(f"{world} devices, fewer than the minimum {policy.min_devices}")
    if policy.cluster.mixed:
        raise ElasticStop(
            f"{world} devices where the plan has {len(plan.devices)}, on cluster "
            f"{policy.cluster.name!r} of device kinds "
            f"{', '.join(k.name for k in policy.cluster.kinds)}: torchrun's ranks do not say "
            "which servers are left, so it cannot be re-planned here; resume from the newest "
            "checkpoint with a plan for the servers left (dapple plan --cluster FILE)"
        )
    return replan(policy, world, plan)


def worker_plan(
    plan: Plan, world: int, policy: ElasticPolicy, config: TrainConfig, *, announce_it: bool
) -> tuple[Plan, TrainConfig]:
    """What a ``torchrun`` worker of an elastic run runs: :func:`plan_for_world`, with
    ``config`` made to resume from the newest checkpoint (none: step 0). Where that checkpoint was saved
    under another plan, ``announce_it`` prints and records the re-plan (rank 0's part).

    Raises:
        ElasticStop: see :func:`plan_for_world`.
    """
    ckpt_dir = _check_options(config)
    t0 = time.perf_counter()
    new = plan_for_world(plan, world, policy)
    seconds = time.perf_counter() - t0
    ck = latest_checkpoint(ckpt_dir)
    old = Plan.from_dict(ck.meta.plan) if ck is not None and ck.meta.plan else None
    if announce_it and ck is not None and old is not None and old.stages != new.stages:
        why = (
            f"this attempt has {world} devices, the checkpoint's plan "
            f"{len(old.devices)}; predicted {new.predicted_step_ms:.1f} ms per step"
        )
        _record(Replan(ck.meta.step, (), old, new, why, seconds), config.metrics_path,
                config.echo)  # fmt: skip
    return new, _resuming(config)


def _resuming(config: TrainConfig) -> TrainConfig:
    """``config`` resuming from its newest checkpoint, which it must not overwrite."""
    return dataclasses.replace(config, resume=True, overwrite_checkpoints=False)


def _resume_step(checkpoint_dir: str) -> int:
    ck = latest_checkpoint(checkpoint_dir)
    return 0 if ck is None else ck.meta.step


def _check_options(config: TrainConfig) -> str:
    ck, every = config.checkpoint_dir, config.save_every
    if ck is None or not every:
        raise ValidationError(
            "an elastic run resumes from its checkpoints: give it checkpoint_dir and save_every "
            f"(got checkpoint_dir={ck!r}, save_every={every!r})"
        )
    return str(ck)


def _survivors(failure: RankFailure, devices: list[str], policy: ElasticPolicy) -> list[str]:
    """The device names left after ``failure``; raises ``failure`` itself when no device was
    lost (an error of the run, not of a device) and :class:`ElasticStop` below the minimum."""
    lost = failure.lost_ranks()
    if not lost:
        raise failure
    left = [d for r, d in enumerate(devices) if r not in lost]
    if len(left) < policy.min_devices:
        raise ElasticStop(
            f"{failure}; {len(left)} devices left, fewer than the minimum {policy.min_devices}"
        )
    return left


def _kinds_left(
    policy: ElasticPolicy, failure: RankFailure, devices: list[str], left: list[str]
) -> tuple[ElasticPolicy, list[str]]:
    """On a cluster with device kinds over several servers: the policy on the servers left
    (:func:`servers_left`) and the names of their devices; else as given.

    Raises:
        ElasticStop: no whole server left, or fewer devices on them than the minimum.
    """
    c = policy.cluster
    if not c.kinds or c.servers == 1:
        return policy, left
    cut, keep = servers_left(c, len(devices), failure.lost_ranks())
    if len(keep) < policy.min_devices:
        raise ElasticStop(
            f"{failure}; {len(keep)} devices left on whole servers of the kinds "
            f"{', '.join(k.name for k in cut.kinds)}, fewer than the minimum {policy.min_devices}"
        )
    return dataclasses.replace(policy, cluster=cut), [devices[r] for r in keep]


def _record(replan_: Replan, metrics_path: str | None, echo: bool) -> None:
    announce(replan_.line(), echo)
    if metrics_path:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(replan_.to_dict()) + "\n")


def train_elastic(
    plan: Plan,
    config: TrainConfig,
    attempt: Callable[[Plan, TrainConfig], Any],
    *,
    policy: ElasticPolicy,
) -> ElasticResult:
    """Run ``attempt(plan, config)`` (one standalone launch of ``config.steps`` steps, see
    :func:`dapple.runtime.train` with ``elastic``), re-planning for the devices left whenever
    a device is lost (see the module docstring).

    Args:
        config: The run's options; ``checkpoint_dir`` and ``save_every`` are required.

    Raises:
        ElasticStop: below ``policy.min_devices``, ``policy.max_restarts`` used up, or no
            plan fits the devices left.
        RankFailure: a failure that lost no device (an error of the run itself).
    """
    ckpt_dir = _check_options(config)
    if len(plan.devices) < policy.min_devices:
        raise ValidationError(
            f"elastic min_devices {policy.min_devices} is more than the plan's "
            f"{len(plan.devices)} devices, so the run would stop before its first step: give a "
            f"plan for at least {policy.min_devices} devices or a lower --min-devices"
        )
    devices = _visible_devices(len(plan.devices))
    with tempfile.TemporaryDirectory(prefix="dapple-elastic-") as tmp:
        metrics_path = config.metrics_path or str(Path(tmp) / "metrics.jsonl")
        config = dataclasses.replace(config, metrics_path=metrics_path)
        with RunClosing(
            tmp, partial(stop_line, metrics_path=metrics_path, checkpoint_dir=ckpt_dir)
        ):
            return _attempts(plan, config, attempt, policy, devices)


def _attempts(
    plan: Plan,
    config: TrainConfig,
    attempt: Callable[[Plan, TrainConfig], Any],
    policy: ElasticPolicy,
    devices: list[str],
) -> ElasticResult:
    """:func:`train_elastic`'s attempts and re-plans, ``config`` writing its metrics file."""
    ckpt_dir, metrics_path = _check_options(config), str(config.metrics_path)
    replans: list[Replan] = []
    while True:
        try:
            attempt(plan, config)
            break
        except RankFailure as failure:
            left = _survivors(failure, devices, policy)
            policy, left = _kinds_left(policy, failure, devices, left)
            resume_step = _resume_step(ckpt_dir)
            if resume_step >= config.steps:  # lost after the last step's checkpoint: done
                break
            if len(replans) >= policy.max_restarts:
                raise ElasticStop(
                    f"{failure}; {len(replans)} re-plans made, the most allowed "
                    f"(max_restarts={policy.max_restarts}); resume from {ckpt_dir!r}"
                ) from failure
            lost = ", ".join(map(str, failure.lost_ranks()))
            announce(f"lost rank {lost}, re-planning for the {len(left)} devices left",
                     config.echo)  # fmt: skip
            rep = _replan(policy, failure, plan, len(left), resume_step)
            _record(rep, metrics_path, config.echo)
            replans.append(rep)
            plan, devices = rep.new, left[: len(rep.new.devices)]
            _show_devices(devices)
            config = _resuming(config)
    records = _tagged_steps(metrics_path)
    return ElasticResult([metrics_from_dict(d) for d in records], tuple(replans), plan)


def _replan(
    policy: ElasticPolicy, failure: RankFailure, plan: Plan, left: int, resume_step: int
) -> Replan:
    t0 = time.perf_counter()
    new = replan(policy, left, plan)
    lost = failure.lost_ranks()
    why = (
        f"lost rank(s) {', '.join(map(str, lost))}; the planner's best plan for the {left} "
        f"devices left uses {len(new.devices)}, predicted {new.predicted_step_ms:.1f} ms per step"
    )
    return Replan(resume_step, lost, plan, new, why, time.perf_counter() - t0)


def _visible_devices(n: int) -> list[str]:
    """The device names of the plan's ``n`` ranks: ``CUDA_VISIBLE_DEVICES``' entries where it is
    set, else ``0..n-1`` (the local rank is the device index)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    names = [d.strip() for d in env.split(",") if d.strip()] if env else []
    return names[:n] if len(names) >= n else [str(i) for i in range(n)]


def _show_devices(devices: list[str]) -> None:
    """Hide the lost GPUs from the next attempt's workers (rank r uses the r-th visible one)."""
    import torch

    if torch.cuda.is_available() or "CUDA_VISIBLE_DEVICES" in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)


def _tagged_steps(path: str | Path) -> list[dict[str, Any]]:
    """The step records of an elastic run's metrics file; those after re-plan k (1, 2...)
    carry ``extra["replan"] = k`` and the replication they ran under."""
    out, k, replication = [], 0, ""
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        if "event" in d:
            k, replication = k + 1, Plan.from_dict(d["new_plan"]).replication
        elif k:
            out.append({**d, "extra": {**d.get("extra", {}), "replan": k,
                                       "replication": replication}})  # fmt: skip
        else:
            out.append(d)
    return out


def metrics_lines(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """An elastic run's metrics file: (step records, re-plan events), each in file order."""
    steps: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            (events if "event" in d else steps).append(d)
    return steps, events

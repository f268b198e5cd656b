"""``dapple train``: run a plan for N synchronous steps on torch.distributed.

Standalone it starts one local process per plan device; under ``torchrun --nproc-per-node K
-m dapple train ...`` each process is one rank (rank r runs plan device r). Rank 0 prints one
line per step (loss, step time, samples/s, per-stage peak memory).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics

from dapple.errors import ValidationError
from dapple.plan import Plan

__all__ = ["register", "run"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="train a plan on torch.distributed (standalone or under torchrun)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--plan", required=True, help="plan JSON file")
    p.add_argument("--model", required=True, help="zoo model name or module:factory")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps (default 1)")
    p.add_argument("--seed", type=int, default=0, help="weights seed; step t uses batch seed+t")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    p.add_argument("--metrics", default=None, help="write per-step metrics as JSON lines here")
    p.add_argument("--profile", default=None, help="profile JSON: print the predicted step time")
    p.add_argument("--cluster", default=None, help="cluster preset or JSON (with --profile)")
    p.add_argument(
        "--timeout-s", type=float, default=300.0, help="fail instead of waiting longer on a peer"
    )
    p.add_argument("--recompute", action="store_true", help="re-compute forwards on every stage")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.set_defaults(func=run)


def _predicted_step_ms(plan: Plan, profile_path: str, cluster_spec: str) -> tuple[float, str]:
    """The simulator's step time for ``plan`` (or the planner's L when no simulator exists)."""
    from dapple.cluster import load_cluster
    from dapple.profile import ModelProfile

    profile = ModelProfile.load(profile_path)
    cluster = load_cluster(cluster_spec)
    try:
        from dapple.simulate import simulate
    except ImportError:
        try:
            from dapple.planner.cost import pipeline_latency
        except ImportError:
            return math.nan, "no simulator or cost model available"
        return pipeline_latency(plan, profile, cluster).L_ms, "cost model L"
    return simulate(plan, profile, cluster).step_ms, "simulator"


def run(args: argparse.Namespace) -> int:
    from dapple.runtime import train

    if (args.profile is None) != (args.cluster is None):
        raise ValidationError("--profile and --cluster must be given together")
    plan = Plan.load(args.plan)
    predicted, source = math.nan, ""
    if args.profile is not None:
        predicted, source = _predicted_step_ms(plan, args.profile, args.cluster)
    metrics = train(
        plan,
        args.model,
        steps=args.steps,
        seed=args.seed,
        optimizer=args.optimizer,
        lr=args.lr,
        timeout_s=args.timeout_s,
        recompute=args.recompute,
        metrics_path=args.metrics,
        echo=True,
        device=args.device,
        predicted_step_ms=predicted,
    )
    if metrics and int(os.environ.get("RANK", "0")) == 0:
        # the first step includes connection set-up and warm-up; report the rest when possible
        steady = [m.step_ms for m in metrics[1:]] or [metrics[0].step_ms]
        line = f"measured step time {statistics.median(steady):.1f} ms (median of {len(steady)})"
        if args.profile is not None:
            line += (
                f" vs predicted {predicted:.1f} ms ({source})"
                if not math.isnan(predicted)
                else f"; no prediction ({source})"
            )
        print(line)
    return 0

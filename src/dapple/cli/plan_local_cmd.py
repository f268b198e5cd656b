"""``dapple plan-local``: plan for this machine's CPU cores, choosing the number of processes.

For each candidate count k: profile the model as one of k co-located workers, calibrate this
machine with k processes, plan for k devices (:func:`dapple.calibrate.local.plan_local`); print every
candidate and write the best plan with the profile and cluster it was made from, ready for
``dapple train --plan``.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from rich.table import Table

from dapple.api.planning_local import PlanLocalConfig
from dapple.cli._console import StepProgress, console, print_table
from dapple.cli._model_args import add_model_arguments, model_config, parse_overrides
from dapple.cli._renamed import renamed
from dapple.cli._run_args import add_precision_argument
from dapple.core.precision import precision_of
from dapple.errors import ValidationError

__all__ = ["parse_counts", "plan_local_config_of", "register", "run_config", "train_command"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plan-local",
        help="plan for this machine's CPU cores: profile, calibrate and plan for each process "
        "count, keep the fastest",
    )
    add_model_arguments(p)
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per step")
    p.add_argument(
        "--nprocs",
        default="2,4",
        metavar="N,N,...",
        help="candidate numbers of local processes, each planned (default 2,4; calibrate's and "
        "demo's --nproc is one number)",
    )
    p.add_argument("--nproc", action=renamed("--nprocs"), help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=5, help="timed runs per layer, median kept")
    add_precision_argument(p)
    p.add_argument(
        "--out-dir",
        required=True,
        help="directory for plan.json and the chosen count's profile.json and cluster.json",
    )
    p.set_defaults(func=run)


def parse_counts(text: str) -> list[int]:
    """``"2,4"`` -> ``[2, 4]``.

    Raises:
        ValidationError: empty, non-integer or below-2 entries.
    """
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(k < 2 for k in counts):
        raise ValidationError(f"--nprocs expects integers >= 2 like 2,4, got {text!r}")
    return counts


def plan_local_config_of(args: argparse.Namespace) -> PlanLocalConfig:
    """The :class:`~dapple.api.planning_local.PlanLocalConfig` of ``dapple plan-local``'s
    flags.

    Raises:
        ValidationError: bad ``--nprocs`` or a ``--set`` item without ``=``.
    """
    return PlanLocalConfig(
        model=model_config(args),
        global_batch_size=args.global_batch_size,
        nprocs=tuple(parse_counts(args.nprocs)),
        repeats=args.repeats,
        precision=args.precision,
        out_dir=args.out_dir,
    )


def _set_item(key: str, value: Any) -> str:
    """A ``--set`` item that reads back as ``value`` (a string as it is, when it reads back)."""
    if isinstance(value, str) and parse_overrides([f"{key}={value}"])[key] == value:
        return f"{key}={value}"
    return f"{key}={json.dumps(value)}"


def train_command(cfg: PlanLocalConfig, plan: Path) -> str:
    """The ``dapple train`` command line for the chosen plan, with every model option given
    here (``--set``, ``--split-at``, ``--weights``, ``--dynamic-dims``) and the precision."""
    m = cfg.model
    assert m.spec is not None  # -m is a required flag
    argv = ["dapple", "train", "--plan", str(plan), "--model", m.spec]
    for key, value in m.set.items():
        argv += ["--set", _set_item(key, value)]
    if m.split_at:
        argv += ["--split-at", ",".join(m.split_at)]
    if m.weights:
        argv += ["--weights", m.weights]
    for item in m.dynamic_dims:
        argv += ["--dynamic-dims", item]
    if precision_of(cfg.precision).autocast:  # fp32, the default, goes unsaid
        argv += ["--precision", cfg.precision]
    return shlex.join(argv)


def run(args: argparse.Namespace) -> int:
    return run_config(plan_local_config_of(args))


def run_config(cfg: PlanLocalConfig) -> int:
    """Plan what ``cfg`` asks for (:func:`dapple.api.planning_local.plan_local_candidates`,
    which writes the best count's files), print every candidate and the command that trains
    the best (``dapple plan-local`` once its flags are read)."""
    from dapple.api.planning_local import check_plan_local, plan_local_candidates
    from dapple.models.zoo import load_workload

    assert cfg.out_dir is not None and cfg.model.spec is not None  # required flags
    check_plan_local(cfg, flags=True)  # before the model is loaded
    workload = load_workload(cfg.model.spec, **cfg.model.overrides())
    con = console()
    with StepProgress("plan-local", console=con) as progress:
        best, cands = plan_local_candidates(cfg, workload, progress, flags=True)
    t = Table(title=f"{workload.name}, global batch {cfg.global_batch_size}")
    for col in ("processes", "plan", "M", "predicted ms/step", "samples/s"):
        t.add_column(col, justify="right")
    for c in cands:
        mark = " *" if c is best else ""
        t.add_row(
            f"{c.processes}{mark}",
            ":".join(str(s.replicas) for s in c.plan.stages),
            str(c.plan.num_micro_batches),
            f"{c.predicted_ms:.1f}",
            f"{cfg.global_batch_size / c.predicted_ms * 1e3:.1f}",
        )
    print_table(con, t)
    used, out = len(best.plan.devices), Path(cfg.out_dir)
    runs_on = "" if used == best.processes else f", the plan runs on {used} of them"
    con.print(
        f"* chosen: {best.processes} processes{runs_on} -> {out / 'plan.json'} (with "
        f"profile.json and cluster.json); run it with: {train_command(cfg, out / 'plan.json')}"
    )
    return 0

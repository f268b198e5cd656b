"""``dapple train``: run a plan for N synchronous steps on torch.distributed.

Standalone it starts one local process per plan device; under ``torchrun --nproc-per-node K
-m dapple train ...`` each process is one rank (rank r runs plan device r). Rank 0 prints one
line per step (loss, lr, grad norm, eval loss, step time, samples/s, tokens/s, per-stage peak
memory), a progress bar when stdout is a terminal, and at the end the final train and validation
losses and the loss-curve PNG. Before step 0 it names each start-up phase as it starts
(``start-up: loading the model ...``, ``start-up: rendezvous``, ...), and one line each says
what was loaded (``weights loaded: ...``), saved (``checkpoint saved: ...``) or resumed
(``resumed: ...``, and ``lr schedule re-derived: ...`` when the schedule changed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
from typing import TYPE_CHECKING, Any

from dapple.cli._config_args import add_config_arguments
from dapple.cli._console import plain_doc
from dapple.cli._data_args import add_eval_data_argument
from dapple.cli._profile_arg import add_profile_argument
from dapple.cli._run_args import add_recompute_argument, add_run_arguments
from dapple.cli._train_flags import (
    FILE_GIVES,
    TRAIN_SECTIONS_HELP,
    read_run_config,
    required_inputs,
)
from dapple.cli._train_show import add_show_arguments, loss_curve_path, print_summary
from dapple.core.cluster_presets import describe_presets
from dapple.core.plan import Plan
from dapple.core.planning_options import NONFINITE_MODES
from dapple.files.output_path import check_output_file, check_picture_file

if TYPE_CHECKING:  # torch-free import of the CLI
    from pathlib import Path

    from dapple.api.run_config import RunConfig
    from dapple.runtime.launch.early import EarlyWorkers
    from dapple.runtime.step_metrics import StepMetrics

__all__ = ["DEFAULT_KEEP", "register", "run", "run_config"]

DEFAULT_KEEP = 3
"""``--keep``: checkpoints kept on disk (each holds weights, optimizer state and RNG states)."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="train a plan on torch.distributed (standalone or under torchrun)",
        description=plain_doc(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p, steps=1)
    p.add_argument("--metrics", default=None, help="write per-step metrics as JSON lines here")
    add_profile_argument(
        p,
        required=False,
        help="profile JSON or paper:NAME: print the simulated step time beside the measured one "
        "(KIND=FILE once per device kind of a mixed cluster: each kind's own)",
    )
    p.add_argument(
        "--cluster",
        default=None,
        help=f"with --profile: a JSON/TOML file or a preset: {describe_presets()}",
    )
    add_recompute_argument(p)
    add_eval_data_argument(p)
    _register_long_run(p)
    add_show_arguments(p)
    add_config_arguments(p, FILE_GIVES, TRAIN_SECTIONS_HELP)
    p.set_defaults(func=run)


def _register_long_run(p: argparse.ArgumentParser) -> None:
    """Checkpoint / resume / non-finite flags."""
    g = p.add_argument_group("long runs")
    g.add_argument(
        "--checkpoint-dir",
        default=None,
        help="save checkpoints here (per layer): after the run's last step, and every "
        "--save-every N steps when given",
    )
    g.add_argument(
        "--save-every",
        type=int,
        default=0,
        metavar="N",
        help="save every N steps and at the run's last step (not given: at the last step "
        "only; 0: never)",
    )
    g.add_argument(
        "--keep",
        type=int,
        default=DEFAULT_KEEP,
        metavar="K",
        help="keep the K newest checkpoints (default %(default)s; 0 keeps all)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest intact checkpoint (saved under any plan); with none, "
        "warn and start at step 0",
    )
    g.add_argument(
        "--require-resume",
        action="store_true",
        help="as --resume, but fail when --checkpoint-dir holds no checkpoint to resume",
    )
    g.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="start at step 0 in a --checkpoint-dir that holds checkpoints: they are deleted "
        "at this run's first save (without it, or --resume, such a run is refused)",
    )
    g.add_argument(
        "--on-nonfinite",
        choices=NONFINITE_MODES,
        default="stop",
        help="non-finite loss/gradient: stop (default, exit non-zero) or skip the step; off: "
        "no guard (no rank waits for the others before its update; metrics a step late; not "
        "with fp16 or --clip-grad-norm)",
    )
    e = p.add_argument_group("elastic runs")
    e.add_argument(
        "--elastic",
        action="store_true",
        help="when a device is lost, re-plan for the devices left (the planner's search on "
        "--profile and --cluster less the lost device, same global batch) and go on from the "
        "newest checkpoint; under torchrun (--nnodes MIN:MAX), plan for each attempt's devices",
    )
    e.add_argument(
        "--min-devices",
        type=int,
        default=1,
        metavar="N",
        help="stop, resumable, rather than go on with fewer than N devices (default %(default)s)",
    )
    e.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="K",
        help="re-plans an elastic run may make (default %(default)s)",
    )


def _phase(line: str) -> None:
    """A start-up phase as it starts, on rank 0's stdout as the step lines (under ``torchrun``
    every rank runs this command; the others stay silent)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def _check_output(path: str | os.PathLike[str] | None, what: str, *, picture: bool = False) -> None:
    """Rank 0 (which writes the metrics and the loss curve) refuses, before any worker starts,
    an output path it could not write at the end (:func:`check_output_file`; ``picture``: in
    a format it cannot draw, :func:`check_picture_file`)."""
    if path is not None and int(os.environ.get("RANK", "0")) == 0:
        (check_picture_file if picture else check_output_file)(path, what)


def _early_workers(
    spec: str, overrides: dict[str, Any], world: int
) -> contextlib.AbstractContextManager[EarlyWorkers | None]:
    """Standalone: the ``world`` workers, started now so that they start and load the model
    ``spec`` (with ``overrides``) while this process loads it and checks the plan
    (:mod:`dapple.runtime.launch.early`); they get the run once every check passed, and end
    without a word otherwise. Under ``torchrun``: none (this process is one rank)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return contextlib.nullcontext()
    from dapple.profiler.host_fit import check_local_processes
    from dapple.runtime.launch.early import EarlyWorkers

    check_local_processes(world, f"--plan of {world} devices (one local process each)")
    return EarlyWorkers(world, spec, overrides, echo=True)


def run(args: argparse.Namespace) -> int:
    cfg, at_end = read_run_config(args)  # the flags and the --config file, read once
    if args.print_config:
        from dapple.api.run_config import dump_run_config

        print(dump_run_config(cfg), end="")
        return 0
    if at_end:
        _phase(
            f"checkpoints: one, after the last step (step {cfg.train.steps}), in "
            f"{cfg.train.checkpoint_dir} (--save-every N also saves every N steps)"
        )
    return run_config(cfg)


def run_config(cfg: RunConfig) -> int:
    """Train the run ``cfg`` asks for (``dapple train`` once its flags and file are read)."""
    from dapple.api import check_outputs, plan_with
    from dapple.profiler.host_fit import check_device_available

    plan_path, spec = required_inputs(cfg)
    check_device_available(cfg.train.device)  # once here, not in each worker once started
    c = cfg.plan
    plan = plan_with(plan_path, c.schedule, c.policy, c.virtual_stages, cli=True)
    check_outputs(cfg.train, flags=True)  # here too: before the workers start
    curve = loss_curve_path(cfg.run.loss_curve, cfg.train.metrics_path)
    _check_output(curve, "loss curve file", picture=True)
    overrides = cfg.model_overrides()
    with _early_workers(spec, overrides, len(plan.devices)) as early:
        metrics = _checked_train(cfg, early)
    if metrics and int(os.environ.get("RANK", "0")) == 0:
        _report(cfg, plan, metrics, curve)
    return 0


def _report(cfg: RunConfig, plan: Plan, metrics: list[StepMetrics], curve: Path | None) -> None:
    """Rank 0 after the run: the measured step time beside the predicted one and what the
    prediction rests on, the memory table (both with a profile and cluster; neither after a
    re-plan: they were for the first plan), then :func:`print_summary`."""
    from dapple.api.running import PLANNED_MEMORY

    if "replan" in metrics[-1].extra:  # the plan changed: no prediction or table fits
        final = metrics[-1].extra["replication"]
        k = metrics[-1].extra["replan"]
        print(f"the run re-planned {'once' if k == 1 else f'{k} times'}; its last plan: "
              f"replication {final}")  # fmt: skip
        print_summary(metrics, curve)
        return
    # the first step includes connection set-up and warm-up; report the rest when possible
    steady = [m.step_ms for m in metrics[1:]] or [metrics[0].step_ms]
    line = f"measured step time {statistics.median(steady):.1f} ms (median of {len(steady)})"
    predicted = metrics[0].predicted_step_ms
    print(line + ("" if predicted is None else f" vs predicted {predicted:.1f} ms (simulator)"))
    profile, cluster = cfg.run.profile, cfg.run.cluster
    if predicted is not None and profile is not None and cluster is not None:
        from dapple.cli._prediction_note import prediction_basis

        print(prediction_basis(profile, cluster, statistics.median(steady), predicted))
    estimate = metrics[-1].extra.get(PLANNED_MEMORY)
    if estimate is not None:
        from dapple.cli._memory_table import memory_table

        memory_table(plan, metrics[-1], estimate, cfg.train.optimizer)
    print_summary(metrics, curve)


def _checked_train(cfg: RunConfig, early: EarlyWorkers | None) -> list[StepMetrics]:
    """Train ``cfg`` through :func:`dapple.api.train` (on the ``early`` workers when given),
    which loads the plan, model and data, and checks them and the checkpoints before any
    worker gets the run; rank 0's metrics, each step's line and a progress bar shown."""
    from dapple.api import train

    shown = dataclasses.replace(cfg.train, echo=True, progress=True)  # step lines, a progress bar
    return train(dataclasses.replace(cfg, train=shown), early=early, flags=True)

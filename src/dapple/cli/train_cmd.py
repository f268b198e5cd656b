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
import math
import os
import statistics
import sys
from typing import TYPE_CHECKING

from dapple.cli._data_args import add_eval_data_argument, open_datasets, with_seq_len
from dapple.cli._model_args import model_overrides
from dapple.cli._optim_args import optim_options
from dapple.cli._precision import note_profile_precision
from dapple.cli._run_args import add_run_arguments, load_run_plan
from dapple.cli._train_show import (
    add_show_arguments,
    eval_defaults,
    loss_curve_path,
    print_summary,
    show_options,
)
from dapple.core.cluster import describe_presets
from dapple.core.output_path import check_output_file
from dapple.core.plan import Plan
from dapple.errors import ValidationError

if TYPE_CHECKING:  # torch-free import of the CLI
    from dapple.models.workload import Workload
    from dapple.runtime.config import StepMetrics
    from dapple.runtime.early import EarlyWorkers

__all__ = ["DEFAULT_KEEP", "check_long_run", "register", "run"]

DEFAULT_KEEP = 3
"""``--keep``: checkpoints kept on disk (each holds weights, optimizer state and RNG states)."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="train a plan on torch.distributed (standalone or under torchrun)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p, steps=1)
    p.add_argument("--metrics", default=None, help="write per-step metrics as JSON lines here")
    p.add_argument(
        "--profile",
        default=None,
        help="profile JSON or paper:NAME: print the simulated step time beside the measured one",
    )
    p.add_argument(
        "--cluster",
        default=None,
        help=f"with --profile: a JSON/TOML file or a preset: {describe_presets()}",
    )
    p.add_argument("--recompute", action="store_true", help="re-compute forwards on every stage")
    add_eval_data_argument(p)
    _register_long_run(p)
    add_show_arguments(p)
    p.set_defaults(func=run)


def _register_long_run(p: argparse.ArgumentParser) -> None:
    """Checkpoint / resume / non-finite flags."""
    g = p.add_argument_group("long runs")
    g.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (per layer)")
    g.add_argument("--save-every", type=int, default=0, help="save every N steps (0: never)")
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
        choices=("stop", "skip"),
        default="stop",
        help="non-finite loss/gradient: stop (default, exit non-zero) or skip the step",
    )


def check_long_run(
    checkpoint_dir: str | None,
    workload: Workload,
    plan_num_layers: int,
    *,
    resume: bool,
    require_resume: bool = False,
    overwrite: bool = False,
    optimizer: str | None = None,
    save_every: int = 0,
) -> None:
    """Before any worker gets its run, and without creating anything: the checkpoint directory is
    writable; with ``resume`` the newest intact checkpoint (every file's size and hash as its
    manifest lists, optimizer state whole; damaged newer ones are passed over with a warning)
    is of this model and ``optimizer`` and the plan covers the model - no checkpoint at all is
    a warning, or an error with ``require_resume``; without ``resume`` the directory holds no
    checkpoints unless ``overwrite`` (a warning then). Warnings go to stderr, one line each.

    Raises:
        ValidationError: ``resume`` and ``overwrite`` together.
        CheckpointError: unwritable directory, no intact or a foreign checkpoint to resume,
            nothing to resume with ``require_resume``, or checkpoints of another run.
    """
    from dapple.runtime.checkpoint import (
        CheckpointError,
        check_compatible,
        check_writable,
        describe_steps,
        find_resume_checkpoint,
        list_checkpoints,
        refuse_occupied,
    )
    from dapple.runtime.longrun import OPTIMIZER_CLASSES

    if checkpoint_dir is None:
        return
    resume = resume or require_resume
    if resume and overwrite:
        raise ValidationError(
            "--resume continues the checkpoints that --overwrite-checkpoints deletes: give one"
        )
    if resume:
        point = find_resume_checkpoint(checkpoint_dir)
        ck = point.checkpoint
        if ck is None:
            what = "no such directory" if not os.path.isdir(checkpoint_dir) else "none there"
            if require_resume:
                raise CheckpointError(
                    f"--require-resume: no checkpoint to resume in {checkpoint_dir!r} ({what})"
                )
            _warn(f"--resume: no checkpoint in {checkpoint_dir!r} ({what}): starting at step 0")
        else:
            check_compatible(
                ck,
                model_name=workload.name,
                num_layers=workload.num_layers,
                plan_num_layers=plan_num_layers,
                optimizer_type=OPTIMIZER_CLASSES.get(optimizer or ""),
            )
            for line in point.skipped:
                _warn(f"{line}; resuming from the older step {ck.step} ({str(ck.path)!r})")
    elif overwrite:
        old = list_checkpoints(checkpoint_dir)
        if old:
            when = "at this run's first save" if save_every > 0 else "never: --save-every is 0"
            _warn(
                f"--overwrite-checkpoints: the {len(old)} checkpoints in {checkpoint_dir!r} "
                f"({describe_steps(old)}) are deleted {when}"
            )
    else:
        refuse_occupied(
            checkpoint_dir,
            "pass --resume to continue them, or --overwrite-checkpoints to delete them and "
            "start over (or choose an empty directory)",
        )
    check_writable(checkpoint_dir)


def _phase(line: str) -> None:
    """A start-up phase as it starts, on rank 0's stdout as the step lines (under ``torchrun``
    every rank runs this command; the others stay silent)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def _warn(line: str) -> None:
    print(f"dapple: warning: {line}", file=sys.stderr, flush=True)


def _keep(keep: int) -> int | None:
    """``--keep``: K, or None for 0 (keep all).

    Raises:
        ValidationError: a negative K.
    """
    if keep < 0:
        raise ValidationError(f"--keep must be >= 0 (0 keeps every checkpoint), got {keep}")
    return keep or None


def _predicted_step_ms(plan: Plan, profile_spec: str, cluster_spec: str) -> float:
    """The simulator's step time for ``plan`` on ``profile_spec`` (a file or ``paper:NAME``)."""
    from dapple.core.cluster import load_cluster
    from dapple.profiler.paper_models import load_profile
    from dapple.simulate import simulate

    return simulate(plan, load_profile(profile_spec), load_cluster(cluster_spec)).step_ms


def _memory_table(
    plan: Plan,
    last: StepMetrics,
    profile_spec: str,
    cluster_spec: str,
    optimizer: str,
    momentum: float = 0.0,
) -> None:
    """Each stage's measured memory beside the planner's per-replica estimate (interleaved and
    ZB-H1: per device group, all its chunks, by replaying the schedule's compute order)."""
    import dataclasses

    from rich.table import Table

    from dapple.cli._console import console, print_table
    from dapple.core.cluster import load_cluster
    from dapple.planner.cost import pipeline_latency
    from dapple.profiler.paper_models import load_profile
    from dapple.runtime.optim_config import state_factor

    profile = dataclasses.replace(
        load_profile(profile_spec), optimizer_state_factor=state_factor(optimizer, momentum)
    )
    if plan.schedule in ("interleaved", "zbh1"):
        from dapple.planner.schedules import device_memory_by_group

        estimate = device_memory_by_group(plan, profile)
    else:
        rows = pipeline_latency(plan, profile, load_cluster(cluster_spec)).stages
        estimate = [float(r.memory_bytes) for r in rows if r.kind == "compute"]
    mib = 2**20
    table = Table(title=f"memory per replica (planner: {optimizer} state, K_i in flight)")
    for col in ("stage", "replicas", f"peak {last.resident_kind}", "added by the stage",
                f"peak {last.memory_kind}", "planner estimate", "estimate / added"):  # fmt: skip
        table.add_column(col, justify="right")
    for s, st in enumerate(plan.stages[: plan.num_groups]):  # a group's chunks: its first stage
        added = last.stage_resident_bytes[s] if last.stage_resident_bytes else 0
        chunks = plan.stages_of_device(st.devices[0])
        table.add_row(
            str(s) if len(chunks) == 1 else ",".join(map(str, chunks)),
            str(st.replicas),
            f"{last.peak_resident_bytes[s] / mib:.1f} MiB" if last.peak_resident_bytes else "-",
            f"{added / mib:.1f} MiB" if last.stage_resident_bytes else "-",
            f"{last.peak_memory_bytes[s] / mib:.1f} MiB",
            f"{estimate[s] / mib:.1f} MiB",
            f"{estimate[s] / added:.2f}" if added > 0 else "-",
        )
    print_table(console(), table)


def _check_output(path: str | os.PathLike[str] | None, what: str) -> None:
    """Rank 0 (which writes the metrics and the loss curve) refuses, before any worker starts,
    an output path it could not write at the end (:func:`check_output_file`)."""
    if path is not None and int(os.environ.get("RANK", "0")) == 0:
        check_output_file(path, what)


def _model_arg(args: argparse.Namespace) -> Workload:
    """The workload ``--model`` (with ``--set``, ``--split-at``, ``--weights``...) names, loaded
    once here - every check before the launch uses it - and pickled as its spec, so each
    spawned worker loads it once more, itself."""
    from dapple.api import load

    return load(args.model, **with_seq_len(args, model_overrides(args)))


def _early_workers(
    args: argparse.Namespace, world: int
) -> contextlib.AbstractContextManager[EarlyWorkers | None]:
    """Standalone: the ``world`` workers, started now so that they start and load the model
    while this process loads it and checks the plan (:mod:`dapple.runtime.early`); they get
    the run once every check passed, and end without a word otherwise. Under ``torchrun``:
    none (this process is one rank)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return contextlib.nullcontext()
    from dapple.runtime.early import EarlyWorkers

    overrides = with_seq_len(args, model_overrides(args))
    return EarlyWorkers(world, args.model, overrides, echo=True)


def run(args: argparse.Namespace) -> int:
    if (args.profile is None) != (args.cluster is None):
        raise ValidationError("--profile and --cluster must be given together")
    plan = load_run_plan(args)
    _check_output(args.metrics, "--metrics file")
    curve = loss_curve_path(args)
    _check_output(curve, "loss curve")
    with _early_workers(args, len(plan.devices)) as early:
        metrics, predicted = _checked_train(args, plan, early)
    if metrics and int(os.environ.get("RANK", "0")) == 0:
        # the first step includes connection set-up and warm-up; report the rest when possible
        steady = [m.step_ms for m in metrics[1:]] or [metrics[0].step_ms]
        line = f"measured step time {statistics.median(steady):.1f} ms (median of {len(steady)})"
        if args.profile is not None:
            line += f" vs predicted {predicted:.1f} ms (simulator)"
        print(line)
        if args.profile is not None:
            _memory_table(
                plan, metrics[-1], args.profile, args.cluster, args.optimizer, args.momentum
            )
        print_summary(metrics, curve)
    return 0


def _checked_train(
    args: argparse.Namespace, plan: Plan, early: EarlyWorkers | None
) -> tuple[list[StepMetrics], float]:
    """Load the model, check the plan, data and checkpoints against it, then train (on the
    ``early`` workers when given); rank 0's metrics and the predicted step time (NaN: none)."""
    from dapple.runtime import train

    _phase(f"start-up: loading the model {args.model}")
    wl = _model_arg(args)
    plan.check_model(wl.name, wl.num_layers)  # the plan was made for this model
    data, eval_data = open_datasets(args)
    eval_defaults(
        args,
        len(eval_data) if eval_data is not None else None,  # type: ignore[arg-type]
        plan.global_batch_size,
    )
    if data is not None or eval_data is not None:  # before the checkpoint directory is made
        from dapple.runtime.data import check_data

        check_data(wl, data, plan.global_batch_size, args.seed, eval_data=eval_data)
    keep = _keep(args.keep)
    if args.checkpoint_dir is not None:
        if args.resume or args.require_resume:  # every file of the newest one is hashed
            _phase(f"start-up: checking the checkpoints in {args.checkpoint_dir}")
        check_long_run(
            args.checkpoint_dir,
            wl,
            plan.num_layers,
            resume=args.resume,
            require_resume=args.require_resume,
            overwrite=args.overwrite_checkpoints,
            optimizer=args.optimizer,
            save_every=args.save_every,
        )
    predicted = math.nan
    if args.profile is not None:
        predicted = _predicted_step_ms(plan, args.profile, args.cluster)
        note_profile_precision(args.profile, args.precision)
    metrics = train(
        plan,
        wl,
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
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        keep=keep,
        resume=args.resume or args.require_resume,
        overwrite_checkpoints=args.overwrite_checkpoints,
        on_nonfinite=args.on_nonfinite,
        data=data,
        eval_data=eval_data,
        early=early,
        **show_options(args),
        precision=args.precision,
        **optim_options(args),
    )
    return metrics, predicted

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
import sys
from typing import TYPE_CHECKING, Any

from dapple.cli._config_args import add_config_arguments
from dapple.cli._console import plain_doc
from dapple.cli._data_args import add_eval_data_argument
from dapple.cli._precision import note_profile_precision
from dapple.cli._profile_arg import add_profile_argument
from dapple.cli._run_args import add_recompute_argument, add_run_arguments
from dapple.cli._train_flags import (
    FILE_GIVES,
    TRAIN_SECTIONS_HELP,
    required_inputs,
    run_config_of,
    saves_at_the_end_only,
)
from dapple.cli._train_show import add_show_arguments, loss_curve_path, print_summary
from dapple.core.cluster_presets import describe_presets
from dapple.core.plan import Plan
from dapple.core.planning_options import NONFINITE_MODES
from dapple.errors import ValidationError
from dapple.files.output_path import check_output_dir, check_output_file, check_picture_file

if TYPE_CHECKING:  # torch-free import of the CLI
    from dapple.api.run_config import RunConfig
    from dapple.models.workload import Workload
    from dapple.runtime.checkpoint import Checkpoint
    from dapple.runtime.launch.early import EarlyWorkers
    from dapple.runtime.step_metrics import StepMetrics

__all__ = ["DEFAULT_KEEP", "check_long_run", "register", "run", "run_config"]

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
    steps: int | None = None,
    synthetic_seed: int | None = None,
) -> None:
    """Before any worker gets its run, and without creating anything: the checkpoint directory is
    writable; with ``resume`` the newest intact checkpoint (every file's size and hash as its
    manifest lists, optimizer state whole; damaged newer ones are passed over with a warning)
    is of this model and ``optimizer`` and the plan covers the model - no checkpoint at all is
    a warning, or an error with ``require_resume``; without ``resume`` the directory holds no
    checkpoints unless ``overwrite`` (a warning then); with ``steps`` the checkpoint resumed
    is below it (a run asked for no more steps than are done would do nothing); with
    ``synthetic_seed`` (a run on synthetic batches) a checkpoint saved on synthetic batches
    has that seed (as ``--data`` runs must keep theirs). Warnings go to stderr, one line each.

    Raises:
        ValidationError: ``resume`` and ``overwrite`` together.
        CheckpointError: unwritable directory, no intact or a foreign checkpoint to resume,
            nothing to resume with ``require_resume``, a checkpoint at or past ``steps`` or of
            another seed, or checkpoints of another run.
    """
    from dapple.runtime.checkpoint import (
        check_writable,
        describe_steps,
        list_checkpoints,
        refuse_foreign,
        refuse_occupied,
    )

    if checkpoint_dir is None:
        return
    resume = resume or require_resume
    if resume and overwrite:
        raise ValidationError(
            "--resume continues the checkpoints that --overwrite-checkpoints deletes: give one"
        )
    if resume:
        _check_resume_point(
            checkpoint_dir, workload, plan_num_layers, require_resume, optimizer, steps,
            synthetic_seed,
        )  # fmt: skip
    elif overwrite:
        refuse_foreign(
            checkpoint_dir,
            "--overwrite-checkpoints deletes only what dapple wrote: move them "
            "away or choose another directory",
        )
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


def _check_resume_point(
    checkpoint_dir: str,
    workload: Workload,
    plan_num_layers: int,
    require_resume: bool,
    optimizer: str | None,
    steps: int | None,
    synthetic_seed: int | None,
) -> None:
    """:func:`check_long_run` with ``resume``: the checkpoint a run would resume from."""
    from dapple.runtime.checkpoint import CheckpointError, check_compatible
    from dapple.runtime.launch.run_checks import check_layer_tensors, resume_point
    from dapple.runtime.longrun import OPTIMIZER_CLASSES

    point = resume_point(checkpoint_dir)  # verified once: the launcher asks again
    ck = point.checkpoint
    if ck is None:
        what = "no such directory" if not os.path.isdir(checkpoint_dir) else "none there"
        if require_resume:
            raise CheckpointError(
                f"--require-resume: no checkpoint to resume in {checkpoint_dir!r} ({what})"
            )
        _warn(f"--resume: no checkpoint in {checkpoint_dir!r} ({what}): starting at step 0")
        return
    check_compatible(
        ck,
        model_name=workload.name,
        num_layers=workload.num_layers,
        plan_num_layers=plan_num_layers,
        optimizer_type=OPTIMIZER_CLASSES.get(optimizer or ""),
    )
    check_layer_tensors(ck, workload)
    for line in point.skipped:
        _warn(f"{line}; resuming from the older step {ck.step} ({str(ck.path)!r})")
    _check_continues(ck, steps, synthetic_seed)


def _check_continues(ck: Checkpoint, steps: int | None, synthetic_seed: int | None) -> None:
    """The run would continue ``ck``: the same synthetic seed, more steps than it has done."""
    from dapple.runtime.checkpoint import CheckpointError

    saved_seed = ck.meta.extra.get("seed")
    if (
        synthetic_seed is not None
        and ck.meta.extra.get("data") is None
        and saved_seed is not None
        and saved_seed != synthetic_seed
    ):
        raise CheckpointError(
            f"--resume: the checkpoint {str(ck.path)!r} was trained on synthetic batches "
            f"of --seed {saved_seed}, not {synthetic_seed}: the run would not continue "
            f"it; pass --seed {saved_seed}"
        )
    if steps is not None and ck.step >= steps:
        raise CheckpointError(
            f"--resume: the checkpoint {str(ck.path)!r} is at step {ck.step}, which "
            f"already covers --steps {steps}: nothing to train; pass --steps above "
            f"{ck.step} to go on"
        )


def _restarted(cfg: RunConfig) -> bool:
    """Under ``torchrun``, a restarted attempt or an elastic run: it resumes whatever step it
    finds (a run whose last save came just before a failure ends at once, not in an error)."""
    if "RANK" not in os.environ:
        return False
    return cfg.run.elastic or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _phase(line: str) -> None:
    """A start-up phase as it starts, on rank 0's stdout as the step lines (under ``torchrun``
    every rank runs this command; the others stay silent)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def _warn(line: str) -> None:
    print(f"dapple: warning: {line}", file=sys.stderr, flush=True)


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
    cfg = run_config_of(args)  # the flags and the --config file, read once
    if args.print_config:
        from dapple.api.run_config import dump_run_config

        print(dump_run_config(cfg), end="")
        return 0
    if saves_at_the_end_only(args, cfg):
        _phase(
            f"checkpoints: one, after the last step (step {cfg.train.steps}), in "
            f"{cfg.train.checkpoint_dir} (--save-every N also saves every N steps)"
        )
    return run_config(cfg)


def run_config(cfg: RunConfig) -> int:
    """Train the run ``cfg`` asks for (``dapple train`` once its flags and file are read)."""
    from dapple.api import plan_with
    from dapple.profiler.host_fit import check_device_available

    plan_path, spec = required_inputs(cfg)
    check_device_available(cfg.train.device)  # once here, not in each worker once started
    c = cfg.plan
    plan = plan_with(plan_path, c.schedule, c.policy, c.virtual_stages, cli=True)
    _check_output(cfg.train.metrics_path, "--metrics file")
    if int(os.environ.get("RANK", "0")) == 0:  # the writers make the folders and write in them
        for where, flag in ((cfg.train.tensorboard_dir, "--tensorboard"),
                            (cfg.train.checkpoint_dir, "--checkpoint-dir")):  # fmt: skip
            if where is not None:
                check_output_dir(where, flag)
    curve = loss_curve_path(cfg.run.loss_curve, cfg.train.metrics_path)
    _check_output(curve, "loss curve file", picture=True)
    overrides = cfg.model_overrides()
    with _early_workers(spec, overrides, len(plan.devices)) as early:
        metrics = _checked_train(cfg, plan, (spec, overrides), early)
    if metrics and int(os.environ.get("RANK", "0")) == 0:
        if "replan" in metrics[-1].extra:  # the plan changed: no prediction or table fits
            final = metrics[-1].extra["replication"]
            k = metrics[-1].extra["replan"]
            print(f"the run re-planned {'once' if k == 1 else f'{k} times'}; its last plan: "
                  f"replication {final}")  # fmt: skip
            print_summary(metrics, curve)
            return 0
        # the first step includes connection set-up and warm-up; report the rest when possible
        steady = [m.step_ms for m in metrics[1:]] or [metrics[0].step_ms]
        line = f"measured step time {statistics.median(steady):.1f} ms (median of {len(steady)})"
        predicted = metrics[0].predicted_step_ms
        print(line + ("" if predicted is None else f" vs predicted {predicted:.1f} ms (simulator)"))
        profile, cluster, t = cfg.run.profile, cfg.run.cluster, cfg.train
        if predicted is not None and profile is not None and cluster is not None:
            from dapple.cli._prediction_note import prediction_basis

            print(prediction_basis(profile, cluster, statistics.median(steady), predicted))
        if profile is not None and cluster is not None:
            from dapple.cli._memory_table import memory_table

            memory_table(plan, metrics[-1], profile, cluster, t.optimizer, t.momentum)
        print_summary(metrics, curve)
    return 0


def _checked_train(
    cfg: RunConfig, plan: Plan, model: tuple[str, dict[str, Any]], early: EarlyWorkers | None
) -> list[StepMetrics]:
    """Load the ``model`` (its spec and overrides; once here: every check before the launch
    uses it, and each worker loads it again from its spec), check the plan, data and
    checkpoints against it, then train through :func:`dapple.api.train` (on the ``early``
    workers when given); rank 0's metrics."""
    from dapple.api import RunInputs, load, train
    from dapple.api.run_config import open_run_data

    spec, overrides = model
    _phase(f"start-up: loading the model {spec}")
    wl = load(spec, **overrides)
    plan.check_model(wl.name, wl.num_layers)  # the plan was made for this model
    d, t = cfg.data, cfg.train
    data, eval_data = (None if x is None else open_run_data(x, d.seq_len, d.documents)
                       for x in (d.path, d.eval_path))  # fmt: skip
    if data is not None or eval_data is not None:  # before the checkpoint directory is made
        from dapple.runtime.data import check_data

        check_data(wl, data, plan.global_batch_size, t.seed, eval_data=eval_data)
    if cfg.run.elastic and "RANK" in os.environ:
        # every torchrun attempt of an elastic run goes on from the newest checkpoint
        t = dataclasses.replace(t, resume=True, overwrite_checkpoints=False)
    if t.checkpoint_dir is not None:
        if t.resume or cfg.run.require_resume:  # every file of the newest one is hashed
            _phase(f"start-up: checking the checkpoints in {t.checkpoint_dir}")
        check_long_run(
            t.checkpoint_dir,
            wl,
            plan.num_layers,
            resume=t.resume,
            require_resume=cfg.run.require_resume,
            overwrite=t.overwrite_checkpoints,
            optimizer=t.optimizer,
            save_every=t.save_every,
            steps=None if _restarted(cfg) else t.steps,
            synthetic_seed=t.seed if data is None else None,
        )
    if cfg.run.profile is not None:
        note_profile_precision(cfg.run.profile, t.precision)
    shown = dataclasses.replace(t, echo=True, progress=True)  # step lines, a progress bar
    inputs = RunInputs(plan, wl, data=data, eval_data=eval_data)
    return train(dataclasses.replace(cfg, train=shown), inputs=inputs, early=early)

"""Checks the Python API's running side makes before any worker starts, and the inputs of a
run it resolves (:mod:`dapple.api.running`, :mod:`dapple.api.verifying`).

A training run's own checks, for ``dapple train`` and :func:`dapple.api.train` alike: before
anything is loaded, rank 0 can write its outputs (:func:`check_outputs`); once the inputs are
loaded (:func:`check_before_run`), the data fit the model and the batch, the checkpoint
directory is writable and a resume's checkpoint continues this run (:func:`check_long_run`),
and the profile a prediction is made from computes in the run's precision
(:func:`note_profile_precision`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dapple.api._inputs import RunInputs, WorkloadLike, say_phase
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.workload import Workload

if TYPE_CHECKING:
    from dapple.api.run_config import RunConfig
    from dapple.runtime.checkpoint import Checkpoint
    from dapple.runtime.train_config import TrainConfig

__all__ = [
    "check_before_run",
    "check_host",
    "check_long_run",
    "check_outputs",
    "check_run",
    "dataset",
    "note_profile_precision",
    "seq_overrides",
]


def check_run(plan: Plan, wl: Workload, cluster: Cluster | None = None) -> None:
    """The plan was made for this model (:meth:`~dapple.core.plan.Plan.check_model`) and its
    tensor groups can cut it (:func:`dapple.runtime.parallel.tensor_check.check_tensor_run`)."""
    from dapple.runtime.parallel.tensor_check import check_tensor_run

    plan.check_model(wl.name, wl.num_layers)
    check_tensor_run(plan, wl, cluster)


def check_outputs(t: TrainConfig, *, flags: bool = False) -> TrainConfig:
    """Rank 0, which writes them, refuses an output it could not write at the end - the metrics
    file, the TensorBoard and the checkpoint directories (:mod:`dapple.files.output_path`:
    missing folders are made by the writers, nothing is created here) - before anything is
    loaded or any worker starts. ``flags``: messages name ``dapple train``'s flags (else the
    options' names).

    Returns:
        ``t``, checked.

    Raises:
        ValidationError: one line naming the option, the path and why.
    """
    from dapple.files.output_path import check_output_dir, check_output_file

    if int(os.environ.get("RANK", "0")) != 0:
        return t
    if t.metrics_path is not None:
        check_output_file(t.metrics_path, "--metrics file" if flags else "metrics_path file")
    for where, flag, name in ((t.tensorboard_dir, "--tensorboard", "tensorboard_dir"),
                              (t.checkpoint_dir, "--checkpoint-dir", "checkpoint_dir")):  # fmt: skip
        if where is not None:
            check_output_dir(where, flag if flags else name)
    return t


def check_host(wl: Workload, device: str, optimizer: str, momentum: float, what: str) -> None:
    """What this host must have before any worker starts or layer is built: the device the
    run asks for (``cuda`` where torch sees none is refused once here, not by every worker:
    :func:`dapple.profiler.host_fit.check_device_available`); and, for a run whose processes
    all start on this host and compute on its CPU, the memory to hold the model once with
    gradients and optimizer state (:func:`dapple.profiler.host_fit.check_training_memory`).
    Under torchrun each host holds only its own ranks' stages: memory not checked."""
    import os

    from dapple.profiler.host_fit import check_device_available

    check_device_available(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return
    from dapple.profiler.host_fit import check_training_memory
    from dapple.runtime.train_config import OPTIMIZERS, state_factor

    if optimizer in OPTIMIZERS:  # another name is refused by the run's own checks
        check_training_memory(wl, state_factor(optimizer, momentum), what=what)


def seq_overrides(
    workload: WorkloadLike, overrides: Mapping[str, Any] | None, seq_len: int | None
) -> Mapping[str, Any] | None:
    """``overrides`` with ``seq=seq_len`` for a spec string (a built workload stays as is)."""
    if seq_len is None or not isinstance(workload, str):
        return overrides
    given = dict(overrides or {})
    if given.setdefault("seq", seq_len) != seq_len:
        raise ValidationError(f"overrides seq={given['seq']} disagrees with seq_len={seq_len}")
    return given


def dataset(data: Any, seq_len: int | None, documents: str | None = None) -> Any:
    """A dataset as given, or the token file (``documents``: the documents) at a path."""
    from dapple.api.run_config import open_run_data

    return None if data is None else open_run_data(data, seq_len, documents)


def check_before_run(cfg: RunConfig, inputs: RunInputs, *, flags: bool = False) -> RunConfig:
    """A training run's checks before any worker gets it, on its loaded ``inputs``: the data
    fit the model and G (:func:`dapple.runtime.data.check_data`), the checkpoints
    (:func:`check_long_run`; every attempt of an elastic ``torchrun`` run resumes the newest),
    the profile's precision (:func:`note_profile_precision`); ``flags``: messages name
    ``dapple train``'s flags. With ``cfg.train.echo``, rank 0 says when it hashes the
    checkpoints.

    Returns:
        ``cfg`` as it runs (an elastic ``torchrun`` attempt: resuming).

    Raises:
        ValidationError: data that do not fit the model or the batch; see
            :func:`check_long_run`.
        CheckpointError: see :func:`check_long_run`.
    """
    plan, wl, data, t = inputs.plan, inputs.workload, inputs.data, cfg.train
    if data is not None or inputs.eval_data is not None:  # before the checkpoint directory
        from dapple.runtime.data import check_data

        check_data(wl, data, plan.global_batch_size, t.seed, eval_data=inputs.eval_data)
    if cfg.run.elastic and "RANK" in os.environ:
        # every torchrun attempt of an elastic run goes on from the newest checkpoint
        t = dataclasses.replace(t, resume=True, overwrite_checkpoints=False)
    if t.checkpoint_dir is not None:
        if (t.resume or cfg.run.require_resume) and t.echo:  # every file of the newest is hashed
            say_phase(f"start-up: checking the checkpoints in {t.checkpoint_dir}")
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
            flags=flags,
        )
    if inputs.profile is not None:
        note_profile_precision(inputs.profile, t.precision)
    return dataclasses.replace(cfg, train=t)


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
    flags: bool = False,
) -> None:
    """Before any worker gets its run, and without creating anything: the checkpoint directory is
    writable; with ``resume`` the newest intact checkpoint (every file's size and hash as its
    manifest lists, optimizer state whole; damaged newer ones are passed over with a warning)
    is of this model and ``optimizer`` and the plan covers the model - no checkpoint at all is
    a warning, or an error with ``require_resume``; without ``resume`` the directory holds no
    checkpoints unless ``overwrite`` (a warning then); with ``steps`` the checkpoint resumed
    is below it (a run asked for no more steps than are done would do nothing); with
    ``synthetic_seed`` (a run on synthetic batches) a checkpoint saved on synthetic batches
    has that seed (as ``--data`` runs must keep theirs). Warnings go to stderr, one line each;
    ``flags``: messages name ``dapple train``'s flags (else the options' names).

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
    res, over = _option("resume", flags), _option("overwrite_checkpoints", flags)
    if resume and overwrite:
        raise ValidationError(f"{res} continues the checkpoints that {over} deletes: give one")
    if resume:
        _check_resume_point(
            checkpoint_dir, workload, plan_num_layers, require_resume, optimizer, steps,
            synthetic_seed, flags,
        )  # fmt: skip
    elif overwrite:
        refuse_foreign(
            checkpoint_dir,
            f"{over} deletes only what dapple wrote: move them away or choose another directory",
        )
        old = list_checkpoints(checkpoint_dir)
        if old:
            when = (
                "at this run's first save"
                if save_every > 0
                else f"never: {_option('save_every', flags)} is 0"
            )
            _warn(
                f"{over}: the {len(old)} checkpoints in {checkpoint_dir!r} "
                f"({describe_steps(old)}) are deleted {when}"
            )
    else:
        refuse_occupied(
            checkpoint_dir,
            f"pass {res} to continue them, or {over} to delete them and start over (or choose "
            "an empty directory)",
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
    flags: bool,
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
                f"{_option('require_resume', flags)}: no checkpoint to resume in "
                f"{checkpoint_dir!r} ({what})"
            )
        _warn(
            f"{_option('resume', flags)}: no checkpoint in {checkpoint_dir!r} ({what}): "
            "starting at step 0"
        )
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
    _check_continues(ck, steps, synthetic_seed, flags)


def _check_continues(
    ck: Checkpoint, steps: int | None, synthetic_seed: int | None, flags: bool
) -> None:
    """The run would continue ``ck``: the same synthetic seed, more steps than it has done."""
    from dapple.runtime.checkpoint import CheckpointError

    res, seed, n = (_option(x, flags) for x in ("resume", "seed", "steps"))
    saved_seed = ck.meta.extra.get("seed")
    if (
        synthetic_seed is not None
        and ck.meta.extra.get("data") is None
        and saved_seed is not None
        and saved_seed != synthetic_seed
    ):
        raise CheckpointError(
            f"{res}: the checkpoint {str(ck.path)!r} was trained on synthetic batches "
            f"of {seed} {saved_seed}, not {synthetic_seed}: the run would not continue "
            f"it; pass {seed} {saved_seed}"
        )
    if steps is not None and ck.step >= steps:
        raise CheckpointError(
            f"{res}: the checkpoint {str(ck.path)!r} is at step {ck.step}, which "
            f"already covers {n} {steps}: nothing to train; pass {n} above "
            f"{ck.step} to go on"
        )


def note_profile_precision(profile: ModelProfile | str | Path, precision: str) -> None:
    """Print a note to stderr when ``profile`` was measured in another precision than the
    run computes in (its times, activation bytes and weight cast cache then do not match)."""
    from dapple.api._inputs import as_profile

    measured = as_profile(profile).precision
    if measured != precision:
        named = profile.model_name if isinstance(profile, ModelProfile) else profile
        print(
            f"note: profile {named} was measured in {measured} and this run computes in "
            f"{precision}; `dapple profile --precision {precision}` measures a matching one",
            file=sys.stderr,
        )


def _restarted(cfg: RunConfig) -> bool:
    """Under ``torchrun``, a restarted attempt or an elastic run: it resumes whatever step it
    finds (a run whose last save came just before a failure ends at once, not in an error)."""
    if "RANK" not in os.environ:
        return False
    return cfg.run.elastic or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _option(name: str, flags: bool) -> str:
    """How a message names the option ``name``: ``dapple train``'s flag, or the field."""
    return "--" + name.replace("_", "-") if flags else name


def _warn(line: str) -> None:
    print(f"dapple: warning: {line}", file=sys.stderr, flush=True)

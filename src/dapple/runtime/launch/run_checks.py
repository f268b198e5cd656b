"""What the launcher checks before any worker starts: step 0's batch and, for a model whose
input shapes change, every step's (:func:`check_batches`); the datasets and a resume's
checkpoint (:func:`check_datasets`).

A resume's checkpoint: the one the workers would load - the newest whose files all have the size
and sha256 their manifest lists (:func:`resume_point`, damaged newer ones passed over) - is of
this model (name, layer count, each layer's tensor shapes), holds this optimizer's state and
was saved on this data stream. Refused here, a damaged, another model's or another optimizer's
checkpoint costs no worker, no model build and no rendezvous. Rank 0 verifies the files again
as it picks the checkpoint every rank loads (they may change in between); the verification
here is made once per process for files that did not change since (``dapple train`` makes it
before the launcher does).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dapple.core.plan import Plan
from dapple.models.shapes import check_steps, run_dims
from dapple.models.workload import Workload
from dapple.runtime.checkpoint import (
    Checkpoint,
    ResumePoint,
    check_compatible,
    check_layer_shapes,
    find_resume_checkpoint,
    list_checkpoints,
)
from dapple.runtime.checkpoint.files import latest_checkpoint
from dapple.runtime.data import check_data, check_data_resume, data_state
from dapple.runtime.evaluate import eval_batch_fn, eval_plan
from dapple.runtime.longrun import OPTIMIZER_CLASSES
from dapple.runtime.rank import first_batch
from dapple.runtime.train_config import TrainConfig

__all__ = [
    "check_batches",
    "check_datasets",
    "check_layer_tensors",
    "check_resume",
    "resume_point",
]


def check_batches(plan: Plan, wl: Workload, cfg: TrainConfig, data: Any) -> None:
    """Step 0's batch has G rows (:func:`~dapple.runtime.rank.first_batch`, as every rank draws
    it), and with a model whose input shapes change from step to step
    (:mod:`dapple.models.shapes`) every step's batch fits it, checked here before any worker
    starts (the workers check each step again; a model with static shapes is left to them).

    Raises:
        ValidationError: ``make_batch`` returned another number of rows than G; the first step
            whose batch the model cannot take.
    """
    if data is None:
        first_batch(wl, plan.global_batch_size, cfg.seed, None)
    if data is None and run_dims(wl, plan.global_batch_size, cfg.seed):
        check_steps(wl, plan.global_batch_size, cfg.seed, cfg.steps)


def check_datasets(
    plan: Plan,
    wl: Workload,
    cfg: TrainConfig,
    data: Any,
    eval_data: Any,
    *,
    verify_files: bool = True,
) -> None:
    """The datasets fit the model and the batch, and a resume's checkpoint is of this model
    and optimizer and continues the same data stream
    (:func:`~dapple.runtime.launch.run_checks.check_resume`).

    Raises:
        ValidationError: see :func:`dapple.runtime.data.check_data`.
        CheckpointError: the checkpoint to resume is of another model or optimizer, or was
            saved on other data.
    """
    G_e = eval_plan(plan, cfg.eval_batch_size).global_batch_size
    check_data(wl, data, plan.global_batch_size, cfg.seed, eval_data=eval_data, eval_batch_size=G_e)
    if cfg.eval_every > 0 and eval_data is not None:  # enough eval batches, before any worker
        eval_batch_fn(wl, G_e, cfg.eval_batches, eval_data)
    check_resume(plan, wl, cfg, data, verify_files=verify_files)


def check_resume(
    plan: Plan, workload: Workload, config: TrainConfig, data: Any, *, verify_files: bool = True
) -> None:
    """With ``config.resume``: the checkpoint in ``config.checkpoint_dir`` the workers would
    load (``verify_files``: :func:`resume_point`'s, every file verified; else the newest
    manifest's, for an elastic attempt that resumes from what its own run just saved) is of
    ``workload`` (:func:`check_compatible`: name and layer count, the plan's layer count;
    :func:`check_layer_tensors`), holds ``config.optimizer``'s state and was saved on
    ``data``'s stream (:func:`~dapple.runtime.data.check_data_resume`). No checkpoint: a run
    from step 0, nothing to check.

    Raises:
        CheckpointError: any of these differs; a damaged checkpoint and no older intact one,
            or no manifest reads.
    """
    if not config.resume or config.checkpoint_dir is None:
        return
    if verify_files:
        ck = resume_point(config.checkpoint_dir).checkpoint
    else:  # the manifest only
        ck = latest_checkpoint(config.checkpoint_dir)
    if ck is None:
        return
    check_compatible(
        ck,
        model_name=workload.name,
        num_layers=workload.num_layers,
        plan_num_layers=plan.num_layers,
        optimizer_type=OPTIMIZER_CLASSES.get(config.optimizer),
    )
    check_layer_tensors(ck, workload)
    check_data_resume(
        ck.meta.extra.get("data"), data_state(data, config.seed, plan.global_batch_size), ck.path
    )


def check_layer_tensors(ck: Checkpoint, workload: Workload) -> None:
    """Every layer of checkpoint ``ck`` holds the tensors of ``workload``'s layer, in its
    shapes - another model of the same name and layer count (other sizes) is refused before any
    worker starts. Layers are built on ``meta`` (no memory, no init); a layer that cannot be
    built so is left to the workers' own check.

    Raises:
        CheckpointError: the first tensor whose shape differs (see ``check_layer_shapes``).
    """
    from dapple.models.fingerprint import layer_tensors

    for i in range(min(workload.num_layers, len(ck.layers))):
        tensors = layer_tensors(workload, i)
        if tensors is not None:  # else the workers check it on the real layer
            check_layer_shapes(ck, i, {k: shape for k, (shape, _) in tensors.items()})


_verified: dict[str, tuple[tuple[tuple[str, int, int], ...], ResumePoint]] = {}
"""This process's :func:`resume_point` answers: directory -> (its files' signature, answer)."""


def resume_point(root: str | Path) -> ResumePoint:
    """:func:`~dapple.runtime.checkpoint.find_resume_checkpoint` of ``root``, which reads every
    file of the checkpoint it returns; again only when a file under ``root``'s checkpoints was
    added, removed or changed (name, size, modification time) since this process asked.

    Raises:
        CheckpointError: see :func:`~dapple.runtime.checkpoint.find_resume_checkpoint`.
    """
    key = os.path.realpath(root)
    signature = _signature(key)
    seen = _verified.get(key)
    if seen is not None and seen[0] == signature:
        return seen[1]
    point = find_resume_checkpoint(root)
    _verified[key] = (signature, point)
    return point


def _signature(root: str) -> tuple[tuple[str, int, int], ...]:
    """(path, size, modification time in ns) of every file of every checkpoint under ``root``."""
    out = []
    for d in list_checkpoints(root):
        for f in sorted(Path(d).iterdir()):
            try:
                st = f.stat()
            except OSError:  # removed while listed
                continue
            out.append((str(f), st.st_size, st.st_mtime_ns))
    return tuple(out)

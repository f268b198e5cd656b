"""What the launcher checks before any worker starts: step 0's batch and, for a model whose
input shapes change, every step's (:func:`check_batches`); the datasets and a resume's
checkpoint (:func:`check_datasets`).

A resume's checkpoint: the newest checkpoint's manifest says what the workers would load - the
model it was saved from (name, layer count, each layer's tensor shapes), the optimizer whose
state it holds and the data stream it was saved on. Refused here, another model's or
optimizer's checkpoint costs no worker, no model build and no rendezvous. The files themselves (sizes, sha256) are verified
where they are read: by ``dapple train`` before its workers get the run
(:func:`~dapple.runtime.checkpoint.find_resume_checkpoint`, which also passes over damaged
newer checkpoints) and by rank 0, which picks the checkpoint every rank loads.
"""

from __future__ import annotations

from typing import Any

from dapple.core.plan import Plan
from dapple.models.shapes import check_steps, run_dims
from dapple.models.workload import Workload
from dapple.runtime.checkpoint import Checkpoint, check_compatible, check_layer_shapes
from dapple.runtime.checkpoint.files import latest_checkpoint
from dapple.runtime.data import check_data, check_data_resume, data_state
from dapple.runtime.evaluate import eval_batch_fn, eval_plan
from dapple.runtime.longrun import OPTIMIZER_CLASSES
from dapple.runtime.rank import first_batch
from dapple.runtime.train_config import TrainConfig

__all__ = ["check_batches", "check_datasets", "check_layer_tensors", "check_resume"]


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


def check_datasets(plan: Plan, wl: Workload, cfg: TrainConfig, data: Any, eval_data: Any) -> None:
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
    check_resume(plan, wl, cfg, data)


def check_resume(plan: Plan, workload: Workload, config: TrainConfig, data: Any) -> None:
    """With ``config.resume``: the newest checkpoint in ``config.checkpoint_dir`` (its
    manifest) is of ``workload`` (:func:`check_compatible`: name and layer count, the plan's
    layer count; :func:`check_layer_tensors`), holds ``config.optimizer``'s state and was saved
    on ``data``'s stream (:func:`~dapple.runtime.data.check_data_resume`). No checkpoint: a run
    from step 0, nothing to check.

    Raises:
        CheckpointError: any of these differs, or no manifest reads.
    """
    if not config.resume or config.checkpoint_dir is None:
        return
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

"""Long runs: periodic checkpoints, resume under any plan, and the non-finite guard's home.

:class:`LongRun` is what :func:`dapple.runtime.run_plan` and its program interpreter
(:mod:`dapple.runtime.interpreter`) consult around every step:

- :meth:`LongRun.resume` (before the first step) loads the newest intact checkpoint of
  ``TrainConfig.checkpoint_dir`` (rank 0 verifies every file and names the step to all ranks,
  passing over damaged newer ones, :func:`dapple.runtime.checkpoint.find_resume_checkpoint`)
  *by layer* into this rank's stage - so a run saved under one plan continues under another -
  and returns the index of the next step (the data position:
  step ``t`` trains on ``make_batch(G, seed + t)``, or on a dataset's batch ``t`` of
  :mod:`dapple.runtime.data`, whose record the checkpoint must match);
- :attr:`LongRun.guard` (:mod:`dapple.runtime.guard`) stops or skips a step with a non-finite
  loss or gradient before the optimizer touches the weights; the steps it skipped are saved
  in the checkpoints;
- :meth:`LongRun.after_step` saves every ``save_every`` steps and at the run's last step
  (replica 0 of each stage writes its layers - under ZeRO with the optimizer shards of the
  other replicas gathered to it, :mod:`dapple.runtime.parallel.zero`; a stage cut over a tensor group
  or sharded by ZeRO-3 gathers its layers whole to its first device,
  :mod:`dapple.runtime.parallel.sharded_state` - every rank its RNG state, rank 0 the manifest after a
  barrier, with the fp16 loss scale in its ``extra``).
  Before writing, every rank checks its stage's weights and buffers are finite and all ranks
  agree in one all_gather: non-finite weights (a step the guard let through, e.g. an infinite
  learning rate) are never saved - the run stops naming the last good checkpoint.

A run that does not resume refuses a ``checkpoint_dir`` holding checkpoints (its saves would
overwrite or prune them), unless ``overwrite_checkpoints``: then rank 0 deletes them at the
run's first save, so a run that fails before saving leaves them whole.

Cost: per save, one pass over the stage's weights and one small all_gather (the guard's:
one small all_gather per step, which also carries the step's metrics).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dapple.core.plan import Plan
from dapple.models.workload import Workload
from dapple.runtime import comm
from dapple.runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    CheckpointMeta,
    check_compatible,
    check_writable,
    delete_checkpoints,
    find_resume_checkpoint,
    load_rng_state,
    read_checkpoint,
    refuse_foreign,
    refuse_occupied,
    restore_rng_state,
    restore_stage,
    save_checkpoint,
    stage_layer_states,
    step_dir,
)
from dapple.runtime.data import check_data_resume
from dapple.runtime.guard import NonFiniteGuard
from dapple.runtime.metrics import announce
from dapple.runtime.optim import config_lr, lr_at
from dapple.runtime.parallel.sharded_state import CutStage
from dapple.runtime.parallel.zero import FlatShards
from dapple.runtime.precision import Precision
from dapple.runtime.train_config import TrainConfig

__all__ = [
    "OPTIMIZER_CLASSES",
    "SCHEDULE_KEYS",
    "LongRun",
    "data_position",
    "elastic_store",
    "first_attempt",
    "lr_rederived",
]

logger = logging.getLogger(__name__)

OPTIMIZER_CLASSES = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
"""``TrainConfig.optimizer`` -> the torch class name a checkpoint records."""
SCHEDULE_KEYS = ("steps", "lr", "lr_schedule", "warmup_steps", "min_lr")
"""The :class:`TrainConfig` fields the learning rate of a step depends on
(:func:`dapple.runtime.optim.lr_at`): a checkpoint records them in its ``extra``, so a resume
says how its schedule differs (:func:`lr_rederived`)."""


def first_attempt() -> bool:
    """False in a worker that ``torchrun`` restarted (test hooks fire only in the first one)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def elastic_store(timeout: timedelta) -> dict[str, Any]:
    """``init_process_group`` arguments that keep a ``torchrun`` restart off stale store keys.

    torchrun's agent hosts one TCPStore for all attempts of a job, so a restarted gloo worker
    may read a peer address that a worker of the failed attempt published and time out
    connecting to it. A restarted worker therefore joins through a prefix private to its
    attempt. Empty (the default ``env://`` behaviour) outside a restart.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timeout=timeout
    )
    prefixed = dist.PrefixStore(f"dapple/attempt-{attempt}/", store)  # type: ignore[attr-defined]
    return {"store": prefixed, "rank": rank, "world_size": world}


def _local(g: torch.Tensor) -> torch.Tensor:
    """A tensor as this rank holds it (a ZeRO-3 DTensor: its shard)."""
    return g.to_local() if isinstance(g, DTensor) else g


class LongRun:
    """Checkpointing and the non-finite guard of one rank (see the module docstring).

    Every rank creates one, ranks beyond the plan included (with ``stage=None``): they take
    part in :meth:`agree_finite` and the checkpoint barriers.
    """

    def __init__(
        self,
        plan: Plan,
        workload: Workload,
        config: TrainConfig,
        *,
        rank: int,
        world: int,
        stage: int | None,
        replica: int | None,
        module: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        precision: Precision | None = None,
        shards: FlatShards | None = None,
        cut: CutStage | None = None,
    ) -> None:
        self.plan, self.workload, self.config = plan, workload, config
        self.cut = cut
        """A stage cut over a tensor group or sharded by ZeRO-3: saves gather its layers whole
        to its first device, resumes load this rank's parts
        (:mod:`dapple.runtime.parallel.sharded_state`)."""
        self.shards = shards
        """ZeRO: this replica's optimizer holds its shard only; a save gathers the stage's
        whole optimizer state to replica 0 (:meth:`FlatShards.layer_states`)."""
        self.precision = precision or Precision("fp32", device)
        """fp16: a non-finite gradient (no non-finite loss) skips the step and lowers the loss
        scale on every rank; the scale is saved in and restored from checkpoints."""
        self.rank, self.world, self.stage, self.replica = rank, world, stage, replica
        self.module, self.optimizer, self.device = module, optimizer, device
        self.layer_ids = plan.layers_of_device(rank) if stage is not None else ()
        """The chain index of each of ``module``'s children (several chunks: not contiguous)."""
        self.saved: list[int] = []
        """Steps (completed-step counts) this run saved a checkpoint at."""
        self.last_good: int | None = None
        """The step of the newest checkpoint known whole and finite: the last save, or the
        checkpoint this run resumed from."""
        self.guard = NonFiniteGuard(
            plan, config, rank=rank, world=world, stage=stage, module=module, device=device,
            precision=self.precision, shards=shards, last_good=lambda: self.last_good,
        )  # fmt: skip
        """The non-finite guard (:mod:`dapple.runtime.guard`); its skipped steps are saved."""
        self.data_state: dict[str, Any] | None = None
        """The training data's record (:func:`dapple.runtime.data.data_state`; None: synthetic):
        checkpoints save it, and resume requires the same."""
        if config.checkpoint_dir is not None:
            if not (config.resume or config.overwrite_checkpoints):
                refuse_occupied(
                    config.checkpoint_dir,
                    "resume=True continues them, overwrite_checkpoints=True deletes them at the "
                    "first save; or use another directory",
                )
            elif config.overwrite_checkpoints:
                refuse_foreign(config.checkpoint_dir, "move them away or use another directory")
            check_writable(config.checkpoint_dir)
        self._overwrite = config.overwrite_checkpoints
        """The old checkpoints are still to delete (at the first save)."""

    # -- resume ------------------------------------------------------------------------------
    def resume(self) -> int:
        """Load the newest intact checkpoint (when ``config.resume``); the next step index.

        A collective (every rank calls it): rank 0 picks the checkpoint and broadcasts its step.

        Raises:
            CheckpointError: no intact checkpoint, another model, or another optimizer.
        """
        cfg = self.config
        if not cfg.resume or cfg.checkpoint_dir is None:
            return 0
        ck = self._agree_resume_point(cfg.checkpoint_dir)
        if ck is None:
            logger.info("no checkpoint in %s: starting at step 0", cfg.checkpoint_dir)
            return 0
        check_compatible(
            ck,
            model_name=self.workload.name,
            num_layers=self.workload.num_layers,
            plan_num_layers=self.plan.num_layers,
        )
        check_data_resume(ck.meta.extra.get("data"), self.data_state, ck.path)
        if self.cut is not None:
            self.cut.restore(ck, self.optimizer)
        elif self.module is not None:
            views = self.shards.views() if self.shards is not None else None
            restore_stage(ck, self.module, self.layer_ids, self.optimizer, views)
        same_run = ck.meta.plan == self.plan.to_dict() and ck.meta.world_size == self.world
        rng = load_rng_state(ck, self.rank) if same_run else None
        if rng is not None:
            restore_rng_state(rng)
        else:  # another plan: the saved per-rank streams do not map onto these ranks
            torch.manual_seed(cfg.seed * 7919 + self.rank + 1_000_003 * ck.step)
        self.guard.skipped = [int(x) for x in ck.meta.extra.get("skipped_steps", [])]
        self.last_good = ck.step
        self.precision.load_state_dict(ck.meta.extra)
        if self.rank == 0:
            how = "same plan" if same_run else f"plan {self.plan.replication}, saved under another"
            announce(
                f"resumed: step {ck.step} from {ck.path} ({how}); data position: "
                f"{data_position(ck.meta.extra.get('data'), ck.step, cfg.seed)}",
                cfg.echo,
            )
            line = lr_rederived(ck.meta.extra, cfg, ck.step)
            if line is not None:
                announce(line, cfg.echo)
        return ck.step

    def _agree_resume_point(self, root: str) -> Checkpoint | None:
        """Rank 0's choice (:func:`find_resume_checkpoint`, every file verified once), broadcast
        as a step (or an error line) so every rank loads the same checkpoint."""
        picked: list[int | str | None] = [None]
        if self.rank == 0:
            try:
                point = find_resume_checkpoint(root)
            except CheckpointError as e:
                picked = [str(e)]
            else:
                for line in point.skipped:  # the launcher has warned; a note for the log
                    logger.info("passing over a damaged checkpoint: %s", line)
                picked = [None if point.checkpoint is None else point.checkpoint.step]
        if self.world > 1:
            dist.broadcast_object_list(picked, src=0, device=self.device)
        if isinstance(picked[0], str):
            raise CheckpointError(picked[0])
        return None if picked[0] is None else read_checkpoint(step_dir(root, picked[0]))

    # -- save ----------------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        """Save when ``step + 1`` completed steps is a multiple of ``save_every`` or the run's
        last step (``config.steps``), so the steps after the last multiple are kept too (a
        collective; ``save_every`` 0 never saves)."""
        cfg = self.config
        done = step + 1
        if cfg.checkpoint_dir is None or cfg.save_every <= 0:
            return
        if done % cfg.save_every and done != cfg.steps:
            return
        self._refuse_nonfinite_weights(step)
        if self._overwrite:  # the old run's checkpoints go now, before this run's first files
            if self.rank == 0:
                gone = delete_checkpoints(cfg.checkpoint_dir)
                announce(
                    f"checkpoints deleted: the {len(gone)} of an earlier run in "
                    f"{cfg.checkpoint_dir} (overwrite_checkpoints)",
                    cfg.echo,
                )
            if self.world > 1:
                dist.barrier()
            self._overwrite = False
        states = {}
        if self.cut is not None:  # a collective over the stage's tensor and replica groups
            states = self.cut.layer_states(self.optimizer)
        elif self.shards is not None:  # a collective over the stage's replicas
            states = self.shards.layer_states(self.layer_ids, self.optimizer)
        elif self.module is not None and self.replica == 0:
            states = stage_layer_states(self.module, self.layer_ids, self.optimizer)
        meta = CheckpointMeta(
            model_name=self.workload.name,
            num_layers=self.workload.num_layers,
            step=done,
            samples_consumed=done * self.plan.global_batch_size,
            plan=self.plan.to_dict(),
            optimizer_type=OPTIMIZER_CLASSES[cfg.optimizer],
            world_size=self.world,
            extra={
                "seed": cfg.seed,
                **{k: getattr(cfg, k) for k in SCHEDULE_KEYS},  # the lr schedule
                "skipped_steps": list(self.guard.skipped),
                **self.precision.state_dict(),  # fp16: the loss scale
            }
            | ({"data": self.data_state} if self.data_state is not None else {}),
        )
        path = save_checkpoint(
            cfg.checkpoint_dir,
            meta,
            states,
            rank=self.rank,
            write_manifest=self.rank == 0,
            barrier=dist.barrier if self.world > 1 else None,
            keep=cfg.keep,
        )
        self.saved.append(done)
        self.last_good = done
        if self.rank == 0:
            announce(f"checkpoint saved: step {done} (steps 0-{step} done) in {path}", cfg.echo)

    def _refuse_nonfinite_weights(self, step: int) -> None:
        """Before a save: every rank checks its stage's floating weights and buffers, one
        all_gather shares the verdicts, and every rank raises the same line when any is
        non-finite.

        Raises:
            CheckpointError: a stage holds a non-finite weight (the first such stage and rank
                named, with the last good checkpoint); nothing is written.
        """
        bad = False
        if self.module is not None:
            if self.shards is not None:
                self.shards.wait_gathers()  # the updated shards are back in the stage's weights
            ts = [_local(t) for t in self.module.state_dict().values() if t.is_floating_point()]
            bad = bool(ts) and not bool(torch.stack([t.isfinite().all() for t in ts]).all())
        s = -1 if self.stage is None else self.stage
        mine = torch.tensor([float(bad), s, self.rank], dtype=torch.float64, device=self.device)
        rows: list[list[float]] = [mine.tolist()]
        if self.world > 1:
            gathered = [torch.empty_like(mine) for _ in range(self.world)]
            comm.all_gather(gathered, mine)
            rows = torch.stack(gathered).tolist()
        found = [(int(r[1]), int(r[2])) for r in rows if r[0]]
        if not found:
            return
        (st, rk), *more = sorted(found)
        also = sorted({s for s, _ in more} - {st})
        what = f"stage {st} (rank {rk})" + (
            f"; also at stage {', '.join(map(str, also))}" if also else ""
        )
        last = self.last_good
        where = f"step {last} in {self.config.checkpoint_dir}" if last is not None else "none yet"
        raise CheckpointError(
            f"step {step}: non-finite weights after the optimizer step at {what}; checkpoint of "
            f"step {step + 1} not saved; last good checkpoint: {where}"
        )


def data_position(saved: dict[str, Any] | None, step: int, seed: int) -> str:
    """Where the data stream of a run resumed at ``step`` stands, in words: a dataset's epoch,
    batch within it and next sample of the epoch's shuffled order
    (:class:`~dapple.datasets.EpochSampler`, from the checkpoint's record ``saved``), or the
    seed of the next synthetic batch (``saved`` None: ``make_batch(G, seed + step)``)."""
    if saved is None:
        return f"synthetic batches, next make_batch seed {seed + step}"
    G, items = int(saved["global_batch_size"]), int(saved["items"])
    per_epoch = max(1, items // G)  # E = N // G steps per epoch
    epoch, k = divmod(step, per_epoch)
    return (
        f"epoch {epoch}, batch {k} of {per_epoch}, next sample {k * G} of the epoch's order of "
        f"{items} ({step * G} samples consumed)"
    )


def lr_rederived(saved: dict[str, Any], config: TrainConfig, step: int) -> str | None:
    """One line when this run's learning-rate schedule differs from the one the checkpoint
    was saved under (``--steps`` changed, say): the fields that changed and the lr of the
    resume step under each; None when they agree or the checkpoint does not record them."""
    if any(k not in saved for k in SCHEDULE_KEYS):
        return None
    old = {k: saved[k] for k in SCHEDULE_KEYS}
    changed = [k for k in SCHEDULE_KEYS if old[k] != getattr(config, k)]
    if not changed:
        return None
    names = {"steps": "total steps", "lr": "peak lr", "lr_schedule": "schedule",
             "warmup_steps": "warm-up steps", "min_lr": "min lr"}  # fmt: skip
    what = ", ".join(f"{names[k]} {old[k]} -> {getattr(config, k)}" for k in changed)
    before = lr_at(step, lr=old["lr"], steps=old["steps"], schedule=old["lr_schedule"],
                   warmup_steps=old["warmup_steps"], min_lr=old["min_lr"])  # fmt: skip
    after = config_lr(config, step)
    return (
        f"lr schedule re-derived: {what}; lr at step {step} {before:.3g} -> {after:.3g} "
        f"(now {config.lr_schedule} over {config.steps} steps)"
    )

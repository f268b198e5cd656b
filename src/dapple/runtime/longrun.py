"""Long runs: periodic checkpoints, resume under any plan, and the non-finite guard.

:class:`LongRun` is what :func:`dapple.runtime.run_plan` and its program interpreter
(:mod:`dapple.runtime.interpreter`) consult around every step:

- :meth:`LongRun.resume` (before the first step) loads the newest intact checkpoint of
  ``TrainConfig.checkpoint_dir`` (rank 0 verifies every file and names the step to all ranks,
  passing over damaged newer ones, :func:`dapple.runtime.checkpoint.find_resume_checkpoint`)
  *by layer* into this rank's stage - so a run saved under one plan continues under another -
  and returns the index of the next step (the data position:
  step ``t`` trains on ``make_batch(G, seed + t)``, or on a dataset's batch ``t`` of
  :mod:`dapple.runtime.data`, whose record the checkpoint must match);
- :meth:`LongRun.watch` (after every F action) keeps, on the device, the step's loss so far
  (last stage, per micro-batch);
- :meth:`LongRun.agree_finite` (at the step point, after the gradient reductions and before
  the optimizer step) finds the first non-finite loss on the device, else reads the gradients'
  verdict off this rank's part of the squared gradient norm (which the step computes for
  clipping and its metrics anyway: non-finite when a gradient is), and gathers every rank's
  verdict over all ranks (ranks beyond the plan send none) with the step's ONE host read, so
  all ranks take the same decision *before the optimizer touches the weights*: stop with one
  line naming step, stage, micro-batch and rank (default), or skip the step and count it
  (``on_nonfinite="skip"``). The norm does not say which micro-batch made a gradient
  non-finite: to name it, every rank replays the step's compute from the same batch and random
  state with a check after each backward (one fused pass over the gradients), and the ranks
  gather again. A good step pays nothing for the naming; a step that stops or is skipped runs
  twice. Under fp16 loss scaling a non-finite gradient without a
  non-finite loss is an overflow: every rank skips the step and halves the loss scale, and the
  run goes on (:mod:`dapple.runtime.precision`). The same gather carries the caller's per-rank
  values (the step's metrics);
- :meth:`LongRun.after_step` saves every ``save_every`` steps and at the run's last step
  (replica 0 of each stage writes its layers - under ZeRO with the optimizer shards of the
  other replicas gathered to it, :mod:`dapple.runtime.zero`; a stage cut over a tensor group
  or sharded by ZeRO-3 gathers its layers whole to its first device,
  :mod:`dapple.runtime.sharded_state` - every rank its RNG state, rank 0 the manifest after a
  barrier, with the fp16 loss scale in its ``extra``).
  Before writing, every rank checks its stage's weights and buffers are finite and all ranks
  agree in one all_gather: non-finite weights (a step the guard let through, e.g. an infinite
  learning rate) are never saved - the run stops naming the last good checkpoint.

A run that does not resume refuses a ``checkpoint_dir`` holding checkpoints (its saves would
overwrite or prune them), unless ``overwrite_checkpoints``: then rank 0 deletes them at the
run's first save, so a run that fails before saving leaves them whole.

Cost: one small all_gather per step and one host read of it - it also carries the step's
metrics (see :mod:`dapple.runtime.metrics`) and each rank's part of the global gradient norm
(:mod:`dapple.runtime.optim`, whose norm is the gradients' check); besides it the runtime's
per-step collectives are the gradient AllReduce; per save, one pass over the stage's weights
and one small all_gather.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Sequence
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
    refuse_occupied,
    restore_rng_state,
    restore_stage,
    save_checkpoint,
    stage_layer_states,
    step_dir,
)
from dapple.runtime.checkpoint_files import refuse_foreign
from dapple.runtime.config import TrainConfig
from dapple.runtime.data import check_data_resume
from dapple.runtime.metrics import announce, device_row
from dapple.runtime.optim import GradGroups, config_lr, lr_at
from dapple.runtime.precision import Precision
from dapple.runtime.sharded_state import CutStage
from dapple.runtime.zero import FlatShards
from dapple.schedule.ir import Action, ActionKind

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
_KINDS = ("loss", "gradient")
_HALF = (torch.float16, torch.bfloat16)
_GRAD_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)
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


def _bad_ranks(rows: list[list[float]]) -> list[tuple[int, int, int]]:
    """The sorted ``(kind, stage, rank)`` of the rows (:meth:`LongRun.agree_finite`'s) whose
    loss (kind 0) or, with a finite loss, squared gradient norm part (kind 1) is non-finite."""
    bad = [(0 if not math.isfinite(r[0]) else 1, int(r[1]), int(r[3])) for r in rows
           if not (math.isfinite(r[0]) and math.isfinite(r[2]))]  # fmt: skip
    return sorted(bad)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU random state and, on CUDA, the device's (copies; no device synchronisation)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


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
        (:mod:`dapple.runtime.sharded_state`)."""
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
        self.params = list(module.parameters()) if module is not None else []
        sharded = {id(p) for p in shards.params} if shards is not None else set()
        self._groups = GradGroups(p for p in self.params if id(p) not in sharded)
        """The parameters whose ``p.grad`` the guard checks (the sharded ones: by the shards)."""
        self.last_stage = stage is not None and plan.num_stages - 1 in plan.stages_of_device(rank)
        self.skipped: list[int] = []
        """Steps skipped for a non-finite loss or gradient (``on_nonfinite="skip"``)."""
        self.saved: list[int] = []
        """Steps (completed-step counts) this run saved a checkpoint at."""
        self.last_good: int | None = None
        """The step of the newest checkpoint known whole and finite: the last save, or the
        checkpoint this run resumed from."""
        self._loss_sums: list[tuple[int, torch.Tensor]] = []  # (micro-batch, loss so far)
        self._grad_mbs: list[int] = []
        """The micro-batch of each backward the guard checked this step (its flag's slot)."""
        self._flags = torch.zeros(0, dtype=torch.float32, device=device)
        """Per checked backward: 1 when it left a non-finite gradient (on the device)."""
        self._naming = False
        """The step is being replayed to name its micro-batch: :meth:`watch` checks every
        backward."""
        self._rng = _rng_state(device)
        """The random state the step's compute started from (CPU, and the device's)."""
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        """The check's "inverse scale": 1, so the norms it runs over keep their values."""
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
        self.skipped = [int(x) for x in ck.meta.extra.get("skipped_steps", [])]
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

    # -- non-finite guard -----------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before the step's compute: forget the last step's losses and flags, and keep the
        random state the compute starts from (a replay of the step starts from it again)."""
        if self._grad_mbs:  # last step's flags back to 0 (only those it used were written)
            self._flags.zero_()
        self._loss_sums = []
        self._grad_mbs = []
        if not self._naming:
            self._rng = _rng_state(self.device)

    def watch(self, action: Action, loss_sum: torch.Tensor | float) -> None:
        """After a compute action: keep the step's loss so far (last stage, after an F), on
        the device (no host read). While a step is replayed to name its micro-batch
        (:meth:`agree_finite`), also flag after each backward whether the gradients are
        non-finite.

        A backward's check is one fused pass over the stage's gradients: per (device, dtype)
        group one ``torch._foreach_norm`` (L1: a NaN or an infinity makes it non-finite, as a
        sum whose float32 range overflows does; on the CPU, where it has no fused kernel and an
        L1 norm reads about 4x slower than a sum, each gradient's sum, which a NaN or an
        infinity makes non-finite as well: ``inf + -inf`` is NaN), then one
        ``torch._amp_foreach_non_finite_check_and_unscale_`` over those norms into this
        backward's slot of a flag vector (it writes only the norms, by 1: the gradients are
        only read). fp16 and bf16 gradients are summed in float32 instead (their L1 norm would
        overflow fp16's range).
        """
        if action.kind is ActionKind.FORWARD:
            if self.last_stage:
                loss = (
                    loss_sum
                    if isinstance(loss_sum, torch.Tensor)
                    else torch.as_tensor(loss_sum, dtype=torch.float64, device=self.device)
                )
                self._loss_sums.append((int(action.micro_batch or 0), loss))
        elif self._naming and action.kind in _GRAD_KINDS and self.params:
            self._check_backward(int(action.micro_batch or 0))

    def _check_backward(self, micro_batch: int) -> None:
        """Flag whether the gradients are non-finite after this backward (see :meth:`watch`)."""
        checks: list[torch.Tensor] = []
        for dtype, grads in self._groups.grads():
            if dtype in _HALF:
                checks += [g.sum(dtype=torch.float32) for g in grads]
            elif grads[0].device.type == "cpu":  # no fused CPU kernel: a sum is cheapest
                checks += [g.sum() for g in grads]
            else:
                checks += torch._foreach_norm(grads, 1.0)
        if self.shards is not None:  # the sharded parameters' local gradients' sums
            sums = self.shards.grad_sums()
            if sums:
                checks.append(torch.stack(sums).sum(dtype=torch.float64))
        if checks:
            flag = self._flag(len(self._grad_mbs))
            torch._amp_foreach_non_finite_check_and_unscale_(checks, flag, self._one)
            self._grad_mbs.append(micro_batch)

    def _flag(self, k: int) -> torch.Tensor:
        """The step's ``k``-th backward's slot of the flag vector (grown when the program has
        more backwards than it holds)."""
        n = self._flags.numel()
        if k >= n:
            grown = torch.zeros(max(8, 2 * n), dtype=torch.float32, device=self.device)
            grown[:n] = self._flags
            self._flags = grown
        return self._flags[k : k + 1]

    def _first_bad(self) -> torch.Tensor:
        """``[kind, micro-batch]`` of the step's first non-finite loss, else of its first
        backward whose check flagged its gradients (checked only while the step is replayed;
        gradients accumulate: the first such backward names the micro-batch), else
        ``[-1, -1]``: float64 on the device."""
        parts: list[torch.Tensor] = []
        meta = [[0.0, m] for m, _ in self._loss_sums] + [[1.0, m] for m in self._grad_mbs]
        if self._loss_sums:
            parts.append(torch.stack([t for _, t in self._loss_sums]).isfinite().logical_not())
        if self._grad_mbs:
            parts.append(self._flags[: len(self._grad_mbs)] != 0)
        if not parts:
            return torch.full((2,), -1.0, dtype=torch.float64, device=self.device)
        bad = torch.cat(parts) if len(parts) > 1 else parts[0]
        which = torch.tensor(meta, dtype=torch.float64, device=self.device)
        # the losses come first, and argmax gives the first of the maxima
        return torch.where(bad.any(), which[bad.to(torch.uint8).argmax()], -1.0)

    def agree_finite(
        self,
        step: int,
        extra: Sequence[float | torch.Tensor] = (),
        grad_sq_norm: torch.Tensor | float = 0.0,
        replay: Callable[[], None] | None = None,
    ) -> tuple[str | None, list[list[float]], torch.Tensor]:
        """Every rank's verdict on the step (a world all_gather, none in a world of one; every
        rank calls it once per step, ranks beyond the plan included), read on the host once.

        Each rank sends its step's loss (the last stage's sum over the micro-batches so far:
        non-finite from the first non-finite one on) and its part of the squared gradient norm
        (which the step computes anyway: non-finite when a gradient is); the verdict is read off
        them on the host, so a good step adds no work on the device. Neither says which
        micro-batch was first: a step that stops or is skipped is named in a second gather of
        every rank's first bad micro-batch - its losses' as kept, its gradients' by ``replay``
        (the step's compute part again, on the same batch and random state, with a check after
        each backward). An fp16 overflow only lowers the loss scale and is not named.

        Args:
            step: the step index (for the messages and the skipped-step list).
            extra: this rank's values to gather along (the same length on every rank; numbers
                or 0-d tensors on the device, read with the rest).
            grad_sq_norm: this rank's part of the squared gradient norm (0: it holds none).
            replay: runs this rank's compute part of the step again (None: no replay; the
                message then names no micro-batch for a gradient).

        Returns:
            The verdict - None to go on; ``""`` when the step must be skipped (its gradients are
            dropped); otherwise the one-line message the caller raises to stop the run - the
            gathered rows by rank: ``[loss, stage, squared gradient norm part, rank, *extra]``,
            and the same rows as a float64 tensor on the device.
        """
        s = -1 if self.stage is None else self.stage
        loss = self._loss_sums[-1][1] if self._loss_sums else 0.0
        mine = device_row([loss, s, grad_sq_norm, self.rank, *extra], self.device)
        rows, table = self._gather(mine)  # the step's one host read
        return self._verdict(step, _bad_ranks(rows), replay), rows, table

    def _gather(self, mine: torch.Tensor) -> tuple[list[list[float]], torch.Tensor]:
        """Every rank's row (as lists on the host, and stacked on the device)."""
        if self.world == 1:  # one process: nothing to agree on
            table = mine.unsqueeze(0)
        else:
            gathered = [torch.empty_like(mine) for _ in range(self.world)]
            comm.all_gather(gathered, mine)
            table = torch.stack(gathered)
        return table.tolist(), table

    def _name_micro_batch(
        self, replay: Callable[[], None] | None
    ) -> list[tuple[int, int, int, int]]:
        """Every rank's first non-finite loss, else (after ``replay``, run with a check after
        each backward) its first backward that left non-finite gradients, gathered: the sorted
        ``(kind, micro-batch, stage, rank)`` found (empty when there was none)."""
        if replay is not None:
            self._replay(replay)
        s = -1 if self.stage is None else self.stage
        mine = device_row([-1, s, -1, self.rank], self.device)
        mine[0:3:2] = self._first_bad()
        rows, _ = self._gather(mine)
        return sorted((int(r[0]), int(r[2]), int(r[1]), int(r[3])) for r in rows if r[0] >= 0)

    def _replay(self, replay: Callable[[], None]) -> None:
        """Run ``replay`` with a check after each backward, from the random state the step
        started from; afterwards the random state and the module's buffers are as the step
        left them."""
        buffers = list(self.module.buffers()) if self.module is not None else []
        kept = [b.detach().clone() for b in buffers]  # e.g. running statistics
        cuda = [self.device] if self.device.type == "cuda" else []
        self._naming = True
        if self.shards is not None:
            self.shards.checked = True
        try:
            with torch.random.fork_rng(devices=cuda):
                cpu_state, device_state = self._rng
                torch.set_rng_state(cpu_state)
                if device_state is not None:
                    torch.cuda.set_rng_state(device_state, self.device)
                replay()
        finally:
            self._naming = False
            if self.shards is not None:
                self.shards.checked = False
            with torch.no_grad():
                for b, k in zip(buffers, kept, strict=True):
                    b.copy_(k)

    def _verdict(
        self,
        step: int,
        bad: list[tuple[int, int, int]],
        replay: Callable[[], None] | None = None,
    ) -> str | None:
        """The decision on the sorted ``(kind, stage, rank)`` of the ranks whose loss (kind 0)
        or gradients (kind 1) are non-finite."""
        if not bad:
            return None
        k, st, rk = bad[0]
        if k == 1 and self.precision.overflow(step):  # fp16 overflow: skip, scale / 2, go on
            for p in self.params:
                p.grad = None
            return ""
        named = self._name_micro_batch(replay if k == 1 else None)
        m, note = -1, ""
        if named:
            k, m, st, rk = named[0]
        elif k == 1 and replay is not None:
            note = (
                " (a replay of the step left every micro-batch's gradients finite: their norm "
                "exceeded float32's range, or the step does not repeat exactly)"
            )
        where = f"in micro-batch {m} " if m >= 0 else ""
        what = f"non-finite {_KINDS[k]} {where}at stage {st} (rank {rk}){note}"
        others = sorted({b[1] for b in bad} - {st})
        if others:
            what += f"; also non-finite at {', '.join(f'stage {o}' for o in others)}"
        if self.config.on_nonfinite == "skip":
            for p in self.params:
                p.grad = None
            self.skipped.append(step)
            if self.rank == 0:
                logger.warning("step %d skipped: %s", step, what)
                if self.config.echo:
                    print(f"step {step} skipped: {what}", flush=True)
            return ""
        last = self.last_good
        ck = (
            f"; last good checkpoint: step {last} in {self.config.checkpoint_dir}"
            if last is not None
            else ""
        )
        return (
            f"step {step}: {what}; stopped before the optimizer step{ck} "
            "(--on-nonfinite skip skips such steps)"
        )

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
                "skipped_steps": list(self.skipped),
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

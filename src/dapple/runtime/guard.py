"""The non-finite guard: no optimizer step after a non-finite loss or gradient, on any rank,
and a message naming the step, stage, micro-batch and rank that made it.

The program interpreter (:mod:`dapple.runtime.interpreter`) consults it around every step:

- :meth:`NonFiniteGuard.begin_step` (before the step's compute) keeps the random state the
  compute starts from;
- :meth:`NonFiniteGuard.watch` (after every F on the last stage's rank; while a step is
  replayed, after every backward too) keeps, on the device, the step's loss so far (per
  micro-batch);
- :meth:`NonFiniteGuard.agree_finite` (at the step point, after the gradient reductions and
  before the optimizer step) gathers every rank's loss and part of the squared gradient norm
  (which the step computes anyway for clipping and its metrics: non-finite when a gradient is)
  over all ranks (ranks beyond the plan send zeros) with the step's ONE host read, so all ranks
  take the same decision *before the optimizer touches the weights*: stop with one line naming
  step, stage, micro-batch and rank (default), or skip the step and count it
  (``on_nonfinite="skip"``). Under fp16 loss scaling a non-finite gradient without a
  non-finite loss is an overflow: every rank skips the step and halves the loss scale, and the
  run goes on (:mod:`dapple.runtime.precision`). The same gather carries the caller's per-rank
  values (the step's metrics).

Neither the loss sum nor the norm says which micro-batch was first. A step that stops or is
skipped is named in a second gather: its losses' first non-finite micro-batch as kept, and its
gradients' by a replay of the step's compute from the same batch and random state with a check
after each backward (one fused pass over the gradients). A good step pays nothing for the
naming; a bad one runs twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dapple.core.plan import Plan
from dapple.runtime import comm
from dapple.runtime.metrics import device_row, host_row, read_rows
from dapple.runtime.optim import GradGroups
from dapple.runtime.parallel.zero import FlatShards
from dapple.runtime.precision import Precision
from dapple.runtime.train_config import TrainConfig
from dapple.schedule.ir import Action, ActionKind

__all__ = ["NonFiniteGuard"]

logger = logging.getLogger(__name__)

_KINDS = ("loss", "gradient")
_HALF = (torch.float16, torch.bfloat16)
_GRAD_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)


def _bad_ranks(rows: list[list[float]]) -> list[tuple[int, int, int]]:
    """The sorted ``(kind, stage, rank)`` of the rows (:meth:`NonFiniteGuard.agree_finite`'s) whose
    loss (kind 0) or, with a finite loss, squared gradient norm part (kind 1) is non-finite."""
    bad = [(0 if not math.isfinite(r[0]) else 1, int(r[1]), int(r[3])) for r in rows
           if not (math.isfinite(r[0]) and math.isfinite(r[2]))]  # fmt: skip
    return sorted(bad)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU random state and, on CUDA, the device's (copies; no device synchronisation)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.default_generator.get_state(), cuda


class NonFiniteGuard:
    """The non-finite guard of one rank (see the module docstring).

    Every rank creates one, ranks beyond the plan included (with ``stage=None``): they take
    part in :meth:`agree_finite`.
    """

    def __init__(
        self,
        plan: Plan,
        config: TrainConfig,
        *,
        rank: int,
        world: int,
        stage: int | None,
        module: nn.Module | None,
        device: torch.device,
        precision: Precision,
        shards: FlatShards | None,
        last_good: Callable[[], int | None],
    ) -> None:
        """Args:
        plan: the plan (which rank holds the last stage).
        config: ``on_nonfinite``, ``echo`` and ``checkpoint_dir`` (named in the message).
        rank, world, stage: this rank, the world size and its stage (None: beyond the plan).
        module: the rank's stage (its parameters' gradients, its buffers).
        device: the rank's device.
        precision: fp16: a non-finite gradient without a non-finite loss is an overflow.
        shards: ZeRO-1/2: the sharded parameters' gradients are checked by their buckets.
        last_good: the step of the newest checkpoint known whole and finite (for the message).
        """
        self.config, self.precision, self.shards = config, precision, shards
        self.rank, self.world, self.stage = rank, world, stage
        self.module, self.device = module, device
        self._last_good = last_good
        self.params = list(module.parameters()) if module is not None else []
        sharded = {id(p) for p in shards.params} if shards is not None else set()
        self._groups = GradGroups(p for p in self.params if id(p) not in sharded)
        """The parameters whose ``p.grad`` a replay checks (the sharded ones: by the shards)."""
        self.last_stage = stage is not None and plan.num_stages - 1 in plan.stages_of_device(rank)
        self.skipped: list[int] = []
        """Steps skipped for a non-finite loss or gradient (``on_nonfinite="skip"``)."""
        self.sums: list[float] = []
        """The last :meth:`agree_finite`'s ``summed`` vector summed over the ranks."""
        self._loss_sums: list[tuple[int, torch.Tensor]] = []  # (micro-batch, loss so far)
        self._grad_mbs: list[int] = []
        """The micro-batch of each backward the replay checked (its flag's slot)."""
        self._flags = torch.zeros(0, dtype=torch.float32, device=device)
        """Per checked backward: 1 when it left a non-finite gradient (on the device)."""
        self._naming = False
        """The step is being replayed to name its micro-batch: :meth:`watch` checks every
        backward."""
        self._rng = _rng_state(device)
        """The random state the step's compute started from (CPU, and the device's)."""
        self._one = torch.ones(1, dtype=torch.float32, device=device)
        """The check's "inverse scale": 1, so the norms it runs over keep their values."""

    @property
    def naming(self) -> bool:
        """A step is being replayed to name its micro-batch: :meth:`watch` wants every backward
        (otherwise only the last stage's forwards)."""
        return self._naming

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
        summed: torch.Tensor | None = None,
    ) -> tuple[str | None, list[list[float]], torch.Tensor | None]:
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
            summed: a float64 vector on the device (the same length on every rank) gathered
                along and summed over the ranks on the device before the one host read
                (the step's expert loads); the sums are left in :attr:`sums`.

        Returns:
            The verdict - None to go on; ``""`` when the step must be skipped (its gradients are
            dropped); otherwise the one-line message the caller raises to stop the run - the
            gathered rows by rank: ``[loss, stage, squared gradient norm part, rank, *extra]``,
            and the same rows as a float64 tensor on the device (None in a world of one without
            ``summed``: its one row is this rank's own values, read without a row on the
            device).
        """
        values = self.row(extra, grad_sq_norm)
        table: torch.Tensor | None = None
        if self.world == 1 and summed is None:  # the step's one host read: its tensors at once
            rows = [host_row(values)]
        else:  # the step's one host read
            rows, table = self._gather(device_row(values, self.device), summed)
        return self._verdict(step, _bad_ranks(rows), replay), rows, table

    def row(
        self, extra: Sequence[float | torch.Tensor] = (), grad_sq_norm: torch.Tensor | float = 0.0
    ) -> list[float | torch.Tensor]:
        """This rank's row of the step's collective: ``[loss, stage, squared gradient norm
        part, rank, *extra]`` (the loss: the last stage's sum so far, else 0; stage -1: beyond
        the plan), its tensors left on the device."""
        s = -1 if self.stage is None else self.stage
        loss = self._loss_sums[-1][1] if self._loss_sums else 0.0
        return [loss, s, grad_sq_norm, self.rank, *extra]

    def _gather(
        self, mine: torch.Tensor, summed: torch.Tensor | None = None
    ) -> tuple[list[list[float]], torch.Tensor]:
        """Every rank's row (as lists on the host, and stacked on the device); with
        ``summed``, its sum over the ranks read along into :attr:`sums`."""
        n = mine.numel()
        if summed is not None:
            mine = torch.cat([mine, summed.to(mine.device, torch.float64)])
        if self.world == 1:  # one process: nothing to agree on
            table = mine.unsqueeze(0)
        else:
            gathered = [torch.empty_like(mine) for _ in range(self.world)]
            comm.all_gather(gathered, mine)
            table = torch.stack(gathered)
        rows, head, sums = read_rows(table, n)
        if summed is not None:
            self.sums = sums
        return rows, head

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

    def _drop_grads(self) -> None:
        """A skipped step's gradients are dropped: the optimizer step does not run on them."""
        for p in self.params:
            p.grad = None

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
            self._drop_grads()
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
            self._drop_grads()
            self.skipped.append(step)
            if self.rank == 0:
                logger.warning("step %d skipped: %s", step, what)
                if self.config.echo:
                    print(f"step {step} skipped: {what}", flush=True)
            return ""
        last = self._last_good()
        ck = (
            f"; last good checkpoint: step {last} in {self.config.checkpoint_dir}"
            if last is not None
            else ""
        )
        return (
            f"step {step}: {what}; stopped before the optimizer step{ck} "
            "(--on-nonfinite skip skips such steps)"
        )

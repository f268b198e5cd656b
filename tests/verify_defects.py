"""Defects injected into ``dapple verify``'s workers (``DAPPLE_TEST_VERIFY_SETUP=
verify_defects:NAME``): each breaks one promise of the runtime on purpose, as a real bug
would, while every collective still matches (no hang). ``DEFECT_RANK`` names the rank."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from dapple.runtime.optim import ModelUpdate
from dapple.runtime.stage import StageExecutor
from dapple.runtime.stage_links import StageLinks
from dapple.runtime.sync import GradientSync

DEFECT_RANK_ENV = "DAPPLE_TEST_DEFECT_RANK"


def _mine(rank: int) -> bool:
    return rank == int(os.environ.get(DEFECT_RANK_ENV, "-1"))


def drop_microbatch(rank: int) -> None:
    """Micro-batch 0's contribution to this rank's parameter gradients is lost (its input
    gradients are still sent)."""
    if not _mine(rank):
        return
    original = StageExecutor._backward

    def backward(self: StageExecutor, m: int) -> None:
        params = [p for p in self.module.parameters()]
        before = [None if p.grad is None else p.grad.clone() for p in params]
        original(self, m)
        if m == 0:
            for p, g in zip(params, before, strict=True):
                p.grad = g

    StageExecutor._backward = backward  # type: ignore[method-assign]


def skip_allreduce(rank: int) -> None:
    """This replica takes part in its stage's AllReduce but keeps its local gradients."""
    if not _mine(rank):
        return

    def launch(self: GradientSync, bk: Any) -> None:
        for p, off in zip(bk.params, bk.offsets, strict=True):
            view = bk.flat[off : off + p.numel()]
            view.zero_() if p.grad is None else view.copy_(p.grad.reshape(-1))
        bk.work = dist.all_reduce(bk.flat.clone(), group=self.pg, async_op=True)
        bk.launched = True

    GradientSync._launch = launch  # type: ignore[method-assign]


def swap_rows(rank: int) -> None:
    """The split-concat on this rank puts the first and last rows of each activation it
    joins from its peers in each other's place."""
    if not _mine(rank):
        return
    original = StageLinks.wait_concat

    def wait_concat(
        self: StageLinks, m: int, backward: bool, outputs: Any = ()
    ) -> list[torch.Tensor]:
        out = original(self, m, backward, outputs)
        if backward:
            return out
        swapped = []
        for t in out:
            t = t.clone()
            t[[0, -1]] = t[[-1, 0]]
            swapped.append(t)
        return swapped

    StageLinks.wait_concat = wait_concat  # type: ignore[method-assign]


def tied_unsummed(rank: int) -> None:
    """Tied copies keep their own gradients (no sum within or across stages), every rank."""
    GradientSync.tied = lambda self: None  # type: ignore[method-assign]


def stale_shard(rank: int) -> None:
    """This replica skips its optimizer step: its ZeRO shard stays as it was, and the gather
    hands the stale shard to every replica."""
    if not _mine(rank):
        return
    original = ModelUpdate.step

    def step(self: ModelUpdate, step: int) -> None:
        opt, self.optimizer = self.optimizer, None
        try:
            original(self, step)
        finally:
            self.optimizer = opt

    ModelUpdate.step = step  # type: ignore[method-assign]

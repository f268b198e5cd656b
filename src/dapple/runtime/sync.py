"""Synchronous update (section 6.2): AR(P_s, g_s) overlapped with the last backward, then
tied-parameter sums across stages.

Order at the end of a step, on every rank:

(1) AR(P_s, g_s), overlapped: before a replicated stage's *last* backward of the step
    :meth:`GradientSync.arm` turns on per-parameter ``post_accumulate_grad`` hooks. As soon as
    every gradient of a bucket (parameters in reverse order, about :data:`BUCKET_BYTES` each)
    is final, the hook copies them into the bucket's flat buffer and starts an asynchronous
    SUM over the stage's replica group - while backward still computes the earlier layers.
    Buckets start strictly in bucket order on every replica (a bucket waits for all earlier
    ones), so the replicas' collectives always match, even when a parameter gets no gradient.
    ``p.grad`` stays the local gradient until :meth:`GradientSync.finish` (the schedule's
    ``AR`` action) waits for every bucket and makes each gradient a view of its reduced bucket
    - so the non-finite guard, which runs before ``finish``, still sees this rank's own
    gradients, and a NaN stops the step before the optimizer touches the weights.
(2) for each tied group of ``Workload.tied_parameters`` (groups of ``(layer, parameter name)``
    that are one parameter in the original model), every copy's gradient becomes the sum over
    all copies - copies in other stages are summed with one AllReduce over all ranks holding a
    copy, on the *partial* (not replica-reduced) gradients, which adds every replica's and
    every stage's share exactly once, so these copies are left out of (1); copies inside one
    stage are summed locally after (1) (both sums are linear, so the order does not matter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dapple.core.buckets import BUCKET_BYTES
from dapple.core.buckets import bucket_runs as core_bucket_runs
from dapple.core.parallelism import ONE_DEVICE
from dapple.core.plan import Plan
from dapple.models.tied import sync_tied_grads
from dapple.models.workload import Workload
from dapple.runtime import comm

__all__ = ["BUCKET_BYTES", "GradientSync", "bucket_runs", "tied_stages"]


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    ready: set[int] = field(default_factory=set)
    work: Any = None
    launched: bool = False


def bucket_runs(
    params: Sequence[nn.Parameter], cap_bytes: int, kind: Callable[[nn.Parameter], object]
) -> list[list[nn.Parameter]]:
    """Consecutive runs of ``params`` of one ``kind(p)``, each about ``cap_bytes`` (a run holds
    at least one parameter, so one larger than the cap is a run of its own):
    :func:`dapple.core.buckets.bucket_runs` over their bytes, as the memory model cuts layers."""
    sizes = [p.numel() * p.element_size() for p in params]
    runs = core_bucket_runs(sizes, cap_bytes, [kind(p) for p in params])
    return [[params[i] for i in run] for run in runs]


def _make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
    """Consecutive runs of ``params`` of one dtype and device, about ``cap_bytes`` each."""
    out = []
    for run in bucket_runs(params, cap_bytes, lambda p: (p.dtype, p.device)):
        offsets, n = [], 0
        for p in run:
            offsets.append(n)
            n += p.numel()
        flat = torch.zeros(n, dtype=run[0].dtype, device=run[0].device)
        out.append(_Bucket(run, offsets, flat))
    return out


def tied_stages(plan: Plan, group: Sequence[tuple[int, str]]) -> list[int]:
    """The stages holding a copy of a tied group's parameter (``(layer, name)`` copies), in
    order."""
    return sorted(
        {
            i
            for i, st in enumerate(plan.stages)
            for lay, _ in group
            if st.layers[0] <= lay < st.layers[1]
        }
    )


def _stage_groups(plan: Plan) -> dict[tuple[int, int], Any]:
    """A process group per replicated stage among the first ``num_groups`` stages and tensor
    index ``i`` (``devices[i::t_s]``; t_s = 1: the stage's devices), by ``(stage, i)``: one per
    device group (an interleaved plan's later chunks on it share it). Collective."""
    return {
        (s, i): dist.new_group(list(st.replica_group(i)))
        for s, st in enumerate(plan.stages[: plan.num_groups])
        if st.parallel.data_parallel
        for i in range(st.tensor_width)
    }


def _tied_groups(plan: Plan, groups: Sequence[Sequence[tuple[int, str]]]) -> dict[int, Any]:
    """A process group per tied group with copies in several stages (every device of those
    stages), by group index. Collective."""
    out: dict[int, Any] = {}
    for g, group in enumerate(groups):
        stages = tied_stages(plan, group)
        if len(stages) > 1:
            out[g] = dist.new_group(sorted({d for i in stages for d in plan.stages[i].devices}))
    return out


class GradientSync:
    """Process groups and the end-of-step gradient reductions of one rank.

    Creating it is a collective: every rank creates every group in the same order. Call
    :meth:`close` when the run ends (every rank, in the same order): it removes the hooks
    and destroys the groups, so repeated runs in one process group leave nothing behind.
    """

    def __init__(
        self,
        plan: Plan,
        workload: Workload,
        rank: int,
        module: nn.Module | None,
        stage: int | None,
        *,
        bucket_bytes: int | None = None,
        exclude: frozenset[int] = frozenset(),
        stage_pg: dict[tuple[int, int], Any] | None = None,
        tensor_index: int = 0,
        extra_pg: Sequence[Any] = (),
    ) -> None:
        self.groups = list(workload.tied_parameters)
        # the groups: stages first (or given: ``stage_pg``, ``extra_pg`` destroyed with them)
        self.stage_pg = _stage_groups(plan) if stage_pg is None else dict(stage_pg)
        self.extra_pg = list(extra_pg)
        self.tied_pg = _tied_groups(plan, self.groups)
        self.module, self.stage = module, stage
        self.parallel = plan.stages[stage].parallel if stage is not None else ONE_DEVICE
        """The stage's layout: a tied copy outside the TP cut is whole on each of its t_s tensor
        ranks, each with the same gradient (:meth:`tied` counts it once)."""
        self.by_layer: dict[int, nn.Module] = {}
        if module is not None and stage is not None:
            assert isinstance(module, nn.Sequential)
            self.by_layer = dict(zip(plan.layers_of_device(rank), module, strict=True))
        cross = self._cross_stage_copies()
        params = list(module.parameters()) if module is not None else []
        self.reduced = [
            p for p in params if id(p) not in cross and id(p) not in exclude and p.requires_grad
        ]
        """Parameters the stage AllReduce sums (cross-stage tied copies are already totals;
        frozen parameters have no gradient; ``exclude``: the ids of parameters a
        :class:`~dapple.runtime.parallel.zero.FlatShards` reduce-scatters instead)."""
        self.pg = self.stage_pg.get((stage, tensor_index)) if stage is not None else None
        """The stage AllReduce's group: the replicas of this rank's tensor index."""
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, index in bucket)
        self._hooks: list[Any] = []
        self._armed = False
        self._final: set[int] | None = None
        """Armed parameters (None: all): the ones whose gradients are final this step."""
        self._next = 0  # the next bucket to launch
        if self.pg is not None and self.reduced:
            self._hook_buckets(BUCKET_BYTES if bucket_bytes is None else bucket_bytes)

    def _cross_stage_copies(self) -> set[int]:
        """The ids of this rank's copies of parameters tied across stages (summed over
        ``tied_pg``, left out of the stage AllReduce)."""
        return {
            id(self.by_layer[lay].get_parameter(name))
            for g in self.tied_pg
            for lay, name in self.groups[g]
            if lay in self.by_layer
        }

    def _hook_buckets(self, cap_bytes: int) -> None:
        """Bucket :attr:`reduced` in reverse order (the order backward finishes them) and hook
        each parameter's gradient accumulation to :meth:`on_grad`."""
        self.buckets = _make_buckets(self.reduced[::-1], cap_bytes)
        for k, bk in enumerate(self.buckets):
            for i, p in enumerate(bk.params):
                self._where[id(p)] = (k, i)
                self._hooks.append(p.register_post_accumulate_grad_hook(self.on_grad))  # type: ignore[no-untyped-call]

    # -- (1) the overlapped stage AllReduce ------------------------------------------------------
    def arm(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Before the last backward of the step that accumulates into ``params`` (None: every
        parameter of the rank): reduce buckets as they become final. A rank holding several
        chunks arms each chunk's parameters at that chunk's last backward; the gradients of
        parameters not armed yet are not final and are ignored."""
        if not self.buckets:
            return
        if not self._armed:
            for bk in self.buckets:
                bk.ready.clear()
                bk.work, bk.launched = None, False
            self._next = 0
            self._armed = True
            self._final = set()
        if params is None:
            self._final = None
        elif self._final is not None:
            self._final |= {id(p) for p in params}

    def on_grad(self, p: torch.Tensor) -> None:
        """``p``'s gradient of this backward is complete (autograd's hook, or a ``W``): start
        the buckets whose gradients are all final, in order; parameters not reduced here are
        ignored."""
        if not self._armed or id(p) not in self._where:
            return
        if self._final is not None and id(p) not in self._final:
            return
        k, i = self._where[id(p)]
        bk = self.buckets[k]
        if bk.launched:
            raise RuntimeError(
                "a gradient changed after its bucket's AllReduce started (a parameter "
                "accumulated twice in one backward)"
            )
        bk.ready.add(i)
        while self._next < len(self.buckets):
            nb = self.buckets[self._next]
            if len(nb.ready) < len(nb.params):
                break
            self._launch(nb)
            self._next += 1

    def _launch(self, bk: _Bucket) -> None:
        for p, off in zip(bk.params, bk.offsets, strict=True):
            view = bk.flat[off : off + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
        bk.work = comm.all_reduce(bk.flat, op=dist.ReduceOp.SUM, group=self.pg, async_op=True)
        bk.launched = True

    def finish(self) -> None:
        """The ``AR`` action: start the buckets not started yet (in order), wait for all and
        make every gradient its reduced value (a view of the bucket)."""
        self._armed = False
        if not self.buckets:
            return
        for bk in self.buckets:
            if not bk.launched:
                self._launch(bk)
        for bk in self.buckets:
            bk.work.wait()
            bk.work = None
            for p, off in zip(bk.params, bk.offsets, strict=True):
                view = bk.flat[off : off + p.numel()]
                if p.is_contiguous():
                    p.grad = view.view_as(p)
                else:
                    p.grad = view.view(p.shape).clone(memory_format=torch.preserve_format)
        for bk in self.buckets:
            bk.launched = False
        self._next = 0

    def drain(self) -> None:
        """Wait for the started buckets and drop them (the step is skipped or stopped)."""
        self._armed = False
        for bk in self.buckets:
            if bk.work is not None:
                bk.work.wait()
            bk.work, bk.launched = None, False
        self._next = 0

    # -- (2) tied parameters -------------------------------------------------------------------
    def tied(self) -> None:
        """Step (2): sum tied copies (local and, over ``tied_pg``, across stages)."""
        if not self.by_layer or not self.groups:
            return

        def group_sum(g: int, local: torch.Tensor) -> torch.Tensor:
            if g in self.tied_pg:  # every device of the stages: each tensor rank adds 1/t_s
                if self.parallel.tensor_parallel:
                    local.div_(self.parallel.tensor_width)  # t_s a power of two: exact
                comm.all_reduce(local, op=dist.ReduceOp.SUM, group=self.tied_pg[g])
            return local

        sync_tied_grads(self.by_layer, self.groups, group_sum)

    # -- teardown -----------------------------------------------------------------------------
    def close(self, *, clean: bool) -> None:
        """Remove the hooks; when ``clean`` (every rank finished the run), wait for any bucket
        still in flight and destroy this run's groups (a collective in creation order).

        After a failure (``clean=False``) peers may be gone: nothing is waited for or destroyed.
        """
        self._armed = False
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if not clean:
            return
        self.drain()
        self.buckets = []
        for pg in [*self.stage_pg.values(), *self.extra_pg, *self.tied_pg.values()]:
            dist.destroy_process_group(pg)
        self.stage_pg, self.tied_pg, self.pg, self.extra_pg = {}, {}, None, []

"""The worker of ``schedules_measured.py``: dapple's runs and torch's pipelining peers in one
gloo process group, with the busy time of every dapple rank measured around the executor's F,
B, I and W handlers (``src/`` unchanged)."""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import (
    back_to_back_ms,
    bench_transformer,
    join_worker_group,
    load_note,
    max_over_ranks,
)
from dapple.core.plan import Plan
from vs_torch_pipelining import LR

TORCH_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "interleavedzb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""The ``torch.distributed.pipelining`` schedule class of each torch runner kind."""


# -- measuring the busy time of a dapple rank -----------------------------------------------
class BusyMeter:
    """Wall time this process spends inside the stage executors' F, B, I and W handlers, minus
    the time those handlers wait for incoming activations or gradients, per training step.

    Installed by wrapping the methods of :class:`dapple.runtime.stage.StageExecutor`,
    :meth:`dapple.runtime.stage_links.StageLinks.wait_concat` and
    :meth:`dapple.runtime.interpreter.ProgramInterpreter.run_step` in this process (the
    benchmark's worker); ``src/`` is unchanged.
    """

    def __init__(self) -> None:
        self.busy = 0.0
        self.steps: list[float] = []
        """Busy ms of each ``run_step`` since :meth:`reset`."""
        self.cpu: list[float] = []
        """CPU ms of this process (all its threads) in each ``run_step`` since :meth:`reset`."""
        self.ends: list[float] = []
        """``time.perf_counter`` at the start of the first ``run_step`` since :meth:`reset`,
        then at the end of each."""

    def reset(self) -> None:
        self.busy, self.steps, self.cpu, self.ends = 0.0, [], [], []

    def periods(self) -> list[float]:
        """This rank's ms per step: the period between consecutive ``run_step`` ends (the
        first: from the first one's start)."""
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self.ends)]

    def install(self) -> BusyMeter:
        from dapple.runtime.interpreter import ProgramInterpreter
        from dapple.runtime.stage import StageExecutor
        from dapple.runtime.stage_links import StageLinks

        def timed(fn: Callable[..., Any], sign: float) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.busy += sign * (time.perf_counter() - t) * 1e3

            return wrapper

        for name in ("forward", "backward", "backward_input", "backward_weight"):
            setattr(StageExecutor, name, timed(getattr(StageExecutor, name), 1.0))
        # the receive waits happen inside F, B and I: not compute
        StageLinks.wait_concat = timed(StageLinks.wait_concat, -1.0)
        run_step = ProgramInterpreter.run_step

        def counted_step(interp: ProgramInterpreter, *args: Any, **kwargs: Any) -> Any:
            before, cpu = self.busy, time.process_time()
            if not self.ends:
                self.ends.append(time.perf_counter())
            try:
                return run_step(interp, *args, **kwargs)
            finally:
                self.steps.append(self.busy - before)
                self.cpu.append((time.process_time() - cpu) * 1e3)
                self.ends.append(time.perf_counter())

        ProgramInterpreter.run_step = counted_step
        return self


# -- the CPU of each action kind, dapple's and torch's alike ----------------------------------
ACTION_KINDS = ("F", "B", "I", "W", "main")
"""The compute kinds :class:`ActionMeter` counts, and ``main``: the whole step on the main
thread (what is not F, B, I or W there is the runtime's own work: sends, receives, the
optimizer, the schedule's bookkeeping)."""


class ActionMeter:
    """Main-thread CPU ms (``time.thread_time``) inside each compute action, per kind and step:
    dapple's ``StageExecutor.forward/backward/backward_input/backward_weight`` and torch's
    ``_PipelineStageBase.forward_one_chunk/backward_one_chunk/backward_weight_one_chunk``
    (``B`` where ``full_backward``, ``I`` otherwise), wrapped in this process. dapple waits for
    an action's messages inside it (``StageLinks.wait_concat``), torch before it
    (``_wait_batch_p2p``): the CPU of dapple's waits (gloo's wait path; a sleep adds none) is
    taken out of its actions and left to ``main``, where torch's is, so both count the same.
    """

    def __init__(self) -> None:
        self.now = dict.fromkeys(ACTION_KINDS, 0.0)
        self.steps: list[dict[str, float]] = []
        self.waited = 0.0
        """Main-thread CPU ms inside dapple's message waits so far."""

    def take(self) -> list[list[float]]:
        """Per kind of :data:`ACTION_KINDS`, the ms of each step since the last call."""
        out = [[st[k] for st in self.steps] for k in ACTION_KINDS]
        self.steps = []
        return out

    def end_step(self, main_ms: float) -> None:
        self.steps.append({**self.now, "main": main_ms})
        self.now = dict.fromkeys(ACTION_KINDS, 0.0)

    def _timed(self, fn: Callable[..., Any], kind: Callable[..., str]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t, waited = time.thread_time(), self.waited
            try:
                return fn(*args, **kwargs)
            finally:
                ms = (time.thread_time() - t) * 1e3 - (self.waited - waited)
                self.now[kind(*args, **kwargs)] += ms

        return wrapper

    def _wait(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.waited += (time.thread_time() - t) * 1e3

        return wrapper

    def install(self) -> ActionMeter:
        from torch.distributed.pipelining.stage import _PipelineStageBase

        from dapple.runtime.interpreter import ProgramInterpreter
        from dapple.runtime.stage import StageExecutor
        from dapple.runtime.stage_links import StageLinks

        StageLinks.wait_concat = self._wait(StageLinks.wait_concat)  # type: ignore[method-assign]

        for cls, names in (
            (StageExecutor, ("forward", "backward", "backward_input", "backward_weight")),
            (
                _PipelineStageBase,
                ("forward_one_chunk", "", "", "backward_weight_one_chunk"),
            ),
        ):
            for name, k in zip(names, "FBIW", strict=True):
                if name:
                    setattr(cls, name, self._timed(getattr(cls, name), lambda *a, k=k, **kw: k))

        def torch_backward(*args: Any, **kwargs: Any) -> str:
            full = kwargs.get("full_backward", args[3] if len(args) > 3 else True)
            return "B" if full else "I"

        _PipelineStageBase.backward_one_chunk = self._timed(  # type: ignore[method-assign]
            _PipelineStageBase.backward_one_chunk, torch_backward
        )
        run_step = ProgramInterpreter.run_step

        def counted_step(interp: ProgramInterpreter, *args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return run_step(interp, *args, **kwargs)
            finally:
                self.end_step((time.thread_time() - t) * 1e3)

        ProgramInterpreter.run_step = counted_step
        return self


# -- torch peers ------------------------------------------------------------------------------
class TorchPipe:
    """A ``torch.distributed.pipelining`` schedule with this rank's stages of ``chunks``
    (stage k: layers ``chunks[k]`` on rank ``placement[k]``)."""

    def __init__(
        self,
        kind: str,
        rank: int,
        G: int,
        M: int,
        chunks: list[list[int]],
        placement: list[int],
        blocks: int,
        clip: float | None = None,
    ) -> None:
        from torch.distributed import pipelining as pp

        self.G = G
        self.wl = bench_transformer(layers=blocks)
        S = len(chunks)
        mine = [k for k in range(S) if placement[k] == rank]
        self.first, self.last = 0 in mine, S - 1 in mine
        modules = [self.wl.build_stage(chunks[k][0], chunks[k][1], 0) for k in mine]
        stages = [
            pp.PipelineStage(mod, k, S, torch.device("cpu"))
            for k, mod in zip(mine, modules, strict=True)
        ]
        cls = getattr(pp, TORCH_SCHEDULES[kind])
        self.sched = cls(
            stages[0] if kind == "1f1b" else stages, n_microbatches=M, loss_fn=self.wl.loss_fn
        )
        self.params = [p for m in modules for p in m.parameters()]
        self.opt = torch.optim.SGD(self.params, lr=LR)
        self.clip = clip

    def step(self, k: int) -> None:
        """One optimizer step on the batch of seed ``k`` (built here, as dapple's runtime does)."""
        x, y = self.wl.make_batch(self.G, k)
        args = (x,) if self.first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": []} if self.last else {}
        self.sched.step(*args, **kwargs)
        if self.clip is not None:
            clip_over_ranks(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def clip_over_ranks(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip ``params``' gradients by the pipeline's global norm as torchtitan clips a pipeline:
    this rank's L2 norm (``torch.nn.utils.get_total_norm``) squared, all-reduced (sum) over the
    ranks, its square root the total norm, every gradient scaled by
    ``torch.nn.utils.clip_grads_with_norm_``; returns the total norm. The all-reduce waits for
    every rank's last weight gradient, as dapple's step collective does."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.nn.utils.get_total_norm(grads, 2.0) ** 2
    dist.all_reduce(sq, op=dist.ReduceOp.SUM)
    total = sq.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def _agree(error: str | None) -> str | None:
    """The first rank's error, if any rank has one (every rank calls this)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((e for e in errors if e), None)


def _sum_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return [float(v) for v in t.tolist()]


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def worker(
    rank: int, world: int, port: int, cases: list[dict[str, Any]], opts: dict[str, Any], out: str
) -> None:
    from dapple.runtime import TrainConfig, run_plan, shutdown_distributed

    join_worker_group(rank, world, port)  # as dapple's CPU ranks, for both runners
    wl = bench_transformer(layers=opts["blocks"])
    meter = BusyMeter().install()
    actions = ActionMeter().install()
    peers: dict[int, TorchPipe] = {}
    res: dict[int, dict[str, Any]] = {
        i: {"ms": [], "busy": [], "cpu": [], "actions": [], "error": None}
        for i in range(len(cases))
    }
    steps, skip = opts["steps"], opts["skip"]
    for rnd in range(opts["rounds"]):
        order = list(range(len(cases)))
        if rnd % 2:
            order.reverse()
        for i in order:
            c, r = cases[i], res[i]
            if r["error"]:
                continue
            if c["runner"] == "dapple":
                meter.reset()
                cfg = TrainConfig(steps=steps, seed=rnd, optimizer="sgd", lr=LR, device="cpu",
                                  **c.get("train", {}))  # fmt: skip
                run_plan(Plan.from_dict(c["plan"]), wl, cfg, device=torch.device("cpu"))
                # the slowest rank's period (without the guard the ranks' periods differ)
                ms = max_over_ranks(meter.periods())
                got = [torch.zeros(len(meter.steps), dtype=torch.float64) for _ in range(world)]
                dist.all_gather(got, torch.tensor(meter.steps, dtype=torch.float64))
                cpu = _sum_over_ranks(meter.cpu)
                if rank == 0:
                    r["busy"].append([g.tolist() for g in got])  # [rank][step]
            else:
                error = None
                if i not in peers:
                    try:  # a schedule this torch cannot build here: a row "not run"
                        peers[i] = TorchPipe(
                            c["kind"], rank, opts["G"], opts["M"], c["chunks"], c["placement"],
                            opts["blocks"], **c.get("torch", {}),
                        )  # fmt: skip
                    except Exception as e:
                        error = _first_line(e)
                    r["error"] = _agree(error)
                    if r["error"]:
                        peers.pop(i, None)
                        continue
                peer, peer_cpu = peers[i], list[float]()

                def step(k: int, peer: TorchPipe = peer, out: list[float] = peer_cpu) -> None:
                    t, main = time.process_time(), time.thread_time()
                    peer.step(k)
                    actions.end_step((time.thread_time() - main) * 1e3)
                    out.append((time.process_time() - t) * 1e3)

                ms = max_over_ranks(back_to_back_ms(step, [rnd * steps + k for k in range(steps)]))
                cpu = _sum_over_ranks(peer_cpu)
            acts = [_sum_over_ranks(per_step) for per_step in actions.take()]
            if rank == 0:
                r["ms"].append(ms)
                r["cpu"].append(cpu)
                r["actions"].append(acts)  # [kind][step], summed over ranks
                print(
                    f"  round {rnd} {c['group'][:8]} {c['label']:36s} "
                    f"{statistics.median(ms[skip:]):8.1f} ms"
                    f"  ({load_note()})",
                    flush=True,
                )
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    peers.clear()  # the stages hold the process group: drop them before leaving it
    shutdown_distributed()

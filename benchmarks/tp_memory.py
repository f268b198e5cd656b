"""Per-rank memory of one stage under TP2, FSDP x2 and TP2 x FSDP2 against the same stage
unsharded, measured as tracked tensor bytes, beside the cost model's estimate.

The model is the zoo ``transformer`` (fp32, AdamW) traced into one piece per chain layer
(embedding, blocks, head) with its TP plan (:data:`dapple.runtime.parallel.tp.TRANSFORMER_TP_PLAN`), so
the runtime can cut it. Every configuration is one stage holding all layers, trained a few
steps in ONE 4-process gloo group (``run_plan`` with ``exact_world=False``: ranks beyond a
plan idle through its collectives), one after the other.

What is measured, per rank, by :class:`LiveBytes` (a ``TorchDispatchMode`` entered around
``run_plan``): the bytes of every tensor storage the rank's ops allocate, while it is alive
(FSDP's ``UntypedStorage.resize_`` included), and after every op the part that is training
state - the storages of every parameter a module call or the optimizer saw (TP's local slices,
FSDP's shards and its gathered whole parameters), their ``.grad`` and the optimizer's state. A
step's window runs from one optimizer step's end to the next; the rows report the steady steps
(the first, which ends by creating AdamW's moments, is left out):

- *state peak*: the most bytes of parameters + gradients + optimizer state at once, and what
  they were at that moment;
- *step peak*: the most bytes of all tensors at once (the state, held activations, backward
  temporaries, FSDP's reduce-scatter buffers);
- *held between steps*: the least state during a step (the gradients dropped, the rest kept).

At the end of the first step the tracker runs one ``gc.collect()`` and records what it freed:
set-up garbage in reference cycles (e.g. the uncut pieces a TP rank built before cutting
them), which Python's cyclic collector would otherwise free at a time of its choosing.

The estimate is the cost model's for the same plan, on a profile of the same model measured with
:func:`dapple.api.profile` (its chain layers that the TP plan cuts marked ``tensor_parallel``,
which the measured profiler does not do itself):

- state: :func:`dapple.cost.memory.parameter_state_bytes` less its gradients in flight
  (:func:`~dapple.cost.memory.gradients_in_flight_bytes`: the gradient autograd produces before
  adding it to the accumulated one, FSDP's reduce-scatter buffers and re-gathered pieces - the
  tracker counts those transients in the step peak, not in the state);
- step: the stage's ``memory_bytes`` from :func:`dapple.cost.pipeline.pipeline_latency`
  (state, gradients in flight and the kept activations of the K_i micro-batches in flight).

Run: ``python benchmarks/tp_memory.py [--out benchmarks/tp_memory.md] [--tiny]`` (about 2
minutes on 2 busy cores; ``--tiny``: a 2-block width-32 model, for a smoke run). A section
``## Analysis`` already in ``--out`` is kept below the new results.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from _bench_common import (
    HERE,
    header,
    join_worker_group,
    kept_section,
    load_note,
    run_worker_group,
)
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.cost.memory import gradients_in_flight_bytes, parameter_state_bytes
from dapple.cost.pipeline import pipeline_latency
from dapple.models.workload import Workload

MODEL: dict[str, Any] = {"layers": 4, "hidden": 384, "heads": 6, "seq": 32, "vocab": 1024}
"""The zoo transformer measured: 4 blocks of width 384 (7.1M of its 7.9M parameters)."""
TINY: dict[str, Any] = {"layers": 2, "hidden": 32, "heads": 4, "seq": 8, "vocab": 64}
"""``--tiny``: a smoke-run size."""
G, M, STEPS = 4, 2, 3
"""Global batch, micro-batches, steps: 2-sample micro-batches, so parameters and AdamW state
dominate the step (kept activations: about 5% of the unsharded state at MODEL)."""
WORLD = 4
MIB = 1024**2
GOAL_RATIO = 0.6
"""Parameters + gradients + optimizer state per rank, against the unsharded stage."""
GOAL_ESTIMATE = 0.15
"""|estimate / measured - 1| allowed."""
ANALYSIS = "## Analysis"

CONFIGS: dict[str, dict[str, Any]] = {
    "unsharded (1 rank)": {"devices": (0,)},
    "TP2": {"devices": (0, 1), "tensor_width": 2},
    "FSDP x2": {"devices": (0, 1), "zero_stage": 3},
    "FSDP x2, regather": {"devices": (0, 1), "zero_stage": 3, "regather": True},
    "TP2 x FSDP2": {"devices": (0, 1, 2, 3), "tensor_width": 2, "zero_stage": 3},
}
"""The compared plans: one stage of every layer; its ``StagePlan`` fields besides ``layers``."""
BASE = "unsharded (1 rank)"
KINDS = ("parameters", "FSDP parameter shards", "gradients", "FSDP gradient shards", "optimizer")
"""The parts of the state: a parameter (or gradient) is an FSDP shard when it is a DTensor;
the others are whole, or TP's local slices, or FSDP's gathered whole parameters."""


def traced_zoo(sizes: dict[str, Any]) -> Workload:
    """The zoo transformer at ``sizes`` traced into one piece per chain layer, with its TP plan."""
    from dapple.models.split import workload_from_module
    from dapple.models.zoo.transformer import transformer
    from dapple.runtime.parallel.tp import TRANSFORMER_TP_PLAN

    wl = transformer(**sizes)
    cuts = [str(i) for i in range(1, sizes["layers"] + 2)]
    traced = workload_from_module(wl.build_model, wl.make_batch, wl.loss_fn, split_at=cuts)
    return dataclasses.replace(traced, name="transformer", tp_plan=dict(TRANSFORMER_TP_PLAN))


def plan_of(name: str, num_layers: int, global_batch: int = G, micro: int = M) -> Plan:
    """The one-stage plan ``name`` of :data:`CONFIGS` over ``num_layers`` layers."""
    stage = StagePlan(layers=(0, num_layers), **CONFIGS[name])
    return Plan(planner="manual", global_batch_size=global_batch,
                micro_batch_size=global_batch // micro, num_micro_batches=micro,
                stages=(stage,), schedule="dapple")  # fmt: skip


# -- the tracker -----------------------------------------------------------------------------
def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """``t``'s storage (a DTensor: its local shard's); None on the meta device or without one."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


@dataclasses.dataclass
class Window:
    """One step's extremes (bytes), from one optimizer step's end to the next's."""

    step_peak: int = 0
    state_peak: int = -1
    state_low: int = 2**62
    parts: dict[str, int] = dataclasses.field(default_factory=dict)
    """The state's :data:`KINDS` at its peak."""
    other_at_step_peak: int = 0
    """Bytes besides the state at the step peak."""

    def see(self, total: int, parts: dict[str, int]) -> None:
        state = sum(parts.values())
        if state > self.state_peak:
            self.state_peak, self.parts = state, dict(parts)
        if total > self.step_peak:
            self.step_peak, self.other_at_step_peak = total, total - state
        self.state_low = min(self.state_low, state)


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Live bytes of the tensor storages this thread's ops allocate, and the training state
    among them, with each step's extremes (:class:`Window`, in :attr:`windows`).

    Storages are counted once, from the op that returns them until they are freed (a weak
    reference's callback); ``UntypedStorage.resize_`` (FSDP's allocation of gathered
    parameters) updates a storage's size. The state is recomputed after every op from what the
    tracker has seen: parameters of every module called (global forward pre-hook), those of
    every optimizer stepped, their gradients and the optimizers' state tensors. The first
    optimizer step's end runs ``gc.collect()``; :attr:`collected` is what it freed.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0
        self.collected = 0
        self.windows: list[Window] = []
        self._sizes: Any = WeakIdKeyDictionary()  # storage -> ([bytes], weakref)
        self._params: Any = WeakIdKeyDictionary()  # parameter -> None
        self._optims: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._win = Window()
        self._undo: list[Callable[[], None]] = []

    def _add(self, st: torch.UntypedStorage) -> None:
        if st in self._sizes:
            return
        cell = [st.nbytes()]
        self._sizes[st] = (cell, weakref.ref(st, partial(self._free, cell)))
        self.total += cell[0]

    def _free(self, cell: list[int], _ref: object) -> None:
        self.total -= cell[0]

    def _resized(self, st: torch.UntypedStorage) -> None:
        entry = self._sizes.get(st)
        if entry is None:
            self._add(st)
        else:
            self.total += st.nbytes() - entry[0][0]
            entry[0][0] = st.nbytes()
        self._see()

    def _track(self, t: torch.Tensor) -> None:
        st = _storage(t)
        if st is not None:
            self._add(st)

    def state_parts(self) -> dict[str, int]:
        """Bytes of the distinct storages of the state seen, by :data:`KINDS`."""
        held: dict[int, tuple[str, int]] = {}

        def add(kind: str, t: torch.Tensor | None) -> None:
            st = None if t is None else _storage(t)
            if st is not None and st.nbytes() and st.data_ptr() not in held:
                held[st.data_ptr()] = (kind, st.nbytes())

        for p in list(self._params.keys()):
            shard = isinstance(p, DTensor)
            add("FSDP parameter shards" if shard else "parameters", p)
            add("FSDP gradient shards" if shard else "gradients", p.grad)
        for opt in list(self._optims):
            for state in opt.state.values():
                for v in state.values():
                    add("optimizer", v if isinstance(v, torch.Tensor) else None)
        parts = dict.fromkeys(KINDS, 0)
        for kind, n in held.values():
            parts[kind] += n
        return parts

    def _see(self) -> None:
        self._win.see(self.total, self.state_parts())

    def _module_called(self, module: nn.Module, _args: Any) -> None:
        for p in module.parameters():
            self._params[p] = None

    def _optimizer_stepping(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        self._optims.add(opt)
        for group in opt.param_groups:
            for p in group["params"]:
                self._params[p] = None

    def _optimizer_stepped(self, *_: Any) -> None:
        self._see()
        self.windows.append(self._win)
        if len(self.windows) == 1:
            before = self.total
            gc.collect()
            self.collected = before - self.total
        self._win = Window()
        self._see()

    def __enter__(self) -> LiveBytes:
        orig_resize = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig_resize(st, size)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
        hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._module_called),
            register_optimizer_step_pre_hook(self._optimizer_stepping),
            register_optimizer_step_post_hook(self._optimizer_stepped),
        ]

        def undo() -> None:
            torch.UntypedStorage.resize_ = orig_resize  # type: ignore[method-assign]
            for h in hooks:
                h.remove()

        self._undo.append(undo)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)  # type: ignore[no-untyped-call]
        self._undo.pop()()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        self._see()
        return out


def steady_extremes(live: LiveBytes) -> dict[str, Any] | None:
    """A rank's extremes over the steady steps (all but the first; None: no step ran)."""
    steady = live.windows[1:] or live.windows
    if not steady:
        return None
    top = max(steady, key=lambda w: w.state_peak)
    return {
        "state_peak": top.state_peak,
        "parts": top.parts,
        "step_peak": max(w.step_peak for w in steady),
        "other_at_step_peak": max(steady, key=lambda w: w.step_peak).other_at_step_peak,
        "state_low": min(w.state_low for w in steady),
        "collected": live.collected,
    }


# -- measuring on 4 processes -------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, sizes: dict[str, Any], steps: int, out: str) -> None:
    """Every configuration in turn on this rank; rank 0 writes each rank's steady extremes."""
    from dapple.runtime import shutdown_distributed
    from dapple.runtime.engine import run_plan
    from dapple.runtime.train_config import TrainConfig

    join_worker_group(rank, world, port)
    wl = traced_zoo(sizes)
    cfg = TrainConfig(steps=steps, optimizer="adamw", lr=1e-3, device="cpu")
    results: dict[str, list[dict[str, Any]]] = {}
    for name in CONFIGS:
        plan = plan_of(name, wl.num_layers)
        with LiveBytes() as live:
            run_plan(plan, wl, cfg, device=torch.device("cpu"), exact_world=False)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, steady_extremes(live) if rank in plan.devices else None)
        results[name] = [g for g in gathered if g is not None]
        if rank == 0:
            print(f"{name}: {results[name]}", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    shutdown_distributed()


# -- the estimate ----------------------------------------------------------------------------------
def mark_tensor_parallel(prof: ModelProfile, wl: Workload) -> ModelProfile:
    """``prof`` with ``tensor_parallel`` set on the layers ``wl``'s TP plan cuts."""
    from dapple.runtime.parallel.tp import match_style

    layers = []
    for i, layer in enumerate(prof.layers):
        names = [n for n, _ in wl.build_layer(i, 0).named_parameters()]
        cut = any(match_style(n.rpartition(".")[0], wl.tp_plan) for n in names)
        layers.append(dataclasses.replace(layer, tensor_parallel=cut))
    return dataclasses.replace(prof, layers=tuple(layers))


def estimate(plan: Plan, prof: ModelProfile) -> dict[str, float]:
    """The cost model's per-rank state (less its gradients in flight) and step peak."""
    st = plan.stages[0]
    cluster = Cluster(name="local-4", servers=1, devices_per_server=WORLD,
                      device_memory_bytes=64 * 1024**3, intra_server_bandwidth_gbps=10.0,
                      inter_server_bandwidth_gbps=10.0)  # fmt: skip
    in_flight = gradients_in_flight_bytes(prof, st.layers, st.parallel)
    state = parameter_state_bytes(prof, st.layers, st.parallel)
    step = pipeline_latency(plan, prof, cluster).stages[0].memory_bytes
    return {"state": state - in_flight, "step": step}


# -- the report ----------------------------------------------------------------------------------
def _mib(b: float) -> str:
    return f"{b / MIB:.1f}"


def worst(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per configuration, each number's largest over its ranks (the parts: the rank with the
    largest state peak)."""
    out = {}
    for name, rows in results.items():
        top = max(rows, key=lambda r: r["state_peak"])
        out[name] = {k: max(r[k] for r in rows) for k in rows[0] if k != "parts"}
        out[name]["parts"] = top["parts"]
        out[name]["ranks"] = len(rows)
    return out


def tables(w: dict[str, dict[str, Any]], ests: dict[str, dict[str, float]]) -> list[str]:
    """The markdown tables: peaks against the unsharded stage and the estimate; the state's
    parts at its peak."""
    base = w[BASE]
    lines = [
        "| configuration | ranks | state peak MiB | vs unsharded | estimate MiB | est / meas "
        "| step peak MiB | vs unsharded | estimate MiB | est / meas |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in w.items():
        est = ests[name]
        lines.append(
            f"| {name} | {r['ranks']} | {_mib(r['state_peak'])} "
            f"| {r['state_peak'] / base['state_peak']:.2f}x | {_mib(est['state'])} "
            f"| {est['state'] / r['state_peak']:.2f} | {_mib(r['step_peak'])} "
            f"| {r['step_peak'] / base['step_peak']:.2f}x | {_mib(est['step'])} "
            f"| {est['step'] / r['step_peak']:.2f} |"
        )
    lines += [
        "",
        "The state at its peak, MiB (whole or TP-local / FSDP shards), what it holds between "
        "steps, the other tensors at the step peak, and what `gc.collect()` freed after the "
        "first step:",
        "",
        f"| configuration | {' | '.join(KINDS)} | held between steps | vs unsharded "
        "| other tensors at step peak | freed by gc.collect() |",
        f"|---|{'---|' * len(KINDS)}---|---|---|---|",
    ]
    for name, r in w.items():
        lines.append(
            f"| {name} | {' | '.join(_mib(r['parts'][k]) for k in KINDS)} "
            f"| {_mib(r['state_low'])} | {r['state_low'] / base['state_low']:.2f}x "
            f"| {_mib(r['other_at_step_peak'])} | {_mib(r['collected'])} |"
        )
    return lines


def verdicts(w: dict[str, dict[str, Any]], ests: dict[str, dict[str, float]]) -> list[str]:
    """The goals, met or missed, with the numbers."""
    base = w[BASE]["state_peak"]
    lines = []
    for name in ("TP2", "FSDP x2", "FSDP x2, regather", "TP2 x FSDP2"):
        ratio = w[name]["state_peak"] / base
        ok = "met" if ratio <= GOAL_RATIO else "**missed**"
        lines.append(
            f"- {name}: parameters + gradients + optimizer state <= {GOAL_RATIO}x the "
            f"unsharded stage: {ok} ({ratio:.2f}x)"
        )
    off = [
        f"{name} {kind} {ests[name][kind] / w[name][f'{kind}_peak']:.2f}"
        for name in w
        for kind in ("state", "step")
        if abs(ests[name][kind] / w[name][f"{kind}_peak"] - 1) > GOAL_ESTIMATE
    ]
    cells = 2 * len(w)
    ok = "met" if not off else "**missed**"
    lines.append(
        f"- estimate within {GOAL_ESTIMATE:.0%} of measured: {ok} ({cells - len(off)} of "
        f"{cells} within; outside, est / meas: {', '.join(off) or 'none'})"
    )
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, estimate, write the markdown; returns the worst-rank rows and the estimates."""
    from dapple import api

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "tp_memory.md"))
    ap.add_argument("--tiny", action="store_true", help="the TINY model (smoke run)")
    ap.add_argument("--steps", type=int, default=STEPS)
    args = ap.parse_args(argv)
    sizes = TINY if args.tiny else MODEL
    command = f"python benchmarks/tp_memory.py{' --tiny' if args.tiny else ''}"
    lines = header("Per-rank memory of TP2 and FSDP x2 against one unsharded stage", command)
    wl = traced_zoo(sizes)
    prof = api.profile(wl, batch_sizes=[1, 2], device="cpu", repeats=1, warmup=0)
    prof = mark_tensor_parallel(prof, wl)
    n_params = sum(layer.parameter_bytes for layer in prof.layers) // 4
    cut = sum(layer.parameter_bytes for layer in prof.layers if layer.tensor_parallel) // 4
    ests = {name: estimate(plan_of(name, wl.num_layers), prof) for name in CONFIGS}
    w = worst(run_worker_group(_worker, WORLD, sizes, args.steps))
    lines += [
        f"Model: zoo `transformer` {sizes}, {n_params / 1e6:.2f}M parameters "
        f"({cut / 1e6:.2f}M in the blocks the TP plan cuts; embedding, head and the blocks' "
        f"norms whole on every tensor rank), fp32, AdamW (fused), global batch {G}, M = {M}, "
        f"{args.steps} steps (the first left out), one stage of all {wl.num_layers} chain "
        "layers, 4 gloo processes. Tracked tensor bytes per rank (see the script's docstring); "
        "each cell is the largest over the configuration's ranks.",
        "",
        *tables(w, ests),
        "",
        "## Goals",
        "",
        *verdicts(w, ests),
        "",
        f"End: {load_note()}.",
    ]
    lines += kept_section(Path(args.out), ANALYSIS)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {"rows": w, "estimates": ests}


if __name__ == "__main__":
    main()

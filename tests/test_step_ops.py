"""What a dapple step does beyond a plain loop, counted: aten ops and Python calls (issue 46).

One process (a gloo group of one) trains a 1-stage plan of an 8-layer MLP (16 parameter
tensors) with AdamW, metrics and the non-finite guard on, and a plain loop over the same
layers (same batches, micro-batches, optimizer; its loss read once a step). One step of each,
after warm-up, is counted: ``torch.profiler``'s ``aten::`` events (nested ones included) and
``cProfile``'s calls. M = 2 and M = 4 separate what dapple adds per micro-batch from what it
adds once per step. Counts, never time: they do not move with the machine's load. The same
counts of a small transformer (integer token inputs and targets, 30 parameter tensors) bound
what a token workload's step adds.

The bounds: per micro-batch, a fixed number of ops and calls whatever the number of gradients
(the guard reads no gradient there: their norm is its check, once per step); per step, the
gradient norm (three events per gradient: its norm, the norm's strides and its copy into
the step's vector of norms), the guard's verdict, the step's collective row and the metrics.

Besides the counts: which stages run under the keyed-RNG context, and the fused check after
each backward of the replay that names the first backward that left a non-finite gradient,
in every gradient dtype. Beyond one stage: the Python calls of a pipeline's message
(:class:`~dapple.runtime.comm.PointToPoint`, posted on a recording group), and a CUDA step's
memory reads giving ``torch.cuda``'s numbers without its flattening of every statistic.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import runtime_workloads as rw
from dapple.core.plan import straight_plan
from dapple.models.workload import Workload
from dapple.profiler.op_counts import OpCounter
from dapple.runtime import TrainConfig, run_plan
from dapple.runtime.optim import make_optimizer

LAYERS, B, WARMUP, SEED = 8, 2, 3, 0
N_GRADS = 2 * LAYERS  # weight and bias per layer

PER_MB_OPS = 7
"""aten ops dapple may add per micro-batch, whatever the number of gradients: the clone of the
micro-batch's (floating) input rows, the clone of its (floating) target rows and the copy of its
loss into a held float64 scalar, summed there for the guard (7 here; 10 while the loss was
converted by ``to`` and the sum promoted it, 12 while each row copy was ``to(copy=True)``, 65
while the guard checked the gradients after each backward, 106 before that)."""
PER_MB_CALLS = 22
"""Python calls dapple may add per micro-batch: a fixed number for the executor, the
interpreter and the guard (20 here: no slow-down context at K = 1 and the last stage's loss
back-propagated directly; 26-28 before; 61 with a check after each backward, 118 before
that)."""
PER_STEP_OPS = 3 * N_GRADS + 4
"""aten ops dapple may add once per step: the gradient norm (on the CPU a norm, its strides
and its copy into the group's vector per gradient; their copy into a held float64 vector and
the squares' sum in one ``dot``), the guard's verdict, the step's row (each distinct tensor
copied into a held vector, read at once), the metrics (52 here; 60 while the row was
``stack``ed and the norms converted by ``to``; 77 while the norms were stacked, 81 with
``square().sum()``, 105 while a world of one still built its row on the device and the
norm's square root without clipping)."""
TOKEN_GRADS = 30
"""Parameter tensors of :func:`_tokens`'s model."""
TOKEN_PER_MB_OPS = 1
"""aten ops dapple may add per micro-batch of a token workload: the loss's copy into float64
(1 here; 7 while integer input rows were cloned and the loss converted by ``to``)."""
TOKEN_PER_STEP_OPS = 3 * TOKEN_GRADS + 8
"""aten ops dapple may add once per step of a token workload: :data:`PER_STEP_OPS`'s and the
count of target tokens, ``count_nonzero``, copied into the row (98 here; 112 while the count
was a float64 ``sum`` and the row ``stack``ed)."""
PER_STEP_CALLS = 175
"""Python calls dapple may add once per step (170 here, 173 once in a full test run: the
peak resident memory is read from ``getrusage``, and from the file only in a step where it
moved, which the measured step may or may not be; the batch's
static shapes compared without building them; 178-179 before,
the step's records and row are built by methods of their own, which ``on_nonfinite="off"``
shares, 8910ddd; 174 before;
writing the norms into each group's vector takes 3 calls more than stacking them, 171; 201
before a world of one read its row in one copy)."""


def _config() -> TrainConfig:
    return TrainConfig(steps=WARMUP + 2, seed=SEED, optimizer="adamw", lr=1e-3, timeout_s=60)


def _tokens() -> Workload:
    """A token workload: integer inputs and targets, the step's target tokens counted."""
    from dapple.models.zoo.transformer import transformer_tp

    return transformer_tp(layers=2, hidden=16, heads=2, seq=8, vocab=32)


def _plain(m: int, wl: Workload) -> tuple[int, int]:
    model = wl.build_model(SEED)
    params = list(model.parameters())
    opt = make_optimizer(_config(), params)
    G = B * m
    win = OpCounter()
    counted = (0, 0)
    for step in range(WARMUP + 1):
        if step == WARMUP:
            win.start()
        x, y = wl.make_batch(G, SEED + step)
        for p in params:
            p.grad = None
        total: Any = 0.0
        for k in range(m):
            loss = wl.loss_fn(model(x[k * B : (k + 1) * B]), y[k * B : (k + 1) * B]) * (B / G)
            loss.backward()
            total = total + loss.detach()
        opt.step()
        float(total)
        if step == WARMUP:
            counts = win.stop()
            counted = (counts.total_ops, counts.total_calls)
    return counted


def _dapple(m: int, wl: Workload) -> tuple[int, int]:
    plan = straight_plan(wl.num_layers, [0], global_batch_size=B * m, num_micro_batches=m)
    win = OpCounter()
    counted: list[tuple[int, int]] = []

    def on_step(metrics: Any) -> None:  # one whole step: from the end of the one before
        if metrics.step == WARMUP - 1:
            win.start()
        elif metrics.step == WARMUP:
            counts = win.stop()
            counted.append((counts.total_ops, counts.total_calls))

    run_plan(plan, wl, _config(), device=torch.device("cpu"), on_step=on_step)
    return counted[0]


def _extra(wl: Workload) -> dict[int, tuple[int, int]]:
    """M -> (aten ops, Python calls) dapple's step makes beyond the plain loop's."""
    out = {}
    for m in (2, 4):
        d, p = _dapple(m, wl), _plain(m, wl)
        out[m] = (d[0] - p[0], d[1] - p[1])
    return out


@pytest.fixture(scope="module")
def extra(world_of_one: None) -> dict[int, tuple[int, int]]:
    """:func:`_extra` of the MLP."""
    return _extra(rw.mlp(LAYERS))


@pytest.fixture(scope="module")
def token_extra(world_of_one: None) -> dict[int, tuple[int, int]]:
    """:func:`_extra` of the token workload."""
    return _extra(_tokens())


def test_dapple_adds_per_micro_batch_a_fixed_number_of_ops(
    extra: dict[int, tuple[int, int]],
) -> None:
    ops = (extra[4][0] - extra[2][0]) / 2
    calls = (extra[4][1] - extra[2][1]) / 2
    assert ops <= PER_MB_OPS, f"{ops} aten ops per micro-batch beyond the plain loop's"
    assert calls <= PER_MB_CALLS, f"{calls} Python calls per micro-batch beyond the plain loop's"


def test_dapple_adds_per_step_a_bounded_step_end(extra: dict[int, tuple[int, int]]) -> None:
    per_mb_ops = (extra[4][0] - extra[2][0]) / 2
    per_mb_calls = (extra[4][1] - extra[2][1]) / 2
    ops = extra[2][0] - 2 * per_mb_ops
    calls = extra[2][1] - 2 * per_mb_calls
    assert ops <= PER_STEP_OPS, f"{ops} aten ops per step beyond the plain loop's"
    assert calls <= PER_STEP_CALLS, f"{calls} Python calls per step beyond the plain loop's"


def test_a_token_step_adds_per_micro_batch_only_its_loss_sum(
    token_extra: dict[int, tuple[int, int]],
) -> None:
    """Integer input and target rows are read through views (copied only while a step is
    metered), so a token workload's micro-batch adds one op: its loss's copy into float64."""
    ops = (token_extra[4][0] - token_extra[2][0]) / 2
    assert ops <= TOKEN_PER_MB_OPS, f"{ops} aten ops per micro-batch beyond the plain loop's"


def test_a_token_step_adds_per_step_the_norm_and_one_row(
    token_extra: dict[int, tuple[int, int]],
) -> None:
    per_mb = (token_extra[4][0] - token_extra[2][0]) / 2
    ops = token_extra[2][0] - 2 * per_mb
    assert ops <= TOKEN_PER_STEP_OPS, f"{ops} aten ops per step beyond the plain loop's"


# -- what the per-micro-batch savings rest on ----------------------------------------------------
def test_only_a_stage_that_may_draw_keyed_randomness_runs_under_the_keys() -> None:
    from torch import nn

    from dapple.models.rng import KeyedDropout
    from dapple.runtime.stage import draws_keyed

    class UserLayer(nn.Module):  # user code may call dapple.models.rng's functions itself
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    assert not draws_keyed(nn.Sequential(nn.Linear(2, 2), nn.Tanh()))
    assert draws_keyed(nn.Sequential(nn.Linear(2, 2), KeyedDropout(0.1, 0, 0)))
    assert draws_keyed(nn.Sequential(nn.Linear(2, 2), UserLayer()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_guards_fused_check_flags_each_backward_in_any_gradient_dtype(
    dtype: torch.dtype,
) -> None:
    from torch import nn

    from dapple.runtime.longrun import LongRun
    from dapple.schedule.ir import Action, ActionKind

    plan = straight_plan(4, [0], global_batch_size=4, num_micro_batches=4)
    module = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, dtype=dtype), nn.Linear(3, 1))
    lr = LongRun(plan, rw.mlp(), TrainConfig(), rank=0, world=1, stage=0, replica=0,
                 module=module, optimizer=None, device=torch.device("cpu"))  # fmt: skip
    big = 6e4 if dtype is torch.float16 else 1e30  # finite, but their sum is not in fp16

    def run(values: list[float]) -> None:
        lr.guard.begin_step()
        for m, v in enumerate(values):
            for p in module.parameters():
                p.grad = torch.full_like(p, 1.0)
            module[1].weight.grad = torch.full_like(module[1].weight, v)
            lr.guard.watch(Action(stage=0, kind=ActionKind.BACKWARD, micro_batch=m), 0.0)

    def first_bad(values: list[float]) -> list[float]:
        """``[kind, micro-batch]`` the replay that names a bad step finds."""
        found = lr.guard._name_micro_batch(lambda: run(values))
        return [float(found[0][0]), float(found[0][1])] if found else [-1.0, -1.0]

    assert first_bad([1.0, big, -big, 2.0]) == [-1.0, -1.0]
    assert first_bad([1.0, 2.0, float("nan"), 1.0]) == [1.0, 2.0]
    assert first_bad([float("-inf"), 1.0, float("nan"), 1.0]) == [1.0, 0.0]
    assert first_bad([1.0] * 9 + [float("inf")]) == [1.0, 9.0]  # more backwards than 8 slots
    assert first_bad([1.0, 1.0]) == [-1.0, -1.0]  # the flags of the step before were reset


def test_the_norms_written_into_a_groups_vector_are_foreach_norms() -> None:
    """The CPU norms written into each group's own vector equal ``_foreach_norm``'s stacked,
    in each dtype, step after step; a group with a missing gradient is stacked instead."""
    from torch import nn

    from dapple.runtime.optim import GradGroups, _local_sq_norm

    ps = [nn.Parameter(torch.zeros(3, dtype=d)) for d in (torch.float32, torch.bfloat16) * 2]
    groups = GradGroups(ps)
    for scale in (1.0, -2.0, 3.0):
        for k, p in enumerate(ps):
            p.grad = torch.arange(3.0, dtype=p.dtype) * scale + k
        got = groups.norms()
        want = [torch.stack(torch._foreach_norm(gs, 2.0)) for _, gs in groups.grads()]
        assert [(g.dtype, g.tolist()) for g in got] == [(w.dtype, w.tolist()) for w in want]
        sq = sum(float(n) ** 2 for w in want for n in w.double())
        assert _local_sq_norm(groups, torch.device("cpu")).item() == pytest.approx(sq, rel=1e-12)
    ps[2].grad = None  # the float32 group now has one gradient of two
    got = groups.norms()
    assert got[0].tolist() == [torch.linalg.vector_norm(ps[0].grad).item()]


# -- what a pipeline's message and a CUDA step's memory reads cost ----------------------------
class _Group:
    """A process group that records what is posted on it."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, torch.Tensor, int, int]] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> str:
        self.posted.append(("send", tensors[0], dst, tag))
        return "work"

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> str:
        self.posted.append(("recv", tensors[0], src, tag))
        return "work"


PER_MESSAGE_CALLS = 6
"""Python calls of a stage's send or receive to another rank, the group's own included (5
here; ``torch.distributed.isend`` with its checks took 38)."""


def test_a_stage_message_is_posted_on_the_group_in_a_few_calls(world_of_one: None) -> None:
    import cProfile
    import pstats

    from dapple.runtime.comm import PointToPoint

    p2p = PointToPoint()
    assert p2p.rank == 0
    group = p2p.group = _Group()
    t = torch.ones(2, 3)
    prof = cProfile.Profile()
    prof.enable()
    for tag in range(10):
        p2p.isend(t, 1, tag)
        p2p.irecv(t, 1, tag)
    prof.disable()
    calls = pstats.Stats(prof).total_calls / 20  # type: ignore[attr-defined]
    assert calls <= PER_MESSAGE_CALLS, f"{calls} Python calls per message"
    assert [(k, x is t, peer, tag) for k, x, peer, tag in group.posted[:2]] == [
        ("send", True, 1, 0),
        ("recv", True, 1, 0),
    ]
    z = torch.zeros(2, dtype=torch.complex64)  # as torch.distributed sends it: its real view
    p2p.isend(z, 1, 5)
    assert group.posted[-1][1].shape == (2, 2) and group.posted[-1][1].dtype == torch.float32
    own = torch.empty(2)  # a message to itself never reaches the group
    p2p.isend(torch.tensor([1.0, 2.0]), 0, 9)
    assert p2p.irecv(own, 0, 9).is_completed() and own.tolist() == [1.0, 2.0]
    assert len(group.posted) == 21


def test_cuda_memory_reads_give_torchs_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    from dapple.runtime.metrics import cuda_bytes

    stats: dict[str, Any] = {"num_ooms": 0, "max_split_size": -1}
    for n, kind in enumerate(("allocated_bytes", "reserved_bytes", "active_bytes")):
        stats[kind] = {
            pool: {"current": 10 * n + k, "peak": 100 * n + k, "allocated": 7, "freed": 3}
            for k, pool in enumerate(("all", "small_pool", "large_pool"))
        }
    fake = lambda device=None: stats  # noqa: E731
    monkeypatch.setattr(torch.cuda.memory, "memory_stats_as_nested_dict", fake)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", fake)
    dev = torch.device("cuda", 0)
    assert cuda_bytes(dev, "allocated_bytes", "peak") == torch.cuda.max_memory_allocated(dev) == 0
    assert cuda_bytes(dev, "reserved_bytes", "peak") == torch.cuda.max_memory_reserved(dev) == 100
    assert cuda_bytes(dev, "reserved_bytes", "current") == torch.cuda.memory_reserved(dev) == 10
    stats.clear()  # before CUDA is initialised
    assert cuda_bytes(dev, "allocated_bytes", "peak") == torch.cuda.max_memory_allocated(dev) == 0


def test_a_parameters_gradient_accumulator_lives_through_the_run(world_of_one: None) -> None:
    """Each parameter keeps one gradient accumulator (autograd's ``AccumulateGrad`` node) for
    the run: a micro-batch's forward finds it, not a new one built after the previous
    micro-batch's backward freed its graph (as a plain loop keeps it while its last loss
    lives). A node marked at the first update carries its mark at the last."""
    wl = rw.mlp(LAYERS)
    plan = straight_plan(wl.num_layers, [0], global_batch_size=B * 4, num_micro_batches=4)
    marks: list[list[Any]] = []

    def on_update(step: int, module: torch.nn.Module, held: Any) -> None:
        with torch.enable_grad():
            nodes = [p.view_as(p).grad_fn.next_functions[0][0] for p in module.parameters()]
        marks.append([n.metadata.setdefault("first step", step) for n in nodes])

    run_plan(plan, wl, _config(), device=torch.device("cpu"), on_update=on_update)
    assert len(marks) == WARMUP + 2 and len(marks[0]) == N_GRADS
    assert marks[-1] == [0] * N_GRADS, marks[-1]

"""Expert parallelism (``StagePlan.expert_width``) in the runtime: the route of the token
exchange, the cut MoE block against the whole one (members simulated by threads in one
process), what is refused before any compute, ``dapple verify`` of Hugging Face's Mixtral and
Qwen2-MoE under AdamW with EP 2 on 1:2:1 and EP 4 on 4:1 (uneven slices both), and checkpoints
that resume under another width (the shared scaffolding in ``ep_runs``)."""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import extra_models as em
from dapple import api
from dapple.core.plan import Plan, interleave, straight_plan
from dapple.errors import ValidationError
from dapple.runtime.parallel.expert import (
    ExpertGroups,
    ExpertShards,
    check_expert_run,
    shard_experts,
)
from dapple.runtime.parallel.expert.exchange import Route
from dapple.runtime.train_config import TrainConfig
from dapple.runtime.verify.run import WORKER_SETUP_ENV
from ep_runs import (
    CK_CUT,
    ResumeCase,
    append_row,
    plan_1_2_1,
    plan_4_1,
    run_and_check_resumes,
    verify_equal_to_one_device,
)

EP_DIR_ENV = "DAPPLE_TEST_EP_DIR"
"""Where :func:`record_shards` writes each verify worker's expert shards."""


class ThreadCollectives:
    """An expert group's collectives among threads of one process (one thread per member)."""

    def __init__(self, shared: dict[str, Any], size: int, index: int) -> None:
        self.shared, self.size, self.index = shared, size, index

    def _swap(self, item: Any) -> list[Any]:
        self.shared["slots"][self.index] = item
        self.shared["barrier"].wait()
        got = list(self.shared["slots"])
        self.shared["barrier"].wait()
        return got

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack([x.clone() for x in self._swap(t)])

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        got = self._swap(list(torch.split(x, send)))
        out = torch.cat([got[p][self.index] for p in range(self.size)])
        assert out.shape[0] == sum(recv)
        return out


# -- the route ------------------------------------------------------------------------------


def test_route_sends_runs_by_owner_and_orders_received_rows_by_local_expert() -> None:
    table = torch.tensor([[1, 2, 0, 3], [2, 0, 1, 1]])  # rows per expert of members 0 and 1
    r0, r1 = Route(table, 0), Route(table, 1)
    assert (r0.send, r0.recv, r1.send, r1.recv) == ([3, 3], [3, 2], [2, 2], [3, 2])
    # member 0 receives [e0 from 0 | e1 from 0, 0 | e0 from 1, 1]: expert 0's rows, then 1's
    assert r0.order.tolist() == [0, 3, 4, 1, 2] and r0.local_offs.tolist() == [3, 5]
    # member 1 receives [e3 from 0 x3 | e2 from 1 | e3 from 1]
    assert r1.order.tolist() == [3, 0, 1, 2, 4] and r1.local_offs.tolist() == [1, 5]


@pytest.mark.parametrize("e", [1, 2, 4])
def test_route_order_equals_a_loop_over_local_experts_and_sources(e: int) -> None:
    g = torch.Generator().manual_seed(e)
    for _ in range(20):
        E = e * int(torch.randint(1, 4, (1,), generator=g))
        table = torch.randint(0, 4, (e, E), generator=g)
        for me in range(e):
            r, n = Route(table, me), E // e
            got = table[:, me * n : (me + 1) * n]  # [source p, local expert k]
            start = torch.cumsum(got.reshape(-1), 0) - got.reshape(-1)
            want = [int(start[p * n + k]) + i for k in range(n) for p in range(e)
                    for i in range(int(got[p, k]))]  # fmt: skip
            assert r.order.tolist() == want
            assert r.local_offs.tolist() == torch.cumsum(got.sum(0), 0).tolist()
            assert sum(r.send) == int(table[me].sum()) and r.recv == got.sum(1).tolist()


# -- the cut block against the whole one ----------------------------------------------------


def _cut_stage(factory: str, sizes: list[int]) -> None:
    """Stage [1, 2) (one MoE block) of ``factory`` cut over len(sizes) thread members, each
    running ``sizes[q]`` samples: outputs, input gradients and parameter gradients (expert
    shards concatenated, the rest summed) equal the whole stage's on all the samples."""
    wl = getattr(em, factory)()
    inputs, _ = wl.make_batch(sum(sizes), 0)
    hidden = tuple(t.detach() for t in wl.build_stage(0, 1, 0)(inputs))
    whole = wl.build_stage(1, 2, 0)
    x = hidden[0].clone().requires_grad_(True)
    out = whole((x, *hidden[1:]))[-1]
    gy = torch.randn_like(out)
    out.backward(gy)
    e = len(sizes)
    plan = straight_plan(4, [0, 1, 2], global_batch_size=sum(sizes), num_micro_batches=1,
                         replicas=[1, e, 1])  # fmt: skip
    plan = replace(plan, stages=(plan.stages[0], replace(plan.stages[1], expert_width=e,
                                 shares=tuple(sizes)), plan.stages[2]))  # fmt: skip
    shared: dict[str, Any] = {"slots": [None] * e, "barrier": threading.Barrier(e)}
    members, cuts = [], []
    for q in range(e):
        module = copy.deepcopy(whole)
        module.zero_grad()
        groups = ExpertGroups(group={(1, 0): None})
        ep = shard_experts(plan, plan.stages[1].devices[q], module, groups)
        assert ep is not None and len(ep.names) == 2
        ep.coll = ThreadCollectives(shared, e, q)  # type: ignore[assignment]
        for child in module.children():  # the exchange modules hold the group's collectives
            for sub in child.modules():
                if hasattr(sub, "coll"):
                    sub.coll = ep.coll
        members.append(module)
        cuts.append(ep)
    results: list[Any] = [None] * e

    def run(q: int) -> None:
        lo, hi = sum(sizes[:q]), sum(sizes[: q + 1])
        xq = hidden[0][lo:hi].clone().requires_grad_(True)
        y = members[q]((xq, *(t[lo:hi] for t in hidden[1:])))[-1]
        y.backward(gy[lo:hi])
        results[q] = (y.detach(), xq.grad)

    threads = [threading.Thread(target=run, args=(q,)) for q in range(e)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat([r[0] for r in results]), out.detach())
    torch.testing.assert_close(torch.cat([r[1] for r in results]), x.grad)
    for name, p in whole.named_parameters():
        parts = [dict(m.named_parameters())[name].grad for m in members]
        got = torch.cat(parts) if name in cuts[0].names else sum(parts)
        assert parts[0] is not None and (name not in cuts[0].names or parts[0].shape[0] == 4 // e)
        torch.testing.assert_close(got, p.grad, msg=name)


@pytest.mark.parametrize("factory", ["mixtral", "qwen2_moe"])
def test_the_cut_moe_block_computes_what_the_whole_block_does(factory: str) -> None:
    pytest.importorskip("transformers")
    _cut_stage(factory, [1, 3])


class _Experts(nn.Module):
    """Two grouped matmuls around a gated activation, as a site; ``between`` and ``leak`` make
    it one expert parallelism must refuse."""

    def __init__(self, between: bool = False, leak: bool = False, reuse: bool = False) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(4, 6, 8))
        self.down = nn.Parameter(torch.randn(4, 3, 6))
        self.between, self.leak, self.reuse = between, leak, reuse

    def forward(self, x: torch.Tensor, offs: torch.Tensor, other: torch.Tensor) -> Any:
        mm = torch.ops.transformers.grouped_mm_fallback
        gate, up = torch.chunk(mm(x, self.up.transpose(-2, -1), offs), 2, -1)
        h = torch.nn.functional.silu(gate) * up
        if self.between:
            h = torch.cumsum(h, 0)  # mixes rows: not row-wise
        y = mm(h, self.down.transpose(-2, -1), offs)
        if self.reuse:  # the weight in another site too
            y = y + mm(y, self.down.transpose(-2, -1).transpose(-2, -1), other)
        return (y, offs + 1) if self.leak else y


def test_a_site_is_two_matmuls_on_one_offsets_node_with_row_wise_ops_between() -> None:
    pytest.importorskip("transformers.integrations.moe")
    from torch import fx

    from dapple.runtime.parallel.expert.sites import find_sites

    (site,) = find_sites(fx.symbolic_trace(_Experts()))
    assert site.weights == ("up", "down") and len(site.matmuls) == 2
    with pytest.raises(ValidationError, match=r"cumsum.* between its grouped matmuls is not row"):
        find_sites(fx.symbolic_trace(_Experts(between=True)))
    with pytest.raises(ValidationError, match="its expert offsets are also used by"):
        find_sites(fx.symbolic_trace(_Experts(leak=True)))
    with pytest.raises(ValidationError, match="weight down has other uses than its matmuls"):
        find_sites(fx.symbolic_trace(_Experts(reuse=True)))


def test_whole_gathers_the_shards_and_norm_counts_each_once() -> None:
    e = 2
    shared: dict[str, Any] = {"slots": [None] * e, "barrier": threading.Barrier(e)}
    full = torch.arange(24.0).view(4, 3, 2)
    dense = nn.Parameter(torch.ones(3))
    got: list[Any] = [None] * e

    def run(q: int) -> None:
        shard = nn.Parameter(full[2 * q : 2 * q + 2].clone())
        module = nn.Module()
        module.register_parameter("w", shard)
        module.register_parameter("d", dense)
        ep = ExpertShards(ThreadCollectives(shared, e, q), None, ("w",), [shard], q < e)  # type: ignore[arg-type]
        got[q] = (ep.whole({"w": shard.detach(), "d": dense.detach()}),
                  ep.norm_counted(module, q))  # fmt: skip

    threads = [threading.Thread(target=run, args=(q,)) for q in range(e)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for whole, _ in got:
        assert torch.equal(whole["w"], full) and torch.equal(whole["d"], dense.detach())
    counted0, counted1 = got[0][1], got[1][1]
    assert [tuple(p.shape) for p in counted0] == [(3,), (2, 3, 2)]  # replica 0: dense + shard
    assert [tuple(p.shape) for p in counted1] == [(2, 3, 2)]  # replica 1: its shard only


# -- refused before any compute -------------------------------------------------------------


@pytest.mark.parametrize(
    ("plan", "config", "words"),
    [
        (lambda: plan_1_2_1(zero_stage=3), {}, "zero_stage 3: EP with ZeRO-3"),
        (lambda: plan_1_2_1(), {"zero_stage": 3}, "zero_stage 3: EP with ZeRO-3"),
        (lambda: plan_1_2_1(), {"precision": "fp16"}, "precision fp16"),
    ],
)
def test_what_expert_parallelism_does_not_run_is_refused(
    plan: Any, config: dict[str, Any], words: str
) -> None:
    from dapple.runtime.parallel.stage_mesh import zero_floored

    cfg = TrainConfig(**config)
    with pytest.raises(ValidationError, match=f"stage 1 \\[1, 3\\] \\(expert_width 2\\).*{words}"):
        check_expert_run(zero_floored(plan(), cfg.zero_stage), cfg)


def test_tensor_parallel_and_interleaved_expert_stages_are_refused() -> None:
    tp = straight_plan(4, [0, 1, 3], global_batch_size=4, num_micro_batches=2,
                       replicas=[1, 4, 1])  # fmt: skip
    mid = replace(tp.stages[1], tensor_width=2, expert_width=2)
    with pytest.raises(ValidationError, match="tensor_width 2: EP with TP"):
        check_expert_run(replace(tp, stages=(tp.stages[0], mid, tp.stages[2])), TrainConfig())
    two = interleave(straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2,
                                   replicas=[2, 1]), 2)  # fmt: skip
    ep = tuple(replace(st, expert_width=st.replicas) for st in two.stages)
    with pytest.raises(ValidationError, match=r"stage 0 \[0, 1\].*an interleaved plan"):
        check_expert_run(replace(two, stages=ep), TrainConfig())
    check_expert_run(plan_1_2_1(), TrainConfig())  # what runs is not refused
    for z in (1, 2):  # ZeRO-1/2 runs at e_s = r_s and below it (test_expert_zero)
        check_expert_run(plan_1_2_1(zero_stage=z), TrainConfig())
        below = replace(tp, stages=(tp.stages[0], replace(tp.stages[1], expert_width=2,
                                                           zero_stage=z), tp.stages[2]))  # fmt: skip
        check_expert_run(below, TrainConfig())


def test_verify_refuses_an_expert_plan_it_cannot_run_before_starting_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dapple.runtime.verify as verify_mod

    def no_workers(*_: Any, **__: Any) -> None:
        raise AssertionError("workers started")

    monkeypatch.setattr(verify_mod, "verify_many", no_workers)
    with pytest.raises(ValidationError, match=r"\(expert_width 2\).*zero_stage 3: EP with ZeRO"):
        api.verify_many([(plan_1_2_1(), em.moe_lm())], 1, device="cpu", zero_stage=3)


@pytest.mark.parametrize("command", ["train", "verify"])
def test_an_expert_width_on_a_dense_model_is_refused_once_before_any_worker_starts(
    monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    pytest.importorskip("transformers")
    import dapple.runtime as runtime_mod
    import dapple.runtime.verify as verify_mod

    def no_workers(*_: Any, **__: Any) -> None:
        raise AssertionError("workers started")

    monkeypatch.setattr(verify_mod, "verify_many", no_workers)
    monkeypatch.setattr(runtime_mod, "train", no_workers)
    plan = plan_1_2_1()
    words = (r"^plan stage 1 \[1, 3\] \(expert_width 2\): model 'varlen-llama' has no "
             r"mixture-of-experts layers there")  # fmt: skip
    with pytest.raises(ValidationError, match=words):
        if command == "train":
            api.train(plan, em.varlen_llama(), 1, device="cpu")
        else:
            api.verify_many([(plan, em.varlen_llama())], 1, device="cpu")


def _plan_1_3_1() -> Plan:
    """Layers prologue | 2 MoE blocks | epilogue on 1:3:1, the middle stage at EP 3."""
    plan = straight_plan(4, [0, 1, 3], global_batch_size=6, num_micro_batches=2,
                         replicas=[1, 3, 1])  # fmt: skip
    mid = replace(plan.stages[1], expert_width=3)
    return replace(plan, stages=(plan.stages[0], mid, plan.stages[2]))


def test_experts_not_a_multiple_of_the_width_are_refused_before_any_worker_starts() -> None:
    pytest.importorskip("transformers")
    from dapple.runtime.parallel.expert import check_expert_layers

    three = _plan_1_3_1()
    with pytest.raises(
        ValidationError,
        match=r"stage 1 \[1, 3\] \(expert_width 3\): model "
        r"'mixtral''s MoE layers there hold 4 experts, not a multiple of 3",
    ):
        check_expert_layers(three, em.mixtral())
    check_expert_layers(plan_1_2_1(), em.mixtral())  # 4 experts over 2: not refused
    with pytest.raises(ValidationError, match="model 'moe-lm' has no mixture-of-experts layers"):
        check_expert_layers(plan_1_2_1(), em.moe_lm())  # its experts: no grouped matmuls


def test_a_stage_without_experts_or_with_experts_not_dividing_is_refused() -> None:
    pytest.importorskip("transformers")
    dense = em.varlen_llama().build_stage(1, 3, 0)
    with pytest.raises(ValidationError, match=r"stage 1 \[1, 3\]: expert_width 2, but its layers"):
        shard_experts(plan_1_2_1(), 1, dense, ExpertGroups(group={(1, 0): None}))
    three = _plan_1_3_1()
    moe = em.mixtral().build_stage(1, 3, 0)
    with pytest.raises(ValidationError, match="holds 4 experts, not a multiple of expert_width 3"):
        shard_experts(three, 1, moe, ExpertGroups(group={(1, 0): None}))


# -- dapple verify ----------------------------------------------------------------------------


def record_shards(rank: int) -> None:
    """Verify worker setup hook: append the expert shards the rank's stage holds in each run
    (names and shapes) as a line to ``$DAPPLE_TEST_EP_DIR/rank<r>.jsonl``."""
    import dapple.runtime.rank as rank_mod

    cut = rank_mod.shard_experts

    def recorded(plan: Plan, r: int, module: Any, groups: ExpertGroups) -> ExpertShards | None:
        ep = cut(plan, r, module, groups)
        if ep is not None:
            shapes = {n: list(p.shape) for n, p in zip(ep.names, ep.params, strict=True)}
            append_row(EP_DIR_ENV, r, shapes)
        return ep

    rank_mod.shard_experts = recorded


@pytest.mark.slow
def test_verify_mixtral_and_qwen2_moe_with_ep_2_under_adamw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One launch, three runs of 3 AdamW steps, each equal to one device's: Mixtral and
    Qwen2-MoE (the latter under ZB-H1's split backward) on 1:2:1, the middle stage's 2 replicas
    (slices of 2 and 1 samples) holding 2 of the 4 experts of both MoE blocks each; and Mixtral
    on 4:1 with EP 2 and re-computation (two expert groups: each shard summed over 2 replicas;
    slices of 2, 1, 1, 1)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv(WORKER_SETUP_ENV, "test_expert_parallel:record_shards")
    monkeypatch.setenv(EP_DIR_ENV, str(tmp_path))
    verify_equal_to_one_device(
        [(plan_1_2_1(), "mixtral"), (replace(plan_1_2_1(), schedule="zbh1"), "qwen2_moe"),
         (plan_4_1(2, recompute="full"), "mixtral")], 600,
    )  # fmt: skip
    runs = {int(p.stem[4:]): p.read_text().splitlines() for p in tmp_path.glob("rank*.jsonl")}
    assert {r: len(lines) for r, lines in runs.items()} == {0: 1, 1: 3, 2: 3, 3: 1}
    for lines in runs.values():  # every run: 2 of the 4 experts of both blocks' 2 weights
        for shapes in map(json.loads, lines):
            assert len(shapes) == 4 and all(s[0] == 2 for s in shapes.values()), shapes


@pytest.mark.slow
def test_verify_mixtral_and_qwen2_moe_with_ep_4_on_an_uneven_plan_under_adamw(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One launch, two runs of 3 AdamW steps on 4:1 (stage 0's slices 2, 1, 1, 1) with EP 4 on
    stage 0, each equal to one device's: Mixtral and Qwen2-MoE (its shared expert replicated),
    each of the 4 replicas holding 1 of the 4 experts of both MoE blocks."""
    pytest.importorskip("transformers")
    monkeypatch.setenv(WORKER_SETUP_ENV, "test_expert_parallel:record_shards")
    monkeypatch.setenv(EP_DIR_ENV, str(tmp_path))
    verify_equal_to_one_device([(plan_4_1(4), "mixtral"), (plan_4_1(4), "qwen2_moe")], 900)
    runs = {int(p.stem[4:]): p.read_text().splitlines() for p in tmp_path.glob("rank*.jsonl")}
    assert {r: len(lines) for r, lines in runs.items()} == {0: 2, 1: 2, 2: 2, 3: 2}
    for lines in runs.values():  # every run: 1 of the 4 experts of both blocks' 2 weights
        for shapes in map(json.loads, lines):
            assert len(shapes) == 4 and all(s[0] == 1 for s in shapes.values()), shapes


# -- checkpoints --------------------------------------------------------------------------------

RESUMES = ResumeCase(
    {"plain": plan_1_2_1(1), "ep": plan_1_2_1(2)},
    ("plain", "ep"),
    (("ep", "plain"), ("plain", "ep")),
    eval_every=CK_CUT,
)
"""Mixtral on 1:2:1 with and without EP 2, evaluating every CK_CUT steps, then each one's
checkpoint resumed under the other."""


@pytest.mark.slow
def test_checkpoints_of_an_expert_sharded_stage_are_whole_and_resume_across_widths(
    tmp_path: Path,
) -> None:
    """The EP run's checkpoints hold what the unsharded run's do (whole ``[4, ...]`` experts and
    their AdamW moments, within rounding), and so do its evaluation losses; each run's step-2
    checkpoint resumed under the other width ends where the uninterrupted runs do."""
    pytest.importorskip("transformers")
    losses, want = run_and_check_resumes(tmp_path, RESUMES, 4)
    experts = [k for k in want if k.endswith(("experts.gate_up_proj", "gate_up_proj/exp_avg"))]
    assert experts and all(want[k].shape[0] == 4 for k in experts), experts
    evals = losses["eval-u-plain"]
    assert [x is not None for x in evals] == [False, True, False, True]
    got = losses["eval-u-ep"]
    assert [x is not None for x in got] == [False, True, False, True]
    assert [got[1], got[3]] == pytest.approx([evals[1], evals[3]], rel=1e-5)

"""Unequal per-replica shares of a micro-batch (issue #43, the runtime's part).

Pure tiers first: the split-concat arithmetic under shares (golden cases and a property against
brute force), the plan's checks and JSON, interleaving, the eval plan, a rank's rows, the
lowered schedule's peers, the simulator and the layout picture, the balanced shares of replicas
of different speeds (against brute force) and the emulated slow-down. Then multi-process runs
(marked slow): ``verify`` of plans whose replicas take 3:1 and 1:3 of a micro-batch against one
process under AdamW, for every schedule and with ZeRO-1/2, once reading a token file; and a
checkpoint saved under one set of shares resumed under another."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import runtime_workloads as rw
from dapple import api
from dapple.core.plan import Plan, StagePlan, interleave, straight_plan
from dapple.core.slicing import proportional_shares, slice_bounds, split_sizes, transfers
from dapple.errors import ValidationError
from dapple.runtime.data import rank_rows
from dapple.runtime.evaluate import eval_plan
from dapple.schedule.lower import lower
from dapple.schedule.validate import validate


def shared(plan: Plan, *shares: tuple[int, ...] | None) -> Plan:
    """``plan`` with stage s's replicas taking ``shares[s]`` of each micro-batch."""
    stages = tuple(
        dataclasses.replace(s, shares=sh) for s, sh in zip(plan.stages, shares, strict=True)
    )
    return dataclasses.replace(plan, stages=stages)


def plan_31(**kw: object) -> Plan:
    """Stage 0 on 2 replicas taking 3:1 of b = 4, stage 1 on one device (8 samples, M = 2)."""
    base = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2, replicas=[2, 1])
    return dataclasses.replace(shared(base, (3, 1), None), **kw)


def plan_13_31() -> Plan:
    """2 replicas taking 1:3, then 2 taking 3:1: every source slice splits unequally."""
    base = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2, replicas=[2, 2])
    return shared(base, (1, 3), (3, 1))


# -- split-concat arithmetic --------------------------------------------------------------------
def test_slices_and_transfers_follow_the_shares() -> None:
    assert split_sizes(4, 2, (3, 1)) == (3, 1)
    assert slice_bounds(4, 2, (3, 1)) == ((0, 3), (3, 4))
    assert slice_bounds(4, 2) == ((0, 2), (2, 4))  # no shares: the even split, as before
    assert transfers(4, 2, 1, (3, 1)) == ((0, 0, 0, 3), (1, 0, 3, 4))
    assert transfers(4, 2, 2, (1, 3), (3, 1)) == ((0, 0, 0, 1), (1, 0, 1, 3), (1, 1, 3, 4))
    assert transfers(4, 2, 2, (3, 1)) == ((0, 0, 0, 2), (0, 1, 2, 3), (1, 1, 3, 4))


@settings(deadline=None)  # no timing: the machine is shared
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=4),
    st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
def test_transfers_cover_every_sample_once_inside_both_slices(a: list[int], c: list[int]) -> None:
    b = sum(a)
    dst = proportional_shares(c, b) if b >= len(c) else None
    r_dst = len(c) if dst is not None else 1
    src_b, dst_b = slice_bounds(b, len(a), a), slice_bounds(b, r_dst, dst)
    seen = []
    for j, k, lo, hi in transfers(b, len(a), r_dst, a, dst):
        assert src_b[j][0] <= lo < hi <= src_b[j][1] and dst_b[k][0] <= lo < hi <= dst_b[k][1]
        seen += range(lo, hi)
    assert sorted(seen) == list(range(b))
    brute = {(j, k) for j in range(len(a)) for k in range(r_dst)
             if set(range(*src_b[j])) & set(range(*dst_b[k]))}  # fmt: skip
    assert {(j, k) for j, k, _, _ in transfers(b, len(a), r_dst, a, dst)} == brute


@pytest.mark.parametrize(
    ("weights", "b", "want"),
    [([3, 1], 4, (3, 1)), ([3, 1], 8, (6, 2)), ([10, 1], 11, (10, 1)), ([1, 1, 1], 7, (3, 2, 2)),
     ([100, 1, 1], 3, (1, 1, 1)), ([1.0, 2.5], 7, (2, 5)), ([100, 1], 4, (3, 1))],
)  # fmt: skip
def test_proportional_shares(weights: list[float], b: int, want: tuple[int, ...]) -> None:
    assert proportional_shares(weights, b) == want


@settings(deadline=None)  # no timing: the machine is shared
@given(st.lists(st.floats(0.01, 100), min_size=1, max_size=6), st.integers(0, 40))
def test_proportional_shares_are_whole_positive_and_sum_to_b(w: list[float], extra: int) -> None:
    b = len(w) + extra
    got = proportional_shares(w, b)
    assert sum(got) == b and min(got) >= 1 and len(got) == len(w)
    ideal = [b * x / sum(w) for x in w]
    assert all(n <= max(1, q + 1) for n, q in zip(got, ideal, strict=True))  # never past a rounding


@pytest.mark.parametrize(
    ("weights", "b", "needle"),
    [([], 3, "finite weights > 0"), ([1, 0], 3, "finite weights > 0"),
     ([1, float("inf")], 3, "finite weights > 0"), ([1, 1, 1], 2, "2 samples cannot give each of 3")],
)  # fmt: skip
def test_proportional_shares_refusals(weights: list[float], b: int, needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        proportional_shares(weights, b)


# -- the plan -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shares", "needle"),
    [((3, 1, 1), r"stage \[0, 2\]: shares \[3, 1, 1\] name 3 replicas, the stage has 2"),
     ((4, 0), r"stage \[0, 2\]: shares \[4, 0\] must be whole samples >= 1 each"),
     ((2.5, 1.5), r"shares \[2.5, 1.5\] must be whole samples"),
     ((True, 3), r"shares \[True, 3\] must be whole samples"),
     ((3, 2), r"plan: stage 0 shares \[3, 2\] sum to 5, not the micro-batch size 4")],
)  # fmt: skip
def test_bad_shares_are_one_line_naming_the_values(shares: tuple[int, ...], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle) as e:
        shared(plan_31(), shares, None)
    assert "\n" not in str(e.value)


def test_shares_round_trip_through_the_plan_file_only_when_uneven(tmp_path: Path) -> None:
    p = plan_31()
    d = p.to_dict()
    assert d["stages"][0]["shares"] == [3, 1] and "shares" not in d["stages"][1]
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == p
    even = shared(p, (2, 2), None)  # the even split, spelled out: not written
    assert "shares" not in json.dumps(even.to_dict())
    assert Plan.from_dict(even.to_dict()).stages[0].shares is None
    base = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2, replicas=[2, 1])
    assert "shares" not in json.dumps(base.to_dict())  # plans without shares: files unchanged
    assert shared(p, [1, 3], None).stages[0].shares == (1, 3)  # a list is kept as a tuple


def test_plan_file_with_bad_shares_names_the_stage(tmp_path: Path) -> None:
    d = plan_31().to_dict()
    d["stages"][0]["shares"] = "3:1"
    with pytest.raises(ValidationError, match="plan stage 0: shares must be a list"):
        Plan.from_dict(d)
    d["stages"][0]["shares"] = [2, 1]
    with pytest.raises(ValidationError, match=r"stage 0 shares \[2, 1\] sum to 3, not .* 4"):
        Plan.from_dict(d)


def test_interleaving_keeps_the_shares_and_chunks_of_a_group_agree() -> None:
    p = interleave(plan_31(), 2)
    assert [s.shares for s in p.stages] == [(3, 1), None, (3, 1), None]
    stages = list(p.stages)
    stages[2] = dataclasses.replace(stages[2], shares=(1, 3))
    with pytest.raises(ValidationError, match=r"stage 2 shares \(1, 3\) differ from those of "
                       r"stage 0 \(3, 1\) on the same devices \[0, 1\]"):  # fmt: skip
        dataclasses.replace(p, stages=tuple(stages))


def test_eval_plan_scales_the_shares_to_its_micro_batch() -> None:
    p = eval_plan(plan_31(), 16)  # M_e = 2: b_e = 8
    assert (p.micro_batch_size, p.stages[0].shares, p.stages[1].shares) == (8, (6, 2), None)
    p = eval_plan(plan_31(), 4)  # b_e = 2: one sample each
    assert (p.micro_batch_size, p.stages[0].shares) == (2, (1, 1))


def test_rank_rows_follow_the_shares() -> None:
    p = plan_31()
    assert rank_rows(p, 0) == ([0, 1, 2, 4, 5, 6], [])
    assert rank_rows(p, 1) == ([3, 7], [])
    assert rank_rows(p, 2) == ([], list(range(8)))


@pytest.mark.parametrize("schedule", ["gpipe", "dapple", "zbh1", "interleaved"])
def test_lowered_peers_follow_the_shares(schedule: str) -> None:
    p = plan_13_31()
    p = interleave(p, 2) if schedule == "interleaved" else dataclasses.replace(p, schedule=schedule)
    sched = lower(p)
    validate(sched, p)
    sends = {(a.replica, a.peer) for a in sched[1] if a.kind.name == "SEND_F" and a.stage == 0}
    assert sends == {(1, 0), (1, 1)}  # replica 1's rows [1, 4) go to both; replica 0's only to 0
    assert {a.peer for a in sched[0] if a.kind.name == "SEND_F" and a.stage == 0} == {0}


# -- multi-process ------------------------------------------------------------------------------
ADAMW = dict(optimizer="adamw", lr=0.02, weight_decay=0.1)


def _zero(p: Plan, z: int) -> Plan:
    return dataclasses.replace(
        p, stages=tuple(dataclasses.replace(s, zero_stage=z if s.replicas > 1 else 0)
                        for s in p.stages)
    )  # fmt: skip


def _schedules(p: Plan) -> list[Plan]:
    return [dataclasses.replace(p, schedule=s) for s in ("gpipe", "dapple", "zbh1")] + [
        interleave(p, 2)
    ]


@pytest.mark.slow
def test_verify_unequal_shares_equals_one_device_under_every_schedule_and_zero() -> None:
    """3:1 next to one replica, and 1:3 into 3:1, under gpipe, dapple, ZB-H1 and interleaved:
    after 3 AdamW steps every parameter and each step's loss equal one process's, unsharded and
    under ZeRO-1/2."""
    wl = api.load("runtime_workloads:mlp")
    plans = _schedules(plan_31()) + _schedules(_zero(plan_13_31(), 1))
    plans += [_zero(plan_31(), 2), _zero(interleave(plan_13_31(), 2), 2)]
    reports = api.verify_many([(p, wl) for p in plans], 3, device="cpu", **ADAMW)
    for rep in reports:
        what = (rep.plan.schedule, rep.plan.replication, [s.shares for s in rep.plan.stages],
                [s.zero_stage for s in rep.plan.stages])  # fmt: skip
        assert any(s.shares for s in rep.plan.stages), what
        assert rep.ok, (what, rep.max_abs_diff)
        assert rep.grad_norms_ok, (what, rep.grad_norms, rep.reference_grad_norms)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), what


STEPS, CUT = 4, 2


def resume_worker(rank: int, world: int, out_dir: str) -> None:
    """Save at step CUT under 3:1, resume under 1:3 with ZeRO-1 to STEPS: every parameter equals
    one process's run of STEPS steps."""
    from dapple.runtime import TrainConfig, init_distributed, run_plan
    from dapple.runtime.verify import reference_run

    device = init_distributed(TrainConfig(timeout_s=60), world)
    wl = rw.mlp()
    base = dict(seed=3, timeout_s=60, **ADAMW)
    ck = str(Path(out_dir) / "ck")
    first, other = plan_31(), _zero(shared(plan_31(), (1, 3), None), 1)
    run_plan(first, wl, TrainConfig(steps=CUT, checkpoint_dir=ck, save_every=CUT, **base),
             device=device, exact_world=False)  # fmt: skip
    again = run_plan(other, wl, TrainConfig(steps=STEPS, checkpoint_dir=ck, resume=True, **base),
                     device=device, exact_world=False)  # fmt: skip
    ref_losses, ref_params, _ = reference_run(wl, 8, STEPS, seed=3, **ADAMW)
    n = 0
    if again.module is not None:
        lo = other.stages[again.stage].layers[0]
        for k, layer in enumerate(again.module.children()):
            for name, p in layer.named_parameters():
                torch.testing.assert_close(p.detach(), ref_params[lo + k][name])
                n += 1
    losses = [m.loss for m in again.metrics] if rank == 0 else []
    row = {"checked": n, "losses": losses, "ref": ref_losses[CUT:]}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(row))


@pytest.mark.slow
def test_checkpoint_saved_under_3_1_resumes_under_1_3_with_zero1(tmp_path: Path) -> None:
    from dapple.runtime import spawn

    spawn(resume_worker, 3, str(tmp_path), timeout_s=180)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    assert [r["checked"] for r in rows] == [4, 4, 4]  # two Linear layers of 2 tensors each
    assert rows[0]["losses"] == pytest.approx(rows[0]["ref"], rel=1e-5)


def test_simulate_draws_and_times_a_plan_with_shares(tmp_path: Path) -> None:
    from dapple.cli import main
    from dapple.profiler.analytic import analytic_profile
    from dapple.simulate.layout import stage_label

    prof = tmp_path / "p.json"
    analytic_profile("llama3-8b", "h100").save(prof)
    n = 34  # embedding, 32 blocks, head
    plan = tmp_path / "plan.json"
    Plan(
        planner="test", global_batch_size=8, micro_batch_size=4, num_micro_batches=2,
        stages=(StagePlan(layers=(0, 17), devices=(0, 1), shares=(3, 1)),
                StagePlan(layers=(17, n), devices=(2,))),
    ).save(plan)  # fmt: skip
    assert json.loads(plan.read_text())["stages"][0]["shares"] == [3, 1]
    out = tmp_path / "layout.svg"
    args = ["--profile", str(prof), "--cluster", "h100-8x", "--servers", "1"]
    assert main(["simulate", "--plan", str(plan), *args, "--layout", str(out)]) == 0
    svg = out.read_text()
    assert "stage 0: layers 0-16, 2 x 1 devices, shares 3:1" in svg
    st = Plan.load(plan).stages[0]
    assert stage_label(0, dataclasses.replace(st, zero_stage=1)).endswith("shares 3:1, ZeRO-1")


# -- replicas of different speeds (pure cost functions) -----------------------------------------
def _compositions(b: int, r: int) -> list[tuple[int, ...]]:
    """Every way of giving ``r`` replicas >= 1 sample each out of ``b``."""
    if r == 1:
        return [(b,)]
    return [(n, *rest) for n in range(1, b - r + 2) for rest in _compositions(b - n, r - 1)]


@settings(deadline=None)  # no timing: the machine is shared
@given(
    st.lists(st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]), min_size=1, max_size=3),
    st.integers(0, 6),
    st.floats(0.0, 5.0),
    st.floats(0.1, 3.0),
)
def test_balanced_shares_minimise_the_slowest_replica_like_brute_force(
    speeds: list[float], extra: int, fixed_ms: float, per_sample_ms: float
) -> None:
    from dapple.cost.replica_shares import balanced_shares, slowest_replica_ms

    b = len(speeds) + extra

    def ms(n: int) -> float:
        return fixed_ms + per_sample_ms * n

    got = balanced_shares(b, speeds, ms)
    assert sum(got) == b and min(got) >= 1
    best = min(slowest_replica_ms(c, speeds, ms) for c in _compositions(b, len(speeds)))
    assert slowest_replica_ms(got, speeds, ms) == pytest.approx(best)


def test_slowest_replica_sets_the_stage_time_and_bad_speeds_are_named() -> None:
    from dapple.cost.replica_shares import balanced_shares, slowest_replica_ms

    def ms(n: int) -> float:
        return 10.0 * n

    assert slowest_replica_ms((3, 1), (3.0, 1.0), ms) == 10.0
    assert slowest_replica_ms((2, 2), (3.0, 1.0), ms) == 20.0  # the even split waits on the slow
    assert balanced_shares(4, (3.0, 1.0), ms) == (3, 1)
    assert balanced_shares(8, (1.0, 1.0), ms) == (4, 4)
    with pytest.raises(
        ValidationError, match=r"replica speeds must be finite and > 0, got \[1.0, 0.0\]"
    ):
        slowest_replica_ms((2, 2), (1.0, 0.0), ms)
    with pytest.raises(ValidationError, match=r"3 shares \[1, 1, 2\] for 2 replica speeds"):
        slowest_replica_ms((1, 1, 2), (1.0, 1.0), ms)
    with pytest.raises(ValidationError, match="2 samples cannot give each of 3 replicas one"):
        balanced_shares(2, (1.0, 1.0, 1.0), ms)


def test_simulated_replicas_compute_their_shares() -> None:
    """On equal devices a 3:1 split waits on the 3-sample replica: slower than the even split,
    as slow whichever replica takes the 3 (and unequal split-concat across the cut works)."""
    from dapple.core.cluster_presets import load_cluster
    from dapple.cost.terms import stage_terms
    from dapple.profiler.analytic import analytic_profile
    from dapple.simulate import simulate

    prof, cluster = analytic_profile("llama3-8b", "h100"), load_cluster("h100-8x", 1)

    def two_by_two(a: tuple[int, ...] | None, c: tuple[int, ...] | None) -> Plan:
        return Plan(
            planner="test", global_batch_size=8, micro_batch_size=4, num_micro_batches=2,
            stages=(StagePlan(layers=(0, 17), devices=(0, 1), shares=a),
                    StagePlan(layers=(17, 34), devices=(2, 3), shares=c)),
        )  # fmt: skip

    even = simulate(two_by_two(None, None), prof, cluster).step_ms
    assert simulate(two_by_two((2, 2), (2, 2)), prof, cluster).step_ms == even
    cross = simulate(two_by_two((1, 3), (3, 1)), prof, cluster).step_ms
    same = simulate(two_by_two((3, 1), (3, 1)), prof, cluster).step_ms
    assert cross > 1.3 * even and same == pytest.approx(cross, rel=0.01)
    terms = stage_terms(two_by_two((1, 3), None), prof, cluster).stages[0]
    assert [r.samples for r in terms.replicas] == [1, 3]
    assert terms.terms.forward_ms == terms.replicas[1].forward_ms > terms.replicas[0].forward_ms


# -- an emulated slower device (DAPPLE_SLOWDOWN) ------------------------------------------------
def test_slowdown_factor_reads_rank_k_pairs_and_names_a_bad_item() -> None:
    from dapple.runtime.slowdown import slowdown_factor

    assert slowdown_factor(1, "1:3, 2:1.5") == 3.0
    assert slowdown_factor(2, "1:3, 2:1.5") == 1.5
    assert slowdown_factor(0, "1:3") == 1.0 and slowdown_factor(0, "") == 1.0
    for bad in ("1", "1:0.5", "-1:2", "x:2", "1:inf", "1:3,2"):
        with pytest.raises(ValidationError, match=r"DAPPLE_SLOWDOWN=.* is not RANK:K") as e:
            slowdown_factor(0, bad)
        assert "\n" not in str(e.value)


def test_slowdown_sleeps_k_minus_1_times_the_block() -> None:
    from dapple.runtime.slowdown import Slowdown

    now, slept, synced = [10.0], [], []

    def work() -> None:
        now[0] += 0.25

    slow = Slowdown(3.0, sync=lambda: synced.append(now[0]), clock=lambda: now[0],
                    sleep=slept.append)  # fmt: skip
    with slow():
        work()
    assert slept == [0.5] and synced == [10.0, 10.25]
    slept.clear()
    with Slowdown(1.0, clock=lambda: now[0], sleep=slept.append)():
        work()
    assert slept == []


@pytest.mark.slow
def test_verify_with_a_token_file_reads_each_replicas_share_of_rows(tmp_path: Path) -> None:
    """Data from a token file: each rank reads only its rows (:func:`rank_rows`, by the
    shares), and the run still equals one process reading whole batches."""
    import numpy as np

    from dapple.datasets import TokenFile

    seq, vocab = 8, 64
    path = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, vocab, 24 * seq + 1).astype(np.uint16).tofile(path)
    wl = api.load("transformer", layers=2, hidden=16, heads=2, seq=seq, vocab=vocab)
    plan = plan_31()
    assert wl.num_layers == plan.num_layers
    rep = api.verify(plan, wl, 3, device="cpu", data=TokenFile(path, seq), **ADAMW)
    assert rep.ok, rep.max_abs_diff
    assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)

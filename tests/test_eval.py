"""Forward-only evaluation: the forward program's shape (pure), and multi-process gloo runs
whose eval loss equals the one-process model's mean loss over the same batches while training
stays bit for bit what it is without evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import eval_workers as ew
import runtime_workloads as rw
from dapple.core.plan import split_sizes, transfers
from dapple.errors import ValidationError
from dapple.runtime import TrainConfig, spawn
from dapple.runtime.evaluate import EVAL_SEED_BASE, Evaluation, eval_batch_fn, eval_plan
from dapple.schedule import ActionKind, format_actions, lower_forward

K = ActionKind


# -- the forward-only program (pure) ---------------------------------------------------------
def test_forward_program_golden_3_1() -> None:
    plan = rw.make_plan("3:1", "dapple", "A", False, 5, 2)
    got = {d: format_actions(p) for d, p in lower_forward(plan).items()}
    assert got == {
        0: "0F0 0.0SEND_F0@0 0F1 0.0SEND_F1@0",
        1: "0.1F0 0.1SEND_F0@0 0.1F1 0.1SEND_F1@0",
        2: "0.2F0 0.2SEND_F0@0 0.2F1 0.2SEND_F1@0",
        3: "1.0RECV_F0@0 1.0RECV_F0@1 1.0RECV_F0@2 1F0 1.0RECV_F1@0 1.0RECV_F1@1 1.0RECV_F1@2 1F1",
    }


@pytest.mark.parametrize("name", list(rw.PLANS))
@pytest.mark.parametrize(("b", "m"), [(5, 3), (2, 2), (1, 4)])
def test_forward_program_covers_every_micro_batch_and_pairs_sends(
    name: str, b: int, m: int
) -> None:
    plan = rw.make_plan(name, "gpipe", "A", False, b, m)
    sched = lower_forward(plan)
    assert set(sched) == set(plan.devices)
    sends, recvs = set(), set()
    for s, st in enumerate(plan.stages):
        for j, dev in enumerate(st.devices):
            prog = sched[dev]
            assert {a.kind for a in prog} <= {K.RECV_F, K.FORWARD, K.SEND_F}
            assert all((a.stage, a.replica) == (s, j) for a in prog)
            fs = [a.micro_batch for a in prog if a.kind is K.FORWARD]
            empty = split_sizes(b, st.replicas)[j] == 0
            assert fs == ([] if empty else list(range(m)))
            for i, a in enumerate(prog):  # receives before, sends after their F
                f_at = prog.index(next(x for x in prog if x.kind is K.FORWARD and
                                       x.micro_batch == a.micro_batch))  # fmt: skip
                if a.kind is K.RECV_F:
                    assert i < f_at
                    recvs.add((s - 1, a.peer, j, a.micro_batch))
                elif a.kind is K.SEND_F:
                    assert i > f_at
                    sends.add((s, j, a.peer, a.micro_batch))
    assert sends == recvs
    want = {
        (s, j, k, mb)
        for s in range(plan.num_stages - 1)
        for j, k, _, _ in transfers(b, plan.stages[s].replicas, plan.stages[s + 1].replicas)
        for mb in range(m)
    }
    assert sends == want


# -- eval batches and options (pure) ---------------------------------------------------------
def test_eval_batch_sources() -> None:
    wl = rw.mlp()
    x, y = eval_batch_fn(wl, 6, 2)(1)
    x_ref, y_ref = wl.make_batch(6, EVAL_SEED_BASE + 1)
    assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    samples = ew.eval_samples(12)
    x, y = eval_batch_fn(wl, 6, 2, samples)(1)
    assert torch.equal(x, torch.stack([s[0] for s in samples[6:]]))
    assert torch.equal(y, torch.stack([s[1] for s in samples[6:]]))
    assert eval_batch_fn(wl, 6, 2, ew.callable_batch) is ew.callable_batch
    with pytest.raises(ValidationError, match=r"holds 12 samples; 3 eval batches .* need 18"):
        eval_batch_fn(wl, 6, 3, samples)
    with pytest.raises(ValidationError, match="callable of global batches or a map-style"):
        eval_batch_fn(wl, 6, 3, 5)


def test_eval_plan_keeps_stages_and_picks_micro_batches() -> None:
    plan = rw.make_plan("3:1", "dapple", "A", False, ew.B, ew.M)  # G = 15, M = 3
    assert eval_plan(plan, None) is plan and eval_plan(plan, 15) is plan
    ev = eval_plan(plan, 12)  # M_e = 3 would give 4 >= 3 replicas
    assert (ev.global_batch_size, ev.num_micro_batches, ev.micro_batch_size) == (12, 3, 4)
    assert ev.stages == plan.stages
    ev = eval_plan(plan, 7)  # 7 is prime: one micro-batch of 7
    assert (ev.num_micro_batches, ev.micro_batch_size) == (1, 7)
    ev = eval_plan(plan, 8)  # M_e = 2 gives 4 >= 3; M_e = 3 does not divide 8
    assert (ev.num_micro_batches, ev.micro_batch_size) == (2, 4)
    with pytest.raises(ValidationError, match="eval batch size 2 is smaller than the 3 replicas"):
        eval_plan(plan, 2)
    with pytest.raises(ValidationError, match="eval_batch_size must be >= 1, got 0"):
        TrainConfig(eval_batch_size=0)


def test_evaluation_is_due_every_n_steps_and_after_the_last() -> None:
    plan = rw.make_plan("straight2", "dapple", "A", False, 2, 2)

    def due(every: int, steps: int) -> list[int]:
        ev = Evaluation(plan, 3, executor=None, module=None, device=torch.device("cpu"),
                        batch=ew.callable_batch, batches=1, every=every, steps=steps)  # fmt: skip
        return [t for t in range(steps) if ev.due(t)]

    assert due(3, 10) == [2, 5, 8, 9]
    assert due(5, 10) == [4, 9]
    assert due(1, 3) == [0, 1, 2]
    assert due(0, 10) == []
    assert due(20, 10) == [9]


def test_train_config_rejects_bad_eval_options(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="eval_every must be >= 0, got -1"):
        TrainConfig(eval_every=-1)
    with pytest.raises(ValidationError, match="eval_batches must be >= 1, got 0"):
        TrainConfig(eval_batches=0)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "tensorboard" else real(n, *a)
    )
    with pytest.raises(ValidationError, match="needs the 'tensorboard' package"):
        TrainConfig(tensorboard_dir="tb")


# -- multi-process: eval loss vs the one-process model, training untouched -------------------
@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("eval")
    spawn(ew.eval_worker, 4, str(out), timeout_s=60)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(4)]


def _reference_eval(wl, data: str, steps: int, G_e: int | None = None) -> float:
    """The one-process model after ``steps`` steps: mean loss over the K eval batches of
    ``G_e`` samples (default G)."""
    model, _ = rw.reference_run(wl, "sgd", ew.LR, ew.SEED, ew.B * ew.M, steps)
    model.eval()
    batch = eval_batch_fn(wl, G_e or ew.B * ew.M, ew.K, ew.eval_data(data))
    with torch.no_grad():
        return sum(float(wl.loss_fn(model(x), y)) for x, y in map(batch, range(ew.K))) / ew.K


def _eval_of_final_weights(spawned: list[dict], case: tuple) -> float:
    """The one-process model with the run's final weights (from every stage's replica 0), in
    eval mode: mean loss over the K default eval batches."""
    name, plan_name, wl_name, *_ = case
    plan = rw.make_plan(plan_name, "dapple", "A", False, ew.B, ew.M)
    wl = ew.WORKLOADS[wl_name]()
    model = wl.build_model(0)
    state = {}
    for st in plan.stages:
        lo = st.layers[0]
        for local, values in spawned[st.devices[0]][name]["params1"].items():
            i, rest = local.split(".", 1)
            state[f"{lo + int(i)}.{rest}"] = values
    params = dict(model.named_parameters())
    assert state.keys() == params.keys()
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.tensor(state[n]).reshape(p.shape))
    model.eval()
    batch = eval_batch_fn(wl, ew.B * ew.M, ew.K)
    with torch.no_grad():
        return sum(float(wl.loss_fn(model(x), y)) for x, y in map(batch, range(ew.K))) / ew.K


@pytest.mark.slow
@pytest.mark.parametrize("case", ew.CASES, ids=[c[0] for c in ew.CASES])
def test_eval_loss_matches_single_process_model(spawned: list[dict], case: tuple) -> None:
    name, _, wl_name, _, data, *eval_bs = case
    with_eval = spawned[0][name]["metrics1"]
    assert [m["step"] for m in with_eval] == list(range(ew.STEPS))
    got = [m["eval_loss"] for m in with_eval]
    if wl_name == "dropout":  # per-rank dropout RNG: no one-process training reference
        want_last = _eval_of_final_weights(spawned, case)  # dropout off while evaluating
        torch.testing.assert_close(torch.tensor(got[-1]), torch.tensor(want_last))
        return
    wl = rw.WORKLOADS[wl_name]()
    want = [_reference_eval(wl, data, t + 1, *eval_bs) for t in range(ew.STEPS)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    assert got[0] != got[1]  # the weights moved between the evaluations
    assert all(m["eval_loss"] is None for m in spawned[0][name]["metrics0"])


@pytest.mark.slow
@pytest.mark.parametrize("case", ew.CASES, ids=[c[0] for c in ew.CASES])
def test_evaluation_leaves_weights_and_losses_bit_for_bit(spawned: list[dict], case: tuple) -> None:
    name, plan_name, *_ = case
    plan = rw.make_plan(plan_name, "dapple", "A", False, ew.B, ew.M)
    for rank, rep in enumerate(spawned):
        res = rep[name]
        assert bool(res["params1"]) == (rank in plan.devices)
        assert res["params1"] == res["params0"], f"rank {rank}"
        if rank in plan.devices:
            assert res["training_mode"] is True  # back in train mode after evaluating
    losses = [[m["loss"] for m in spawned[0][name][f"metrics{e}"]] for e in (1, 0)]
    assert losses[0] == losses[1]

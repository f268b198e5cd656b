"""Training on a token file: interrupted + resumed == uninterrupted (bit for bit), the runs
match a single-process reference on the same batches, and resume refuses other data.

One group of 4 gloo workers is spawned ONCE and runs every scenario in order.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dapple.core.plan import Plan, StagePlan
from dapple.datasets import EpochSampler, TokenFile, open_documents
from dapple.models.workload import Workload

B, M, STEPS, CUT, SEED, LR = 4, 2, 5, 3, 2, 0.05
G = B * M
SEQ, VOCAB = 8, 64
ITEMS = 20  # 2 steps per epoch: the runs cross epochs 0, 1 and 2; the cut is mid-epoch 1

PLANS = {
    "3:1": (((0, 2), (0, 1, 2)), ((2, 4), (3,))),
    "2:2": (((0, 2), (0, 1)), ((2, 4), (2, 3))),
}


def plan_of(name: str) -> Plan:
    return Plan(
        planner="test",
        global_batch_size=G,
        micro_batch_size=B,
        num_micro_batches=M,
        stages=tuple(StagePlan(layers=lay, devices=dev) for lay, dev in PLANS[name]),
    )


def tiny_gpt() -> Workload:
    from dapple.models.zoo import transformer

    return transformer(layers=2, hidden=16, heads=2, seq=SEQ, vocab=VOCAB)


def token_file(path: Path, items: int = ITEMS, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    rng.integers(0, VOCAB, items * SEQ + 1).astype(np.uint16).tofile(path)
    return path


def docs_file(path: Path, n: int = ITEMS, seed: int = 0) -> Path:
    """A JSONL file of ``n`` documents of 3-9 token ids (at most ``SEQ + 1``)."""
    rng = np.random.default_rng(seed)
    rows = [rng.integers(1, VOCAB, int(rng.integers(3, SEQ + 2))).tolist() for _ in range(n)]
    path.write_text("\n".join(json.dumps({"ids": r}) for r in rows))
    return path


def _scenario(name: str, results: dict, fn) -> None:
    try:
        results[name] = {"ok": True, **(fn() or {})}
    except Exception as e:
        results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}


def worker(rank: int, world: int, out_dir: str) -> None:
    from dapple.runtime import TrainConfig, init_distributed, run_plan
    from dapple.runtime.verify import reference_run

    device = init_distributed(TrainConfig(timeout_s=30), world)
    out = Path(out_dir)
    data = TokenFile(out / "train.bin", SEQ)
    wl = tiny_gpt()
    base = dict(seed=SEED, optimizer="adam", lr=LR, timeout_s=30)
    res: dict[str, dict] = {}

    def run(plan: Plan, d=data, **kw):
        cfg = TrainConfig(**{**base, **kw})
        return run_plan(plan, wl, cfg, device=device, exact_world=False, data=d)

    p31 = plan_of("3:1")
    full = run(p31, steps=STEPS)
    ck = str(out / "ck")
    part = run(p31, steps=CUT, checkpoint_dir=ck, save_every=CUT)
    again = run(p31, steps=STEPS, checkpoint_dir=ck, resume=True)

    def resumed_is_exact(full=full, part=part, again=again, ck=ck):
        for a, b in zip(again.module.parameters(), full.module.parameters(), strict=True):
            assert torch.equal(a, b)
        if rank == 0:
            got = [m.loss for m in part.metrics + again.metrics]
            assert got == [m.loss for m in full.metrics], (got, [m.loss for m in full.metrics])
            assert [m.step for m in again.metrics] == list(range(CUT, STEPS))
        manifest = json.loads((Path(ck) / f"step-{CUT:08d}" / "manifest.json").read_text())
        return {"data": manifest.get("extra", {}).get("data")}

    _scenario("resume", res, resumed_is_exact)
    # documents padded to each global batch's longest: the length changes from step to step
    docs = open_documents(out / "docs.jsonl", SEQ, "pad")
    ckp = str(out / "ck-padded")
    full_p = run(p31, d=docs, steps=STEPS)
    part_p = run(p31, d=docs, steps=CUT, checkpoint_dir=ckp, save_every=CUT)
    again_p = run(p31, d=docs, steps=STEPS, checkpoint_dir=ckp, resume=True)
    _scenario("resume-padded", res, lambda: resumed_is_exact(full_p, part_p, again_p, ckp))

    # SGD: Adam turns the rounding noise of the attention key bias' zero gradient into steps
    ref_losses, ref_params, _ = reference_run(
        wl, G, STEPS, seed=SEED, optimizer="sgd", lr=LR, data=data
    )

    def matches_reference(r, plan: Plan, first_step: int = 0):
        n = 0
        if r.module is not None:
            first = plan.stages[r.stage].layers[0]
            for k, layer in enumerate(r.module.children()):
                for name, p in layer.named_parameters():
                    torch.testing.assert_close(p.detach(), ref_params[first + k][name])
                    n += 1
        if rank == 0:
            torch.testing.assert_close(
                torch.tensor([m.loss for m in r.metrics]), torch.tensor(ref_losses[first_step:])
            )
        return {"checked": n}

    r31 = run(p31, steps=STEPS, optimizer="sgd")
    _scenario("reference-3:1", res, lambda: matches_reference(r31, p31))
    p22 = plan_of("2:2")
    r22 = run(p22, steps=STEPS, optimizer="sgd")
    _scenario("reference-2:2", res, lambda: matches_reference(r22, p22))
    # saved under 2:2, resumed under 3:1: the same batches, so the reference's end point
    ck22 = str(out / "ck22")
    run(p22, steps=CUT, optimizer="sgd", checkpoint_dir=ck22, save_every=CUT)
    moved = run(p31, steps=STEPS, optimizer="sgd", checkpoint_dir=ck22, resume=True)
    _scenario("resume-2:2-as-3:1", res, lambda: matches_reference(moved, p31, CUT))

    def refused(**kw):
        def fn():
            try:
                run(p31, steps=STEPS, checkpoint_dir=ck, resume=True, **kw)
            except Exception as e:
                return {"error": str(e), "type": type(e).__name__}
            raise AssertionError("resumed on other data")

        return fn

    longer = TokenFile(token_file(out / f"longer{rank}.bin", ITEMS + 3), SEQ)
    _scenario("other-length", res, refused(d=longer))
    _scenario("other-seed", res, refused(seed=SEED + 1))
    _scenario("synthetic", res, refused(d=None))
    (out / f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from dapple.runtime import spawn

    out = tmp_path_factory.mktemp("data-runtime")
    token_file(out / "train.bin")
    docs_file(out / "docs.jsonl")
    spawn(worker, 4, str(out), timeout_s=90)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def _ok(spawned: list[dict], name: str) -> list[dict]:
    rows = [rep[name] for rep in spawned]
    for rank, row in enumerate(rows):
        assert row["ok"], f"rank {rank}: {row.get('error')}"
    return rows


@pytest.mark.slow
def test_resume_on_a_token_file_equals_the_uninterrupted_run_bit_for_bit(spawned) -> None:
    rows = _ok(spawned, "resume")
    assert rows[0]["data"] == {
        "sampler": "epoch-permutation",
        "items": ITEMS,
        "seed": SEED,
        "global_batch_size": G,
        "seq_len": SEQ,
        "source": rows[0]["data"]["source"],
    }
    assert rows[0]["data"]["source"].endswith("train.bin")


@pytest.mark.slow
def test_resume_on_padded_documents_equals_the_uninterrupted_run_bit_for_bit(
    spawned, tmp_path: Path
) -> None:
    docs = open_documents(docs_file(tmp_path / "docs.jsonl"), SEQ, "pad")
    sampler = EpochSampler(len(docs), G, SEED)
    assert len({docs.width(sampler.indices(t)) for t in range(STEPS)}) > 1  # lengths change
    rows = _ok(spawned, "resume-padded")
    assert rows[0]["data"]["items"] == ITEMS


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["3:1", "2:2"])
def test_token_file_run_matches_the_single_process_reference(spawned, plan: str) -> None:
    rows = _ok(spawned, f"reference-{plan}")
    per_layer = {0: 2, 1: 12, 2: 12, 3: 4}  # embedding, blocks, head: parameter tensors
    assert sum(r["checked"] for r in rows) == sum(
        len(devs) * sum(per_layer[i] for i in range(lo, hi)) for (lo, hi), devs in PLANS[plan]
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, needle",
    [
        ("other-length", "items 20 (now 23)"),
        ("other-seed", f"seed {SEED} (now {SEED + 1})"),
        ("synthetic", "resume it with the same --data"),
    ],
)
def test_resume_refuses_other_data(spawned, case: str, needle: str) -> None:
    for row in _ok(spawned, case):
        assert row["type"] == "CheckpointError" and needle in row["error"], row


@pytest.mark.slow
def test_resume_under_another_plan_continues_the_same_data(spawned) -> None:
    rows = _ok(spawned, "resume-2:2-as-3:1")
    assert sum(r["checked"] for r in rows) == 3 * 14 + 16  # 3 replicas of [0, 2), one of [2, 4)

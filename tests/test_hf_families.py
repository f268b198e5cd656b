"""Hugging Face causal-LM families with dropout on: profile -> plan -> verify under uneven plans.

Every family of :data:`hf_families.FAMILIES` (tiny config, dropout 0.1) is profiled, planned for
four processes and verified step by step with AdamW under the uneven 1:2:1 plan; OPT, Bloom and
Falcon under 3:1 too, GPT-2 under ZB-H1 and with re-computation. One launch of four worker processes runs
every case (:func:`dapple.runtime.verify.verify_many`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from dapple import api
from dapple.core.plan import Plan, straight_plan
from dapple.models.hf import hf_causal_lm
from dapple.runtime.train_config import TrainConfig
from dapple.runtime.verify import verify_many
from hf_families import FAMILIES, save_family

pytestmark = pytest.mark.slow

SEQ = 16


def _uneven(n: int, shape: str, **kw: object) -> Plan:
    if shape == "1:2:1":
        return straight_plan(
            n, [0, 2, n - 2], global_batch_size=8, num_micro_batches=2, replicas=[1, 2, 1], **kw
        )
    return straight_plan(n, [0, n - 2], global_batch_size=12, num_micro_batches=2,
                         replicas=[3, 1], **kw)  # fmt: skip


@pytest.mark.timeout(1800)  # 16 profiles and 21 verified runs: ~200 s alone on 2 cores
def test_every_family_trains_like_one_process_with_dropout_on(tmp_path: Path) -> None:
    cases: list[tuple[str, Plan, object]] = []
    for family in FAMILIES:
        wl = hf_causal_lm(save_family(family, tmp_path / family), seq=SEQ)
        profile = api.profile(wl, batch_sizes=(1, 2), repeats=1, warmup=0)
        assert len(profile.layers) == wl.num_layers
        planned = api.plan(profile, "local-cpu", 8)
        assert planned.num_layers == wl.num_layers
        cases.append((f"{family} 1:2:1", _uneven(wl.num_layers, "1:2:1"), wl))
        if family in ("opt", "bloom", "falcon"):
            cases.append((f"{family} 3:1", _uneven(wl.num_layers, "3:1"), wl))
        if family == "gpt2":
            cases.append(("gpt2 1:2:1 zbh1", _uneven(wl.num_layers, "1:2:1", schedule="zbh1"), wl))
            plan = _uneven(wl.num_layers, "1:2:1")
            stages = tuple(dataclasses.replace(s, recompute="full") for s in plan.stages)
            cases.append(("gpt2 1:2:1 recompute", dataclasses.replace(plan, stages=stages), wl))
    pairs = [(plan, wl) for _, plan, wl in cases]
    cfg = TrainConfig(steps=2, optimizer="adamw", lr=1e-3, device="cpu", timeout_s=120.0)
    reports = verify_many(pairs, cfg)  # type: ignore[arg-type]
    failed = {
        name: [d.first_failure for d in r.stages if d.first_failure] or "losses"
        for (name, _, _), r in zip(cases, reports, strict=True)
        if not r.ok
    }
    assert not failed, failed
    assert len(FAMILIES) >= 12


@pytest.mark.timeout(900)
def test_a_resume_under_another_plan_draws_the_uninterrupted_runs_masks(tmp_path: Path) -> None:
    """GPT-2 with dropout 0.1: 3 steps under 1:2:1 equal 2 steps under 1:2:1, then the third
    resumed from the checkpoint under 3:1 (other micro-batch rows per rank, same masks)."""
    wl = api.load("dapple.models.hf:gpt2", layers=2, hidden=32, heads=2, vocab=64, seq=16,
                  dropout=0.1)  # fmt: skip
    n = wl.num_layers
    first = straight_plan(n, [0, 1, 3], global_batch_size=12, num_micro_batches=2,
                          replicas=[1, 2, 1])  # fmt: skip
    other = straight_plan(n, [0, 3], global_batch_size=12, num_micro_batches=3, replicas=[3, 1])
    whole = [m.loss for m in api.train(first, wl, 3, device="cpu")]
    ck = str(tmp_path / "ck")
    api.train(first, wl, 2, device="cpu", checkpoint_dir=ck, save_every=2)
    resumed = api.train(other, wl, 3, device="cpu", checkpoint_dir=ck, resume=True)
    assert [m.step for m in resumed] == [2]
    assert resumed[0].loss == pytest.approx(whole[2], rel=1e-5)
    assert whole[2] != pytest.approx(whole[1], rel=1e-3)  # the steps differ: a real comparison

"""Expert parallelism with ZeRO-1/2 at e_s = r_s (``dapple.runtime.parallel.expert``): the dense
parameters sharded over the stage's replicas as without EP, the expert shards left out of the
flat buckets (each replica updates its own experts whole); ``dapple verify`` equal to one device
under AdamW, and checkpoints whole that resume under another width and zero stage."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import extra_models as em
from dapple import api
from dapple.runtime.verify.run import WORKER_SETUP_ENV
from test_expert_parallel import _plan_1_2_1, _tensors

ZERO_DIR_ENV = "DAPPLE_TEST_EP_ZERO_DIR"
"""Where :func:`record_zero` writes what each verify worker's ZeRO shards."""


def record_zero(rank: int) -> None:
    """Verify worker setup hook: append, per run, the rank's zero stage, its flat (sharded)
    parameters' count and how many of them are expert shards, to
    ``$DAPPLE_TEST_EP_ZERO_DIR/rank<r>.jsonl``."""
    import dapple.runtime.startup as startup

    select = startup.select_zero

    def recorded(plan: Any, workload: Any, layers: Any, zero_stage: int, mesh: Any = None) -> Any:
        sel = select(plan, workload, layers, zero_stage, mesh)
        ep = mesh.experts if mesh is not None else None
        ids = ep.param_ids if ep is not None else frozenset()
        row = {"zero": sel.zero_stage, "flat": len(sel.flat),
               "flat_experts": sum(id(p) in ids for p in sel.flat), "experts": len(ids)}  # fmt: skip
        with Path(os.environ[ZERO_DIR_ENV], f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        return sel

    startup.select_zero = recorded


@pytest.mark.slow
def test_verify_moe_with_ep_2_under_zero_1_and_2_equals_one_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One launch, two runs of 3 AdamW steps on 1:2:1 (the middle stage's 2 replicas, slices
    of 2 and 1 samples, each holding 2 of the 4 experts of both MoE blocks): Mixtral with the
    stage at ZeRO-1, Qwen2-MoE at ZeRO-2; both equal one device, and the middle stage's
    replicas shard their dense parameters and no expert."""
    pytest.importorskip("transformers")
    monkeypatch.setenv(WORKER_SETUP_ENV, "test_expert_zero:record_zero")
    monkeypatch.setenv(ZERO_DIR_ENV, str(tmp_path))
    cases = [(_plan_1_2_1(zero_stage=1), "mixtral"), (_plan_1_2_1(zero_stage=2), "qwen2_moe")]
    reports = api.verify_many([(p, f"extra_models:{f}") for p, f in cases], 3, device="cpu",
                              optimizer="adamw", lr=0.01, timeout_s=600)  # fmt: skip
    for (plan, factory), rep in zip(cases, reports, strict=True):
        assert rep.ok, (factory, plan.replication, rep.max_abs_diff)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), factory
    for r in (1, 2):  # the middle stage's replicas
        rows = [json.loads(x) for x in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()]
        assert [x["zero"] for x in rows] == [1, 2], rows
        assert all(x["flat"] > 0 and x["flat_experts"] == 0 and x["experts"] == 4 for x in rows)


CK_STEPS, CK_CUT = 4, 2
RUNS = {"plain": (1, 0), "ep-zero1": (2, 1), "ep-zero2": (2, 2)}
"""Run name -> (expert width, zero stage) of the 1:2:1 plan's middle stage."""


def checkpoint_worker(rank: int, world: int, out_dir: str) -> None:
    """Mixtral on 1:2:1 without EP and with EP 2 under ZeRO-1 (AdamW, saving at CK_CUT and
    CK_STEPS); the EP + ZeRO-1 run's CK_CUT checkpoint resumed without EP and under EP 2 with
    ZeRO-2."""
    import torch.distributed as dist

    from dapple.runtime import TrainConfig, init_distributed, run_plan
    from dapple.runtime.checkpoint import step_dir

    device = init_distributed(TrainConfig(timeout_s=120), world)
    out, wl = Path(out_dir), em.mixtral()
    losses: dict[str, Any] = {}

    def run(name: str, ck: Path, **kw: Any) -> None:
        e, z = RUNS[name]
        cfg = TrainConfig(seed=1, optimizer="adamw", lr=1e-2, timeout_s=120, steps=CK_STEPS,
                          save_every=CK_CUT, checkpoint_dir=str(ck), **kw)  # fmt: skip
        r = run_plan(_plan_1_2_1(e, zero_stage=z), wl, cfg, device=device, exact_world=False)
        losses[ck.name] = [m.loss for m in r.metrics]

    run("plain", out / "u-plain")
    run("ep-zero1", out / "u-ep-zero1")
    for dst in ("plain", "ep-zero2"):
        d = out / f"r-as-{dst}"
        if rank == 0:
            d.mkdir()
            shutil.copytree(step_dir(out / "u-ep-zero1", CK_CUT), step_dir(d, CK_CUT))
        dist.barrier()
        run(dst, d, resume=True)
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))


@pytest.mark.slow
def test_checkpoints_of_ep_with_zero_are_whole_and_resume_under_another_width_and_zero(
    tmp_path: Path,
) -> None:
    """The EP 2 + ZeRO-1 run's checkpoints hold what the plain run's do (whole ``[4, ...]``
    experts and every AdamW moment, within rounding), and its step-2 checkpoint resumed without
    EP and under EP 2 + ZeRO-2 ends where the uninterrupted runs do."""
    pytest.importorskip("transformers")
    from dapple.runtime import spawn

    spawn(checkpoint_worker, 4, str(tmp_path), timeout_s=600)
    losses = json.loads((tmp_path / "losses.json").read_text())
    want = _tensors(tmp_path / "u-plain", CK_STEPS)
    moments = [
        k for k in want if k.endswith(("gate_up_proj/exp_avg", "self_attn.q_proj.weight/exp_avg"))
    ]
    assert len(moments) == 4 and all(want[k].abs().sum() > 0 for k in moments), moments
    for run in ("u-ep-zero1", "r-as-plain", "r-as-ep-zero2"):
        got = _tensors(tmp_path / run, CK_STEPS)
        assert got.keys() == want.keys(), run
        for k, w in want.items():
            scale = float(w.abs().max()) if w.numel() else 1.0
            torch.testing.assert_close(got[k], w, rtol=1e-4, atol=3e-4 * scale,
                                       msg=lambda m, k=k, run=run: f"{run} {k}: {m}")  # fmt: skip
    full = losses["u-plain"]
    assert losses["u-ep-zero1"] == pytest.approx(full, rel=1e-5)
    for run in ("r-as-plain", "r-as-ep-zero2"):
        assert losses[run] == pytest.approx(full[CK_CUT:], rel=1e-5), run

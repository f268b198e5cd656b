"""End to end on real inputs: the CLI and the Python API on Hugging Face GPT-2/BERT and on a user
model file, and ``verify`` of hand-written plans (GPT-2 with tied embeddings, BERT) under both
schedules against the single-process original model, on 4 CPU processes.

Process launches are the expensive part (~10-20 s each on 2 cores): every distributed run of a
test happens in as few launches as possible (``verify_many`` runs all plans in one).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dapple import api
from dapple.cli import main
from dapple.core.plan import Plan, straight_plan
from dapple.runtime.verify import PERTURB_GRAD_RANK_ENV

pytest.importorskip("transformers")

GPT2 = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq": 16}
"""A tiny GPT-2: 4 pieces (embeddings, 2 blocks, final norm + tied LM head)."""
BERT = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq": 16}


def _set(overrides: dict[str, object]) -> list[str]:
    return [a for k, v in overrides.items() for a in ("--set", f"{k}={v}")]


USER_NET = '''
"""A user model: blocks in a ModuleList, gated residuals (one gate vector used by every block,
so it is tied across pieces), a long skip and a second per-sample input."""

from functools import partial

import torch
from torch import nn
from torch.nn import functional as F

from dapple.models.split import workload_from_module


class Net(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
            for _ in range(depth)
        )
        self.gates = nn.Parameter(torch.linspace(0.5, 1.0, depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x, scale):
        h = self.embed(x)
        skip = h
        for i, block in enumerate(self.blocks):
            h = h + self.gates[i] * block(h)
            if i % 2 == 1:
                h = h + 0.5 * skip
        return self.head(torch.tanh(h) * scale)


def batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    scale = torch.rand(n, 1, generator=g) + 0.5
    return (x, scale), torch.randint(0, 3, (n,), generator=g)


def factory(width=16, depth=4, split_at=None):
    return workload_from_module(
        partial(Net, width, depth), batch, F.cross_entropy, split_at=split_at,
        name=f"user-net-{depth}x{width}",
    )
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("user") / "user_net.py"
    path.write_text(USER_NET)
    return f"{path}:factory"


def _profile_plan_cli(
    model: str, args: list[str], out: Path, capfd: pytest.CaptureFixture[str]
) -> Plan:
    """``dapple profile`` then ``dapple plan`` (local-cpu, 4 processes) through the CLI."""
    prof, plan = out / "profile.json", out / "plan.json"
    assert (
        main(["profile", "--model", model, *args, "--batch-sizes", "1,4", "--repeats", "1",
              "--warmup", "0", "-o", str(prof)])
        == 0
    )  # fmt: skip
    assert main(["plan", "--profile", str(prof), "--cluster", "local-cpu",
                 "--global-batch-size", "8", "--output", str(plan)]) == 0  # fmt: skip
    printed = capfd.readouterr().out
    assert "wrote" in printed and "stage" in printed.lower()
    return Plan.load(plan)


def _train_cli(
    plan: Path, model: str, args: list[str], capfd: pytest.CaptureFixture[str]
) -> list[dict[str, object]]:
    metrics = plan.parent / "metrics.jsonl"
    rc = main(["train", "--plan", str(plan), "--model", model, *args, "--steps", "2",
               "--device", "cpu", "--metrics", str(metrics)])  # fmt: skip
    assert rc == 0
    assert "step 1 loss" in capfd.readouterr().out
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.mark.slow
def test_cli_profile_plan_train_gpt2(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    plan = _profile_plan_cli("dapple.models.hf:gpt2", _set(GPT2), tmp_path, capfd)
    assert plan.num_layers == GPT2["layers"] + 2
    rows = _train_cli(tmp_path / "plan.json", "dapple.models.hf:gpt2", _set(GPT2), capfd)
    assert [r["step"] for r in rows] == [0, 1]
    # the same run in one process gives the same losses (random init: ~ln(vocab))
    from dapple.runtime.verify import reference_run

    wl = api.load("dapple.models.hf:gpt2", **GPT2)
    ref_losses, _, kind = reference_run(wl, plan.global_batch_size, 2)
    assert kind == "original model"
    assert [r["loss"] for r in rows] == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.slow
def test_cli_profile_plan_train_and_verify_user_module_file(
    user_file: str,
    tmp_path: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model defined in a file the package cannot import: --set and --split-at everywhere,
    and ``dapple verify`` passes (exit 0), then fails (exit 1) with one rank's gradient off."""
    args = ["--set", "width=16", "--set", "depth=4", "--split-at", "blocks.1,blocks.3,head"]
    plan = _profile_plan_cli(user_file, args, tmp_path, capfd)
    assert plan.num_layers == 4  # the --split-at cuts, not the default 6 pieces
    rows = _train_cli(tmp_path / "plan.json", user_file, args, capfd)
    assert len(rows) == 2 and all(r["loss"] == r["loss"] for r in rows)  # finite, not NaN

    hand = tmp_path / "p121.json"
    straight_plan(4, [0, 1, 3], global_batch_size=8, num_micro_batches=2, replicas=[1, 2, 1]).save(
        hand
    )
    verify = ["verify", "--plan", str(hand), "--model", user_file, *args, "--steps", "2"]
    assert main(verify) == 0
    out = capfd.readouterr().out
    assert "OK" in out and "original model" in out and "MISMATCH" not in out
    monkeypatch.setenv(PERTURB_GRAD_RANK_ENV, "2")  # stage 1, replica 1
    assert main([*verify, "--schedule", "gpipe"]) == 1
    out = capfd.readouterr().out
    assert "MISMATCH" in out and "FAIL" in out


def _gpt2_plans() -> list[Plan]:
    n = GPT2["layers"] + 2
    shapes = [  # (cuts, replicas, micro-batches): straight 4-stage, 1:2:1, 3:1 (uneven), 2:2
        ([0, 1, 2, 3], [1, 1, 1, 1], 4),
        ([0, 1, 3], [1, 2, 1], 2),
        ([0, 2], [3, 1], 2),
        ([0, 3], [2, 2], 2),
    ]
    base = [
        straight_plan(n, cuts, global_batch_size=8, num_micro_batches=m, replicas=reps)
        for cuts, reps, m in shapes
    ]
    return [dataclasses.replace(p, schedule=s) for p in base for s in ("dapple", "gpipe")]


@pytest.mark.slow
def test_verify_gpt2_and_bert_plans_both_schedules() -> None:
    gpt2 = api.load("dapple.models.hf:gpt2", **GPT2)
    bert = api.load("dapple.models.hf:bert", **BERT)
    bert_plan = straight_plan(4, [0, 2, 3], global_batch_size=8, num_micro_batches=2,
                              replicas=[2, 1, 1], policy="B")  # fmt: skip
    cases = [(p, gpt2) for p in _gpt2_plans()] + [
        (dataclasses.replace(bert_plan, schedule=s), bert) for s in ("dapple", "gpipe")
    ]
    n_params = {
        wl.name: sum(p.numel() for p in wl.build_model(0).parameters()) for wl in (gpt2, bert)
    }
    reports = api.verify_many(cases, steps=2)
    assert len(reports) == len(cases) == 10
    for (plan, wl), rep in zip(cases, reports, strict=True):
        what = f"{wl.name} {plan.replication} {plan.schedule}"
        assert rep.reference == "original model", what
        assert rep.ok, (what, [(s.stage, s.max_abs_diff, s.worst) for s in rep.stages])
        assert [s.replicas for s in rep.stages] == [st.replicas for st in plan.stages]
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), what
        # every parameter of the model (tied copies once per piece) was compared
        assert sum(s.num_params for s in rep.stages) == n_params[wl.name], what
    # the tied embedding / LM head copies (stages 0 and 3 of the straight plan) moved together
    straight = reports[0]
    assert straight.stages[0].num_params > 0 and straight.stages[-1].num_params > 0

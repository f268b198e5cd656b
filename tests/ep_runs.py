"""Shared scaffolding of the expert-parallel runtime tests (``test_expert_parallel``,
``test_expert_zero``, ``test_expert_load``): the uneven MoE plans they run, ``dapple verify``
of several plans against one device, a checkpoint-and-resume worker over named runs, and the
checks of what those runs leave."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import extra_models as em
from dapple import api
from dapple.core.plan import Plan, straight_plan

CK_STEPS, CK_CUT = 4, 2
"""A resume case's runs train CK_STEPS AdamW steps, saving at CK_CUT and CK_STEPS; the
resumed runs start from the CK_CUT checkpoint."""


def plan_1_2_1(expert_width: int = 2, **stage: Any) -> Plan:
    """Layers prologue | 2 MoE blocks | epilogue on 1:2:1, b = 3 (middle slices 2 and 1), the
    middle stage at EP ``expert_width`` with ``stage``'s other settings."""
    plan = straight_plan(4, [0, 1, 3], global_batch_size=6, num_micro_batches=2,
                         replicas=[1, 2, 1])  # fmt: skip
    mid = dataclasses.replace(plan.stages[1], expert_width=expert_width, **stage)
    return dataclasses.replace(plan, stages=(plan.stages[0], mid, plan.stages[2]))


def plan_4_1(expert_width: int = 2, **stage: Any) -> Plan:
    """Layers prologue + 2 MoE blocks | epilogue on 4:1, b = 5 (stage 0's slices 2, 1, 1, 1),
    stage 0 at EP ``expert_width`` with ``stage``'s other settings."""
    plan = straight_plan(4, [0, 3], global_batch_size=10, num_micro_batches=2, replicas=[4, 1])
    first = dataclasses.replace(plan.stages[0], expert_width=expert_width, **stage)
    return dataclasses.replace(plan, stages=(first, plan.stages[1]))


def verify_equal_to_one_device(cases: Sequence[tuple[Plan, str]], timeout_s: float) -> None:
    """``dapple verify`` of each ``(plan, extra_models factory)`` in one launch, 3 AdamW steps:
    each report OK and its losses those of one device."""
    reports = api.verify_many([(p, f"extra_models:{f}") for p, f in cases], 3, device="cpu",
                              optimizer="adamw", lr=0.01, timeout_s=timeout_s)  # fmt: skip
    for (plan, factory), rep in zip(cases, reports, strict=True):
        assert rep.ok, (factory, plan.replication, rep.max_abs_diff)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), factory


def append_row(env: str, rank: int, row: object) -> None:
    """Append ``row`` as one JSON line to ``$<env>/rank<rank>.jsonl`` (a verify worker's
    setup hook records what its rank holds this way)."""
    with Path(os.environ[env], f"rank{rank}.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def rows(root: Path, rank: int) -> list[Any]:
    """The lines :func:`append_row` wrote for ``rank`` under ``root``, parsed."""
    return [json.loads(x) for x in (root / f"rank{rank}.jsonl").read_text().splitlines()]


@dataclasses.dataclass(frozen=True)
class ResumeCase:
    """Mixtral runs of :data:`CK_STEPS` AdamW steps, each saving at :data:`CK_CUT`: the plans
    :attr:`runs` names uninterrupted, then each ``(source, target)`` of :attr:`resumes`, the
    source run's CK_CUT checkpoint resumed under the target's plan. Runs write ``u-<name>``,
    resumes ``r-<source>-as-<target>``."""

    plans: Mapping[str, Plan]
    """Name -> plan; ``plain`` (no EP) is the reference."""
    runs: tuple[str, ...]
    """The plans run uninterrupted (``plain`` among them)."""
    resumes: tuple[tuple[str, str], ...]
    eval_every: int = 0
    """Evaluate every this many steps (0: never)."""

    @property
    def resumed(self) -> list[str]:
        """The resumes' directory names."""
        return [f"r-{src}-as-{dst}" for src, dst in self.resumes]


def resume_worker(rank: int, world: int, out_dir: str, case: ResumeCase) -> None:
    """Run ``case`` (:class:`ResumeCase`) on ``world`` ranks; rank 0 writes every run's step
    losses (and evaluation losses, ``eval-<dir>``) to ``losses.json``."""
    import torch.distributed as dist

    from dapple.runtime import TrainConfig, init_distributed, run_plan
    from dapple.runtime.checkpoint import step_dir

    device = init_distributed(TrainConfig(timeout_s=120), world)
    out, wl = Path(out_dir), em.mixtral()
    losses: dict[str, Any] = {}
    evals = {"eval_every": case.eval_every, "eval_batches": 1} if case.eval_every else {}

    def run(name: str, ck: Path, **kw: Any) -> None:
        cfg = TrainConfig(seed=1, optimizer="adamw", lr=1e-2, timeout_s=120, steps=CK_STEPS,
                          save_every=CK_CUT, checkpoint_dir=str(ck), **evals, **kw)  # fmt: skip
        r = run_plan(case.plans[name], wl, cfg, device=device, exact_world=False)
        losses[ck.name] = [m.loss for m in r.metrics]
        losses[f"eval-{ck.name}"] = [m.eval_loss for m in r.metrics]

    for name in case.runs:
        run(name, out / f"u-{name}")
    for src, dst in case.resumes:
        d = out / f"r-{src}-as-{dst}"
        if rank == 0:
            d.mkdir()
            shutil.copytree(step_dir(out / f"u-{src}", CK_CUT), step_dir(d, CK_CUT))
        dist.barrier()
        run(dst, d, resume=True)
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))


def checkpoint_tensors(root: Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor and optimizer state of a checkpoint, by ``layer/name[/state]``."""
    from dapple.runtime.checkpoint import load_layer_states, read_checkpoint, step_dir

    ck = read_checkpoint(step_dir(root, step))
    out: dict[str, torch.Tensor] = {}
    for i, ls in load_layer_states(ck, range(ck.meta.num_layers)).items():
        out |= {f"{i}/{n}": t for n, t in ls.tensors.items()}
        for n, st in ls.optimizer.items():
            out |= {f"{i}/{n}/{k}": torch.as_tensor(v) for k, v in st.items()}
    return out


def run_and_check_resumes(
    tmp_path: Path, case: ResumeCase, world: int
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Spawn :func:`resume_worker` on ``world`` ranks and check what ``case``'s runs leave:
    every run's and resume's final checkpoint holds the ``plain`` run's tensors and optimizer
    state (within rounding), the runs' losses equal ``plain``'s and each resume's its steps
    from :data:`CK_CUT` on. Returns the losses by directory and the ``plain`` checkpoint's
    tensors, for the caller's own checks."""
    from dapple.runtime import spawn

    spawn(resume_worker, world, str(tmp_path), case, timeout_s=900)
    losses = json.loads((tmp_path / "losses.json").read_text())
    want = checkpoint_tensors(tmp_path / "u-plain", CK_STEPS)
    others = [f"u-{n}" for n in case.runs if n != "plain"] + case.resumed
    for run in others:
        got = checkpoint_tensors(tmp_path / run, CK_STEPS)
        assert got.keys() == want.keys(), run
        for k, w in want.items():
            scale = float(w.abs().max()) if w.numel() else 1.0
            torch.testing.assert_close(got[k], w, rtol=1e-4, atol=3e-4 * scale,
                                       msg=lambda m, k=k, run=run: f"{run} {k}: {m}")  # fmt: skip
    full = losses["u-plain"]
    for name in case.runs:
        assert losses[f"u-{name}"] == pytest.approx(full, rel=1e-5), name
    for run in case.resumed:  # the resumed runs report steps CK_CUT.. only
        assert losses[run] == pytest.approx(full[CK_CUT:], rel=1e-5), run
    return losses, want

"""Checkpoints of tensor-parallel and ZeRO-3 stages: whole layers, resumable under any plan.

One group of 4 gloo workers is spawned ONCE and trains the zoo transformer (traced into pieces,
its TP plan) with AdamW: seven uninterrupted runs of ``STEPS`` steps (DP2 x TP2, 2:2, 1:2 with
ZeRO-3, 1:2, TP2 x FSDP2, TP2 then ZeRO-3 as interleaved 1F1B, and DP2 x TP2 with ZeRO-2),
each saving at steps ``CUT`` and ``STEPS``, then resumes from a copy of one run's ``CUT``
checkpoint under another plan (or the same), saving again at ``STEPS``. The checks read the checkpoint files here: a cut
stage's checkpoint holds what an unsharded run's holds (same files, names, whole shapes, values
within float rounding, AdamW moments included); a resumed run's final checkpoint and losses
equal the uninterrupted run's - bit for bit when the plan resumes itself; ``dapple export``
reads a TP checkpoint as any other. Five more runs evaluate (``eval_every``) under the cut
plans: their eval losses equal the one-process model's with the checkpoint's weights, and their
training equals the runs without evaluation.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from dapple.core.plan import Plan, StagePlan, interleave
from dapple.models.workload import Workload
from dapple.runtime.checkpoint import Checkpoint, load_layer_states, read_checkpoint, step_dir

B, M, STEPS, CUT, SEED, LR = 4, 2, 4, 2, 3, 1e-2
EVAL_BATCHES = 2
G = B * M
ZOO = {"layers": 2, "hidden": 16, "heads": 2, "seq": 8, "vocab": 64}
EPS = 1e-6
"""AdamW's eps: large beside the rounding noise of the key bias' zero gradient (whose Adam steps
would otherwise be +-lr whatever its size), small beside every real gradient's scale."""

PLANS: dict[str, tuple[StagePlan, ...]] = {
    "dp2xtp2": (StagePlan(layers=(0, 4), devices=(0, 1, 2, 3), tensor_width=2),),
    "2:2": (StagePlan(layers=(0, 2), devices=(0, 1)), StagePlan(layers=(2, 4), devices=(2, 3))),
    "1:2z3": (
        StagePlan(layers=(0, 2), devices=(0,)),
        StagePlan(layers=(2, 4), devices=(1, 2), zero_stage=3),
    ),
    "1:2": (StagePlan(layers=(0, 2), devices=(0,)), StagePlan(layers=(2, 4), devices=(1, 2))),
    "tp2xfsdp2": (StagePlan(layers=(0, 4), devices=(0, 1, 2, 3), tensor_width=2, zero_stage=3),),
    "i-tp2:z3": (
        StagePlan(layers=(0, 2), devices=(0, 1), tensor_width=2),
        StagePlan(layers=(2, 4), devices=(2, 3), zero_stage=3),
    ),
}
PLANS["dp2xtp2+z2"] = PLANS["dp2xtp2"]
ZERO = {"dp2xtp2+z2": 2}
"""Runs with the run's ZeRO-1/2 stage (the optimizer state and gradients sharded over the
replicas of each tensor index)."""
INTERLEAVED = {"i-tp2:z3": 2}
"""Plans run as interleaved 1F1B with v chunks per device group (each rank holds two chunks:
TP2 on the embedding's and the second block's group, ZeRO-3 on the other)."""
PLAIN = {
    "dp2xtp2": "2:2",
    "1:2z3": "1:2",
    "tp2xfsdp2": "2:2",
    "i-tp2:z3": "2:2",
    "dp2xtp2+z2": "2:2",
}
"""Each cut plan -> the unsharded plan whose checkpoints its must equal (within rounding)."""
RESUMES = [
    ("dp2xtp2", "dp2xtp2"),
    ("dp2xtp2", "2:2"),
    ("2:2", "dp2xtp2"),
    ("1:2z3", "1:2z3"),
    ("1:2z3", "1:2"),
    ("1:2", "1:2z3"),
    ("tp2xfsdp2", "2:2"),
    ("2:2", "tp2xfsdp2"),
    ("i-tp2:z3", "i-tp2:z3"),
    ("i-tp2:z3", "dp2xtp2"),
    ("1:2z3", "i-tp2:z3"),
    ("dp2xtp2+z2", "dp2xtp2+z2"),
    ("dp2xtp2+z2", "2:2"),
    ("dp2xtp2", "dp2xtp2+z2"),
]
"""(plan that saved step CUT, plan that resumes it)."""


def plan_of(name: str) -> Plan:
    plan = Plan(planner="test", global_batch_size=G, micro_batch_size=B, num_micro_batches=M,
                stages=PLANS[name])  # fmt: skip
    return interleave(plan, INTERLEAVED[name]) if name in INTERLEAVED else plan


def _zoo_model() -> torch.nn.Module:
    from dapple.models.zoo.transformer import transformer

    return transformer(**ZOO).build_model()


def zoo() -> Workload:
    """The zoo transformer traced into pieces (embedding, block, block, head), with its TP
    plan."""
    from dapple.models.split import workload_from_module
    from dapple.models.zoo.transformer import transformer
    from dapple.runtime.parallel.tp import TRANSFORMER_TP_PLAN

    wl = transformer(**ZOO)
    traced = workload_from_module(_zoo_model, wl.make_batch, wl.loss_fn, split_at=["1", "2", "3"])
    return replace(traced, tp_plan=dict(TRANSFORMER_TP_PLAN))


def _resumed_dir(out: Path, src: str, dst: str) -> Path:
    return out / f"r-{src}-as-{dst}"


def worker(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    from dapple.runtime import TrainConfig, init_distributed, run_plan

    device = init_distributed(TrainConfig(timeout_s=60), world)
    out = Path(out_dir)
    wl = zoo()
    base = dict(seed=SEED, optimizer="adamw", lr=LR, eps=EPS, timeout_s=60, steps=STEPS,
                save_every=CUT)  # fmt: skip
    runs: dict[str, dict[str, list[Any]]] = {}

    def run(name: str, ck: Path, **kw: Any) -> None:
        cfg = TrainConfig(**{**base, **kw}, checkpoint_dir=str(ck), zero_stage=ZERO.get(name, 0))
        r = run_plan(plan_of(name), wl, cfg, device=device, exact_world=False)
        if rank == 0:
            runs[ck.name] = {"loss": [m.loss for m in r.metrics],
                             "eval": [m.eval_loss for m in r.metrics]}  # fmt: skip

    for name in PLANS:
        run(name, out / f"u-{name}")
    for name in PLAIN:  # evaluating after steps CUT and STEPS
        run(name, out / f"e-{name}", eval_every=CUT, eval_batches=EVAL_BATCHES)
    for src, dst in RESUMES:
        d = _resumed_dir(out, src, dst)
        if rank == 0:
            d.mkdir()
            shutil.copytree(step_dir(out / f"u-{src}", CUT), step_dir(d, CUT))
        dist.barrier()
        run(dst, d, resume=True)
    if rank == 0:
        (out / "runs.json").write_text(json.dumps(runs))


Runs = tuple[Path, dict[str, dict[str, list[Any]]]]
"""The workers' output directory, and rank 0's losses and eval losses per run directory."""


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    from dapple.runtime import spawn

    out = tmp_path_factory.mktemp("tp-checkpoint")
    spawn(worker, 4, str(out), timeout_s=600)
    return out, json.loads((out / "runs.json").read_text())


# -- comparing checkpoints --------------------------------------------------------------------
def _ckpt(root: Path, step: int) -> Checkpoint:
    return read_checkpoint(step_dir(root, step))


def _flat(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor and optimizer state of a checkpoint by ``layer/name[/state]``."""
    out: dict[str, torch.Tensor] = {}
    states = load_layer_states(ck, range(ck.meta.num_layers))
    for i, ls in states.items():
        out |= {f"{i}/{n}": t for n, t in ls.tensors.items()}
        for n, st in ls.optimizer.items():
            out |= {f"{i}/{n}/{k}": torch.as_tensor(v) for k, v in st.items()}
    return out


def _same_files(a: Checkpoint, b: Checkpoint) -> None:
    assert [lr.file.file for lr in a.layers] == [lr.file.file for lr in b.layers]
    assert [lr.shapes for lr in a.layers] == [lr.shapes for lr in b.layers]
    assert a.meta.optimizer_type == b.meta.optimizer_type == "AdamW"


def _assert_equal(got: Checkpoint, want: Checkpoint) -> int:
    _same_files(got, want)
    g, w = _flat(got), _flat(want)
    assert g.keys() == w.keys()
    for k in w:
        assert torch.equal(g[k], w[k]), k
    return len(w)


def _assert_close(got: Checkpoint, want: Checkpoint) -> int:
    """Every tensor within ``3e-4`` of its scale (its largest element): a tensor group sums its
    partial products in another order, and an AdamW step ``lr * m / (sqrt(v) + eps)`` of an
    element with a near-zero gradient turns that rounding into up to ``1e-4`` of the scale
    (measured: 7e-5 on ``fc2.weight``); a wrong slice or lost moment is off by ``1e-2`` or more."""
    _same_files(got, want)
    g, w = _flat(got), _flat(want)
    assert g.keys() == w.keys()
    for k in w:
        _close_to_scale(g[k], w[k], k)
    return len(w)


def _close_to_scale(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=3e-4 * scale,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip


def _exact(a: str, b: str) -> bool:
    """Plans whose runs are bit-for-bit alike: the same plan, or plans that differ only in
    ZeRO-3 (over 2 replicas a reduce-scatter sums the same two gradients an AllReduce does,
    and AdamW is elementwise on a shard)."""
    strip = {"1:2z3": "1:2"}
    return strip.get(a, a) == strip.get(b, b)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(PLAIN))
def test_a_cut_stage_saves_what_an_unsharded_stage_saves(spawned: Runs, name: str) -> None:
    out, _ = spawned
    same = _assert_equal if _exact(name, PLAIN[name]) else _assert_close
    for step in (CUT, STEPS):
        n = same(_ckpt(out / f"u-{name}", step), _ckpt(out / f"u-{PLAIN[name]}", step))
        # parameters: embedding 2, blocks 12 each, head 4; each with AdamW's 3 states
        assert n == (2 + 2 * 12 + 4) * 4


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("src,dst", RESUMES)
def test_resume_moves_between_widths_and_zero_stages(spawned: Runs, src: str, dst: str) -> None:
    out, runs = spawned
    got = _ckpt(_resumed_dir(out, src, dst), STEPS)
    want = _ckpt(out / f"u-{dst}", STEPS)
    resumed = runs[_resumed_dir(out, src, dst).name]["loss"]
    uninterrupted = runs[f"u-{dst}"]["loss"][CUT:]
    assert len(resumed) == STEPS - CUT
    if _exact(src, dst):  # e.g. the same plan resumes itself: bit for bit
        _assert_equal(got, want)
        assert resumed == uninterrupted
    else:
        _assert_close(got, want)
        torch.testing.assert_close(
            torch.tensor(resumed), torch.tensor(uninterrupted), rtol=1e-5, atol=0
        )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_export_of_a_tp_checkpoint_equals_the_export_of_its_weights_written_unsharded(
    spawned: Runs, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from dapple.runtime.checkpoint import (
        CheckpointMeta,
        restore_stage,
        save_checkpoint,
        stage_layer_states,
    )
    from dapple.runtime.export import export_checkpoint
    from dapple.runtime.optim import make_optimizer
    from dapple.runtime.train_config import TrainConfig

    out, _ = spawned
    tp = _ckpt(out / "u-dp2xtp2", STEPS)
    # today's one-process path: the whole model restored from it and written again, unsharded
    wl = zoo()
    model = wl.build_stage(0, wl.num_layers, SEED)
    opt = make_optimizer(TrainConfig(optimizer="adamw", lr=LR, eps=EPS), list(model.parameters()))
    restore_stage(tp, model, 0, opt)
    meta = CheckpointMeta(model_name=tp.meta.model_name, num_layers=tp.meta.num_layers,
                          step=STEPS, optimizer_type="AdamW")  # fmt: skip
    plain = save_checkpoint(tmp_path / "plain", meta, stage_layer_states(model, 0, opt))
    _assert_equal(read_checkpoint(plain), tp)

    def exported(src: Path, name: str) -> dict[str, torch.Tensor]:
        res = export_checkpoint(src, tmp_path / name)
        files = [f for f in res.files if f.endswith(".safetensors")]
        return {k: v for f in files for k, v in load_file(res.path / f).items()}

    a, b = exported(tp.path, "from-tp"), exported(plain, "from-plain")
    assert a.keys() == b.keys() and len(a) == 2 + 2 * 12 + 2 * 2  # the weights, no state
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # and the TP run's export is the 2:2 run's within rounding
    c = exported(_ckpt(out / "u-2:2", STEPS).path, "from-2-2")
    assert c.keys() == a.keys()
    for k in a:
        _close_to_scale(a[k], c[k], k)


def _one_process_eval(ck: Checkpoint) -> float:
    """The whole zoo model with the checkpoint's weights, in eval mode: the mean loss over the
    run's eval batches."""
    from dapple.models.zoo.transformer import transformer
    from dapple.runtime.evaluate import eval_batch_fn

    model = _zoo_model()
    layers = load_layer_states(ck, range(ck.meta.num_layers)).values()
    model.load_state_dict({n: t for ls in layers for n, t in ls.tensors.items()})
    model.eval()
    wl = transformer(**ZOO)
    batch = eval_batch_fn(wl, G, EVAL_BATCHES)
    with torch.no_grad():
        losses = [float(wl.loss_fn(model(x), y)) for x, y in map(batch, range(EVAL_BATCHES))]
    return sum(losses) / EVAL_BATCHES


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(PLAIN))
def test_evaluation_of_a_cut_stage_equals_one_process_and_leaves_training_alone(
    spawned: Runs, name: str
) -> None:
    out, runs = spawned
    evaluated, plain = runs[f"e-{name}"], runs[f"u-{name}"]
    assert evaluated["loss"] == plain["loss"]
    for step in (CUT, STEPS):
        _assert_equal(_ckpt(out / f"e-{name}", step), _ckpt(out / f"u-{name}", step))
    assert [e is None for e in evaluated["eval"]] == [(t + 1) % CUT != 0 for t in range(STEPS)]
    got = [evaluated["eval"][step - 1] for step in (CUT, STEPS)]
    want = [_one_process_eval(_ckpt(out / f"u-{name}", step)) for step in (CUT, STEPS)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    assert got[0] != got[1]  # the weights moved between the evaluations

"""Small workloads for the runtime tests (importable as ``runtime_workloads:mlp`` etc.)."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.nn import functional as F

from dapple.errors import ValidationError
from dapple.models.tied import sum_tied_grads_local
from dapple.models.workload import Workload

IN, HID, OUT, CLASSES, VOCAB = 6, 12, 3, 5, 7


def _mlp_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def mlp(num_layers: int = 4) -> Workload:
    """A chain of Linear+Tanh blocks, MSE loss."""
    dims = [IN] + [HID] * (num_layers - 1) + [OUT]

    def block(i: int):
        return lambda: nn.Sequential(nn.Linear(dims[i], dims[i + 1]), nn.Tanh())

    return Workload(
        name="test-mlp",
        layer_factories=[block(i) for i in range(num_layers)],
        make_batch=_mlp_batch,
        loss_fn=F.mse_loss,
    )


def steep_mlp() -> Workload:
    """:func:`mlp` with its loss scaled by 1e15: gradients near 1e15 keep loss and gradient norm
    finite in float32, and an SGD step with ``lr`` 1e30 overflows every weight to infinity."""
    base = mlp(4)

    def steep_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target) * 1e15

    return Workload("test-steep-mlp", base.layer_factories, _mlp_batch, steep_loss)


def tied_mlp() -> Workload:
    """Like :func:`mlp`, but layers 1 and 2 share one weight (equal initial copies)."""

    def shared() -> nn.Module:
        block = nn.Sequential(nn.Linear(HID, HID), nn.Tanh())
        with torch.no_grad():
            block[0].weight.copy_(
                torch.randn(HID, HID, generator=torch.Generator().manual_seed(9)) * 0.3
            )
        return block

    base = mlp(4)
    return Workload(
        name="test-tied",
        layer_factories=[base.layer_factories[0], shared, shared, base.layer_factories[3]],
        make_batch=_mlp_batch,
        loss_fn=F.mse_loss,
        tied_parameters=[[(1, "0.weight"), (2, "0.weight")]],
    )


class _Head(nn.Module):
    """(x float, ids int64) -> (h, ids, skip): a tuple boundary with a non-float member."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(IN, HID)
        self.emb = nn.Embedding(VOCAB, HID)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]):
        x, ids = xs
        h = torch.tanh(self.lin(x)) + self.emb(ids)
        return h, ids, h * 0.5


class _Mid(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HID, HID)
        self.emb = nn.Embedding(VOCAB, HID)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        h, ids, skip = xs
        out = torch.tanh(self.lin(h)) + 0.5 * skip + self.emb(ids)
        return out, ids, h


class _Tail(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HID, CLASSES)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, _ids, skip = xs
        return self.lin(h + skip)


def _tuple_batch(n: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return (x, ids), y


def tuple_chain() -> Workload:
    """Four layers whose boundaries carry ``(float, int64, float)`` tuples; cross-entropy loss."""
    return Workload(
        name="test-tuple",
        layer_factories=[_Head, _Mid, _Mid, _Tail],
        make_batch=_tuple_batch,
        loss_fn=F.cross_entropy,
    )


# --------------------------------------------------------------------------------------------
# Multi-process drivers (spawned once per test module; loop over configurations inside).

WORKLOADS = {"mlp": mlp, "tuple": tuple_chain, "tied": tied_mlp}

# name -> ((layers, devices), ...) for a 4-layer model on <= 4 ranks
PLANS: dict[str, tuple[tuple[tuple[int, int], tuple[int, ...]], ...]] = {
    "straight2": (((0, 2), (0,)), ((2, 4), (1,))),
    "dp4": (((0, 4), (0, 1, 2, 3)),),
    "3:1": (((0, 2), (0, 1, 2)), ((2, 4), (3,))),
    "1:3": (((0, 1), (0,)), ((1, 4), (1, 2, 3))),
    "2:1:1": (((0, 2), (0, 1)), ((2, 3), (2,)), ((3, 4), (3,))),
    "2:1:1-permuted": (((0, 1), (2, 0)), ((1, 3), (3,)), ((3, 4), (1,))),
    "straight4": (((0, 1), (0,)), ((1, 2), (1,)), ((2, 3), (2,)), ((3, 4), (3,))),
}


def make_plan(name: str, schedule: str, policy: str, recompute: bool, b: int, m: int):
    from dapple.core.plan import Plan, StagePlan

    return Plan(
        planner="test",
        global_batch_size=b * m,
        micro_batch_size=b,
        num_micro_batches=m,
        schedule=schedule,  # type: ignore[arg-type]
        policy=policy,  # type: ignore[arg-type]
        stages=tuple(
            StagePlan(layers=lay, devices=dev, recompute="full" if recompute else "none")
            for lay, dev in PLANS[name]
        ),
    )


ZB_PLANS = ("straight4", "2:1:1", "1:3", "2:1:1-permuted")
"""The plans ZB-H1 runs in the equivalence configs (without re-computation)."""


def equivalence_configs() -> list[dict]:
    """Every plan x schedule x re-computation x workload; micro-batch 5 (uneven slices)."""
    out = []
    i = 0
    for plan in PLANS:
        for schedule, policy in (("dapple", "A"), ("gpipe", "A"), ("dapple", "B"), ("zbh1", "A")):
            for recompute in (False, True):
                if policy == "B" and recompute:
                    continue
                if schedule == "zbh1" and (recompute or plan not in ZB_PLANS):
                    continue
                for wl in ("mlp", "tuple", "tied"):
                    if (wl == "tied" and recompute) or (wl, schedule) == ("tied", "gpipe"):
                        continue
                    out.append(
                        dict(
                            plan=plan,
                            schedule=schedule,
                            policy=policy,
                            recompute=recompute,
                            workload=wl,
                            optimizer="adam" if i % 2 else "sgd",
                        )
                    )
                    i += 1
    return out


def config_id(c: dict) -> str:
    rc = "-recompute" if c["recompute"] else ""
    return f"{c['plan']}-{c['schedule']}{c['policy']}{rc}-{c['workload']}-{c['optimizer']}"


def reference_run(wl: Workload, optimizer: str, lr: float, seed: int, g: int, steps: int):
    """Single-process training of the whole model on the global batch."""
    model = wl.build_model(seed)
    opt = (
        torch.optim.Adam(model.parameters(), lr=lr)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=lr)
    )
    losses = []
    for step in range(steps):
        x, y = wl.make_batch(g, seed + step)
        opt.zero_grad()
        loss = wl.loss_fn(model(x), y)
        loss.backward()
        sum_tied_grads_local(list(model), wl.tied_parameters)
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def equivalence_worker(rank: int, world: int, out_dir: str) -> None:
    """Runs every configuration and compares this rank's parameters with the reference."""
    import json
    from pathlib import Path

    from dapple.runtime import TrainConfig, init_distributed, run_plan, shutdown_distributed

    b, m, steps, seed, lr = 5, 3, 3, 1, 0.05
    device = init_distributed(TrainConfig(timeout_s=60), world)
    results: dict[str, dict] = {}
    refs: dict[tuple[str, str], tuple] = {}
    for c in equivalence_configs():
        plan = make_plan(c["plan"], c["schedule"], c["policy"], c["recompute"], b, m)
        wl = WORKLOADS[c["workload"]]()
        cfg = TrainConfig(steps=steps, seed=seed, optimizer=c["optimizer"], lr=lr, timeout_s=60)
        run = run_plan(plan, wl, cfg, device=device, exact_world=False)
        key = (c["workload"], c["optimizer"])
        if key not in refs:
            refs[key] = reference_run(wl, c["optimizer"], lr, seed, b * m, steps)
        ref_model, ref_losses = refs[key]
        res: dict = {"ok": True, "checked": 0}
        try:
            if run.module is not None:
                lo, hi = plan.stages[run.stage].layers
                ref_stage = dict(nn.Sequential(*list(ref_model)[lo:hi]).named_parameters())
                mine = dict(run.module.named_parameters())
                assert mine.keys() == ref_stage.keys(), (mine.keys(), ref_stage.keys())
                for name, p in mine.items():
                    torch.testing.assert_close(p.detach(), ref_stage[name].detach(), msg=name)
                    res["checked"] += 1
            if rank == 0:
                got = [mm.loss for mm in run.metrics]
                torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses))
                res["losses"] = got
        except AssertionError as e:
            res = {"ok": False, "error": str(e)[:3000]}
        results[config_id(c)] = res
    # DAPPLE vs GPipe held activations as M grows (2-stage pipeline, micro-batch 4).
    mem: dict[str, list[int]] = {}
    for schedule in ("dapple", "gpipe"):
        for recompute in (False, True):
            for mbs in (2, 4, 8, 16):
                plan = make_plan("straight2", schedule, "A", recompute, 4, mbs)
                run = run_plan(plan, mlp(), TrainConfig(steps=1), device=device, exact_world=False)
                if rank == 0:
                    mem[f"{schedule}-{int(recompute)}-{mbs}"] = list(
                        run.metrics[0].peak_memory_bytes
                    )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"results": results, "memory": mem}))
    shutdown_distributed()


class _Branchy(nn.Module):
    """Control flow that depends on the data: ``torch.export`` cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, OUT), nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if bool(x.sum() > 0) else self.b(x)  # type: ignore[no-any-return]


def untraceable() -> Workload:
    """A user's module that ``torch.export`` cannot trace (for the error path)."""
    from dapple.models.split import workload_from_module

    return workload_from_module(_Branchy, _mlp_batch, F.mse_loss)


def overflowing_lm() -> Workload:
    """A tiny causal LM whose sequence length changes every step (4, 6, 8 tokens) and whose
    step-3 batch (seed 3) is longer than its position table (12 > 8 tokens)."""
    import dataclasses

    from dapple.models.zoo.transformer import transformer

    wl = transformer(layers=1, hidden=8, heads=2, seq=8, vocab=16, seq_choices=[4, 6, 8])

    def make_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seed % 4 != 3:
            return wl.make_batch(n, seed)
        tokens = torch.randint(0, 16, (n, 13), generator=torch.Generator().manual_seed(seed))
        return tokens[:, :-1].clone(), tokens[:, 1:].clone()

    return dataclasses.replace(wl, make_batch=make_batch)


def _var_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of side 8, 12 or 16 by seed (found dynamic: nothing declares them)."""
    g = torch.Generator().manual_seed(seed)
    side = (8, 12, 16)[seed % 3]
    return torch.randn(n, 3, side, side, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def var_cnn() -> Workload:
    """A small CNN (no batch norm) whose image size changes from step to step: two 3x3
    convolutions, global average pooling, a linear classifier."""

    def conv(cin: int, cout: int):
        return lambda: nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU())

    return Workload(
        name="test-var-cnn",
        layer_factories=[
            conv(3, 4),
            conv(4, 6),
            lambda: nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten()),
            lambda: nn.Linear(6, CLASSES),
        ],
        make_batch=_var_images,
        loss_fn=F.cross_entropy,
    )


def paramfree_mlp() -> Workload:
    """:func:`mlp` with a layer without parameters in the middle (its stage's ``W`` has no
    weights to compute)."""
    base = mlp(4)
    factories = [*base.layer_factories[:2], nn.Tanh, *base.layer_factories[2:]]
    return Workload("test-paramfree", factories, _mlp_batch, F.mse_loss)


def refusing_mlp() -> Workload:
    """:func:`mlp` whose last layer refuses to be built on rank 1 (a refusal in one worker
    after the rendezvous, while rank 0 waits for it in a collective)."""
    base = mlp(4)

    def last() -> nn.Module:
        if os.environ.get("RANK") == "1":
            raise ValidationError("layer 3 cannot be built on rank 1")
        return base.layer_factories[3]()

    return Workload("test-refusing-mlp", [*base.layer_factories[:3], last], _mlp_batch,
                    F.mse_loss)  # fmt: skip

"""``dapple verify`` and ``dapple.api`` without launching processes: the per-stage comparison,
the single-process reference, the gradient-perturbation hook, spec-loaded workloads that
pickle as their spec, and one-line CLI errors (multi-process runs: test_real_inputs.py)."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from rich.console import Console

import runtime_workloads as rw
from dapple import api
from dapple.cli import main
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.runtime.verify import (
    ATOL,
    PERTURBATION,
    StageDiff,
    VerifyReport,
    perturbed,
    reference_run,
    stage_diffs,
)

PLAN = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[2, 1])


def _params(value: float) -> dict[int, dict[str, torch.Tensor]]:
    return {i: {"w": torch.full((3,), value), "b": torch.zeros(2)} for i in range(4)}


def _runs(ref: dict[int, dict[str, torch.Tensor]]) -> list[dict[str, object]]:
    def clone(lo: int, hi: int) -> dict[int, dict[str, torch.Tensor]]:
        return {i: {n: t.clone() for n, t in ref[i].items()} for i in range(lo, hi)}

    return [
        {"stages": [0], "replica": 0, "layers": clone(0, 2)},
        {"stages": [0], "replica": 1, "layers": clone(0, 2)},
        {"stages": [1], "replica": 0, "layers": clone(2, 4)},
    ]


def test_stage_diffs_within_and_beyond_tolerance() -> None:
    ref = _params(2.0)
    runs = _runs(ref)
    exact = stage_diffs(PLAN, ref, runs, 1.3e-6, ATOL)
    assert [(d.stage, d.layers, d.replicas, d.num_params) for d in exact] == [
        (0, (0, 2), 2, 10),
        (1, (2, 4), 1, 10),
    ]
    assert all(d.ok and d.max_abs_diff == 0 for d in exact)
    # replica 1 of stage 0 drifts: within atol passes, beyond fails and is named
    runs[1]["layers"][1]["w"][0] += 0.5 * ATOL  # type: ignore[index]
    assert all(d.ok for d in stage_diffs(PLAN, ref, runs, 1.3e-6, ATOL))
    runs[1]["layers"][1]["b"][1] += 4 * ATOL  # type: ignore[index]
    s0, s1 = stage_diffs(PLAN, ref, runs, 1.3e-6, ATOL)
    assert not s0.ok and s1.ok
    assert s0.max_abs_diff == pytest.approx(4 * ATOL, rel=1e-3)
    assert s0.worst == "layer 1 b"
    assert s0.max_rel_diff == pytest.approx(
        0.5 * ATOL / 2.0, rel=1e-2
    )  # float32 rounding; zeros: atol only


def test_stage_diffs_rejects_missing_replica_or_parameter() -> None:
    ref = _params(1.0)
    runs = _runs(ref)
    with pytest.raises(ValidationError, match="stage 0: got the weights of 1 replicas"):
        stage_diffs(PLAN, ref, runs[1:], 1.3e-6, ATOL)
    del runs[2]["layers"][3]["w"]  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="layer 3 parameter 'w'"):
        stage_diffs(PLAN, ref, runs, 1.3e-6, ATOL)


def test_nan_parameter_fails() -> None:
    ref = _params(1.0)
    runs = _runs(ref)
    runs[2]["layers"][2]["w"][1] = float("nan")  # type: ignore[index]
    assert [d.ok for d in stage_diffs(PLAN, ref, runs, 1.3e-6, ATOL)] == [True, False]


def test_reference_chain_keeps_tied_copies_equal_and_matches_manual_sgd() -> None:
    wl = rw.tied_mlp()
    losses, params, kind = reference_run(wl, 6, 3, seed=1, lr=0.1)
    assert kind == "layer chain" and len(losses) == 3
    torch.testing.assert_close(params[1]["0.weight"], params[2]["0.weight"], rtol=0, atol=0)
    # the untied layer 0 changed by exactly SGD on the summed-tied model's gradient
    model = wl.build_model(1)
    tied = torch.nn.Parameter(model[1][0].weight.detach().clone())
    model[1][0].weight = tied
    model[2][0].weight = tied  # one parameter, as in an unsplit model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = wl.make_batch(6, 1 + step)
        opt.zero_grad()
        loss = wl.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        assert losses[step] == pytest.approx(float(loss.detach()), rel=1e-6)
    torch.testing.assert_close(params[0]["0.weight"], model[0][0].weight.detach())
    torch.testing.assert_close(params[2]["0.weight"], tied.detach())


def test_perturbed_layers_shift_every_gradient() -> None:
    wl = rw.mlp(2)
    plain, shifted = wl.build_layer(0, 3), perturbed(wl).build_layer(0, 3)
    x, _ = wl.make_batch(4, 0)
    for layer in (plain, shifted):
        layer(x).sum().backward()
    for a, b in zip(plain.parameters(), shifted.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad + PERTURBATION)


def test_report_verdict_and_printing() -> None:
    good = StageDiff(0, (0, 2), 2, 10, 1e-9, 1e-8, True, "layer 0 w")
    bad = StageDiff(1, (2, 4), 1, 10, 3e-4, 1e-2, False, "layer 3 lm_head.weight",
                    first_failure="step 1 weights of layer 3 lm_head.weight (replica 0)")  # fmt: skip
    rep = VerifyReport(PLAN, "m", "layer chain", (good, bad), (2.0, 1.5), (2.0, 1.25))
    assert not rep.ok and rep.max_abs_diff == 3e-4 and rep.max_loss_diff == 0.25
    assert not dataclasses.replace(rep, stages=(good,)).ok  # the losses alone differ
    assert not rep.losses_ok
    assert dataclasses.replace(rep, stages=(good,), reference_losses=(2.0, 1.5)).ok
    from dapple.cli.verify_cmd import print_report

    con = Console(record=True, width=120)
    print_report(con, rep)
    text = con.export_text()
    assert "FAIL" in text and "MISMATCH" in text
    assert "stage 1: step 1 weights of layer 3 lm_head.weight (replica 0)" in text
    assert "1.5000000" in text and "1.2500000" in text  # losses side by side


USER = """
from dapple.models.workload import Workload
import runtime_workloads as rw

def factory(num_layers=4):
    return rw.mlp(num_layers)
"""


def test_load_pickles_as_its_spec_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    wl = api.load("model.py:factory", num_layers=3)
    assert wl.num_layers == 3
    again = pickle.loads(pickle.dumps(wl))
    assert again.num_layers == 3 and again is not wl
    # the spec was made absolute: it loads from any working directory
    monkeypatch.chdir(tmp_path.parent)
    assert pickle.loads(pickle.dumps(wl)).num_layers == 3
    torch.testing.assert_close(
        again.build_layer(1, 5).state_dict(), wl.build_layer(1, 5).state_dict()
    )


def test_api_rejects_overrides_on_built_workload_and_bad_plan_overrides() -> None:
    with pytest.raises(ValidationError, match="overrides"):
        api.train(PLAN, rw.mlp(4), 1, overrides={"num_layers": 2})
    with pytest.raises(ValidationError, match="schedule"):
        api.verify(PLAN, rw.mlp(4), 1, schedule="pipedream")
    with pytest.raises(ValidationError, match="expected a Workload"):
        api.verify(PLAN, 42, 1)  # type: ignore[arg-type]


def test_api_profile_plan_simulate(tmp_path: Path) -> None:
    prof = api.profile(rw.mlp(4), batch_sizes=[1, 2], repeats=1, warmup=0)
    plan = api.plan(prof, "local-cpu", 8, output=tmp_path / "plan.json")
    assert plan.num_layers == 4 and (tmp_path / "plan.json").exists()
    sim = api.simulate(tmp_path / "plan.json", prof, "local-cpu", schedule="gpipe")
    assert sim.step_ms > 0


def test_cli_verify_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    PLAN.save(tmp_path / "plan.json")
    base = ["verify", "--plan", str(tmp_path / "plan.json"), "--model", "runtime_workloads:mlp"]
    assert main([*base, "--set", "num_layers=6"]) == 2  # the plan covers 4 layers, not 6
    err = capsys.readouterr().err
    assert err.startswith("dapple: error:") and err.count("\n") == 1 and "6" in err
    assert main([*base, "--set", "layers"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main([*base, "--rtol", "-1"]) == 2
    assert "tolerances" in capsys.readouterr().err


# -- the step-by-step comparison --------------------------------------------------------------
def _grad_run(layers: dict[int, dict[str, torch.Tensor]], stage: int, replica: int = 0):
    pieces = [
        (i, n, 0, g.reshape(-1).clone()) for i, layer in layers.items() for n, g in layer.items()
    ]
    return {"stages": [stage], "replica": replica, "grads": pieces}


def test_grad_diffs_judge_each_gradient_by_its_layers_scale() -> None:
    from dapple.runtime.verify import GRAD_RTOL, grad_diffs

    ref = {i: {"w": torch.full((3,), 1.0 + i), "b": torch.zeros(2)} for i in range(4)}
    runs = [_grad_run({i: ref[i] for i in (0, 1)}, 0, j) for j in (0, 1)]
    runs.append(_grad_run({i: ref[i] for i in (2, 3)}, 1))
    assert all(d.grad_ok and d.max_grad_diff == 0 for d in grad_diffs(PLAN, ref, runs, GRAD_RTOL))
    # rounding noise on a gradient that is 0 (a key bias): judged by the layer's scale, passes
    runs[0]["grads"][1][3][:] = 1e-9  # type: ignore[index]
    s0, _ = grad_diffs(PLAN, ref, runs, GRAD_RTOL)
    assert s0.grad_ok and s0.max_grad_diff == pytest.approx(1e-9 / 1.0)
    # a ZeRO piece: elements [1, 3) of layer 3's w, compared with that slice
    runs[2]["grads"] = [(3, "w", 1, torch.tensor([4.0, 4.0 + 1e-2]))]
    _, s1 = grad_diffs(PLAN, ref, runs, GRAD_RTOL, "step 2 ")
    assert not s1.grad_ok and s1.max_grad_diff == pytest.approx(1e-2 / 4.0, rel=1e-4)
    assert s1.first_failure == "step 2 gradient of layer 3 w (replica 0)"
    runs[2]["grads"] = [(3, "w", 2, torch.ones(2))]  # past the end of the parameter
    with pytest.raises(ValidationError, match="layer 3 'w'"):
        grad_diffs(PLAN, ref, runs, GRAD_RTOL)


@pytest.mark.parametrize("opts", [dict(optimizer="sgd", lr=0.1, momentum=0.9),
                                  dict(optimizer="adamw", lr=0.01, clip_grad_norm=0.05)])  # fmt: skip
def test_forced_reference_fed_its_own_steps_is_the_free_run(opts: dict[str, object]) -> None:
    """Stepping the forced reference along itself (its gradients, its updated weights)
    reproduces the free-running reference exactly, tied layer chain included."""
    from dapple.runtime.verify import ForcedReference
    from dapple.runtime.verify.reference import config

    wl = rw.tied_mlp()
    losses, final, _ = reference_run(wl, 6, 3, seed=1, **opts)  # type: ignore[arg-type]
    optim = {k: v for k, v in opts.items() if k not in ("optimizer", "lr")}
    ref = ForcedReference(wl, 6, config(3, 1, str(opts["optimizer"]), float(opts["lr"]), optim))  # type: ignore[arg-type]
    weights = ref.initial
    for t in range(3):
        probe = ForcedReference(wl, 6, ref.cfg)  # the gradients at these weights, first
        for _ in range(t):
            next(probe._batches)
        grads = probe.step(t, weights, {i: {n: torch.zeros_like(v) for n, v in layer.items()}
                                        for i, layer in weights.items()}).grads  # fmt: skip
        res = ref.step(t, weights, grads)
        assert res.loss == pytest.approx(losses[t], rel=1e-6)
        weights = res.expected
    for i in final:
        for n in final[i]:
            torch.testing.assert_close(weights[i][n], final[i][n], rtol=0, atol=0)

"""``recompute`` has one vocabulary (``none``/``selective``/``full``, :mod:`dapple.core.recompute`)
in ``dapple profile``, ``dapple train``, their API keywords and config keys, and the plan's
stages; the runtime takes ``none`` and ``full``, and the old switch is refused naming them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import runtime_workloads as rw
from dapple.api.profiling import ProfileConfig, check_mode_options
from dapple.api.run_config import ModelConfig, load_run_config
from dapple.cli import main
from dapple.core.plan import Plan, straight_plan
from dapple.core.recompute import Recompute
from dapple.core.stage_plan import StagePlan
from dapple.errors import ValidationError
from dapple.runtime.memory import ActivationMeter
from dapple.runtime.precision import Precision
from dapple.runtime.rank import ExecutorFactory, build_layers
from dapple.runtime.stage import StageExecutor
from dapple.runtime.train_config import TrainConfig
from dapple.runtime.transport import BoundarySpec

CPU = torch.device("cpu")


def _train_error(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """``dapple train``'s stderr for ``flags``; no plan file exists, so the flags' own check
    is what stops it (before anything is read or computed)."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--plan", "nowhere.json", "-m", "mlp", *flags])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_train_refuses_the_bare_switch_naming_the_values(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = _train_error(capsys, "--recompute", "--steps", "2")
    assert err == (
        "dapple: error: --recompute takes none or full now (the bare switch was --recompute full)\n"
    )


@pytest.mark.parametrize(
    ("value", "why"), [("selective", " (the runtime re-computes whole stages)"), ("yes", "")]
)
def test_train_refuses_a_mode_it_does_not_run_in_one_line(
    capsys: pytest.CaptureFixture[str], value: str, why: str
) -> None:
    err = _train_error(capsys, "--recompute", value)
    assert err == f"dapple: error: --recompute must be none or full{why}, got {value!r}\n"


def test_train_config_takes_the_modes_and_refuses_a_bool() -> None:
    assert TrainConfig().recompute is None  # each stage as its plan says
    assert TrainConfig(recompute="full").recompute is Recompute.FULL  # type: ignore[arg-type]
    assert TrainConfig(recompute="none").recompute is Recompute.NONE  # type: ignore[arg-type]
    with pytest.raises(ValidationError) as e:
        TrainConfig(recompute=True)  # type: ignore[arg-type]
    assert str(e.value) == (
        "recompute must be none or full, not True (a bool was train's old switch: full now)"
    )
    with pytest.raises(ValidationError, match=r"^recompute must be none or full \(the runtime"):
        TrainConfig(recompute="selective")  # type: ignore[arg-type]


def test_a_run_file_takes_the_mode_and_refuses_the_old_bool(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[train]\nrecompute = "full"\n')
    assert load_run_config(path).train.recompute is Recompute.FULL
    path.write_text("[train]\nrecompute = true\n")
    with pytest.raises(ValidationError, match=r"recompute must be none or full, not True"):
        load_run_config(path)


def test_print_config_writes_the_mode_and_reads_it_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--plan", "p.json", "-m", "mlp", "--recompute", "full", "--print-config"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert 'recompute = "full"' in text.splitlines()
    (tmp_path / "run.toml").write_text(text)
    assert load_run_config(tmp_path / "run.toml").train.recompute is Recompute.FULL


def test_a_stage_records_the_mode_and_an_old_plan_file_still_loads(tmp_path: Path) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[1, 1])
    stages = (StagePlan(layers=(0, 2), devices=(0,), recompute="full"),  # type: ignore[arg-type]
              plan.stages[1])  # fmt: skip
    plan = dataclasses.replace(plan, stages=stages)
    assert [st.recompute for st in plan.stages] == [Recompute.FULL, Recompute.NONE]
    assert [st["recompute"] for st in plan.to_dict()["stages"]] == ["full", "none"]
    old = plan.to_dict()
    for st, was in zip(old["stages"], (True, False), strict=True):
        st["recompute"] = was  # a plan file written while it was a bool
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert Plan.load(tmp_path / "old.json").stages == plan.stages
    with pytest.raises(ValidationError, match=r"^stage \[0, 2\]: recompute must be none or full"):
        StagePlan(layers=(0, 2), devices=(0,), recompute=True)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"got 'selective'"):
        StagePlan(layers=(0, 2), devices=(0,), recompute="selective")  # type: ignore[arg-type]


def test_profile_takes_all_three_modes_and_refuses_a_bool_in_the_same_words() -> None:
    model = ModelConfig(spec="llama3-8b")
    check_mode_options(ProfileConfig(model=model, analytic="h100", recompute="selective"))
    with pytest.raises(ValidationError) as e:
        check_mode_options(ProfileConfig(model=model, analytic="h100", recompute=True))  # type: ignore[arg-type]
    assert str(e.value).startswith("--recompute must be none, selective, full, not True")


@pytest.mark.parametrize(
    ("run_mode", "stage_mode", "recomputes"),
    [(None, "full", True), (None, "none", False), (Recompute.NONE, "full", False),
     (Recompute.FULL, "none", True)],
)  # fmt: skip
def test_the_run_mode_overrides_each_stage_and_none_leaves_the_plan_s(
    run_mode: Recompute | None, stage_mode: str, recomputes: bool
) -> None:
    wl = rw.mlp()
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[1, 1])
    stages = tuple(StagePlan(layers=st.layers, devices=st.devices, recompute=stage_mode)  # type: ignore[arg-type]
                   for st in plan.stages)  # fmt: skip
    plan = dataclasses.replace(plan, stages=stages)
    layers = build_layers(plan, wl, 0, CPU, 1)
    factory = ExecutorFactory(layers, [BoundarySpec.of(torch.zeros(1, rw.HID))], wl.loss_fn, CPU,
                              run_mode, ActivationMeter(), Precision("fp32", CPU), dynamic=False,
                              seed=0)  # fmt: skip
    ex = factory(plan, True)
    assert isinstance(ex, StageExecutor) and ex.recompute is recomputes
    ev = factory(plan, False)
    assert isinstance(ev, StageExecutor) and ev.recompute is False  # evaluation never does

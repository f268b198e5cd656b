"""The tensor-parallel and ZeRO-3 plan space at the user's interface, and its bad inputs.

``dapple plan --tensor-widths`` / ``--zero-stage 3`` (and :func:`dapple.api.plan`) reach the
planner; each bad input is refused in one line ``dapple: error: ...`` before any work: widths
outside 1, 2, 4, 8 or not dividing the server size, widths > 1 for a profile where no layer
shards, on shared cores or with a baseline planner; a tensor group across servers (simulate,
train with a cluster); ZeRO-3 on one replica (plan load); and, for ``dapple train`` /
``verify``, a model without a TP plan, a width that does not divide its heads, or a stage the
plan cuts nothing of (:mod:`dapple.runtime.parallel.tensor_check`). The expensive step (the search, the
event simulation, the runtime) is replaced by a function that fails the test, so each refusal
is proved to come first.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from builders import boom, make_cluster, make_profile, one_error_line
from dapple import api
from dapple.cli import main
from dapple.core.plan import Plan, StagePlan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.planner import make_plan
from dapple.runtime.precision import CPU_FP16_ENV

ZOO = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64}
LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 48,
    "max_position_embeddings": 32,
}


def tp_profile(n: int = 8) -> ModelProfile:
    """A chain whose inner layers shard (as a profile of a model with a TP plan marks them)."""
    p = make_profile(n=n, params=4_000_000, act=100_000.0)
    marked = (dataclasses.replace(x, tensor_parallel=0 < i < n - 1) for i, x in enumerate(p.layers))
    return dataclasses.replace(p, layers=tuple(marked))


@pytest.fixture
def profiles(tmp_path: Path) -> tuple[Path, Path]:
    """A profile file whose inner layers shard, and one where none does."""
    tp, plain = tmp_path / "tp.json", tmp_path / "plain.json"
    tp_profile().save(tp)
    make_profile(n=8, params=4_000_000, act=100_000.0).save(plain)
    return tp, plain


@pytest.fixture
def no_search(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dapple.planner.dapple_search", boom)
    from dapple.planner.registry import PLANNERS

    monkeypatch.setitem(PLANNERS, "dp", dataclasses.replace(PLANNERS["dp"], rule=boom))


def _columns(shown: str) -> str:
    """The header row of the printed stage table."""
    return next(line for line in shown.splitlines() if "layers" in line and "replicas" in line)


def _plan(profile: Path, *extra: str) -> int:
    argv = ["plan", "--profile", str(profile), "--cluster", "local-cpu"]
    return main([*argv, "--global-batch-size", "8", *extra])


# -- dapple plan --------------------------------------------------------------------------------
def test_plan_searches_the_widths_asked_and_shows_them(
    profiles: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tp, _ = profiles
    out = tmp_path / "p.json"
    assert _plan(tp, "--tensor-widths", "2", "-o", str(out)) == 0
    shown = capsys.readouterr().out
    plan = Plan.load(out)
    assert max(st.tensor_width for st in plan.stages) == 2  # the one width asked for
    assert "tensor width" in _columns(shown) and "zero stage" not in _columns(shown)
    assert plan == api.plan(tp, "local-cpu", 8, tensor_widths=[2])
    assert _plan(tp, "--tensor-widths", "1", "-o", str(out)) == 0
    assert "tensor width" not in _columns(capsys.readouterr().out)
    assert {st.tensor_width for st in Plan.load(out).stages} == {1}
    auto = make_plan(tp_profile(), make_cluster(), 8)  # width_candidates: 1, 2, 4
    assert auto == make_plan(tp_profile(), make_cluster(), 8, tensor_widths=[1, 2, 4])
    assert auto == api.plan(tp_profile(), make_cluster(), 8, tensor_widths="auto")


def test_plan_zero_stage_3_is_recorded_and_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    argv = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a", "--zero-stage", "3"]
    assert main([*argv, "-o", str(out)]) == 0
    out_text = capsys.readouterr().out
    plan = Plan.load(out)
    assert any(st.replicas > 1 for st in plan.stages)
    assert all(st.zero_stage == (3 if st.replicas > 1 else 0) for st in plan.stages)
    assert "zero stage" in _columns(out_text) and "tensor width" not in _columns(out_text)
    assert "stage 0 (r=8) zero stage 3" in " ".join(out_text.split())
    assert plan == api.plan("paper:bert48", "paper-a", zero_stage=3)


@pytest.mark.usefixtures("no_search")
def test_plan_refuses_widths_for_a_profile_where_no_layer_shards(
    profiles: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, plain = profiles
    for widths in ("2", "1,2"):
        assert _plan(plain, "--tensor-widths", widths) == 2
        one_error_line(capsys, "no layer of profile 'toy' shards over a tensor group",
                        "the model has no TP plan")  # fmt: skip
    with pytest.raises(ValidationError, match=r"tensor widths \[2, 4\]: no layer of profile"):
        api.plan(plain, "local-cpu", 8, tensor_widths=(4, 2))


@pytest.mark.usefixtures("no_search")
@pytest.mark.parametrize("widths", ["3", "0", "16", "x", "2,", "auto,2", "-2"])
def test_plan_refuses_widths_outside_1_2_4_8(
    widths: str, profiles: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _plan(profiles[0], "--tensor-widths", widths) == 2
    one_error_line(
        capsys,
        f"--tensor-widths must be auto or comma-separated widths from 1, 2, 4, 8, got {widths!r}",
    )


@pytest.mark.usefixtures("no_search")
def test_api_refuses_widths_outside_1_2_4_8() -> None:
    for bad in ([3], [], "all", [True]):
        with pytest.raises(ValidationError, match="tensor_widths must be auto or widths from"):
            api.plan(tp_profile(), make_cluster(), 8, tensor_widths=bad)
    with pytest.raises(ValidationError, match="tensor widths must each be one of 1, 2, 4, 8"):
        make_plan(tp_profile(), make_cluster(), 8, tensor_widths=[6])


@pytest.mark.usefixtures("no_search")
def test_plan_refuses_a_width_wider_than_or_not_dividing_the_server(
    profiles: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _plan(profiles[0], "--tensor-widths", "1,8") == 2  # local-cpu: 4 per server
    one_error_line(capsys, "tensor width(s) [8] do not divide the 4 devices of a server of "
                    "local-cpu", "widths that fit: [1, 2, 4]")  # fmt: skip
    six = tmp_path / "six.json"
    make_cluster(per_server=6).save(six)
    argv = ["plan", "--profile", str(profiles[0]), "--cluster", str(six)]
    assert main([*argv, "--global-batch-size", "8", "--tensor-widths", "2,4"]) == 2
    one_error_line(capsys, "tensor width(s) [4] do not divide the 6 devices", "fit: [1, 2]")


@pytest.mark.usefixtures("no_search")
def test_plan_refuses_widths_on_shared_cores_and_with_a_baseline(
    profiles: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "shared.json"
    dataclasses.replace(make_cluster(), compute_cores_per_server=2.0).save(shared)
    argv = ["plan", "--profile", str(profiles[0]), "--global-batch-size", "8"]
    assert main([*argv, "--cluster", str(shared), "--tensor-widths", "2"]) == 2
    one_error_line(capsys, "share 2 compute cores per server", "no tensor groups")
    assert main([*argv, "--cluster", "local-cpu", "--tensor-widths", "2", "--planner", "dp"]) == 2
    one_error_line(capsys, "tensor widths [2] are searched by the dapple planner only, not 'dp'")


@pytest.mark.usefixtures("no_search")
def test_plan_refuses_zero_stages_it_does_not_know(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a"]
    for bad in ("4", "x", "-1"):
        assert main([*argv, "--zero-stage", bad]) == 2
        one_error_line(capsys, f"--zero-stage must be one of 0, 1, 2, 3 or auto, got {bad!r}")


# -- plan files and simulate ------------------------------------------------------------------
def _stages_plan(stages: list[StagePlan]) -> Plan:
    return Plan(planner="manual", global_batch_size=8, micro_batch_size=4, num_micro_batches=2,
                stages=tuple(stages))  # fmt: skip


def test_zero_stage_3_on_one_replica_is_refused_at_plan_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ok = _stages_plan([StagePlan(layers=(0, 4), devices=(0, 1), tensor_width=2)])
    d = ok.to_dict()
    d["stages"][0]["zero_stage"] = 3  # its one replica is one tensor group of two devices
    path = tmp_path / "z3.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValidationError, match=r"plan stage 0: stage .* has one replica"):
        Plan.load(path)
    monkeypatch.setattr(importlib.import_module("dapple.simulate.engine"), "_Run", boom)
    argv = ["simulate", "--plan", str(path), "--profile", "paper:bert48", "--cluster", "paper-a"]
    assert main(argv) == 2
    one_error_line(capsys, "zero_stage 3 shards parameters over the replicas", "one replica",
                    "tensor_width=2")  # fmt: skip


def test_simulate_refuses_a_tensor_group_across_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = _stages_plan([StagePlan(layers=(0, 4), devices=(0,)),
                         StagePlan(layers=(4, 8), devices=(1, 2), tensor_width=2)])  # fmt: skip
    files = {"plan": tmp_path / "p.json", "profile": tmp_path / "tp.json",
             "cluster": tmp_path / "c.json"}  # fmt: skip
    plan.save(files["plan"])
    tp_profile().save(files["profile"])
    make_cluster(servers=2, per_server=2).save(files["cluster"])
    monkeypatch.setattr(importlib.import_module("dapple.simulate.engine"), "_Run", boom)
    assert main(["simulate", *(f"--{k}={v}" for k, v in files.items())]) == 2
    one_error_line(capsys, "plan stage 1 [4, 8]: tensor group 0 on devices [1, 2] spans "
                    "servers [0, 1]")  # fmt: skip


# -- dapple train and verify -------------------------------------------------------------------
def zoo_tp() -> Workload:
    """The zoo transformer traced into pieces (embedding, block, block, head) with its TP plan."""
    from dapple.models.split import workload_from_module
    from dapple.models.tp_plan import TRANSFORMER_TP_PLAN
    from dapple.models.zoo.transformer import transformer

    wl = transformer(**ZOO)
    traced = workload_from_module(
        lambda: transformer(**ZOO).build_model(), wl.make_batch, wl.loss_fn,
        split_at=["1", "2", "3"],
    )  # fmt: skip
    return dataclasses.replace(traced, tp_plan=dict(TRANSFORMER_TP_PLAN))


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    """A tiny LLaMA config (random weights when loaded as ``hf:DIR``)."""
    tf = pytest.importorskip("transformers")
    path = tmp_path / "llama"
    tf.LlamaConfig(**LLAMA).save_pretrained(path)
    return path


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime fails the test; as one torchrun rank, so no early workers start."""
    monkeypatch.setattr("dapple.runtime.train", boom)
    monkeypatch.setattr("dapple.runtime.verify.verify", boom)
    monkeypatch.setattr("dapple.runtime.verify.verify_many", boom)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")


def _tp_plan_file(tmp_path: Path, t: int, layers: tuple[int, int] = (0, 4)) -> Path:
    stages = [StagePlan(layers=layers, devices=(0, 1, 2, 3), tensor_width=t)]
    if layers[1] < 4:
        stages.append(StagePlan(layers=(layers[1], 4), devices=(4,)))
    path = tmp_path / f"plan-t{t}.json"
    _stages_plan(stages).save(path)
    return path


@pytest.mark.usefixtures("no_run")
def test_train_and_verify_refuse_a_width_that_does_not_divide_the_heads(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _tp_plan_file(tmp_path, 4)  # 2 key/value heads
    for cmd in ("train", "verify"):
        assert main([cmd, "--plan", str(plan), "-m", f"hf:{llama_dir}"]) == 2
        one_error_line(capsys, "plan stage 0 [0, 4] (tensor_width 4): TP width 4 does not "
                        "divide the 2 key/value heads", "num_attention_heads 4",
                        "hidden_size 32")  # fmt: skip
    zoo = f"{Path(__file__).resolve()}:zoo_tp"
    with pytest.raises(ValidationError, match=r"plan stage 0 \[0, 4\] \(tensor_width 8\): "
                       r"layer 1: TP width 8 does not divide size 4"):  # fmt: skip
        api.verify(_stages_plan([StagePlan(layers=(0, 4), devices=tuple(range(8)),
                                           tensor_width=8)]), zoo)  # fmt: skip


@pytest.mark.usefixtures("no_run")
def test_train_refuses_tensor_parallelism_for_a_model_without_a_tp_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _tp_plan_file(tmp_path, 2, layers=(0, 4))
    argv = ["train", "--plan", str(plan), "-m", "transformer", "--set", "layers=2"]
    assert main(argv) == 2
    one_error_line(capsys, "plan stage 0 [0, 4] (tensor_width 2): model 'transformer' has no "
                    "TP plan")  # fmt: skip


@pytest.mark.usefixtures("no_run")
def test_train_refuses_a_tensor_stage_the_plan_cuts_nothing_of(tmp_path: Path) -> None:
    plan = _stages_plan([StagePlan(layers=(0, 1), devices=(0, 1), tensor_width=2),
                         StagePlan(layers=(1, 4), devices=(2,))])  # fmt: skip
    zoo = f"{Path(__file__).resolve()}:zoo_tp"
    with pytest.raises(ValidationError, match=r"plan stage 0 \[0, 1\] \(tensor_width 2\): the "
                       "TP plan of model .* cuts none of its layers"):  # fmt: skip
        api.train(plan, zoo)


@pytest.mark.usefixtures("no_run")
def test_train_with_a_cluster_refuses_a_tensor_group_across_servers(
    llama_dir: Path, tmp_path: Path
) -> None:
    plan = _stages_plan([StagePlan(layers=(0, 1), devices=(0,)),
                         StagePlan(layers=(1, 4), devices=(1, 2), tensor_width=2)])  # fmt: skip
    profile = dataclasses.replace(tp_profile(4), model_name="hf-llama")
    with pytest.raises(ValidationError, match=r"plan stage 1 \[1, 4\]: tensor group 0 on "
                       r"devices \[1, 2\] spans servers \[0, 1\]"):  # fmt: skip
        api.train(plan, f"hf:{llama_dir}", profile=profile, cluster=make_cluster(2, 2))


@pytest.mark.usefixtures("no_run")
def test_train_refuses_what_tensor_stages_cannot_run_yet_before_the_launch(
    llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """:func:`dapple.runtime.parallel.stage_mesh.check_mesh_run` runs in ``dapple train`` before the
    workers get the run, not only in each worker."""
    monkeypatch.setenv(CPU_FP16_ENV, "1")  # fp16 on the CPU: what is left is the stage's refusal
    stage = StagePlan(layers=(0, 4), devices=(0, 1, 2, 3), tensor_width=2)
    plan = Plan(planner="manual", global_batch_size=8, micro_batch_size=4, num_micro_batches=2,
                stages=(stage,))  # fmt: skip
    path = tmp_path / "tp2-fp16.json"
    plan.save(path)
    assert main(["train", "--plan", str(path), "-m", f"hf:{llama_dir}", "--precision", "fp16"]) == 2
    one_error_line(capsys, "stage 0 [0, 4] (tensor_width 2, zero 0): precision fp16 with TP")

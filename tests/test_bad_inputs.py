"""Bad inputs are refused in one line ``dapple: error: ...`` before any work starts.

Cluster files with NaN or Infinity, huge global batch sizes, ``dapple data prepare`` outputs
that cannot be written or inputs that are not text, unwritable ``--metrics`` paths, and plans
made for another model. The fast tests drive the CLI in this process with the expensive step
(the planner, the tokenizer, ``dapple.runtime.train``) replaced by a function that fails the
test, so each refusal is proved to come first; the ``slow`` one runs real processes.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from builders import boom, make_cluster, make_profile, one_error_line
from dapple import api
from dapple.cli import main
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan, straight_plan
from dapple.errors import ValidationError
from dapple.planner import make_plan
from dapple.planner.batches import divisors
from dapple.planner.scorer import Scorer
from dapple.planner.search import (
    DIVISOR_SCAN,
    MAX_GLOBAL_BATCH_SIZE,
    MAX_MICRO_BATCH_COUNTS,
    micro_batch_candidates,
)
from dapple.runtime.train_config import TrainConfig

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False
"""Root passes every permission check: chmod-based cases are skipped then."""


def _unwritable_dir(tmp_path: Path) -> Path:
    """A folder nobody may write into (skipped where permissions do not bind)."""
    if ROOT:
        pytest.skip("root writes into read-only folders")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    return d


SYS = Path("/sys")
needs_sys = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and SYS.is_dir()),
    reason="needs Linux /sys, a folder no process (not even root) can create files in",
)

# ---------------------------------------------------------------------------------------------
# 1. cluster files with NaN / Infinity

_CLUSTER = {
    "servers": 1,
    "devices_per_server": 2,
    "device_memory_gib": 4,
    "intra_server_bandwidth_gbps": 10,
    "inter_server_bandwidth_gbps": 10,
}
_NUMERIC = [
    "device_memory_gib",
    "device_memory_bytes",
    "reserved_memory_gib",
    "intra_server_bandwidth_gbps",
    "inter_server_bandwidth_gbps",
    "intra_server_latency_ms",
    "inter_server_latency_ms",
    "compute_slowdown",
    "compute_cores_per_server",
    "background_load_per_server",
    "action_overhead_ms",
    "step_overhead_ms",
    "comm_cpu_ms_per_mb",
]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", _NUMERIC)
def test_cluster_file_with_non_finite_number(
    field: str,
    value: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = field.startswith("device_memory")  # given once: replaces device_memory_gib
    d: dict[str, Any] = {
        k: v for k, v in _CLUSTER.items() if not (memory and k == "device_memory_gib")
    }
    d[field] = "@@"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d).replace('"@@"', value))  # json.loads accepts the literals
    monkeypatch.setattr("dapple.planner.make_plan", boom)
    argv = ["plan", "--profile", "paper:bert48", "--cluster", str(path)]
    assert main([*argv, "--global-batch-size", "8"]) == 2
    shown = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}[value]
    one_error_line(capsys, field, f"got {shown}")


def test_toml_cluster_with_nan(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    lines = [f"{k} = {v}" for k, v in _CLUSTER.items() if k != "device_memory_gib"]
    path.write_text("\n".join([*lines, "device_memory_gib = nan"]) + "\n")
    with pytest.raises(ValidationError, match="device_memory_gib must be a finite number, got nan"):
        load_cluster(str(path))


# ---------------------------------------------------------------------------------------------
# 2. huge global batch sizes


def test_micro_batch_candidates_are_divisors_bounded_in_number() -> None:
    for g in range(1, 1500):  # every divisor while there are few (at most 36 below 1500)
        every = [m for m in range(1, g + 1) if g % m == 0]
        assert divisors(g) == every == micro_batch_candidates(g)
    prime = 9007199254740881  # the largest prime below 2^53
    for g in (720720, 735134400, 10**10, 2**40, 10**15, prime, MAX_GLOBAL_BATCH_SIZE):
        ms = micro_batch_candidates(g)
        assert ms == sorted(set(ms)) and all(g % m == 0 for m in ms)
        assert ms[0] == 1 and ms[-1] == g and len(ms) <= MAX_MICRO_BATCH_COUNTS
    assert micro_batch_candidates(prime) == [1, prime]
    # small M stay dense when the candidates are thinned
    assert micro_batch_candidates(720720)[:16] == list(range(1, 17))
    with pytest.raises(ValidationError, match="above the largest the planner handles"):
        micro_batch_candidates(MAX_GLOBAL_BATCH_SIZE + 1)


class _CountingInt(int):
    """An int that counts the divisions (``%``) made on it."""

    calls = 0

    def __mod__(self, other: int) -> int:
        _CountingInt.calls += 1
        return int(self) % other


def test_divisor_search_work_is_bounded() -> None:
    _CountingInt.calls = 0
    got = divisors(_CountingInt(10**18), DIVISOR_SCAN)
    assert _CountingInt.calls <= DIVISOR_SCAN  # a scan up to 10**18 would never end
    assert all(10**18 % d == 0 for d in got) and 2**16 in got and 10**18 // 2**16 in got
    _CountingInt.calls = 0
    assert divisors(_CountingInt(10**10)) == divisors(10**10)
    assert _CountingInt.calls == 10**5  # sqrt(n) trial divisions, all divisors


def test_planner_tries_a_bounded_set_of_m_for_a_huge_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: set[int] = set()
    score = Scorer.score

    def spy(self: Scorer, stages: Any, M: int, **kw: Any) -> Any:
        seen.add(M)
        return score(self, stages, M, **kw)

    monkeypatch.setattr(Scorer, "score", spy)
    for planner in ("dapple", "dp", "straight"):
        seen.clear()
        plan = make_plan(make_profile(6), make_cluster(), 10**12, planner)
        assert 0 < len(seen) <= MAX_MICRO_BATCH_COUNTS and plan.num_micro_batches in seen
        assert plan.global_batch_size == 10**12


@pytest.mark.timeout(120)
def test_cli_plans_a_huge_batch_in_bounded_time(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 10^10 plans with a bounded number of candidates scored (3,742 at the time of
    writing, against 1,366 for a batch of 64): the work, not a shared machine's wall time."""
    from dapple.planner.scorer import Scorer

    scored = [0]
    score = Scorer.score

    def counted(self: Scorer, *args: Any, **kwargs: Any) -> Any:
        scored[0] += 1
        return score(self, *args, **kwargs)

    monkeypatch.setattr(Scorer, "score", counted)
    argv = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a", "--global-batch-size"]
    assert main([*argv, "64"]) == 0
    small, scored[0] = scored[0], 0
    assert main([*argv, "10000000000"]) == 0
    assert "predicted step" in capsys.readouterr().out
    assert 0 < scored[0] <= 5 * small, f"{scored[0]} candidates scored, {small} for a batch of 64"


def test_cli_refuses_batches_beyond_float_exactness(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a", "--global-batch-size"]
    assert main([*argv, str(10**400)]) == 2
    one_error_line(capsys, "(401 digits)", f"{MAX_GLOBAL_BATCH_SIZE:,}")
    assert main([*argv, str(MAX_GLOBAL_BATCH_SIZE + 1)]) == 2
    one_error_line(capsys, str(MAX_GLOBAL_BATCH_SIZE + 1))


def test_cli_refuses_simulating_too_many_micro_batches(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a", "--schedule", "zbh1"]
    assert main([*argv, "--global-batch-size", "10000000000"]) == 2
    one_error_line(capsys, "--schedule zbh1 simulates every micro-batch", "micro-batches x")


def test_plan_output_checked_before_planning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dapple.planner.make_plan", boom)
    argv = ["plan", "--profile", "paper:bert48", "--cluster", "paper-a", "-o"]
    assert main([*argv, str(tmp_path)]) == 2
    one_error_line(capsys, "is a directory")
    (tmp_path / "f").write_text("x")
    assert main([*argv, str(tmp_path / "f" / "plan.json")]) == 2
    one_error_line(capsys, "is a file, not a directory")


# ---------------------------------------------------------------------------------------------
# 3. dapple data prepare


PREPARE = importlib.import_module("dapple.datasets.prepare")
"""The module (``dapple.datasets.prepare`` the attribute is the function of that name)."""


@pytest.fixture
def text(tmp_path: Path) -> Path:
    p = tmp_path / "in.txt"
    p.write_text("some text to tokenize, long enough for a split\n" * 4)
    return p


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the inputs or tokenizing fails the test: the outputs are checked first."""
    monkeypatch.setattr(PREPARE, "_read_text", boom)
    monkeypatch.setattr(PREPARE, "_byte_tokens", boom)


def _prepare(*argv: str) -> int:
    return main(["data", "prepare", *argv])


@pytest.mark.usefixtures("no_work")
def test_prepare_output_is_a_directory(
    text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert _prepare(str(text), "-o", str(out)) == 2
    one_error_line(capsys, f"output {str(out)!r} is a directory")
    assert list(out.iterdir()) == [] and not (tmp_path / "meta.json").exists()
    (out / "val.bin").mkdir()  # the validation file beside train.bin
    assert _prepare(str(text), "-o", str(out / "train.bin")) == 2
    one_error_line(capsys, "validation file", "val.bin' is a directory")


@pytest.mark.usefixtures("no_work")
def test_prepare_output_under_a_regular_file(
    text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    for out in (f / "train.bin", f / "deeper" / "train.bin"):
        assert _prepare(str(text), "-o", str(out)) == 2
        one_error_line(capsys, f"{str(f)!r} is a file, not a directory")
    assert f.read_text() == "x"


@pytest.mark.usefixtures("no_work")
def test_prepare_output_folder_not_writable(
    text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ro = _unwritable_dir(tmp_path)
    assert _prepare(str(text), "-o", str(ro / "sub" / "train.bin")) == 2
    one_error_line(capsys, str(ro))


@needs_sys
@pytest.mark.usefixtures("no_work")
def test_prepare_output_where_even_root_cannot_write(
    text: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _prepare(str(text), "-o", str(SYS / "train.bin")) == 2
    one_error_line(capsys, "'/sys'")


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"ab\x00cd", "NUL byte at offset 2"),
        (bytes(range(256)), "NUL byte at offset 0"),
        ("caf\u00e9".encode("latin-1"), "byte 0xe9 at offset 3"),
        ("hi".encode("utf-16"), "NUL byte at offset 3"),
    ],
)
@pytest.mark.parametrize("documents", [False, True])
def test_prepare_binary_input(
    data: bytes,
    needle: str,
    documents: bool,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(PREPARE, "_byte_tokens", boom)
    monkeypatch.setattr(PREPARE, "_tokenize_each", boom)
    good, bad = tmp_path / "good.txt", tmp_path / "data.bin"
    good.write_text("fine text\n")
    bad.write_bytes(data)
    out = tmp_path / "out" / "train.bin"
    argv = [str(good), str(bad), "-o", str(out), *(["--documents"] if documents else [])]
    assert _prepare(*argv) == 2
    one_error_line(capsys, f"text file {str(bad)!r}", needle)
    assert not (tmp_path / "out").exists()


def test_prepare_still_writes_good_text(text: Path, tmp_path: Path) -> None:
    out = tmp_path / "new" / "dir" / "train.bin"
    assert _prepare(str(text), "-o", str(out)) == 0
    assert out.stat().st_size == 2 * (text.stat().st_size - int(text.stat().st_size * 0.01))
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".dapple-write-probe")]


# ---------------------------------------------------------------------------------------------
# 4. --metrics of dapple train


@pytest.fixture
def mlp_plan(tmp_path: Path) -> Path:
    """A plan of the zoo ``mlp`` (5 layers) on two devices."""
    plan = straight_plan(5, [0, 2], global_batch_size=4, num_micro_batches=2, model_name="mlp")
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def _train(plan: Path, *extra: str) -> int:
    return main(["train", "--plan", str(plan), "-m", "mlp", "--steps", "1", *extra])


@pytest.fixture
def no_train(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dapple.runtime.train", boom)


@pytest.mark.usefixtures("no_train")
def test_metrics_path_is_checked_before_training(
    mlp_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(mlp_plan, "--metrics", str(tmp_path)) == 2
    one_error_line(capsys, "--metrics file", "is a directory")
    f = tmp_path / "file"
    f.write_text("x")
    assert _train(mlp_plan, "--metrics", str(f / "m.jsonl")) == 2
    one_error_line(capsys, "--metrics file", f"{str(f)!r} is a file, not a directory")
    with pytest.raises(AssertionError, match="work started"):  # a missing folder is made later
        _train(mlp_plan, "--metrics", str(tmp_path / "missing" / "m.jsonl"))
    assert not (tmp_path / "missing").exists()
    good = tmp_path / "m.jsonl"
    assert _train(mlp_plan, "--metrics", str(good), "--loss-curve", str(tmp_path)) == 2
    one_error_line(capsys, "loss curve", "is a directory")
    assert not good.exists()  # checked, not created


@pytest.mark.usefixtures("no_train")
def test_metrics_folder_not_writable(
    mlp_plan: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ro = _unwritable_dir(tmp_path)
    assert _train(mlp_plan, "--metrics", str(ro / "m.jsonl")) == 2
    one_error_line(capsys, "--metrics file", "not writable")


@needs_sys
@pytest.mark.usefixtures("no_train")
def test_metrics_where_even_root_cannot_write(
    mlp_plan: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(mlp_plan, "--metrics", str(SYS / "m.jsonl")) == 2
    one_error_line(capsys, "--metrics file", "'/sys'")


def test_metrics_check_reaches_training(
    mlp_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A good path passes the check and reaches the (stubbed) run."""
    called: list[str | None] = []

    def fake_train(plan: Any, workload: Any, config: TrainConfig, **_: Any) -> list[Any]:
        called.append(config.metrics_path)
        return []

    monkeypatch.setattr("dapple.runtime.train", fake_train)
    assert _train(mlp_plan, "--metrics", str(tmp_path / "m.jsonl")) == 0
    assert called == [str(tmp_path / "m.jsonl")]


@pytest.mark.usefixtures("no_train")
def test_the_api_checks_its_outputs_before_loading_anything(
    mlp_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``api.train`` (both forms) refuses rank 0's outputs it could not write before it loads
    the plan or the model, naming the options as the API spells them."""
    monkeypatch.setattr("dapple.api.running.run_inputs", boom)  # loading would fail the test
    monkeypatch.setattr("dapple.api.running.plan_with", boom)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for options, needle in (
        ({"metrics_path": str(tmp_path)}, "metrics_path file"),
        ({"metrics_path": str(a_file / "m.jsonl")}, "is a file, not a directory"),
        ({"tensorboard_dir": str(a_file)}, "tensorboard_dir"),
        ({"checkpoint_dir": str(a_file)}, "checkpoint_dir"),
    ):
        with pytest.raises(ValidationError, match=needle):
            api.train(mlp_plan, "mlp", **options)
    cfg = _run_config(mlp_plan, metrics_path=str(tmp_path))
    with pytest.raises(ValidationError, match="metrics_path file"):
        api.train(cfg)
    with pytest.raises(ValidationError, match="--metrics file"):
        api.train(cfg, flags=True)
    monkeypatch.setenv("RANK", "1")  # only rank 0 writes them
    with pytest.raises(AssertionError, match="work started"):
        api.train(cfg)


def _run_config(plan: Path, **train: Any) -> Any:
    """A ``RunConfig`` of the zoo ``mlp`` on ``plan`` with these ``TrainConfig`` fields."""
    from dapple.api.run_config import ModelConfig, PlanChoice, RunConfig

    return RunConfig(model=ModelConfig(spec="mlp"), plan=PlanChoice(path=str(plan)),
                     train=TrainConfig(steps=1, **train))  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 5. plans made for another model


def test_plan_records_its_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = make_plan(make_profile(6, name="chain6"), make_cluster(), 8)
    assert (plan.model_name, plan.num_layers) == ("chain6", 6)
    d = plan.to_dict()
    assert (d["model_name"], d["num_layers"]) == ("chain6", 6)
    assert Plan.from_dict(d) == plan
    prof, cluster, out = tmp_path / "prof.json", tmp_path / "c.json", tmp_path / "p.json"
    make_profile(7, name="chain7").save(prof)
    make_cluster().save(cluster)
    argv = ["plan", "--profile", str(prof), "--cluster", str(cluster), "-o", str(out)]
    assert main([*argv, "--global-batch-size", "8"]) == 0
    saved = json.loads(out.read_text())
    assert (saved["model_name"], saved["num_layers"]) == ("chain7", 7)


def test_old_plan_files_load_and_num_layers_must_agree() -> None:
    d = make_plan(make_profile(6), make_cluster(), 8).to_dict()
    old = {k: v for k, v in d.items() if k not in ("num_layers", "model_name")}
    plan = Plan.from_dict(old)
    assert plan.model_name == "" and plan.num_layers == 6
    plan.check_model("anything", 6)  # no recorded model: any name
    with pytest.raises(
        ValidationError, match=r"num_layers is 7 but the stages cover layers \[0, 6\)"
    ):
        Plan.from_dict({**d, "num_layers": 7})


def test_check_model_messages() -> None:
    plan = dataclasses.replace(make_plan(make_profile(6), make_cluster(), 8), model_name="toy")
    plan.check_model("toy", 6)
    with pytest.raises(
        ValidationError, match=r"made for model 'toy' \(6 layers\), not for 'mlp' \(6 layers\)"
    ):
        plan.check_model("mlp", 6)
    with pytest.raises(
        ValidationError, match=r"covers layers \[0, 6\) but the model has 5 layers: .*'toy'"
    ):
        plan.check_model("mlp", 5)


@pytest.mark.usefixtures("no_train")
def test_train_refuses_a_plan_of_another_model(
    mlp_plan: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # transformer with 3 blocks has 5 layers, like the plan: only the name tells them apart
    argv = ["train", "--plan", str(mlp_plan), "-m", "transformer", "--set", "layers=3"]
    assert main(argv) == 2
    one_error_line(capsys, "made for model 'mlp' (5 layers), not for 'transformer' (5 layers)")


def test_verify_and_api_refuse_a_plan_of_another_model(
    mlp_plan: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dapple.runtime.train", boom)
    argv = ["verify", "--plan", str(mlp_plan), "-m", "transformer", "--set", "layers=3"]
    assert main(argv) == 2
    one_error_line(capsys, "made for model 'mlp'", "'transformer'")
    with pytest.raises(ValidationError, match="made for model 'mlp'"):
        api.train(mlp_plan, "transformer", overrides={"layers": 3})
    with pytest.raises(ValidationError, match="made for model 'mlp'"):
        api.verify(mlp_plan, "transformer", overrides={"layers": 3})


@pytest.mark.slow
def test_profile_plan_train_with_the_right_and_a_wrong_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof, plan, metrics = tmp_path / "p.json", tmp_path / "plan.json", tmp_path / "m.jsonl"
    assert main(["profile", "-m", "mlp", "--batch-sizes", "1,2", "--repeats", "1",
                 "--warmup", "0", "-o", str(prof)]) == 0  # fmt: skip
    assert main(["plan", "--profile", str(prof), "--cluster", "local-cpu", "--servers", "1",
                 "--global-batch-size", "4", "-o", str(plan)]) == 0  # fmt: skip
    assert json.loads(plan.read_text())["model_name"] == "mlp"
    capsys.readouterr()
    argv = ["train", "--plan", str(plan), "--steps", "1", "--device", "cpu"]
    assert main([*argv, "-m", "transformer", "--set", "layers=3"]) == 2
    one_error_line(capsys, "made for model 'mlp'")
    assert main([*argv, "-m", "mlp", "--metrics", str(metrics), "--timeout-s", "120"]) == 0
    assert len(metrics.read_text().splitlines()) == 1


def test_the_api_checks_its_output_files_before_the_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``profile``, ``calibrate``, ``plan`` and ``plan_local`` of the Python API refuse an output
    they could not write before they measure or search (as their commands do), not after."""
    from dapple.api.run_config import ModelConfig

    for where in ("dapple.profiler.measure.profile_workload", "dapple.calibrate.machine.calibrate",
                  "dapple.planner.make_plan", "dapple.calibrate.local.plan_local"):  # fmt: skip
        monkeypatch.setattr(where, boom)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    bad = str(a_file / "out.json")  # under a file: no folder can be made there
    with pytest.raises(ValidationError, match=r"output profile file .*is a file"):
        api.profile(api.ProfileConfig(model=ModelConfig(spec="mlp"), output=bad))
    with pytest.raises(ValidationError, match=r"output cluster file .*is a file"):
        api.calibrate(api.CalibrateConfig(nproc=2, output=bad))
    with pytest.raises(ValidationError, match=r"output plan file .*is a file"):
        api.plan("paper:bert48", "paper-a", 64, output=bad)
    with pytest.raises(ValidationError, match=r"out_dir .*is a file"):
        api.plan_local(api.PlanLocalConfig(model=ModelConfig(spec="mlp"), global_batch_size=8,
                                           out_dir=str(a_file)))  # fmt: skip


def test_the_api_plan_local_refuses_before_it_measures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``api.plan_local`` refuses a batch below 1 and more local processes than the host can
    start before it profiles or starts anything (it profiled for a batch of 0, and tried to
    start 1,000 processes), naming the options as the API spells them."""
    from dapple.api.run_config import ModelConfig

    monkeypatch.setattr("dapple.calibrate.local.plan_local", boom)
    model = ModelConfig(spec="mlp")
    with pytest.raises(ValidationError, match="global_batch_size must be >= 1, got 0"):
        api.plan_local(api.PlanLocalConfig(model=model, global_batch_size=0))
    with pytest.raises(ValidationError, match="nprocs 2,100000: 100,000 local processes need"):
        api.plan_local(api.PlanLocalConfig(model=model, global_batch_size=8, nprocs=(2, 100000)))
    with pytest.raises(AssertionError, match="work started"):
        api.plan_local(api.PlanLocalConfig(model=model, global_batch_size=8, nprocs=(2,)))


def test_the_api_calibrate_refuses_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``api.calibrate`` makes ``dapple calibrate``'s checks itself, naming the options as the
    API spells them: more processes than the host can start, a repeat count without end and
    counts that are not integers are refused before any process starts."""
    monkeypatch.setattr("dapple.calibrate.machine.calibrate", boom)
    with pytest.raises(ValidationError, match="nproc 100000: 100,000 local processes need"):
        api.calibrate(api.CalibrateConfig(nproc=100000))
    with pytest.raises(ValidationError, match=r"^max_mb must be a number"):
        api.calibrate(api.CalibrateConfig(max_mb=0.0))
    for bad in (0, 10**9):  # 10**9 measured without end
        with pytest.raises(
            ValidationError, match=rf"^repeats must be from 1 to 1000 .*, got {bad}"
        ):
            api.calibrate(api.CalibrateConfig(repeats=bad))
    for field, value in (("repeats", 1.5), ("nproc", 2.0), ("nproc", True)):
        with pytest.raises(ValidationError, match=rf"^{field} must be an integer, got {value!r}"):
            api.calibrate(api.CalibrateConfig(**{field: value}))  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="work started"):
        api.calibrate(api.CalibrateConfig(nproc=2))


def test_the_api_generate_refuses_a_seed_or_prompt_before_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``api.generate`` refuses a seed torch's generator cannot take (torch raised a bare
    ``ValueError``) and a prompt that is not text, before it loads the model."""
    from dapple.api.run_config import ModelConfig

    monkeypatch.setattr("dapple.api._inputs.as_workload", boom)
    model = ModelConfig(spec="transformer")
    with pytest.raises(ValidationError, match=f"^seed must be an integer from .* got {2**70}"):
        api.generate(api.GenerateConfig(model=model, prompt="x", seed=2**70))
    with pytest.raises(ValidationError, match=r"^the prompt is not UTF-8 text: byte 0xe9"):
        api.generate("transformer", "a\udce9b")
    with pytest.raises(AssertionError, match="work started"):
        api.generate(api.GenerateConfig(model=model, prompt="x", seed=-(2**63)))


@pytest.mark.parametrize(
    ("field", "value"),
    [("steps", 1.5), ("steps", True), ("seed", 0.5), ("keep", 2.0), ("eval_batch_size", True),
     ("grad_norm_every", 2.0), ("save_every", 1e3)],
)  # fmt: skip
def test_train_config_whole_numbers_are_integers(field: str, value: object) -> None:
    """The Python API passes ``TrainConfig``'s counts through as given: ``steps=1.5`` started
    every worker, and each failed (``'float' object cannot be interpreted as an integer``)."""
    from dapple.runtime.train_config import TrainConfig

    with pytest.raises(ValidationError, match=rf"^{field} must be an integer, got {value!r}$"):
        TrainConfig(**{field: value})


def test_train_config_takes_numpy_integers_and_none_where_optional() -> None:
    import numpy as np

    from dapple.runtime.train_config import TrainConfig

    cfg = TrainConfig(steps=np.int64(3), keep=None, eval_batch_size=None)
    assert cfg.steps == 3


def test_the_api_refuses_a_fractional_step_count_before_any_worker(
    mlp_plan: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dapple.api.running._launch", boom)
    for run in (api.train, api.verify):
        with pytest.raises(ValidationError, match=r"steps must be an integer, got 1\.5"):
            run(mlp_plan, "mlp", 1.5)
    with pytest.raises(ValidationError, match=r"eval_batches must be an integer, got 2\.5"):
        api.train(mlp_plan, "mlp", 1, eval_batches=2.5)  # RunOptions


def test_calibrate_repeats_are_a_bounded_count(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``dapple calibrate --repeats 1000000000`` measured without end."""
    monkeypatch.setattr("dapple.calibrate.machine.calibrate", boom)
    argv = ["calibrate", "--repeats", str(10**9), "-o", str(tmp_path / "c.json")]
    assert main(argv) == 2
    assert "--repeats must be from 1 to 1000" in capsys.readouterr().err


def test_plan_local_repeats_are_a_bounded_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dapple plan-local --repeats 1000000000`` profiled without end (profile's own
    ``--repeats`` stops at 1,000); a float failed in torch."""
    from dapple.api.profiling import MAX_RUNS
    from dapple.api.run_config import ModelConfig

    monkeypatch.setattr("dapple.calibrate.local.plan_local", boom)
    monkeypatch.setattr("dapple.models.zoo.load_workload", boom)
    argv = ["plan-local", "-m", "mlp", "--global-batch-size", "8", "--out-dir", str(tmp_path)]
    assert main([*argv, "--repeats", str(10**9)]) == 2
    err = capsys.readouterr().err
    assert f"--repeats must be an integer from 1 to {MAX_RUNS}" in err and "1000000000" in err
    model = ModelConfig(spec="mlp")
    for bad in (0, 1.5, True, MAX_RUNS + 1):
        cfg = api.PlanLocalConfig(model=model, global_batch_size=8, repeats=bad)  # type: ignore[arg-type]
        with pytest.raises(ValidationError, match=r"^repeats must be an integer"):
            api.plan_local(cfg)

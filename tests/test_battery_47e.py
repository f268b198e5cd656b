"""Issue 47 (re-run G, 2026-11-29): what a hostile battery of the features new that day still
found: a mixed cluster cut to the devices a small batch can use lost its device kinds (every
planner but the dapple search's large-batch path refused with a contradiction the user never
wrote), device kinds of absurd memory or speed (a traceback; L = 0.00 ms), a kind named by an
object, and ``plan --schedule zbv`` on a planner's plan the V cannot cut, refused without
saying it was the planner's plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from builders import make_profile, one_error_line
from dapple.cli import main
from dapple.core.cluster import GIB
from dapple.core.cluster_presets import load_cluster
from dapple.core.usable import usable_cluster

MIXED = Path(__file__).resolve().parents[1] / "examples" / "mixed.json"
"""One server of 8 H100 (80 GiB), then one of 8 A100-40GB, profiled on an H100."""


def _cluster(tmp_path: Path, kinds: list[dict[str, Any]]) -> str:
    d = json.loads(MIXED.read_text())
    d["kinds"] = kinds
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_usable_cut_keeps_the_kinds_of_the_servers_it_keeps() -> None:
    cluster = load_cluster(str(MIXED))
    cut = usable_cluster(cluster, 4)
    assert (cut.servers, [(k.name, k.servers) for k in cut.kinds]) == (1, [("H100", 1)])
    assert cut.device_memory_bytes == 80 * GIB  # the A100-40GB server is not kept
    assert usable_cluster(cluster, 9).kinds == cluster.kinds


@pytest.mark.parametrize("argv", [["--planner", "dp"], ["--planner", "straight"], []])
def test_a_small_batch_plans_on_a_mixed_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """A batch of 2 on 4 layers can use at most 8 devices of the 16: the cut cluster's kinds
    used to be the whole cluster's ("its device kinds hold 2 servers ..., the cluster 1")."""
    prof = tmp_path / "p.json"
    make_profile(4).save(prof)
    rc = main(["plan", "--profile", str(prof), "--cluster", str(MIXED),
               "--global-batch-size", "2", *argv])  # fmt: skip
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "predicted step L" in out.out


_KIND = {"name": "X", "servers": 2, "speed": 1.0, "device_memory_gib": 40}


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("device_memory_gib", 1e300, "device_memory_gib must be from"),  # was OverflowError
        ("device_memory_gib", -4, "device_memory_gib must be from"),  # was in bytes
        ("device_memory_gib", 1e-12, "got 1e-12"),  # was "got 0" bytes
        ("speed", 1e300, "speed must be from 0.0001 to 10000"),  # was L = 0.00 ms
        ("speed", 1e-300, "speed must be from 0.0001 to 10000"),  # was L = 1e26 ms
        ("name", {"a": 1}, "name must be a non-empty string"),  # was the dict's str()
        ("name", "", "name must be a non-empty string"),
    ],
)
def test_device_kind_fields_out_of_range_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: Any, needle: str
) -> None:
    path = _cluster(tmp_path, [{**_KIND, field: value}])
    assert main(["plan", "--profile", "paper:bert48", "--cluster", path]) == 2
    one_error_line(capsys, "cluster 'mixed'", needle)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_plan_schedule_the_v_cannot_cut_names_the_planners_plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], schedule: str
) -> None:
    """The dp planner's one stage is no V; the refusal said only "got 1 (4)"."""
    prof = tmp_path / "p.json"
    make_profile(4).save(prof)
    rc = main(["plan", "--profile", str(prof), "--cluster", "local-cpu", "--global-batch-size",
               "4", "--planner", "dp", "--schedule", schedule])  # fmt: skip
    assert rc == 2
    one_error_line(capsys, f"--schedule {schedule} cannot run the dp planner's plan",
                   "stages [0, 4), replication 4", "--schedule best")  # fmt: skip


def test_simulate_refuses_expert_widths_on_stages_without_experts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dense profile's stage of e_s = 2 was simulated and reported "expert widths: stage 0
    e_s=2 (1 group of 2 replicas)"."""
    from dapple.core.plan import straight_plan

    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    make_profile(4).save(prof)
    p = straight_plan(4, [0], global_batch_size=4, num_micro_batches=2, replicas=[2])
    d = p.to_dict()
    d["stages"][0]["expert_width"] = 2
    plan.write_text(json.dumps(d))
    rc = main(["simulate", "--plan", str(plan), "--profile", str(prof), "--cluster", "h100-8x"])
    assert rc == 2
    one_error_line(capsys, "plan stage 0 [0, 4): expert_width 2", "no mixture-of-experts layer")


@pytest.mark.parametrize("module", ["unittest.__main__", "a b", "os/path", 7])
def test_a_plan_file_names_no_program_as_its_schedule_module(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], module: Any
) -> None:
    """``unittest.__main__`` was imported: unittest's own command line parsed dapple's
    arguments ("unrecognized arguments: --plan ...")."""
    from dapple.core.plan import straight_plan

    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    make_profile(4).save(prof)
    d = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).to_dict()
    d["schedule_module"] = module
    plan.write_text(json.dumps(d))
    rc = main(["simulate", "--plan", str(plan), "--profile", str(prof), "--cluster", "h100-8x"])
    assert rc == 2
    one_error_line(capsys, "schedule_module must be the dotted name of a module")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-m", "transformer", "--recompute", "full"], "--recompute full applies to --analytic"),
        (["-m", "mixtral-8x7b", "--analytic", "h100", "--co-workers", "3"],
         "--co-workers 3 applies to measured CPU profiles only"),
    ],
)  # fmt: skip
def test_profile_refuses_an_option_of_the_other_kind_of_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    """Both were accepted and ignored: a measured profile without re-computation, an analytic
    one written as if no co-workers were asked for."""
    out = tmp_path / "p.json"
    assert main(["profile", *argv, "-o", str(out)]) == 2
    one_error_line(capsys, needle)
    assert not out.exists()


@pytest.mark.parametrize("model", ["transformer", "transformer-tp"])
def test_a_dynamic_dimension_the_input_lacks_is_refused(
    capsys: pytest.CaptureFixture[str], model: str
) -> None:
    """Input 0 is (batch, seq): dimension 9 was taken without a word by a layer chain, and
    ended in "cannot trace Sequential with torch.export: IndexError" for a traced model."""
    rc = main(["split", "-m", model, "--set", "layers=2", "--set", "hidden=32",
               "--dynamic-dims", "0:9=seq"])  # fmt: skip
    assert rc == 2
    one_error_line(capsys, "dynamic_dims: input 0 has 2 dimensions", "no dimension 9")


def test_split_at_on_a_model_that_cannot_take_it_names_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It said "bad arguments ['split_at'] (got an unexpected keyword argument 'split_at')", an
    argument the user never --set."""
    rc = main(["split", "-m", "transformer", "--set", "layers=2", "--split-at", "block0"])
    assert rc == 2
    one_error_line(capsys, "model 'transformer' takes no split_at: --split-at cuts a model")


@pytest.mark.parametrize("mine", [None, ".dapple-demo", "summary.json"])
def test_demo_refuses_an_out_dir_of_a_users_files(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    mine: str | None,
) -> None:
    """``demo --out-dir`` a directory of the user's wrote plan.json, profile.json, data/ ...
    over theirs; a directory an earlier demo made (its marker, or a finished demo's summary)
    is the demo's to replace."""
    from builders import boom

    monkeypatch.setattr("dapple.cli._demo_corpus.stdlib_sources", boom)  # no demo step runs
    (tmp_path / "plan.json").write_text("mine")
    if mine is None:
        assert main(["demo", "--out-dir", str(tmp_path)]) == 2
        one_error_line(capsys, "holds files the demo did not write (plan.json)")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    else:
        (tmp_path / mine).write_text("{}")
        with pytest.raises(AssertionError, match="work started"):  # past the checks
            main(["demo", "--out-dir", str(tmp_path)])
    assert (tmp_path / "plan.json").read_text() == "mine"


def test_no_plan_on_device_kinds_names_each_kinds_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "fits 16 devices of 1.00 GiB" for 8 devices of 1 GiB beside 8 of 80 GiB."""
    path = _cluster(tmp_path, [{**_KIND, "servers": 1, "device_memory_gib": 1},
                               {**_KIND, "name": "Y", "servers": 1, "device_memory_gib": 80}])  # fmt: skip
    assert main(["plan", "--profile", "paper:bert48", "--cluster", path]) == 2
    one_error_line(capsys, "fits 16 devices (X: 8 of 1.00 GiB, Y: 8 of 80.00 GiB)")


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("device_memory_gib", 1e300, "=1e+300 is more than 1 EiB per device"),
        ("device_memory_bytes", float("inf"), " must be a finite number, got inf"),
        ("reserved_memory_gib", 1e300, "=1e+300 is more than 1 EiB per device"),
    ],
)
def test_cluster_memory_past_an_exbibyte_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, value: float, needle: str
) -> None:
    """A cluster's own memory field of 1e300 GiB was an OverflowError traceback."""
    d = {"servers": 1, "devices_per_server": 2, "intra_server_bandwidth_gbps": 100,
         "inter_server_bandwidth_gbps": 10, "device_memory_gib": 16}  # fmt: skip
    if field == "device_memory_bytes":
        del d["device_memory_gib"]
    d[field] = value
    path = tmp_path / "c.json"
    path.write_text(json.dumps(d))
    assert main(["plan", "--profile", "paper:bert48", "--cluster", str(path)]) == 2
    one_error_line(capsys, "cluster 'c'", f"{field}{needle}")

"""What a hostile re-run of issue 47's battery (2026-11-29, 268 commands) still found, each
refused in one line before any work, or said: inputs overwritten by outputs, an unreadable token
file, a loss curve in an unknown format, whole-model commands without a size check, a plan of
another model's tensors, a NaN tolerance, and profiles that cannot be checked against a plan."""

from __future__ import annotations

import dataclasses
import errno
import json
import math
from pathlib import Path
from typing import Any

import pytest

from builders import boom, make_cluster, make_profile, one_error_line
from dapple import api
from dapple.cli import main
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.datasets.token_file import TokenFile
from dapple.errors import ValidationError
from dapple.models.fingerprint import layer_tensors, model_fingerprint
from dapple.models.zoo import load_workload

TINY = {"layers": 2, "hidden": 32, "heads": 2, "seq": 8, "vocab": 64}
HUGE = ["--set", "layers=2", "--set", "hidden=10000000"]


def _files(tmp_path: Path) -> tuple[Path, Path]:
    prof, cluster = tmp_path / "p.json", tmp_path / "c.json"
    make_profile(4).save(prof)
    make_cluster(1, 2).save(cluster)
    return prof, cluster


@pytest.mark.parametrize("out", ["p.json", "c.json"])
def test_plan_output_is_never_an_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], out: str
) -> None:
    prof, cluster = _files(tmp_path)
    before = {p: p.read_bytes() for p in (prof, cluster)}
    argv = ["plan", "--profile", str(prof), "--cluster", str(cluster)]
    rc = main([*argv, "--global-batch-size", "4", "-o", str(tmp_path / out)])
    assert rc == 2
    one_error_line(capsys, "-o/--output", "writing it would replace that input")
    assert {p: p.read_bytes() for p in (prof, cluster)} == before


def test_import_and_simulate_outputs_are_never_their_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    graph = tmp_path / "g.txt"
    graph.write_text("node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, "
                     "activation_size=4.0, parameter_size=0.0\n")  # fmt: skip
    assert main(["import-pipedream", str(graph), "-o", str(graph)]) == 2
    one_error_line(capsys, "is the GRAPH file", "replace that input")
    prof, cluster = _files(tmp_path)
    plan = tmp_path / "plan.json"
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(plan)
    text = plan.read_text()
    argv = ["simulate", "--plan", str(plan), "--profile", str(prof), "--cluster", str(cluster)]
    assert main([*argv, "--trace", str(plan)]) == 2
    one_error_line(capsys, "--trace", "--plan")
    assert plan.read_text() == text


def test_unreadable_or_directory_token_file(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ValidationError, match="is a directory"):
        TokenFile(tmp_path, 4)
    data = tmp_path / "t.bin"
    data.write_bytes(bytes(4000))

    def denied(self: Path, *_a: object, **_k: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "open", denied)  # root reads a chmod 000 file: refuse by hand
    with pytest.raises(ValidationError, match=r"cannot read data file .*Permission denied"):
        TokenFile(data, 4)


def test_loss_curve_format_is_checked_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    plan = tmp_path / "plan.json"
    straight_plan(4, [0], global_batch_size=2, num_micro_batches=1).save(plan)
    monkeypatch.setattr("dapple.cli.train_cmd._checked_train", boom)
    sets = [x for k, v in TINY.items() for x in ("--set", f"{k}={v}")]
    argv = ["train", "--plan", str(plan), "-m", "transformer", *sets, "--device", "cpu"]
    assert main([*argv, "--loss-curve", str(tmp_path / "x.json")]) == 2
    one_error_line(capsys, "loss curve file", "unknown picture format '.json'")


def test_whole_model_commands_size_the_model_first(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["split", "-m", "transformer", *HUGE]) == 2
    one_error_line(capsys, "splitting 'transformer' needs at least", "host memory")
    with pytest.raises(ValidationError, match="generating with 'transformer' needs at least"):
        api.generate("transformer", "hi", 2, overrides={"layers": 2, "hidden": 10**7})


def test_a_huge_layer_has_its_shapes_on_meta() -> None:
    """The shape checks (export, resume) and the fingerprint read a layer built on ``meta``:
    a 10^7-wide layer has its shapes there, with nothing allocated."""
    wl = load_workload("transformer", layers=2, hidden=10**7)
    shapes = [layer_tensors(wl, i) for i in range(wl.num_layers)]
    assert all(s is not None for s in shapes)
    assert shapes[1] is not None and [10**7] in [shape for shape, _ in shapes[1].values()]
    assert model_fingerprint(wl) != model_fingerprint(load_workload("transformer", **TINY))


def test_train_refuses_a_plan_of_other_tensors(monkeypatch) -> None:
    monkeypatch.setattr("dapple.runtime.train", boom)
    fp = model_fingerprint(load_workload("transformer", **TINY))
    plan = dataclasses.replace(
        straight_plan(4, [0], global_batch_size=2, num_micro_batches=1),
        model_name="transformer",
        model_fingerprint=fp,
    )
    wider = {**TINY, "hidden": 64}
    with pytest.raises(ValidationError, match="plan was made for another 'transformer'"):
        api.train(plan, "transformer", steps=1, overrides=wider, device="cpu")


def test_train_builds_the_model_fingerprint_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's and the profile's fingerprints are held against one build of the model's."""
    import dapple.models.fingerprint as fingerprint

    wl = load_workload("transformer", **TINY)
    fp = model_fingerprint(wl)
    plan = dataclasses.replace(
        straight_plan(4, [0], global_batch_size=2, num_micro_batches=1),
        model_name="transformer",
        model_fingerprint=fp,
    )
    profile = dataclasses.replace(make_profile(4, name="transformer"), model_fingerprint=fp)
    builds: list[str | None] = []

    def counted(workload: Any) -> str | None:
        builds.append(model_fingerprint(workload))
        return builds[-1]

    monkeypatch.setattr(fingerprint, "model_fingerprint", counted)
    monkeypatch.setattr("dapple.runtime.train", lambda *_, **__: [])
    assert api.train(plan, wl, steps=1, profile=profile, cluster=make_cluster(), device="cpu") == []
    assert builds == [fp]


def test_verify_refuses_a_nan_tolerance() -> None:
    plan = straight_plan(4, [0], global_batch_size=2, num_micro_batches=1)
    with pytest.raises(ValidationError, match="finite numbers >= 0"):
        api.verify(plan, "transformer", 1, overrides=TINY, device="cpu", rtol=math.nan)


def test_simulate_says_when_the_profile_cannot_be_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof, cluster = _files(tmp_path)
    plan = tmp_path / "plan.json"
    made = dataclasses.replace(
        straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2),
        model_name="transformer",
        model_fingerprint="meta-state-v1:0123456789abcdef",
    )
    made.save(plan)
    argv = ["simulate", "--plan", str(plan), "--profile", str(prof), "--cluster", str(cluster)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "dapple: warning:" in err and "profiled as 'toy'" in err, err
    unnamed = json.loads(prof.read_text())
    unnamed["model_name"] = "transformer"
    prof.write_text(json.dumps(unnamed))
    assert main(argv) == 0
    assert "records no model fingerprint" in capsys.readouterr().err


def _battery_profile() -> ModelProfile:
    """The battery's 2-block transformer as it profiled (rounded): fixed costs dominate, so
    the search splits it over many devices."""
    rows = [  # name, F fixed/per sample, B fixed/per sample ms, output, parameters, kept bytes
        ("embedding", 0.065, 0.00045, 0.119, 0.0073, 4096, 36864, 256),
        ("block0", 0.571, 0.0654, 0.975, 0.0, 4096, 50816, 82432),
        ("block1", 0.603, 0.0515, 0.884, 0.129, 4096, 50816, 82432),
        ("lm_head", 0.081, 0.0148, 0.133, 0.034, 32768, 34048, 8448),
    ]
    return ModelProfile(
        model_name="transformer",
        layers=tuple(
            LayerProfile(
                name=n,
                forward=AffineTime(fixed_ms=ff, per_sample_ms=fp),
                backward=AffineTime(fixed_ms=bf, per_sample_ms=bp),
                output_bytes_per_sample=float(out),
                parameter_bytes=par,
                kept_activation_bytes_per_sample=float(kept),
            )
            for n, ff, fp, bf, bp, out, par, kept in rows
        ),
        input_bytes_per_sample=256.0,
    )


@pytest.mark.parametrize("devices, batch", [(8, 2), (16, 4), (6, 1)])
def test_no_stage_has_more_replicas_than_samples(devices: int, batch: int) -> None:
    """A replica beyond the micro-batch's b samples would get none: the search never plans one
    (the battery's 8 devices at global batch 2 were planned 1:2:5, three replicas idle)."""
    from dapple.planner import make_plan

    cluster = dataclasses.replace(make_cluster(1, devices), intra_server_bandwidth_gbps=10.0)
    plan = make_plan(_battery_profile(), cluster, batch)
    assert all(st.replicas <= plan.micro_batch_size for st in plan.stages), plan.replication


def test_bad_model_arguments_name_only_the_unknown_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["split", "-m", "transformer", "--set", "layers=2", "--set", "hiden=3"]) == 2
    err = one_error_line(capsys, "bad arguments ['hiden']", "accepted: layers, hidden")
    assert "'layers'" not in err

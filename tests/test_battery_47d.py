"""Issue 47 (fourth re-run): what ``dapple train`` still took without a word, or said once per
worker - CUDA asked for on a host without it, a profile that cannot be checked against the
model, and the elastic and checkpoint flags given without the option they apply to."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import pytest

from builders import plan_file
from dapple.cli import main

MODEL = ["-m", "transformer", "--set", "layers=2", "--set", "hidden=32"]
"""A zoo transformer of 4 layers (embedding, 2 blocks, head), small enough to build at once."""

_GRAPH = """node1 -- Input0 -- forward_compute_time=0.1, backward_compute_time=0.1, \
activation_size=4096.0, parameter_size=100.0
node2 -- Linear -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=4096.0, \
parameter_size=400.0
node3 -- Linear -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=4096.0, \
parameter_size=400.0
node4 -- Linear -- forward_compute_time=1.0, backward_compute_time=2.0, activation_size=4096.0, \
parameter_size=400.0
\tnode1 -- node2
\tnode2 -- node3
\tnode3 -- node4
"""
"""A PipeDream graph of 4 layers: imported, it records no model fingerprint."""


# -- CUDA asked for on a host without it: one line, before any worker starts -------------------
def test_train_refuses_cuda_without_it_once_before_any_worker(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    standalone: None,
) -> None:
    """Each worker used to find it out on its own (3 lines, ~14 s in)."""
    from builders import boom, one_error_line

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("dapple.api.load", boom)  # refused before the model is loaded
    assert main(["train", "--plan", plan_file(tmp_path), *MODEL, "--device", "cuda"]) == 2
    one_error_line(capsys, "--device cuda: CUDA is not available on this host (",
                   "use --device cpu, or auto")  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_verify_and_the_api_refuse_cuda_without_it_before_any_worker(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    standalone: None,
) -> None:
    """``dapple verify`` and ``api.train``/``api.verify`` check the device where they check the
    host's memory (``api._checks.check_host``), before any worker starts."""
    from builders import boom, one_error_line
    from dapple import api
    from dapple.errors import ValidationError

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("dapple.runtime.verify.verify", boom)
    monkeypatch.setattr("dapple.runtime.train", boom)
    plan = plan_file(tmp_path)
    assert main(["verify", "--plan", plan, *MODEL, "--device", "cuda"]) == 2
    one_error_line(capsys, "--device cuda: CUDA is not available on this host (")
    spec = {"layers": 2, "hidden": 32}
    with pytest.raises(ValidationError, match=r"^--device cuda: CUDA is not available"):
        api.verify(plan, "transformer", overrides=spec, device="cuda")
    with pytest.raises(ValidationError, match=r"^--device cuda: CUDA is not available"):
        api.train(plan, "transformer", overrides=spec, device="cuda", steps=1)


def test_the_device_check_passes_cpu_auto_and_cuda_where_torch_sees_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dapple.errors import ValidationError
    from dapple.profiler.host_fit import check_device_available

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    for device in ("cpu", "auto"):
        check_device_available(device)
    with pytest.raises(ValidationError, match=r"^--device cuda:1: CUDA is not available"):
        check_device_available("cuda:1")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    check_device_available("cuda")
    check_device_available("cuda:1")


# -- a profile that records no fingerprint: one warning naming both models ----------------------
def _stop_at_launch(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """``dapple train`` runs its checks, then stops where the run would launch."""
    launched: list[Any] = []
    monkeypatch.setattr("dapple.cli.train_cmd._early_workers", lambda *_: contextlib.nullcontext())
    monkeypatch.setattr("dapple.api.running._launch", lambda *a: launched.append(a) or [])
    return launched


@pytest.mark.parametrize(("name", "profiled_as"), [("transformer", "'transformer'"),
                                                  ("other", "'other'")])  # fmt: skip
def test_train_warns_once_of_a_profile_it_cannot_check_against_the_model(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    standalone: None,
    name: str,
    profiled_as: str,
) -> None:
    """An imported profile of the model's name and layer count was taken in silence (one of
    another name got a warning): neither can be checked, so both are said, once."""
    graph, prof = tmp_path / "g.txt", tmp_path / "pd.json"
    graph.write_text(_GRAPH)
    assert main(["import-pipedream", str(graph), "-o", str(prof), "--name", name]) == 0
    launched = _stop_at_launch(monkeypatch)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        argv = ["train", "--plan", plan_file(tmp_path), *MODEL, "--device", "cpu", "--profile",
                str(prof), "--cluster", "local-cpu"]  # fmt: skip
        assert main(argv) == 0
    assert len(launched) == 1  # the checks passed: a warning, not a refusal
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"the profile {str(prof)!r} records no fingerprint of its model's tensors" in lines[0]
    assert f"profiled as {profiled_as}" in lines[0], lines
    assert "the model 'transformer' (4 layers)" in lines[0], lines


def test_a_profile_with_the_models_fingerprint_gives_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import dataclasses

    from dapple import api
    from dapple.models.fingerprint import check_profile_model, model_fingerprint
    from dapple.profiler.paper_models import load_profile

    graph, path = tmp_path / "g.txt", tmp_path / "pd.json"
    graph.write_text(_GRAPH)
    assert main(["import-pipedream", str(graph), "-o", str(path), "--name", "transformer"]) == 0
    prof, wl = load_profile(str(path)), api.load("transformer", layers=2, hidden=32)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_profile_model(
            dataclasses.replace(prof, model_fingerprint=model_fingerprint(wl)), wl, "p"
        )
        assert caplog.records == []
        check_profile_model(prof, wl, "p")
    assert len(caplog.records) == 1


# -- an elastic run's flags given to a run that is not elastic ----------------------------------
@pytest.mark.parametrize("flags", [["--min-devices", "1"], ["--max-restarts", "3"]])
def test_train_refuses_an_elastic_flag_without_elastic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], standalone: None, flags: list[str]
) -> None:
    """At their defaults these were taken without a word (the config cannot tell them from no
    flag), and did nothing."""
    from builders import one_error_line, plan_file

    assert main(["train", "--plan", plan_file(tmp_path), *MODEL, *flags]) == 2
    one_error_line(capsys, f"{' '.join(flags)} applies to elastic runs only", "add --elastic")


def test_an_elastic_flag_passes_in_an_elastic_run_from_the_flag_or_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan, ck = plan_file(tmp_path), str(tmp_path / "ck")
    elastic = ["--profile", "p.json", "--cluster", "local-cpu", "--checkpoint-dir", ck,
               "--save-every", "1", "--min-devices", "1", "--max-restarts", "2"]  # fmt: skip
    assert main(["train", "--plan", plan, *MODEL, *elastic, "--elastic", "--print-config"]) == 0
    assert "elastic = true\nmin_devices = 1\nmax_restarts = 2" in capsys.readouterr().out
    cfg = tmp_path / "run.toml"
    cfg.write_text("[elastic]\nelastic = true\n")
    assert main(["train", "--config", str(cfg), "--plan", plan, *MODEL, *elastic,
                 "--print-config"]) == 0  # fmt: skip
    capsys.readouterr()
    # a file's keys at their defaults (as --print-config writes them) are no flags given
    cfg.write_text("[elastic]\nmin_devices = 1\nmax_restarts = 3\n")
    assert main(["train", "--config", str(cfg), "--plan", plan, *MODEL, "--print-config"]) == 0


# -- a checkpoint flag given to a run that saves no checkpoints ---------------------------------
@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--keep", "2"], "--keep 2"), (["--overwrite-checkpoints"], "--overwrite-checkpoints")],
)
def test_train_refuses_a_checkpoint_flag_without_a_checkpoint_dir(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    standalone: None,
    flags: list[str],
    named: str,
) -> None:
    """Both were taken without a word and did nothing."""
    from builders import one_error_line

    assert main(["train", "--plan", plan_file(tmp_path), *MODEL, *flags]) == 2
    one_error_line(capsys, f"{named} applies to checkpoints only", "add --checkpoint-dir DIR")
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    assert (
        main(["train", "--plan", plan_file(tmp_path), *MODEL, *flags, *ck, "--print-config"]) == 0
    )
    capsys.readouterr()
    cfg = tmp_path / "run.toml"  # the folder from the file
    cfg.write_text(f'[checkpoint]\ncheckpoint_dir = "{tmp_path / "ck"}"\n')
    argv = ["train", "--config", str(cfg), "--plan", plan_file(tmp_path), *MODEL, *flags]
    assert main([*argv, "--print-config"]) == 0


# -- more steps than 64-bit batch seeds: the steps are named, not the seed ----------------------
def test_train_refuses_more_steps_than_batch_seeds_naming_the_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], standalone: None
) -> None:
    """``--steps 100000000000000000000`` (10^20) was refused as "seed must be an integer from ... to -9.07e19, got 0"."""
    from builders import one_error_line
    from dapple.runtime.train_config import TrainConfig

    TrainConfig(steps=2**63 - 1)  # seed 0: the last batch seed is 2^63 - 1
    assert main(["train", "--plan", plan_file(tmp_path), *MODEL, "--steps", str(10**20)]) == 2
    one_error_line(capsys, f"steps must be at most {2**63 - 1}", "got 100000000000000000000")


# -- a profile batch larger than the host's memory: refused before it is made -------------------
def test_profile_refuses_a_batch_whose_inputs_exceed_the_host_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to fail only after trying to allocate the batch (26 GB for 10^8 samples)."""
    from builders import boom, one_error_line
    from dapple.errors import ValidationError
    from dapple.models.zoo import load_workload
    from dapple.profiler.host_fit import check_batch_memory

    monkeypatch.setattr("dapple.profiler.host_fit.available_host_bytes", lambda: 10**9)
    monkeypatch.setattr("dapple.profiler.measure.profile_workload", boom)
    out = tmp_path / "p.json"
    assert main(["profile", *MODEL, "--batch-sizes", "1,100000000", "-o", str(out)]) == 2
    one_error_line(capsys, "--batch-sizes 1,100000000: a batch of 100,000,000 samples",
                   "inputs and targets alone", "give smaller batch sizes")  # fmt: skip
    assert not out.exists()
    wl = load_workload("transformer", layers=2, hidden=32)
    x, y = wl.make_batch(1, 0)
    one = x.numel() * x.element_size() + y.numel() * y.element_size()
    assert check_batch_memory(wl, 1000, "b", available=1000 * one) == 1000 * one  # just fits
    with pytest.raises(ValidationError, match="a batch of 1,001 samples"):
        check_batch_memory(wl, 1001, "b", available=1000 * one)

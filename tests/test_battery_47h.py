"""What issue 47's battery H (``benchmarks/battery_47h.py``) found, each refused in one line
before any work: a plan made from an analytic profile given, to ``simulate`` or ``train
--profile``, the analytic profile of another model of the same name and layer count (another
``--set``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builders import boom, one_error_line
from dapple.cli import main
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile, comparable_fingerprints
from dapple.profiler.analytic import analytic_profile
from dapple.profiler.analytic_models import ANALYTIC_KIND

ZOO = ["-m", "transformer", "--set", "layers=2", "--set", "hidden=32"]


def _analytic(hidden: int, **kw: object) -> ModelProfile:
    return analytic_profile(
        "transformer", "h100", batch_sizes=[1, 2], overrides={"layers": 2, "hidden": hidden}, **kw
    )  # type: ignore[arg-type]


def test_analytic_profiles_fingerprint_their_shapes_not_their_length() -> None:
    a, b = _analytic(32), _analytic(64)
    assert a.model_fingerprint is not None and a.model_fingerprint.startswith(f"{ANALYTIC_KIND}:")
    assert a.num_layers == b.num_layers and a.model_name == b.model_name
    assert a.model_fingerprint != b.model_fingerprint
    assert _analytic(32, precision="fp32").model_fingerprint == a.model_fingerprint
    # another length is the same model
    llama = [
        analytic_profile("llama3-8b", "h100", batch_sizes=[1], seq_len=n) for n in (2048, 4096)
    ]
    assert llama[0].model_fingerprint == llama[1].model_fingerprint
    # a measured profile's fingerprint (of the model's tensors) is of another kind
    assert not comparable_fingerprints(a.model_fingerprint, "meta-state-v1:0123456789abcdef")
    assert not comparable_fingerprints(a.model_fingerprint, None)
    assert comparable_fingerprints(a.model_fingerprint, b.model_fingerprint)


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Analytic profiles of the zoo transformer at widths 32 and 64 (4 layers each) and a plan
    made from the first; the run's work replaced by :func:`boom`."""
    monkeypatch.setattr("dapple.runtime.train", boom)
    monkeypatch.setenv("RANK", "0")  # as one torchrun rank: no early workers
    monkeypatch.setenv("WORLD_SIZE", "1")
    a, b = _analytic(32), _analytic(64)
    out = {"a": str(tmp_path / "a.json"), "b": str(tmp_path / "b.json")}
    a.save(out["a"])
    b.save(out["b"])
    out["plan"] = str(tmp_path / "plan.json")
    straight_plan(4, [0], global_batch_size=2, num_micro_batches=1, model_name="transformer",
                  model_fingerprint=a.model_fingerprint).save(out["plan"])  # fmt: skip
    return out


def test_simulate_refuses_another_analytic_model_of_the_same_name_and_layers(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--plan", files["plan"], "--cluster", "h100-8x", "--profile"]
    assert main([*argv, files["b"]]) == 2
    one_error_line(capsys, "another model than the plan was made for", "'transformer'")
    assert main([*argv, files["a"]]) == 0


def test_train_refuses_another_analytic_model_of_the_same_name_and_layers(
    files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--plan", files["plan"], *ZOO, "--steps", "1", "--cluster", "h100-8x"]
    assert main([*argv, "--profile", files["b"]]) == 2
    err = capsys.readouterr().err.splitlines()  # after a note on the profile's precision
    errors = [x for x in err if x.startswith("dapple: error: ")]
    assert len(errors) == 1 and "another model than the plan was made for" in errors[0], err
    with pytest.raises(AssertionError, match="work started"):  # its own profile: to the run
        main([*argv, "--profile", files["a"]])

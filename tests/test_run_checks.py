"""Step 0's batch and a resume's checkpoint are checked before any worker starts
(:func:`dapple.runtime.launch.run_checks.check_resume`), through the API as through
``dapple train``: another model's (name, layer count or tensor shapes), another optimizer's or
another data stream's checkpoint costs no worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.models.zoo import mlp
from dapple.runtime import train
from dapple.runtime.checkpoint import (
    CheckpointError,
    CheckpointMeta,
    save_checkpoint,
    stage_layer_states,
)
from dapple.runtime.launch import launcher
from dapple.runtime.train_config import TrainConfig


def _saved(root: Path, wl: Workload, optimizer_type: str = "SGD") -> None:
    """``wl``'s initial weights saved as a checkpoint at step 1 (no optimizer state)."""
    meta = CheckpointMeta(
        model_name=wl.name, num_layers=wl.num_layers, step=1, optimizer_type=optimizer_type
    )
    save_checkpoint(root, meta, stage_layer_states(wl.build_model(0), 0))


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launcher, "spawn", refuse)


def _resume(root: Path, wl: Workload, optimizer: str = "sgd") -> None:
    plan = straight_plan(wl.num_layers, [0], global_batch_size=4, num_micro_batches=1)
    cfg = TrainConfig(steps=3, checkpoint_dir=str(root), resume=True, optimizer=optimizer)
    train(plan, wl, cfg)


BASE = {"layers": 2, "in_features": 4, "hidden": 8, "num_classes": 2}


@pytest.mark.usefixtures("no_workers")
@pytest.mark.parametrize(
    ("theirs", "match"),
    [
        (mlp(**{**BASE, "layers": 3}), r"has 4 layers but model 'mlp' has 3"),
        (mlp(**{**BASE, "hidden": 16}), r"is of another model: layer 0 tensor '0.weight'"),
    ],
    ids=["layer count", "tensor shapes"],
)
def test_another_models_checkpoint_is_refused_before_any_worker(
    tmp_path: Path, theirs: Workload, match: str
) -> None:
    _saved(tmp_path, theirs)
    with pytest.raises(CheckpointError, match=match):
        _resume(tmp_path, mlp(**BASE))


@pytest.mark.usefixtures("no_workers")
def test_another_optimizers_checkpoint_is_refused_before_any_worker(tmp_path: Path) -> None:
    _saved(tmp_path, mlp(**BASE), optimizer_type="AdamW")
    with pytest.raises(CheckpointError, match=r"has AdamW optimizer state; cannot resume with SGD"):
        _resume(tmp_path, mlp(**BASE), optimizer="sgd")


@pytest.mark.usefixtures("no_workers")
def test_a_checkpoint_of_this_model_goes_on_to_the_workers(tmp_path: Path) -> None:
    import runtime_workloads

    _saved(tmp_path, runtime_workloads.mlp())
    plan = straight_plan(4, [0], global_batch_size=4, num_micro_batches=1)
    cfg = TrainConfig(steps=3, checkpoint_dir=str(tmp_path), resume=True, optimizer="sgd")
    with pytest.raises(AssertionError, match="a worker was started"):
        train(plan, "runtime_workloads:mlp", cfg)


@pytest.mark.usefixtures("no_workers")
def test_a_batch_of_other_rows_than_g_is_refused_before_any_worker(tmp_path: Path) -> None:
    base = mlp(**BASE)

    def short(batch_size: int, seed: int) -> tuple[object, object]:
        inputs, targets = base.make_batch(batch_size, seed)
        return inputs[:-1], targets[:-1]

    wl = Workload(base.name, list(base.layer_factories), short, base.loss_fn)
    plan = straight_plan(wl.num_layers, [0], global_batch_size=4, num_micro_batches=1)
    with pytest.raises(ValidationError, match=r"make_batch\(4\) returned \[3\] rows, expected 4"):
        train(plan, wl, TrainConfig(steps=2))


@pytest.mark.usefixtures("no_workers")
def test_a_damaged_layer_file_is_refused_before_any_worker(tmp_path: Path) -> None:
    """The only checkpoint's layer file has one byte changed: its sha256 no longer matches."""
    _saved(tmp_path, mlp(**BASE))
    layer = next(tmp_path.glob("step-*/layer-00001.pt"))
    data = bytearray(layer.read_bytes())
    data[-1] ^= 0xFF
    layer.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"layer-00001\.pt.*no older intact checkpoint"):
        _resume(tmp_path, mlp(**BASE))


def test_a_resume_point_is_verified_once_while_its_files_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dapple.runtime.launch import run_checks

    calls: list[str] = []
    real = run_checks.find_resume_checkpoint

    def counted(root: str | Path) -> object:
        calls.append(str(root))
        return real(root)

    monkeypatch.setattr(run_checks, "find_resume_checkpoint", counted)
    _saved(tmp_path, mlp(**BASE))
    first = run_checks.resume_point(tmp_path)
    assert run_checks.resume_point(tmp_path) is first and len(calls) == 1
    layer = next(tmp_path.glob("step-*/layer-00001.pt"))
    layer.write_bytes(layer.read_bytes() + b"x")  # another size: verified again, and refused
    with pytest.raises(CheckpointError):
        run_checks.resume_point(tmp_path)
    assert len(calls) == 2

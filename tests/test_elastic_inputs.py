"""An elastic run's options are checked before any worker starts: the checkpoints it resumes
from, a minimum it can meet, and no elastic option on a run that is not elastic."""

from __future__ import annotations

from pathlib import Path

import pytest

from builders import make_profile
from dapple.api.run_config import RunConfig, RunOptions
from dapple.core.cluster_presets import PRESETS
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.runtime.launch.elastic import ElasticPolicy, train_elastic
from dapple.runtime.train_config import TrainConfig


def _never(*_: object, **__: object) -> None:
    raise AssertionError("an attempt started")


def test_a_minimum_above_the_plans_devices_is_refused_before_the_first_attempt(
    tmp_path: Path,
) -> None:
    plan = straight_plan(5, [0, 2], global_batch_size=16, num_micro_batches=2, replicas=[3, 1])
    policy = ElasticPolicy(make_profile(5, name="mlp"), PRESETS["local-cpu"], min_devices=5)
    with pytest.raises(ValidationError, match=r"min_devices 5 is more than the plan's 4 devices"):
        config = TrainConfig(steps=2, checkpoint_dir=str(tmp_path), save_every=1)
        train_elastic(plan, config, _never, policy=policy)


@pytest.mark.parametrize(("minimum", "restarts"), [(2, 3), (1, 0), (4, 7)])
def test_elastic_options_without_elastic_are_refused(minimum: int, restarts: int) -> None:
    with pytest.raises(ValidationError, match=r"apply to elastic runs only: add elastic"):
        RunOptions(min_devices=minimum, max_restarts=restarts)
    RunOptions(elastic=True, profile="p.json", cluster="local-cpu", min_devices=minimum,
               max_restarts=restarts)  # fmt: skip


@pytest.mark.parametrize("train", [TrainConfig(), TrainConfig(checkpoint_dir="ck", save_every=0)])
def test_an_elastic_run_without_checkpoints_is_refused_with_its_configuration(
    train: TrainConfig,
) -> None:
    run = RunOptions(elastic=True, profile="p.json", cluster="local-cpu")
    with pytest.raises(ValidationError, match=r"an elastic run resumes from its checkpoints"):
        RunConfig(train=train, run=run)
    RunConfig(train=TrainConfig(checkpoint_dir="ck", save_every=1), run=run)

"""Shared fixtures: a fixed seed for every test, ``dapple train`` as a user starts it (data
builders live in ``builders.py``)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest


@pytest.fixture
def standalone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dapple train`` as a user starts it: no torchrun rank in the environment, and no worker
    may start (a refusal comes first)."""
    from builders import boom

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("dapple.runtime.launch.early.EarlyWorkers", boom)


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    """A gloo process group of this process alone (an in-memory store), for a module's
    single-rank runs of the runtime."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _seed() -> None:
    random.seed(0)
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch

        torch.manual_seed(0)
    except ImportError:  # pragma: no cover
        pass

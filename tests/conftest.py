"""Shared fixtures: a fixed seed for every test (data builders live in ``builders.py``)."""

from __future__ import annotations

import random

import pytest


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

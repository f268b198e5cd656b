"""An installed ``transformers`` older than dapple's declared minimum is refused in one line."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType

import pytest

from dapple.errors import ValidationError
from dapple.models import hf

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _installed() -> ModuleType:
    """The module ``import transformers`` gives now: transformers replaces its own
    ``sys.modules`` entry once a model is built, so a reference taken at import time can be stale."""
    return importlib.import_module("transformers")


def test_the_minimum_is_the_one_pyproject_declares() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    (extra,) = re.findall(r"^hf = \[(.*)\]$", text, flags=re.M)
    (spec,) = re.findall(r'"transformers>=([0-9.]+)"', extra)
    declared = tuple(int(n) for n in spec.split("."))
    assert declared == hf.MIN_TRANSFORMERS


def test_an_old_transformers_is_refused_naming_both_versions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_installed(), "__version__", "5.17.0")
    with pytest.raises(ValidationError) as err:
        hf.hf_gpt2(layers=1, hidden=32, heads=2, vocab=64, seq=8)
    msg = str(err.value)
    assert "\n" not in msg
    assert "transformers 5.17.0 is installed" in msg
    assert "transformers>=5.23" in msg


@pytest.mark.parametrize("version", ["5.23.0", "5.24.0.dev0", "6.0.0"])
def test_the_minimum_and_newer_are_accepted(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    transformers = _installed()
    monkeypatch.setattr(transformers, "__version__", version)
    assert hf._transformers() is transformers


def test_release_numbers() -> None:
    assert hf._release("5.24.0.dev0") == (5, 24, 0)
    assert hf._release("4.57.1+cu") == (4, 57, 1)
    assert hf._release("5.22.9") < hf.MIN_TRANSFORMERS <= hf._release("5.23")

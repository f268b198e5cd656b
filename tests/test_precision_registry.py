"""The precision registry: each precision's traits, and the torch side's dtypes agree with it."""

from __future__ import annotations

import pytest
import torch

from dapple.core.precision import (
    ANALYTIC_PRECISIONS,
    TRAINING_PRECISIONS,
    ComputePrecision,
    precision_of,
)
from dapple.errors import ValidationError
from dapple.profiler.layer_measure import _AUTOCAST_DTYPES
from dapple.runtime.precision import AUTOCAST_DTYPES, Precision


def test_traits_table() -> None:
    rows = {
        p.value: (
            p.autocast,
            p.loss_scaling,
            p.trains,
            p.trains_on_cpu,
            p.element_bytes,
            p.weight_cast_factor,
            p.tensor_precision.value,
        )
        for p in ComputePrecision
    }
    assert rows == {
        "fp32": (False, False, True, True, 4, 0.0, "fp32"),
        "bf16": (True, False, True, True, 2, 0.5, "bf16"),
        "fp16": (True, True, True, False, 2, 0.5, "fp16"),
        "fp8": (True, False, False, False, 2, 0.5, "bf16"),
    }


def test_names() -> None:
    assert TRAINING_PRECISIONS == ("fp32", "bf16", "fp16")
    assert ANALYTIC_PRECISIONS == ("fp32", "bf16", "fp16", "fp8")
    assert precision_of("bf16") is ComputePrecision.BF16
    with pytest.raises(ValidationError, match=r"precision must be one of .*got 'fp64'"):
        precision_of("fp64")


def test_dtype_names_are_torch_dtypes() -> None:
    for p in ComputePrecision:
        assert isinstance(getattr(torch, p.dtype_name), torch.dtype)
    want = {"bf16": torch.bfloat16, "fp16": torch.float16}
    assert want == AUTOCAST_DTYPES
    assert want == _AUTOCAST_DTYPES


def test_runtime_precision_follows_the_registry() -> None:
    cpu = torch.device("cpu")
    assert Precision("fp32", cpu).dtype is None and Precision("fp32", cpu).scaler is None
    assert Precision("bf16", cpu).dtype is torch.bfloat16
    assert Precision("bf16", cpu).scaler is None

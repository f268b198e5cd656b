"""Model zoo: chains equal layer-by-layer execution, per-layer init, determinism, loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.models.zoo import NAMES, get_workload, load_workload
from dapple.profiler import _paper_arch as arch

SMALL: dict[str, dict[str, Any]] = {
    "mlp": {},
    "transformer": {"layers": 3},
    "vgg19": {"image_size": 32, "width": 1 / 16, "fc_dim": 32, "num_classes": 5},
    "resnet50": {"image_size": 32, "width": 1 / 16, "num_classes": 5},
    "gnmt": {"layers": 6, "hidden": 16, "vocab": 50, "seq": 6},
}


def _apply(layers: list[nn.Module], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


@pytest.mark.parametrize("name", list(SMALL))
def test_chain_equals_layer_by_layer(name: str) -> None:
    w = get_workload(name, **SMALL[name])
    x, y = w.make_batch(4, seed=7)
    model = w.build_model(seed=3)
    out = model(x)
    out2 = _apply([w.build_layer(i, seed=3) for i in range(w.num_layers)], x)
    torch.testing.assert_close(out, out2)
    loss = w.loss_fn(out, y)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert len(w.layer_names) == w.num_layers


@pytest.mark.parametrize("name", list(SMALL))
def test_stage_weights_equal_model_weights(name: str) -> None:
    w = get_workload(name, **SMALL[name])
    full = w.build_model(seed=5)
    cut = w.num_layers // 2
    for start, end in ((0, cut), (cut, w.num_layers)):
        stage = w.build_stage(start, end, seed=5)
        for k, layer in enumerate(stage):
            ref = full[start + k].state_dict()
            got = layer.state_dict()
            assert ref.keys() == got.keys()
            for key in ref:
                torch.testing.assert_close(got[key], ref[key])
    other = w.build_model(seed=6)
    diffs = [
        not torch.equal(a, b)
        for a, b in zip(full.parameters(), other.parameters(), strict=True)
        if a.numel() > 1 and a.dim() > 1
    ]
    assert any(diffs)


@pytest.mark.parametrize("name", list(SMALL))
def test_batches_are_deterministic(name: str) -> None:
    w = get_workload(name, **SMALL[name])
    (x1, y1), (x2, y2), (x3, _) = w.make_batch(3, 11), w.make_batch(3, 11), w.make_batch(3, 12)
    first = x1[0] if isinstance(x1, tuple) else x1
    assert first.shape[0] == 3 and y1.shape[0] == 3
    for a, b in zip(
        x1 if isinstance(x1, tuple) else (x1,), x2 if isinstance(x2, tuple) else (x2,), strict=True
    ):
        assert torch.equal(a, b)
    assert torch.equal(y1, y2)
    x3f = x3[0] if isinstance(x3, tuple) else x3
    assert not torch.equal(first, x3f)


def test_default_transformer_is_small_and_names() -> None:
    w = get_workload("transformer")
    assert w.num_layers == 8
    n = sum(p.numel() for p in w.build_model().parameters())
    assert n < 1_000_000
    assert set(NAMES) >= {"mlp", "transformer", "bert-48", "vgg19", "resnet50", "gnmt", "gnmt-16"}


def _meta_params(w: Workload) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in w.build_model().parameters())


def test_paper_sizes_match_analytic_profiles() -> None:
    assert _meta_params(get_workload("vgg19")) == sum(
        x.parameter_count for x in arch.vgg19_layers()
    )
    assert _meta_params(get_workload("resnet50")) == sum(
        x.parameter_count for x in arch.resnet50_layers()
    )
    # the zoo's dot-product attention lacks normalized Bahdanau's vector, bias and scalar
    assert _meta_params(get_workload("gnmt-16")) == sum(
        x.parameter_count for x in arch.gnmt16_layers()
    ) - (2 * 1024 + 1)
    bert = get_workload("bert-48")
    assert bert.num_layers == 50
    assert 600e6 < _meta_params(bert) < 680e6


def test_unknown_name_and_bad_overrides() -> None:
    with pytest.raises(ValidationError, match="known: mlp"):
        get_workload("resnet5O")
    with pytest.raises(ValidationError, match="known: mlp"):
        load_workload("nonsense")
    with pytest.raises(ValidationError, match="accepted: layers"):
        get_workload("transformer", depth=3)
    with pytest.raises(ValidationError, match="heads"):
        get_workload("transformer", hidden=30, heads=4)


@pytest.mark.parametrize("size", ["layers", "in_features", "hidden", "num_classes"])
@pytest.mark.parametrize("value", [0, -1])
def test_mlp_refuses_a_size_below_one(size: str, value: int) -> None:
    with pytest.raises(ValidationError, match=f"mlp: need sizes >= 1, got .*{size}={value}"):
        get_workload("mlp", **{size: value})


def test_load_factory_from_file_and_module(tmp_path: Path) -> None:
    f = tmp_path / "mymodel.py"
    f.write_text(
        "from torch import nn\n"
        "from dapple.models.zoo import mlp\n"
        "def seq(width=8):\n"
        "    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 2))\n"
        "def wl():\n"
        "    return mlp(layers=2)\n"
        "def bad():\n"
        "    return 3\n"
    )
    w = load_workload(f"{f}:seq", input_shape=(4,), width=6)
    assert w.num_layers == 3
    x, y = w.make_batch(5, 0)
    assert x.shape == (5, 4) and y.shape == (5, 2)
    torch.testing.assert_close(w.build_model(seed=1)(x), w.build_model(seed=2)(x))
    assert w.loss_fn(w.build_model()(x), y).ndim == 0
    assert load_workload(f"{f}:wl").num_layers == 3
    assert load_workload("dapple.models.zoo.mlp:mlp", layers=1).num_layers == 2
    with pytest.raises(ValidationError, match="input_shape"):
        load_workload(f"{f}:seq")
    with pytest.raises(ValidationError, match="must return"):
        load_workload(f"{f}:bad")
    with pytest.raises(ValidationError, match="no callable"):
        load_workload(f"{f}:missing")
    with pytest.raises(ValidationError, match="cannot import"):
        load_workload("no_such_pkg_xyz.mod:f")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_abc\n")
    with pytest.raises(ValidationError, match="ModuleNotFoundError"):
        load_workload(f"{broken}:f")
    with pytest.raises(ValidationError, match="not found"):
        load_workload(f"{tmp_path}/nope.py:f")

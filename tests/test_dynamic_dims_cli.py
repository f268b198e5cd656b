"""``--dynamic-dims`` on the commands that load a model and ``load(..., dynamic_dims=)``: the
syntax and its one-line errors, a traced model re-traced with the declaration, a layer chain's
declaration, and the declared ranges and static dimensions checked before any worker starts."""

from __future__ import annotations

import pickle
import textwrap
from pathlib import Path

import pytest

from dapple import api
from dapple.cli import main
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.models.dim_syntax import parse_dynamic_dims
from dapple.models.shapes import DynamicDim
from dapple.models.split import with_dynamic_dims

NET = textwrap.dedent(
    '''
    import torch
    from torch import nn
    from torch.nn import functional as F

    from dapple.models.split import workload_from_module


    class Net(nn.Module):
        """Two linear blocks over (b, len, 4); doubles its output when len > 6."""

        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x * 2 if x.shape[1] > 6 else x


    def batch(n, seed):
        """len = 5, 6, 7 for seeds 0, 1, 2 (mod 3)."""
        g = torch.Generator().manual_seed(seed)
        s = 5 + seed % 3
        return torch.randn(n, s, 4, generator=g), torch.randn(n, s, 4, generator=g)


    def net():
        return workload_from_module(Net, batch, F.mse_loss)
    '''
)


@pytest.fixture()
def net_spec(tmp_path: Path) -> str:
    (tmp_path / "net.py").write_text(NET)
    return f"{tmp_path / 'net.py'}:net"


def test_parse_dynamic_dims_mirrors_the_api_declaration() -> None:
    got = parse_dynamic_dims(["input_ids:1=seq:2..512, attention_mask:1=seq", "0:2=static"])
    assert got == {"input_ids": {1: ("seq", 2, 512)}, "attention_mask": {1: "seq"}, 0: {2: None}}
    assert parse_dynamic_dims(["x:1=s:..8", "x:2=t:3.."]) == {
        "x": {1: ("s", 1, 8), 2: ("t", 3, None)}
    }
    assert parse_dynamic_dims([]) == {}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("ids1=seq", "--dynamic-dims expects INPUT:DIM=NAME[:MIN..MAX] or INPUT:DIM=static"),
        ("ids:x=seq", "dimension 'x' is not a number"),
        ("ids:1=", "--dynamic-dims expects INPUT:DIM=NAME"),
        ("ids:1=seq:2-5", "the range must be MIN..MAX"),
        ("ids:1=s,ids:1=t", "declares input 'ids' dimension 1 twice"),
        ("ids:1=:2..4", "the dimension needs a name"),
    ],
)
def test_parse_dynamic_dims_names_the_bad_item(item: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace(".", r"\.")):
        parse_dynamic_dims([item])


def test_cli_bad_dynamic_dims_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["split", "-m", "transformer", "--dynamic-dims", "0:1=seq:9..2"],
        ["split", "-m", "transformer", "--dynamic-dims", "ids:1=seq"],
        ["split", "-m", "transformer", "--dynamic-dims", "0:0=batch"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("dapple: error: ") and err.count("\n") == 1, err
        assert "dynamic dimension" in err or "dynamic_dims" in err, err


def test_cli_split_traces_the_model_with_the_declared_dimension(
    net_spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["split", "-m", net_spec]) == 2  # found dynamic, but it branches on the length
    assert "declare the dimension static" in capsys.readouterr().err
    for flag in ("x:1=len:2..6", "0:1=static"):
        assert main(["split", "-m", net_spec, "--dynamic-dims", flag]) == 0, flag
        capsys.readouterr()


def test_load_with_dynamic_dims_keeps_the_range_and_pickles_as_its_spec(net_spec: str) -> None:
    wl = api.load(net_spec, dynamic_dims={"x": {1: ("len", 2, 6)}})
    assert wl.dynamic_dims == {0: {1: DynamicDim("len", 2, 6)}}
    again = pickle.loads(pickle.dumps(wl))
    assert again.dynamic_dims == wl.dynamic_dims
    x, _ = wl.make_batch(3, 1)  # 6 tokens, inside the traced range
    assert wl.build_model(0)(x).shape == (3, 6, 4)
    static = api.load(net_spec, dynamic_dims={0: {1: None}})
    assert static.dynamic_dims == {0: {1: None}}
    retraced = with_dynamic_dims(static, {"x": {1: ("len", 2, 6)}})  # an already built workload
    assert retraced.dynamic_dims == wl.dynamic_dims
    assert retraced.build_model(0)(x).shape == (3, 6, 4)


def test_layer_chain_takes_dimensions_by_position() -> None:
    kw = {"layers": 1, "hidden": 8, "heads": 2, "seq": 16, "vocab": 16}
    wl = api.load("transformer", **kw, dynamic_dims={0: {1: ("seq", 1, 16)}})
    assert wl.dynamic_dims == {0: {1: DynamicDim("seq", 1, 16)}}
    declared = api.load("transformer", **kw, seq_choices=[8, 12], dynamic_dims={"0": {1: None}})
    assert declared.dynamic_dims == {0: {1: None}}  # the model's own declaration overridden
    with pytest.raises(ValidationError, match=r"is a layer chain .* by position 0\.\.0"):
        api.load("transformer", **kw, dynamic_dims={"ids": {1: "seq"}})
    with pytest.raises(ValidationError, match="names input 1; the model takes 1 inputs"):
        api.load("transformer", **kw, dynamic_dims={1: {1: "seq"}})


def test_cli_verify_checks_the_declared_dimensions_before_any_worker(
    net_spec: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = straight_plan(2, [0, 1], global_batch_size=4, num_micro_batches=2, replicas=[1, 1])
    plan.save(tmp_path / "plan.json")
    run = ["verify", "--plan", str(tmp_path / "plan.json"), "-m", net_spec, "--device", "cpu"]
    cases = [
        (["--steps", "3", "--dynamic-dims", "x:1=len:2..6"],
         "step 2: input 0 dimension 1 (len) is 7, outside the allowed range [2, 6]"),
        (["--steps", "2", "--dynamic-dims", "x:1=static"],
         "step 1: input 0 dimension 1 is 6, but it is static (always 5)"),
    ]  # fmt: skip
    for extra, message in cases:
        assert main([*run, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"dapple: error: {message}"), err

"""Torch profiler: exact sizes, positive fitted times, CLI behaviour and errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dapple.cli import main
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.models.zoo import get_workload
from dapple.profiler.measure import profile_workload


def test_cli_profile_mlp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            "--model",
            "mlp",
            "--batch-sizes",
            "1,2,4",
            "--device",
            "cpu",
            "--output",
            str(out),
            "--repeats",
            "3",
        ]
    )
    assert rc == 0
    assert "fc0" in capsys.readouterr().out
    prof = ModelProfile.load(out)
    model = get_workload("mlp").build_model()
    assert prof.num_layers == len(model) == 5
    assert prof.batch_sizes == (1, 2, 4)
    for ly, layer in zip(prof.layers, model, strict=True):
        assert ly.parameter_bytes == sum(p.numel() * p.element_size() for p in layer.parameters())
        assert ly.forward.at(1) > 0 and ly.backward.at(1) > 0
        assert ly.forward.at(4) >= ly.forward.at(1)
    assert prof.parameter_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert prof.input_bytes_per_sample == 32 * 4
    # Linear keeps its input, ReLU its output (fp32): fc0 32 + 64, fc1..3 64 + 64, head 64
    kept = [ly.kept_activation_bytes_per_sample for ly in prof.layers]
    assert kept == [384.0, 512.0, 512.0, 512.0, 256.0]
    assert [ly.output_bytes_per_sample for ly in prof.layers] == [256.0] * 4 + [40.0]


def test_transformer_profile_sizes() -> None:
    w = get_workload("transformer", layers=2, hidden=32, heads=2, seq=8, vocab=64)
    calls: list[tuple[int, int]] = []
    prof = profile_workload(
        w,
        [2, 1],
        warmup=1,
        repeats=1,
        progress=lambda d, t, _: calls.append((d, t)),
        num_threads=1,
    )
    assert calls[-1] == (8, 8) and len(calls) == 8
    assert prof.batch_sizes == (1, 2)
    assert [ly.name for ly in prof.layers] == ["embedding", "block0", "block1", "lm_head"]
    assert prof.layers[0].output_bytes_per_sample == 8 * 32 * 4
    assert prof.layers[-1].output_bytes_per_sample == 8 * 64 * 4
    assert prof.input_bytes_per_sample == 8 * 8  # int64 token ids
    # a block keeps at least its LayerNorm inputs, q/k/v and the attention probabilities
    assert prof.layers[1].kept_activation_bytes_per_sample >= 4 * (
        2 * 8 * 32 + 3 * 8 * 32 + 2 * 8 * 8
    )
    assert prof.layers[0].kept_activation_bytes_per_sample == 8 * 8  # embedding keeps the ids


def test_tuple_chain_gnmt() -> None:
    w = get_workload("gnmt", layers=4, hidden=8, vocab=20, seq=4)
    prof = profile_workload(w, [1, 2], warmup=0, repeats=1)
    assert prof.layers[0].output_bytes_per_sample == 2 * 4 * 8 * 4  # (src_emb, tgt_emb)
    assert prof.layers[1].output_bytes_per_sample == (4 * 16 + 4 * 8) * 4  # bi-LSTM out + tgt
    assert all(ly.backward.at(1) > 0 for ly in prof.layers)


def test_bad_inputs() -> None:
    w = get_workload("mlp")
    with pytest.raises(ValidationError, match="batch sizes"):
        profile_workload(w, [0, 2])
    with pytest.raises(ValidationError, match="batch sizes"):
        profile_workload(w, [])
    with pytest.raises(ValidationError, match="repeats"):
        profile_workload(w, [1], repeats=0)
    with pytest.raises(ValidationError, match="device"):
        profile_workload(w, [1], device="tpu")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--model", "mlp", "--batch-sizes", "1,x"], "--batch-sizes"),
        (["--model", "mlp", "--batch-sizes", "0"], "--batch-sizes"),
        (["--model", "mlp", "--set", "depth=3"], "accepted"),
        (["--model", "no_such_mod_q:f"], "cannot import"),
    ],
)
def test_cli_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    rc = main(["profile", *args, "--output", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.startswith("dapple: error:") and message in err and "\n" not in err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_cuda_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["profile", "--model", "mlp", "--device", "cuda", "--output", str(tmp_path / "x.json")]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "CUDA is not available" in err and "\n" not in err


def test_cli_sequential_factory(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text(
        "from torch import nn\n"
        "def net(width=6):\n"
        "    return nn.Sequential(nn.Conv2d(3, width, 3), nn.ReLU(), nn.Flatten(),"
        " nn.Linear(width * 4, 2))\n"
    )
    out = tmp_path / "p.json"
    rc = main(
        [
            "profile",
            "--model",
            f"{f}:net",
            "--input-shape",
            "3,4,4",
            "--set",
            "width=5",
            "--batch-sizes",
            "1,2",
            "--repeats",
            "1",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    prof = ModelProfile.load(out)
    assert [ly.parameter_bytes for ly in prof.layers] == [
        (3 * 9 * 5 + 5) * 4,
        0,
        0,
        (20 * 2 + 2) * 4,
    ]
    assert prof.input_bytes_per_sample == 3 * 4 * 4 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_profile() -> None:  # pragma: no cover - GPU only
    prof = profile_workload(get_workload("transformer"), [1, 2, 4], device="cuda")
    assert all(ly.forward.at(1) > 0 for ly in prof.layers)
    assert prof.device != "cpu"


def test_split_backward_measures_both_halves_as_the_runtime_runs_them() -> None:
    w = get_workload("transformer", layers=1, hidden=64, heads=2, seq=16, vocab=64)
    prof = profile_workload(w, [4, 8], warmup=1, repeats=3, num_threads=1, split_backward=True)
    emb, block, head = prof.layers
    assert all(ly.backward_input is not None for ly in prof.layers)
    assert all(ly.backward_weight is not None for ly in prof.layers)
    # token ids are integers: the embedding has no input gradient, its whole backward is W
    # (timed on its own, as the runtime's first stage runs it)
    assert emb.backward_input is not None and emb.backward_input.at(8) == 0.0
    i, wgt = emb.backward_split(8)
    assert i == 0.0 and wgt > 0
    for ly in (block, head):
        i, wgt = ly.backward_split(8)  # measured each: no longer constrained to sum to B
        assert i > 0 and wgt > 0
        assert (i, wgt) == (ly.backward_input.at(8), ly.backward_weight.at(8))  # type: ignore[union-attr]
    assert ModelProfile.from_dict(prof.to_dict()) == prof
    old = dataclasses.replace(block, backward_weight=None)  # profiles without W: B - I
    i, wgt = old.backward_split(8)
    assert i + wgt == pytest.approx(block.backward.at(8))
    plain = profile_workload(w, [4], warmup=0, repeats=1, num_threads=1)
    assert all(ly.backward_input is None for ly in plain.layers)


# -- which layers shard over a tensor group --------------------------------------------------------
TP_ZOO = {"layers": 2, "hidden": 32, "heads": 4, "seq": 8, "vocab": 64}


def _traced_transformer(tp_plan: dict[str, str]) -> Workload:
    """The zoo transformer traced into pieces (embedding, block, block, head) with ``tp_plan``."""
    from dapple.models.split import workload_from_module
    from dapple.models.zoo.transformer import transformer

    wl = transformer(**TP_ZOO)
    traced = workload_from_module(
        lambda: transformer(**TP_ZOO).build_model(), wl.make_batch, wl.loss_fn,
        split_at=["1", "2", "3"],
    )  # fmt: skip
    return dataclasses.replace(traced, tp_plan=tp_plan)


def _runtime_cuts(wl: Workload, tp_plan: dict[str, str]) -> list[bool]:
    """Per layer: whether the runtime's :func:`parallelize_stage` cuts it (a traced piece whose
    parameters the plan matches: :func:`plan_layouts` finds some)."""
    from torch import fx

    from dapple.runtime.parallel.tp import plan_layouts

    out = []
    for i in range(wl.num_layers):
        layer = wl.build_layer(i)
        try:
            cut = isinstance(layer, fx.GraphModule) and bool(plan_layouts(layer, tp_plan)[0])
        except ValidationError as e:
            assert "matches no parameter" in str(e)
            cut = False
        out.append(cut)
    return out


def test_profiles_mark_the_layers_the_runtime_cuts() -> None:
    from dapple.models.tp_plan import TRANSFORMER_TP_PLAN

    wl = _traced_transformer(dict(TRANSFORMER_TP_PLAN))
    prof = profile_workload(wl, [1, 2], warmup=0, repeats=1)
    marked = [x.tensor_parallel for x in prof.layers]
    assert marked == [False, True, True, False]  # the blocks; the embedding and head stay whole
    assert marked == _runtime_cuts(wl, dict(TRANSFORMER_TP_PLAN))
    assert ModelProfile.from_dict(prof.to_dict()) == prof  # the marks are saved
    plain = get_workload("transformer", **TP_ZOO)  # whole layers, no TP plan
    odd = dataclasses.replace(wl, tp_plan={"*.qkv": "sequence_parallel"})  # no such style
    for other in (plain, get_workload("mlp"), odd):
        layers = profile_workload(other, [1], warmup=0, repeats=1).layers
        assert not any(x.tensor_parallel for x in layers), other.name


def test_profile_of_a_hf_llama_marks_its_decoder_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tf = pytest.importorskip("transformers")
    from dapple.models.spec import load
    from dapple.models.tp_plan import tp_plan_of

    path = tmp_path / "llama"
    tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=48,
                   max_position_embeddings=32).save_pretrained(path)  # fmt: skip
    out = tmp_path / "p.json"
    argv = ["profile", "--model", f"hf:{path}", "--batch-sizes", "1,2", "--repeats", "1"]
    assert main([*argv, "--warmup", "0", "-o", str(out)]) == 0
    capsys.readouterr()
    prof = ModelProfile.load(out)
    assert [x.tensor_parallel for x in prof.layers] == [False, True, True, False]
    wl = load(f"hf:{path}")
    assert _runtime_cuts(wl, tp_plan_of(wl)) == [False, True, True, False]


def test_a_model_with_tied_parameters_marks_its_blocks(tmp_path: Path) -> None:
    """The runtime cuts a tied model's blocks (its tied embedding and head stay whole on every
    tensor rank), so its profile marks them as any other."""
    tf = pytest.importorskip("transformers")
    from dapple.models.spec import load

    path = tmp_path / "tied"
    tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=2, vocab_size=48,
                   max_position_embeddings=32, tie_word_embeddings=True).save_pretrained(path)  # fmt: skip
    wl = load(f"hf:{path}")
    assert wl.tied_parameters
    layers = profile_workload(wl, [1], warmup=0, repeats=1).layers
    assert [x.tensor_parallel for x in layers] == [False, True, True, False]
    assert [x.tied_parameter_bytes > 0 for x in layers] == [True, False, False, True]


def test_median_layers_keeps_each_layers_median_pass_whole() -> None:
    from builders import make_profile
    from dapple.profiler.measure import median_layers

    a, b, c = (make_profile(n=3, fwd=f, bwd=2 * f) for f in (1.0, 3.0, 2.0))
    slow = dataclasses.replace(
        c.layers[1], forward=dataclasses.replace(c.layers[1].forward, per_sample_ms=9.0)
    )
    c = dataclasses.replace(c, layers=(c.layers[0], slow, c.layers[2]))  # its layer 1: slowest
    out = median_layers([a, b, c], b=2)
    assert [layer.forward.per_sample_ms for layer in out.layers] == [2.0, 3.0, 2.0]
    assert out.layers[0] is c.layers[0] and out.layers[1] is b.layers[1]
    assert median_layers([a], b=2) is a
    with pytest.raises(ValidationError, match="no profile pass"):
        median_layers([], b=2)


def test_profile_passes_are_checked() -> None:
    wl = get_workload("mlp")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValidationError, match="passes must be an integer >= 1"):
            profile_workload(wl, [1], passes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="one length"):
        profile_workload(wl, [1], passes=2, seq_lens=[8])

"""Models beyond the zoo's shapes: mixtures of experts (plain torch and ``transformers``' Mixtral)
whose forward picks its ops by device, and causal LMs whose sequence length changes every step
without a declared dimension. Each splits, profiles and plans from a spec file and the CLI, and
(slow) ``verify``s under uneven replication."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import sympy
import torch
from torch import nn
from torch.utils._sympy.numbers import int_oo

import extra_models as em
from dapple import api
from dapple.cli import main
from dapple.core.plan import straight_plan
from dapple.models import split as split_mod
from dapple.models import split_pieces
from dapple.models.shapes import DynamicDim
from dapple.models.split import original_model
from dapple.models.split_graph import SplitModel
from dapple.models.trace import _range_end, fake_copy, fake_to_meta
from dapple.models.workload import Workload

SPEC_FILE = str(Path(__file__).with_name("extra_models.py"))
"""The models as a ``file.py``, the way a user hands their own to ``-m file.py:factory``."""


def _histc_input_dtypes(pieces: list[torch.fx.GraphModule]) -> list[torch.dtype]:
    return [
        n.args[0].meta["val"].dtype
        for p in pieces
        for n in p.graph.nodes
        if n.target is torch.ops.aten.histc.default
    ]


def assert_matches_model(wl: Workload, seeds: tuple[int, ...] = (0, 1, 2)) -> None:
    """The piece chain's output, loss and every gradient equal the unsplit model's."""
    chain, model = wl.build_model(3), original_model(wl, 3)
    for seed in seeds:
        inputs, targets = wl.make_batch(3, seed)
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        out, ref = chain(inputs), model(*args)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        chain.zero_grad()
        model.zero_grad()
        wl.loss_fn(out, targets).backward()
        wl.loss_fn(ref, targets).backward()
        for piece in chain:
            for name, p in piece.named_parameters():
                assert p.grad is not None, name
                torch.testing.assert_close(p.grad, model.get_parameter(name).grad, msg=name)


# -- tracing without weights, on the CPU's branch --------------------------------------------


def test_range_end_reads_unbounded_ends_as_none() -> None:
    assert _range_end(int_oo) is None and _range_end(-int_oo) is None
    assert _range_end(sympy.oo) is None
    assert _range_end(sympy.Integer(16)) == 16 and _range_end(sympy.Integer(2)) == 2


def test_fake_copy_keeps_tied_tensors_and_fake_to_meta_undoes_it() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight
    model.register_buffer("table", torch.arange(3.0))
    fake, (x,) = fake_copy(copy.deepcopy(model), (torch.zeros(2, 5, dtype=torch.long),))
    assert fake[0].weight is fake[1].weight
    assert all(t.device == torch.device("cpu") for t in [x, *fake.parameters(), fake.table])
    fake_to_meta(fake)
    assert fake[0].weight is fake[1].weight and isinstance(fake[0].weight, nn.Parameter)
    assert all(t.is_meta for t in [*fake.parameters(), fake.table])
    assert fake.table.shape == (3,) and fake[1].weight.shape == (8, 4)


def test_moe_is_traced_on_the_cpu_branch_and_matches_the_model() -> None:
    """The experts count tokens with ``torch.histc`` on float ids on the CPU (int elsewhere):
    traced on ``meta`` the graph took the int branch, which the CPU cannot run."""
    wl = em.moe_lm()
    pieces = split_mod._splitter_of(wl).split.pieces
    assert _histc_input_dtypes(pieces) == [torch.float32, torch.float32]
    on_meta = SplitModel(em.moe_model().to("meta"), em.fixed_batch(2, 0)[0].to("meta"))
    assert _histc_input_dtypes(on_meta.pieces) == [torch.int32, torch.int32]
    assert list(wl.layer_names) == ["prologue", "blocks.0", "blocks.1", "epilogue"]
    assert wl.dynamic_dims == {}
    assert_matches_model(wl)


def test_a_model_whose_tensors_cannot_be_faked_is_traced_with_real_weights(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no fake for this tensor subclass")

    monkeypatch.setattr(split_pieces, "fake_copy", refuse)
    with caplog.at_level(logging.WARNING, logger="dapple.models.split_pieces"):
        wl = em.varlen_lm()
    assert "could not be traced without its weights (cannot make fake tensors" in caplog.text
    assert "traced with real weights" in caplog.text
    assert_matches_model(wl, seeds=(0, 1))


def test_mixtral_splits_and_matches_the_model() -> None:
    pytest.importorskip("transformers")
    wl = em.mixtral()
    assert list(wl.layer_names) == [
        "prologue",
        "lm.model.layers.0",
        "lm.model.layers.1",
        "epilogue",
    ]
    model = original_model(wl, 0)
    assert model.lm.config._experts_implementation == "grouped_mm"
    assert_matches_model(wl, seeds=(0, 1))


def test_mixtral_from_a_config_directory_uses_its_traceable_experts(tmp_path: Path) -> None:
    """``hf:DIR`` builds a subclass of the model class; it still gets the grouped-matmul
    experts (the eager loop over the experts hit cannot be traced)."""
    pytest.importorskip("transformers")
    from dapple.models.hf import hf_causal_lm

    em.mixtral_config().save_pretrained(tmp_path)
    wl = hf_causal_lm(str(tmp_path), seq=16)
    assert original_model(wl, 0).config._experts_implementation == "grouped_mm"
    assert list(wl.layer_names) == ["prologue", "model.layers.0", "model.layers.1", "epilogue"]
    assert_matches_model(wl, seeds=(0,))


# -- lengths found from the batches ----------------------------------------------------------


def test_found_length_has_no_upper_bound_and_every_length_matches() -> None:
    wl = em.varlen_lm()
    assert wl.dynamic_dims == {0: {1: DynamicDim("in0_d1", 1, None)}}
    assert [wl.make_batch(2, s)[0].shape[1] for s in range(3)] == list(em.LENGTHS)
    assert_matches_model(wl)


def test_found_length_of_a_llama_matches_the_model() -> None:
    pytest.importorskip("transformers")
    wl = em.varlen_llama()
    dim = wl.dynamic_dims[0][1]
    assert dim.max is None and wl.dynamic_dims[1][1] == dim
    assert_matches_model(wl)


def test_profile_and_plan_a_found_length_at_several_lengths() -> None:
    prof = api.profile(em.varlen_lm(), [1, 2], "cpu", repeats=1, warmup=0, seq_lens=[8, 16])
    assert len(prof.layers) == 4
    plan = api.plan(prof, "local-cpu", global_batch_size=8)
    assert plan.global_batch_size == 8


# -- the CLI, from a spec file ---------------------------------------------------------------


@pytest.mark.parametrize("factory", ["moe_lm", "varlen_lm"])
def test_cli_split_profile_plan_from_a_spec_file(
    factory: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"{SPEC_FILE}:{factory}"
    assert main(["split", "-m", spec]) == 0
    assert "blocks.1" in capsys.readouterr().out
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    profile = ["profile", "-m", spec, "--batch-sizes", "1,2", "--device", "cpu"]
    assert main([*profile, "--repeats", "1", "--warmup", "0", "-o", str(prof)]) == 0
    plan_args = ["plan", "--profile", str(prof), "--cluster", "local-cpu"]
    assert main([*plan_args, "--global-batch-size", "8", "-o", str(plan)]) == 0
    assert plan.exists()


def test_cli_split_and_profile_mixtral(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    spec = f"{SPEC_FILE}:mixtral"
    assert main(["split", "-m", spec]) == 0
    assert "lm.model.layers.1" in capsys.readouterr().out
    prof = tmp_path / "p.json"
    profile = ["profile", "-m", spec, "--batch-sizes", "1,2", "--device", "cpu"]
    assert main([*profile, "--repeats", "1", "--warmup", "0", "-o", str(prof)]) == 0


# -- verify under uneven replication (SGD) ---------------------------------------------------

_PLANS = {
    "3:1": straight_plan(4, [0, 2], global_batch_size=6, num_micro_batches=2, replicas=[3, 1]),
    "1:2:1": straight_plan(
        4, [0, 1, 3], global_batch_size=4, num_micro_batches=2, replicas=[1, 2, 1]
    ),
    "2:1": straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[2, 1]),
}


def _verify(cases: list[tuple[str, str]]) -> None:
    reports = api.verify_many(
        [(_PLANS[p], f"extra_models:{f}") for p, f in cases],
        3,
        device="cpu",
        optimizer="sgd",
        lr=0.1,
        timeout_s=240,
    )
    for (plan, factory), rep in zip(cases, reports, strict=True):
        assert rep.ok, (factory, plan, rep.max_abs_diff)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5), (factory, plan)


@pytest.mark.slow
def test_verify_mixtures_of_experts_under_1_2_1_3_1_and_2_1() -> None:
    pytest.importorskip("transformers")
    _verify([("1:2:1", "moe_lm"), ("3:1", "mixtral"), ("2:1", "moe_lm")])


@pytest.mark.slow
def test_verify_lengths_found_from_the_batches_under_2_1_3_1_and_1_2_1() -> None:
    """Steps 0, 1, 2 have 8, 12 and 16 tokens; the ``2:1`` plan runs on 3 processes."""
    pytest.importorskip("transformers")
    _verify([("2:1", "varlen_lm"), ("3:1", "varlen_lm"), ("1:2:1", "varlen_llama")])

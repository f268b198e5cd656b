"""Shapes that change from step to step: finding and declaring dynamic input dimensions, the
per-step batch check and its one-line errors, the transport's shape header, the zoo
transformer's per-step sequence lengths, and (slow) ``verify`` with lengths changing every step
under uneven replication."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import runtime_workloads as rw
from dapple import api
from dapple.cli import main
from dapple.core.plan import Plan, straight_plan
from dapple.errors import ValidationError
from dapple.models.shapes import (
    DynamicDim,
    check_batch,
    check_steps,
    find_dynamic_dims,
    input_shapes,
    resolve_dims,
    run_dims,
)
from dapple.models.split import original_model, workload_from_module
from dapple.models.zoo.transformer import transformer
from dapple.runtime.rank import Batches
from dapple.runtime.transport import BoundarySpec, sample_shapes, shape_header

SEQ = DynamicDim("seq", 1, 16)


def _pair_batch(n: int, seed: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Input 0: ``(n, 4 + seed % 3, 5)`` floats; input 1: ``(n, 3)`` ints (static)."""
    x = torch.zeros(n, 4 + seed % 3, 5)
    return (x, torch.zeros(n, 3, dtype=torch.int64)), torch.zeros(n)


def test_find_dynamic_dims_marks_only_the_dimensions_that_differ() -> None:
    found = find_dynamic_dims(_pair_batch, 2, seed=0)
    assert found == {0: {1: DynamicDim("in0_d1")}}
    assert find_dynamic_dims(rw._mlp_batch, 2, seed=0) == {}


def test_declared_dimensions_override_found_ones() -> None:
    wl = transformer(layers=1, hidden=8, heads=2, seq=16, vocab=16, seq_choices=[8, 12])
    assert run_dims(wl, 4, 0) == {0: {1: SEQ}}  # found (8 != 12) and declared with its range
    static = transformer(layers=1, hidden=8, heads=2, seq=16, vocab=16)
    assert run_dims(static, 4, 0) == {}


def test_check_batch_accepts_sizes_in_range_and_names_what_does_not_fit() -> None:
    ref = input_shapes((torch.zeros(4, 8, 5), torch.zeros(4, 3, dtype=torch.int64)))
    dims = {0: {1: SEQ}}
    ok = (torch.zeros(2, 16, 5), torch.zeros(2, 3, dtype=torch.int64))  # batch is free too
    check_batch(ref, dims, ok, where="step 1")
    cases = [
        ((torch.zeros(4, 17, 5), torch.zeros(4, 3, dtype=torch.int64)),
         "step 2: input 0 dimension 1 (seq) is 17, outside the allowed range [1, 16]"),
        ((torch.zeros(4, 8, 6), torch.zeros(4, 3, dtype=torch.int64)),
         "step 2: input 0 dimension 2 is 6, but it is static (always 5)"),
        ((torch.zeros(4, 8, 5), torch.zeros(4, 4, dtype=torch.int64)),
         "step 2: input 1 dimension 1 is 4, but it is static (always 3)"),
        ((torch.zeros(4, 8), torch.zeros(4, 3, dtype=torch.int64)),
         "step 2: input 0 has 2 dimensions [4, 8], the model takes 3"),
        ((torch.zeros(4, 8, 5), torch.zeros(4, 3)),
         "step 2: input 1 has dtype torch.float32, the model takes torch.int64"),
        (torch.zeros(4, 8, 5), "step 2: the batch has 1 inputs, the model was set up with 2"),
    ]  # fmt: skip
    for inputs, message in cases:
        with pytest.raises(ValidationError) as e:
            check_batch(ref, dims, inputs, where="step 2")
        assert str(e.value).startswith(message), str(e.value)


def test_dynamic_dim_rejects_an_empty_range() -> None:
    with pytest.raises(ValidationError, match="min=9 max=8"):
        DynamicDim("seq", 9, 8)
    assert DynamicDim("h").range_text() == "[1, inf]" and DynamicDim("h").accepts(10**6)


def test_transformer_seq_choices_vary_per_step_within_the_position_table() -> None:
    wl = transformer(layers=1, hidden=8, heads=2, seq=16, vocab=16, seq_choices=[8, 12, 16])
    model = wl.build_model(0)
    for seed, n in [(0, 8), (1, 12), (2, 16), (3, 8)]:
        x, y = wl.make_batch(3, seed)
        assert x.shape == y.shape == (3, n)
        assert model(x).shape == (3, n, 16)
    with pytest.raises(ValidationError, match=r"seq_choices \[8, 17\] must lie in \[1, seq=16\]"):
        transformer(seq=16, seq_choices=[8, 17])


def test_shape_header_round_trip() -> None:
    out = (torch.zeros(3, 7, 5), torch.zeros(3, dtype=torch.int64), torch.zeros(3, 2, 4, 6))
    spec = BoundarySpec.of(tuple(t[:1] for t in out))
    header = shape_header(out, torch.device("cpu"))
    assert header.tolist() == [7, 5, 2, 4, 6] and header.dtype == torch.int64
    assert sample_shapes(spec, header) == [(7, 5), (), (2, 4, 6)]
    with pytest.raises(TypeError, match="carries 64 tensors; at most 63"):
        BoundarySpec.of(tuple(torch.zeros(1, 2) for _ in range(64)))  # the header's tag is 63


def test_runtime_checks_each_steps_batch_before_the_step() -> None:
    wl = rw.overflowing_lm()
    first = wl.make_batch(4, 0)
    no_data = SimpleNamespace(source=None)
    batches = Batches(wl, 0, 4, first, no_data, input_shapes(first[0]), run_dims(wl, 4, 0))  # type: ignore[arg-type]
    assert batches.batch(2)[0].shape == (4, 8)
    with pytest.raises(ValidationError, match=r"step 3: input 0 dimension 1 \(seq\) is 12"):
        batches.batch(3)
    check_steps(wl, 4, 0, 3)  # steps 0..2 fit
    with pytest.raises(ValidationError, match=r"allowed range \[1, 8\]"):
        check_steps(wl, 4, 0, 4)


def test_cli_verify_and_train_stop_on_a_batch_the_model_cannot_take_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = straight_plan(3, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[1, 1])
    plan.save(tmp_path / "plan.json")
    for command in ("verify", "train"):  # both before any worker starts
        argv = [command, "--plan", str(tmp_path / "plan.json"), "--model",
                "runtime_workloads:overflowing_lm", "--steps", "4", "--device", "cpu"]  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(
            "dapple: error: step 3: input 0 dimension 1 (seq) is 12, outside the allowed range "
            "[1, 8]"
        )


class _Net(nn.Module):
    """Two linear blocks over ``(b, len, 4)``; doubles its output when ``len > 6``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x * 2 if x.shape[1] > 6 else x


def _net_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``len`` = 5, 6, 7 for seeds 0, 1, 2."""
    g = torch.Generator().manual_seed(seed)
    s = 5 + seed % 3
    return torch.randn(n, s, 4, generator=g), torch.randn(n, s, 4, generator=g)


def test_split_of_a_model_that_branches_on_a_found_length_names_the_dimension() -> None:
    with pytest.raises(ValidationError) as e:
        workload_from_module(_Net, _net_batch, F.mse_loss)
    assert str(e.value).startswith(
        "_Net.forward cannot be traced with input 0 dimension 1 (in0_d1) dynamic: it fixes or "
        "branches on that size; declare the dimension static"
    )


def test_split_with_a_declared_range_or_a_static_declaration() -> None:
    wl = workload_from_module(_Net, _net_batch, F.mse_loss, dynamic_dims={"x": {1: ("len", 2, 6)}})
    assert wl.dynamic_dims == {0: {1: DynamicDim("len", 2, 6)}}
    chain, model = wl.build_model(0), original_model(wl, 0)
    for seed in (0, 1):
        x, _ = wl.make_batch(3, seed)
        torch.testing.assert_close(chain(x), model(x), rtol=0, atol=0)
    with pytest.raises(
        ValidationError,
        match=r"step 2: input 0 dimension 1 \(len\) is 7, outside the allowed range \[2, 6\]",
    ):
        check_steps(wl, 4, 0, 3)
    static = workload_from_module(_Net, _net_batch, F.mse_loss, dynamic_dims={0: {1: None}})
    assert static.dynamic_dims == {0: {1: None}} and run_dims(static, 4, 0) == {}
    with pytest.raises(
        ValidationError, match=r"step 1: input 0 dimension 1 is 6, but it is static \(always 5\)"
    ):
        check_steps(static, 4, 0, 2)


def test_resolve_dims_by_name_or_position_shares_one_dimension_per_name() -> None:
    dims = resolve_dims({"ids": {1: "seq"}, 1: {1: "seq", 2: ("w", 1, 8)}, "x": {2: None}},
                        ["ids", "mask", "x"])  # fmt: skip
    assert dims == {0: {1: DynamicDim("seq")}, 1: {1: DynamicDim("seq"), 2: DynamicDim("w", 1, 8)},
                    2: {2: None}}  # fmt: skip
    assert dims[0][1] is dims[1][1]
    for bad, message in [({"idz": {1: "s"}}, "names input 'idz'; the inputs are"),
                         ({3: {1: "s"}}, "names input 3; the model takes 3 inputs"),
                         ({0: {0: "b"}}, "dimension 0 is the batch")]:  # fmt: skip
        with pytest.raises(ValidationError, match=message):
            resolve_dims(bad, ["ids", "mask", "x"])


def test_llama_split_with_changing_lengths_matches_the_original_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import hf_dirs
    from dapple.models.hf import hf_causal_lm

    path = hf_dirs.save_llama(tmp_path / "llama")
    wl = hf_causal_lm(str(path), seq=16, seq_choices=[6, 10, 16])
    seq = DynamicDim("seq", 2, 16)
    assert wl.dynamic_dims == {0: {1: seq}, 1: {1: seq}}
    chain, model = wl.build_model(0), original_model(wl, 0)
    for seed, n in [(0, 6), (1, 10), (2, 16)]:
        x, _ = wl.make_batch(3, seed)
        assert x[0].shape == (3, n)
        torch.testing.assert_close(chain(x), model(*x), rtol=0, atol=0)
    with pytest.raises(ValidationError, match=r"seq_choices \[6, 17\] must lie in \[2, seq=16\]"):
        hf_causal_lm(str(path), seq=16, seq_choices=[6, 17])


def _recomputing(plan: Plan) -> Plan:
    """``plan`` with every stage re-computing its forward in backward."""
    stages = tuple(dataclasses.replace(st, recompute="full") for st in plan.stages)
    return dataclasses.replace(plan, stages=stages)


@pytest.mark.slow
def test_verify_shapes_changing_every_step_under_3_1_2_2_and_1_2_1(tmp_path: Path) -> None:
    """One spawned group: the zoo transformer (8, 12 or 16 tokens by step) under 3:1 and 2:2
    (re-computing), a LLaMA split from its Hugging Face config (6, 10 or 16 tokens) under 1:2:1
    and a CNN whose images are 8, 12 or 16 pixels wide under 2:2; the activations cross
    split-concat boundaries with their shape headers, the gradients come back shaped like them,
    and every parameter matches the one-process reference."""
    pytest.importorskip("transformers")
    import hf_dirs

    zoo = api.load("transformer", layers=2, hidden=16, heads=2, seq=16, vocab=32,
                   seq_choices=[8, 12, 16])  # fmt: skip
    path = hf_dirs.save_llama(tmp_path / "llama")
    llama = api.load(f"hf:{path}", seq=16, seq_choices=[6, 10, 16])
    cnn = api.load("runtime_workloads:var_cnn")  # images of side 8, 12, 16: found, not declared
    cases = [
        (straight_plan(4, [0, 2], global_batch_size=6, num_micro_batches=2, replicas=[3, 1]), zoo),
        (_recomputing(straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2,
                                    replicas=[2, 2])), zoo),
        (straight_plan(4, [0, 1, 3], global_batch_size=4, num_micro_batches=2,
                       replicas=[1, 2, 1]), llama),
        (straight_plan(4, [0, 1], global_batch_size=8, num_micro_batches=2, replicas=[2, 2]),
         cnn),
    ]  # fmt: skip
    reports = api.verify_many(cases, 3, device="cpu")
    for rep in reports:
        assert rep.ok, (rep.plan.replication, rep.max_abs_diff)
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)
    assert reports[2].reference == "original model"


def test_step_metrics_report_the_steps_tokens_beside_tokens_per_s() -> None:
    from dapple.runtime.metrics import step_metrics

    plan = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2)
    rows = [[0, 0, -1, 0, 0.0, 1024.0], [0, 1, -1, 1, 0.5, 2048.0]]
    for tokens in (64, 96):  # 8 samples of 8 and of 12 tokens
        m = step_metrics(plan, 1, rows, 40.0, "held_activations", None, target_tokens=tokens)
        assert m.tokens == tokens and m.tokens_per_s == pytest.approx(tokens / 0.04)
        assert f" {tokens} tokens {tokens / 0.04:.0f} tokens/s " in m.line()
    assert step_metrics(plan, 1, rows, 40.0, "held_activations", None).tokens is None

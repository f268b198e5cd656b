"""Hugging Face GPT-2 / BERT workloads: the piece chain equals the HF model's loss and grads."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dapple.errors import ValidationError
from dapple.models.split import original_model
from dapple.models.tied import sum_tied_grads_local
from dapple.models.workload import Workload

transformers = pytest.importorskip("transformers")

from dapple.models.hf import hf_bert, hf_gpt2  # noqa: E402

TINY: dict[str, Any] = {"layers": 2, "hidden": 32, "heads": 2, "vocab": 64, "seq": 16}


@pytest.fixture(scope="module")
def gpt2() -> Workload:
    return hf_gpt2(**TINY)


@pytest.fixture(scope="module")
def bert() -> Workload:
    return hf_bert(**TINY)


def hf_loss(model: torch.nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """The loss Hugging Face's own head computes (not our loss function).

    GPT-2's targets are already the next tokens (``targets[:, t]`` follows ``ids[:, t]``), so
    they go in as ``shift_labels``, which Hugging Face's causal-LM loss takes unshifted: all
    ``seq`` targets count (``labels=ids`` would shift them and drop the last).
    """
    ids, mask = inputs
    if isinstance(model, transformers.GPT2LMHeadModel):
        out = transformers.GPT2LMHeadModel.forward(
            model,
            input_ids=ids,
            attention_mask=mask,
            labels=targets,
            shift_labels=targets,
            use_cache=False,
        )
    else:
        out = transformers.BertForMaskedLM.forward(
            model, input_ids=ids, attention_mask=mask, labels=targets
        )
    return out.loss  # type: ignore[no-any-return]


def assert_matches_hf(w: Workload, seed: int = 3, batch: int = 3) -> None:
    model = original_model(w, seed)
    chain = w.build_model(seed)
    inputs, targets = w.make_batch(batch, 7)
    ref = hf_loss(model, inputs, targets)
    out = chain(inputs)
    torch.testing.assert_close(out, model(*inputs))
    loss = w.loss_fn(out, targets)
    torch.testing.assert_close(loss, ref)
    ref.backward()
    loss.backward()
    sum_tied_grads_local(list(chain), w.tied_parameters)
    covered = set()
    for piece in chain:
        for name, p in piece.named_parameters():
            orig = model.get_parameter(name)
            covered.add(id(orig))
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, orig.grad, msg=lambda m, n=name: f"{n}: {m}")
    assert covered == {id(p) for p in model.parameters()}


def test_gpt2_pieces(gpt2: Workload) -> None:
    assert list(gpt2.layer_names) == ["prologue", "transformer.h.0", "transformer.h.1", "epilogue"]
    chain = gpt2.build_model(0)
    assert {n for n, _ in chain[1].named_parameters()} == {
        n for n, _ in original_model(gpt2).named_parameters() if n.startswith("transformer.h.0.")
    }
    assert "transformer.ln_f.weight" in dict(chain[3].named_parameters())


def test_gpt2_tied_embeddings_detected(gpt2: Workload) -> None:
    assert len(gpt2.tied_parameters) == 1
    (first, name_first), (last, name_last) = sorted(gpt2.tied_parameters[0])
    assert (first, last) == (0, gpt2.num_layers - 1)
    model = original_model(gpt2)
    assert model.get_parameter(name_first) is model.get_parameter(name_last)
    assert model.get_parameter(name_first) is model.transformer.wte.weight
    # Each copy is named after the module that uses it in its piece.
    assert (name_first, name_last) == ("transformer.wte.weight", "lm_head.weight")


def test_gpt2_equals_hf_loss_and_grads(gpt2: Workload) -> None:
    assert_matches_hf(gpt2)


def test_gpt2_batch_of_one(gpt2: Workload) -> None:
    assert_matches_hf(gpt2, batch=1)


def test_bert_equals_hf_loss_and_grads(bert: Workload) -> None:
    assert list(bert.layer_names)[1:3] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
    assert len(bert.tied_parameters) == 1  # word embeddings and MLM decoder
    assert_matches_hf(bert)


def test_bert_batch_has_padding_and_fixed_masked_count(bert: Workload) -> None:
    (ids, mask), targets = bert.make_batch(8, 1)
    assert (mask == 0).any()  # the attention mask really masks something
    per_sample = (targets != -100).sum(dim=1)
    assert torch.all(per_sample == per_sample[0])
    assert torch.all(ids[targets != -100] == TINY["vocab"] - 1)
    assert torch.all(ids[mask == 0] == 0)


def test_bert_mask_changes_output(bert: Workload) -> None:
    """The int attention mask flows through the cuts: changing it changes the chain's output."""
    chain = bert.build_model(0)
    (ids, mask), _ = bert.make_batch(2, 1)
    with torch.no_grad():
        a = chain((ids, mask))
        b = chain((ids, torch.ones_like(mask)))
    assert not torch.allclose(a[mask == 1], b[mask == 1])


def test_gpt2_split_at() -> None:
    w = hf_gpt2(**TINY, split_at="lm_head,transformer.h.1")  # CLI --set form
    assert list(w.layer_names) == ["prologue", "transformer.h.1", "lm_head"]
    assert w.num_layers == 3
    assert {n for n, _ in w.build_layer(2).named_parameters()} == {"lm_head.weight"}
    assert_matches_hf(w)


def test_gpt2_bad_split_name() -> None:
    with pytest.raises(ValidationError, match="valid names") as info:
        hf_gpt2(**TINY, split_at=["transformer.h.7"])
    assert "transformer.h.1.attn" in str(info.value)
    assert "lm_head" in str(info.value)
    assert "_empty" not in str(info.value)  # only real module names are offered


def test_bad_sizes() -> None:
    with pytest.raises(ValidationError, match="divisible"):
        hf_gpt2(layers=1, hidden=30, heads=4)
    with pytest.raises(ValidationError, match="masked_per_sample"):
        hf_bert(layers=1, seq=8, masked_per_sample=9)


def test_zoo_spec() -> None:
    zoo = pytest.importorskip("dapple.models.zoo")
    w = zoo.load_workload("dapple.models.hf:gpt2", layers=1, hidden=16, heads=2, vocab=32, seq=8)
    assert w.num_layers == 3
    w = zoo.load_workload(
        "dapple.models.hf:bert", layers=2, hidden=16, heads=2, vocab=32, seq=8, split_at=["cls"]
    )
    assert list(w.layer_names) == ["prologue", "cls"]


def test_cli_split(capsys: pytest.CaptureFixture[str]) -> None:
    from dapple.cli import main

    argv = ["split", "-m", "dapple.models.hf:gpt2", "--set", "layers=2", "--set", "hidden=16"]
    assert main([*argv, "--split-at", "transformer.h.1,lm_head"]) == 0
    out = capsys.readouterr().out
    assert "transformer.h.1" in out and "lm_head.weight" in out and "bool[2,1,32,32]" in out
    assert main([*argv, "--split-at", "transformer.h.9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dapple: error: split_at names ['transformer.h.9']")
    assert len(err.strip().splitlines()) == 1


def test_workload_pickles_for_spawned_workers(gpt2: Workload) -> None:
    import pickle

    clone = pickle.loads(pickle.dumps(gpt2))
    assert clone.layer_names == gpt2.layer_names
    assert clone.tied_parameters == gpt2.tied_parameters
    for a, b in zip(clone.build_model(4), gpt2.build_model(4), strict=True):
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert na == nb
            torch.testing.assert_close(pa, pb)


def test_gpt2_under_autocast_matches_hf(gpt2: Workload) -> None:
    """Mixed precision goes through autocast (pieces are traced in float32)."""
    model, chain = original_model(gpt2, 0), gpt2.build_model(0)
    inputs, _ = gpt2.make_batch(2, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = chain(inputs), model(*inputs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


@pytest.mark.slow
def test_gpt2_two_stage_runtime_equals_hf_training() -> None:
    """End to end: 2 pipeline stages (tied wte/lm_head on different ranks) train like HF GPT-2."""
    runtime = pytest.importorskip("dapple.runtime")
    from dapple.core.plan import straight_plan

    w = hf_gpt2(**TINY)
    plan = straight_plan(w.num_layers, [0, 2], global_batch_size=4, num_micro_batches=2)
    cfg = runtime.TrainConfig(steps=3, lr=0.1, optimizer="sgd", seed=0, timeout_s=240)
    metrics = runtime.train(plan, w, cfg)
    model = original_model(w, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = []
    for step in range(3):
        inputs, targets = w.make_batch(4, step)
        opt.zero_grad()
        loss = hf_loss(model, inputs, targets)
        loss.backward()
        opt.step()
        ref.append(loss.item())
    assert [m.loss for m in metrics] == pytest.approx(ref, rel=1e-5)

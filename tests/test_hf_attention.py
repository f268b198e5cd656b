"""``attention=causal`` (:mod:`dapple.models.hf_attention`): a traced Hugging Face causal LM calls
SDPA with ``is_causal`` and no mask, trains to the same loss and gradients as the traced model
as it comes (``masked``), and is refused where that does not hold."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dapple import api
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.models.hf import causal_lm_loss, hf_causal_lm
from dapple.models.hf_attention import CAUSAL_FAMILIES, IMPLEMENTATION, use_attention

tf = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_trace import attention_calls  # noqa: E402
from hf_families import FAMILIES, VOCAB  # noqa: E402

SEQ = 16
SLIDING = ("mistral",)
"""Families whose config has a sliding window: their mask is built as before (still correct)."""


def _family_dir(family: str, path: Path) -> Path:
    """The tiny ``family`` model (dropout off: the two modes compare bit for bit) saved in
    ``path``."""
    config = tf.AutoConfig.for_model(family, vocab_size=VOCAB, **FAMILIES[family])
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _loss_and_grads(path: Path, mode: str) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
    wl = hf_causal_lm(path, seq=SEQ, attention=mode)
    model = wl.build_model(0)
    (ids, mask), y = wl.make_batch(2, 0)
    calls = attention_calls(lambda m, i, k: m((i, k)), model, ids, mask, "cpu")
    loss = causal_lm_loss(model((ids, mask)), y)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], calls  # type: ignore[misc]


@pytest.mark.parametrize("family", CAUSAL_FAMILIES)
def test_causal_attention_trains_like_the_masked_model(family: str, tmp_path: Path) -> None:
    path = _family_dir(family, tmp_path / family)
    loss_m, grads_m, calls_m = _loss_and_grads(path, "masked")
    loss_c, grads_c, calls_c = _loss_and_grads(path, "causal")
    torch.testing.assert_close(loss_c, loss_m, rtol=1e-5, atol=1e-6)
    for gc, gm in zip(grads_c, grads_m, strict=True):
        torch.testing.assert_close(gc, gm, rtol=1e-4, atol=1e-6)
    assert calls_m and calls_c, (calls_m, calls_c)
    cells = [c.split(" | ") for c in calls_c]  # op | calls | mask | is_causal | query | key
    if family in SLIDING:
        assert calls_c == calls_m
    else:
        assert all(c[2] == "none" and c[3] == "True" for c in cells), calls_c
        assert all(c[2] != "none" for c in (m.split(" | ") for m in calls_m)), calls_m


def test_grouped_query_attention_keeps_its_key_heads(tmp_path: Path) -> None:
    """Llama (4 query heads, 2 key heads): the masked model copies K per head, causal not."""
    path = _family_dir("llama", tmp_path / "llama")
    *_, masked = _loss_and_grads(path, "masked")
    *_, causal = _loss_and_grads(path, "causal")
    assert [c.split(" | ")[-1] for c in masked] == ["2x4x16x8"]
    assert [c.split(" | ")[-1] for c in causal] == ["2x2x16x8"]


def test_a_family_outside_the_checked_ones_is_refused(tmp_path: Path) -> None:
    path = _family_dir("falcon", tmp_path / "falcon")
    with pytest.raises(ValidationError, match="attention=causal is checked for the families"):
        hf_causal_lm(path, seq=SEQ, attention="causal")
    with pytest.raises(ValidationError, match="attention must be one of masked, causal"):
        api.load(f"hf:{path}", seq=SEQ, attention="flash")


def test_why_falcon_is_left_out(tmp_path: Path) -> None:
    """Given the registered implementation, Falcon runs its own eager attention, which without
    the mask is no longer causal: its loss changes (the reason for the family list)."""
    path = _family_dir("falcon", tmp_path / "falcon")
    wl = hf_causal_lm(path, seq=SEQ)
    (ids, mask), y = wl.make_batch(2, 0)

    def loss(forced: bool) -> float:
        model: Any = tf.AutoModelForCausalLM.from_pretrained(path)
        if forced:
            model.config.model_type = "llama"  # past the family check, as if it were listed
            use_attention(model, "causal")
            assert model.config._attn_implementation == IMPLEMENTATION
        out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return float(causal_lm_loss(out, y))

    assert abs(loss(True) - loss(False)) > 1e-3


def test_a_causal_workload_trains_in_workers(tmp_path: Path) -> None:
    """Worker processes build the model from the picklable factory: each registers the
    implementation itself; two stages train to a finite loss."""
    path = _family_dir("llama", tmp_path / "llama")
    wl = api.load(f"hf:{path}", seq=SEQ, attention="causal")
    plan = straight_plan(wl.num_layers, [0, wl.num_layers // 2], global_batch_size=4,
                         num_micro_batches=2)  # fmt: skip
    metrics = api.train(plan, wl, 2, device="cpu", optimizer="adamw", lr=1e-3)
    assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(m.loss)) for m in metrics)


def test_the_analytic_profile_times_the_attention_the_model_runs(tmp_path: Path) -> None:
    """``--set attention=`` of an ``hf:DIR`` model: ``causal`` is timed as SDPA's causal kernel
    (``flash``), ``masked`` as the default eager profile (SDPA given the mask)."""
    from dapple.profiler.analytic import analytic_profile

    spec = f"hf:{_family_dir('llama', tmp_path / 'llama')}"

    def blocks(**kw: Any) -> list[float]:
        prof = analytic_profile(spec, "h200", precision="bf16", batch_sizes=(1, 2), **kw)
        return [lp.forward.at(2) + lp.backward.at(2) for lp in prof.layers]

    masked, causal = blocks(), blocks(overrides={"attention": "causal"})
    assert blocks(overrides={"attention": "masked"}) == masked
    assert causal == blocks(attention="flash")
    assert sum(causal) < sum(masked)
    with pytest.raises(ValidationError, match="attention must be one of masked, causal"):
        blocks(overrides={"attention": "flash"})
    with pytest.raises(ValidationError, match="two attentions"):
        blocks(overrides={"attention": "causal"}, attention="masked")

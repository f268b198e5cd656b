"""Hugging Face causal LMs train on all ``seq_len`` targets of a window (issue #35, item 1).

A window ``w`` of ``seq_len + 1`` tokens is ``x = w[:-1]`` (``input_ids``) and ``y = w[1:]``
(targets, the nanoGPT convention of token files): the loss compares ``logits[:, t]`` with
``y[:, t]`` for every ``t``, and the step metrics' ``tokens`` count those ``seq_len`` targets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dapple.core.plan import straight_plan
from dapple.datasets import IGNORE_INDEX, EpochSampler, TokenFile, open_documents
from dapple.errors import ValidationError
from dapple.models.split import original_model
from dapple.models.workload import Workload
from dapple.runtime.data import fit_data, fit_workload
from dapple.runtime.reporting import target_tokens

tf = pytest.importorskip("transformers")

from dapple.models.hf import causal_lm_loss, hf_causal_lm, hf_gpt2  # noqa: E402

SEQ, VOCAB, POSITIONS, G = 16, 48, 32, 4
"""Tokens per sample, vocabulary, position table (room for a whole window), global batch."""


def _config(family: str) -> Any:
    if family == "llama":
        return tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=POSITIONS,
        )  # fmt: skip
    return tf.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=POSITIONS,
        tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )  # fmt: skip


def _hf_dir(tmp_path: Path, family: str) -> Path:
    """A directory holding only the ``config.json`` of a tiny ``family`` causal LM (offline)."""
    d = tmp_path / family
    _config(family).save_pretrained(d)
    return d


def _token_file(path: Path, n: int, seed: int = 0) -> Path:
    np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.uint16).tofile(path)
    return path


def _hf_window_loss(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """Hugging Face's own loss with ``input_ids = labels = w`` (the whole window).

    Hugging Face shifts ``labels`` inside: the logits at position ``t`` meet ``w[t + 1]`` for
    ``t < seq_len`` and the last position meets padding (ignored). So its loss over the
    ``seq_len + 1`` tokens of ``w`` covers exactly the ``seq_len`` targets ``w[1:] = y``, and the
    logits at positions ``0 .. seq_len - 1`` are those of ``x = w[:-1]`` alone (causal
    attention: a position sees no later one; positions count from 0 either way). Passing
    ``input_ids = labels = x`` instead would cover only ``x[1:]``: ``seq_len - 1`` targets, the
    last target ``y[-1]`` never trained (the convention this issue removed).
    """
    base = type(model).__mro__[1]  # the transformers class under the logits-only subclass
    out = base.forward(
        model,
        input_ids=windows,
        attention_mask=torch.ones_like(windows),
        labels=windows,
        use_cache=False,
    )
    return out.loss  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_loss_on_a_window_equals_hf_loss_over_all_its_targets(tmp_path: Path, family: str) -> None:
    wl = hf_causal_lm(_hf_dir(tmp_path, family), seq=SEQ)
    data = fit_data(wl, TokenFile(_token_file(tmp_path / "t.bin", 8 * SEQ + 1), SEQ))
    assert data is not None
    model, chain = original_model(wl, 3), wl.build_model(3)
    items = [5, 0, 2]
    rows = [data[i] for i in items]
    x = torch.stack([r[0][0] for r in rows])
    y = torch.stack([r[1] for r in rows])
    mask = torch.stack([r[0][1] for r in rows])
    file = np.fromfile(tmp_path / "t.bin", dtype=np.uint16).astype(np.int64)
    w = torch.from_numpy(np.stack([file[i * SEQ : i * SEQ + SEQ + 1] for i in items]))
    assert torch.equal(x, w[:, :-1]) and torch.equal(y, w[:, 1:]) and bool(mask.eq(1).all())

    loss = wl.loss_fn(chain((x, mask)), y)
    ref = _hf_window_loss(model, w)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    shifted = _hf_window_loss(model, x)  # labels = x: only SEQ - 1 targets
    assert abs(shifted.item() - ref.item()) > 1e-4  # the comparison tells the two apart

    loss.backward()
    ref.backward()
    grads: dict[str, torch.Tensor] = {}
    for piece in chain:  # a tied weight appears in two pieces: its gradient is the sum
        for name, p in piece.named_parameters():
            assert p.grad is not None, name
            grads[name] = grads.get(name, 0) + p.grad  # type: ignore[assignment]
    for name, p in model.named_parameters():
        tied = [n for n in grads if model.get_parameter(n) is p]
        got = sum(grads[n] for n in tied) if len(tied) > 1 else grads[tied[0]]
        torch.testing.assert_close(got, p.grad, msg=lambda m, n=name: f"{n}: {m}")


def test_causal_lm_loss_uses_every_target_and_skips_ignored_ones() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen)
    y = torch.randint(0, 7, (2, 5), generator=gen)
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none")
    torch.testing.assert_close(causal_lm_loss(logits, y), per_token.mean())  # no shift
    padded = y.clone()
    padded[1, 3:] = IGNORE_INDEX  # sample 1 has 3 targets
    want = (per_token[0].mean() + per_token[1, :3].mean()) / 2  # each sample's mean, then mean
    torch.testing.assert_close(causal_lm_loss(logits, padded), want)
    assert target_tokens(padded) == 8


def _check_next_token_batch(wl: Workload, batch: int, seed: int, length: int) -> None:
    (x, mask), y = wl.make_batch(batch, seed)
    assert x.shape == y.shape == mask.shape == (batch, length)
    assert torch.equal(y[:, :-1], x[:, 1:]) and bool(mask.eq(1).all())
    assert not torch.equal(y, x)
    assert target_tokens(y) == batch * length


def test_synthetic_hf_batches_are_next_token_windows(tmp_path: Path) -> None:
    _check_next_token_batch(hf_gpt2(layers=1, hidden=16, heads=2, vocab=VOCAB, seq=SEQ), 3, 1, SEQ)
    varying = hf_gpt2(layers=1, hidden=16, heads=2, vocab=VOCAB, seq=SEQ, seq_choices=[6, SEQ])
    for seed, length in [(0, 6), (1, SEQ), (2, 6)]:
        _check_next_token_batch(varying, 2, seed, length)
    _check_next_token_batch(hf_causal_lm(_hf_dir(tmp_path, "llama"), seq=SEQ), 2, 5, SEQ)


def test_documents_still_refused_for_hf_causal_lms(tmp_path: Path) -> None:
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"ids": {list(range(1, 3 + k))}}}\n' for k in range(6)))
    wl = hf_causal_lm(_hf_dir(tmp_path, "llama"), seq=SEQ)
    with pytest.raises(ValidationError, match=r"\(input_ids, attention_mask\)"):
        fit_workload(wl, open_documents(docs, SEQ, "pack"))


@pytest.mark.slow
def test_step_tokens_count_the_trained_targets(tmp_path: Path) -> None:
    """Two stages on a token file: every step reports ``G x SEQ`` tokens (rank 0 holds stage 0,
    which reads no targets), and step 0's loss is Hugging Face's over those ``G x SEQ`` targets."""
    from dapple import api

    d = _hf_dir(tmp_path, "llama")
    path = _token_file(tmp_path / "t.bin", 20 * SEQ + 1, seed=1)
    plan = straight_plan(4, [0, 2], global_batch_size=G, num_micro_batches=2)
    metrics = api.train(plan, f"hf:{d}", 2, data=path, seq_len=SEQ, device="cpu", timeout_s=120)
    assert [m.tokens for m in metrics] == [G * SEQ] * 2
    for m in metrics:
        assert m.tokens_per_s == pytest.approx(G * SEQ / (m.step_ms / 1e3))

    wl = hf_causal_lm(d, seq=SEQ)
    ds = TokenFile(path, SEQ)
    file = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    items = EpochSampler(len(ds), G, 0).indices(0)
    w = torch.from_numpy(np.stack([file[i * SEQ : i * SEQ + SEQ + 1] for i in items]))
    assert int((w[:, 1:] != IGNORE_INDEX).sum()) == G * SEQ
    with torch.no_grad():
        ref = _hf_window_loss(original_model(wl, 0), w)
    assert metrics[0].loss == pytest.approx(float(ref), rel=1e-5)

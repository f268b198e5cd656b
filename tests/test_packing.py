"""Documents of a token file: ``prepare --documents`` offsets, next-fit packing (golden rows,
no target crossing a document, the packed loss and gradients equal to the token-weighted mean
of its documents' for a model that does not mix positions), padded batches read per rank, the
runtime's checks, and (one gloo run each) ``verify --pad`` with lengths changing every step and
``train --pad`` evaluating on batches of another length."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dapple.cli import main
from dapple.core.plan import straight_plan
from dapple.datasets import (
    IGNORE_INDEX,
    DocumentFile,
    EpochSampler,
    PackedDocuments,
    PaddedDocuments,
    docs_path,
    masked_token_loss,
    open_documents,
    pack_rows,
    prepare,
)
from dapple.errors import ValidationError
from dapple.models.shapes import DynamicDim
from dapple.models.zoo.transformer import transformer
from dapple.runtime.data import check_data, fit_workload
from dapple.runtime.reporting import target_tokens

VOCAB = 32


def _write_docs(tmp_path: Path, lengths: list[int], seed: int = 0) -> Path:
    """A JSONL documents file of ids in [1, VOCAB)."""
    g = torch.Generator().manual_seed(seed)
    path = tmp_path / "docs.jsonl"
    rows = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    path.write_text("\n".join(json.dumps({"ids": r}) for r in rows))
    return path


def test_pack_rows_next_fit_golden() -> None:
    # pairs: 2, 4, 1, 8 (cut into 4 + 4), 0 (one token), 3; budget 4 pairs per sample
    assert pack_rows([3, 5, 2, 9, 1, 4], 4) == [
        [(0, 0, 3)],
        [(1, 0, 5)],
        [(2, 0, 2)],
        [(3, 0, 5)],
        [(3, 4, 9)],
        [(5, 0, 4)],
    ]
    assert pack_rows([3, 3, 2, 3], 4) == [[(0, 0, 3), (1, 0, 3)], [(2, 0, 2), (3, 0, 3)]]
    with pytest.raises(ValidationError, match="seq_len must be >= 1"):
        pack_rows([3], 0)


def test_packed_samples_keep_every_target_inside_its_document(tmp_path: Path) -> None:
    lengths = [3, 7, 2, 12, 5, 4, 9]
    docs = DocumentFile(_write_docs(tmp_path, lengths))
    packed = PackedDocuments(docs, 6)
    pairs = []  # every (input, target) pair of every document, in order
    for d in range(len(lengths)):
        t = docs.doc(d)
        pairs += list(zip(t[:-1].tolist(), t[1:].tolist(), strict=True))
    got = []
    for i in range(len(packed)):
        x, y = packed[i]
        assert x.shape == y.shape == (6,)
        real = y != IGNORE_INDEX
        assert real.sum() == packed.pairs_of(i) and bool(real[: int(real.sum())].all())
        got += list(zip(x[real].tolist(), y[real].tolist(), strict=True))
    assert got == pairs  # each pair once, none made across a boundary


class _TokenWise(nn.Module):
    """Embedding then a linear head: each position's logits depend on its own token only."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x)))


def test_packed_loss_is_the_token_weighted_mean_of_its_documents_losses(tmp_path: Path) -> None:
    docs = DocumentFile(_write_docs(tmp_path, [4, 6, 3, 5]))
    packed = PackedDocuments(docs, 12)
    assert [len(r) for r in packed.rows] == [3, 1]  # 3 + 5 + 2 pairs, then 4
    torch.manual_seed(0)
    model = _TokenWise()
    x, y = packed[0]
    loss = masked_token_loss(model(x[None]), y[None])
    loss.backward()
    g_packed = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad()
    pieces = packed.rows[0]
    total = sum(end - start - 1 for _, start, end in pieces)
    expected = torch.zeros(())
    for d, start, end in pieces:  # each document alone, weighted by its targets
        t = docs.doc(d, start, end)
        one = masked_token_loss(model(t[None, :-1]), t[None, 1:]) * (t.numel() - 1) / total
        one.backward()
        expected = expected + one.detach()
    torch.testing.assert_close(loss.detach(), expected)
    for g, p in zip(g_packed, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)


def test_padded_batches_pad_to_the_batch_longest_and_count_unread_rows(tmp_path: Path) -> None:
    docs = DocumentFile(_write_docs(tmp_path, [3, 9, 2, 5, 20]))
    padded = PaddedDocuments(docs, 12)
    assert padded.pairs.tolist() == [2, 8, 1, 4, 12]  # the last cut to seq_len + 1 tokens
    x, y = padded.read_rows([0, 3], input_rows=[0, 1], target_rows=[0])
    assert x.shape == y.shape == (2, 4)
    assert y[1].tolist() == [0, 0, 0, 0]  # unread target row: real pairs as 0, no padding
    assert y[0].tolist()[2:] == [IGNORE_INDEX] * 2
    assert target_tokens(y) == 6
    full = padded.read_rows([1, 4], [0, 1], [0, 1])
    assert full[0].shape == (2, 12) and int((full[1] != IGNORE_INDEX).sum()) == 20
    clone = pickle.loads(pickle.dumps(padded))
    torch.testing.assert_close(clone.read_rows([1, 4], [0, 1], [0, 1]), full)


def test_prepare_documents_writes_offsets_and_splits_whole_documents(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    texts = ["hello there", "ab", "a third document", "four", "and five"]
    src.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    out = prepare([src], tmp_path / "data" / "train.bin", val_fraction=0.4, documents=True)
    offsets = np.load(docs_path(out.train)).tolist()
    assert offsets == [0, 11, 13, 29]  # three documents train, two validate
    assert np.load(docs_path(out.val)).tolist() == [0, 4, 12]
    train = DocumentFile(out.train)
    assert bytes(train.doc(2).tolist()).decode() == "a third document"
    meta = json.loads(out.meta.read_text())
    assert meta["train"]["documents"] == 3 and meta["val"]["documents"] == 2
    prepare([src], tmp_path / "plain" / "train.bin")  # no offsets without --documents
    with pytest.raises(ValidationError, match=r"no document offsets \(train.docs.npy beside it\)"):
        open_documents(tmp_path / "plain" / "train.bin", 8, "pack")
    src.write_text('{"txt": "x"}\n')
    with pytest.raises(ValidationError, match=r'docs.jsonl:1: expected \{"text": "..."\}'):
        prepare([src], tmp_path / "bad" / "train.bin", documents=True)


def test_documents_bring_their_loss_and_length_and_are_checked_before_compute(
    tmp_path: Path,
) -> None:
    path = _write_docs(tmp_path, [3, 9, 6, 5, 12, 4])
    wl = transformer(layers=1, hidden=8, heads=2, seq=12, vocab=VOCAB)
    padded = open_documents(path, 12, "pad")
    fitted = fit_workload(wl, padded)
    assert fitted.loss_fn is masked_token_loss
    assert fitted.dynamic_dims[0][1].max == 12  # type: ignore[union-attr]
    packed = fit_workload(wl, open_documents(path, 12, "pack"))
    assert packed.dynamic_dims == {} and packed.loss_fn is masked_token_loss
    check_data(wl, padded, 4)
    small = transformer(layers=1, hidden=8, heads=2, seq=12, vocab=16)
    with pytest.raises(ValidationError, match=r"holds token id \d+ >= the vocabulary"):
        check_data(small, padded, 4)
    with pytest.raises(ValidationError, match="6 samples are fewer than one global batch of 8"):
        check_data(wl, padded, 8)
    static = transformer(layers=1, hidden=8, heads=2, seq=12, vocab=VOCAB)
    static = type(static)(**{**static.__dict__, "dynamic_dims": {0: {1: None}}})
    with pytest.raises(ValidationError, match=r"takes it static; declare it dynamic"):
        fit_workload(static, padded)
    short = type(static)(**{**static.__dict__, "dynamic_dims": {0: {1: DynamicDim("seq", 1, 8)}}})
    with pytest.raises(ValidationError, match=r"reach 12 along input 0 dimension 1, .* at most 8"):
        fit_workload(short, padded)


def test_cli_pack_or_pad_need_a_documents_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = straight_plan(3, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[1, 1])
    plan.save(tmp_path / "plan.json")
    prepare([_write_docs(tmp_path, [40])], tmp_path / "plain.bin")
    run = ["verify", "--plan", str(tmp_path / "plan.json"), "-m", "transformer", "--set",
           "layers=1", "--seq-len", "8", "--device", "cpu"]  # fmt: skip
    for extra, message in [
        (["--pad"], "--pad applies to --data; give a documents file"),
        (["--pack", "--data", str(tmp_path / "plain.bin")], "plain.bin has no document offsets"),
    ]:
        assert main([*run, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def _lm_docs(tmp_path: Path, n: int = 40) -> Path:
    """Byte documents of 4..30 tokens, prepared with offsets."""
    rng = np.random.default_rng(0)
    src = tmp_path / "docs.jsonl"
    words = ["ab", "cde", "f", "ghij", "kl"]
    rows = [" ".join(rng.choice(words, int(rng.integers(2, 8)))) for _ in range(n)]
    src.write_text("\n".join(json.dumps({"text": t}) for t in rows) + "\n")
    return prepare([src], tmp_path / "data" / "train.bin", 0.25, documents=True).train


def test_verify_pad_with_lengths_changing_every_step_under_2_1(tmp_path: Path) -> None:
    train = _lm_docs(tmp_path)
    padded = open_documents(train, 32, "pad")
    sampler = EpochSampler(len(padded), 6, 0)
    widths = {padded.width(sampler.indices(t)) for t in range(3)}
    assert len(widths) > 1, widths  # the length changes between steps
    plan = straight_plan(4, [0, 2], global_batch_size=6, num_micro_batches=2, replicas=[2, 1])
    plan.save(tmp_path / "plan.json")
    argv = ["verify", "--plan", str(tmp_path / "plan.json"), "-m", "transformer",
            "--set", "layers=2", "--set", "hidden=16", "--set", "heads=2",
            "--data", str(train), "--seq-len", "32", "--pad", "--steps", "3", "--device", "cpu"]  # fmt: skip
    assert main(argv) == 0


@pytest.mark.slow
def test_train_pad_evaluates_on_batches_of_another_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train = _lm_docs(tmp_path)
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2, replicas=[1, 1])
    plan.save(tmp_path / "plan.json")
    metrics = tmp_path / "m.jsonl"
    argv = ["train", "--plan", str(tmp_path / "plan.json"), "-m", "transformer",
            "--set", "layers=2", "--set", "hidden=16", "--set", "heads=2",
            "--data", str(train), "--eval-data", str(train.with_name("val.bin")),
            "--seq-len", "32", "--pad", "--steps", "2", "--eval-every", "1",
            "--eval-batches", "2", "--device", "cpu", "--metrics", str(metrics)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(r.get("eval_loss") is not None for r in rows)
    padded = open_documents(train, 32, "pad")
    sampler = EpochSampler(len(padded), 4, 0)
    assert [r["tokens"] for r in rows] == [
        int(padded.pairs[sampler.indices(t)].sum()) for t in range(2)
    ]

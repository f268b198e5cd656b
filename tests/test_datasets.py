"""Data sources: token files, ``prepare``, the epoch sampler, batch sources and row reads."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple.core.plan import Plan, StagePlan
from dapple.datasets import (
    META_NAME,
    BatchSource,
    EpochSampler,
    EvalBatches,
    TokenFile,
    prepare,
    read_rows,
    val_path,
)
from dapple.errors import ValidationError
from dapple.runtime.data import rank_rows


def write_tokens(path: Path, ids, dtype: str = "uint16") -> Path:
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


# -- TokenFile ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n_tokens, seq_len", [(11, 5), (10, 3), (4, 3), (100, 1)])
def test_token_file_windows_and_length(tmp_path: Path, n_tokens: int, seq_len: int) -> None:
    ids = np.arange(n_tokens) * 7 % 1000
    ds = TokenFile(write_tokens(tmp_path / "t.bin", ids), seq_len)
    assert len(ds) == (n_tokens - 1) // seq_len
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64
        window = ids[i * seq_len : i * seq_len + seq_len + 1]
        assert x.tolist() == list(window[:-1])
        assert y.tolist() == list(window[1:])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_token_file_dtype_from_meta_and_default(tmp_path: Path) -> None:
    ids = [70000, 1, 2, 65536, 5]
    write_tokens(tmp_path / "train.bin", ids, "uint32")
    (tmp_path / META_NAME).write_text(json.dumps({"dtype": "uint32", "vocab_size": 70001}))
    ds = TokenFile(tmp_path / "train.bin", 2)
    assert ds.dtype == "uint32" and ds.vocab_size == 70001
    assert ds[0][0].tolist() == [70000, 1] and ds.max_token() == 70000
    (tmp_path / META_NAME).unlink()  # no meta: uint16, twice the tokens
    assert TokenFile(tmp_path / "train.bin", 2).n_tokens == 10


def test_token_file_max_token_reads_in_chunks(tmp_path: Path, monkeypatch) -> None:
    import dapple.datasets.token_file as tf

    monkeypatch.setattr(tf, "_CHUNK_TOKENS", 3)
    ids = [1, 2, 3, 4, 900, 5, 6]
    assert TokenFile(write_tokens(tmp_path / "t.bin", ids), 2).max_token() == 900


def test_token_file_pickles_without_its_memmap(tmp_path: Path) -> None:
    ds = TokenFile(write_tokens(tmp_path / "t.bin", range(50)), 4)
    ds[0]
    again = pickle.loads(pickle.dumps(ds))
    assert again._mm is None and torch.equal(again[3][1], ds[3][1])


@pytest.mark.parametrize(
    "content, seq_len, needle",
    [
        (None, 4, "does not exist"),
        (b"", 4, "is empty"),
        (b"\x01\x00\x02", 1, "not a whole number"),
        (np.arange(4, dtype=np.uint16).tobytes(), 4, "fewer than one sample"),
        (np.arange(8, dtype=np.uint16).tobytes(), 0, "seq_len must be >= 1"),
    ],
)
def test_token_file_rejects_bad_files(tmp_path: Path, content, seq_len: int, needle: str) -> None:
    path = tmp_path / "t.bin"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValidationError, match=needle):
        TokenFile(path, seq_len)


# -- prepare -----------------------------------------------------------------------------------
def test_prepare_bytes_round_trip_and_val_split(tmp_path: Path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("héllo wörld\n")
    b.write_bytes(bytes(range(256)) * 2)
    out = prepare([a, b], tmp_path / "data" / "train.bin", val_fraction=0.1)
    raw = a.read_bytes() + b.read_bytes()
    n_val = int(len(raw) * 0.1)
    assert out.val == tmp_path / "data" / "val.bin"
    train = np.fromfile(out.train, dtype=np.uint16)
    val = np.fromfile(out.val, dtype=np.uint16)
    assert bytes(train.astype(np.uint8)) + bytes(val.astype(np.uint8)) == raw
    assert len(val) == n_val == out.val_tokens and len(train) == out.train_tokens
    meta = json.loads(out.meta.read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["train"] == {"file": "train.bin", "tokens": len(raw) - n_val}
    assert meta["sources"] == [str(a.resolve()), str(b.resolve())]
    ds = TokenFile(out.train, 8)  # the meta beside it is read
    assert ds.vocab_size == 256 and ds[0][0].tolist() == list(raw[:8])


def test_prepare_val_name_and_zero_fraction(tmp_path: Path) -> None:
    assert val_path(tmp_path / "shakespeare.bin") == tmp_path / "shakespeare.val.bin"
    (tmp_path / "a.txt").write_text("abcdef")
    out = prepare([tmp_path / "a.txt"], tmp_path / "x.bin", val_fraction=0.0)
    assert out.val_tokens == 0 and out.val.stat().st_size == 0 and out.train_tokens == 6


@pytest.mark.parametrize(
    "files, kw, needle",
    [
        ([], {}, "at least one text file"),
        (["missing.txt"], {}, "does not exist"),
        (["a.txt"], {"val_fraction": 1.0}, "val_fraction"),
        (["a.txt"], {"tokenizer": "no-such-dir"}, "tokenizer directory"),
        (["one.txt"], {}, "need at least 2"),
    ],
)
def test_prepare_rejects_bad_input_and_writes_nothing(
    tmp_path: Path, files: list[str], kw: dict, needle: str
) -> None:
    (tmp_path / "a.txt").write_text("some text")
    (tmp_path / "one.txt").write_text("x")
    out = tmp_path / "out" / "train.bin"
    with pytest.raises(ValidationError, match=needle):
        prepare([tmp_path / f for f in files], out, **kw)
    assert not (tmp_path / "out").exists()


def _tiny_tokenizer(where: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3, "data": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>"
    )
    fast.save_pretrained(str(where))
    return where


def test_prepare_with_a_local_hf_tokenizer(tmp_path: Path) -> None:
    tok = _tiny_tokenizer(tmp_path / "tok")
    (tmp_path / "a.txt").write_text("hello world data")
    (tmp_path / "b.txt").write_text("world zebra")
    out = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "train.bin", 0.0, tok)
    assert np.fromfile(out.train, dtype=np.uint16).tolist() == [2, 3, 4, 1, 3, 0]
    meta = json.loads(out.meta.read_text())
    assert meta["vocab_size"] == 5 and meta["tokenizer"] == str(tok.resolve())


# -- sampler -----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    g=st.integers(1, 60),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
)
def test_sampler_epoch_is_a_permutation_with_the_remainder_dropped(
    n: int, g: int, seed: int, epoch: int
) -> None:
    if n < g:
        with pytest.raises(ValidationError, match="fewer than one global batch"):
            EpochSampler(n, g, seed)
        return
    s = EpochSampler(n, g, seed)
    E = n // g
    assert s.steps_per_epoch == E
    batches = [s.indices(epoch * E + k) for k in range(E)]
    assert all(len(b) == g for b in batches)
    seen = [i for b in batches for i in b]
    assert len(set(seen)) == len(seen) == E * g  # distinct within an epoch
    assert set(seen) | set(s.permutation(epoch)[E * g :].tolist()) == set(range(n))
    assert s.position(epoch * E + E - 1) == (epoch, E - 1)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 80), g=st.integers(1, 8), seed=st.integers(0, 99), t=st.integers(0, 40))
def test_sampler_position_is_a_pure_function_of_the_step(n: int, g: int, seed: int, t: int) -> None:
    if n < g:
        return
    walked = EpochSampler(n, g, seed)
    for u in range(t):  # an uninterrupted run passes every earlier step first
        walked.indices(u)
    assert walked.indices(t) == EpochSampler(n, g, seed).indices(t)


def test_sampler_epochs_and_seeds_differ() -> None:
    s = EpochSampler(1000, 10, seed=3)
    assert s.permutation(0).tolist() != s.permutation(1).tolist()
    assert s.indices(0) != EpochSampler(1000, 10, seed=4).indices(0)
    assert s.indices(0) == EpochSampler(1000, 10, seed=3).indices(0)


# -- rows and batch sources --------------------------------------------------------------------
def _plan(stages, b: int = 4, m: int = 2) -> Plan:
    return Plan(
        planner="test",
        global_batch_size=b * m,
        micro_batch_size=b,
        num_micro_batches=m,
        stages=tuple(StagePlan(layers=lay, devices=dev) for lay, dev in stages),
    )


def test_rank_rows_follow_the_split_concat_slices() -> None:
    p = _plan((((0, 2), (0, 1, 2)), ((2, 4), (3,))))  # 3:1, b = 4: slices [0,2) [2,3) [3,4)
    assert rank_rows(p, 0) == ([0, 1, 4, 5], [])
    assert rank_rows(p, 1) == ([2, 6], [])
    assert rank_rows(p, 2) == ([3, 7], [])
    assert rank_rows(p, 3) == ([], list(range(8)))
    assert rank_rows(p, 9) == ([], [])
    straight = _plan((((0, 1), (0,)), ((1, 2), (1,)), ((2, 3), (2,))))
    assert rank_rows(straight, 1) == ([], [])
    dp = _plan((((0, 4), (0, 1)),))
    assert rank_rows(dp, 1) == ([2, 3, 6, 7], [2, 3, 6, 7])


def test_read_rows_reads_only_the_rows_asked_for(tmp_path: Path) -> None:
    ds = TokenFile(write_tokens(tmp_path / "t.bin", np.arange(1, 101)), 4)
    x, y = read_rows(ds, [5, 0, 3], input_rows=[1], target_rows=[0, 2])
    assert x.shape == y.shape == (3, 4)
    assert x[0].eq(0).all() and x[2].eq(0).all() and torch.equal(x[1], ds[0][0])
    assert torch.equal(y[0], ds[5][1]) and torch.equal(y[2], ds[3][1]) and y[1].eq(0).all()


def test_batch_source_prefetched_equals_direct_and_resumes(tmp_path: Path) -> None:
    ds = TokenFile(write_tokens(tmp_path / "t.bin", np.arange(500) % 97), 5)
    rows = list(range(4))
    src = BatchSource(ds, 4, 7, rows, rows, stop=30)
    direct = BatchSource(ds, 4, 7, rows, rows, prefetch=False)
    try:
        got = [src.batch(t) for t in range(30)]  # crosses epochs (99 items: 24 steps each)
        for t in (0, 23, 24, 29, 5):  # out of order too: a resume
            x, y = direct.batch(t)
            assert torch.equal(x, got[t][0]) and torch.equal(y, got[t][1])
        items = EpochSampler(len(ds), 4, 7).indices(24)
        assert torch.equal(got[24][0][2], ds[items[2]][0])
    finally:
        src.close()
        direct.close()


def test_eval_batches_are_the_first_items_in_order(tmp_path: Path) -> None:
    ds = TokenFile(write_tokens(tmp_path / "v.bin", np.arange(60)), 3)  # 19 items
    ev = EvalBatches(ds, 4, range(4), range(4))
    assert ev.num_batches == 4
    x, y = ev.batch(2)
    assert x[:, 0].tolist() == [24, 27, 30, 33] and torch.equal(ev.batch(2)[1], y)
    with pytest.raises(ValidationError, match="out of range"):
        ev.batch(4)
    with pytest.raises(ValidationError, match="fewer than one global batch"):
        EvalBatches(ds, 20, [], [])


class _Recording(torch.utils.data.Dataset):
    """Items ``(i, i)`` as one-element tensors; records which thread read which item."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import threading

        self.reads.append((i, threading.current_thread().name))
        t = torch.tensor([i])
        return t, t


def test_batch_source_reads_the_next_step_in_the_background_until_stop() -> None:
    ds = _Recording(12)
    src = BatchSource(ds, 4, 0, range(4), [], stop=2)
    try:
        first = src.batch(0)
        src._next[1].result()  # the prefetch of step 1 ran ...
        background = {i for i, name in ds.reads if name.startswith("dapple-data")}
        assert background == set(EpochSampler(12, 4, 0).indices(1))  # ... on the data thread
        n = len(ds.reads)
        second = src.batch(1)
        assert len(ds.reads) == n and src._next is None  # served from the prefetch; 2 = stop
        assert first[0][:, 0].tolist() == EpochSampler(12, 4, 0).indices(0)
        assert second[0][:, 0].tolist() == EpochSampler(12, 4, 0).indices(1)
        assert second[1].eq(0).all()  # no target rows asked for
    finally:
        src.close()


def test_rank_data_eval_batches_and_training_batches(tmp_path: Path) -> None:
    from dapple.runtime.data import RankData

    ds = TokenFile(write_tokens(tmp_path / "t.bin", np.arange(1, 200)), 4)
    p = _plan((((0, 2), (0, 1, 2)), ((2, 4), (3,))))  # 3:1
    first = RankData(p, 1, 5, ds, ds)  # stage 0 replica 1: rows 2 and 6
    last = RankData(p, 3, 5, None, ds)
    try:
        assert first.eval_batches == last.eval_batches == len(ds) // 8
        x, y = first.eval_batch(1)
        assert [r for r in range(8) if x[r].any()] == [2, 6] and not y.any()
        assert torch.equal(x[6], ds[8 + 6][0])
        x, y = last.eval_batch(1)
        assert not x.any() and torch.equal(y, torch.stack([ds[8 + r][1] for r in range(8)]))
        items = EpochSampler(len(ds), 8, 5).indices(3)
        x, _ = first.batch(3)
        assert torch.equal(x[2], ds[items[2]][0])
        assert last.source is None
    finally:
        first.close()
        last.close()
    with pytest.raises(ValidationError, match="no evaluation data"):
        RankData(p, 0, 5, ds, None).eval_batch(0)


def test_check_data_resume_wants_the_same_stream(tmp_path: Path) -> None:
    from dapple.runtime.checkpoint.files import CheckpointError
    from dapple.runtime.data import check_data_resume, data_state

    ds = TokenFile(write_tokens(tmp_path / "t.bin", range(100)), 4)  # 24 samples
    saved = data_state(ds, 1, 8)
    assert saved is not None and saved["items"] == 24 and saved["seq_len"] == 4
    check_data_resume(saved, data_state(ds, 1, 8), "ck")
    check_data_resume(None, data_state(None, 1, 8), "ck")  # synthetic both times
    cases = [
        (data_state(ds, 1, 4), "global_batch_size 8 (now 4)"),
        (
            data_state(TokenFile(tmp_path / "t.bin", 3), 1, 8),
            "items 24 (now 33), seq_len 4 (now 3)",
        ),
        (None, "resume it with the same --data"),
    ]
    for now, needle in cases:
        with pytest.raises(CheckpointError, match=re.escape(needle)):
            check_data_resume(saved, now, "ck")
    with pytest.raises(CheckpointError, match="saved training on synthetic batches"):
        check_data_resume(None, saved, "ck")

"""Small steps split out of long functions, each on its own: ``prepare``'s tokenising and
split, ``profile_workload``'s option checks and length passes, the co-workers' loss cast and
``verify``'s tolerances."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dapple.datasets.prepare import _check_outputs, _meta_info, _split, _split_files, _tokenize
from dapple.errors import ValidationError
from dapple.profiler.co_workers import _as_float
from dapple.profiler.length_passes import length_passes
from dapple.profiler.measure import _check_options
from dapple.runtime.precision import tolerances_for
from dapple.runtime.verify.report import ATOL, GRAD_RTOL, RTOL
from dapple.runtime.verify.run import _tolerances


def _docs(tmp_path: Path, *texts: str) -> tuple[list[Path], list[bytes]]:
    paths = []
    for i, t in enumerate(texts):
        p = tmp_path / f"d{i}.txt"
        p.write_text(t)
        paths.append(p)
    return paths, [p.read_bytes() for p in paths]


def test_tokens_of_plain_text_and_of_documents(tmp_path: Path) -> None:
    sources, raws = _docs(tmp_path, "ab", "cde")
    plain = _tokenize(sources, raws, None, documents=False)
    assert plain.ids.tolist() == list(b"abcde") and plain.offsets is None
    assert (plain.vocab, plain.kind, plain.ids.dtype) == (256, "bytes", np.uint16)
    docs = _tokenize(sources, raws, None, documents=True)
    assert docs.ids.tolist() == list(b"abcde") and docs.offsets is not None
    assert docs.offsets.tolist() == [0, 2, 5]
    with pytest.raises(ValidationError, match="hold no document"):
        _tokenize([], [], None, documents=True)


def test_split_takes_the_last_tokens_or_the_last_whole_documents(tmp_path: Path) -> None:
    sources, raws = _docs(tmp_path, "abcd", "efg", "hi")
    plain = _split(_tokenize(sources, raws, None, False), 0.25)  # 9 tokens: floor(2.25) = 2
    assert (plain.n_train, plain.n_val) == (7, 2)
    docs = _split(_tokenize(sources, raws, None, True), 0.4)  # 3 documents: floor(1.2) = 1
    assert (docs.n_train, docs.n_val, docs.split_doc, docs.n_docs) == (7, 2, 2, 3)
    one, raw1 = _docs(tmp_path / "..", "a")
    with pytest.raises(ValidationError, match="1 tokens: 1 for training, need at least 2"):
        _split(_tokenize(one, raw1, None, False), 0.0)


def test_split_files_and_meta_record_both_splits(tmp_path: Path) -> None:
    sources, raws = _docs(tmp_path, "abcd", "efg", "hi")
    tokens = _tokenize(sources, raws, None, True)
    split = _split(tokens, 0.4)
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    files = dict(_split_files(tokens, split, train, val))
    assert np.frombuffer(files[train], dtype="<u2").tolist() == list(b"abcdefg")
    assert np.frombuffer(files[val], dtype="<u2").tolist() == list(b"hi")
    assert len(files) == 4  # and each split's document offsets
    info = _meta_info(tokens, split, train, val, 0.4, sources)
    assert info["train"] == {"file": "train.bin", "tokens": 7, "documents": 2}
    assert info["val"] == {"file": "val.bin", "tokens": 2, "fraction": 0.4, "documents": 1}
    assert (info["vocab_size"], info["dtype"], info["tokenizer"]) == (256, "uint16", "bytes")


def test_outputs_are_checked_before_any_input_is_read(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="is the name of the meta file"):
        _check_outputs(tmp_path / "meta.json", tmp_path / "meta.val.bin", False, ())
    _check_outputs(tmp_path / "new" / "train.bin", tmp_path / "new" / "val.bin", True, ())
    assert not (tmp_path / "new" / "train.bin").exists()  # checked, nothing written
    (tmp_path / "file").write_text("")
    with pytest.raises(ValidationError):
        _check_outputs(tmp_path / "file" / "train.bin", tmp_path / "file" / "val.bin", False, ())


def test_profile_options_are_checked_in_order() -> None:
    ok = _check_options([4, 2, 4], 0, 1, "cpu", "fp32", None, 1, 1, None)
    assert ok == ([2, 4], torch.device("cpu"))
    with pytest.raises(ValidationError, match="batch sizes must be positive integers"):
        _check_options([0], 0, 1, "no-such-device", "fp32", 0, 0, 0, [8])
    with pytest.raises(ValidationError, match="need repeats >= 1"):
        _check_options([1], 0, 0, "no-such-device", "fp32", 0, 0, 0, [8])
    with pytest.raises(ValidationError, match="num_threads must be >= 1"):
        _check_options([1], 0, 1, "cpu", "fp32", 0, 0, 0, [8])
    with pytest.raises(ValidationError, match="co_workers must be an integer >= 1"):
        _check_options([1], 0, 1, "cpu", "fp32", None, 0, 0, [8])
    with pytest.raises(ValidationError, match="passes must be an integer >= 1"):
        _check_options([1], 0, 1, "cpu", "fp32", None, 1, 0, [8])
    with pytest.raises(ValidationError, match="passes > 1 take one length"):
        _check_options([1], 0, 1, "cpu", "fp32", None, 1, 2, [8])


def test_each_length_pass_reports_its_share_of_the_progress() -> None:
    calls: list[tuple[int, int, str]] = []
    passes = length_passes(lambda d, t, s: calls.append((d, t, s)), [8, 16])
    assert [L for L, _ in passes] == [8, 16]
    for _, step in passes:
        assert step is not None
        step(1, 3, "layer 0")
    assert calls == [(1, 6, "L=8 layer 0"), (4, 6, "L=16 layer 0")]
    assert length_passes(None, [8]) == [(8, None)]


def test_co_workers_take_the_loss_of_an_autocast_output_in_fp32() -> None:
    h = torch.ones(2, dtype=torch.bfloat16)
    ids = torch.ones(2, dtype=torch.int64)
    out = _as_float((h, [ids, h], "tag"))
    assert out[0].dtype == torch.float32 and out[1][0].dtype == torch.int64
    assert isinstance(out[1], list) and out[1][1].dtype == torch.float32 and out[2] == "tag"


def test_verify_tolerances_default_by_precision() -> None:
    assert _tolerances("fp32", None, None, None) == {
        "rtol": RTOL,
        "atol": ATOL,
        "grad_rtol": GRAD_RTOL,
    }
    assert _tolerances("bf16", None, None, None)["grad_rtol"] == tolerances_for("bf16")[0]
    assert _tolerances("bf16", 1.0, 2.0, 3.0) == {"rtol": 1.0, "atol": 2.0, "grad_rtol": 3.0}

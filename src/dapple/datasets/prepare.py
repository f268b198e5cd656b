"""Turn text files into token files: ``train.bin``, ``val.bin`` and ``meta.json``.

Design choices:
    - tokens are the UTF-8 bytes of the text (vocabulary 256) by default, or the ids of a
      local Hugging Face tokenizer directory (``AutoTokenizer.from_pretrained(dir)``, offline;
      no special tokens are added, the end-of-sequence id - if the tokenizer has one -
      separates files);
    - the files' tokens are concatenated in the order given; the LAST ``val_fraction`` of them
      is the validation split (``floor(n * val_fraction)`` tokens), the rest the training split;
    - ids are stored as ``uint16`` when the vocabulary fits (<= 65,536), else ``uint32``;
      ``meta.json`` in the output directory records vocabulary size, dtype, tokenizer, each
      split's file and token count, and the source files;
    - the validation file is ``val.bin`` beside ``train.bin`` when the output is named
      ``train.bin``, otherwise ``<stem>.val.bin``; every file is written to a temporary name
      and renamed, and nothing is written before the inputs have been read and checked;
    - with ``documents=True`` the inputs are documents: each line ``{"text": "..."}`` of a
      ``.jsonl`` file, or each whole other file, is one; no separator is added between them,
      and each split's document starts go to ``train.docs.npy`` / ``val.docs.npy`` beside it
      (:mod:`dapple.datasets.packing`); the validation split is the last
      ``floor(documents * val_fraction)`` documents.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dapple.datasets.documents import json_rows
from dapple.datasets.packing import docs_path
from dapple.datasets.token_file import META_NAME
from dapple.datasets.tokenizer_dir import check_tokenizer_dir, load_hf_tokenizer
from dapple.errors import ValidationError
from dapple.files.atomic_file import write_atomically
from dapple.files.output_path import check_output_file, refuse_overwrite

__all__ = ["Prepared", "prepare", "val_path"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """What :func:`prepare` wrote."""

    train: Path
    val: Path
    meta: Path
    vocab_size: int
    dtype: str
    train_tokens: int
    val_tokens: int


def val_path(output: str | Path) -> Path:
    """The validation file written beside training file ``output``."""
    out = Path(output)
    return (
        out.with_name("val.bin")
        if out.name == "train.bin"
        else out.with_name(f"{out.stem}.val.bin")
    )


def _byte_tokens(texts: Sequence[bytes]) -> tuple[np.ndarray, int, str]:
    ids = np.frombuffer(b"".join(texts), dtype=np.uint8).astype(np.uint16)
    return ids, 256, "bytes"


def _hf_tokens(texts: Sequence[bytes], tokenizer: str | Path) -> tuple[np.ndarray, int, str]:
    where = Path(tokenizer)
    tok = load_hf_tokenizer(where)
    eos = tok.eos_token_id
    ids: list[int] = []
    for i, raw in enumerate(texts):
        if i and eos is not None:
            ids.append(int(eos))
        ids.extend(int(t) for t in tok.encode(raw.decode("utf-8"), add_special_tokens=False))
    vocab = len(tok)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    return np.asarray(ids, dtype=dtype), vocab, str(where.resolve())


def _read_text(path: Path, text: bool) -> bytes:
    """The bytes of input file ``path``; with ``text`` checked to be UTF-8 text.

    Raises:
        ValidationError: a missing or unreadable file; with ``text`` a NUL byte (binary data)
            or bytes that are not UTF-8 (the message names the file and the byte offset).
    """
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ValidationError(f"text file {str(path)!r} {what}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValidationError(f"cannot read text file {str(path)!r}: {e.strerror or e}") from e
    if not text:
        return raw
    nul = raw.find(b"\0")
    if nul >= 0:
        raise ValidationError(
            f"text file {str(path)!r} holds a NUL byte at offset {nul}: binary data, not UTF-8 text"
        )
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValidationError(
            f"text file {str(path)!r} is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset "
            f"{e.start} ({e.reason})"
        ) from e
    return raw


def _document_texts(sources: Sequence[Path], raws: Sequence[bytes]) -> list[bytes]:
    """One UTF-8 text per document: each ``{"text": ...}`` line of a ``.jsonl`` file, each
    other file whole (``raws``: each file's bytes)."""
    texts: list[bytes] = []
    for p, raw in zip(sources, raws, strict=True):
        if p.suffix != ".jsonl":
            texts.append(raw)
            continue
        for n, row in json_rows(p):
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValidationError(f'{p}:{n}: expected {{"text": "..."}}')
            texts.append(row["text"].encode())
    return texts


def _tokenize_each(
    texts: Sequence[bytes], tokenizer: str | Path | None
) -> tuple[list[np.ndarray], int, str]:
    """Each text's ids (no separator), the vocabulary size and the tokenizer's name."""
    if tokenizer is None:
        return [_byte_tokens([t])[0] for t in texts], 256, "bytes"
    where = Path(tokenizer)
    out: list[np.ndarray] = []
    vocab, kind = 0, ""
    for t in texts:
        ids, vocab, kind = _hf_tokens([t], where)
        out.append(ids)
    return out, vocab, kind


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def prepare(
    text_files: Sequence[str | Path],
    output: str | Path,
    val_fraction: float = 0.01,
    tokenizer: str | Path | None = None,
    documents: bool = False,
    *,
    text: bool = False,
) -> Prepared:
    """Tokenize ``text_files`` into ``output`` (training split), its validation file and
    ``meta.json`` (see the module docstring).

    Args:
        text_files: UTF-8 text files, concatenated in this order.
        output: the training token file (its directory is created if missing).
        val_fraction: share of the tokens (the last ones) that go to the validation file,
            in ``[0, 1)``.
        tokenizer: a local Hugging Face tokenizer directory; ``None``: bytes (vocabulary 256).
        documents: the inputs are documents (``.jsonl`` lines or whole files): write their
            offsets beside each split, split whole documents.
        text: refuse an input that is not UTF-8 text (a NUL byte or an invalid sequence)
            before tokenizing anything; always so with a ``tokenizer`` and for ``.jsonl``
            documents. False: byte tokens take any bytes.

    Raises:
        ValidationError: no, missing or unreadable text files, a file that is not UTF-8 text
            (binary data; see ``text``), an output path that cannot be written (checked
            before any input is read), a bad ``val_fraction``, an unloadable tokenizer, or no
            training tokens.
    """
    _check_arguments(text_files, val_fraction, tokenizer)
    train, val = Path(output), val_path(output)
    sources = [Path(p) for p in text_files]
    _check_outputs(train, val, documents, sources)
    texts = [
        _read_text(p, text or tokenizer is not None or (documents and p.suffix == ".jsonl"))
        for p in sources
    ]
    tokens = _tokenize(sources, texts, tokenizer, documents)
    split = _split(tokens, val_fraction)
    meta = train.with_name(META_NAME)
    info = _meta_info(tokens, split, train, val, val_fraction, sources)
    _write_all(
        [
            *_split_files(tokens, split, train, val),
            (meta, (json.dumps(info, indent=2) + "\n").encode()),
        ]
    )
    dtype = str(tokens.ids.dtype)
    return Prepared(train, val, meta, tokens.vocab, dtype, split.n_train, split.n_val)


def _check_arguments(
    text_files: Sequence[str | Path], val_fraction: float, tokenizer: str | Path | None
) -> None:
    """Refuse no text file, a ``val_fraction`` outside ``[0, 1)`` or a missing tokenizer.

    Raises:
        ValidationError: naming the argument.
    """
    if not text_files:
        raise ValidationError("prepare needs at least one text file")
    if not 0 <= val_fraction < 1:
        raise ValidationError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if tokenizer is not None:
        check_tokenizer_dir(tokenizer)


def _check_outputs(train: Path, val: Path, documents: bool, sources: Sequence[Path]) -> None:
    """Check every file :func:`prepare` writes can be written (parents made) and would replace
    nothing but an earlier :func:`prepare`'s output, before any input is read.

    Raises:
        ValidationError: the output is named like the meta file, a path cannot be written, an
            output is one of the inputs, or an output exists that this command did not write.
    """
    if train.name == META_NAME:
        raise ValidationError(f"output {str(train)!r}: {META_NAME} is the name of the meta file")
    written = [
        (train, "output"),
        (val, "validation file"),
        (train.with_name(META_NAME), "meta file"),
    ]
    if documents:
        written += [
            (docs_path(train), "document offsets file"),
            (docs_path(val), "validation document offsets file"),
        ]
    for path, what in written:
        check_output_file(path, what, in_place=False)
    refuse_overwrite(written, [(src, "input text") for src in sources])
    _check_only_own_files_replaced(train, val, written)


def _check_only_own_files_replaced(
    train: Path, val: Path, written: Sequence[tuple[Path, str]]
) -> None:
    """Refuse to replace an existing output file unless the ``meta.json`` beside it is one
    :func:`prepare` wrote for these very files (a re-run replaces its own output).

    Raises:
        ValidationError: naming the file that would be lost.
    """
    existing = [(p, what) for p, what in written if p.exists()]
    if not existing:
        return
    meta = train.with_name(META_NAME)
    info: Any = None
    if meta.is_file():
        try:
            info = json.loads(meta.read_bytes())
        except (OSError, ValueError, RecursionError):
            info = None
    ours = (
        isinstance(info, dict)
        and isinstance(info.get("train"), dict)
        and isinstance(info.get("val"), dict)
        and "vocab_size" in info
        and info["train"].get("file") == train.name
        and info["val"].get("file") == val.name
    )
    if not ours:
        path, what = existing[0]
        found = (
            f"{str(meta)!r} exists and is not the meta file dapple data prepare wrote for "
            f"{train.name!r}"
            if meta.exists()
            else f"{what} {str(path)!r} exists and no {META_NAME} beside it says dapple data "
            "prepare wrote it"
        )
        raise ValidationError(
            f"{found}; refusing to overwrite it: remove it or choose another output directory"
        )


@dataclass(frozen=True)
class _Tokens:
    """The inputs' tokens, concatenated."""

    ids: np.ndarray
    vocab: int
    kind: str
    """The tokenizer's name (``bytes`` or its resolved directory)."""
    offsets: np.ndarray | None
    """Documents: where each starts in ``ids``, then ``len(ids)``; None: plain text."""


def _tokenize(
    sources: Sequence[Path], texts: Sequence[bytes], tokenizer: str | Path | None, documents: bool
) -> _Tokens:
    """The tokens of the input files (``texts``: their bytes), or of their documents.

    Raises:
        ValidationError: documents asked for and the inputs hold none, or a tokenizer that
            cannot be loaded.
    """
    if not documents:
        ids, vocab, kind = (
            _byte_tokens(texts) if tokenizer is None else _hf_tokens(texts, tokenizer)
        )
        return _Tokens(ids, vocab, kind, None)
    each, vocab, kind = _tokenize_each(_document_texts(sources, texts), tokenizer)
    if not each:
        raise ValidationError("the inputs hold no document")
    ids = np.concatenate(each).astype(np.uint16 if vocab <= 2**16 else np.uint32)
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in each])]).astype(np.int64)
    return _Tokens(ids, vocab, kind, offsets)


@dataclass(frozen=True)
class _Split:
    """Where the validation split starts."""

    n_train: int
    n_val: int
    split_doc: int = 0
    """Documents: the first validation document (= the training documents)."""
    n_docs: int = 0


def _split(tokens: _Tokens, val_fraction: float) -> _Split:
    """The last ``floor(n * val_fraction)`` tokens validate, or with documents the last
    ``floor(documents * val_fraction)`` whole documents.

    Raises:
        ValidationError: fewer than 2 training tokens.
    """
    n = len(tokens.ids)
    if tokens.offsets is not None:
        n_docs = len(tokens.offsets) - 1
        split_doc = n_docs - int(n_docs * val_fraction)
        n_train = int(tokens.offsets[split_doc])
        split = _Split(n_train, n - n_train, split_doc, n_docs)
    else:
        n_val = int(n * val_fraction)
        split = _Split(n - n_val, n_val)
    if split.n_train < 2:
        raise ValidationError(
            f"the text files give {n} tokens: {split.n_train} for training, need at least 2"
        )
    return split


def _meta_info(
    tokens: _Tokens,
    split: _Split,
    train: Path,
    val: Path,
    val_fraction: float,
    sources: Sequence[Path],
) -> dict[str, Any]:
    """What ``meta.json`` records (see the module docstring)."""
    info: dict[str, Any] = {
        "vocab_size": tokens.vocab,
        "dtype": str(tokens.ids.dtype),
        "tokenizer": tokens.kind,
        "train": {"file": train.name, "tokens": split.n_train},
        "val": {"file": val.name, "tokens": split.n_val, "fraction": val_fraction},
        "sources": [str(p.resolve()) for p in sources],
    }
    if tokens.offsets is not None:
        info["train"]["documents"] = split.split_doc
        info["val"]["documents"] = split.n_docs - split.split_doc
    return info


def _split_files(
    tokens: _Tokens, split: _Split, train: Path, val: Path
) -> list[tuple[Path, bytes]]:
    """The bytes of the two token files (little-endian) and, with documents, their offsets."""
    ids, n_train = tokens.ids, split.n_train
    little = ids.astype(ids.dtype.newbyteorder("<"))  # the file format is little-endian
    files = [(train, little[:n_train].tobytes()), (val, little[n_train:].tobytes())]
    if tokens.offsets is not None:
        offsets, split_doc = tokens.offsets, split.split_doc
        files += [
            (docs_path(train), _npy(offsets[: split_doc + 1])),
            (docs_path(val), _npy(offsets[split_doc:] - n_train)),
        ]
    return files


def _write_all(files: Sequence[tuple[Path, bytes]]) -> None:
    """Write each file atomically, in order.

    Raises:
        ValidationError: a file cannot be written.
    """
    for path, data in files:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, data)
        except OSError as e:
            raise ValidationError(f"cannot write {str(path)!r}: {e.strerror or e}") from e

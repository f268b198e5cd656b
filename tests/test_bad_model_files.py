"""Hostile model files (issue 47, item 8): ``--weights`` that is missing, binary, a directory
or not safetensors, ``--tokenizer`` paths that hold no tokenizer, and ``-m hf:DIR`` with a
missing directory, no ``config.json`` or a bad one. Each is refused before any work in exactly
one ``dapple: error:`` line, exit code 2, no traceback (an exception escaping ``main`` fails
the test)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from dapple.cli import main

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hf_dirs import save_llama

Make = Callable[[Path], Path]


def _file(content: bytes, name: str) -> Make:
    def make(d: Path) -> Path:
        (d / name).write_bytes(content)
        return d / name

    return make


def _dir(files: dict[str, bytes]) -> Make:
    def make(d: Path) -> Path:
        out = d / "thing"
        out.mkdir()
        for name, content in files.items():
            (out / name).write_bytes(content)
        return out

    return make


BINARY = bytes(range(256)) * 16
WEIGHTS: dict[str, tuple[Make, str]] = {
    "missing": (lambda d: d / "none.safetensors", "no such file or directory"),
    "empty file": (_file(b"", "w.safetensors"), "is an empty file"),
    "binary .safetensors": (_file(BINARY, "w.safetensors"), "cannot read weights file"),
    "binary .bin": (_file(BINARY, "w.bin"), "neither safetensors"),
    "text": (_file(b"not weights\n", "w.txt"), "neither safetensors"),
    "empty directory": (_dir({}), "is an empty directory"),
    "directory of other files": (_dir({"notes.txt": b"x"}), "no weights in"),
    "binary model.safetensors": (_dir({"model.safetensors": BINARY}), "cannot read weights file"),
}
TOKENIZERS: dict[str, tuple[Make, str]] = {
    "missing": (lambda d: d / "none", "does not exist"),
    "a file": (_file(BINARY, "tok"), "is a file, not a directory"),
    "empty directory": (_dir({}), "holds no tokenizer file"),
    "directory of other files": (_dir({"notes.txt": b"x"}), "holds no tokenizer file"),
    "binary tokenizer.json": (_dir({"tokenizer.json": BINARY}), "cannot load a tokenizer"),
    "junk tokenizer.json": (_dir({"tokenizer.json": b"{junk"}), "cannot load a tokenizer"),
}
HF_DIRS: dict[str, tuple[Make, str]] = {
    "missing": (lambda d: d / "none", "does not exist"),
    "a file": (_file(b"{}", "config.json"), "is a file, not a directory"),
    "no config.json": (_dir({"model.safetensors": b"x"}), "holds no config.json"),
    "binary config.json": (_dir({"config.json": BINARY}), "cannot read the Hugging Face config"),
    "junk config.json": (_dir({"config.json": b"{not json"}), "cannot read the Hugging Face"),
    "unknown model_type": (
        _dir({"config.json": b'{"model_type": "no_such_type"}'}),
        "cannot read the Hugging Face config",
    ),
}


def _refused(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (argv, rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dapple: error: "), err
    assert needle in lines[0] and "Traceback" not in err, err


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("hf") / "llama")


WEIGHT_COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "generate": lambda m, w: ["generate", "-m", f"hf:{m}", "--weights", str(w), "--prompt", "x"],
    "split": lambda m, w: ["split", "-m", f"hf:{m}", "--weights", str(w)],
}


@pytest.mark.parametrize("command", sorted(WEIGHT_COMMANDS))
@pytest.mark.parametrize("kind", sorted(WEIGHTS))
def test_bad_weights(
    kind: str,
    command: str,
    llama: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    make, needle = WEIGHTS[kind]
    _refused(WEIGHT_COMMANDS[command](llama, make(tmp_path)), needle, capsys)


TOKENIZER_COMMANDS: dict[str, Callable[[Path, Path], list[str]]] = {
    "generate": lambda d, t: ["generate", "-m", "transformer", "--set", "layers=1", "--set",
                              "hidden=16", "--set", "heads=2", "--checkpoint-dir", str(d),
                              "--prompt", "x", "--tokenizer", str(t)],
    "data prepare": lambda d, t: ["data", "prepare", str(d / "text.txt"), "-o",
                                  str(d / "out" / "t.bin"), "--tokenizer", str(t)],
}  # fmt: skip


@pytest.mark.parametrize("command", sorted(TOKENIZER_COMMANDS))
@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_bad_tokenizer(
    kind: str, command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "text.txt").write_text("some text\n")
    make, needle = TOKENIZERS[kind]
    _refused(TOKENIZER_COMMANDS[command](tmp_path, make(tmp_path)), needle, capsys)
    assert not (tmp_path / "out").exists()


HF_COMMANDS: dict[str, Callable[[Path], list[str]]] = {
    "split": lambda d: ["split", "-m", f"hf:{d}"],
    "generate": lambda d: ["generate", "-m", f"hf:{d}", "--weights", str(d), "--prompt", "x"],
    "profile": lambda d: ["profile", "-m", f"hf:{d}", "-o", str(d.parent / "p.json")],
}


@pytest.mark.parametrize("command", sorted(HF_COMMANDS))
@pytest.mark.parametrize("kind", sorted(HF_DIRS))
def test_bad_hf_dir(
    kind: str,
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from builders import boom

    monkeypatch.setattr("dapple.profiler.measure.profile_workload", boom)
    make, needle = HF_DIRS[kind]
    path = make(tmp_path)
    if command == "generate" and kind == "missing":
        needle = "no such file or directory"  # --weights, the same path, is checked first
    _refused(HF_COMMANDS[command](path), needle, capsys)

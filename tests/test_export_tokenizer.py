"""An export a user can publish: an ``hf:DIR`` model's tokenizer and generation config copied
beside the weights, every file and directory with the modes the umask gives."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dapple import api
from dapple.cli import main
from dapple.runtime.checkpoint import CheckpointMeta, save_checkpoint, stage_layer_states
from dapple.runtime.export import export_checkpoint
from hf_dirs import save_llama
from hf_tokenizers import save_tokenizer

tf = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

SEQ = 8
COPIED = [
    "additional_chat_templates/tool.jinja",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture
def umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _model_dir_and_checkpoint(root: Path) -> tuple[Path, str]:
    """A LLaMA directory with a tokenizer and generation config, and a checkpoint of it."""
    pre = save_tokenizer(save_llama(root / "pretrained", seed=7), chat_template=True)
    (pre / "tokenizer.json").chmod(0o600)  # the source's mode is not what the export gets
    (pre / "additional_chat_templates").mkdir()
    (pre / "additional_chat_templates" / "tool.jinja").write_text("{{ messages }}")
    wl = api.load(f"hf:{pre}", weights=pre, seq=SEQ)
    meta = CheckpointMeta(model_name=wl.name, num_layers=wl.num_layers, step=1)
    save_checkpoint(root / "ckpt", meta, stage_layer_states(wl.build_model(0), 0))
    return pre, f"hf:{pre}"


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_export_copies_the_tokenizer_with_modes_from_the_umask(
    tmp_path: Path, umask: None, mask: int
) -> None:
    pre, spec = _model_dir_and_checkpoint(tmp_path)
    wl = api.load(spec, weights=pre, seq=SEQ)
    os.umask(mask)
    out = tmp_path / "site" / "export"  # a missing parent is made too
    result = export_checkpoint(tmp_path / "ckpt", out, wl, max_shard_bytes=40_000)
    assert sorted(result.copied) == COPIED
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert names == sorted(result.files) and {"config.json", *COPIED} <= set(names)
    assert "model.safetensors.index.json" in names  # sharded
    for name in COPIED:
        assert (out / name).read_bytes() == (pre / name).read_bytes(), name
    for p in [out.parent, out, *out.rglob("*")]:
        want = 0o777 & ~mask if p.is_dir() else 0o666 & ~mask  # safetensors shards included
        assert _mode(p) == want, p
    mine = tf.AutoTokenizer.from_pretrained(out, local_files_only=True)
    theirs = tf.AutoTokenizer.from_pretrained(pre, local_files_only=True)
    assert len(mine) == len(theirs) == 36
    assert mine.encode("hello cat") == theirs.encode("hello cat")
    assert mine.chat_template == theirs.chat_template
    gen = tf.GenerationConfig.from_pretrained(out, local_files_only=True)
    assert gen.to_dict() == tf.GenerationConfig.from_pretrained(pre).to_dict()
    tf.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)


def test_cli_export_names_the_copied_files(
    tmp_path: Path, umask: None, capsys: pytest.CaptureFixture[str]
) -> None:
    pre, spec = _model_dir_and_checkpoint(tmp_path)
    out = tmp_path / "hf"
    argv = ["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out-dir", str(out)]
    assert main([*argv, "-m", spec, "--weights", str(pre), "--set", f"seq={SEQ}"]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("copied")]
    assert sorted(line.removeprefix("copied from the model's directory: ").split(", ")) == COPIED
    assert _mode(out) == 0o755 and _mode(out / "model.safetensors") == 0o644


def test_export_of_a_model_without_a_directory_copies_nothing(tmp_path: Path, umask: None) -> None:
    wl = api.load("dapple.models.hf:gpt2", layers=1, hidden=8, heads=2, vocab=16, seq=4)
    meta = CheckpointMeta(model_name=wl.name, num_layers=wl.num_layers, step=1)
    save_checkpoint(tmp_path / "ckpt", meta, stage_layer_states(wl.build_model(0), 0))
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "out", wl)
    assert result.copied == () and result.files == ("model.safetensors", "config.json")
    assert _mode(tmp_path / "out") == 0o755
    assert {_mode(p) for p in (tmp_path / "out").iterdir()} == {0o644}

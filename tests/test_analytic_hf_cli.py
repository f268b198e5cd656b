"""``dapple profile --analytic`` on a Hugging Face config: ``--set seq=`` and the datasheet's
own precision (two of issue 42's small bugs: ``--set seq=8192`` was refused as an argument for
zoo transformers only, and an H100 profile was counted in fp32 unless told otherwise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dapple.cli import main

_LLAMA = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "vocab_size": 1000, "max_position_embeddings": 2048,
}  # fmt: skip


def _run(tmp_path: Path, *flags: str) -> int:
    model = tmp_path / "llama"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(_LLAMA))
    out = tmp_path / "p.json"
    return main(["profile", "--analytic", "h100", "-m", f"hf:{model}", *flags, "-o", str(out)])


def _profile(tmp_path: Path, *flags: str) -> dict[str, object]:
    assert _run(tmp_path, *flags) == 0
    return json.loads((tmp_path / "p.json").read_text())  # type: ignore[no-any-return]


def test_set_seq_gives_an_hf_configs_length(tmp_path: Path) -> None:
    assert _profile(tmp_path, "--set", "seq=8192")["seq_len"] == 8192
    assert _profile(tmp_path, "--set", "seq=512")["seq_len"] == 512


def test_an_h100_profile_is_counted_in_bf16_unless_told(tmp_path: Path) -> None:
    assert _profile(tmp_path)["precision"] == "bf16"
    assert _profile(tmp_path, "--precision", "fp32")["precision"] == "fp32"


def test_other_model_arguments_stay_refused_for_an_hf_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(tmp_path, "--set", "layers=4") == 2
    assert "model arguments ['layers'] apply to zoo transformers only" in capsys.readouterr().err

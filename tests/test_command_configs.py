"""Every command reads its flags once into a typed configuration, and the Python API takes that
configuration: ``calibrate``, ``data prepare``, ``demo``, ``export``, ``generate``,
``import-pipedream``, ``plan-local`` and ``split``, as ``train``, ``plan``, ``profile`` and
``simulate`` (``tests/test_config_parity.py``).

For each command: every flag is a field of its configuration (the model flags are one
:class:`~dapple.api.run_config.ModelConfig`), the flags given build the configuration expected,
and ``dapple COMMAND ...`` hands that configuration to the API (the API function replaced by
one that records what it is given)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from dapple import api
from dapple.api.calibrating import CalibrateConfig
from dapple.api.exporting import ExportConfig
from dapple.api.generating import GenerateConfig
from dapple.api.planning_local import PlanLocalConfig
from dapple.api.preparing import PrepareConfig
from dapple.api.profiling import ImportConfig
from dapple.api.run_config import ModelConfig
from dapple.api.splitting import SplitConfig
from dapple.cli import build_parser, main
from dapple.cli._demo_args import DemoConfig
from dapple.errors import ValidationError

MODEL_DESTS = {"model", "set", "split_at", "weights", "dynamic_dims"}
"""The flags :func:`dapple.cli._model_args.add_model_arguments` adds: one ``model`` field."""

RENAMED = {"plan-local": {"nproc"}}
"""Old spellings each command refuses with the new name (no field of their own)."""


def _parser(*path: str) -> argparse.ArgumentParser:
    p = build_parser()
    for name in path:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = sub.choices[name]
    return p


def _dests(*path: str) -> set[str]:
    """Every flag and positional of a command but ``-h`` (and renamed flags), by dest."""
    p = _parser(*path)
    return {
        a.dest
        for a in p._actions
        if a.dest not in ("help", "func") and not isinstance(a, argparse._SubParsersAction)
    } - RENAMED.get(path[0], set())


CONFIGS: dict[tuple[str, ...], type[Any]] = {
    ("calibrate",): CalibrateConfig,
    ("data", "prepare"): PrepareConfig,
    ("demo",): DemoConfig,
    ("export",): ExportConfig,
    ("generate",): GenerateConfig,
    ("import-pipedream",): ImportConfig,
    ("plan-local",): PlanLocalConfig,
    ("split",): SplitConfig,
}

RENAMED_FIELDS: dict[type[Any], dict[str, str]] = {
    ExportConfig: {"max_shard_size": "max_shard_bytes"},
}
"""Flags whose field holds the value parsed (``--max-shard-size 5GB`` -> bytes)."""


@pytest.mark.parametrize("path", list(CONFIGS), ids=lambda p: " ".join(p))
def test_every_flag_of_the_command_is_a_field_of_its_config(path: tuple[str, ...]) -> None:
    root = CONFIGS[path]
    fields = {f.name for f in dataclasses.fields(root)}
    dests = _dests(*path)
    if "model" in fields and root is not DemoConfig:  # -m and its flags: one ModelConfig
        assert dests >= MODEL_DESTS, dests
        dests = (dests - MODEL_DESTS) | {"model"}
    renamed = RENAMED_FIELDS.get(root, {})
    assert {renamed.get(d, d) for d in dests} == fields


def _captured(monkeypatch: pytest.MonkeyPatch, target: str) -> list[Any]:
    """Replace the API function ``target`` by one that records its first argument and
    refuses (so the command ends there, exit code 2)."""
    seen: list[Any] = []

    def take(cfg: Any, *_: Any, **__: Any) -> Any:
        seen.append(cfg)
        raise ValidationError("taken")

    monkeypatch.setattr(target, take)
    return seen


def _runs(argv: list[str], monkeypatch: pytest.MonkeyPatch, target: str) -> Any:
    """The configuration ``dapple ARGV`` hands to the API function ``target``."""
    seen = _captured(monkeypatch, target)
    assert main(argv) == 2
    assert len(seen) == 1, seen
    return seen[0]


def test_calibrate_hands_its_config_to_the_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = str(tmp_path / "c.json")
    argv = ["calibrate", "--nproc", "2", "-o", out, "--repeats", "3", "--max-mb", "1"]
    want = CalibrateConfig(nproc=2, output=out, repeats=3, max_mb=1.0)
    assert _runs(argv, monkeypatch, "dapple.api.calibrating.calibrate") == want


def test_data_prepare_hands_its_config_to_the_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = str(tmp_path / "train.bin")
    argv = ["data", "prepare", "a.txt", "b.txt", "-o", out, "--val-fraction", "0.1",
            "--tokenizer", "tok", "--documents"]  # fmt: skip
    want = PrepareConfig(text_files=("a.txt", "b.txt"), output=out, val_fraction=0.1,
                         tokenizer="tok", documents=True)  # fmt: skip
    assert _runs(argv, monkeypatch, "dapple.api.preparing.prepare_data") == want


def test_api_prepare_data_takes_the_config(tmp_path: Path) -> None:
    text = tmp_path / "a.txt"
    text.write_text("hello world, " * 40)
    cfg = PrepareConfig(text_files=(str(text),), output=str(tmp_path / "d" / "train.bin"),
                        val_fraction=0.25)  # fmt: skip
    out = api.prepare_data(cfg)
    assert out.train_tokens + out.val_tokens == len(text.read_bytes())
    assert out.val_tokens == len(text.read_bytes()) // 4
    assert json.loads(out.meta.read_text())["vocab_size"] == 256


def test_demo_reads_its_flags_into_its_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from dapple.cli import demo_cmd

    seen: list[DemoConfig] = []
    monkeypatch.setattr(demo_cmd, "run_config", lambda cfg: seen.append(cfg) or 0)
    assert main(["demo"]) == 0
    assert seen == [DemoConfig()]
    argv = ["demo", "--out-dir", "o", "--nproc", "3", "--steps", "5", "--global-batch-size",
            "4", "--seq-len", "8", "--corpus-mib", "0.5", "-m", "mlp"]  # fmt: skip
    assert main(argv) == 0
    assert seen[1] == DemoConfig(out_dir="o", nproc=3, steps=5, global_batch_size=4, seq_len=8,
                                 corpus_mib=0.5, model="mlp")  # fmt: skip


def test_demo_refuses_from_its_config_before_writing(tmp_path: Path) -> None:
    from dapple.cli._demo_args import check_demo_args

    with pytest.raises(ValidationError, match="--nproc 2: the demo runs a pipeline"):
        check_demo_args(DemoConfig(nproc=2, out_dir=str(tmp_path / "o")))
    with pytest.raises(ValidationError, match="--seq-len must be >= 1, got 0"):
        check_demo_args(DemoConfig(nproc=3, seq_len=0, out_dir=str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


def test_export_hands_its_config_to_the_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["export", "--checkpoint-dir", "ck", "--out-dir", "hf", "-m", "transformer", "--set",
            "layers=2", "--max-shard-size", "200MiB"]  # fmt: skip
    want = ExportConfig(checkpoint_dir="ck", out_dir="hf", max_shard_bytes=200 * 2**20,
                        model=ModelConfig(spec="transformer", set={"layers": 2}))  # fmt: skip
    assert _runs(argv, monkeypatch, "dapple.api.exporting.export") == want
    argv = ["export", "--checkpoint-dir", "ck", "--out-dir", "hf"]  # no model: weights only
    want = ExportConfig(checkpoint_dir="ck", out_dir="hf")
    assert _runs(argv, monkeypatch, "dapple.api.exporting.export") == want


def test_generate_hands_its_config_to_the_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["generate", "-m", "transformer", "--set", "seq=16", "--weights", "w.safetensors",
            "--prompt", "hi", "--max-new-tokens", "3", "--tokenizer", "tok", "--temperature",
            "0.5", "--seed", "7"]  # fmt: skip
    want = GenerateConfig(
        model=ModelConfig(spec="transformer", set={"seq": 16}, weights="w.safetensors"),
        prompt="hi", max_new_tokens=3, tokenizer="tok", temperature=0.5, seed=7,
    )  # fmt: skip
    assert _runs(argv, monkeypatch, "dapple.api.generating.generate") == want


def test_import_pipedream_hands_its_config_to_the_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = str(tmp_path / "p.json")
    argv = ["import-pipedream", "graph.txt", "-o", out, "--batch-size", "4", "--name", "vgg"]
    want = ImportConfig(graph="graph.txt", output=out, batch_size=4, name="vgg")
    assert _runs(argv, monkeypatch, "dapple.api.profiling.import_pipedream") == want


def test_plan_local_hands_its_config_to_the_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = str(tmp_path / "out")
    argv = ["plan-local", "-m", "mlp", "--set", "layers=3", "--global-batch-size", "8",
            "--nprocs", "2", "--repeats", "2", "--precision", "bf16", "--out-dir", out]  # fmt: skip
    want = PlanLocalConfig(model=ModelConfig(spec="mlp", set={"layers": 3}), global_batch_size=8,
                           nprocs=(2,), repeats=2, precision="bf16", out_dir=out)  # fmt: skip
    got = _runs(argv, monkeypatch, "dapple.api.planning_local.plan_local_candidates")
    assert got == want


def test_api_plan_local_of_a_config_plans_its_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake(wl: Any, gbs: int, nprocs: Any, **kw: Any) -> Any:
        seen.update(kw, name=wl.name, gbs=gbs, nprocs=nprocs)
        raise ValidationError("stop")

    monkeypatch.setattr("dapple.calibrate.local.plan_local", fake)
    cfg = PlanLocalConfig(model=ModelConfig(spec="mlp"), global_batch_size=8, nprocs=(2, 3),
                          repeats=2, precision="bf16")  # fmt: skip
    with pytest.raises(ValidationError, match="stop"):
        api.plan_local(cfg)
    assert seen == {"name": "mlp", "gbs": 8, "nprocs": (2, 3), "repeats": 2,
                    "precision": "bf16", "progress": None}  # fmt: skip


def test_split_hands_its_config_to_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["split", "-m", "mlp", "--set", "layers=3", "--split-at", "a,b", "--batch-size", "4"]
    want = SplitConfig(model=ModelConfig(spec="mlp", set={"layers": 3}, split_at=("a", "b")),
                       batch_size=4)  # fmt: skip
    assert _runs(argv, monkeypatch, "dapple.api.splitting.split") == want


def test_api_split_takes_the_config() -> None:
    chain = api.split(SplitConfig(model=ModelConfig(spec="mlp", set={"layers": 3}), batch_size=2))
    assert chain.num_layers == len(chain.pieces) >= 3
    assert all(p.params > 0 for p in chain.pieces)
    assert chain.pieces[0].output.startswith("float32[2,")
    with pytest.raises(ValidationError, match="--batch-size must be >= 1, got 0"):
        api.split(SplitConfig(model=ModelConfig(spec="mlp"), batch_size=0))


@pytest.mark.parametrize("schedule", ["gpipe", "zbh1"])
def test_plan_cli_and_api_put_a_plan_under_a_schedule_alike(
    tmp_path: Path, schedule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dapple plan --schedule S -o FILE`` writes the plan :func:`dapple.api.plan` returns for
    the same options: the same stages under S, the same predicted step."""
    from dapple.core.plan import Plan
    from dapple.planner.plan_config import PlanConfig

    out = tmp_path / "plan.json"
    argv = ["plan", "--profile", "paper:vgg19", "--cluster", "paper-a", "--servers", "1",
            "--schedule", schedule, "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    capsys.readouterr()
    cfg = PlanConfig(profile="paper:vgg19", cluster="paper-a", servers=1, schedule=schedule)
    assert Plan.load(out).to_dict() == api.plan(cfg).to_dict()

"""``--config FILE``: a run file reaches every field of :class:`~dapple.api.run_config.
RunConfig` (and a ``[planning]`` section every field of :class:`~dapple.planner.plan_config.
PlanConfig`); flags given beside it win, even at their default; ``--print-config`` prints what
reads back to the same configuration; a bad file fails before any compute, naming the file, the
key, the value and the type wanted."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from dapple import api
from dapple.api.run_config import (
    RUN_SECTIONS,
    DataConfig,
    ModelConfig,
    PlanChoice,
    RunConfig,
    RunOptions,
    dump_run_config,
    load_run_config,
    resolve_eval,
    resolve_train_config,
)
from dapple.cli import main
from dapple.core.plan import Plan, straight_plan
from dapple.errors import ValidationError
from dapple.files.config_file import merge_values
from dapple.planner.plan_config import PLAN_SECTIONS, PlanConfig, dump_plan_config, load_plan_config
from dapple.runtime.train_config import TrainConfig

Field = tuple[str, str]

NON_DEFAULT: dict[str, Any] = {
    # [model]
    "spec": "runtime_workloads:mlp", "set": {"num_layers": 4, "note": "a b", "w": [1, 2.5]},
    "split_at": ("blocks.1", "blocks.3"), "weights": "w.safetensors",
    "dynamic_dims": ("input_ids:1=seq:2..64",),
    # [plan]
    "path": "plan.json", "schedule": "zbh1", "virtual_stages": 2, "policy": "B",
    # [data]
    "eval_path": "val.bin", "seq_len": 64, "documents": "pack",
    # [train]
    "steps": 7, "seed": 3, "device": "cpu", "precision": "bf16", "timeout_s": 42.5,
    "recompute": "full", "on_nonfinite": "skip",
    # [optimizer]
    "optimizer": "adamw", "lr": 0.003, "weight_decay": 0.1, "momentum": 0.9,
    "betas": (0.8, 0.95), "eps": 1e-6, "lr_schedule": "cosine", "warmup_steps": 2,
    "min_lr": 1e-5, "clip_grad_norm": 1.0, "zero_stage": 2,
    # [checkpoint]
    "checkpoint_dir": "ck", "save_every": 5, "keep": 0, "resume": True, "require_resume": True,
    "overwrite_checkpoints": True,
    # [eval]
    "eval_every": 3, "eval_batches": 2, "eval_batch_size": 6,
    # [report]
    "metrics_path": "m.jsonl", "grad_norm_every": 2, "tensorboard_dir": "tb", "profile": "paper:bert48",
    "cluster": "paper-a", "loss_curve": "curve.png",
    # [elastic]
    "elastic": True, "min_devices": 2, "max_restarts": 5,
}  # fmt: skip
"""A value other than the default for every key of a run file (``path`` of ``[data]``: below)."""

EXCLUSIVE = (
    {"momentum": 0.0, "overwrite_checkpoints": False, "grad_norm_every": 1},  # adamw, resuming
    {"optimizer": "sgd", "resume": False, "require_resume": False, "clip_grad_norm": None},
)
"""Two files between them set every key: momentum is SGD's, resume and overwrite exclude each
other, clipping needs the gradient norm on every step (None: the key is left out)."""


def _value(field: Field) -> Any:
    if field == ("data", "path"):
        return "train.bin"
    return NON_DEFAULT[field[1]]


def _variant(i: int) -> dict[Field, Any]:
    values = {f: _value(f) for fields in RUN_SECTIONS.values() for f in fields}
    return {f: EXCLUSIVE[i].get(f[1], v) for f, v in values.items()}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(map(_toml_value, v)) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def _write(path: Path, values: dict[Field, Any], schema: Any = RUN_SECTIONS) -> Path:
    """A TOML file setting ``values``, in ``schema``'s sections (written here, not by dump)."""
    lines = []
    for section, fields in schema.items():
        lines.append(f"[{section}]")
        lines += [f"{f[1]} = {_toml_value(values[f])}" for f in fields
                  if values.get(f) is not None]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return path


def _expected(values: dict[Field, Any]) -> RunConfig:
    """The configuration ``values`` ask for, built field by field."""
    part = {p: {n: v for (q, n), v in values.items() if q == p} for p, _ in values}
    return RunConfig(
        model=ModelConfig(**part["model"]),
        plan=PlanChoice(**part["plan"]),
        data=DataConfig(**part["data"]),
        train=TrainConfig(**part["train"]),
        run=RunOptions(**part["run"]),
    )


@pytest.fixture(autouse=True)
def _no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any, **__: Any) -> None:
        raise AssertionError("the runtime was reached")

    monkeypatch.setattr("dapple.runtime.train", boom)


@pytest.mark.parametrize("i", range(len(EXCLUSIVE)))
def test_a_run_file_reaches_every_field(tmp_path: Path, i: int) -> None:
    pytest.importorskip("tensorboard")  # tensorboard_dir needs it
    values = _variant(i)
    cfg = load_run_config(_write(tmp_path / "run.toml", values))
    assert cfg == _expected(values)
    default = RunConfig()
    for f, v in values.items():
        got = getattr(getattr(cfg, f[0]), f[1])
        assert got == v, f
        if EXCLUSIVE[i].get(f[1], object()) != v:
            assert got != getattr(getattr(default, f[0]), f[1]), f"{f} is at its default"


def test_the_variants_set_every_key_off_its_default() -> None:
    default = RunConfig()
    for fields in RUN_SECTIONS.values():
        for f in fields:
            base = getattr(getattr(default, f[0]), f[1])
            assert any(_variant(i)[f] != base for i in range(len(EXCLUSIVE))), f


@pytest.mark.parametrize("i", range(len(EXCLUSIVE)))
def test_print_config_reads_back_to_the_same_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], i: int
) -> None:
    pytest.importorskip("tensorboard")
    path = _write(tmp_path / "run.toml", _variant(i))
    assert main(["train", "--config", str(path), "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed == dump_run_config(load_run_config(path))
    again = tmp_path / "printed.toml"
    again.write_text(printed)
    assert load_run_config(again) == load_run_config(path)
    assert main(["train", "--config", str(again), "--print-config"]) == 0
    assert capsys.readouterr().out == printed  # a fixed point


def test_print_config_of_flags_alone_is_a_template(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--print-config"]) == 0  # no --plan, -m: printed as unset
    out = capsys.readouterr().out
    assert "# spec = <str>  (unset)" in out and '[optimizer]\noptimizer = "sgd"' in out
    assert "keep = 3" in out and "eps = 1e-08" in out


def test_flags_given_beside_the_file_win(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[model]\nspec = "mlp"\nset = { layers = 2, hidden = 8 }\n[plan]\npath = "p.json"\n'
        "[train]\nsteps = 5\nseed = 9\n[optimizer]\nlr = 0.1\n"
        '[checkpoint]\ncheckpoint_dir = "ck"\nkeep = 5\n'
    )
    argv = ["train", "--config", str(path), "--lr", "0.01", "--set", "hidden=16", "--keep", "0"]
    assert main([*argv, "--print-config"]) == 0
    out = tmp_path / "out.toml"
    out.write_text(capsys.readouterr().out)
    cfg = load_run_config(out)
    assert cfg.train.lr == 0.01  # given at its default, still over the file's 0.1
    assert cfg.run.keep == 0
    assert cfg.model.set == {"layers": 2, "hidden": 16}  # --set merges into [model] set
    assert (cfg.train.steps, cfg.train.seed, cfg.model.spec) == (5, 9, "mlp")  # the file's
    # a checkpoint_dir without save_every saves once, after the last step: train resolves it
    assert cfg.train.save_every == cfg.train.steps
    assert cfg == load_run_config(path, over={("train", "lr"): 0.01, ("run", "keep"): 0,
                                              ("model", "set"): {"hidden": 16},
                                              ("train", "save_every"): 5})  # fmt: skip


def test_merge_values_merges_tables_and_replaces_the_rest() -> None:
    a = {("model", "set"): {"x": 1, "y": 2}, ("train", "lr"): 0.1}
    b = {("model", "set"): {"y": 3}, ("train", "lr"): 0.2}
    assert merge_values(a, b) == {("model", "set"): {"x": 1, "y": 3}, ("train", "lr"): 0.2}


BAD = {
    "unknown key": ("[optimizer]\nweight_decy = 0.1\n",
                    "unknown key 'weight_decy' in [optimizer]; did you mean weight_decay?"),
    "misplaced key": ("[train]\nlr = 0.1\n", "unknown key 'lr' in [train]; it belongs in [optimizer]"),
    "unknown section": ("[optimiser]\nlr = 0.1\n", "unknown section [optimiser]; did you mean [optimizer]?"),
    "outside": ("lr = 0.1\n", "key 'lr' is outside any section; put it under one of [model]"),
    "str for float": ('[optimizer]\nlr = "fast"\n', '[optimizer] lr = "fast": expected float, got str'),
    "int for bool": ("[checkpoint]\nresume = 1\n", "[checkpoint] resume = 1: expected bool, got int"),
    "bool for int": ("[train]\nsteps = true\n", "[train] steps = true: expected int, got bool"),
    "float for int": ("[train]\nsteps = 2.5\n", "[train] steps = 2.5: expected int, got float"),
    "short array": ("[optimizer]\nbetas = [0.9]\n",
                    "[optimizer] betas = [0.9]: expected an array of 2 floats, got an array of 1"),
    "table for str": ('[model]\nspec = { a = 1 }\n', "[model] spec = { a = 1 }: expected str, got a table"),
    "str for array": ('[model]\nsplit_at = "a,b"\n',
                      '[model] split_at = "a,b": expected an array of str, got str'),
    "bad value": ("[optimizer]\nlr = -1.0\n", "lr must be > 0, got -1.0"),
    "bad pair": ("[report]\nprofile = \"paper:bert48\"\n", "profile and cluster must be given together"),
    "syntax": ("[optimizer\n", "Expected ']' at the end of a table declaration (at line 1"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_file_is_one_error_line_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    text, needle = BAD[case]
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dapple: error: "), err
    assert str(path) in err and needle in err, err


def test_a_bad_flag_beside_a_good_file_is_the_flags_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[optimizer]\nlr = 0.1\n[model]\nspec = "mlp"\n[plan]\npath = "p.json"\n')
    assert main(["train", "--config", str(path), "--lr", "-2"]) == 2
    err = capsys.readouterr().err
    assert err == "dapple: error: --lr must be > 0, got -2.0\n"  # not the file's fault


def test_the_file_may_give_the_required_flags_and_names_them_when_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[model]\nspec = "mlp"\n')
    assert main(["train", "--config", str(path)]) == 2
    assert "--plan is required (or [plan] path in the --config file)" in capsys.readouterr().err
    assert main(["train", "--config", str(path), "--plan", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err  # on to loading the plan
    with pytest.raises(SystemExit):
        main(["train", "--steps", "2"])  # without a file argparse still wants them


def test_a_missing_config_file_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--config", "/nonexistent/run.toml"]) == 2
    assert "config file '/nonexistent/run.toml': No such file" in capsys.readouterr().err


def test_none_inside_a_table_cannot_be_printed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--plan", "p.json", "-m", "mlp", "--set", "x=null", "--print-config"]
    assert main(argv) == 2
    assert "[model] set: TOML cannot hold None" in capsys.readouterr().err


# -- what the doors resolve -----------------------------------------------------------------------
def test_resolve_eval_and_keep_as_the_cli_always_did() -> None:
    assert resolve_eval(0, None, None, steps=5, eval_samples=None, G=4) == (0, 4)
    assert resolve_eval(0, None, None, steps=5, eval_samples=40, G=4) == (5, 4)
    assert resolve_eval(0, None, None, steps=5, eval_samples=12, G=4) == (5, 3)
    assert resolve_eval(2, None, 6, steps=5, eval_samples=12, G=4) == (2, 2)
    assert resolve_eval(0, 7, None, steps=5, eval_samples=12, G=4) == (5, 7)  # as told
    train = TrainConfig(checkpoint_dir="ck", save_every=1)
    assert resolve_train_config(train, RunOptions(), None, 4).keep == 3
    assert resolve_train_config(train, RunOptions(keep=0), None, 4).keep is None
    assert resolve_train_config(train, RunOptions(require_resume=True), None, 4).resume
    with pytest.raises(ValidationError, match="keep must be >= 0"):
        RunOptions(keep=-1)


# -- dapple plan --config -------------------------------------------------------------------------
PLAN_VALUES = {
    "profile": "paper:bert48", "cluster": "paper-a", "servers": 2, "global_batch_size": 64,
    "planner": "straight", "mean_seq_len": 300.5, "max_seq_len": 512.0, "schedule": "interleaved",
    "virtual_stages": 2, "zero_stage": "auto", "tensor_widths": (1, 2), "interleave": True,
    "on_nonfinite": "off", "output": "plan.json",
}  # fmt: skip


def test_a_planning_section_reaches_every_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = {f: PLAN_VALUES[f[1]] for fields in PLAN_SECTIONS.values() for f in fields}
    path = _write(tmp_path / "plan.toml", values, PLAN_SECTIONS)
    cfg = load_plan_config(path)
    assert cfg == PlanConfig(**PLAN_VALUES)
    for name, v in PLAN_VALUES.items():
        assert getattr(cfg, name) == v != getattr(PlanConfig(), name), name
    assert main(["plan", "--config", str(path), "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert printed == dump_plan_config(cfg)
    (tmp_path / "again.toml").write_text(printed)
    assert load_plan_config(tmp_path / "again.toml") == cfg
    assert main(["plan", "--config", str(path), "--mean-seq-len", "128", "--zero-stage", "3",
                 "--tensor-widths", "4,1", "--print-config"]) == 0  # fmt: skip
    (tmp_path / "over.toml").write_text(capsys.readouterr().out)
    over = load_plan_config(tmp_path / "over.toml")
    assert (over.mean_seq_len, over.max_seq_len, over.zero_stage) == (128.0, 128.0, 3)
    assert over.tensor_widths == (1, 4)
    assert main(["plan", "--config", str(path), "--tensor-widths", "auto", "--print-config"]) == 0
    assert 'tensor_widths = "auto"' in capsys.readouterr().out  # the flag won over the file


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            '[planning]\nzero_stage = "two"\n',
            "zero_stage must be one of 0, 1, 2, 3 or auto, got 'two'",
        ),
        ("[planning]\nzero_stage = 1.0\n", "[planning] zero_stage = 1.0: expected int or str"),
        (
            "[planning]\ntensor_widths = [1, 3]\n",
            "tensor_widths must be auto or widths from 1, 2, 4, 8, got [1, 3]",
        ),
        (
            '[planning]\ntensor_widths = "all"\n',
            "tensor_widths must be auto or widths from 1, 2, 4, 8, got 'all'",
        ),
        (
            "[planning]\ntensor_widths = 2\n",
            "[planning] tensor_widths = 2: expected str or an array of int",
        ),
        ('[planning]\nplaner = "dp"\n', "did you mean planner?"),
        ("[planning]\nmax_seq_len = 64.0\n", "max_seq_len=64 needs mean_seq_len"),
        ("[planning]\nseq_len = 64.0\n", "[planning] seq_len is spelled mean_seq_len now"),
    ],
)
def test_a_bad_planning_section_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, needle: str
) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(text)
    assert main(["plan", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and needle in err, err


def test_plan_from_a_file_is_the_plan_from_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags, filed = tmp_path / "flags.json", tmp_path / "file.json"
    argv = ["--profile", "paper:vgg19", "--cluster", "paper-a", "--servers", "1"]
    assert main(["plan", *argv, "--zero-stage", "auto", "-o", str(flags)]) == 0
    job = tmp_path / "job.toml"  # one file for both commands: each reads its own sections
    job.write_text(
        '[planning]\nprofile = "paper:vgg19"\ncluster = "paper-a"\nzero_stage = "auto"\n'
        f'output = "{tmp_path / "unused.json"}"\n[model]\nspec = "mlp"\n[optimizer]\nlr = 0.1\n'
    )
    assert main(["plan", "--config", str(job), "--servers", "1", "-o", str(filed)]) == 0
    capsys.readouterr()
    assert Plan.load(filed) == Plan.load(flags)
    assert not (tmp_path / "unused.json").exists()  # -o won over the file's output
    assert main(["train", "--config", str(job), "--print-config"]) == 0
    assert "lr = 0.1" in capsys.readouterr().out


# -- the whole way: a run file trains --------------------------------------------------------------
@pytest.mark.slow
def test_train_from_a_run_file_equals_the_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.undo()  # the real runtime
    plan = tmp_path / "plan.json"
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(plan)
    run = tmp_path / "run.toml"
    run.write_text(
        f'[model]\nspec = "runtime_workloads:mlp"\n[plan]\npath = "{plan}"\n'
        '[train]\nsteps = 2\nseed = 3\ndevice = "cpu"\ntimeout_s = 120.0\n'
        '[optimizer]\noptimizer = "adamw"\nlr = 0.01\nweight_decay = 0.1\n'
        f'[report]\nmetrics_path = "{tmp_path / "m.jsonl"}"\n'
    )
    assert main(["train", "--config", str(run)]) == 0
    capsys.readouterr()
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    metrics = api.train(plan, "runtime_workloads:mlp", 2, seed=3, device="cpu", timeout_s=120.0,
                        optimizer="adamw", lr=0.01, weight_decay=0.1)  # fmt: skip
    assert [r["loss"] for r in rows] == [m.loss for m in metrics]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)

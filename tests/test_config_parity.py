"""One typed configuration behind three doors: every flag of ``dapple train`` and ``dapple plan``
is a field of :class:`~dapple.api.run_config.RunConfig` / :class:`~dapple.planner.plan_config.
PlanConfig` with the flag's default, and :func:`dapple.api.train` / :func:`dapple.api.plan` take
the same option with the same default - but for the few flags that only a command line can have,
each listed below with its reason. The runs the CLI, a config file and the API ask for reach the
runtime alike."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest

from dapple import api
from dapple.api.run_config import (
    NOT_IN_FILE,
    RUN_SECTIONS,
    ModelConfig,
    PlanChoice,
    RunConfig,
    load_run_config,
)
from dapple.cli import build_parser, main
from dapple.cli._config_args import Flag
from dapple.cli._plan_flags import plan_flags
from dapple.cli._train_flags import RUN_FLAGS, TRAIN_FLAGS
from dapple.cli.plan_cmd import parse_mean_seq_len
from dapple.cli.train_cmd import DEFAULT_KEEP
from dapple.core.parallelism import ZERO_STAGES
from dapple.core.plan import Plan, straight_plan
from dapple.core.planning_options import ZERO_CHOICES
from dapple.errors import ValidationError
from dapple.planner.plan_config import PLAN_SECTIONS, RUN_SECTION_NAMES, PlanConfig
from dapple.profiler.paper_models import load_profile
from dapple.runtime.train_config import TrainConfig

FILE_FLAGS = {"config", "print_config"}
"""The flags about the config file itself (no field of it)."""

CLI_ONLY_TRAIN = {
    "config": "names the file the options come from; the API takes them as arguments "
    "(a file: dapple.api.run_config.load_run_config)",
    "print_config": "prints the merged options and exits; the API has the object "
    "(dump_run_config writes it)",
    "loss_curve": "dapple train draws the PNG after the run; the API returns the metrics "
    "(dapple.runtime.reporting.write_loss_curve draws them)",
}
"""``dapple train`` flags (by dest) that :func:`dapple.api.train` does not take, and why."""

CLI_ONLY_PLAN = {
    "config": "names the file the options come from; the API takes them as arguments "
    "(a file: dapple.planner.plan_config.load_plan_config)",
    "print_config": "prints the merged options and exits; the API has the object "
    "(dump_plan_config writes it)",
    "compare": "prints every planner side by side; the API plans with one planner per call",
}
"""``dapple plan`` flags (by dest) that :func:`dapple.api.plan` does not take, and why."""

API_ONLY_PLAN = {
    "inputs": "what a PlanConfig names, already loaded (dapple plan loads them naming its flags)",
    "progress": "the search's progress callback (dapple plan shows a progress bar)",
}
"""Keywords of :func:`dapple.api.plan` beside a ``PlanConfig``, no field of it."""

API_NAMES = {
    ("plan", "path"): "plan",
    ("model", "spec"): "workload",
    ("data", "path"): "data",
    ("data", "eval_path"): "eval_data",
}
"""Fields the API takes under another name (its positional subjects and data arguments)."""

OVERRIDES = {
    ("model", "set"): "the overrides mapping itself",
    ("model", "split_at"): "split_at",
    ("model", "weights"): "weights",
    ("model", "dynamic_dims"): "dynamic_dims",
}
"""Fields the API takes as entries of ``overrides=`` (keyword arguments of
:func:`dapple.models.spec.load`, as ``--set`` items are)."""

API_ONLY_TRAIN = {
    "overrides": "the model factory's keywords: --set, --split-at, --weights, --dynamic-dims",
    "early": "workers dapple train starts before its checks",
    "inputs": "with a RunConfig: what it names, already loaded (None: train loads them)",
    "flags": "the checks' messages name dapple train's flags (its own call)",
    "options": "TrainConfig fields (each checked above)",
}
""":func:`dapple.api.train` parameters that are no single flag."""


def _parser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def _flag_actions(command: str) -> dict[str, argparse.Action]:
    """Every flag of ``command`` but ``-h``, by dest (``--pack``/``--pad`` share one)."""
    return {a.dest: a for a in _parser(command)._actions if a.option_strings and a.dest != "help"}


def _default(action: argparse.Action, flag: Flag) -> tuple[Any, ...]:
    """The flag's default as the config fields' values."""
    return flag.to_fields(action.default)


def _field_default(root: Any, f: tuple[str, str]) -> Any:
    holder = root if f[0] == "" else getattr(root, f[0])
    return getattr(holder, f[1])


def _in_schema(schema: Any) -> set[tuple[str, str]]:
    return {f for fields in schema.values() for f in fields}


# -- dapple train ---------------------------------------------------------------------------------
def test_every_train_flag_is_a_config_field_or_cli_only() -> None:
    dests = set(_flag_actions("train"))
    table = [f.dest for f in TRAIN_FLAGS]
    assert len(table) == len(set(table))
    assert dests == set(table) | FILE_FLAGS
    fields = [x for f in TRAIN_FLAGS for x in f.fields]
    assert len(fields) == len(set(fields)), "two flags set one field"
    assert set(fields) <= _in_schema(RUN_SECTIONS), "a flag's field no file key reaches"
    assert _in_schema(RUN_SECTIONS) == set(fields), "a file key no flag sets"


def test_train_flag_defaults_are_the_config_defaults() -> None:
    actions, cfg = _flag_actions("train"), RunConfig()
    for flag in TRAIN_FLAGS:
        want = tuple(_field_default(cfg, f) for f in flag.fields)
        assert _default(actions[flag.dest], flag) == want, flag.dest
    assert cfg.run.keep == DEFAULT_KEEP
    for dest in ("plan", "model"):  # required unless --config gives them
        assert actions[dest].required, dest


def test_api_train_takes_every_option_with_the_same_default() -> None:
    params, actions = inspect.signature(api.train).parameters, _flag_actions("train")
    assert params["options"].kind is inspect.Parameter.VAR_KEYWORD  # TrainConfig fields
    cfg, train_fields = RunConfig(), {f.name for f in dataclasses.fields(TrainConfig)}
    taken: set[str] = set()
    for flag in TRAIN_FLAGS:
        if flag.dest in CLI_ONLY_TRAIN:
            continue
        for f in flag.fields:
            default = _field_default(cfg, f)
            if f in OVERRIDES:
                assert params["overrides"].default is None and not default, f
                continue
            name = API_NAMES.get(f, f[1])
            if name in params:
                p = params[name]
                if p.default is inspect.Parameter.empty:  # the required subjects
                    assert default is None and actions[flag.dest].required, f
                else:
                    assert p.default == default, (f, p.default, default)
            else:  # through **options into TrainConfig
                assert f[0] == "train" and name in train_fields, f
                assert getattr(TrainConfig(), name) == default, f
            taken.add(name)
    assert set(params) - taken == set(API_ONLY_TRAIN)  # nothing else the API takes
    for name in NOT_IN_FILE:
        assert name in train_fields, name


def test_train_config_fields_are_each_in_the_file_or_given_a_reason() -> None:
    in_file = {n for p, n in _in_schema(RUN_SECTIONS) if p == "train"}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert in_file | set(NOT_IN_FILE) == names
    assert not in_file & set(NOT_IN_FILE)
    assert set(RUN_SECTIONS) == set(RUN_SECTION_NAMES)


# -- dapple plan ----------------------------------------------------------------------------------
def test_every_plan_flag_is_a_config_field_or_cli_only() -> None:
    flags = plan_flags(parse_mean_seq_len)
    dests = set(_flag_actions("plan"))
    assert dests == {f.dest for f in flags} | set(CLI_ONLY_PLAN) | {"seq_len"}  # renamed
    fields = [x for f in flags for x in f.fields]
    assert sorted(fields) == sorted(_in_schema(PLAN_SECTIONS))


def test_plan_flag_defaults_and_api_plan_defaults_are_the_config_defaults() -> None:
    actions, cfg = _flag_actions("plan"), PlanConfig()
    params = inspect.signature(api.plan).parameters
    for flag in plan_flags(parse_mean_seq_len):
        want = tuple(_field_default(cfg, f) for f in flag.fields)
        assert _default(actions[flag.dest], flag) == want, flag.dest
        for (_, name), default in zip(flag.fields, want, strict=True):
            p = params[name]
            if p.default is inspect.Parameter.empty:
                assert default is None and actions[flag.dest].required, name
            else:
                assert p.default == default, (name, p.default, default)
    assert set(params) == {n for _, n in _in_schema(PLAN_SECTIONS)} | set(API_ONLY_PLAN)
    # a run's zero stages (a floor, 0-3) are the plan's, and auto, which only the planner takes
    assert (*ZERO_STAGES, "auto") == ZERO_CHOICES


def test_api_plan_takes_zero_stage_and_servers_like_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli.json"
    argv = ["plan", "--profile", "paper:vgg19", "--cluster", "paper-a", "--servers", "1"]
    assert main([*argv, "--zero-stage", "auto", "-o", str(out)]) == 0
    capsys.readouterr()
    ours = api.plan("paper:vgg19", "paper-a", servers=1, zero_stage="auto")
    assert ours == Plan.load(out)
    assert len(ours.devices) == 8  # one server of paper-a
    with pytest.raises(
        ValidationError, match="zero_stage must be one of 0, 1, 2, 3 or auto, got 4"
    ):
        api.plan("paper:vgg19", "paper-a", zero_stage=4)
    load_profile("paper:vgg19").save(tmp_path / "vgg.json")
    with pytest.raises(ValidationError, match="global_batch_size is required"):
        api.plan(tmp_path / "vgg.json", "paper-a")
    cfg = PlanConfig(profile="paper:vgg19", cluster="paper-a", servers=1, zero_stage="auto",
                     output=str(tmp_path / "cfg.json"))  # fmt: skip
    assert api.plan(cfg) == ours == Plan.load(tmp_path / "cfg.json")
    with pytest.raises(
        ValidationError, match="plan\\(cfg\\) takes the planning options from cfg, got also servers"
    ):
        api.plan(cfg, servers=2)  # type: ignore[call-overload]
    with pytest.raises(ValidationError, match="a plan needs a profile and a cluster"):
        api.plan(PlanConfig(profile="paper:vgg19"))


# -- dapple simulate --------------------------------------------------------------------------------
def test_every_simulate_flag_is_a_simulate_config_field_with_its_default() -> None:
    from dapple.api.simulating import SimulateConfig
    from dapple.cli.simulate_cmd import simulate_config_of

    actions = _flag_actions("simulate")
    fields = {f.name: f for f in dataclasses.fields(SimulateConfig)}
    renamed = {"compare"}  # refused with its new name, --other-schedule
    assert set(actions) == set(fields) | renamed | {"config", "print_config"}
    for name, f in fields.items():
        assert actions[name].default == f.default, name
        assert actions[name].required == (name in ("plan", "profile", "cluster")), name
    argv = ["simulate", "--plan", "p.json", "--profile", "paper:bert48", "--cluster", "paper-a",
            "--servers", "1", "--schedule", "interleaved", "--virtual-stages", "2", "--policy",
            "B", "--other-schedule", "--gantt", "g.png", "--trace", "t.json", "--memory", "m.png",
            "--layout", "l.png"]  # fmt: skip
    cfg = simulate_config_of(build_parser().parse_args(argv))
    assert cfg == SimulateConfig(
        plan="p.json", profile="paper:bert48", cluster="paper-a", servers=1,
        schedule="interleaved", virtual_stages=2, policy="B", other_schedule=True, gantt="g.png",
        trace="t.json", memory="m.png", layout="l.png",
    )  # fmt: skip


def test_simulate_refuses_the_old_compare_with_its_new_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--compare`` is ``dapple plan``'s (every planner side by side); ``dapple simulate``'s
    other schedule is ``--other-schedule``, and its old spelling is refused before anything
    is read."""
    argv = ["simulate", "--plan", "missing.json", "--profile", "paper:bert48", "--cluster",
            "paper-a", "--compare"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "dapple: error: --compare is spelled --other-schedule now (same meaning)\n"
    plan = _flag_actions("plan")["compare"]
    assert plan.option_strings == ["--compare"] and "every planner" in (plan.help or "")


# -- dapple profile ---------------------------------------------------------------------------------
def test_every_profile_flag_is_a_profile_config_field_or_the_model() -> None:
    from dapple.api.profiling import ProfileConfig
    from dapple.cli._profile_flags import MODEL_FLAGS
    from dapple.cli.profile_cmd import profile_config_of

    actions = _flag_actions("profile")
    fields = {f.name: f for f in dataclasses.fields(ProfileConfig)}
    model = {f.dest for f in MODEL_FLAGS}
    renamed = {"act_checkpoint"}  # refused with its new name, --recompute
    assert set(actions) == (set(fields) - {"model"}) | model | renamed | {"config", "print_config"}
    argv = ["profile", "-m", "mlp", "-o", "p.json", "--set", "layers=3"]
    cfg = profile_config_of(build_parser().parse_args(argv))
    assert cfg == ProfileConfig(model=ModelConfig(spec="mlp", set={"layers": 3}), output="p.json")
    argv += ["--batch-sizes", "2,8", "--seq-lens", "8,16", "--input-shape", "3,4", "--threads",
             "2", "--co-workers", "2", "--precision", "bf16", "--split-backward"]  # fmt: skip
    cfg = profile_config_of(build_parser().parse_args(argv))
    assert cfg is not None and (cfg.batch_sizes, cfg.seq_lens, cfg.input_shape) == (
        (2, 8), (8, 16), (3, 4),
    )  # fmt: skip
    assert (cfg.threads, cfg.co_workers, cfg.precision, cfg.split_backward) == (2, 2, "bf16", True)


# -- the same run through the three doors --------------------------------------------------------
EVERY_RUN_OPTION = {
    "steps": 3, "seed": 5, "optimizer": "adamw", "lr": 0.002, "weight_decay": 0.1,
    "betas": (0.8, 0.99), "eps": 1e-6, "lr_schedule": "cosine", "warmup_steps": 1,
    "min_lr": 0.0001, "clip_grad_norm": 1.5, "zero_stage": 1, "device": "cpu",
    "timeout_s": 60.0, "precision": "bf16", "recompute": "full", "on_nonfinite": "skip",
    "save_every": 2, "keep": 2, "eval_every": 1, "eval_batches": 2, "eval_batch_size": 2,
}  # fmt: skip
"""A value other than the default for every option the runtime gets (besides the paths)."""


def _flags(options: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in options.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif isinstance(v, tuple):
            out += [flag, *map(str, v)]
        else:
            out += [flag, str(v)]
    return out


def _toml(options: dict[str, Any]) -> str:
    sections: dict[str, list[str]] = {}
    for k, v in options.items():
        section = next(s for s, fs in RUN_SECTIONS.items() if any(n == k for _, n in fs))
        text = repr(v) if not isinstance(v, bool | str | tuple) else ""
        text = text or ("true" if v is True else f'"{v}"' if isinstance(v, str) else repr(list(v)))
        sections.setdefault(section, []).append(f"{k} = {text}")
    return "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in sections.items()) + "\n"


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every ``dapple.runtime.train`` call (none starts a process): plan and options."""
    calls: list[dict[str, Any]] = []

    def fake_train(plan: Any, workload: Any, config: TrainConfig, **kw: Any) -> list[Any]:
        kw.pop("early", None)
        calls.append({"plan": plan, "workload": workload.name, **dataclasses.asdict(config), **kw})
        return []

    monkeypatch.setattr("dapple.runtime.train", fake_train)
    monkeypatch.setenv("RANK", "0")  # as one torchrun rank: no early workers
    monkeypatch.setenv("WORLD_SIZE", "2")
    return calls


def test_cli_file_and_api_ask_the_runtime_for_the_same_run(
    tmp_path: Path, runs: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.json"
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(plan)
    paths = {"checkpoint_dir": str(tmp_path / "ck"), "metrics_path": str(tmp_path / "m.jsonl")}
    flags = [
        *_flags(EVERY_RUN_OPTION),
        *("--checkpoint-dir", paths["checkpoint_dir"], "--metrics", paths["metrics_path"]),
    ]
    if importlib.util.find_spec("tensorboard") is not None:  # a dev dependency
        paths["tensorboard_dir"] = str(tmp_path / "tb")
        flags += ["--tensorboard", paths["tensorboard_dir"]]
    model = ["-m", "runtime_workloads:mlp", "--set", "num_layers=4"]
    assert main(["train", "--plan", str(plan), *model, *flags]) == 0
    run_toml = tmp_path / "run.toml"
    run_toml.write_text(
        f'[model]\nspec = "runtime_workloads:mlp"\nset = {{ num_layers = 4 }}\n'
        f'[plan]\npath = "{plan}"\n' + _toml({**EVERY_RUN_OPTION, **paths})
    )
    assert main(["train", "--config", str(run_toml)]) == 0
    capsys.readouterr()
    api.train(plan, "runtime_workloads:mlp", overrides={"num_layers": 4}, echo=True,
              progress=True, **EVERY_RUN_OPTION, **paths)  # fmt: skip
    cfg = load_run_config(run_toml)
    api.train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, echo=True,
                                                                 progress=True)))  # fmt: skip
    cli, from_file, from_api, from_config = runs
    assert cli == from_file == from_api == from_config
    for k, v in EVERY_RUN_OPTION.items():  # each reached the runtime
        assert cli[k] == v, k
    assert cli["resume"] is False and cli["echo"] and cli["progress"]


def test_api_train_opens_documents_and_refuses_before_the_runtime(
    tmp_path: Path, runs: list[dict[str, Any]]
) -> None:
    from dapple.models.spec import load
    from dapple.runtime.checkpoint import CheckpointError

    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    wl = load("transformer", layers=2, hidden=16, heads=2, seq=4)  # 4 chain layers
    docs = tmp_path / "docs.jsonl"
    docs.write_text('{"ids": [1, 2, 3, 4, 5, 6]}\n{"ids": [7, 8, 9]}\n' * 3)  # G = 4 samples
    api.train(plan, wl, data=str(docs), seq_len=4, documents="pack")  # --pack
    assert type(runs[-1]["data"]).__name__ == "PackedDocuments"
    with pytest.raises(CheckpointError, match="require_resume: no checkpoint to resume"):
        api.train(plan, wl, checkpoint_dir=str(tmp_path / "ck"), require_resume=True)
    with pytest.raises(ValidationError, match="profile and cluster must be given together"):
        api.train(plan, wl, profile="paper:bert48")
    with pytest.raises(ValidationError, match="keep must be >= 0"):
        api.train(plan, wl, keep=-1)
    assert len(runs) == 1


def test_api_train_of_a_config_takes_nothing_beside_it(
    tmp_path: Path, runs: list[dict[str, Any]]
) -> None:
    plan = tmp_path / "plan.json"
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(plan)
    model = ModelConfig(spec="runtime_workloads:mlp", set={"num_layers": 4})
    cfg = RunConfig(model=model, plan=PlanChoice(path=str(plan), schedule="gpipe"))
    with pytest.raises(
        ValidationError, match="takes the run's options from cfg, got also steps, lr"
    ):
        api.train(cfg, steps=3, lr=0.1)  # type: ignore[call-overload]
    with pytest.raises(ValidationError, match="needs a plan path and a model spec"):
        api.train(RunConfig(plan=PlanChoice(path=str(plan))))
    api.train(cfg)
    assert len(runs) == 1 and runs[0]["plan"].schedule == "gpipe" and runs[0]["steps"] == 1


# -- dapple verify ---------------------------------------------------------------------------------
TOLERANCES = {"rtol", "atol", "grad_rtol"}
"""``dapple verify``'s own flags, no field of the run (:data:`dapple.api.verifying.VERIFY_CHECKS`)."""

EVERY_VERIFY_OPTION = {
    k: v for k, v in EVERY_RUN_OPTION.items() if k in {f.dest for f in RUN_FLAGS}
}
"""A value other than the default for every option of the run that verify forwards."""


def test_every_verify_flag_is_a_run_flag_of_train_or_a_tolerance() -> None:
    verify_dests, train_dests = set(_flag_actions("verify")), set(_flag_actions("train"))
    run = {f.dest for f in RUN_FLAGS}
    assert verify_dests == run | TOLERANCES
    assert run <= train_dests and not TOLERANCES & train_dests
    assert set(TRAIN_FLAGS[: len(RUN_FLAGS)]) == set(RUN_FLAGS)
    assert set(api.verifying.VERIFY_CHECKS) > TOLERANCES


def test_cli_and_api_ask_verify_for_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dapple.cli import verify_cmd

    calls: list[dict[str, Any]] = []

    def fake_verify(plan: Plan, workload: Any, config: TrainConfig, **kw: Any) -> Any:
        calls.append({"plan": plan, "workload": workload.name, "config": config, **kw})
        return argparse.Namespace(ok=True)

    monkeypatch.setattr("dapple.runtime.verify.verify", fake_verify)
    monkeypatch.setattr(verify_cmd, "print_report", lambda *_: None)
    plan = tmp_path / "plan.json"
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(plan)
    options = {k: v for k, v in EVERY_VERIFY_OPTION.items() if k != "steps"}
    options["momentum"] = 0.0  # the CLI forwards every optimisation option; adamw takes none
    model = ["-m", "runtime_workloads:mlp", "--set", "num_layers=4"]
    argv = ["verify", "--plan", str(plan), *model, "--schedule", "gpipe", "--policy", "B"]
    assert main([*argv, *_flags(EVERY_VERIFY_OPTION), "--rtol", "0.001"]) == 0
    api.verify(plan, "runtime_workloads:mlp", EVERY_VERIFY_OPTION["steps"], schedule="gpipe",
               policy="B", overrides={"num_layers": 4}, rtol=0.001, **options)  # fmt: skip
    cfg = RunConfig(
        model=ModelConfig(spec="runtime_workloads:mlp", set={"num_layers": 4}),
        plan=PlanChoice(path=str(plan), schedule="gpipe", policy="B"),
        train=TrainConfig(**EVERY_VERIFY_OPTION),
    )
    api.verify(cfg, rtol=0.001)
    cli, from_api, from_config = calls
    assert cli == from_api == from_config
    assert cli["plan"].schedule == "gpipe" and cli["plan"].policy == "B"
    for k, v in EVERY_VERIFY_OPTION.items():  # each reached the runtime
        assert getattr(cli["config"], k) == v, k
    with pytest.raises(
        ValidationError, match="verify\\(cfg\\) takes the run's options from cfg, got also lr"
    ):
        api.verify(cfg, lr=0.5)


def test_verify_runs_with_the_verify_fields_only() -> None:
    """A run's checkpoint, metrics, evaluation and re-computation options stay out of both runs
    of verify; every field verify forwards reaches them."""
    from dapple.api.run_config import resolve_verify_config

    others = {"checkpoint_dir": "ck", "save_every": 2, "metrics_path": "m.jsonl",
              "eval_every": 1, "recompute": "full", "echo": True}  # fmt: skip
    got = resolve_verify_config(TrainConfig(**EVERY_VERIFY_OPTION, **others))
    assert got == TrainConfig(**EVERY_VERIFY_OPTION)


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (
            ["--schedule", "interleaved", "--virtual-stages", "0"],
            "--virtual-stages must be >= 1, got 0",
        ),
        (
            ["--virtual-stages", "2"],
            "--virtual-stages 2 needs --schedule interleaved, zbv or dualpipev",
        ),
    ],
)
def test_train_and_verify_refuse_a_run_value_in_the_same_words(
    extra: list[str], line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.json"
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(plan)
    for command in ("train", "verify"):
        assert main([command, "--plan", str(plan), "-m", "runtime_workloads:mlp", *extra]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"dapple: error: {line}"], command

"""One CLI vocabulary: ``-o/--output`` is a file, ``--out-dir`` a directory, ``-m/--model``,
``--device`` defaulting to ``auto``, the flags ``train`` and ``verify`` share, and ``paper:NAME``
profiles wherever a profile is taken (CLI and API)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapple import api
from dapple.cli import build_parser, main
from dapple.cli._run_args import add_run_arguments
from dapple.cli._train_flags import run_config_of, verify_config_of
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan, straight_plan
from dapple.errors import ValidationError
from dapple.profiler.paper_models import PAPER_MODELS, load_paper_profile, load_profile
from dapple.runtime.train_config import OPTIMIZERS
from dapple.simulate import simulate

COMMANDS = {
    "profile",
    "import-pipedream",
    "plan",
    "simulate",
    "train",
    "verify",
    "split",
    "calibrate",
    "plan-local",
    "demo",
    "export",
    "generate",
    "data",
}
UNKNOWN_PAPER = "dapple: error: unknown paper profile 'paper:bert4'; known: " + ", ".join(
    f"paper:{n}" for n in PAPER_MODELS
)


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every optional argument of ``p`` (but ``-h``) by its longest option string."""
    return {
        max(a.option_strings, key=len): a
        for a in p._actions
        if a.option_strings and a.dest != "help"
    }


def test_every_command_is_surveyed() -> None:
    assert set(_commands()) == COMMANDS


def test_o_is_always_output_a_file_and_directories_are_out_dir() -> None:
    with_output = {}
    with_out_dir = set()
    for name, p in _commands().items():
        opts = _options(p)
        assert "--out" not in opts, name
        for a in opts.values():
            if "-o" in a.option_strings:
                assert a.option_strings == ["-o", "--output"], (name, a.option_strings)
        if "--output" in opts:
            with_output[name] = opts["--output"].option_strings
        if "--out-dir" in opts:
            assert opts["--out-dir"].option_strings == ["--out-dir"], name
            with_out_dir.add(name)
    assert set(with_output) == {"profile", "import-pipedream", "plan", "calibrate"}
    assert with_out_dir == {"plan-local", "demo", "export"}
    ns = build_parser().parse_args(
        ["plan-local", "-m", "mlp", "--global-batch-size", "8", "--out-dir", "out/x"]
    )
    assert ns.out_dir == "out/x"
    assert build_parser().parse_args(["demo", "--out-dir", "d"]).out_dir == "d"


def test_plan_local_rejects_o_for_its_directory(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["plan-local", "-m", "mlp", "--global-batch-size", "8", "--out-dir", "d", "-o", "x"])
    assert e.value.code == 2
    assert "unrecognized arguments: -o x" in capsys.readouterr().err


def test_model_is_m_model_on_every_command_taking_a_model() -> None:
    with_model = set()
    for name, p in _commands().items():
        opts = _options(p)
        if "--model" in opts:
            assert opts["--model"].option_strings == ["-m", "--model"], name
            assert opts["--model"].help, name
            with_model.add(name)
    assert with_model == {
        "profile", "train", "verify", "split", "plan-local", "demo", "export", "generate"
    }  # fmt: skip
    ns = build_parser().parse_args(["train", "--plan", "p.json", "-m", "mlp"])
    assert ns.model == "mlp"
    assert build_parser().parse_args(["demo"]).model == "transformer"


@pytest.mark.parametrize(
    "argv",
    [
        ["profile", "-m", "mlp", "-o", "p.json"],
        ["train", "--plan", "p.json", "-m", "mlp"],
        ["verify", "--plan", "p.json", "-m", "mlp"],
    ],
)
def test_device_defaults_to_auto(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).device == "auto"


def test_device_flag_exists_only_where_parsed_above() -> None:
    assert {n for n, p in _commands().items() if "--device" in _options(p)} == {
        "profile",
        "train",
        "verify",
    }


def test_api_device_defaults_are_auto() -> None:
    for fn in (api.profile, api.verify, api.verify_many):
        assert inspect.signature(fn).parameters["device"].default == "auto", fn.__name__


def test_auto_device_resolves_to_cuda_when_available_else_cpu() -> None:
    from dapple.profiler.measure import resolve_device

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    with pytest.raises(ValidationError, match="use auto, cpu or cuda"):
        resolve_device("tpu")


def test_train_and_verify_share_one_flag_set_with_help() -> None:
    ref = argparse.ArgumentParser()
    add_run_arguments(ref, steps=1)
    shared = _options(ref)
    assert set(shared) == {
        "--plan",
        "--model",
        "--set",
        "--split-at",
        "--weights",
        "--dynamic-dims",
        "--steps",
        "--seed",
        "--optimizer",
        "--lr",
        "--schedule",
        "--virtual-stages",
        "--policy",
        "--device",
        "--timeout-s",
        "--data",
        "--seq-len",
        "--pack",
        "--pad",
        "--precision",
        # optimisation (dapple.cli._optim_args)
        "--weight-decay",
        "--momentum",
        "--betas",
        "--eps",
        "--lr-schedule",
        "--warmup-steps",
        "--min-lr",
        "--clip-grad-norm",
        "--zero-stage",
    }
    cmds = _commands()
    for name in ("train", "verify"):
        opts = _options(cmds[name])
        for flag, a in shared.items():
            b = opts[flag]
            assert b.option_strings == a.option_strings, (name, flag)
            assert b.help == a.help and b.help, (name, flag)
            assert (b.type, b.required, b.metavar) == (a.type, a.required, a.metavar), (name, flag)
            assert list(b.choices or ()) == list(a.choices or ()), (name, flag)
            if flag != "--steps":
                assert b.default == a.default, (name, flag)
        for flag, b in opts.items():
            assert b.help, (name, flag)
    assert _options(cmds["train"])["--steps"].default == 1
    assert _options(cmds["verify"])["--steps"].default == 2


def test_optimizer_choices_are_the_runtimes(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("train", "verify"):
        assert tuple(_options(_commands()[name])["--optimizer"].choices) == OPTIMIZERS
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    assert ", ".join(OPTIMIZERS) in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as e:
        main(["verify", "--plan", "p.json", "-m", "mlp", "--optimizer", "rmsprop"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'rmsprop' (choose from 'sgd', 'adam', 'adamw')" in err


def test_building_the_parser_does_not_import_torch() -> None:
    code = "import sys; from dapple.cli import build_parser; build_parser(); sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# paper:NAME profiles


def test_load_profile_reads_files_and_paper_names(tmp_path: Path) -> None:
    prof = load_paper_profile("vgg19")
    prof.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == prof
    assert load_profile(str(tmp_path / "p.json")) == prof
    assert load_profile("paper:vgg19") == prof
    with pytest.raises(ValidationError) as e:
        load_profile("paper:bert4")
    assert f"dapple: error: {e.value}" == UNKNOWN_PAPER


def test_plan_and_simulate_accept_paper_profiles(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    args = ["--profile", "paper:resnet50", "--cluster", "paper-b"]
    assert main(["plan", *args, "-o", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.global_batch_size == 2048  # the paper's GBS for ResNet-50
    capsys.readouterr()
    assert main(["simulate", "--plan", str(out), *args]) == 0
    expected = simulate(plan, load_paper_profile("resnet50"), load_cluster("paper-b")).step_ms
    assert f"step time {expected:.3f} ms" in capsys.readouterr().out
    assert (
        main(["simulate", "--plan", str(out), "--profile", "paper:bert4", "--cluster", "paper-b"])
        == 2
    )
    assert capsys.readouterr().err.strip() == UNKNOWN_PAPER


def test_api_accepts_paper_profiles() -> None:
    prof = load_paper_profile("resnet50")
    plan = api.plan("paper:resnet50", "paper-b", 256)
    assert plan == api.plan(prof, "paper-b", 256)
    r = api.simulate(plan, "paper:resnet50", "paper-b")
    assert r.step_ms == api.simulate(plan, prof, "paper-b").step_ms
    with pytest.raises(ValidationError, match=r"unknown paper profile 'paper:bert4'; known: "):
        api.simulate(plan, "paper:bert4", "paper-b")


def test_train_rejects_an_unknown_paper_profile_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    straight_plan(4, [0], global_batch_size=4, num_micro_batches=1).save(tmp_path / "p.json")
    argv = ["train", "--plan", str(tmp_path / "p.json"), "-m", "mlp", "--set", "layers=3"]
    assert main([*argv, "--profile", "paper:bert4", "--cluster", "paper-b"]) == 2
    assert capsys.readouterr().err.strip() == UNKNOWN_PAPER


@pytest.mark.slow
def test_train_predicts_with_a_paper_profile(tmp_path: Path) -> None:
    # resnet50's paper profile has 18 layers; mlp(layers=17) too (17 hidden + classifier)
    plan = straight_plan(18, [0, 9], global_batch_size=4, num_micro_batches=2)
    plan.save(tmp_path / "p.json")
    metrics = tmp_path / "m.jsonl"
    argv = ["train", "--plan", str(tmp_path / "p.json"), "-m", "mlp", "--set", "layers=17"]
    argv += ["--profile", "paper:resnet50", "--cluster", "paper-b", "--device", "cpu"]
    assert main([*argv, "--metrics", str(metrics), "--timeout-s", "60"]) == 0
    expected = simulate(plan, load_paper_profile("resnet50"), load_cluster("paper-b")).step_ms
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["predicted_step_ms"] for r in rows] == [pytest.approx(expected)]


def _run_plan(argv: list[str]) -> Plan:
    """The plan ``dapple train`` or ``dapple verify`` runs for ``argv``: flags -> its
    ``RunConfig`` -> the inputs the API loads."""
    args = build_parser().parse_args(argv)
    cfg = run_config_of(args) if argv[0] == "train" else verify_config_of(args)
    return api.run_inputs(cfg, cli=True).plan


@pytest.mark.parametrize("command", ["train", "verify"])
def test_schedule_and_policy_override_the_plan(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    assert (plan.schedule, plan.policy) == ("dapple", "A")
    plan.save(tmp_path / "p.json")
    argv = [command, "--plan", str(tmp_path / "p.json"), "-m", "mlp"]
    assert _run_plan(argv) == plan
    got = _run_plan([*argv, "--schedule", "gpipe"])
    assert got == dataclasses.replace(plan, schedule="gpipe")
    got = _run_plan([*argv, "--policy", "B"])
    assert got == dataclasses.replace(plan, policy="B")
    with pytest.raises(SystemExit) as e:
        main([*argv, "--schedule", "1f1b"])
    assert e.value.code == 2
    assert "invalid choice: '1f1b'" in capsys.readouterr().err


def test_seq_len_and_compare_have_one_meaning_in_every_command() -> None:
    """``--seq-len`` is tokens per sample wherever it is taken (``demo``'s tokens are bytes);
    ``plan``'s mean length is ``--mean-seq-len`` (its old ``--seq-len`` is hidden and refused);
    ``--compare`` is ``plan``'s alone (every planner side by side): ``simulate``'s old
    ``--compare`` is hidden and refused (``--other-schedule``)."""
    commands = {name: _options(p) for name, p in _commands().items()}
    seq = {
        name: opts["--seq-len"]
        for name, opts in commands.items()
        if "--seq-len" in opts and opts["--seq-len"].help != argparse.SUPPRESS
    }
    assert set(seq) == {"train", "verify", "demo"}
    for name, action in seq.items():
        assert (action.help or "").startswith("tokens per sample"), (name, action.help)
    assert commands["plan"]["--seq-len"].help == argparse.SUPPRESS
    assert (commands["plan"]["--mean-seq-len"].help or "").startswith("mean tokens per sample")
    assert {n for n, opts in commands.items() if "--mean-seq-len" in opts} == {"plan"}
    compare = {
        name
        for name, opts in commands.items()
        if "--compare" in opts and opts["--compare"].help != argparse.SUPPRESS
    }
    assert compare == {"plan"}
    assert "--other-schedule" in commands["simulate"]


@pytest.mark.parametrize("value", ["128", "300,1024"])
def test_plan_refuses_the_old_seq_len_naming_mean_seq_len(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--profile", "missing.json", "--cluster", "paper-a", "--seq-len", value]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "dapple: error: --seq-len is spelled --mean-seq-len now (same meaning)\n"


def test_nproc_is_one_count_and_plan_locals_candidates_are_nprocs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--nproc N`` is one number of local processes (``calibrate``, ``demo``);
    ``plan-local``'s candidate counts are ``--nprocs``, as ``api.plan_local(nprocs=)`` names
    them, and its old ``--nproc`` is refused naming it."""
    commands = {name: _options(p) for name, p in _commands().items()}
    shown = {
        name
        for name, opts in commands.items()
        if "--nproc" in opts and opts["--nproc"].help != argparse.SUPPRESS
    }
    assert shown == {"calibrate", "demo"}
    assert all(commands[n]["--nproc"].type is int for n in shown)
    assert {n for n, opts in commands.items() if "--nprocs" in opts} == {"plan-local"}
    assert "nprocs" in inspect.signature(api.plan_local).parameters
    argv = ["plan-local", "-m", "mlp", "--global-batch-size", "8", "--out-dir", "d"]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--nproc", "2,4"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "dapple: error: --nproc is spelled --nprocs now (same meaning)\n"
    )


def test_plan_local_flags_are_api_plan_local_keywords(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option of ``dapple plan-local`` but the model's and its output directory is a
    keyword of ``api.plan_local`` of the same name, and reaches the search."""
    opts = _options(_commands()["plan-local"])
    model = {"--model", "--set", "--split-at", "--weights", "--dynamic-dims"}
    shown = {f for f, a in opts.items() if a.help != argparse.SUPPRESS} - model - {"--out-dir"}
    params = inspect.signature(api.plan_local).parameters
    assert {f[2:].replace("-", "_") for f in shown} <= set(params), shown
    seen: dict[str, object] = {}

    def fake(wl: object, gbs: int, nprocs: object, **kw: object) -> object:
        seen.update(kw, nprocs=nprocs)
        raise ValidationError("stop")

    monkeypatch.setattr("dapple.calibrate.local.plan_local", fake)
    with pytest.raises(ValidationError, match="stop"):
        api.plan_local("mlp", 8, (2, 3), repeats=2, precision="bf16")
    assert seen == {"nprocs": (2, 3), "repeats": 2, "precision": "bf16"}

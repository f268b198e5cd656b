"""Issue 47 (re-run F, 2026-11-29): what was still open after the battery of 591 cases - a
``--checkpoint-dir`` without ``--save-every`` that saved nothing, wording that named the wrong
rule (``--temperature inf``: ">= 0"; a checkpoint path that does not exist: "no complete
checkpoint"), ``demo --corpus-mib 1e12`` taken as the 4 MiB the machine holds, a profile without
a fingerprint warned of in train in another form than simulate's, and ``--min-devices 2``
refused naming fields instead of flags - and the fixes of the mini-battery over the day's new
features (``benchmarks/battery_47f.md``)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from builders import one_error_line, plan_file
from dapple.cli import LogLines, build_parser, main
from dapple.core.plan import Plan, straight_plan

MODEL = ["-m", "transformer", "--set", "layers=2", "--set", "hidden=32"]
"""A zoo transformer of 4 layers (embedding, 2 blocks, head), small enough to build at once."""


# -- 1. --checkpoint-dir without --save-every: one checkpoint, after the last step --------------
def _save_every(argv: list[str]) -> int:
    from dapple.cli._train_flags import run_config_of

    return run_config_of(build_parser().parse_args(argv)).train.save_every


@pytest.mark.parametrize(
    ("extra", "file", "want"),
    [
        ([], None, 7),  # saved nothing: now the last step (7)
        (["--save-every", "3"], None, 3),
        (["--save-every", "0"], None, 0),  # 0 still says never
        ([], "[checkpoint]\nsave_every = 0\n", 0),  # so does the file's
        ([], "[checkpoint]\nsave_every = 2\n", 2),
        ([], "[train]\nsteps = 7\n", 7),
    ],
)
def test_a_checkpoint_dir_without_save_every_saves_after_the_last_step(
    tmp_path: Path, extra: list[str], file: str | None, want: int
) -> None:
    argv = ["train", "--plan", plan_file(tmp_path), *MODEL, "--steps", "7",
            "--checkpoint-dir", str(tmp_path / "ck"), *extra]  # fmt: skip
    if file is not None:
        cfg = tmp_path / "run.toml"
        cfg.write_text(file)
        argv += ["--config", str(cfg)]
    assert _save_every(argv) == want


def test_a_checkpoint_dir_from_the_file_saves_after_the_last_step(tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[checkpoint]\ncheckpoint_dir = "{tmp_path / "ck"}"\n')
    argv = ["train", "--plan", plan_file(tmp_path), *MODEL, "--steps", "5", "--config", str(cfg)]
    assert _save_every(argv) == 5
    assert _save_every(["train", "--plan", plan_file(tmp_path), *MODEL, "--steps", "5"]) == 0


def test_train_says_where_and_when_its_one_checkpoint_is_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("dapple.cli.train_cmd.run_config", lambda cfg: 0)
    ck = tmp_path / "ck"
    argv = [
        "train",
        "--plan",
        plan_file(tmp_path),
        *MODEL,
        "--steps",
        "4",
        "--checkpoint-dir",
        str(ck),
    ]
    assert main(argv) == 0
    assert capsys.readouterr().out == (
        f"checkpoints: one, after the last step (step 4), in {ck} (--save-every N also saves "
        "every N steps)\n"
    )
    assert main([*argv, "--save-every", "2"]) == 0
    assert capsys.readouterr().out == ""


def test_train_help_says_a_checkpoint_dir_saves_after_the_last_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "save checkpoints here (per layer): after the run's last step" in text
    assert "(not given: at the last step only; 0: never)" in text


@pytest.mark.slow
def test_train_with_a_checkpoint_dir_alone_leaves_its_last_step(tmp_path: Path) -> None:
    """The run a user starts: 2 steps with ``--checkpoint-dir`` and nothing else used to leave
    no checkpoint at all."""
    from dapple.runtime.checkpoint import list_checkpoints

    ck = tmp_path / "ck"
    argv = [sys.executable, "-m", "dapple", "train", "--plan", plan_file(tmp_path), *MODEL,
            "--steps", "2", "--device", "cpu", "--checkpoint-dir", str(ck)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in list_checkpoints(ck)] == ["step-00000002"]
    assert f"checkpoint saved: step 2 (steps 0-1 done) in {ck / 'step-00000002'}" in proc.stdout


# -- 2. wording: the rule a value breaks, a path that is not there ------------------------------
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "-1"])
def test_generate_temperature_names_the_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """``inf`` was refused as "must be >= 0"."""
    argv = ["generate", "--checkpoint-dir", str(tmp_path), *MODEL, "--prompt", "x",
            f"--temperature={value}"]  # fmt: skip
    assert main(argv) == 2
    one_error_line(capsys, f"temperature must be finite and >= 0 (0: greedy), got {value}")


@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_checkpoint_path_that_is_not_there_is_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """It said "no complete checkpoint under" a path that does not exist."""
    rest = ["--prompt", "x"] if command == "generate" else ["--out-dir", str(tmp_path / "o")]
    missing, afile, empty = tmp_path / "none", tmp_path / "f.txt", tmp_path / "empty"
    afile.write_text("x")
    empty.mkdir()
    for where, needle in ((missing, "no such directory"),
                          (afile, "it is a file, not a checkpoint directory"),
                          (empty, "no complete checkpoint under")):  # fmt: skip
        assert main([command, "--checkpoint-dir", str(where), *MODEL, *rest]) == 2
        one_error_line(capsys, repr(str(where)), needle)


def test_an_old_spelling_says_the_new_one_means_the_same(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--plan", "p", "--profile", "q", "--cluster", "c", "--compare"])
    err = capsys.readouterr().err
    assert err == "dapple: error: --compare is spelled --other-schedule now (same meaning)\n"


# -- 3. demo --corpus-mib above what the machine holds ------------------------------------------
@pytest.mark.parametrize("mib", ["1e12", "1000"])
def test_demo_refuses_a_corpus_larger_than_the_standard_library(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mib: str
) -> None:
    """It was cut to the ~4.5 MiB of sources there, unsaid."""
    from dapple.cli._demo_corpus import stdlib_files

    root, files = stdlib_files()
    out = tmp_path / "d"
    assert main(["demo", "--corpus-mib", mib, "--out-dir", str(out)]) == 2
    held = sum(p.stat().st_size for p in files) / 2**20
    one_error_line(capsys, f"--corpus-mib {float(mib):g} is more than", f"{held:.2f} MiB in "
                   f"{len(files)} files under {root}; give at most")  # fmt: skip
    assert not out.exists()


# -- 5. a profile without a fingerprint: train warns as simulate does ---------------------------
def test_a_logged_warning_reads_as_the_commands_own() -> None:
    record = logging.LogRecord("dapple.x", logging.WARNING, __file__, 1, "a %s", ("b",), None)
    assert LogLines().format(record) == "dapple: warning: a b"
    debug = logging.LogRecord("dapple.x", logging.DEBUG, __file__, 1, "c", (), None)
    assert LogLines().format(debug) == "DEBUG dapple.x: c"


def test_train_and_simulate_both_warn_of_a_profile_without_fingerprint(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    standalone: None,
) -> None:
    """Train's warning was ``WARNING dapple.models.fingerprint: ...``, simulate's a
    ``dapple: warning:`` line; both are now that line, naming the profile's model."""
    from builders import make_profile

    prof = tmp_path / "p.json"
    make_profile(4, name="other").save(prof)  # imported-like: no fingerprint
    monkeypatch.setattr("dapple.cli.train_cmd._early_workers",
                        lambda *_: contextlib.nullcontext())  # fmt: skip
    launched: list[Any] = []
    monkeypatch.setattr("dapple.api.running._launch", lambda *a: launched.append(a) or [])
    plan = plan_file(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--plan", plan, *MODEL, "--device", "cpu", "--profile", str(prof),
                     "--cluster", "local-cpu"]) == 0  # fmt: skip
    assert len(launched) == 1
    train = [LogLines().format(r) for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(train) == 1 and train[0].startswith("dapple: warning: "), train
    assert "profiled as 'other'" in train[0] and "may be another model's" in train[0]
    capsys.readouterr()
    named = tmp_path / "named.json"  # a plan of 'transformer', as dapple plan writes one
    dataclasses.replace(Plan.load(plan), model_name="transformer").save(named)
    argv = ["simulate", "--plan", str(named), "--profile", str(prof), "--cluster", "local-cpu"]
    assert main(argv) == 0
    sim = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dapple: warning: ")]
    assert len(sim) == 1 and "profiled as 'other'" in sim[0], sim


# -- 6. an elastic flag without --elastic: named as the flag, whatever its value ----------------
@pytest.mark.parametrize(
    "flags", [["--min-devices", "1"], ["--min-devices", "2"], ["--max-restarts", "0"]]
)
def test_an_elastic_flag_without_elastic_names_the_flag_and_elastic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], standalone: None, flags: list[str]
) -> None:
    """``--min-devices 2`` said "min_devices (2) and max_restarts (3) apply to elastic runs
    only: add elastic (--elastic)": the fields, and a flag never given."""
    assert main(["train", "--plan", plan_file(tmp_path), *MODEL, *flags]) == 2
    one_error_line(capsys, f"{' '.join(flags)} applies to elastic runs only", "add --elastic")


def test_an_elastic_flag_passes_when_the_file_makes_the_run_elastic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'[elastic]\nelastic = true\n[report]\nprofile = "p.json"\ncluster = "local-cpu"\n'
        f'[checkpoint]\ncheckpoint_dir = "{tmp_path / "ck"}"\nsave_every = 1\n'
    )
    argv = [
        "train",
        "--config",
        str(cfg),
        "--plan",
        plan_file(tmp_path),
        *MODEL,
        "--min-devices",
        "2",
    ]
    assert main([*argv, "--print-config"]) == 0
    assert "min_devices = 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags", [["--save-every", "5"], ["--save-every", "0"], ["--resume"], ["--require-resume"]]
)
def test_a_checkpoint_flag_without_a_checkpoint_dir_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], standalone: None, flags: list[str]
) -> None:
    """``--save-every 5`` said "save_every and resume need a checkpoint_dir" (``--resume``,
    never given, named beside it); ``--save-every 0`` was taken without a word."""
    assert main(["train", "--plan", plan_file(tmp_path), *MODEL, *flags]) == 2
    one_error_line(capsys, f"{' '.join(flags)} applies to checkpoints only",
                   "add --checkpoint-dir DIR, or drop it")  # fmt: skip


# -- 7. the mini-battery: an expert width under a chunked schedule ------------------------------
def _moe_profile(dense: tuple[int, ...] = ()) -> Any:
    """embedding, four blocks (MoE of 8 experts but the blocks ``dense``), head; 1 ms per
    sample each."""
    from dapple.core.layer_profile import AffineTime, LayerProfile
    from dapple.core.moe_profile import MoEProfile
    from dapple.core.profile import ModelProfile

    t = AffineTime(fixed_ms=0.0, per_sample_ms=1.0)
    moe = MoEProfile(experts=8, top_k=2, expert_parameter_bytes=8000,
                     tokens_per_expert_per_sample=4.0, dispatch_bytes_per_sample=1e6,
                     combine_bytes_per_sample=1e6)  # fmt: skip

    def layer(name: str, m: MoEProfile | None) -> LayerProfile:
        return LayerProfile(name=name, forward=t, backward=t, output_bytes_per_sample=100.0,
                            parameter_bytes=10000, kept_activation_bytes_per_sample=100.0,
                            moe=m)  # fmt: skip

    blocks = [layer(f"block{i}", None if i in dense else moe) for i in range(4)]
    return ModelProfile(model_name="m", layers=(layer("embedding", None), *blocks,
                                                layer("head", None)))  # fmt: skip


def _expert_plan() -> Plan:
    """Two device groups of 2 replicas, [0, 3) of expert width 2 and [3, 6)."""
    p = straight_plan(6, [0, 3], global_batch_size=8, num_micro_batches=4, replicas=[2, 2])
    first = dataclasses.replace(p.stages[0], expert_width=2)
    return dataclasses.replace(p, model_name="m", stages=(first, p.stages[1]))


@pytest.mark.parametrize(("schedule", "v"), [("zbv", 1), ("dualpipev", 1), ("interleaved", 3)])
def test_an_expert_width_runs_under_a_chunked_schedule(schedule: str, v: int) -> None:
    """Each chunk carries its group's e_s: the V put group 0's expert width on its second chunk,
    the head [5, 6), and simulate refused the plan ("no mixture-of-experts layer there")."""
    from dapple import api
    from dapple.core.plan_checks import check_expert_widths
    from dapple.simulate.plan_variants import with_schedule

    prof = _moe_profile()
    chunked = with_schedule(_expert_plan(), schedule, v)
    dense = [st.layers for st in chunked.stages if st.expert_width == 2
             and all(x.moe is None for x in prof.layers[st.layers[0] : st.layers[1]])]  # fmt: skip
    assert dense == ([(5, 6)] if v == 1 else [(0, 1)])  # a dense chunk of the expert group
    check_expert_widths(chunked, prof, "p")
    plain = api.simulate(_expert_plan(), prof, "local-cpu")
    under = api.simulate(_expert_plan(), prof, "local-cpu", schedule=schedule, virtual_stages=v)
    assert 0 < under.step_ms < 2 * plain.step_ms


@pytest.mark.parametrize(
    ("schedule", "v", "dense"),
    [(None, 1, (0, 1)), ("zbv", 1, (0, 1)), ("interleaved", 3, (1, 3))],
)
def test_an_expert_group_without_moe_layers_stays_refused(
    schedule: str | None, v: int, dense: tuple[int, ...]
) -> None:
    """Group 0 (unchunked [0, 3); under the V [0, 2) and [5, 6); interleaved [0, 1), [2, 3),
    [4, 5)) holds no MoE layer in any chunk when these blocks are dense."""
    from dapple.core.plan_checks import check_expert_widths
    from dapple.errors import ValidationError
    from dapple.simulate.plan_variants import with_schedule

    plan = _expert_plan() if schedule is None else with_schedule(_expert_plan(), schedule, v)
    with pytest.raises(ValidationError, match=r"plan stage 0 \[0, \d\): expert_width 2, but p "
                       "has no mixture-of-experts layer there"):  # fmt: skip
        check_expert_widths(plan, _moe_profile(dense), "p")


# -- 7. the mini-battery: the timing counts of a profile ----------------------------------------
@pytest.mark.parametrize("flag", ["--repeats=0", "--repeats=-1", "--warmup=-1", "--threads=0",
                                  "--threads=-1", "--repeats=9"])  # fmt: skip
def test_analytic_profile_refuses_the_timing_counts_of_a_measured_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """Each was taken without a word (exit 0) and did nothing: --analytic times no layer."""
    out = tmp_path / "p.json"
    argv = ["profile", "--analytic", "h100", "-m", "llama3-8b", flag, "-o", str(out)]
    assert main(argv) == 2
    name, value = flag.split("=")
    one_error_line(capsys, f"{name} {value} applies to measured profiles only", "--analytic")
    assert not out.exists()


@pytest.mark.parametrize(("flags", "got"), [(["--repeats=0"], "0 and 2"),
                                            (["--warmup=-1"], "5 and -1"),
                                            (["--repeats=1000000000000"], "1000000000000 and 2"),
                                            (["--warmup=1001"], "5 and 1001")])  # fmt: skip
def test_a_measured_profile_refuses_bad_counts_before_building_the_model(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    got: str,
) -> None:
    """It said "need repeats >= 1 and warmup >= 0" once the model was built; 10^12 repeats
    ran without end."""
    from builders import boom

    monkeypatch.setattr("dapple.models.zoo.load_workload", boom)
    assert main(["profile", "-m", "mlp", "--device", "cpu", *flags, "-o",
                 str(tmp_path / "p.json")]) == 2  # fmt: skip
    one_error_line(capsys, "--repeats must be from 1 to 1000 (timed runs per layer) and "
                   f"--warmup from 0 to 1000, got {got}")  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "got"),
    [
        ([], "--checkpoint-dir (none), --save-every (none)"),
        (["--checkpoint-dir", "ck"], "--checkpoint-dir ck, --save-every (none)"),
        (["--checkpoint-dir", "ck", "--save-every", "0"], "--checkpoint-dir ck, --save-every 0"),
    ],
)
def test_an_elastic_run_without_periodic_checkpoints_names_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], got: str
) -> None:
    """It said "give it checkpoint_dir and save_every (got checkpoint_dir='ck', save_every=0)":
    the fields, and a save_every of 0 the user never gave."""
    elastic = ["--elastic", "--profile", "p.json", "--cluster", "local-cpu"]
    assert main(["train", "--plan", plan_file(tmp_path), *MODEL, *elastic, *flags]) == 2
    one_error_line(capsys, "--elastic goes on from the newest checkpoint when a device is lost: "
                   f"give --checkpoint-dir DIR and --save-every N (N >= 1; got {got})")  # fmt: skip


def test_profile_help_says_the_timing_counts_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "timed runs per layer, median kept (1 to 1000; default 5; not with --analytic)" in text
    assert "untimed runs per layer (0 to 1000; default 2; not with --analytic)" in text


@pytest.mark.parametrize("servers", ["0", "-1"])
def test_simulate_refuses_servers_below_one_before_reading_the_plan(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    servers: str,
) -> None:
    """It was refused once the plan and profile were read (as much CPU as a whole simulate)."""
    from builders import boom

    monkeypatch.setattr("dapple.core.plan.Plan.load", boom)
    argv = ["simulate", "--plan", plan_file(tmp_path), "--profile", "paper:bert48", "--cluster",
            "paper-a", f"--servers={servers}"]  # fmt: skip
    assert main(argv) == 2
    one_error_line(capsys, f"--servers must be >= 1, got {servers}")

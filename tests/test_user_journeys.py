"""What a user meets going through the README (issue 47, items 6 and 9).

- A profile records its model's fingerprint: ``train --profile``, ``simulate`` and
  :func:`dapple.api.simulate` refuse a profile of another model with the same name and layer
  count, in one line, before any compute; profiles without one (older, analytic, the paper's)
  still load and are not checked.
- ``export -m`` of a zoo model (a layer chain, not a traced module) writes its tensors.
- A run with ``--save-every`` also saves its last step; the commands that load a checkpoint
  say which step.
- ``verify`` says which run is going as it goes; its report prints as a short summary.
- ``profile --config run.toml`` reads the ``[model]`` section ``train --config`` reads.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

import dapple.simulate  # noqa: F401  (the package, patched below)
import runtime_workloads as rw
from dapple import api
from dapple.cli import main
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.fingerprint import check_profile_model, layer_tensors, model_fingerprint
from dapple.profiler.paper_models import load_profile
from dapple.runtime import TrainConfig, free_port
from dapple.runtime.checkpoint import list_checkpoints, step_dir
from dapple.runtime.verify.report import StageDiff, VerifyReport

TINY = {"layers": 2, "hidden": 16, "heads": 2, "seq": 8, "vocab": 32}
"""A zoo transformer small enough to profile, train and export in seconds (4 layers)."""


def _sets(**over: Any) -> list[str]:
    out: list[str] = []
    for k, v in {**TINY, **over}.items():
        out += ["--set", f"{k}={v}"]
    return out


def _one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dapple: error: "), lines
    assert "Traceback" not in err
    return lines[0]


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process is rank 0 of a world of 1 (``dapple.runtime.train`` runs in-process)."""
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():  # fmt: skip
        monkeypatch.setenv(k, v)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every ``dapple.runtime.train`` call (none starts a process or computes)."""
    calls: list[dict[str, Any]] = []

    def fake_train(plan: Any, workload: Any, config: TrainConfig, **kw: Any) -> list[Any]:
        calls.append({**dataclasses.asdict(config), **kw})
        return []

    monkeypatch.setattr("dapple.runtime.train", fake_train)
    return calls


# -- A: a profile's model fingerprint ----------------------------------------------------------
@pytest.fixture(scope="module")
def profiles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two measured profiles of the zoo transformer, same name and layer count, two widths,
    and a plan made from the first."""
    d = tmp_path_factory.mktemp("fingerprints")
    for name, hidden in (("narrow", 16), ("wide", 32)):
        argv = ["profile", "-m", "transformer", *_sets(hidden=hidden), "--batch-sizes", "1,2",
                "--repeats", "1", "--warmup", "0", "--device", "cpu", "-o", str(d / f"{name}.json")]  # fmt: skip
        assert main(argv) == 0
    argv = ["plan", "--profile", str(d / "narrow.json"), "--cluster", "local-cpu",
            "--servers", "1", "--global-batch-size", "2", "-o", str(d / "plan.json")]  # fmt: skip
    assert main(argv) == 0
    return d


def test_a_profile_records_its_models_fingerprint_and_the_plan_keeps_it(profiles: Path) -> None:
    narrow = ModelProfile.load(profiles / "narrow.json")
    wide = ModelProfile.load(profiles / "wide.json")
    assert narrow.model_name == wide.model_name and narrow.num_layers == wide.num_layers
    assert narrow.model_fingerprint == model_fingerprint(api.load("transformer", **TINY))
    assert narrow.model_fingerprint is not None and wide.model_fingerprint is not None
    assert narrow.model_fingerprint != wide.model_fingerprint
    assert Plan.load(profiles / "plan.json").model_fingerprint == narrow.model_fingerprint
    raw = json.loads((profiles / "narrow.json").read_text())
    assert isinstance(raw["model_fingerprint"], str)
    assert ModelProfile.from_dict(raw) == narrow  # the field round-trips


def test_the_fingerprint_follows_names_shapes_dtypes_and_layer_count() -> None:
    base = model_fingerprint(rw.mlp())
    assert base is not None and base == model_fingerprint(rw.mlp())  # deterministic
    wl = api.load("transformer", **TINY)
    first = layer_tensors(wl, 0)
    assert first is not None and first["pos"] == ([TINY["seq"], TINY["hidden"]], "float32")
    others = [api.load("transformer", **{**TINY, k: v})
              for k, v in (("hidden", 32), ("layers", 3), ("seq", 16), ("vocab", 64))]  # fmt: skip
    prints = {model_fingerprint(w) for w in [wl, *others]}
    assert len(prints) == 5


def test_simulate_refuses_a_profile_of_another_model_before_simulating(
    profiles: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[Any] = []
    sim = sys.modules["dapple.simulate"]  # the package (``dapple.simulate`` is also a function)
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: ran.append(a))
    argv = ["simulate", "--plan", str(profiles / "plan.json"), "--cluster", "local-cpu",
            "--servers", "1", "--profile"]  # fmt: skip
    capsys.readouterr()
    assert main([*argv, str(profiles / "wide.json")]) == 2
    line = _one_error(capsys.readouterr().err)
    wide = ModelProfile.load(profiles / "wide.json")
    plan = Plan.load(profiles / "plan.json")
    assert "wide.json" in line and "another model than the plan was made for" in line
    assert str(wide.model_fingerprint) in line and str(plan.model_fingerprint) in line
    assert ran == []
    with pytest.raises(ValidationError, match="another model than the plan was made for"):
        api.simulate(plan, wide, "local-cpu")
    # the profile the plan was made from, and one that records no fingerprint: simulated
    monkeypatch.undo()
    assert main([*argv, str(profiles / "narrow.json")]) == 0
    bare = dataclasses.replace(wide, model_fingerprint=None)
    assert api.simulate(plan, bare, "local-cpu").step_ms > 0


def test_train_refuses_a_profile_of_another_model_before_launch(
    profiles: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], launches: list
) -> None:
    argv = ["train", "--plan", str(profiles / "plan.json"), "-m", "transformer", *_sets(),
            "--device", "cpu", "--cluster", "local-cpu", "--profile"]  # fmt: skip
    capsys.readouterr()
    assert main([*argv, str(profiles / "wide.json")]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "the profile" in line and "wide.json" in line and "'transformer' (4 layers)" in line
    assert "same layer count" in line and launches == []
    # its own profile goes on to the launch
    assert main([*argv, str(profiles / "narrow.json")]) == 0
    assert len(launches) == 1


def test_profiles_without_a_fingerprint_load_and_are_not_checked(tmp_path: Path) -> None:
    wl = api.load("transformer", **TINY)
    paper = load_profile("paper:bert48")
    assert paper.model_fingerprint is None
    older = dataclasses.replace(
        ModelProfile.from_dict({**paper.to_dict(), "layers": paper.to_dict()["layers"][:4]}),
        model_name="transformer",
    )
    assert "model_fingerprint" not in older.to_dict()
    check_profile_model(older, wl, "the profile")  # same layer count, nothing recorded
    with pytest.raises(
        ValidationError, match=rf"measured on 'bert48' \({paper.num_layers} layers\), not on"
    ):
        check_profile_model(paper, wl, "the profile 'paper:bert48'")
    from dapple.profiler.analytic import analytic_profile

    analytic = analytic_profile("transformer", "h100", batch_sizes=[1], overrides=TINY)
    assert analytic.model_fingerprint is not None  # of the shapes it counted, not of tensors
    assert analytic.model_fingerprint.startswith("analytic-spec-v1:")
    check_profile_model(analytic, wl, "the profile")  # not held against the model's tensors
    with pytest.raises(ValidationError, match="model_fingerprint must be a string"):
        ModelProfile.from_dict({**older.to_dict(), "model_fingerprint": 7})


# -- B: export of a zoo model -------------------------------------------------------------------
def test_export_of_a_zoo_transformer_writes_its_layers(
    one_rank: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = api.load("transformer", **TINY)
    plan = straight_plan(wl.num_layers, [0], global_batch_size=2, num_micro_batches=1)
    ck = tmp_path / "ck"
    api.train(plan, wl, 1, checkpoint_dir=str(ck), save_every=1, device="cpu")
    capsys.readouterr()
    out = tmp_path / "out"
    argv = ["export", "-m", "transformer", *_sets(), "--checkpoint-dir", str(ck)]
    assert main([*argv, "--out-dir", str(out)]) == 0
    said = capsys.readouterr()
    assert "Traceback" not in said.err and "workload_from_module" not in said.err
    assert said.out.startswith("exported step 1: ")
    assert "not a Hugging Face model" in said.out
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    want = {f"layers.{i}.{n}" for i in range(wl.num_layers) for n in layer_tensors(wl, i) or {}}
    assert keys == want
    # another size of the same model is refused in one line, nothing written
    assert main([*argv[:3], *_sets(hidden=32), *argv[-2:], "--out-dir", str(tmp_path / "o2")]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "another model" in line and not (tmp_path / "o2").exists()


# -- C: the last steps are saved, and the step loaded is said -------------------------------
def test_a_run_saves_its_last_step_too(
    one_rank: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    plan = straight_plan(4, [0], global_batch_size=4, num_micro_batches=2)
    api.train(plan, rw.mlp(), 5, checkpoint_dir=str(ck), save_every=2, keep=0, echo=True)
    assert [p.name for p in list_checkpoints(ck)] == [step_dir(ck, s).name for s in (2, 4, 5)]
    saved = [x for x in capsys.readouterr().out.splitlines() if x.startswith("checkpoint saved")]
    assert saved[-1] == f"checkpoint saved: step 5 (steps 0-4 done) in {step_dir(ck, 5)}"
    # a multiple of save_every is saved once; save_every 0 still saves nothing
    api.train(plan, rw.mlp(), 7, checkpoint_dir=str(ck), save_every=7, keep=0, resume=True)
    assert [p.name for p in list_checkpoints(ck)][-2:] == ["step-00000005", "step-00000007"]
    none = tmp_path / "none"
    api.train(plan, rw.mlp(), 2, checkpoint_dir=str(none))
    assert list_checkpoints(none) == []
    # the resumed run says which step it loaded
    api.train(plan, rw.mlp(), 8, checkpoint_dir=str(ck), resume=True, echo=True)
    assert f"resumed: step 7 from {step_dir(ck, 7)}" in capsys.readouterr().out


def test_save_every_help_says_the_last_step_is_saved(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "at the run's last step" in " ".join(capsys.readouterr().out.split())


# -- D: verify says what it does as it goes; its report prints short --------------------------
def _report(ok: bool) -> VerifyReport:
    stage = StageDiff(stage=0, layers=(0, 4), replicas=1, num_params=10, max_abs_diff=2e-7,
                      max_rel_diff=1e-7, ok=ok, max_grad_diff=3e-6, grad_ok=True,
                      first_failure="" if ok else "step 1 weight of layer 2 fc.weight")  # fmt: skip
    return VerifyReport(
        plan=straight_plan(4, [0], global_batch_size=4, num_micro_batches=2),
        model_name="mlp", reference="original model", stages=(stage,), losses=(1.0, 0.9),
        reference_losses=(1.0, 0.9), grad_norms=(2.0, 1.5), reference_grad_norms=(2.0, 1.5),
        options={"steps": 2},
    )  # fmt: skip


@pytest.mark.parametrize("ok", [True, False])
def test_a_verify_report_prints_as_a_short_summary(ok: bool) -> None:
    rep = _report(ok)
    text = str(rep)
    lines = text.splitlines()
    assert lines[0].startswith(f"verify {'OK' if ok else 'MISMATCH'}: mlp on ")
    assert "2 steps" in lines[0] and "original model" in lines[0]
    assert "3e-06" in text and "2e-07" in text
    assert ("step 1 weight of layer 2 fc.weight" in text) is (not ok)
    assert len(lines) <= 6 and "StageDiff" not in text and "StageDiff" in repr(rep)
    one = dataclasses.replace(rep, losses=(1.0,), reference_losses=(1.0,), grad_norms=(2.0,),
                              reference_grad_norms=(2.0,))  # fmt: skip
    assert ", 1 step fp32 vs" in str(one)


@pytest.mark.slow  # two verify launches (about a minute on 2 loaded cores)
def test_verify_says_which_run_is_going_as_it_goes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.json"
    straight_plan(4, [0], global_batch_size=4, num_micro_batches=2).save(plan)
    argv = ["verify", "--plan", str(plan), "-m", "runtime_workloads:mlp", "--steps", "2",
            "--device", "cpu", "--timeout-s", "60"]  # fmt: skip
    assert main(argv) == 0
    out, err = capfd.readouterr()
    said = [x for x in err.splitlines() if x.startswith("verify: ")]
    assert said[0] == "verify: starting 1 process for the plan's run", err
    runs = [x for x in said if "the plan's run (" in x]
    refs = [x for x in said if "the single-device reference" in x]
    assert [x.rsplit(": ", 1)[1] for x in runs] == ["step 0 done", "step 1 done"]
    assert len(refs) == 2 and "step 1 of 2, comparing" in refs[1]
    assert said.index(runs[-1]) < said.index(refs[0]) and said[-1] == "verify: done"
    assert "OK" in out and "verify:" not in out  # the report stays on stdout
    # the API says nothing when asked not to
    api.verify(str(plan), "runtime_workloads:mlp", 1, device="cpu", progress=False)
    assert "verify: " not in capfd.readouterr().err


# -- E: profile --config ------------------------------------------------------------------------
def test_profile_reads_the_model_from_a_run_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run.toml"
    sets = ", ".join(f"{k} = {v}" for k, v in TINY.items())
    run.write_text(
        f'[model]\nspec = "transformer"\nset = {{ {sets} }}\n\n[plan]\npath = "plan.json"\n\n'
        '[train]\nsteps = 3\n\n[planning]\nprofile = "p.json"\ncluster = "local-cpu"\n'
    )
    out = tmp_path / "p.json"
    fast = ["--batch-sizes", "1", "--repeats", "1", "--warmup", "0", "--device", "cpu"]
    assert main(["profile", "--config", str(run), *fast, "-o", str(out)]) == 0
    prof = ModelProfile.load(out)
    assert prof.model_name == "transformer" and prof.num_layers == TINY["layers"] + 2
    assert prof.model_fingerprint == model_fingerprint(api.load("transformer", **TINY))
    # a flag beside the file wins; --set merges into [model] set
    assert main(["profile", "--config", str(run), "--set", "layers=3", *fast, "-o", str(out)]) == 0
    assert ModelProfile.load(out).num_layers == 5
    capsys.readouterr()
    argv = ["profile", "--config", str(run), "-m", "mlp", "-o", str(out), "--print-config"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert 'spec = "mlp"' in text and "hidden = 16" in text and "[planning]" not in text
    # no model anywhere: one line naming both ways to give it
    (tmp_path / "empty.toml").write_text("[train]\nsteps = 1\n")
    assert main(["profile", "--config", str(tmp_path / "empty.toml"), "-o", str(out)]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "-m/--model is required (or [model] spec in the --config file)" in line
    (tmp_path / "typo.toml").write_text('[model]\nspek = "mlp"\n')
    assert main(["profile", "--config", str(tmp_path / "typo.toml"), "-o", str(out)]) == 2
    assert "unknown key 'spek' in [model]" in _one_error(capsys.readouterr().err)

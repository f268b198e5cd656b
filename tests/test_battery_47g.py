"""Issue 47 (re-run G, 2026-11-30): ``profile --analytic`` took absurd lengths, sizes and batch
sizes (a sample of 10^12 tokens, 7.2e25 parameters) and wrote a profile of them; the MoE
search's second pass (without expert widths) ran unbounded after the first; and the fixes of
the mini-battery over the features since (``benchmarks/battery_47g.md``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from _battery import TINY_MOE  # the battery's own model
from builders import one_error_line
from dapple.cli import main
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.errors import InfeasibleError
from dapple.planner.expert_width import make_scorer
from dapple.planner.scorer import Scorer
from dapple.planner.search import dapple_search


# -- 1. profile --analytic: lengths, sizes and batch sizes past the profiler's limits ---------
@pytest.mark.parametrize(
    ("model", "given", "needles"),
    [
        (["-m", "llama3-8b"], ["--seq-lens", "1000000000000"],
         ["seq=1,000,000,000,000 tokens", "limit of 16,777,216"]),
        (["-m", "llama3-8b"], ["--seq-lens", "1024,16777217"], ["seq=16,777,217", "16,777,216"]),
        (["-m", "llama3-8b"], ["--batch-sizes", "1000000000000"],
         ["batch size 1,000,000,000,000", "limit of 1,048,576"]),
        (["-m", "transformer"], ["--set", "hidden=1000000000000"],
         ["7.2e+25 parameters", "limit of 1e+15", "hidden=1000000000000"]),
        (["-m", "transformer"], ["--set", "layers=1000000000000"],
         ["parameters exceed", "layers=1000000000000"]),
    ],
)  # fmt: skip
def test_analytic_profile_refuses_absurd_lengths_and_sizes_naming_the_limit(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    model: list[str],
    given: list[str],
    needles: list[str],
) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", "--analytic", "h100", *model, *given, "-o", str(out)]) == 2
    one_error_line(capsys, *needles)
    assert not out.exists()


@pytest.mark.parametrize(
    "given", [["--seq-lens", "16777216"], ["--batch-sizes", "1048576"], ["--set", "hidden=4096"]]
)
def test_analytic_profile_takes_lengths_and_sizes_up_to_the_limits(
    tmp_path: Path, given: list[str]
) -> None:
    out = tmp_path / "p.json"
    model = ["-m", "llama3-8b"] if given[0] != "--set" else ["-m", "transformer"]
    assert main(["profile", "--analytic", "h100", *model, *given, "-o", str(out)]) == 0
    assert out.exists()


# -- 2. the MoE search's second pass (without expert widths) is bounded by the first -----------
def _passes(
    monkeypatch: pytest.MonkeyPatch, prof: ModelProfile, cluster: Cluster, B: int
) -> tuple[Plan, int, int]:
    """The plan of the search over both passes, and the candidates each pass scored."""
    made: list[tuple[bool, Scorer]] = []

    def counted(*args: Any, **kwargs: Any) -> Scorer:
        sc = make_scorer(*args, **kwargs)
        made.append((kwargs["experts"], sc))
        return sc

    monkeypatch.setattr("dapple.planner.search.make_scorer", counted)
    plan = dapple_search(prof, cluster, B, tensor_widths=[1, 2])
    first = sum(sc.evaluations for ep, sc in made if ep)
    return plan, first, sum(sc.evaluations for ep, sc in made if not ep)


@pytest.mark.parametrize(
    ("expert_bytes", "blocks", "B"),
    [(4 * 10**9, 4, 16), (10**8, 4, 16), (4 * 10**9, 4, 32), (2 * 10**10, 4, 16), (10**8, 3, 8)],
)
def test_the_second_moe_pass_is_bounded_by_the_first_and_keeps_the_plan(
    monkeypatch: pytest.MonkeyPatch, expert_bytes: int, blocks: int, B: int
) -> None:
    from test_expert_width_planner import CLUSTER, _profile

    prof = _profile(expert_bytes, blocks)
    # the plan of the two passes run whole, as the search ran them before the bound
    ep = dapple_search(prof, CLUSTER, B, tensor_widths=[1, 2], experts=True)
    try:
        plain = dapple_search(prof, CLUSTER, B, tensor_widths=[1, 2], experts=False)
    except InfeasibleError:
        plain = ep
    unbounded = ep if ep.predicted_step_ms <= plain.predicted_step_ms else plain
    plan, first, second = _passes(monkeypatch, prof, CLUSTER, B)
    assert plan == unbounded
    assert 0 < second <= first  # unbounded it scored 6-23x the first's candidates


def test_the_second_moe_pass_returns_only_a_plan_below_its_bound() -> None:
    from test_expert_width_planner import CLUSTER, _profile

    prof = _profile(10**8)
    plain = dapple_search(prof, CLUSTER, 16, tensor_widths=[1], experts=False)
    with pytest.raises(InfeasibleError):
        dapple_search(prof, CLUSTER, 16, tensor_widths=[1], experts=False,
                      below_ms=plain.predicted_step_ms)  # fmt: skip
    got = dapple_search(prof, CLUSTER, 16, tensor_widths=[1], experts=False,
                        below_ms=plain.predicted_step_ms * 1.01)  # fmt: skip
    assert got == plain


# -- 3. a plain --profile beside KIND=FILE ones: one was dropped unsaid ----------------------
@pytest.mark.parametrize("command", ["plan", "simulate", "train"])
@pytest.mark.parametrize(
    "given", [["p.json", "A100=a.json"], ["H100=h.json", "p.json"], ["H100=h.json", "p.json",
                                                                      "A100=a.json"]]
)  # fmt: skip
def test_a_plain_profile_beside_kind_profiles_is_refused_naming_both(
    capsys: pytest.CaptureFixture[str], command: str, given: list[str]
) -> None:
    profiles = [x for p in given for x in ("--profile", p)]
    rest = {"plan": ["--cluster", "mixed.json"],
            "simulate": ["--plan", "plan.json", "--cluster", "mixed.json"],
            "train": ["--plan", "plan.json", "-m", "mlp", "--cluster", "mixed.json"]}[command]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        main([command, *rest, *profiles])
    assert e.value.code == 2
    err = capsys.readouterr().err
    line = f"dapple {command}: error: --profile p.json gives every device kind one profile"
    assert line in err and "KIND=FILE once per kind" in err and err.count("error:") == 1


def test_kind_profiles_and_plain_profiles_alone_still_parse() -> None:
    from dapple.cli import build_parser

    parse = build_parser().parse_args
    args = parse(["plan", "--cluster", "c", "--profile", "H=h.json", "--profile", "A=a.json"])
    assert args.profile == "H=h.json,A=a.json"
    assert parse(["plan", "--cluster", "c", "--profile", "a", "--profile", "b"]).profile == "b"


# -- 4. a V schedule on a one-group plan: "got 1 (1)" said which number? -----------------------
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
@pytest.mark.parametrize("command", ["simulate", "train"])
def test_a_v_on_one_device_group_names_the_replication(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, schedule: str
) -> None:
    from builders import make_profile
    from dapple.core.plan import straight_plan

    plan, prof = tmp_path / "plan.json", tmp_path / "p.json"
    straight_plan(4, [0], global_batch_size=4, num_micro_batches=2, replicas=[2]).save(plan)
    make_profile(4).save(prof)
    rest = (["--profile", str(prof), "--cluster", "local-cpu"] if command == "simulate"
            else ["-m", "transformer", "--set", "layers=2", "--set", "hidden=32"])  # fmt: skip
    assert main([command, "--plan", str(plan), *rest, "--schedule", schedule]) == 2
    one_error_line(capsys, "needs at least 2 device groups (a V over ranks), got 1 (replication 2)")


# -- 5. an EP plan the runtime does not run: refused by every worker after its start-up -------
@pytest.mark.parametrize(
    ("model", "extra", "needle"),
    [("moe", ["--zero-stage", "3"], "stage 0 [0, 4] (expert_width 2): expert parallelism with "
      "zero_stage 3: EP with ZeRO-3"),
     ("moe", ["--precision", "fp16"], "expert parallelism with precision fp16"),
     ("dense", [], "plan stage 0 [0, 4] (expert_width 2): model 'transformer' has no "
      "mixture-of-experts layers there")],
)  # fmt: skip
def test_train_refuses_what_expert_parallelism_does_not_run_before_any_worker_runs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    extra: list[str],
    needle: str,
) -> None:
    """Each was refused by every worker once it had started and loaded the model (50-65 s in
    the battery; on the dense model with 3 error lines and a C++ trace from the peer): the
    launcher now refuses them before spawning."""
    import contextlib
    import json

    from builders import boom
    from dapple.core.plan import straight_plan

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr("dapple.cli.train_cmd._early_workers",
                        lambda *a: contextlib.nullcontext(None))  # fmt: skip
    monkeypatch.setattr("dapple.runtime.launch.launcher.spawn", boom)
    (tmp_path / "moe").mkdir()
    (tmp_path / "moe" / "config.json").write_text(json.dumps(TINY_MOE))
    d = straight_plan(4, [0], global_batch_size=4, num_micro_batches=2, replicas=[2]).to_dict()
    d["stages"][0]["expert_width"] = 2
    (tmp_path / "ep.json").write_text(json.dumps(d))
    spec = ["-m", f"hf:{tmp_path / 'moe'}"] if model == "moe" else [
        "-m", "transformer", "--set", "layers=2", "--set", "hidden=32"]  # fmt: skip
    argv = ["train", "--plan", str(tmp_path / "ep.json"), *spec, "--device", "cpu", "--steps",
            "1", *extra]  # fmt: skip
    assert main(argv) == 2
    one_error_line(capsys, needle)

"""``dapple simulate`` is flags -> :class:`~dapple.api.simulating.SimulateConfig` -> the API:
the CLI, ``simulate(cfg)`` and the keyword form go down one path (issue 42, item 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapple import api
from dapple.api.simulating import SimulateConfig, simulate_runs
from dapple.cli import main
from dapple.core.cluster_presets import load_cluster
from dapple.errors import ValidationError
from dapple.profiler.paper_models import load_profile


@pytest.fixture
def saved(tmp_path: Path) -> str:
    out = tmp_path / "plan.json"
    api.plan("paper:bert48", "paper-a", 64).save(out)
    return str(out)


def test_cli_cfg_and_keywords_simulate_the_same_step(
    saved: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = SimulateConfig(plan=saved, profile="paper:bert48", cluster="paper-a", schedule="gpipe",
                         policy="B")  # fmt: skip
    by_cfg = api.simulate(cfg)
    by_keywords = api.simulate(saved, load_profile("paper:bert48"), load_cluster("paper-a"),
                               schedule="gpipe", policy="B")  # fmt: skip
    assert by_cfg.step_ms == by_keywords.step_ms
    assert by_cfg.step_ms != api.simulate(saved, "paper:bert48", "paper-a").step_ms  # gpipe, B
    capsys.readouterr()
    argv = ["simulate", "--plan", saved, "--profile", "paper:bert48", "--cluster", "paper-a",
            "--schedule", "gpipe", "--policy", "B"]  # fmt: skip
    assert main(argv) == 0
    assert f"step time {by_cfg.step_ms:.3f} ms" in capsys.readouterr().out


def test_other_schedule_runs_the_baseline_first(saved: str) -> None:
    cfg = SimulateConfig(plan=saved, profile="paper:bert48", cluster="paper-a",
                         other_schedule=True)  # fmt: skip
    done = simulate_runs(cfg)
    assert done.runs[0][0].lower().startswith("gpipe")
    assert done.runs[1][1].step_ms == api.simulate(saved, "paper:bert48", "paper-a").step_ms
    assert done.plan.num_micro_batches > 0 and done.cluster.name == "paper-a"


def test_simulate_cfg_takes_nothing_beside_it(saved: str) -> None:
    cfg = SimulateConfig(plan=saved, profile="paper:bert48", cluster="paper-a")
    with pytest.raises(ValidationError, match="takes its options from cfg, got also schedule, "
                       "virtual_stages"):  # fmt: skip
        api.simulate(cfg, schedule="interleaved", virtual_stages=2)  # type: ignore[call-overload]


def test_servers_below_one_are_refused_before_the_files_are_read() -> None:
    cfg = SimulateConfig(plan="missing.json", profile="paper:bert48", cluster="paper-a", servers=0)
    with pytest.raises(ValidationError, match="--servers must be >= 1, got 0"):
        simulate_runs(cfg)


def test_a_config_files_simulate_section_with_flags_on_top(
    saved: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dapple.api.simulating import load_simulate_config

    shared = tmp_path / "job.toml"
    shared.write_text(
        '[planning]\nprofile = "paper:bert48"\ncluster = "paper-a"\nglobal_batch_size = 64\n'
        f'[simulate]\nplan = "{saved}"\nprofile = "paper:bert48"\ncluster = "paper-a"\n'
        'schedule = "gpipe"\n'
    )
    cfg = load_simulate_config(shared)
    assert cfg == SimulateConfig(plan=saved, profile="paper:bert48", cluster="paper-a",
                                 schedule="gpipe")  # fmt: skip
    capsys.readouterr()
    assert main(["simulate", "--config", str(shared), "--policy", "B", "--print-config"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    assert load_simulate_config(printed) == SimulateConfig(
        plan=saved, profile="paper:bert48", cluster="paper-a", schedule="gpipe", policy="B"
    )
    assert main(["simulate", "--config", str(shared), "--policy", "B"]) == 0
    want = api.simulate(SimulateConfig(plan=saved, profile="paper:bert48", cluster="paper-a",
                                       schedule="gpipe", policy="B"))  # fmt: skip
    assert f"step time {want.step_ms:.3f} ms" in capsys.readouterr().out
    assert main(["plan", "--config", str(shared)]) == 0  # the plan reads its own section


def test_a_simulation_without_a_plan_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    only = tmp_path / "sim.toml"
    only.write_text('[simulate]\nprofile = "paper:bert48"\ncluster = "paper-a"\n')
    assert main(["simulate", "--config", str(only)]) == 2
    assert "--plan is required (or [simulate] plan in the --config file)" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="needs a plan, a profile and a cluster"):
        simulate_runs(SimulateConfig(profile="paper:bert48", cluster="paper-a"))


def test_simulate_cfg_writes_the_files_it_asks_for(saved: str, tmp_path: Path) -> None:
    """``simulate(cfg)`` writes the Gantt chart, memory plot, layout and trace it names (as
    ``dapple simulate`` does), and refuses one it cannot write before reading the plan."""
    out = {k: tmp_path / f"{k}.{'json' if k == 'trace' else 'png'}"
           for k in ("gantt", "memory", "layout", "trace")}  # fmt: skip
    cfg = SimulateConfig(plan=saved, profile="paper:bert48", cluster="paper-a",
                         **{k: str(v) for k, v in out.items()})  # fmt: skip
    r = api.simulate(cfg)
    assert r.step_ms > 0
    assert all(p.stat().st_size > 0 for p in out.values()), out
    assert out["trace"].read_text().lstrip().startswith(("{", "["))
    bad = SimulateConfig(plan="missing.json", profile="paper:bert48", cluster="paper-a",
                         gantt=str(tmp_path / "g.txt"))  # fmt: skip
    with pytest.raises(ValidationError, match=r"gantt file .*unknown picture format '.txt'"):
        api.simulate(bad)  # the format, before the missing plan is read

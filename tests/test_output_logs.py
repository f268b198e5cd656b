"""Output in a log file: no table cell cut to an ellipsis, progress as plain lines off a terminal.

Every command's tables are rendered to a non-terminal console (pytest's captured stdout, or a
``StringIO``) with names longer than 80 columns allow; every name and number must appear whole
and no ``…`` anywhere. :class:`~dapple.cli._console.StepProgress` off a terminal prints what,
how far and the ETA, at most one line per interval.
"""

from __future__ import annotations

import dataclasses
import io
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table

from builders import make_cluster, make_profile
from dapple.cli import main
from dapple.cli._console import StepProgress, console, format_seconds, print_table
from dapple.core.plan import straight_plan
from dapple.core.profile import LengthProfile

ELLIPSIS = "…"
LONG_MODEL = "a-model-whose-name-is-much-longer-than-any-column-of-an-80-column-table"
LONG_CLUSTER = "a-cluster-with-a-long-name-too"


@pytest.fixture(autouse=True)
def _no_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich's width off a terminal: 80 columns, as in a log file (no COLUMNS override)."""
    monkeypatch.delenv("COLUMNS", raising=False)


def _narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    """A log 40 columns wide: the tables that fit 80 columns must widen too."""
    monkeypatch.setenv("COLUMNS", "40")


def _whole(text: str, *names: str) -> None:
    assert ELLIPSIS not in text, text
    for name in names:
        assert name in text, f"{name!r} not whole in:\n{text}"


def _files(tmp_path: Path, layers: int = 8) -> tuple[str, str]:
    prof, cluster = tmp_path / "p.json", tmp_path / "c.json"
    make_profile(layers, name=LONG_MODEL).save(prof)
    dataclasses.replace(make_cluster(), name=LONG_CLUSTER).save(cluster)
    return str(prof), str(cluster)


# -- tables ----------------------------------------------------------------------------------
def _wide_table() -> tuple[Table, list[str]]:
    cells = [f"cell-{i}-" + "x" * 30 for i in range(6)]
    t = Table(title="long cells")
    for i in range(6):
        t.add_column(f"column {i} with a long header")
    t.add_row(*cells)
    t.add_row(*(f"{12345.678 * (i + 1):.3f}" for i in range(6)))
    return t, cells


def test_print_table_off_a_terminal_is_as_wide_as_its_cells() -> None:
    con = Console(file=io.StringIO())
    assert not con.is_terminal and con.width == 80
    t, cells = _wide_table()
    print_table(con, t)
    text = con.file.getvalue()  # type: ignore[attr-defined]
    _whole(text, *cells, "column 5 with a long header", "74074.068")
    assert max(len(line) for line in text.splitlines()) > 200  # one line per row, not folded
    assert con.width == 80  # the console's own width is back


def test_print_table_in_a_narrow_terminal_wraps_cells_instead_of_cutting() -> None:
    con = Console(file=io.StringIO(), force_terminal=True, width=60, color_system=None)
    t, _ = _wide_table()
    print_table(con, t)
    text = con.file.getvalue()  # type: ignore[attr-defined]
    assert ELLIPSIS not in text
    assert max(len(line) for line in text.splitlines()) <= 60
    assert all(c.overflow == "fold" for c in t.columns)
    assert text.count("x") == 6 * 30  # every cell's letters, folded over lines


def test_console_off_a_terminal_keeps_lines_whole(capsys: pytest.CaptureFixture[str]) -> None:
    con = console()
    assert not con.is_terminal and con.soft_wrap
    long = " ".join(f"word{i}" for i in range(40))
    con.print(long)
    assert long in capsys.readouterr().out


def test_plan_tables_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, cluster = _files(tmp_path)
    common = ["plan", "--profile", prof, "--cluster", cluster, "--global-batch-size", "16"]
    assert main(common) == 0
    _whole(capsys.readouterr().out, LONG_MODEL, LONG_CLUSTER, "AllReduce ms", "memory GiB")
    assert main([*common, "--compare"]) == 0
    _whole(
        capsys.readouterr().out,
        LONG_MODEL,
        "interleaved v=2",
        "replication",
        "split positions",
        "simulated ms",
        "pipedream",
    )
    assert main([*common, "--schedule", "zbh1"]) == 0
    _whole(capsys.readouterr().out, LONG_MODEL, LONG_CLUSTER, "zbh1")


def test_simulate_table_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _narrow(monkeypatch)
    prof, cluster = _files(tmp_path)
    plan = tmp_path / "plan.json"
    args = ["--profile", prof, "--cluster", cluster]
    assert main(["plan", *args, "--global-batch-size", "16", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", str(plan), *args, "--other-schedule"]) == 0
    _whole(capsys.readouterr().out, LONG_CLUSTER, "stage.replica", "peak in flight", "GPipe")


def test_profile_tables_whole() -> None:
    from dapple.cli.profile_cmd import print_lengths, print_profile

    base = make_profile(3, name=LONG_MODEL)
    names = [f"transformer.h.{i}.a-very-long-layer-name-of-a-hugging-face-model" for i in range(3)]
    layers = tuple(
        dataclasses.replace(ly, name=n) for ly, n in zip(base.layers, names, strict=True)
    )
    prof = dataclasses.replace(
        base,
        layers=layers,
        by_length=(LengthProfile(seq_len=128, layers=layers), LengthProfile(seq_len=512, layers=layers)),
    )  # fmt: skip
    con = Console(file=io.StringIO())
    print_profile(con, prof)
    print_lengths(con, prof)
    _whole(con.file.getvalue(), LONG_MODEL, *names, "kept KB/sample", "us/token")  # type: ignore[attr-defined]


def test_verify_report_whole() -> None:
    from dapple.cli.verify_cmd import print_report
    from dapple.runtime.verify import StageDiff, VerifyReport

    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    stages = (StageDiff(0, (0, 2), 1, 123456789, 1.25e-7, 3.5e-8, True),
              StageDiff(1, (2, 4), 1, 987654321, 2.5e-7, 4.5e-8, True))  # fmt: skip
    rep = VerifyReport(plan, LONG_MODEL, "layer chain", stages, (2.0, 1.5), (2.0, 1.5),
                       grad_norms=(0.75, 0.5), reference_grad_norms=(0.75, 0.5))  # fmt: skip
    con = Console(file=io.StringIO())
    print_report(con, rep)
    text = con.file.getvalue()  # type: ignore[attr-defined]
    _whole(text, LONG_MODEL, "123,456,789", "987,654,321", "gradient diff / scale",
           "weight rel diff", "1.5000000", "0.75")  # fmt: skip


def test_train_memory_table_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dapple.api.predicting import planned_memory
    from dapple.cli._memory_table import memory_table
    from dapple.runtime.step_metrics import StepMetrics

    prof, cluster = _files(tmp_path, layers=4)
    plan = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2)
    mib = 2**20
    last = StepMetrics(
        step=0, loss=1.0, step_ms=1.0, samples_per_s=1.0,
        peak_memory_bytes=(123456 * mib, 654321 * mib), memory_kind="held_activations",
        peak_resident_bytes=(222222 * mib, 333333 * mib), stage_resident_bytes=(1 * mib, 2 * mib),
        resident_kind="VmHWM",
    )  # fmt: skip
    memory_table(plan, last, planned_memory(plan, prof, cluster, "adamw"), "adamw")
    _whole(capsys.readouterr().out, "123456.0 MiB", "654321.0 MiB", "333333.0 MiB",
           "planner estimate", "estimate / added", "peak held_activations")  # fmt: skip


def test_split_table_whole(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _narrow(monkeypatch)
    assert main(["split", "-m", "mlp"]) == 0
    _whole(capsys.readouterr().out, "float32[2,64]", "fc0")


def test_calibrate_table_and_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dapple.calibrate.machine as machine

    def fake(nproc: int, sizes: tuple[int, ...], repeats: int) -> machine.CalibrationResult:
        n = len(sizes)
        return machine.CalibrationResult(
            nproc, "gloo", sizes, (0.123,) * n, (4567.891,) * n, 1.0, 2.0, make_cluster()
        )

    monkeypatch.setattr(machine, "calibrate", fake)
    _narrow(monkeypatch)
    assert main(["calibrate", "--nproc", "2", "-o", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    _whole(out, "p2p one-way ms", "AllReduce(2) ms", "4567.891", "16,777,216")
    assert "calibrate: measuring 2 gloo processes, elapsed 0.0 s" in out
    assert "calibrate: done in" in out


def test_plan_local_table_and_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dapple.calibrate.local as local

    prof, cluster = make_profile(4, name=LONG_MODEL), make_cluster()
    plan = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2)
    plan = dataclasses.replace(plan, predicted_step_ms=12345.6)

    def fake(workload: Any, gbs: int, counts: list[int], **kw: Any) -> Any:
        for i in range(3):
            kw["progress"](i + 1, 3, f"step {i}")
        cands = [local.LocalCandidate(k, plan, prof, cluster) for k in counts]
        return cands[0], cands

    monkeypatch.setattr(local, "plan_local", fake)
    _narrow(monkeypatch)
    out_dir = tmp_path / "out"
    args = ["plan-local", "-m", "mlp", "--global-batch-size", "8", "--out-dir", str(out_dir)]
    assert main(args) == 0
    out = capsys.readouterr().out
    _whole(out, "predicted ms/step", "12345.6", "samples/s")
    assert "plan-local: " in out and "plan-local: done 3/3 in" in out


# -- the sources -------------------------------------------------------------------------------
CLI = Path(__file__).parent.parent / "src" / "dapple" / "cli"
_OTHERS = {"_console.py"}
"""The helpers themselves."""


def test_every_command_prints_through_the_shared_helpers() -> None:
    for path in sorted(CLI.glob("*.py")):
        if path.name in _OTHERS:
            continue
        text = path.read_text()
        assert not re.search(r"\bConsole\(", text), f"{path.name}: make it with console()"
        assert not re.search(r"\b(Progress|status|track)\(", text), f"{path.name}: StepProgress"
        if re.search(r"\bTable\(", text):
            assert "print_table(" in text, f"{path.name}: print tables with print_table"
            assert ".print(t)" not in text and ".print(table)" not in text, path.name


# -- progress --------------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _plain(**kw: Any) -> tuple[StepProgress, io.StringIO, _Clock]:
    out, clock = io.StringIO(), _Clock()
    con = Console(file=out)
    return StepProgress(console=con, heartbeat=False, clock=clock, **kw), out, clock


def test_plain_lines_say_what_how_far_and_eta() -> None:
    bar, out, clock = _plain(what="profile gpt", total=12, interval_s=1.0)
    with bar:
        for i in range(12):
            clock.t += 1.0
            bar(i + 1, 12, f"b=2 transformer.h.{i}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "profile gpt: 0/12 0% elapsed 0.0 s eta ?"
    assert lines[3] == "profile gpt: 3/12 (b=2 transformer.h.2) 25% elapsed 3.0 s eta 9.0 s"
    assert lines[-2] == "profile gpt: 12/12 (b=2 transformer.h.11) 100% elapsed 12.0 s eta 0.0 s"
    assert lines[-1] == "profile gpt: done 12/12 in 12.0 s"
    assert len(lines) == 1 + 12 + 1


def test_plain_lines_at_most_one_per_interval() -> None:
    bar, out, clock = _plain(what="plan", total=10_000, interval_s=5.0)
    with bar:
        for i in range(10_000):  # 10 000 steps of 3 ms: 30 s
            clock.t += 0.003
            bar(i + 1)
    lines = out.getvalue().splitlines()
    progress = lines[1:-1]
    assert 5 <= len(progress) <= 30 / 5  # one per 5 s of the 30
    assert lines[0].startswith("plan: 0/10000") and lines[-1] == "plan: done 10000/10000 in 30.0 s"
    assert all(" eta " in line and "% elapsed " in line for line in progress)


def test_plain_lines_delay_and_failure() -> None:
    bar, out, clock = _plain(what="plan dp", delay_s=1.0)
    with bar:
        bar(1, 2)  # fast: nothing at all
    assert out.getvalue() == ""
    bar, out, clock = _plain(what="plan dapple", total=4, delay_s=1.0)
    with pytest.raises(RuntimeError), bar:
        clock.t += 2.0
        bar(1)
        raise RuntimeError("planner failed")
    assert out.getvalue().splitlines() == [
        "plan dapple: 1/4 25% elapsed 2.0 s eta 6.0 s",
        "plan dapple: stopped at 1/4 after 2.0 s",
    ]


def test_plain_heartbeat_while_a_step_runs() -> None:
    out = io.StringIO()
    with StepProgress("calibrate", detail="measuring", console=Console(file=out), interval_s=0.05):
        time.sleep(0.4)  # one long step without a call
    lines = out.getvalue().splitlines()
    assert lines[0] == "calibrate: measuring, elapsed 0.0 s"
    assert lines[-1].startswith("calibrate: done in ")
    assert 3 <= len(lines) - 2 <= 0.4 / 0.05 + 1
    assert all(line.startswith("calibrate: measuring, elapsed ") for line in lines[:-1])


def test_terminal_shows_a_bar_and_no_lines() -> None:
    out = io.StringIO()
    con = Console(file=out, force_terminal=True, width=100)
    with StepProgress("profile", 3, console=con) as bar:
        for i in range(3):
            bar(i + 1, 3, "b=1 [fc0]")  # markup-like text is shown as is
    with StepProgress("calibrate", console=con):
        pass
    assert "done" not in out.getvalue() and " eta " not in out.getvalue()


def test_format_seconds() -> None:
    assert [format_seconds(s) for s in (4.12, 65, 3725, float("inf"))] == [
        "4.1 s",
        "1m05s",
        "1h02m",
        "?",
    ]


def test_plan_local_reports_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    import dapple.calibrate.machine as machine
    import dapple.planner as planner
    import dapple.profiler.measure as measure
    from dapple.calibrate.local import plan_local

    def profile(workload: Any, sizes: list[int], progress: Any = None, **kw: Any) -> Any:
        for i in range(workload.num_layers * len(sizes)):
            progress(i + 1, workload.num_layers * len(sizes), f"layer {i}")
        return make_profile(3)

    plan = SimpleNamespace(predicted_step_ms=1.0)
    monkeypatch.setattr(measure, "profile_workload", profile)
    monkeypatch.setattr(machine, "calibrate", lambda k: SimpleNamespace(cluster=make_cluster()))
    monkeypatch.setattr(planner, "make_plan", lambda *a: plan)
    calls: list[tuple[int, int, str]] = []
    wl = SimpleNamespace(num_layers=3)
    plan_local(wl, 8, (2, 4), batch_sizes=[1, 2], progress=lambda *c: calls.append(c))  # type: ignore[arg-type]
    total = (3 * 2 + 2) * 2
    assert all(t == total for _, t, _ in calls)
    done = [d for d, _, _ in calls]
    assert done == sorted(done) and done[-1] == total
    texts = [w for _, _, w in calls]
    assert "2 processes: profile layer 0" in texts and "4 processes: calibrate" in texts
    assert "4 processes: plan" in texts

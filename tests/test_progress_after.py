"""Issue 47 (battery F, rows 33-34): a progress bar whose steps are all done while work remains
(``dapple plan`` of an MoE profile: the search again without expert widths, then the
refinement) said "28/28 100% eta 0.0 s" for about a minute. With ``after`` it says what still
runs, with no percentage or ETA (:class:`~dapple.cli._console.StepProgress`)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from dapple.cli._console import StepProgress


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_plain_lines_after_the_last_step_say_what_runs_without_percent_or_eta() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = StepProgress("plan dapple", 4, detail="micro-batch counts", after="the refinement",
                       console=Console(file=out), heartbeat=False, clock=clock,
                       interval_s=1.0)  # fmt: skip
    with bar:
        for i in range(4):
            clock.t += 1.0
            bar(i + 1, 4)
        clock.t += 60.0
        bar._show()  # the heartbeat's call while the work after the steps runs
    lines = out.getvalue().splitlines()
    assert lines[3] == "plan dapple: 3/4 (micro-batch counts) 75% elapsed 3.0 s eta 1.0 s"
    assert lines[4] == (
        "plan dapple: 4/4 (micro-batch counts) done, then the refinement: elapsed 4.0 s"
    )
    assert lines[5] == (
        "plan dapple: 4/4 (micro-batch counts) done, then the refinement: elapsed 1m04s"
    )
    assert lines[-1] == "plan dapple: done 4/4 in 1m04s"
    assert not any("100%" in x or "eta 0.0 s" in x for x in lines)


def test_without_after_the_last_step_is_100_percent() -> None:
    out, clock = io.StringIO(), _Clock()
    bar = StepProgress("profile", 2, console=Console(file=out), heartbeat=False, clock=clock,
                       interval_s=1.0)  # fmt: skip
    with bar:
        clock.t += 1.0
        bar(2)
    assert "profile: 2/2 100% elapsed 1.0 s eta 0.0 s" in out.getvalue().splitlines()


@pytest.mark.parametrize("after", ["", "the refinement"])
def test_the_bar_after_the_last_step_has_no_total_and_no_eta(after: str) -> None:
    now = [0.0]
    con = Console(file=io.StringIO(), force_terminal=True, width=120)
    with StepProgress("plan", 4, detail="M", after=after, console=con, heartbeat=False,
                      clock=lambda: now[0]) as p:  # fmt: skip
        now[0] = 2.0
        p(3)
        assert p._bar is not None and p._bar.tasks[-1].total == 4
        now[0] = 3.0
        p(4)
        task = p._bar.tasks[-1]
        assert len(p._bar.tasks) == 1 and task.completed == 4
        if after:  # a pulsing bar of unknown total: "4/?", no ETA
            assert task.total is None and task.fields["eta"] == "?"
            assert task.description == "M done, then the refinement"
        else:
            assert task.total == 4 and task.fields["eta"] == "0.0 s"

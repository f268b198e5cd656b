"""SIGTERM to a run of several launches (:class:`~dapple.runtime.launch.stop_line.RunClosing`, an
elastic run's): one closing line, its temporary folder removed, the process dead of the signal -
whether the signal comes while a launch waits (its own closing line is the one) or between
launches (the run's line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from builders import make_profile
from dapple.core.plan import straight_plan
from dapple.runtime.launch.elastic import ElasticPolicy, train_elastic
from dapple.runtime.launch.stop_line import RunClosing
from dapple.runtime.train_config import TrainConfig

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals")


def _run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """``body`` in a fresh interpreter with ``TMPDIR`` = ``tmp_path/temp``."""
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


@linux_only
def test_a_sigterm_between_attempts_writes_the_elastic_runs_line_and_removes_its_folder(
    tmp_path: Path,
) -> None:
    """The signal comes where no launch waits (the attempt itself sends it): the elastic run's
    closing line names its checkpoint directory, and its dapple-elastic-* folder is gone."""
    make_profile(4, name="mlp").save(tmp_path / "prof.json")
    done = _run(
        tmp_path,
        """
        import os, signal
        from dapple.core.cluster_presets import PRESETS
        from dapple.core.plan import straight_plan
        from dapple.core.profile import ModelProfile
        from dapple.runtime.launch.elastic import ElasticPolicy, train_elastic
        from dapple.runtime.train_config import TrainConfig

        def attempt(plan, config):
            os.kill(os.getpid(), signal.SIGTERM)
            print("after the signal")

        plan = straight_plan(4, [0], global_batch_size=4, num_micro_batches=1, replicas=[2])
        policy = ElasticPolicy(ModelProfile.load("prof.json"), PRESETS["local-cpu"])
        config = TrainConfig(steps=3, checkpoint_dir="ck", save_every=1)
        train_elastic(plan, config, attempt, policy=policy)
        print("returned")
    """,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == ""
    assert done.stderr == "dapple: stopped by SIGTERM; no complete checkpoint in ck\n"
    assert list((tmp_path / "temp").iterdir()) == []


@linux_only
def test_a_sigterm_while_a_launch_waits_costs_one_line_its_own(tmp_path: Path) -> None:
    """A launch's :class:`StopSignals` inside writes its closing line and delivers the signal
    again: the run's closing then removes its folder and adds no second line."""
    done = _run(
        tmp_path,
        """
        import os, signal, tempfile
        from dapple.runtime.launch.local import StopSignals
        from dapple.runtime.launch.stop_line import RunClosing

        folder = tempfile.mkdtemp(prefix="dapple-elastic-")
        with RunClosing(folder, lambda name: "the run's line"):
            with StopSignals(lambda name: f"the launch's line ({name})") as signals:
                os.kill(os.getpid(), signal.SIGTERM)
                assert signals.received == signal.SIGTERM
                print("noted")
            print("after the launch")
    """,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout == "noted\n"
    assert done.stderr == "the launch's line (SIGTERM)\n"
    assert list((tmp_path / "temp").iterdir()) == []


def test_the_handler_is_there_only_while_the_elastic_run_is(tmp_path: Path) -> None:
    """In the main thread, over the default handler: installed for the run's attempts, and
    the default handler again once it returns."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    seen: list[object] = []

    def attempt(_plan: object, config: TrainConfig) -> None:
        seen.append(signal.getsignal(signal.SIGTERM))
        Path(str(config.metrics_path)).write_text("")  # the run's metrics: no step

    plan = straight_plan(4, [0], global_batch_size=4, num_micro_batches=1, replicas=[2])
    config = TrainConfig(steps=3, checkpoint_dir=str(tmp_path / "ck"), save_every=1)
    policy = ElasticPolicy(make_profile(4, name="mlp"), _cpu())
    train_elastic(plan, config, attempt, policy=policy)
    assert len(seen) == 1 and isinstance(seen[0], RunClosing)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_handler_of_the_callers_own_is_left_alone(tmp_path: Path) -> None:
    def mine(_signum: int, _frame: object) -> None:
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        with RunClosing(str(tmp_path), lambda name: name):
            assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGTERM) is mine and tmp_path.is_dir()
    finally:
        signal.signal(signal.SIGTERM, old)


def _cpu():  # type: ignore[no-untyped-def]
    from dapple.core.cluster_presets import PRESETS

    return PRESETS["local-cpu"]

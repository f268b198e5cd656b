"""The standalone launcher's process lifecycle and its sockets, on Linux, with real processes.

- SIGKILL, SIGTERM or SIGINT to a running ``dapple train`` leaves no worker behind;
- a killed rank costs every surviving rank exactly one line on stderr;
- every socket a local run listens on is bound to loopback, and gloo talks over loopback.

Processes are found through ``/proc`` (children by parent pid, sockets by inode); every wait
polls with a generous deadline. Each test ends the processes it started, by pid.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from builders import make_profile
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.runtime.launch import local
from dapple.runtime.launch.failure import RankFailure, lost_peer, rank_report
from dapple.runtime.launch.local import Interrupted, StopSignals, exit_text

TESTS = Path(__file__).parent
DEADLINE_S = 90.0  # the launcher and its workers must be gone this long after a signal (30 s was
# passed by the SIGINT cases of this file and test_calibrate_lifecycle under a load of 20-28 on the
# 2 cores, which pass in seconds on a quiet machine)
START_S = 240.0  # process start-up and the first step on a busy 2-core machine

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")

_GLOO_PEER = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:5310. This is typically caused by a remote worker crashing."
)


# -- /proc -------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid``; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None and st[1] == pid:
                out.append(int(entry.name))
    return sorted(out)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _running(procs: dict[int, int]) -> list[int]:
    """Those of ``procs`` (pid -> start time) still running (not gone, not a zombie)."""
    alive = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[2] == start and st[0] != "Z":
            alive.append(pid)
    return alive


def _wait_for(what: str, check: Callable[[], Any], timeout_s: float, launcher: Any) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        assert launcher.poll() is None, f"launcher ended (rc {launcher.returncode}) before {what}"
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout_s:.0f} s")


class Launched:
    """A ``python -m dapple ...`` subprocess that starts ``count`` workers; stdout and stderr
    go to files, and every descendant it ever had is remembered (to find orphans)."""

    def __init__(self, tmp: Path, argv: list[str], count: int, env: dict[str, str] | None) -> None:
        self.out, self.err = tmp / "out.txt", tmp / "err.txt"
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join([str(TESTS), full_env.get("PYTHONPATH", "")])
        full_env.update(env or {})
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "dapple", *argv], stdout=out,
                                         stderr=err, env=full_env, text=True)  # fmt: skip
        self.count = count
        self.seen: dict[int, int] = {}  # every descendant seen: pid -> start time

    def descendants(self) -> list[int]:
        """The launcher's processes below it now (workers, multiprocessing's resource tracker)."""
        found, todo = [], [self.proc.pid]
        while todo:
            for c in _children(todo.pop()):
                st = _stat(c)
                if st is not None:
                    self.seen.setdefault(c, st[2])
                found.append(c)
                todo.append(c)
        return found

    def workers(self) -> list[int]:
        """The launcher's worker processes, once all ``count`` of them exist ([] before)."""
        kids = [p for p in _children(self.proc.pid) if "spawn_main" in _cmdline(p)]
        self.descendants()
        return kids if len(kids) == self.count else []

    def wait_workers(self) -> list[int]:
        return _wait_for("workers", self.workers, START_S, self.proc)

    def assert_all_end(self) -> None:
        """Every process the launcher ever had ends within ``DEADLINE_S``."""
        deadline = time.monotonic() + DEADLINE_S
        while _running(self.seen) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {p: _cmdline(p)[:90] for p in _running(self.seen)}
        assert not left, f"still running {DEADLINE_S:.0f} s after the launcher ended: {left}"

    def close(self) -> None:
        """Kill, by pid, whatever of the run is still running (a failed test leaves nothing)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.descendants()
        for pid in _running(self.seen):
            os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=DEADLINE_S)


class _Run(Launched):
    """A ``dapple train`` subprocess of a tiny plan."""

    def __init__(self, tmp: Path, devices: int, env: dict[str, str] | None = None) -> None:
        if devices == 2:
            plan = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=4)
        else:  # 4 ranks: stage 0 replicated (its AllReduce), stages 1 and 2 single
            plan = straight_plan(
                4, [0, 2, 3], global_batch_size=8, num_micro_batches=4, replicas=[2, 1, 1]
            )
        plan.save(tmp / "plan.json")
        argv = ["train", "--plan", str(tmp / "plan.json"), "-m", "runtime_workloads:mlp",
                "--steps", "1000000", "--timeout-s", "20"]  # fmt: skip
        super().__init__(tmp, argv, devices, env)
        self.devices = devices

    def wait_training(self) -> list[int]:
        """Wait for the first step line (every worker is past the rendezvous); the workers."""
        _wait_for("step line", lambda: "step 0 " in self.out.read_text(), START_S, self.proc)
        return self.wait_workers()


@pytest.fixture
def run_factory(tmp_path: Path) -> Iterator[Callable[..., _Run]]:
    runs: list[_Run] = []

    def make(devices: int = 2, env: dict[str, str] | None = None) -> _Run:
        d = tmp_path / f"run{len(runs)}"
        d.mkdir()
        runs.append(_Run(d, devices, env))
        return runs[-1]

    yield make
    for r in runs:
        r.close()


# -- A: no orphans -----------------------------------------------------------------------------
@pytest.mark.slow
@linux_only
@pytest.mark.parametrize("phase", ["starting", "training"])
def test_sigkill_of_the_launcher_ends_every_worker(run_factory, phase: str) -> None:
    run = run_factory()
    workers = run.wait_workers() if phase == "starting" else run.wait_training()
    assert len(workers) == 2 and len(run.seen) >= 2
    os.kill(run.proc.pid, signal.SIGKILL)
    assert run.proc.wait(timeout=DEADLINE_S) == -signal.SIGKILL
    run.assert_all_end()


@pytest.mark.slow
@linux_only
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_and_sigint_stop_the_workers_then_the_launcher(
    run_factory, sig, tmp_path: Path
) -> None:
    temp = tmp_path / "temp"  # the run's TMPDIR
    temp.mkdir()
    run = run_factory(env={"TMPDIR": str(temp)})
    run.wait_training()
    os.kill(run.proc.pid, sig)
    rc = run.proc.wait(timeout=DEADLINE_S)
    run.assert_all_end()
    assert sorted(p.name for p in temp.glob("dapple-*")) == []  # its temporary folders removed
    if sig == signal.SIGTERM:
        assert rc == -signal.SIGTERM  # the launcher still dies of it, after its workers
    else:
        assert rc == 130 and run.err.read_text().splitlines() == [
            "dapple: stopped by SIGINT; nothing saved (no --checkpoint-dir)"
        ]


@pytest.mark.slow
@linux_only
def test_a_sigterm_verify_ends_in_one_line_and_leaves_no_temporary_folder(tmp_path: Path) -> None:
    """``dapple verify`` stopped by SIGTERM while its 2 workers run: they end, the launcher
    dies of the signal after its closing line, and its dapple-verify-* folder is gone."""
    temp = tmp_path / "temp"
    temp.mkdir()
    straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=4).save(tmp_path / "p.json")
    argv = ["verify", "--plan", str(tmp_path / "p.json"), "-m", "runtime_workloads:mlp",
            "--steps", "1000000", "--timeout-s", "20"]  # fmt: skip
    run = Launched(tmp_path, argv, 2, {"TMPDIR": str(temp)})
    try:
        run.wait_workers()
        _wait_for("the verify folder", lambda: list(temp.glob("dapple-verify-*")), START_S,
                  run.proc)  # fmt: skip
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.proc.wait(timeout=DEADLINE_S) == -signal.SIGTERM
        run.assert_all_end()
        assert sorted(p.name for p in temp.glob("dapple-*")) == []
        assert "dapple: verify stopped by SIGTERM; nothing verified" in run.err.read_text()
    finally:
        run.close()


@pytest.mark.slow
@linux_only
def test_a_sigterm_elastic_run_ends_in_one_line_and_leaves_no_temporary_folder(
    tmp_path: Path,
) -> None:
    """The README's elastic run (DP over 2 devices) stopped by SIGTERM while it trains: its
    workers end, the launcher dies of the signal after one closing line, and its
    dapple-elastic-* folder (the metrics file the closing line reads) is gone with the others."""
    temp = tmp_path / "temp"
    temp.mkdir()
    make_profile(4, name="test-mlp").save(tmp_path / "prof.json")
    straight_plan(4, [0], global_batch_size=8, num_micro_batches=1, replicas=[2]).save(
        tmp_path / "p.json"
    )
    ck = tmp_path / "ck"
    argv = ["train", "--plan", str(tmp_path / "p.json"), "-m", "runtime_workloads:mlp",
            "--steps", "1000000", "--timeout-s", "20", "--checkpoint-dir", str(ck),
            "--save-every", "1", "--elastic", "--profile", str(tmp_path / "prof.json"),
            "--cluster", "local-cpu", "--min-devices", "1", "--max-restarts", "3"]  # fmt: skip
    run = Launched(tmp_path, argv, 2, {"TMPDIR": str(temp)})
    try:
        _wait_for("step line", lambda: "step 1 " in run.out.read_text(), START_S, run.proc)
        assert list(temp.glob("dapple-elastic-*"))
        os.kill(run.proc.pid, signal.SIGTERM)
        assert run.proc.wait(timeout=DEADLINE_S) == -signal.SIGTERM
        run.assert_all_end()
        assert sorted(p.name for p in temp.glob("dapple-*")) == []
        lines = [x for x in run.err.read_text().splitlines() if "warning:" not in x]
        assert len(lines) == 1 and re.fullmatch(
            r"dapple: stopped by SIGTERM after step \d+; last checkpoint: step \d+ \(.*\), "
            r"resume with --resume",
            lines[0],
        ), lines
    finally:
        run.close()


_OWN_RANK = re.compile(r"^dapple: error: (?:[^:]*step \d+: |end of run: )?rank (\d+)\b")


@pytest.mark.slow
@linux_only
def test_a_killed_rank_costs_each_survivor_one_line(run_factory) -> None:
    run = run_factory(devices=4)
    workers = run.wait_training()
    os.kill(min(workers), signal.SIGKILL)  # the first started: rank 0, host of the store
    rc = run.proc.wait(timeout=20 + 60)  # --timeout-s bounds every wait on the lost peer
    assert rc != 0
    lines = run.err.read_text().splitlines()
    head, _, ends = lines[-1].partition(": 4 of 4 workers failed: ")
    assert head == "dapple: error", lines
    how = dict(re.fullmatch(r"rank (\d+) (.*)", part).groups() for part in ends.split(", "))  # type: ignore[union-attr]
    killed = [int(r) for r, end in how.items() if end == "killed by SIGKILL"]
    survivors = sorted(int(r) for r, end in how.items() if end == "exit 1")
    assert len(killed) == 1 and sorted(killed + survivors) == [0, 1, 2, 3], lines
    own = [_OWN_RANK.match(line) for line in lines[:-1]]
    assert all(own), lines  # no grid, no traceback: every other line is one rank's account
    assert sorted(int(m.group(1)) for m in own if m) == survivors, lines
    run.assert_all_end()


# -- B: loopback -------------------------------------------------------------------------------
IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def _addr(hexaddr: str) -> IP:
    """An address of /proc/net/tcp{,6}: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _is_loopback(ip: IP) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _tcp_sockets(pid: int) -> list[tuple[str, IP, int, IP]]:
    """(state, local address, local port, remote address) of each TCP socket ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()
            if f[9] in inodes:
                (lhost, lport), (rhost, _) = (x.split(":") for x in (f[1], f[2]))
                out.append((f[3], _addr(lhost), int(lport, 16), _addr(rhost)))
    return out


def _routed_interface() -> str | None:
    """The interface of the default route (a non-loopback one with an address), if any."""
    try:
        rows = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return None
    return next((r.split()[0] for r in rows if r.split()[1] == "00000000"), None)


@pytest.mark.slow
@linux_only
def test_a_local_run_listens_and_talks_on_loopback_only(run_factory) -> None:
    # even when the environment points gloo at a routed interface, a local run stays on loopback
    iface = _routed_interface()
    run = run_factory(env={"GLOO_SOCKET_IFNAME": iface} if iface else None)
    workers = run.wait_training()
    socks = {pid: _tcp_sockets(pid) for pid in workers}
    listening = [
        (pid, ip, port) for pid, ss in socks.items() for st, ip, port, _ in ss if st == "0A"
    ]
    # rank 0 serves the store and gloo's device; every worker listens for its gloo pairs
    assert {pid for pid, _, _ in listening} == set(workers), socks
    assert len(listening) >= len(workers) + 1, socks
    bad = [(pid, str(ip), port) for pid, ip, port in listening if not _is_loopback(ip)]
    assert not bad, f"listening beyond loopback (ss -ltnp would show *:PORT or an address): {bad}"
    talking = [(pid, ip, peer) for pid, ss in socks.items() for st, ip, _, peer in ss if st == "01"]
    assert {pid for pid, _, _ in talking} == set(workers), socks
    assert all(_is_loopback(ip) and _is_loopback(peer) for _, ip, peer in talking), talking


@linux_only
def test_rank_zero_store_binds_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process: a world of one through :func:`local.local_store` listens on 127.0.0.1."""
    from datetime import timedelta

    monkeypatch.setattr(local, "_joined", None)
    assert local.local_store(timedelta(seconds=5)) is None  # not a spawned worker: env://
    sock = local.listener()
    port = sock.getsockname()[1]
    env = local.join_loopback(port, sock)
    assert env == {"GLOO_SOCKET_IFNAME": local.loopback_interface()}
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    args = local.local_store(timedelta(seconds=5))
    assert args is not None and args["rank"] == 0 and args["world_size"] == 1
    store = args["store"]
    store.set("k", "v")
    assert store.get("k") == b"v"
    mine = [(ip, p) for st, ip, p, _ in _tcp_sockets(os.getpid()) if st == "0A" and p == port]
    assert [str(ip) for ip, _ in mine] == ["127.0.0.1"], mine
    del store, args


# -- pieces ------------------------------------------------------------------------------------
def _failure(cause: BaseException) -> RankFailure:
    try:
        try:
            raise cause
        except Exception as e:
            raise RankFailure("step 3: rank 1 (stage 0 replica 1) failed ...\nstep | dev 0") from e
    except RankFailure as f:
        return f


def test_a_rank_that_lost_a_peer_reports_one_line() -> None:
    f = _failure(RuntimeError(_GLOO_PEER))
    assert lost_peer(f)
    assert rank_report(f, 1) == "step 3: rank 1 (stage 0 replica 1) failed ..."
    timeout = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms"
    )
    assert rank_report(timeout, 2) == "rank 2: RuntimeError: Timed out waiting 5000ms"
    nccl = dist.DistBackendError("NCCL communicator was aborted\nException raised from ...")
    assert lost_peer(nccl) and rank_report(nccl, 0).count("\n") == 0


def test_a_rank_that_failed_on_its_own_reports_everything() -> None:
    f = _failure(RuntimeError("layer exploded"))
    assert not lost_peer(f)
    assert rank_report(f, 1) == str(f) and "\nstep | dev 0" in rank_report(f, 1)
    assert rank_report(ValueError("bad\nshape"), 4) == "rank 4: ValueError: bad\nshape"
    assert rank_report(ValidationError("plan x"), 0) == "plan x"  # a DappleError: as it reads
    assert rank_report(KeyError("k")) == "KeyError: 'k'"  # torchrun: no rank prefix


def test_exit_text_names_signals() -> None:
    assert exit_text(1) == "exit 1"
    assert exit_text(-9) == "killed by SIGKILL"
    assert exit_text(-15) == "killed by SIGTERM"


@linux_only
def test_stop_signals_note_then_deliver_again_under_the_previous_handler() -> None:
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    # Python's own SIGINT handler, whatever an earlier test in this process left there (a full
    # fast-tier run once reached this test without it)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(RankFailure, match="workers stopped by SIGTERM"), StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 5
            while stop.received is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert stop.received == signal.SIGTERM and got == []  # only noted
        assert got == [signal.SIGTERM]  # then the caller's own handler ran
        with pytest.raises(KeyboardInterrupt) as plain, StopSignals():  # Python's default handler
            signal.raise_signal(signal.SIGINT)
        assert not isinstance(plain.value, Interrupted)  # no closing line: the CLI says it
        with pytest.raises(Interrupted), StopSignals(closing=lambda name: f"closing {name}"):
            signal.raise_signal(signal.SIGINT)  # the line written, the CLI adds none
        with StopSignals() as quiet:  # no signal: nothing happens
            pass
        assert quiet.received is None
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


@linux_only
def test_a_worker_whose_launcher_is_gone_exits_at_once() -> None:
    code = (
        "import os; from dapple.runtime.launch.local import end_with_launcher; "
        "end_with_launcher(os.getppid() + 100000); print('still here')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "still here" not in proc.stdout, proc.stderr
    ok = subprocess.run(
        [sys.executable, "-c", code.replace(" + 100000", "")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ok.returncode == 0 and ok.stdout == "still here\n", ok.stderr


def _two_groups_worker(rank: int, world: int, out: str) -> None:
    import torch

    from dapple.runtime import TrainConfig, init_distributed, shutdown_distributed

    sums, listening = [], []
    for _ in range(2):  # the second group binds the store's port again (rank 0)
        init_distributed(TrainConfig(timeout_s=30), world)
        t = torch.ones(1) * (rank + 1)
        dist.all_reduce(t)
        sums.append(float(t))
        listening += [str(ip) for st, ip, _, _ in _tcp_sockets(os.getpid()) if st == "0A"]
        shutdown_distributed()
    Path(out, f"rank{rank}.txt").write_text(f"{sums} {sorted(set(listening))}")


@pytest.mark.slow
@linux_only
def test_a_second_group_in_a_spawned_worker_stays_on_loopback(tmp_path: Path) -> None:
    from dapple.runtime import spawn

    spawn(_two_groups_worker, 2, str(tmp_path), timeout_s=60)
    for r in range(2):
        assert (tmp_path / f"rank{r}.txt").read_text() == "[3.0, 3.0] ['127.0.0.1']"

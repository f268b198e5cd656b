"""Issue 47's mini-batteries' shared parts: a case runs ``python -m dapple ...`` under
``timeout`` and is judged as the batteries judge it; a battery's cases run in one temporary
folder and their table is written as markdown; the tiny Mixtral configuration the batteries and
their tests build (``hf:DIR``).

A case is flagged **BAD** when it prints a traceback, exits with neither 0 nor 2, runs past
:data:`LIMIT_S`, refuses in more than one ``dapple: error:`` line, leaves a ``dapple`` process
of the battery's folder running, or fails a battery's own check (``after``); ``differs`` when
it ends otherwise than its expectation (``ok``: exit 0; ``refuse``: exit 2).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from _bench_common import HERE, header

__all__ = [
    "EXAMPLES", "GRACE_S", "LIMIT_S", "MARK", "TINY_MOE", "Case", "live_case", "marked",
    "processes_left", "run_battery", "run_case", "snapshot", "verdict",
]  # fmt: skip

LIMIT_S = 240
EXAMPLES = HERE.parent / "examples"

TINY_MOE = {
    "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
    "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}  # fmt: skip
"""A Mixtral of 2 blocks of 4 experts (``hf:DIR``, built from its config): 4 layers, trains
in seconds on 2 CPU processes."""

Case = tuple[str, str, list[str]]
"""``(group, expectation, argv)``."""


def run_case(argv: list[str], cwd: Path) -> tuple[int, str, float, bool, int]:
    """``(rc, first stderr line, seconds, traceback?, error lines)`` of one case."""
    start = time.monotonic()
    proc = subprocess.run(["timeout", "-k", "5", str(LIMIT_S), sys.executable, "-m", "dapple",
                           *argv], capture_output=True, text=True, cwd=cwd, check=False)  # fmt: skip
    took = time.monotonic() - start
    err = proc.stderr.strip().splitlines()
    shown = next((x for x in err if x.startswith("dapple")), err[0] if err else "")
    errors = sum(x.startswith(("dapple: error:", "dapple ")) and "error" in x for x in err)
    return proc.returncode, shown, took, "Traceback" in proc.stderr, errors


def verdict(expect: str, rc: int, tb: bool, errors: int) -> str:
    """``**BAD** (why)``, ``differs (expected ...)`` or ``as expected``."""
    if tb or rc not in (0, 2):
        return "**BAD**" + (" (traceback)" if tb else f" (rc {rc})")
    if rc == 2 and errors != 1:
        return f"**BAD** ({errors} error lines)"
    if (expect == "ok") != (rc == 0):
        return f"differs (expected {expect})"
    return "as expected"


def processes_left(w: Path) -> int:
    """``dapple`` processes still running whose command line names the battery's folder."""
    out = subprocess.run(["pgrep", "-f", f"dapple.*{w}"], capture_output=True, text=True)
    return len([p for p in out.stdout.split() if int(p) != os.getpid()])


def run_battery(
    name: str,
    title: str,
    cases: Callable[[Path], Sequence[Case]],
    setup: Callable[[Path], None],
    *,
    out: str,
    only: set[str] | None,
    after: Callable[[Path, int], str | None] = lambda _w, _i: None,
    flagged: str = "",
) -> None:
    """Run every case of ``cases(w)`` (``only``: those groups) in a temporary folder ``w``
    prepared by ``setup(w)``, and write the table to ``out``.

    Args:
        name: the script's name (``battery_47f``), for the command line and the folder.
        title: the table's title.
        after: a battery's own check of case ``i`` (its index in ``cases(w)``) once it ran:
            None, or why it is **BAD**.
        flagged: what else ``after`` flags, for the summary line.
    """
    command = " ".join(["python", f"benchmarks/{name}.py", *sys.argv[1:]])
    lines = header(title, command)
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"{name}-") as tmp:
        w = Path(tmp)
        setup(w)
        try:
            for i, (group, expect, argv) in enumerate(cases(w)):
                if only is not None and group not in only:
                    continue
                rc, line, took, tb, errors = run_case(argv, w)
                said = verdict(expect, rc, tb, errors)
                n = processes_left(w)
                why = f"{n} processes left" if n else after(w, i)
                if why is not None and not said.startswith("**BAD"):
                    said = f"**BAD** ({why})"
                shown = " ".join(a.replace(tmp, "W").replace(str(EXAMPLES), "examples")
                                 for a in argv)  # fmt: skip
                rows.append((group, shown, rc, line.replace(tmp, "W"), took, said))
                print(f"{rc:>3} {took:6.1f}s {shown[:90]} | {line[:120]} | {said}", flush=True)
        finally:
            for d in w.rglob("*"):  # a read-only folder of the setup, removable again
                if d.is_dir():
                    d.chmod(0o755)
    bad = sum(r[5].startswith("**BAD") for r in rows)
    differs = sum(r[5].startswith("differs") for r in rows)
    lines += ["", f"{len(rows)} cases; {bad} flagged BAD (traceback, exit code other than 0/2, "
              f"timeout after {LIMIT_S} s, more than one error line, a process left{flagged}), "
              f"{differs} "
              "outcomes other than expected. W is the setup's temporary directory.", "",
              "| # | group | command (`dapple ...`) | rc | first line of stderr | s | verdict |",
              "|---:|---|---|---:|---|---:|---|"]  # fmt: skip
    for i, (group, shown, rc, line, took, said) in enumerate(rows, 1):
        cell = line.replace("|", "\\|")
        lines.append(f"| {i} | {group} | `{shown}` | {rc} | {cell} | {took:.1f} | {said} |")
    Path(out).write_text("\n".join(lines) + "\n")


# -- cases that watch their processes and files (battery H) -----------------------------------

MARK = "DAPPLE_BATTERY_CASE"
"""The environment variable every process of a live case inherits (its tag): the processes a
case left are found by it, spawned workers included (their command lines do not name W)."""

GRACE_S = 10.0
"""How long a case's processes may take to end after its command has exited."""


def marked(tag: str) -> list[int]:
    """Pids of the running (not zombie) processes whose environment holds ``MARK=tag``."""
    want, out = f"{MARK}={tag}".encode(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if want in env and state not in ("Z", "X"):
            out.append(int(d.name))
    return out


def snapshot(w: Path) -> dict[str, str]:
    """Every file and folder under ``w`` (relative path) with its sha256 (``dir`` for a
    folder, ``unreadable`` for a file that cannot be read)."""
    import hashlib

    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(w):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), w)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            try:
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, w)] = hashlib.sha256(fh.read()).hexdigest()
            except OSError:
                out[os.path.relpath(p, w)] = "unreadable"
    return out


def live_case(
    argv: list[str],
    w: Path,
    tag: str,
    *,
    limit_s: float,
    poke: Callable[[subprocess.Popen[bytes], str], None] | None = None,
    prefix: Sequence[str] = (),
) -> tuple[int, str, float, bool, int, int, str]:
    """Run ``dapple argv`` in ``w`` as its own session, ``poke(proc, tag)`` beside it (a
    thread: a signal once its processes are up, say); then ``(rc, first stderr line, seconds,
    traceback?, error lines, processes of the case still running GRACE_S after it ended,
    stderr)``.
    Those processes are killed afterwards (SIGCONT first: a stopped one)."""
    import signal
    import threading

    env = {**os.environ, MARK: tag}
    with tempfile.TemporaryFile() as err_file:
        start = time.monotonic()
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "dapple", *argv], cwd=w, env=env,
                                stdout=subprocess.DEVNULL, stderr=err_file,
                                start_new_session=True)  # fmt: skip
        if poke is not None:
            threading.Thread(target=poke, args=(proc, tag), daemon=True).start()
        try:
            rc = proc.wait(limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        took = time.monotonic() - start
        end = time.monotonic() + GRACE_S
        while (left := marked(tag)) and time.monotonic() < end:
            time.sleep(0.2)
        for pid in left:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        err_file.seek(0)
        stderr = err_file.read().decode(errors="replace")
    lines = stderr.strip().splitlines()
    shown = next((x for x in lines if x.startswith("dapple")), lines[0] if lines else "")
    errors = sum(x.startswith(("dapple: error:", "dapple ")) and "error" in x for x in lines)
    return rc, shown, took, "Traceback" in stderr, errors, len(left), stderr

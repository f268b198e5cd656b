"""Battery H's cases (:mod:`battery_47h`), by the issue's item, and the files each group needs.

``{W}`` in an argument is the run's folder. A group's :func:`setup` makes its inputs with the
command line (``python -m dapple``) or the plan constructor, before its cases run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _battery import LIMIT_S, marked

__all__ = ["GROUPS", "H", "Poke", "setup"]


@dataclass
class Poke:
    """What is done to a running case: ``sig`` to the command's process once ``procs`` of its
    processes run (``worker``: to its last spawned worker instead), and once ``metrics`` (a
    file under W) holds a line when given; ``at``: when it was sent."""

    sig: int
    procs: int = 1
    metrics: str | None = None
    worker: bool = False
    at: list[float] = field(default_factory=list)

    def __call__(self, proc: subprocess.Popen[bytes], tag: str, w: Path) -> None:
        while proc.poll() is None:
            n = len(marked(tag))
            ready = n >= self.procs and (self.metrics is None or _lines(w / self.metrics) >= 1)
            if ready:
                break
            time.sleep(0.05)
        else:
            return
        time.sleep(0.5)
        target = _last_worker(tag) if self.worker else proc.pid
        if target is not None and proc.poll() is None:
            os.kill(target, self.sig)
            self.at.append(time.monotonic())


def _lines(p: Path) -> int:
    try:
        return len(p.read_text().splitlines())
    except OSError:
        return 0


def _last_worker(tag: str) -> int | None:
    """The newest spawned worker of the case (``multiprocessing.spawn`` in its command line)."""
    workers = []
    for pid in marked(tag):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmd:
            workers.append(pid)
    return max(workers) if workers else None


@dataclass
class H:
    """One case: its group, expectation (``ok``: exit 0; ``refuse``: exit 2 in one line;
    ``ended``: any end, bounded), arguments (``{W}`` is the folder), the pre-existing paths it
    may change (prefixes), its poke, limit, bound after the poke, and a check of what it did
    (None, or why it is wrong)."""

    group: str
    expect: str
    argv: list[str]
    writes: tuple[str, ...] = ()
    poke: Poke | None = None
    limit_s: float = LIMIT_S
    bound_s: float | None = None
    check: Callable[[Path, str], str | None] | None = None
    prefix: tuple[str, ...] = ()


# -- inputs -------------------------------------------------------------------------------------

DEPTH = 200_000
"""Nesting of the deeply nested documents (the issue's 200,000)."""

ZOO = ["-m", "transformer", "--set", "layers=2", "--set", "hidden=32"]
"""A zoo transformer of 4 layers (embedding, 2 blocks, head)."""

RO = "/sys/dapple-battery/x"
"""An output under a folder no process can create (root included): a read-only folder."""

KINDS: dict[str, bytes | None] = {
    "binary": bytes(range(256)) * 8,
    "non-utf8": '{"model_name": "caf\xe9"}'.encode("latin-1"),
    "empty": b"",
    "nested": b"[" * DEPTH + b"]" * DEPTH,
    "nested-object": b'{"a":' * DEPTH + b"1" + b"}" * DEPTH,
    "directory": None,
    "missing": None,
    "unreadable": b"{}",
}
"""The hostile file kinds of item 8 (JSON spellings); None: a folder, or nothing there."""

TOML_KINDS: dict[str, bytes | None] = {
    "binary": bytes(range(256)) * 8,
    "non-utf8": 'name = "caf\xe9"\n'.encode("latin-1"),
    "nested": b"a = " + b"[" * DEPTH + b"]" * DEPTH,
    "nested-table": b"a = " + b"{b=" * 5000 + b"1" + b"}" * 5000,
    "directory": None,
    "missing": None,
    "unreadable": b"",
}


def _dapple(*argv: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "dapple", *argv], cwd=cwd, capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"setup: dapple {' '.join(argv)} failed: {done.stderr[-2000:]}")


def _hostile(w: Path, suffix: str, kinds: dict[str, bytes | None]) -> None:
    for kind, content in kinds.items():
        p = w / f"x-{kind}{suffix}"
        if kind == "directory":
            p.mkdir(exist_ok=True)
        elif content is not None:
            p.write_bytes(content)
            if kind == "unreadable":
                p.chmod(0)


def _base(w: Path) -> None:
    from dapple.core.cluster_presets import load_cluster
    from dapple.core.plan import straight_plan

    if (w / "plan.json").exists():
        return
    _dapple("profile", "--analytic", "h100", *ZOO, "-o", "prof.json", cwd=w)
    _dapple("profile", "--analytic", "h100", "-m", "transformer", "--set", "layers=2", "--set",
            "hidden=64", "-o", "prof64.json", cwd=w)  # fmt: skip
    load_cluster("h100-8x").save(w / "cluster.json")
    _dapple("plan", "--profile", "prof.json", "--cluster", "cluster.json",
            "--global-batch-size", "8", "-o", "plan.json", cwd=w)  # fmt: skip
    straight_plan(5, [0], global_batch_size=2, num_micro_batches=1,
                  model_name="mlp").save(w / "mlp-plan.json")  # fmt: skip
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(w / "p4.json")
    (w / "text.txt").write_text("some text\n" * 20)
    (w / "graph.txt").write_text(
        "".join(f"node{i} -- L{i} -- forward_compute_time=1, backward_compute_time=1, "
                "activation_size=1, parameter_size=1\n" for i in (1, 2)) + "\tnode1 -- node2\n"
    )  # fmt: skip
    (w / "run.toml").write_text('[model]\nspec = "transformer"\nset = {layers = 2, hidden = 32}\n')
    _hostile(w, ".json", KINDS)
    _hostile(w, ".toml", TOML_KINDS)
    _hostile(w, ".txt", {k: v for k, v in KINDS.items() if not k.startswith("nested")})


def _checkpoints(w: Path) -> None:
    if (w / "ck_t").exists():
        return
    _dapple("train", "--plan", "p4.json", *ZOO, "--steps", "2", "--checkpoint-dir", "ck_t", cwd=w)
    _dapple("train", "--plan", "mlp-plan.json", "-m", "mlp", "--steps", "2", "--checkpoint-dir",
            "ck_mlp", cwd=w)  # fmt: skip


def _foreign(w: Path) -> None:
    """Checkpoint folders holding a foreign ``step-`` folder (``ck_k`` also a run's saves of
    steps 1 and 2); a text beside a foreign meta.json."""
    if not (w / "ck_k").exists():
        _dapple("train", "--plan", "p4.json", *ZOO, "--steps", "2", "--save-every", "1",
                "--checkpoint-dir", "ck_k", cwd=w)  # fmt: skip
    for d, step in (("ck_f1", 1), ("ck_f2", 1), ("ck_k", 0)):
        (w / d / f"step-{step:08d}").mkdir(parents=True, exist_ok=True)
        (w / d / f"step-{step:08d}" / "mine.txt").write_text("not dapple's")
    (w / "prep").mkdir(exist_ok=True)
    (w / "prep" / "meta.json").write_text('{"mine": true}')


def _elastic(w: Path) -> None:
    from dapple.core.cluster_presets import load_cluster

    if (w / "dp2.json").exists():
        return
    c = load_cluster("local-cpu").to_dict()
    c.update(name="cpu2", servers=1, devices_per_server=2)
    (w / "cpu2.json").write_text(json.dumps(c))
    _dapple("profile", "-m", "mlp", "--device", "cpu", "-o", "prof_mlp.json", cwd=w)
    _dapple("plan", "--profile", "prof_mlp.json", "--cluster", "cpu2.json",
            "--global-batch-size", "16", "--planner", "dp", "-o", "dp2.json", cwd=w)  # fmt: skip


def setup(group: str, w: Path) -> None:
    """The inputs of ``group``'s cases in ``w`` (kept for later groups of the same run)."""
    _base(w)
    if group in ("5", "6", "9"):
        _checkpoints(w)
    if group == "2":
        _foreign(w)
    if group == "7":
        _elastic(w)


# -- the cases, by item ------------------------------------------------------------------------


def _steps_in(path: str, want: list[int]) -> Callable[[Path, str], str | None]:
    def check(w: Path, _line: str) -> str | None:
        d = w / path
        got = sorted(int(p.name[5:]) for p in d.glob("step-*")) if d.is_dir() else []
        return None if got == want else f"checkpoints {got}, expected {want}"

    return check


def _said(text: str) -> Callable[[Path, str], str | None]:
    def check(_w: Path, line: str) -> str | None:
        return None if text in line else f"first line does not say {text!r}"

    return check


def _exists(path: str) -> Callable[[Path, str], str | None]:
    def check(w: Path, _line: str) -> str | None:
        return None if (w / path).exists() else f"{path} not written"

    return check


def _replanned(path: str) -> Callable[[Path, str], str | None]:
    def check(w: Path, _line: str) -> str | None:
        text = (w / path).read_text() if (w / path).exists() else ""
        return None if '"replan"' in text else "no re-plan event in the metrics"

    return check


def g1(_w: Path) -> list[H]:
    """Item 1: a command killed while its helpers run leaves none of them."""
    prof = ["profile", "-m", "transformer", "--set", "layers=4", "--set", "hidden=64",
            "--co-workers", "3", "-o", "cw.json", "--device", "cpu"]  # fmt: skip
    pl = ["plan-local", "-m", "transformer", "--set", "layers=4", "--set", "hidden=32",
          "--global-batch-size", "8", "--out-dir", "pl"]  # fmt: skip
    train = ["train", "--plan", "p4.json", *ZOO, "--steps", "100000", "--metrics", "m1.jsonl"]
    out = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        out += [
            H("1 orphans", "ended", prof, poke=Poke(sig, procs=3), limit_s=300),
            H("1 orphans", "ended", ["demo", "--out-dir", "demo1"], poke=Poke(sig, procs=3),
              limit_s=400),
            H("1 orphans", "ended", pl, poke=Poke(sig, procs=3), limit_s=400),
            H("1 orphans", "ended", train, poke=Poke(sig, procs=3, metrics="m1.jsonl"),
              limit_s=300),
            H("1 orphans", "ended", ["verify", "--plan", "p4.json", *ZOO],
              poke=Poke(sig, procs=3), limit_s=300),
        ]  # fmt: skip
    return out


def g2(_w: Path) -> list[H]:
    """Item 2: no input and nothing foreign is overwritten or deleted."""
    t = ["train", "--plan", "p4.json", *ZOO, "--steps", "2"]
    return [
        H("2 data loss", "refuse", ["data", "prepare", "text.txt", "-o", "text.txt"]),
        H("2 data loss", "refuse", ["data", "prepare", "text.txt", "-o", "prep/train.bin"]),
        H("2 data loss", "refuse", [*t, "--checkpoint-dir", "ck_f1", "--overwrite-checkpoints"]),
        # a folder with a foreign step- folder holds no run to continue or start over from
        H("2 data loss", "refuse", [*t, "--checkpoint-dir", "ck_f2", "--save-every", "1",
                                    "--keep", "1"]),
        # pruning deletes the run's own saves only (step-00000000 is foreign: a lost file if gone)
        H("2 data loss", "ok", ["train", "--plan", "p4.json", *ZOO, "--steps", "4", "--resume",
                                "--save-every", "1", "--keep", "1", "--checkpoint-dir", "ck_k"],
          writes=("ck_k/step-00000001", "ck_k/step-00000002"), check=_steps_in("ck_k", [0, 4])),
    ]  # fmt: skip


def g3(_w: Path) -> list[H]:
    """Item 3's reproductions not in item 8's file kinds."""
    sim = ["simulate", "--plan", "plan.json", "--profile", "prof.json", "--cluster",
           "cluster.json"]  # fmt: skip
    return [
        H("3 tracebacks", "refuse", [*sim, "--gantt", f"{RO}/g.png"]),
        H("3 tracebacks", "refuse", [*sim, "--memory", f"{RO}/m.png"]),
        H("3 tracebacks", "ok", [*sim, "--trace", "no/such/t.json"], check=_exists("no/such/t.json")),
        H("3 tracebacks", "ok", [*sim, "--layout", "no/where/l.svg"],
          check=_exists("no/where/l.svg")),
        H("3 tracebacks", "refuse", [*sim, "--gantt", "g.xyz"]),
        H("3 tracebacks", "refuse", ["profile", "-m", "transformer", "--set", "layers=2.5", "-o",
                                     "p.json", "--device", "cpu"]),
        H("3 tracebacks", "refuse", ["profile", "-m", "transformer", "--set", "seq_choices=[8,",
                                     "-o", "p.json"]),
        H("3 tracebacks", "refuse", ["demo", "--out-dir", RO]),
        H("3 tracebacks", "refuse", ["demo", "--corpus-mib", "nan", "--out-dir", "d3"]),
        H("3 tracebacks", "refuse", ["calibrate", "--repeats", "0", "-o", "c.json"]),
    ]  # fmt: skip


def g4(_w: Path) -> list[H]:
    """Item 4: work bounded by what can be used."""
    plan = ["plan", "--profile", "paper:bert48", "--cluster", "h100-8x", "--global-batch-size", "8"]
    return [
        H("4 unbounded", "ok", [*plan, "--servers", "128"], limit_s=120),
        H("4 unbounded", "ok", [*plan, "--servers", "256"], limit_s=120),
        H("4 unbounded", "ok", [*plan, "--servers", "125000"], limit_s=120),
        H("4 unbounded", "ok", ["plan", "--profile", "prof.json", "--cluster", "h100-8x",
                                "--global-batch-size", "8", "--servers", "1000000"], limit_s=120),
        # an 8 GiB address-space limit: were the size not checked first, the kernel would end it
        H("4 unbounded", "refuse", ["profile", "-m", "transformer", "--set", "hidden=10000000",
                                    "-o", "big.json", "--device", "cpu"],
          prefix=("prlimit", f"--as={8 * 2**30}"), limit_s=120),
        H("4 unbounded", "refuse", ["train", "--plan", "p4.json", "-m", "transformer", "--set",
                                    "layers=2", "--set", "hidden=10000000", "--steps", "1"],
          prefix=("prlimit", f"--as={8 * 2**30}"), limit_s=120),
    ]  # fmt: skip


def g5(_w: Path) -> list[H]:
    """Item 5: refused before any compute or worker (the seconds say how soon)."""
    return [
        H("5 late errors", "refuse", ["profile", "-m", "mlp", "--device", "cpu", "-o",
                                      f"{RO}/p.json"]),
        H("5 late errors", "refuse", ["calibrate", "-o", f"{RO}/c.json"]),
        H("5 late errors", "refuse", ["import-pipedream", "graph.txt", "-o", f"{RO}/i.json"]),
        H("5 late errors", "refuse", ["train", "--plan", "mlp-plan.json", "-m", "mlp",
                                      "--tensorboard", f"{RO}/tb"]),
        H("5 late errors", "refuse", ["demo", "--steps", "0", "--out-dir", "d5a"]),
        H("5 late errors", "refuse", ["demo", "--global-batch-size", "0", "--out-dir", "d5b"]),
        H("5 late errors", "refuse", ["calibrate", "--max-mb", "0", "-o", "c.json"]),
        H("5 late errors", "refuse", ["calibrate", "--max-mb", "nan", "-o", "c.json"]),
        H("5 late errors", "refuse", ["train", "--plan", "p4.json", *ZOO, "--checkpoint-dir",
                                      "ck_mlp", "--resume", "--steps", "4"]),
        H("5 late errors", "refuse", ["train", "--plan", "mlp-plan.json", "-m", "mlp", "--lr",
                                      "inf"]),
        H("5 late errors", "refuse", ["train", "--plan", "mlp-plan.json", "-m", "mlp", "--lr",
                                      "nan"]),
    ]  # fmt: skip


def g6(_w: Path) -> list[H]:
    """Item 6: nothing accepted that gives a wrong result in silence."""
    t = ["train", "--plan", "p4.json", *ZOO, "--checkpoint-dir", "ck_t", "--resume"]
    sim = ["simulate", "--plan", "plan.json", "--cluster", "cluster.json"]
    return [
        H("6 silent results", "refuse", [*t, "--steps", "1"]),
        H("6 silent results", "refuse", [*t, "--steps", "4", "--seed", "7"]),
        H("6 silent results", "refuse", [*sim, "--profile", "prof64.json"]),
        H("6 silent results", "refuse", ["train", "--plan", "plan.json", *ZOO, "--steps", "1",
                                         "--profile", "prof64.json", "--cluster", "cluster.json"]),
        H("6 silent results", "refuse", ["demo", "--corpus-mib", "-1", "--out-dir", "d6"]),
        H("6 silent results", "ok", ["export", *ZOO, "--checkpoint-dir", "ck_t", "--out-dir",
                                     "exported"], check=_exists("exported")),
    ]  # fmt: skip


def g7(_w: Path) -> list[H]:
    """Item 7: a stopped worker ends the run within about the timeout, or is lost (elastic)."""
    stop = Poke(signal.SIGSTOP, procs=3, metrics="m7.jsonl", worker=True)
    stop_e = Poke(signal.SIGSTOP, procs=3, metrics="m7e.jsonl", worker=True)
    return [
        H("7 hung worker", "ended", ["train", "--plan", "p4.json", *ZOO, "--steps", "100000",
                                     "--timeout-s", "20", "--metrics", "m7.jsonl"],
          poke=stop, limit_s=300, bound_s=45),
        H("7 hung worker", "ok", ["train", "--plan", "dp2.json", "-m", "mlp", "--steps", "600",
                                  "--timeout-s", "20", "--metrics", "m7e.jsonl", "--elastic",
                                  "--profile", "prof_mlp.json", "--cluster", "cpu2.json",
                                  "--checkpoint-dir", "ck7", "--save-every", "100",
                                  "--min-devices", "1"],
          poke=stop_e, limit_s=400, bound_s=200, check=_replanned("m7e.jsonl")),
    ]  # fmt: skip


def _file_args() -> list[tuple[str, list[str], str]]:
    """``(argument, argv with X for the file, suffix)`` of every command's file argument;
    the suffix says which kinds it is given (:func:`g8`)."""
    m = ["-m", "mlp", "--steps", "1"]
    return [
        ("plan --profile", ["plan", "--profile", "X", "--cluster", "cluster.json",
                            "--global-batch-size", "8"], ".json"),
        ("plan --cluster", ["plan", "--profile", "prof.json", "--cluster", "X",
                            "--global-batch-size", "8"], ".json"),
        ("simulate --plan", ["simulate", "--plan", "X", "--profile", "prof.json", "--cluster",
                             "cluster.json"], ".json"),
        ("simulate --profile", ["simulate", "--plan", "plan.json", "--profile", "X",
                                "--cluster", "cluster.json"], ".json"),
        ("simulate --cluster", ["simulate", "--plan", "plan.json", "--profile", "prof.json",
                                "--cluster", "X"], ".json"),
        ("train --plan", ["train", "--plan", "X", *m], ".json"),
        ("train --profile", ["train", "--plan", "mlp-plan.json", *m, "--profile", "X",
                             "--cluster", "cluster.json"], ".json"),
        ("train --cluster", ["train", "--plan", "mlp-plan.json", *m, "--cluster", "X"], ".json"),
        ("verify --plan", ["verify", "--plan", "X", "-m", "mlp"], ".json"),
        ("plan --cluster toml", ["plan", "--profile", "prof.json", "--cluster", "X",
                                 "--global-batch-size", "8"], ".toml"),
        ("plan --config", ["plan", "--profile", "prof.json", "--cluster", "cluster.json",
                           "--config", "X"], ".toml"),
        ("simulate --config", ["simulate", "--config", "X"], ".toml"),
        ("train --config", ["train", "--plan", "mlp-plan.json", *m, "--config", "X"], ".toml"),
        ("profile --config", ["profile", "-m", "mlp", "-o", "pc.json", "--config", "X"], ".toml"),
        ("import-pipedream", ["import-pipedream", "X", "-o", "imported.json"], ".graph"),
        ("data prepare", ["data", "prepare", "X", "-o", "prepared/train.bin"], ".txt"),
        ("train --data", ["train", "--plan", "mlp-plan.json", *m, "--data", "X"], ".bin"),
        ("train --eval-data", ["train", "--plan", "mlp-plan.json", *m, "--eval-data", "X"],
         ".bin"),
        ("train --weights", ["train", "--plan", "mlp-plan.json", *m, "--weights", "X"], ".bin"),
        ("generate --checkpoint-dir", ["generate", *ZOO, "--checkpoint-dir", "X", "--prompt",
                                       "hi"], ".bin"),
        ("export --checkpoint-dir", ["export", *ZOO, "--checkpoint-dir", "X", "--out-dir",
                                     "exported8"], ".bin"),
    ]  # fmt: skip


def _kinds(suffix: str) -> list[str]:
    """The hostile kinds an argument is given: JSON and TOML files every kind; a PipeDream
    graph every kind but empty; a text to prepare no JSON nesting either (text to it); a data,
    weights or checkpoint path an empty file, a folder where a file is read (or the other way)
    and nothing. ``unreadable`` is left out for root, who reads it."""
    kinds = list(TOML_KINDS if suffix == ".toml" else KINDS)
    if suffix == ".graph":
        kinds.remove("empty")
    elif suffix == ".txt":
        kinds = [k for k in kinds if k != "empty" and not k.startswith("nested")]
    elif suffix == ".bin":
        kinds = ["empty", "directory", "missing"]
    return [k for k in kinds if not (k == "unreadable" and os.geteuid() == 0)]


def g8(_w: Path) -> list[H]:
    """Item 8: every file argument of every command given each hostile kind."""
    out = []
    for _name, argv, suffix in _file_args():
        ext = {".graph": ".json", ".bin": ".json"}.get(suffix, suffix)
        for kind in _kinds(suffix):
            x = f"x-{kind}{ext}"
            out.append(H("8 file kinds", "refuse", [x if a == "X" else a for a in argv]))
    return out


def _outputs() -> list[tuple[str, list[str], str, bool]]:
    """``(output, argv with O for it, suffix, cheap)``: cheap outputs also run into missing
    folders (which are made)."""
    sim = ["simulate", "--plan", "plan.json", "--profile", "prof.json", "--cluster",
           "cluster.json"]  # fmt: skip
    t = ["train", "--plan", "mlp-plan.json", "-m", "mlp", "--steps", "1"]
    return [
        ("plan -o", ["plan", "--profile", "prof.json", "--cluster", "cluster.json",
                     "--global-batch-size", "8", "-o", "O"], ".json", True),
        ("simulate --gantt", [*sim, "--gantt", "O"], ".png", True),
        ("simulate --memory", [*sim, "--memory", "O"], ".png", True),
        ("simulate --trace", [*sim, "--trace", "O"], ".json", True),
        ("simulate --layout", [*sim, "--layout", "O"], ".svg", True),
        ("profile -o", ["profile", "-m", "mlp", "--device", "cpu", "-o", "O"], ".json", True),
        ("calibrate -o", ["calibrate", "-o", "O"], ".json", False),
        ("import-pipedream -o", ["import-pipedream", "graph.txt", "-o", "O"], ".json", True),
        ("data prepare -o", ["data", "prepare", "text.txt", "-o", "O"], ".bin", True),
        ("train --metrics", [*t, "--metrics", "O"], ".jsonl", True),
        ("train --loss-curve", [*t, "--loss-curve", "O"], ".png", True),
        ("train --tensorboard", [*t, "--tensorboard", "O"], "", True),
        ("train --checkpoint-dir", [*t, "--checkpoint-dir", "O"], "", True),
        ("export --out-dir", ["export", *ZOO, "--checkpoint-dir", "ck_t", "--out-dir", "O"], "",
         False),
        ("demo --out-dir", ["demo", "--out-dir", "O"], "", False),
        ("plan-local --out-dir", ["plan-local", "-m", "mlp", "--global-batch-size", "2",
                                  "--out-dir", "O"], "", False),
    ]  # fmt: skip


def g8o(w: Path) -> list[H]:
    """Item 8: every output into a read-only folder, under a file, and into missing folders."""
    (w / "a-file").write_text("x")
    out = []
    for i, (_name, argv, suffix, cheap) in enumerate(_outputs()):
        for where in (f"{RO}{i}{suffix}", f"a-file/o{i}{suffix}"):
            out.append(H("8 outputs", "refuse", [where if a == "O" else a for a in argv]))
        if cheap:
            where = f"miss{i}/a/b/o{i}{suffix}"
            out.append(H("8 outputs", "ok", [where if a == "O" else a for a in argv],
                         check=_exists(where), limit_s=300))  # fmt: skip
    return out


def g9(_w: Path) -> list[H]:
    """Item 9: what the README's user met (the rest is walked by hand)."""
    t = ["train", "--plan", "p4.json", *ZOO]
    return [
        H("9 readme", "ok", [*t, "--steps", "8", "--save-every", "3", "--checkpoint-dir", "ck9"],
          check=_steps_in("ck9", [3, 6, 8])),
        H("9 readme", "ok", ["generate", *ZOO, "--checkpoint-dir", "ck9", "--prompt", "ab",
                             "--max-new-tokens", "2"], check=_said("step 8")),
        H("9 readme", "ok", ["profile", "--config", "run.toml", "--analytic", "h100", "-o",
                             "p9.json"], check=_exists("p9.json")),
        H("9 readme", "ok", ["plan", "--profile", "prof.json", "--cluster", "h100-8x",
                             "--global-batch-size", "16", "--tensor-widths", "2"]),
    ]  # fmt: skip


GROUPS: dict[str, Callable[[Path], list[H]]] = {
    "1": g1, "2": g2, "3": g3, "4": g4, "5": g5, "6": g6, "7": g7, "8": g8, "8o": g8o, "9": g9,
}  # fmt: skip
"""The groups by item (``8``: file kinds; ``8o``: outputs)."""

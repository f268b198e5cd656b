"""Hostile inputs, every command and every file argument (issue 47, item 8).

Each case drives ``dapple.cli.main`` in this process with the work that must not start
(training, profiling, calibration, the demo's corpus) replaced by a function that fails the
test, and asserts: exit code 2, exactly one ``dapple: error:`` line on stderr (no traceback:
an exception escaping ``main`` fails the test), no file under the test's folder changed, and no
child process left. The loaders of profiles, plans, clusters and config files are fuzzed with
hypothesis: every document is loaded or refused with a :class:`~dapple.errors.DappleError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builders import boom, make_cluster, make_profile
from dapple.cli import main
from dapple.core.cluster_presets import load_cluster
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import ModelProfile
from dapple.errors import DappleError
from dapple.files.config_file import read_toml

ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False
DEPTH = 100_000
"""Nesting of the deeply nested documents (far past Python's recursion limit)."""

# -- the hostile files ----------------------------------------------------------------------


def _json_kinds() -> dict[str, bytes | None]:
    """File contents by kind; None: a directory (``"directory"``) or no file (``"missing"``)."""
    return {
        "binary": bytes(range(256)) * 8,
        "non-utf8": '{"model_name": "caf\xe9"}'.encode("latin-1"),
        "empty": b"",
        "nested": b"[" * DEPTH + b"]" * DEPTH,
        "nested-object": b'{"a":' * DEPTH + b"1" + b"}" * DEPTH,
        "directory": None,
        "missing": None,
        "unreadable": b"{}",
    }


def _toml_kinds() -> dict[str, bytes | None]:
    return {
        "binary": bytes(range(256)) * 8,
        "non-utf8": 'name = "caf\xe9"\n'.encode("latin-1"),
        "nested": b"a = " + b"[" * DEPTH + b"]" * DEPTH,
        "nested-table": b"a = " + b"{b=" * 2000 + b"1" + b"}" * 2000,
        "directory": None,
        "missing": None,
        "unreadable": b"",
    }


def _make(folder: Path, kind: str, content: bytes | None, suffix: str) -> Path:
    """The hostile file ``kind`` in ``folder``."""
    p = folder / f"hostile-{kind}{suffix}"
    if kind == "directory":
        p.mkdir()
    elif content is not None:
        p.write_bytes(content)
        if kind == "unreadable":
            p.chmod(0)
    return p


# -- the valid files every case starts from ---------------------------------------------------


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Valid inputs (a 4-layer profile with its cluster and plan; a plan of the zoo mlp) and
    the work that must not start replaced by :func:`boom`."""
    for target in (
        "dapple.runtime.train",
        "dapple.runtime.launch.early.EarlyWorkers",
        "dapple.profiler.measure.profile_workload",
        "dapple.calibrate.machine.calibrate",
        "dapple.cli._demo_corpus.stdlib_sources",
    ):
        monkeypatch.setattr(target, boom)
    monkeypatch.setattr(importlib.import_module("dapple.datasets.prepare"), "_byte_tokens", boom)
    monkeypatch.chdir(tmp_path)
    make_profile(4).save(tmp_path / "profile.json")
    make_cluster().save(tmp_path / "cluster.json")
    straight_plan(4, [0], global_batch_size=2, num_micro_batches=1, model_name="toy").save(
        tmp_path / "plan.json"
    )
    straight_plan(5, [0], global_batch_size=2, num_micro_batches=1, model_name="mlp").save(
        tmp_path / "mlp-plan.json"
    )
    (tmp_path / "text.txt").write_text("some text\n" * 20)
    (tmp_path / "graph.txt").write_text(
        "".join(f"node{i} -- L{i} -- forward_compute_time=1, backward_compute_time=1, "
                "activation_size=1, parameter_size=1\n" for i in (1, 2)) + "\tnode1 -- node2\n"
    )  # fmt: skip
    return {p.stem: p for p in tmp_path.iterdir()}


def _snapshot(root: Path) -> dict[str, tuple[bool, str]]:
    out: dict[str, tuple[bool, str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.join(dirpath, d)] = (True, "")
        for f in filenames:
            p = Path(dirpath, f)
            try:
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            except OSError:  # the unreadable file
                digest = f"unreadable {p.stat().st_size}"
            out[str(p)] = (False, digest)
    return out


def _children() -> list[int]:
    """This process's live child processes (Linux /proc; [] elsewhere)."""
    me, kids = os.getpid(), []
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    for d in proc.iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == me and stat[0] not in ("Z", "X"):
                kids.append(int(d.name))
    return kids


def _refused(argv: list[str], root: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``dapple argv``; assert the clean refusal (see the module docstring)."""
    before, kids = _snapshot(root), _children()
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (argv, rc, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dapple: error: "), (argv, err)
    assert "Traceback" not in err
    assert _snapshot(root) == before, f"{argv} changed files"
    assert _children() == kids, f"{argv} left processes behind"
    return lines[0]


# -- every command x every file argument x every hostile kind --------------------------------

M = ["-m", "mlp"]
JSON_ARGS: list[tuple[str, Callable[[dict[str, Path], Path], list[str]]]] = [
    ("plan --profile", lambda f, x: ["plan", "--profile", str(x), "--cluster", str(f["cluster"]),
                                     "--global-batch-size", "8"]),
    ("plan --cluster", lambda f, x: ["plan", "--profile", str(f["profile"]), "--cluster", str(x),
                                     "--global-batch-size", "8"]),
    ("simulate --plan", lambda f, x: ["simulate", "--plan", str(x), "--profile", str(f["profile"]),
                                      "--cluster", str(f["cluster"])]),
    ("simulate --profile", lambda f, x: ["simulate", "--plan", str(f["plan"]), "--profile",
                                         str(x), "--cluster", str(f["cluster"])]),
    ("simulate --cluster", lambda f, x: ["simulate", "--plan", str(f["plan"]), "--profile",
                                         str(f["profile"]), "--cluster", str(x)]),
    ("train --plan", lambda f, x: ["train", "--plan", str(x), *M]),
    ("train --profile", lambda f, x: ["train", "--plan", str(f["mlp-plan"]), *M, "--profile",
                                      str(x)]),
    ("train --cluster", lambda f, x: ["train", "--plan", str(f["mlp-plan"]), *M, "--cluster",
                                      str(x)]),
    ("verify --plan", lambda f, x: ["verify", "--plan", str(x), *M]),
]  # fmt: skip
TOML_ARGS: list[tuple[str, Callable[[dict[str, Path], Path], list[str]]]] = [
    ("plan --cluster", lambda f, x: ["plan", "--profile", str(f["profile"]), "--cluster", str(x),
                                     "--global-batch-size", "8"]),
    ("plan --config", lambda f, x: ["plan", "--profile", str(f["profile"]), "--cluster",
                                    str(f["cluster"]), "--global-batch-size", "8", "--config",
                                    str(x)]),
    ("train --config", lambda f, x: ["train", "--plan", str(f["mlp-plan"]), *M, "--config",
                                     str(x)]),
    ("profile --config", lambda f, x: ["profile", *M, "-o", "profiled.json", "--config", str(x)]),
]  # fmt: skip
TEXT_ARGS: list[tuple[str, Callable[[dict[str, Path], Path], list[str]]]] = [
    ("import-pipedream", lambda f, x: ["import-pipedream", str(x), "-o", "imported.json"]),
    ("data prepare", lambda f, x: ["data", "prepare", str(x), "-o", "out/train.bin"]),
]
DATA_ARGS: list[tuple[str, Callable[[dict[str, Path], Path], list[str]]]] = [
    ("train --data", lambda f, x: ["train", "--plan", str(f["mlp-plan"]), *M, "--data", str(x)]),
    ("train --eval-data", lambda f, x: ["train", "--plan", str(f["mlp-plan"]), *M, "--eval-data",
                                        str(x)]),
    ("train --weights", lambda f, x: ["train", "--plan", str(f["mlp-plan"]), *M, "--weights",
                                      str(x)]),
    ("generate --checkpoint-dir", lambda f, x: ["generate", *M, "--checkpoint-dir", str(x),
                                                "--prompt", "hi"]),
    ("export --checkpoint-dir", lambda f, x: ["export", *M, "--checkpoint-dir", str(x),
                                              "--out-dir", "exported"]),
]  # fmt: skip


def _cases(args: list[Any], kinds: dict[str, bytes | None], suffix: str) -> list[Any]:
    return [
        pytest.param(build, kind, content, suffix, id=f"{name} {kind}")
        for name, build in args
        for kind, content in kinds.items()
    ]


TEXT_KINDS = {
    k: v for k, v in _json_kinds().items() if k not in ("empty", "nested", "nested-object")
}
"""Deep brackets are text to ``data prepare``."""
DATA_KINDS = {k: v for k, v in _json_kinds().items() if k in ("empty", "directory", "missing")}


@pytest.mark.parametrize(
    ("build", "kind", "content", "suffix"),
    _cases(JSON_ARGS, _json_kinds(), ".json")
    + _cases(TOML_ARGS, _toml_kinds(), ".toml")
    + _cases(TEXT_ARGS[:1], {k: v for k, v in _json_kinds().items() if k != "empty"}, ".txt")
    + _cases(TEXT_ARGS[1:], TEXT_KINDS, ".txt")
    + _cases(DATA_ARGS, DATA_KINDS, ".bin"),
)
def test_hostile_file_argument(
    build: Callable[[dict[str, Path], Path], list[str]],
    kind: str,
    content: bytes | None,
    suffix: str,
    files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if kind == "unreadable" and ROOT:
        pytest.skip("root reads files whatever their permissions")
    hostile = _make(tmp_path, kind, content, suffix)
    _refused(build(files, hostile), tmp_path, capsys)


# -- outputs into read-only, missing or non-directory folders --------------------------------

OUTPUTS: list[tuple[str, Callable[[dict[str, Path], str], list[str]]]] = [
    ("plan -o", lambda f, o: ["plan", "--profile", str(f["profile"]), "--cluster",
                              str(f["cluster"]), "--global-batch-size", "8", "-o", o]),
    ("simulate --gantt", lambda f, o: ["simulate", "--plan", str(f["plan"]), "--profile",
                                       str(f["profile"]), "--cluster", str(f["cluster"]),
                                       "--gantt", o + ".png"]),
    ("simulate --memory", lambda f, o: ["simulate", "--plan", str(f["plan"]), "--profile",
                                        str(f["profile"]), "--cluster", str(f["cluster"]),
                                        "--memory", o + ".png"]),
    ("simulate --trace", lambda f, o: ["simulate", "--plan", str(f["plan"]), "--profile",
                                       str(f["profile"]), "--cluster", str(f["cluster"]),
                                       "--trace", o]),
    ("simulate --layout", lambda f, o: ["simulate", "--plan", str(f["plan"]), "--profile",
                                        str(f["profile"]), "--cluster", str(f["cluster"]),
                                        "--layout", o + ".svg"]),
    ("profile -o", lambda f, o: ["profile", *M, "-o", o, "--device", "cpu"]),
    ("calibrate -o", lambda f, o: ["calibrate", "-o", o]),
    ("import-pipedream -o", lambda f, o: ["import-pipedream", str(f["graph"]), "-o", o]),
    ("data prepare -o", lambda f, o: ["data", "prepare", str(f["text"]), "-o", o]),
    ("train --metrics", lambda f, o: ["train", "--plan", str(f["mlp-plan"]), *M, "--metrics", o]),
    ("train --loss-curve", lambda f, o: ["train", "--plan", str(f["mlp-plan"]), *M,
                                         "--loss-curve", o + ".png"]),
    ("train --tensorboard", lambda f, o: ["train", "--plan", str(f["mlp-plan"]), *M,
                                          "--tensorboard", o]),
    ("train --checkpoint-dir", lambda f, o: ["train", "--plan", str(f["mlp-plan"]), *M,
                                             "--checkpoint-dir", o]),
    ("demo --out-dir", lambda f, o: ["demo", "--out-dir", o]),
    ("plan-local --out-dir", lambda f, o: ["plan-local", *M, "--global-batch-size", "2",
                                           "--out-dir", o]),
]  # fmt: skip
"""Every command's output arguments (files and directories), from the valid inputs."""
WRITTEN_FOR_REAL = {"plan -o", "simulate --gantt", "simulate --memory", "simulate --trace",
                    "simulate --layout", "import-pipedream -o"}  # fmt: skip
"""The outputs of commands that do no heavy work (nothing stubbed): they run and write."""

SYS = Path("/sys")
"""A folder no process (not even root) can create files in, on Linux."""


def _where(tmp_path: Path, how: str) -> str:
    if how == "read-only":
        if not (sys.platform.startswith("linux") and SYS.is_dir()):
            pytest.skip("needs Linux /sys")
        return str(SYS / "dapple-out" / "x")
    if how == "missing-folder":
        return str(tmp_path / "no" / "such" / "x")
    (tmp_path / "a-file").write_text("x")  # "under-a-file"
    return str(tmp_path / "a-file" / "x")


@pytest.mark.parametrize("how", ["read-only", "under-a-file"])
@pytest.mark.parametrize(("build"), [pytest.param(b, id=n) for n, b in OUTPUTS])
def test_unwritable_output(
    build: Callable[[dict[str, Path], str], list[str]],
    how: str,
    files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _refused(build(files, _where(tmp_path, how)), tmp_path, capsys)


@pytest.mark.parametrize(("name", "build"), [pytest.param(n, b, id=n) for n, b in OUTPUTS])
def test_missing_output_folders_are_made(
    name: str,
    build: Callable[[dict[str, Path], str], list[str]],
    files: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One rule for every output: folders missing above it are created when it is written;
    the check before the work accepts them and creates nothing."""
    argv = build(files, _where(tmp_path, "missing-folder"))
    out = Path(argv[-1])
    if name in WRITTEN_FOR_REAL:
        assert main(argv) == 0, capsys.readouterr().err
        assert out.is_file()
        return
    with pytest.raises(AssertionError, match="work started"):  # past every check, to the work
        main(argv)
    assert "dapple: error" not in capsys.readouterr().err
    if name != "demo --out-dir":  # the demo makes its folder as the first step of its work
        assert not (tmp_path / "no").exists()  # the check made no folder


def test_writers_make_missing_folders(tmp_path: Path) -> None:
    """The writers behind the stubbed commands' outputs create the folders above them."""
    from dapple.runtime.metrics import MetricsSink
    from dapple.runtime.reporting import write_loss_curve
    from dapple.runtime.step_metrics import StepMetrics
    from dapple.runtime.train_config import TrainConfig

    step = StepMetrics(step=0, loss=1.0, step_ms=1.0, samples_per_s=1.0, peak_memory_bytes=(0,),
                       memory_kind="held_activations")  # fmt: skip
    assert write_loss_curve([step], tmp_path / "a" / "b" / "loss.png").is_file()
    plan = straight_plan(4, [0], global_batch_size=2, num_micro_batches=1)
    jsonl = tmp_path / "c" / "d" / "m.jsonl"
    sink = MetricsSink(plan, TrainConfig(metrics_path=str(jsonl)), rank=0, memory_kind="x")
    sink.close()
    assert jsonl.is_file()
    make_profile(4).save(tmp_path / "e" / "f" / "profile.json")
    assert (tmp_path / "e" / "f" / "profile.json").is_file()


# -- bad values refused before any work -------------------------------------------------------

BAD_VALUES = [
    ["profile", "-m", "transformer", "--set", "layers=2.5", "-o", "p.json", "--device", "cpu"],
    ["profile", "-m", "transformer", "--set", "seq_choices=[8,", "-o", "p.json"],
    ["calibrate", "--repeats", "0", "-o", "c.json"],
    ["calibrate", "--max-mb", "0", "-o", "c.json"],
    ["calibrate", "--max-mb", "nan", "-o", "c.json"],
    ["demo", "--corpus-mib", "nan"],
    ["demo", "--corpus-mib", "-1"],
    ["demo", "--steps", "0"],
    ["demo", "--global-batch-size", "0"],
    ["simulate", "--plan", "plan.json", "--profile", "profile.json", "--cluster",
     "cluster.json", "--gantt", "g.xyz"],
    ["train", "--plan", "mlp-plan.json", *M, "--lr", "inf"],
    ["train", "--plan", "mlp-plan.json", *M, "--lr", "nan"],
]  # fmt: skip


@pytest.mark.parametrize("argv", [pytest.param(a, id=" ".join(a[:5])) for a in BAD_VALUES])
def test_bad_value_refused_first(
    argv: list[str], files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _refused(argv, tmp_path, capsys)


# -- fuzzing the loaders ----------------------------------------------------------------------

_SCALARS = (
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats() | st.text(max_size=6)
)
_JSON = st.recursive(
    _SCALARS,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
    max_leaves=10,
)
_VALID = {
    "profile": make_profile(4).to_dict(),
    "cluster": make_cluster().to_dict(),
    "plan": straight_plan(4, [0], global_batch_size=2, num_micro_batches=1).to_dict(),
}
_LOADERS: dict[str, Callable[[Path], Any]] = {
    "profile": ModelProfile.load,
    "plan": Plan.load,
    "cluster": lambda p: load_cluster(str(p)),
}


def _mutated(doc: Any, data: st.DataObject) -> Any:
    """``doc`` with the value at a random path (possibly the root) replaced by any JSON."""
    path: list[Any] = []
    cur = doc
    while isinstance(cur, (dict, list)) and cur and data.draw(st.booleans()):
        keys = list(cur) if isinstance(cur, dict) else list(range(len(cur)))
        path.append(data.draw(st.sampled_from(keys)))
        cur = cur[path[-1]]
    value = data.draw(_JSON)
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return doc


def _loads_or_refuses(load: Callable[[Path], Any], path: Path) -> None:
    with contextlib.suppress(DappleError):
        load(path)


_FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize("what", sorted(_LOADERS))
@_FUZZ
@given(data=st.data())
def test_fuzzed_json_documents_load_or_are_refused(
    what: str, data: st.DataObject, tmp_path: Path
) -> None:
    doc = _mutated(json.loads(json.dumps(_VALID[what])), data)
    p = tmp_path / f"{what}.json"
    p.write_text(json.dumps(doc))
    _loads_or_refuses(_LOADERS[what], p)


@pytest.mark.parametrize("what", ["cluster", "config"])
@_FUZZ
@given(text=st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_fuzzed_toml_text_loads_or_is_refused(what: str, text: str, tmp_path: Path) -> None:
    p = tmp_path / f"{what}.toml"
    p.write_bytes(text.encode("utf-8", "surrogatepass"))
    _loads_or_refuses(lambda q: load_cluster(str(q)) if what == "cluster" else read_toml(q), p)


_TOML_VALUES = st.recursive(
    st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=6),
    lambda c: st.lists(c, max_size=3),
    max_leaves=6,
)


@_FUZZ
@given(
    fields=st.dictionaries(
        st.sampled_from(["servers", "devices_per_server", "device_memory_gib", "name", "x"]),
        _TOML_VALUES,
        max_size=4,
    )
)
def test_fuzzed_toml_cluster_fields_load_or_are_refused(
    fields: dict[str, Any], tmp_path: Path
) -> None:
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    p = tmp_path / "c.toml"
    p.write_text("\n".join(lines) + "\n")
    _loads_or_refuses(lambda q: load_cluster(str(q)), p)

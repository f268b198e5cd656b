"""Checkpoints by layer: save under one stage cut, resume under another; atomicity; bad input."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dapple.errors import DappleError
from dapple.models.workload import Workload
from dapple.runtime.checkpoint import (
    CHECKPOINT_SCHEMA_VERSION,
    CRASH_IN_SAVE_ENV,
    MANIFEST_NAME,
    CheckpointError,
    CheckpointMeta,
    capture_rng_state,
    check_compatible,
    check_writable,
    latest_checkpoint,
    list_checkpoints,
    load_layer_states,
    load_rng_state,
    read_checkpoint,
    restore_rng_state,
    restore_stage,
    save_checkpoint,
    stage_layer_states,
    step_dir,
)

N = 4
G = 8


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)


def _workload(hidden: int = 7, name: str = "ckpt-mlp", n: int = N) -> Workload:
    dims = [5] + [hidden] * (n - 1) + [3]

    def block(i: int):
        if i == 1:  # a layer with buffers (running statistics) besides parameters
            return lambda: nn.Sequential(
                nn.Linear(dims[i], dims[i + 1]), nn.BatchNorm1d(dims[i + 1])
            )
        return lambda: nn.Sequential(nn.Linear(dims[i], dims[i + 1]), nn.Tanh())

    return Workload(
        name=name,
        layer_factories=[block(i) for i in range(n)],
        make_batch=_batch,
        loss_fn=F.mse_loss,
    )


def _opt(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


class _Run:
    """A model cut into stages, each with its own optimizer (what one pipeline rank holds)."""

    def __init__(self, wl: Workload, bounds: list[int], kind: str) -> None:
        self.bounds = bounds
        self.stages = [wl.build_stage(a, b, seed=0) for a, b in itertools.pairwise(bounds)]
        self.opts = [_opt(kind, list(s.parameters())) for s in self.stages]
        self.wl = wl

    def step(self, t: int) -> float:
        x, y = self.wl.make_batch(G, 100 + t)
        for o in self.opts:
            o.zero_grad()
        out = x
        for s in self.stages:
            out = s(out)
        loss = self.wl.loss_fn(out, y)
        loss.backward()
        for o in self.opts:
            o.step()
        return float(loss.detach())

    def save(self, root: Path, step: int, *, keep: int | None = None) -> Path:
        """Save as a 2-replica-per-stage run would: replica 0 writes, replica 1 writes nothing."""
        meta = CheckpointMeta(
            model_name=self.wl.name,
            num_layers=self.wl.num_layers,
            step=step,
            samples_consumed=step * G,
            plan={"cut": self.bounds},
            optimizer_type=type(self.opts[0]).__name__,
            world_size=2 * len(self.stages),
        )
        path = None
        last = 2 * len(self.stages) - 1
        for rank in range(2 * len(self.stages)):
            s, replica = divmod(rank, 2)
            states = (
                stage_layer_states(self.stages[s], self.bounds[s], self.opts[s])
                if replica == 0
                else {}
            )
            path = save_checkpoint(
                root, meta, states, rank=rank, write_manifest=rank == last, keep=keep
            )
        assert path is not None
        return path

    def restore(self, root: Path) -> int:
        ck = latest_checkpoint(root)
        assert ck is not None
        check_compatible(ck, model_name=self.wl.name, num_layers=self.wl.num_layers)
        for s, o, a in zip(self.stages, self.opts, self.bounds, strict=False):
            restore_stage(ck, s, a, o)
        return ck.step

    def flat(self) -> dict[str, torch.Tensor]:
        out = {}
        for s, a in zip(self.stages, self.bounds, strict=False):
            for k, v in s.state_dict().items():
                i, rest = k.split(".", 1)
                out[f"{a + int(i)}.{rest}"] = v
        return out


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("resume_cut", [[0, 2, 4], [0, 3, 4], [0, 1, 2, 3, 4], [0, 4]])
def test_resume_under_any_cut_equals_uninterrupted(
    tmp_path: Path, kind: str, resume_cut: list[int]
) -> None:
    wl = _workload()
    ref = _Run(wl, [0, 4], kind)
    ref_losses = [ref.step(t) for t in range(5)]

    first = _Run(wl, [0, 2, 4], kind)  # saved as a 2:2 run
    losses = [first.step(t) for t in range(3)]
    first.save(tmp_path, 3)
    first.step(3)  # progress after the checkpoint is lost

    second = _Run(wl, resume_cut, kind)
    start = second.restore(tmp_path)
    assert start == 3
    losses += [second.step(t) for t in range(start, 5)]
    assert losses == ref_losses  # exact: same arithmetic, only the cut differs
    got, want = second.flat(), ref.flat()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_optimizer_state_is_keyed_by_name_and_rebuilt_in_new_order(tmp_path: Path) -> None:
    wl = _workload()
    run = _Run(wl, [0, 2, 4], "adam")
    run.step(0)
    ck = read_checkpoint(run.save(tmp_path, 1))
    states = load_layer_states(ck, [2])
    assert set(states[2].optimizer) == {"0.weight", "0.bias"}
    assert set(states[2].optimizer["0.weight"]) == {"step", "exp_avg", "exp_avg_sq"}
    whole = wl.build_model()
    opt = torch.optim.Adam(whole.parameters(), lr=0.01)
    restore_stage(ck, whole, 0, opt)
    w = whole[2][0].weight
    assert torch.equal(
        opt.state[w]["exp_avg"], run.opts[1].state[run.stages[1][0][0].weight]["exp_avg"]
    )
    # the BatchNorm running statistics (buffers) came back too
    assert torch.equal(whole[1][1].running_mean, run.stages[0][1][1].running_mean)


def test_manifest_lists_every_layer_once_with_sizes_and_checksums(tmp_path: Path) -> None:
    run = _Run(_workload(), [0, 1, 4], "sgd")
    run.step(0)
    d = run.save(tmp_path, 1)
    assert d == step_dir(tmp_path, 1)
    m = json.loads((d / MANIFEST_NAME).read_text())
    assert m["schema_version"] == CHECKPOINT_SCHEMA_VERSION
    assert (m["model_name"], m["num_layers"], m["step"], m["samples_consumed"]) == (
        "ckpt-mlp",
        N,
        1,
        G,
    )
    assert m["plan"] == {"cut": [0, 1, 4]}
    assert [e["index"] for e in m["layers"]] == list(range(N))
    for e in m["layers"]:
        data = (d / e["file"]).read_bytes()
        assert len(data) == e["bytes"] and hashlib.sha256(data).hexdigest() == e["sha256"]
    assert m["layers"][0]["shapes"] == {"0.weight": [7, 5], "0.bias": [7]}
    # replicas wrote no layer file, only their RNG state
    assert sorted(p.name for p in d.glob("layer-*")) == [f"layer-{i:05d}.pt" for i in range(N)]
    assert sorted(m["rng"]) == ["0", "1", "2", "3"]
    parts = [json.loads(p.read_text()) for p in d.glob("part-*rank00001.json")]
    assert parts and parts[0]["layers"] == []


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    run = _Run(_workload(), [0, 4], "sgd")
    for t in range(5):
        run.step(t)
        run.save(tmp_path, t + 1, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and ck.step == 5


def test_latest_skips_incomplete_and_empty(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "nothing") is None
    assert latest_checkpoint(tmp_path) is None
    run = _Run(_workload(), [0, 4], "sgd")
    run.save(tmp_path, 1)
    half = step_dir(tmp_path, 2)
    half.mkdir()
    (half / "layer-00000.pt").write_bytes(b"partial")
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and ck.step == 1


def test_crash_mid_save_leaves_previous_checkpoint_whole(tmp_path: Path, monkeypatch) -> None:
    run = _Run(_workload(), [0, 2, 4], "sgd")
    run.step(0)
    run.save(tmp_path, 1)
    before = _tree(tmp_path)

    class Died(BaseException):
        pass

    def die(code: int) -> None:
        raise Died(code)

    monkeypatch.setattr(os, "_exit", die)
    monkeypatch.setenv(CRASH_IN_SAVE_ENV, "2")
    run.step(1)
    with pytest.raises(Died):
        run.save(tmp_path, 2)
    assert (step_dir(tmp_path, 2) / "layer-00000.pt").exists()
    assert not (step_dir(tmp_path, 2) / MANIFEST_NAME).exists()
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and ck.step == 1
    assert {k: v for k, v in _tree(tmp_path).items() if k.startswith("step-00000001")} == before
    fresh = _Run(_workload(), [0, 4], "sgd")
    assert fresh.restore(tmp_path) == 1
    monkeypatch.delenv(CRASH_IN_SAVE_ENV)
    run.save(tmp_path, 2)  # a later save of the same step completes over the debris
    assert latest_checkpoint(tmp_path).step == 2  # type: ignore[union-attr]


@pytest.mark.slow
def test_real_process_killed_mid_save(tmp_path: Path) -> None:
    """A process that really dies (os._exit) after some layer files: the old checkpoint loads."""
    script = textwrap.dedent(
        f"""
        import torch
        from torch import nn
        from dapple.runtime.checkpoint import CheckpointMeta, save_checkpoint, stage_layer_states
        m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))
        for step in (1, 2):
            meta = CheckpointMeta(model_name="k", num_layers=3, step=step)
            save_checkpoint({str(tmp_path)!r}, meta, stage_layer_states(m, 0))
        """
    )
    env = dict(os.environ, **{CRASH_IN_SAVE_ENV: "2"})
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert r.returncode == 3, r.stderr.decode()[-2000:]
    assert sorted(p.name for p in step_dir(tmp_path, 2).glob("layer-*")) == ["layer-00000.pt"]
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and ck.step == 1
    assert set(load_layer_states(ck, range(3))) == {0, 1, 2}


def test_manifest_not_written_when_a_layer_is_missing(tmp_path: Path) -> None:
    run = _Run(_workload(), [0, 2, 4], "sgd")
    meta = CheckpointMeta(model_name="ckpt-mlp", num_layers=N, step=1)
    with pytest.raises(CheckpointError, match=r"layers \[2, 3\] were written by no rank"):
        save_checkpoint(tmp_path, meta, stage_layer_states(run.stages[0], 0))
    assert latest_checkpoint(tmp_path) is None


def test_rng_states_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    state = capture_rng_state()
    meta = CheckpointMeta(model_name="r", num_layers=1, step=1)
    save_checkpoint(tmp_path, meta, stage_layer_states(nn.Sequential(nn.Linear(2, 2)), 0), rank=0)
    a = (torch.rand(3), random.random(), np.random.rand(2))
    ck = latest_checkpoint(tmp_path)
    assert ck is not None
    loaded = load_rng_state(ck, 0)
    assert loaded is not None and load_rng_state(ck, 7) is None
    restore_rng_state(loaded)
    b = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and np.array_equal(a[2], b[2])
    restore_rng_state(state)  # an in-memory capture restores too
    c = torch.rand(3)
    restore_rng_state(state)
    assert torch.equal(torch.rand(3), c)


# -- bad input: one line, names the file, never touches the checkpoints -------------------------
@pytest.fixture
def saved(tmp_path: Path) -> Path:
    run = _Run(_workload(), [0, 2, 4], "adam")
    run.step(0)
    run.save(tmp_path, 1)
    return tmp_path


def _one_line(e: pytest.ExceptionInfo[BaseException], *needles: str) -> None:
    msg = str(e.value)
    assert isinstance(e.value, DappleError) and "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def test_truncated_layer_file(saved: Path) -> None:
    f = step_dir(saved, 1) / "layer-00002.pt"
    f.write_bytes(f.read_bytes()[:100])
    ck = latest_checkpoint(saved)
    assert ck is not None
    with pytest.raises(CheckpointError) as e:
        load_layer_states(ck, [2])
    _one_line(e, "layer-00002.pt", "truncated")
    with pytest.raises(CheckpointError):
        restore_stage(ck, _workload().build_stage(2, 4), 2)


def test_corrupted_layer_file_same_size(saved: Path) -> None:
    f = step_dir(saved, 1) / "layer-00001.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    before = _tree(saved)
    ck = latest_checkpoint(saved)
    assert ck is not None
    with pytest.raises(CheckpointError) as e:
        restore_stage(ck, _workload().build_stage(0, 2), 0)
    _one_line(e, "layer-00001.pt", "sha256")
    assert _tree(saved) == before


def test_checkpoint_of_another_model(saved: Path) -> None:
    before = _tree(saved)
    ck = latest_checkpoint(saved)
    assert ck is not None
    with pytest.raises(CheckpointError) as e:
        check_compatible(ck, model_name="other", num_layers=N)
    _one_line(e, MANIFEST_NAME, "'ckpt-mlp'", "'other'")
    with pytest.raises(CheckpointError) as e:
        check_compatible(ck, model_name="ckpt-mlp", num_layers=N + 1)
    _one_line(e, "has 4 layers", "has 5")
    wide = _workload(hidden=9)  # same name and layer count, other shapes
    with pytest.raises(CheckpointError) as e:
        restore_stage(ck, wide.build_stage(0, 2), 0)
    _one_line(e, "another model", "layer 0", "'0.weight'", "[7, 5]", "[9, 5]")
    with pytest.raises(CheckpointError) as e:
        whole = _workload().build_model()
        restore_stage(ck, whole, 0, torch.optim.SGD(whole.parameters(), lr=0.1))
    _one_line(e, "Adam", "SGD")
    assert _tree(saved) == before


def test_manifest_from_newer_schema(saved: Path) -> None:
    mp = step_dir(saved, 1) / MANIFEST_NAME
    m = json.loads(mp.read_text())
    m["schema_version"] = CHECKPOINT_SCHEMA_VERSION + 1
    mp.write_text(json.dumps(m))
    before = _tree(saved)
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(saved)
    _one_line(e, str(mp), "schema_version 2 is newer")
    assert _tree(saved) == before


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda p: p.write_text("{not json"), "not valid JSON"),
        (lambda p: p.write_text("[1]"), "JSON object"),
        (
            lambda p: p.write_text(json.dumps({"schema_version": 1, "model_name": "x"})),
            "num_layers",
        ),
    ],
)
def test_damaged_manifest(saved: Path, edit, needle: str) -> None:
    mp = step_dir(saved, 1) / MANIFEST_NAME
    edit(mp)
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(saved)
    _one_line(e, str(mp), needle)


def test_missing_listed_file(saved: Path) -> None:
    (step_dir(saved, 1) / "layer-00003.pt").unlink()
    with pytest.raises(CheckpointError) as e:
        latest_checkpoint(saved)
    _one_line(e, "layer-00003.pt", "missing")


def test_plan_layer_count_differs_from_model(saved: Path) -> None:
    ck = latest_checkpoint(saved)
    assert ck is not None
    with pytest.raises(CheckpointError) as e:
        check_compatible(ck, model_name="ckpt-mlp", num_layers=N, plan_num_layers=N - 1)
    _one_line(e, "plan covers 3 layers", "has 4")
    with pytest.raises(CheckpointError) as e:
        load_layer_states(ck, [N])
    _one_line(e, "layer 4 requested")


def test_unwritable_directory(tmp_path: Path, monkeypatch) -> None:
    assert check_writable(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert (
        list(tmp_path.iterdir()) == []
    )  # the probe leaves no directory behind (the save makes it)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError) as e:
        check_writable(blocker / "ckpt")
    _one_line(e, str(blocker / "ckpt"), "not writable")

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    # tempfile.mkstemp: the write probe's and every atomic write's temporary file
    monkeypatch.setattr("dapple.files.atomic_file.tempfile.mkstemp", denied)
    with pytest.raises(CheckpointError) as e:
        check_writable(tmp_path)
    _one_line(e, str(tmp_path), "Permission denied")
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(tmp_path, CheckpointMeta(model_name="m", num_layers=1, step=1), {})
    _one_line(e, "cannot write checkpoint", "Permission denied")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(CheckpointError) as e:
            check_writable(ro)
        _one_line(e, str(ro), "not writable")
    finally:
        ro.chmod(0o700)


class _TiedLayer(nn.Module):
    """One weight used under two names inside a layer (as a tied embedding/head would be)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_parameter_shared_inside_a_layer_keeps_one_optimizer_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_TiedLayer(), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    meta = CheckpointMeta(model_name="tied", num_layers=2, step=2, optimizer_type="Adam")
    save_checkpoint(tmp_path, meta, stage_layer_states(model, 0, opt))
    ck = latest_checkpoint(tmp_path)
    assert ck is not None
    assert set(load_layer_states(ck, [0])[0].optimizer) == {"a.weight", "b.weight"}
    torch.manual_seed(1)
    fresh = nn.Sequential(_TiedLayer(), nn.Linear(4, 2))
    fopt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    restore_stage(ck, fresh, 0, fopt)
    assert fresh[0].a.weight is fresh[0].b.weight  # still one parameter
    assert torch.equal(fresh[0].a.weight, model[0].a.weight)
    assert len(fopt.state) == 3
    w = fresh[0].a.weight
    assert torch.equal(fopt.state[w]["exp_avg"], opt.state[model[0].a.weight]["exp_avg"])

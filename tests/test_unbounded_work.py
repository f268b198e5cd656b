"""Work bounded by what can be used: the planner on far more devices than a batch keeps busy,
and a model too large for host memory refused before it is built (issue 47 item 4).

The bounds are counts (candidates scored, devices enumerated), never wall time.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from builders import make_cluster, make_profile, one_error_line
from dapple.cli import main
from dapple.core.cluster import Cluster
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.core.tensor_layout import TENSOR_WIDTHS
from dapple.core.usable import usable_cluster, usable_devices
from dapple.errors import ValidationError
from dapple.planner import dapple_search, make_plan
from dapple.planner.schedule_choice import balanced_pipelines
from dapple.planner.scorer import Scorer
from dapple.planner.widths import width_candidates

B = 2
"""The global batch: 2 samples keep at most 2 replicas of a stage busy."""


def _sharded(n: int) -> ModelProfile:
    """A chain of n layers whose middle ones shard over a tensor group."""
    p = make_profile(n, act=1e5, params=10**6)
    layers = tuple(
        dataclasses.replace(x, tensor_parallel=0 < i < n - 1) for i, x in enumerate(p.layers)
    )
    return dataclasses.replace(p, layers=layers)


@pytest.fixture
def scored(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of candidates every :class:`Scorer` scores, one count per test."""
    count = [0]
    score = Scorer.score

    def counted(self: Scorer, *args: object, **kwargs: object) -> object:
        count[0] += 1
        return score(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Scorer, "score", counted)
    yield count


def _search(profile: ModelProfile, cluster: Cluster, counter: list[int]) -> tuple[object, int]:
    counter[0] = 0
    plan = dapple_search(profile, cluster, B)
    return plan, counter[0]


@pytest.mark.parametrize(
    ("profile", "per_server"),
    [(make_profile(4), 4), (_sharded(4), 8)],
    ids=["width-1", "widths-1-2-4-8"],
)
def test_search_work_is_the_same_on_1024_and_a_million_devices(
    scored: list[int], profile: ModelProfile, per_server: int
) -> None:
    widths = width_candidates(profile, make_cluster(1, per_server))
    usable = usable_devices(profile.num_layers, B, widths)
    assert usable == profile.num_layers * B * max(widths)
    assert usable < 1024
    small = make_cluster(servers=-(-usable // per_server), per_server=per_server)
    plan_u, work_u = _search(profile, small, scored)
    plan_k, work_k = _search(profile, make_cluster(1024 // per_server, per_server), scored)
    plan_m, work_m = _search(profile, make_cluster(10**6 // per_server, per_server), scored)
    assert work_u == work_k == work_m > 0
    assert plan_u == plan_k == plan_m


def test_one_huge_server_is_cut_with_its_tensor_widths(scored: list[int]) -> None:
    profile = _sharded(4)
    one_k = make_cluster(1, 1024)
    one_m = make_cluster(1, 10**6)
    assert width_candidates(profile, one_m) == list(TENSOR_WIDTHS)
    usable = usable_devices(profile.num_layers, B, TENSOR_WIDTHS)
    cut = usable_cluster(one_m, usable)
    assert cut.servers == 1 and usable <= cut.devices_per_server < 1024
    assert width_candidates(profile, cut) == list(TENSOR_WIDTHS)
    plan_c, work_c = _search(profile, cut, scored)
    plan_k, work_k = _search(profile, one_k, scored)
    plan_m, work_m = _search(profile, one_m, scored)
    assert work_c == work_k == work_m > 0
    assert plan_c == plan_k == plan_m


def test_usable_cluster_keeps_small_clusters_and_the_tensor_widths() -> None:
    c = make_cluster(servers=4, per_server=8)
    assert usable_cluster(c, 32) is c and usable_cluster(c, 100) is c
    cut = usable_cluster(c, 12)
    assert (cut.servers, cut.devices_per_server) == (2, 8)
    assert dataclasses.replace(cut, servers=4) == c  # links, memory, host terms unchanged
    for dps in (10**6, 10**6 + 1, 10**6 + 2, 3 * 2**20, 7 * 4 * 10**5):
        big = make_cluster(servers=3, per_server=dps)
        for usable in (1, 7, 12, 384, 1000):
            got = usable_cluster(big, usable)
            assert got.servers == 1 and usable <= got.devices_per_server <= dps
            for t in TENSOR_WIDTHS:
                assert (got.devices_per_server % t == 0) == (dps % t == 0), (dps, usable, t)


def test_usable_devices_counts_stages_batch_and_width() -> None:
    assert usable_devices(6, 8, [1, 2, 4, 8]) == 6 * 8 * 8
    assert usable_devices(6, 8, [1]) == 48
    assert usable_devices(6, 8, [1, 2], max_stages=2) == 2 * 8 * 2
    assert usable_devices(6, 8, [1], max_stages=0) == 48  # 0: no cap, as dapple_search reads it
    assert usable_devices(48, 64, [1]) == 48 * 64


def test_dp_baseline_and_balanced_pipelines_stop_at_the_batch() -> None:
    profile = make_profile(4)
    huge = make_cluster(10**6 // 4, 4)
    first = make_cluster(1, 4)  # the first server holds the B replicas of one stage
    dp = make_plan(profile, huge, B, "dp")
    assert dp == make_plan(profile, first, B, "dp") and len(dp.devices) == 4
    pipes = balanced_pipelines(profile, huge, B)
    assert pipes == balanced_pipelines(profile, make_cluster(2, 4), B)  # N x B = 8 devices
    assert max(len(p.devices) for p in pipes) <= profile.num_layers * B


def test_cli_plan_on_a_million_devices_names_the_idle_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = tmp_path / "p.json"
    make_profile(4).save(prof)
    cluster = tmp_path / "c.json"
    cluster.write_text(
        json.dumps(
            {
                "servers": 250_000,
                "devices_per_server": 4,
                "device_memory_gib": 16,
                "intra_server_bandwidth_gbps": 100,
                "inter_server_bandwidth_gbps": 25,
            }
        )
    )
    args = ["plan", "--profile", str(prof), "--cluster", str(cluster)]
    assert main([*args, "--global-batch-size", str(B)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "devices left idle" in x)
    assert "of 1,000,000 devices left idle" in line
    assert f"keeps at most {4 * B} busy" in line, line


def test_host_memory_estimate_is_the_layers_real_storage() -> None:
    from dapple.models.zoo import load_workload
    from dapple.profiler.host_fit import check_host_memory, meta_layer_bytes

    wl = load_workload("transformer", layers=2, hidden=32)
    sizes = meta_layer_bytes(wl)
    assert sizes is not None and len(sizes) == wl.num_layers
    real = []
    for i in range(wl.num_layers):
        layer = wl.build_layer(i)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        grads = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
        buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
        real.append(params + grads + buffers)
    assert [x.training_bytes for x in sizes] == real
    need = max(real)
    assert check_host_memory(wl, available=need) == need
    assert check_host_memory(wl, co_workers=3, available=10**15) == need + 2 * sum(real)
    with pytest.raises(ValidationError) as e:
        check_host_memory(wl, available=need - 1)
    assert f"{need:,} bytes" in str(e.value) and f"{need - 1:,} bytes" in str(e.value)


_PEAK = """
import json, os, subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
err = p.stderr.read()
_, status, usage = os.wait4(p.pid, 0)
print(json.dumps([os.waitstatus_to_exitcode(status), err, usage.ru_maxrss]))
"""
"""Runs argv, then prints its exit code, stderr and peak resident KiB as JSON."""


def test_profile_of_a_huge_model_is_refused_before_any_layer_is_built(tmp_path: Path) -> None:
    """hidden=10^7 makes a block of 4.8e15 bytes: refused in one line, exit code 2, the
    process never grows past what importing torch takes."""
    out = tmp_path / "p.json"
    cmd = [sys.executable, "-m", "dapple", "profile", "-m", "transformer",
           "--set", "hidden=10000000", "-o", str(out), "--device", "cpu"]  # fmt: skip
    # started by a fresh interpreter: a child forked from this test process would carry its
    # resident size into ru_maxrss (kept across execve), whatever the child itself touches
    got = subprocess.run([sys.executable, "-c", _PEAK, *cmd], capture_output=True, text=True,
                         check=True)  # fmt: skip
    code, err, maxrss_kib = json.loads(got.stdout)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dapple: error: "), err
    assert "9,600,001,040,000,000 bytes" in lines[0] and "available" in lines[0]
    assert "Traceback" not in err and not out.exists()
    assert maxrss_kib * 1024 < 2 * 2**30  # KiB on Linux; one real block would be 4.8e15


def test_training_memory_is_the_model_once_with_its_state() -> None:
    """The lower bound of a run on one host: every parameter and buffer once, and the gradient
    and optimizer state (bytes per trainable byte) of each trainable one."""
    from dapple.models.zoo import load_workload
    from dapple.profiler.host_fit import check_training_memory

    wl = load_workload("transformer", layers=2, hidden=32)
    params = buffers = 0
    for i in range(wl.num_layers):
        layer = wl.build_layer(i)
        params += sum(p.numel() * p.element_size() for p in layer.parameters())
        buffers += sum(b.numel() * b.element_size() for b in layer.buffers())
    need = params + buffers + 3 * params  # AdamW: the gradient and two moments
    assert check_training_memory(wl, 3.0, available=need) == need
    with pytest.raises(ValidationError, match=f"{need:,} bytes.*{need - 1:,} bytes"):
        check_training_memory(wl, 3.0, available=need - 1)


def test_a_traced_models_pieces_are_sized_without_building_them() -> None:
    pytest.importorskip("transformers")
    from dapple.models.hf import hf_gpt2
    from dapple.profiler.host_fit import meta_layer_bytes

    wl = hf_gpt2(layers=2, hidden=16, heads=2, vocab=32, seq=8)
    sizes = meta_layer_bytes(wl)
    assert sizes is not None
    built = [wl.build_layer(i) for i in range(wl.num_layers)]
    assert [x.parameter_bytes for x in sizes] == [
        sum(p.numel() * p.element_size() for p in b.parameters()) for b in built
    ]


@pytest.mark.parametrize("command", ["train", "verify"])
def test_a_run_of_a_huge_model_is_refused_before_any_layer_is_built(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """hidden=10^6 on one host: one line naming the bytes, before a worker builds a layer."""
    plan = tmp_path / "plan.json"
    two = straight_plan(
        8, [0, 4], global_batch_size=4, num_micro_batches=2, model_name="transformer"
    )
    plan.write_text(json.dumps(two.to_dict()))
    args = [command, "-m", "transformer", "--set", "hidden=1000000", "--plan", str(plan)]
    assert main([*args, "--device", "cpu"]) == 2
    one_error_line(capsys, "of host memory", "288,002,496,001,024 bytes of parameters")


def test_plan_local_of_a_huge_model_is_refused_before_profiling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    args = ["plan-local", "-m", "transformer", "--set", "hidden=1000000", "--nprocs", "2"]
    assert main([*args, "--global-batch-size", "8", "--out-dir", str(out)]) == 2
    one_error_line(capsys, "planning 'transformer'", "1 co-worker(s)")
    assert not out.exists()

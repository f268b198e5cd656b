"""Profiling at several sequence lengths: batches resized along the dynamic dimension, the
per-length profile of a small transformer, the errors before any compute, the CLI flags, and a
plan made for one length running unchanged on batches of other lengths (two processes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dapple import api
from dapple.cli import main
from dapple.core.cluster import Cluster
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import ValidationError
from dapple.models.shapes import DynamicDim
from dapple.models.zoo.transformer import transformer
from dapple.profiler.length_passes import resize_inputs
from dapple.profiler.measure import profile_workload

HIDDEN = 16


def _lm(seq: int = 32, choices: tuple[int, ...] = (8, 16, 32)) -> object:
    return api.load("transformer", layers=2, hidden=HIDDEN, heads=2, seq=seq, vocab=32,
                    seq_choices=list(choices))  # fmt: skip


def _two() -> Cluster:
    return Cluster(name="two", servers=1, devices_per_server=2, device_memory_bytes=2**30,
                   intra_server_bandwidth_gbps=10.0, inter_server_bandwidth_gbps=10.0)  # fmt: skip


def test_resize_inputs_cuts_or_tiles_only_the_dynamic_dimensions() -> None:
    ids = torch.arange(10).reshape(2, 5)
    mask = torch.ones(2, 5, 3)
    seq = DynamicDim("seq")
    short, short_mask = resize_inputs((ids, mask), {0: {1: seq}, 1: {1: seq}}, 3)
    assert short.tolist() == [[0, 1, 2], [5, 6, 7]] and short_mask.shape == (2, 3, 3)
    long = resize_inputs(ids, {0: {1: seq}}, 12)
    assert long.tolist()[0] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]


def test_profile_at_three_lengths_stores_each_and_plans_at_the_longest_by_default() -> None:
    wl = _lm()
    prof = profile_workload(wl, [1, 2], seq_lens=[32, 8, 16], warmup=0, repeats=1,
                            num_threads=1)  # fmt: skip
    assert prof.seq_lens == (8, 16, 32) and prof.seq_len == 32
    assert prof.layers == prof.by_length[-1].layers
    for x in prof.by_length:  # a block's output: hidden fp32 values per token
        assert x.layers[1].output_bytes_per_sample == pytest.approx(4 * HIDDEN * x.seq_len)
        assert x.input_bytes_per_sample == pytest.approx(8 * x.seq_len)  # int64 ids
    kept = [x.layers[1].kept_activation_bytes_per_sample for x in prof.by_length]
    assert kept[0] < kept[1] < kept[2]
    assert kept[2] > 2 * kept[1]  # attention scores grow as L^2: more than the tokens
    one = profile_workload(wl, [1, 2], warmup=0, repeats=1, num_threads=1)
    assert [x.parameter_bytes for x in one.layers] == [x.parameter_bytes for x in prof.layers]
    assert ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof
    # one 2-stage plan costed for 8, for 32, and for a mean of 8 with samples of up to 32
    plan, cluster = straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2), _two()

    def cost(mean: int, top: int) -> tuple[float, float]:
        sized = dataclasses.replace(plan, mean_seq_len=mean, max_seq_len=top)
        r = pipeline_latency(sized, prof, cluster)
        return r.L_ms, max(s.memory_bytes for s in r.stages)

    (t8, m8), (t32, m32), (t_mix, m_mix) = cost(8, 8), cost(32, 32), cost(8, 32)
    assert t32 >= t8 and m32 > m8
    assert t_mix == t8 and m_mix == m32


def test_lengths_the_model_cannot_take_are_named_before_any_compute() -> None:
    fixed = transformer(layers=1, hidden=8, heads=2, seq=16, vocab=16)
    with pytest.raises(ValidationError, match=r"'transformer' has no dynamic input dimension"):
        profile_workload(fixed, [1], seq_lens=[8, 16])
    with pytest.raises(ValidationError, match=r"input 0 dimension 1 \(seq\) takes sizes in "
                       r"\[1, 32\], not the lengths \[64\]"):  # fmt: skip
        profile_workload(_lm(), [1], seq_lens=[8, 64])
    with pytest.raises(ValidationError, match=r"sequence lengths must be positive integers"):
        profile_workload(_lm(), [1], seq_lens=[0])


def test_cli_profile_and_plan_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof.json"
    argv = ["profile", "-m", "transformer", "--set", "layers=1", "--set", "hidden=8", "--set",
            "heads=2", "--set", "seq=16", "--set", "vocab=16", "--set", "seq_choices=[8,16]",
            "--batch-sizes", "1,2", "--seq-lens", "8,16", "--repeats", "1", "--warmup", "0",
            "--device", "cpu", "-o", str(prof)]  # fmt: skip
    assert main(argv) == 0
    assert "whole model by length" in capsys.readouterr().out
    plan = tmp_path / "plan.json"
    base = ["plan", "--profile", str(prof), "--cluster", "local-cpu", "--global-batch-size", "4"]
    assert main([*base, "--mean-seq-len", "12,16", "-o", str(plan)]) == 0
    assert "12 tokens on average (step time) and at most 16 (memory)" in capsys.readouterr().out
    saved = json.loads(plan.read_text())
    assert (saved["mean_seq_len"], saved["max_seq_len"]) == (12, 16)
    for bad, msg in [("16,8", "the mean 16 exceeds the maximum 8"),
                     ("a", "--mean-seq-len must be MEAN or MEAN,MAX with lengths > 0, got 'a'")]:  # fmt: skip
        assert main([*base, "--mean-seq-len", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("dapple: error: --mean-seq-len ")
        assert msg in err
    assert main([*argv[:-2], "--seq-lens", "8,x", "-o", str(prof)]) == 2
    assert "--seq-lens must be comma-separated integers" in capsys.readouterr().err


@pytest.mark.slow
def test_a_plan_made_for_one_length_runs_unchanged_on_other_lengths() -> None:
    """Profiled at 8 and 32 tokens, planned 1:1 for a mean of 16 (memory at 32); verify runs
    it on batches of 8, 16 and 32 tokens in turn (two processes) and matches one process."""
    wl = _lm()
    prof = api.profile(wl, [2], "cpu", seq_lens=[8, 32], repeats=1, warmup=0)
    plan = api.plan(prof, _two(), 4, "straight", mean_seq_len=16, max_seq_len=32)
    assert (plan.replication, plan.mean_seq_len, plan.max_seq_len) == ("1:1", 16, 32)
    rep = api.verify(plan, wl, steps=3, device="cpu")
    assert rep.ok, rep.max_abs_diff
    assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)

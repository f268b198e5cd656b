"""Cost and memory by sequence length (pure): the interpolation in tokens against hand-computed
values and as a hypothesis property, profiles and plans that carry lengths, and the planner for
a length distribution (time at the mean, memory at the longest)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import make_cluster
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.plan import Plan, straight_plan
from dapple.core.profile import LengthProfile, ModelProfile
from dapple.cost.at_length import (
    affine_at_length,
    fixed_at_length,
    length_profile,
    per_sample_at_length,
    profile_for_lengths,
    segment,
)
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import ValidationError
from dapple.planner import make_plan
from dapple.simulate import simulate

LENS = (128.0, 512.0, 1024.0)
TIMES = (  # 1/64, 1/32 and 5/128 ms per token: the time per token grows with the length
    AffineTime(fixed_ms=1.0, per_sample_ms=2.0),
    AffineTime(fixed_ms=1.5, per_sample_ms=16.0),
    AffineTime(fixed_ms=2.0, per_sample_ms=40.0),
)


def test_interpolation_in_tokens_against_hand_computed_values() -> None:
    # L = 256 lies between 128 and 512 at w = (256 - 128) / (512 - 128) = 1/3
    assert segment(LENS, 256) == (0, pytest.approx(1 / 3))
    t = affine_at_length(LENS, TIMES, 256)
    assert t.fixed_ms == pytest.approx(1.0 + (1.5 - 1.0) / 3)  # T1: 1.1667
    # T2: the time per token, 1/64 and 1/32 ms, linear in L: 1/48 ms, x 256 tokens
    assert t.per_sample_ms == pytest.approx(256 * (2 / 3 * 2 / 128 + 1 / 3 * 16 / 512))
    assert t.per_sample_ms == pytest.approx(5.3333, abs=1e-4)  # the chord would say 6.6667
    assert t.at(4) == pytest.approx(22.5)
    # between 512 and 1024 at w = 1/2: 0.03515625 ms per token x 768
    assert affine_at_length(LENS, TIMES, 768).at(2) == pytest.approx(1.75 + 2 * 27.0)
    # T3 below: the fixed part of the shortest length, its time per token
    assert fixed_at_length(LENS, [1.0, 1.5, 2.0], 64) == 1.0
    assert per_sample_at_length(LENS, [2.0, 16.0, 40.0], 64) == pytest.approx(1.0)
    # T3 above: per token 5/128 ms grows by (5/128 - 1/32) / 512 per token of length
    assert per_sample_at_length(LENS, [2.0, 16.0, 40.0], 2048) == pytest.approx(112.0)
    assert affine_at_length(LENS, TIMES, 2048).at(1) == pytest.approx(114.0)
    # one measured length: proportional to the tokens
    assert affine_at_length([512.0], [TIMES[1]], 256).at(2) == pytest.approx(1.5 + 16.0)
    # a time per token that falls with the length: the per-sample chord
    assert per_sample_at_length([128.0, 512.0], [4.0, 8.0], 256) == pytest.approx(4 + 4 / 3)
    # bytes follow the same rule (kept activations of 36 + L/64 KiB per token: exact)
    kib = [L * (36 + L / 64) for L in (128.0, 1024.0)]
    assert per_sample_at_length([128.0, 1024.0], kib, 512) == pytest.approx(512 * 44)


def _nondecreasing(draw: st.DrawFn, k: int) -> list[float]:
    out, v = [], 0.0
    for _ in range(k):
        v += draw(st.floats(0.0, 10.0))
        out.append(v)
    return out


@st.composite
def _measured(draw: st.DrawFn) -> tuple[list[float], list[AffineTime]]:
    k = draw(st.integers(1, 5))
    lens = sorted(draw(st.sets(st.integers(1, 4096), min_size=k, max_size=k)))
    fixed, slope = _nondecreasing(draw, k), _nondecreasing(draw, k)
    times = [AffineTime(fixed_ms=f, per_sample_ms=s) for f, s in zip(fixed, slope, strict=True)]
    return [float(x) for x in lens], times


@settings(max_examples=200, deadline=None)
@given(
    _measured(),
    st.floats(0.5, 8192.0),
    st.floats(0.5, 8192.0),
    st.integers(1, 64),
    st.integers(1, 64),
)
def test_time_is_exact_at_measured_lengths_and_monotone_in_tokens(
    measured: tuple[list[float], list[AffineTime]], L1: float, L2: float, b1: int, b2: int
) -> None:
    lens, times = measured
    for L, t in zip(lens, times, strict=True):
        assert affine_at_length(lens, times, L) == t
    (La, Lb), (ba, bb) = sorted((L1, L2)), sorted((b1, b2))
    lo, hi = affine_at_length(lens, times, La), affine_at_length(lens, times, Lb)
    tol = 1e-9 * (1.0 + hi.at(bb))
    assert lo.at(ba) <= lo.at(bb) + tol  # more samples of one length
    assert lo.at(ba) <= hi.at(ba) + tol  # longer samples, same batch
    assert lo.at(ba) <= hi.at(bb) + tol  # both: more tokens either way


def _layer(name: str, L: float, fwd_per_token: float, kept_per_token: float) -> LayerProfile:
    return LayerProfile(
        name=name,
        forward=AffineTime(fixed_ms=0.1, per_sample_ms=fwd_per_token * L),
        backward=AffineTime(fixed_ms=0.2, per_sample_ms=2 * fwd_per_token * L),
        output_bytes_per_sample=4.0 * 64 * L,
        parameter_bytes=40_000,
        kept_activation_bytes_per_sample=kept_per_token * L,
    )


def lengths_profile(lens: tuple[int, ...] = (128, 512, 1024), n: int = 4) -> ModelProfile:
    """A chain of ``n`` layers measured at ``lens``: times and bytes linear in the tokens."""
    by_length = tuple(
        LengthProfile(
            seq_len=L,
            layers=tuple(_layer(f"l{i}", L, 0.01, 2048.0) for i in range(n)),
            input_bytes_per_sample=8.0 * L,
        )
        for L in lens
    )
    return ModelProfile(
        model_name="lm",
        layers=by_length[-1].layers,
        input_bytes_per_sample=by_length[-1].input_bytes_per_sample,
        batch_sizes=(1, 2, 4),
        seq_len=lens[-1],
        by_length=by_length,
    )


def test_profile_for_lengths_takes_times_at_the_mean_and_memory_at_the_maximum() -> None:
    prof = lengths_profile()
    p = profile_for_lengths(prof, 320, 1024)
    assert p.seq_len == 320 and p.memory_at is not None and p.memory_at.seq_len == 1024
    assert p.layers == length_profile(prof, 320).layers
    assert p.layers[0].forward.per_sample_ms == pytest.approx(3.2)  # 0.01 ms/token x 320
    assert p.layers[0].output_bytes_per_sample == pytest.approx(4.0 * 64 * 320)
    mem = p.for_memory
    assert mem.seq_len == 1024 and mem.memory_at is None
    assert mem.layers[0].kept_activation_bytes_per_sample == pytest.approx(2048.0 * 1024)
    assert mem.input_bytes_per_sample == pytest.approx(8.0 * 1024)
    assert profile_for_lengths(prof, 512).for_memory.seq_len == 512


def test_profile_for_lengths_names_what_it_cannot_do() -> None:
    prof = lengths_profile()
    one_size = dataclasses.replace(prof, by_length=(), seq_len=None)
    with pytest.raises(ValidationError, match=r"measured at one size.*--seq-lens"):
        profile_for_lengths(one_size, 512)
    with pytest.raises(ValidationError, match=r"mean sequence length 600 is longer than the "):
        profile_for_lengths(prof, 600, 512)
    with pytest.raises(ValidationError, match=r"sequence length must be a number > 0, got 0"):
        profile_for_lengths(prof, 0)


def test_profile_and_plan_lengths_round_trip_and_old_files_load(tmp_path: Path) -> None:
    p = profile_for_lengths(lengths_profile(), 300, 1024)
    assert ModelProfile.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    old = {k: v for k, v in p.to_dict().items() if k not in ("seq_len", "by_length", "memory_at")}
    q = ModelProfile.from_dict(old)
    assert q.seq_len is None and q.by_length == () and q.memory_at is None and q.for_memory is q
    with pytest.raises(ValidationError, match=r"by_length must have distinct lengths"):
        dataclasses.replace(p, by_length=p.by_length[::-1])
    plan = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=2)
    assert "mean_seq_len" not in plan.to_dict() and Plan.from_dict(plan.to_dict()) == plan
    sized = dataclasses.replace(plan, mean_seq_len=300.0, max_seq_len=1024.0)
    path = tmp_path / "plan.json"
    sized.save(path)
    assert Plan.load(path) == sized
    saved = json.loads(path.read_text())
    assert (saved["mean_seq_len"], saved["max_seq_len"]) == (300.0, 1024.0)
    assert "seq_len" not in saved
    # a file of an earlier version records the mean as seq_len
    saved["seq_len"] = saved.pop("mean_seq_len")
    assert Plan.from_dict(saved) == sized
    with pytest.raises(ValidationError, match=r"mean_seq_len 2000.0 exceeds max_seq_len 1024"):
        dataclasses.replace(sized, mean_seq_len=2000.0)


def test_a_plan_for_512_predicts_more_time_and_memory_than_one_for_128() -> None:
    prof, cluster = lengths_profile(), make_cluster(per_server=2)
    p128 = make_plan(prof, cluster, 8, mean_seq_len=128)
    p512 = make_plan(prof, cluster, 8, mean_seq_len=512)
    lengths = (p128.mean_seq_len, p128.max_seq_len, p512.mean_seq_len, p512.max_seq_len)
    assert lengths == (128, 128, 512, 512)
    assert p512.predicted_step_ms > p128.predicted_step_ms
    # the same stages at each length: costed at the plan's lengths
    fixed = straight_plan(4, [0, 2], global_batch_size=8, num_micro_batches=4)

    def cost(mean: float, top: float) -> tuple[float, list[float]]:
        r = pipeline_latency(dataclasses.replace(fixed, mean_seq_len=mean, max_seq_len=top), prof,
                             cluster)  # fmt: skip
        return r.L_ms, [s.memory_bytes for s in r.stages if s.kind == "compute"]

    (t128, m128), (t512, m512), (tmix, mmix) = cost(128, 128), cost(512, 512), cost(128, 512)
    assert t512 > 3 * t128 and all(b > a for a, b in zip(m128, m512, strict=True))
    assert tmix == pytest.approx(t128) and mmix == pytest.approx(m512)  # mean: time; max: memory
    sim = simulate(dataclasses.replace(fixed, mean_seq_len=128, max_seq_len=512), prof, cluster)
    assert sim.step_ms == pytest.approx(simulate(dataclasses.replace(fixed, mean_seq_len=128,
                                        max_seq_len=128), prof, cluster).step_ms)  # fmt: skip
    assert sim.peak_memory_bytes == pytest.approx(
        simulate(dataclasses.replace(fixed, mean_seq_len=512, max_seq_len=512), prof,
                 cluster).peak_memory_bytes)  # fmt: skip


def test_the_old_seq_len_keyword_of_the_planner_is_refused_naming_mean_seq_len() -> None:
    """``seq_len`` is tokens per sample (``dapple train``'s); the planner's mean length is
    ``mean_seq_len`` in ``make_plan`` and ``api.plan`` alike."""
    from dapple import api

    prof, cluster = lengths_profile(), make_cluster(per_server=2)
    with pytest.raises(TypeError, match=r"^make_plan\(\) takes mean_seq_len= now, not seq_len="):
        make_plan(prof, cluster, 8, seq_len=128)
    with pytest.raises(TypeError, match=r"^plan\(\) takes mean_seq_len= now, not seq_len="):
        api.plan(prof, cluster, 8, seq_len=128)
    assert api.plan(prof, cluster, 8, mean_seq_len=128) == make_plan(
        prof, cluster, 8, mean_seq_len=128
    )


def test_plan_config_refuses_the_old_field_spellings_naming_the_new_ones() -> None:
    """``PlanConfig`` (behind ``dapple plan`` and ``api.plan``) refuses ``seq_len=`` and
    ``interleaved=`` in the one line ``make_plan`` gives, not Python's unexpected keyword."""
    from dapple.planner.plan_config import PlanConfig

    with pytest.raises(TypeError, match=r"^PlanConfig\(\) takes mean_seq_len= now, not seq_len="):
        PlanConfig(seq_len=128.0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"^PlanConfig\(\) takes interleave= now, not interleaved="):
        PlanConfig(interleaved=True)  # type: ignore[call-arg]
    cfg = PlanConfig(mean_seq_len=128.0, interleave=True)
    assert (cfg.mean_seq_len, cfg.interleave) == (128.0, True)
    assert dataclasses.replace(cfg, mean_seq_len=64.0).mean_seq_len == 64.0


def test_memory_at_the_maximum_decides_what_fits() -> None:
    """A device that holds the kept activations of 128-token samples but not of 1024-token
    ones: the plan for a mean of 128 and a maximum of 1024 must re-compute or hold fewer."""
    prof = lengths_profile()
    state = 4 * 40_000 * 4  # four layers' parameters, gradients and Adam state
    kept_1024 = 4 * 2048.0 * 1024 * 8  # all layers, 8 samples
    cluster = dataclasses.replace(make_cluster(per_server=1),
                                  device_memory_bytes=int(state + kept_1024 / 2))  # fmt: skip
    short = make_plan(prof, cluster, 8, mean_seq_len=128)
    mixed = make_plan(prof, cluster, 8, mean_seq_len=128, max_seq_len=1024)
    assert short.predicted_step_ms < mixed.predicted_step_ms
    assert short.num_micro_batches == 1 and not any(s.recompute for s in short.stages)
    assert any(s.recompute for s in mixed.stages) or mixed.num_micro_batches > 1
    assert pipeline_latency(mixed, prof, cluster).fits_memory
    assert not pipeline_latency(dataclasses.replace(short, max_seq_len=1024), prof,
                                cluster).fits_memory  # fmt: skip

"""Cost and memory by sequence length: a profile measured at several lengths, read in tokens.

Pure functions (no torch). A profile measured at lengths ``L_1 < ... < L_K`` of its dynamic
dimension (:attr:`dapple.core.profile.ModelProfile.by_length`) has, at each ``L_k``, every
layer's time affine in the batch size, ``t_k(b) = f_k + s_k b``, and its sizes per sample
``a_k``. A sample of length ``L`` holds ``L`` tokens; ``p_k = s_k / L_k`` is the time per token
at ``L_k``. At another length ``L`` the time of a call on ``b`` samples is again affine in
``b``, ``t(b, L) = f(L) + s(L) b`` (:func:`affine_at_length`), with:

* T1, the per-call part: ``f(L) = (1 - w) f_k + w f_{k+1}`` between two measured lengths,
  ``w = (L - L_k) / (L_{k+1} - L_k)``; the nearest measured ``f_k`` outside them
  (:func:`fixed_at_length`);
* T2, the per-sample part between two measured lengths (:func:`per_sample_between`): when the
  time per token grows with the length (``p_{k+1} >= p_k``, as attention's ``L^2`` makes it),
  the time per token is linear in ``L``, ``s(L) = L ((1 - w) p_k + w p_{k+1})`` - exact for a
  per-sample cost ``a L + c L^2``; otherwise (per-token costs that fall with the length) the
  time per sample is, ``s(L) = (1 - w) s_k + w s_{k+1}``. Either way the smaller of the two
  (the first is convex in ``L`` where it applies, the second then the chord above it);
* T3, the per-sample part outside the measured lengths (:func:`per_sample_beyond`): the time
  per token of the shortest below it, ``s(L) = p_1 L``; above the longest, the time per token
  continued along the last segment's growth, ``s(L) = L (p_K + g (L - L_K))``,
  ``g = max(0, (p_K - p_{K-1}) / (L_K - L_{K-1}))`` (0 with one length). Lengths far beyond
  the longest measured one are guesses: profile up to the longest length you train with.

Sizes per sample (activation bytes) follow T2 and T3 like ``s``. At a measured length every
term is the measured one (exact). When the measured ``f_k`` and ``s_k`` do not decrease with the
length (the profiler makes them so, :mod:`dapple.profiler.length_passes`), the time and the sizes are
non-decreasing in ``b`` and in ``L``, hence in the tokens ``b L``.

A plan for a distribution of lengths uses the mean length for time (a step's time is the sum of
its micro-batches') and the longest for memory (the peak is reached by the longest batch):
:func:`profile_for_lengths`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from bisect import bisect_left
from collections.abc import Sequence

from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.moe_profile import MoEProfile
from dapple.core.plan import Plan
from dapple.core.profile import LengthProfile, ModelProfile
from dapple.errors import ValidationError

__all__ = [
    "affine_at_length",
    "fixed_at_length",
    "layer_at_length",
    "length_profile",
    "moe_at_length",
    "per_sample_at_length",
    "per_sample_between",
    "per_sample_beyond",
    "profile_for_lengths",
    "profile_for_plan",
    "segment",
]

log = logging.getLogger(__name__)


def segment(lengths: Sequence[float], L: float) -> tuple[int, float]:
    """``(k, w)``: ``L`` lies between ``lengths[k]`` and ``lengths[k + 1]`` at weight ``w`` in
    ``[0, 1)`` (equations T1, T2). Outside the range: ``(0, 0.0)`` below, ``(K - 1, 0.0)`` above;
    one length: ``(0, 0.0)``."""
    K = len(lengths)
    if K == 1 or lengths[0] >= L:
        return 0, 0.0
    if lengths[-1] <= L:
        return K - 1, 0.0
    k = bisect_left(lengths, L) - 1
    if lengths[k + 1] == L:
        return k + 1, 0.0
    return k, (L - lengths[k]) / (lengths[k + 1] - lengths[k])


def fixed_at_length(lengths: Sequence[float], values: Sequence[float], L: float) -> float:
    """T1: a per-call term (the fixed part of a time) at length ``L``: interpolated between the
    measured lengths, the nearest measured value outside them."""
    k, w = segment(lengths, L)
    if w == 0.0:
        return values[k]
    return (1.0 - w) * values[k] + w * values[k + 1]


def per_sample_between(L_k: float, L_k1: float, s_k: float, s_k1: float, L: float) -> float:
    """T2: a per-sample term at ``L_k <= L <= L_{k+1}`` from its values ``s_k``, ``s_{k+1}``:
    the per-token value linear in ``L`` where it grows, else the per-sample value."""
    w = (L - L_k) / (L_k1 - L_k)
    chord = (1.0 - w) * s_k + w * s_k1
    p_k, p_k1 = s_k / L_k, s_k1 / L_k1
    if p_k1 < p_k:
        return chord
    return min(chord, L * ((1.0 - w) * p_k + w * p_k1))


def per_sample_beyond(lengths: Sequence[float], values: Sequence[float], L: float) -> float:
    """T3: a per-sample term at ``L`` outside ``[L_1, L_K]``: the shortest length's per-token
    value below, the longest's continued along its last segment's growth above."""
    if lengths[0] >= L:
        return values[0] / lengths[0] * L
    p_K = values[-1] / lengths[-1]
    g = 0.0
    if len(lengths) > 1:
        p_prev = values[-2] / lengths[-2]
        g = max(0.0, (p_K - p_prev) / (lengths[-1] - lengths[-2]))
    return L * (p_K + g * (L - lengths[-1]))


def per_sample_at_length(lengths: Sequence[float], values: Sequence[float], L: float) -> float:
    """A per-sample term (a time's slope in ``b``, bytes per sample) at length ``L``: the
    measured value at a measured length, T2 between, T3 outside."""
    k, w = segment(lengths, L)
    if lengths[k] == L:
        return values[k]
    if w == 0.0:
        return per_sample_beyond(lengths, values, L)
    return per_sample_between(lengths[k], lengths[k + 1], values[k], values[k + 1], L)


def affine_at_length(lengths: Sequence[float], times: Sequence[AffineTime], L: float) -> AffineTime:
    """The time of one call on ``b`` samples of length ``L``, affine in ``b`` (T1-T3)."""
    return AffineTime(
        fixed_ms=fixed_at_length(lengths, [t.fixed_ms for t in times], L),
        per_sample_ms=per_sample_at_length(lengths, [t.per_sample_ms for t in times], L),
    )


def layer_at_length(
    lengths: Sequence[float], layers: Sequence[LayerProfile], L: float
) -> LayerProfile:
    """One layer at length ``L`` from its profiles at ``lengths`` (times T1-T3, sizes per
    sample T2/T3; parameters do not depend on the length)."""
    first = layers[0]
    return LayerProfile(
        name=first.name,
        forward=affine_at_length(lengths, [x.forward for x in layers], L),
        backward=affine_at_length(lengths, [x.backward for x in layers], L),
        output_bytes_per_sample=per_sample_at_length(
            lengths, [x.output_bytes_per_sample for x in layers], L
        ),
        parameter_bytes=first.parameter_bytes,
        kept_activation_bytes_per_sample=per_sample_at_length(
            lengths, [x.kept_activation_bytes_per_sample for x in layers], L
        ),
        tied_parameter_bytes=first.tied_parameter_bytes,
        tied_layers=first.tied_layers,
        cast_parameter_bytes=first.cast_parameter_bytes,
        tensor_parallel=first.tensor_parallel,
        moe=moe_at_length(lengths, layers, L),
        parameter_sizes=first.parameter_sizes,
    )


def moe_at_length(
    lengths: Sequence[float], layers: Sequence[LayerProfile], L: float
) -> MoEProfile | None:
    """One layer's mixture-of-experts record at length ``L`` (None: a dense layer): its
    per-sample tokens and bytes (the busiest expert's too, where every length measured it) at
    ``L`` like :func:`per_sample_at_length`; experts, top-k, parameter bytes and the time
    shares of its profile at the first length."""
    moes = [x.moe for x in layers]
    first = moes[0]
    if first is None or any(m is None for m in moes):
        return first
    got = [m for m in moes if m is not None]

    def at(values: Sequence[float]) -> float:
        return per_sample_at_length(lengths, values, L)

    tokens = at([m.tokens_per_expert_per_sample for m in got])
    peaks = [m.max_tokens_per_expert_per_sample for m in got]
    return dataclasses.replace(
        first,
        tokens_per_expert_per_sample=tokens,
        max_tokens_per_expert_per_sample=(
            None if any(p is None for p in peaks) else max(at([p or 0.0 for p in peaks]), tokens)
        ),
        dispatch_bytes_per_sample=at([m.dispatch_bytes_per_sample for m in got]),
        combine_bytes_per_sample=at([m.combine_bytes_per_sample for m in got]),
    )


def length_profile(profile: ModelProfile, L: float) -> LengthProfile:
    """Every layer of ``profile`` at length ``L``, from :attr:`ModelProfile.by_length`.

    Raises:
        ValidationError: the profile was measured at one size (no ``by_length``), or ``L`` is
            not a number > 0.
    """
    _check_length(profile, L)
    lens = profile.seq_lens
    by_layer = list(zip(*(x.layers for x in profile.by_length), strict=True))
    return LengthProfile(
        seq_len=L,
        layers=tuple(layer_at_length(lens, ls, L) for ls in by_layer),
        input_bytes_per_sample=per_sample_at_length(
            lens, [x.input_bytes_per_sample for x in profile.by_length], L
        ),
    )


def profile_for_lengths(
    profile: ModelProfile, mean_seq_len: float, max_seq_len: float | None = None
) -> ModelProfile:
    """``profile`` planned for lengths of mean ``mean_seq_len`` and maximum ``max_seq_len``.

    The layers are those at the mean (times, and the bytes that cross a cut, which set the
    comm stages' time) and :attr:`ModelProfile.memory_at` those at the maximum (kept
    activations and stage inputs: the memory model).

    Args:
        profile: measured at several lengths (``by_length``).
        mean_seq_len: mean tokens per sample of the steps the plan is for.
        max_seq_len: the longest sample (default ``mean_seq_len``: every batch of one length).

    Raises:
        ValidationError: the profile has no lengths, a length is not > 0, or the mean exceeds
            the maximum.
    """
    top = mean_seq_len if max_seq_len is None else max_seq_len
    _check_length(profile, mean_seq_len)
    _check_length(profile, top)
    if mean_seq_len > top:
        raise ValidationError(
            f"mean sequence length {_text(mean_seq_len)} is longer than the maximum {_text(top)}: "
            "give MEAN,MAX with MEAN <= MAX"
        )
    mean_at = length_profile(profile, mean_seq_len)
    peak = length_profile(profile, top)
    if top > profile.seq_lens[-1]:
        log.warning(
            "profile %r was measured up to length %s: at %s time and memory are extrapolated "
            "(the time per token continued along its growth between the two longest lengths)",
            profile.model_name,
            _text(profile.seq_lens[-1]),
            _text(top),
        )
    return dataclasses.replace(
        profile,
        layers=mean_at.layers,
        input_bytes_per_sample=mean_at.input_bytes_per_sample,
        seq_len=mean_seq_len,
        memory_at=peak,
    )


def profile_for_plan(profile: ModelProfile, plan: Plan) -> ModelProfile:
    """``profile`` at the lengths ``plan`` was made for (:func:`profile_for_lengths`), when the
    plan states them and the profile was measured at several lengths; else ``profile``."""
    if plan.mean_seq_len is None or not profile.by_length:
        return profile
    return profile_for_lengths(profile, plan.mean_seq_len, plan.max_seq_len)


def _check_length(profile: ModelProfile, L: float) -> None:
    if not profile.by_length:
        raise ValidationError(
            f"profile {profile.model_name!r} was measured at one size, not at several lengths: "
            "profile it with `dapple profile --seq-lens L1,L2,...` to plan for a length"
        )
    if isinstance(L, bool) or not isinstance(L, (int, float)) or not math.isfinite(L) or L <= 0:
        raise ValidationError(f"sequence length must be a number > 0, got {L!r}")


def _text(L: float) -> str:
    return f"{L:g}"

"""The mixture-of-experts record of a layer profile: experts, routing and all-to-all bytes.

Pure data model, no torch. A layer whose feed-forward is a sparse mixture of experts (Mixtral,
Qwen-MoE, DeepSeek-V3) carries a :class:`MoEProfile` in ``LayerProfile.moe``; a dense layer
carries None and its profile file has no ``moe`` key.

Notation (per layer): E routed experts, k of them active per token (top-k), s tokens per
sample, h hidden width, e bytes per activation element. The routed experts' parameters are
``expert_parameter_bytes`` of the layer's ``parameter_bytes``; the rest (attention, router,
shared experts, norms) is dense. An expert-parallel width shards the first and replicates the
second (:mod:`dapple.cost.moe`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dapple.core._json import get_field, require

__all__ = ["MoEProfile"]

_SLACK = 1e-9
"""Relative rounding allowed where a measured value must not fall below a derived one."""


def _count(v: Any, what: str, low: int) -> int:
    require(
        isinstance(v, int) and not isinstance(v, bool) and v >= low,
        f"{what} must be an integer >= {low}, got {v!r}",
    )
    return int(v)


def _size(v: Any, what: str) -> float:
    require(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
        f"{what} must be a finite number >= 0, got {v!r}",
    )
    return float(v)


def _shares(v: Any, what: str) -> tuple[float, float] | None:
    """None, or ``(forward, backward)`` fractions in [0, 1] (a list in a file)."""
    if v is None:
        return None
    require(
        isinstance(v, (tuple, list))
        and len(v) == 2
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in v),
        f"{what} must be None or two fractions in [0, 1] (forward, backward), got {v!r}"[:200],
    )
    return float(v[0]), float(v[1])


def _load_shares(v: Any, experts: int, what: str) -> tuple[float, ...] | None:
    """None, or E fractions >= 0 summing to 1 (a list in a file)."""
    if v is None:
        return None
    require(
        isinstance(v, (tuple, list))
        and len(v) == experts
        and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
            for x in v
        )
        and abs(sum(v) - 1) <= 1e-6,
        f"{what} must be None or {experts} fractions >= 0 summing to 1, got {v!r}"[:200],
    )
    return tuple(float(x) for x in v)


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEProfile:
    """What a mixture-of-experts layer adds to its :class:`~dapple.core.layer_profile.LayerProfile`."""

    experts: int
    """E: routed experts of the layer (shared experts are dense and not counted)."""
    top_k: int
    """k: routed experts each token is sent to."""
    expert_parameter_bytes: int
    """Bytes of all E routed experts' parameters: the part of the layer's ``parameter_bytes``
    that an expert-parallel width shards; the rest is dense."""
    tokens_per_expert_per_sample: float
    """Mean tokens one routed expert receives per sample, ``s k / E``."""
    max_tokens_per_expert_per_sample: float | None = None
    """Tokens the busiest expert received per sample where the routing was measured; None:
    not measured (a balanced router is assumed)."""
    dispatch_bytes_per_sample: float
    """Bytes of the token copies sent to their experts per sample, ``s k h e``, forward (the
    backward sends their gradients back the same way); with expert parallelism the share
    bound for experts on other ranks crosses the all-to-all."""
    combine_bytes_per_sample: float
    """Bytes of the expert outputs returned to their tokens per sample, ``s k h e``."""
    router_time_share: tuple[float, float] | None = None
    """Fractions ``(forward, backward)`` of the layer's times spent in the router (its linear,
    softmax and top-k); None: not split."""
    expert_time_share: tuple[float, float] | None = None
    """Fractions ``(forward, backward)`` of the layer's times spent in the routed experts;
    None: not split. The rest of the layer's time (attention, shared experts, norms) is
    ``1 - router - experts``."""
    expert_load_shares: tuple[float, ...] | None = None
    """Each routed expert's fraction of the routed tokens where the routing was measured (E
    entries in expert order, summing to 1); None: not measured. Read by
    :meth:`member_imbalance`."""

    def __post_init__(self) -> None:
        _count(self.experts, "MoEProfile.experts", 1)
        _count(self.top_k, "MoEProfile.top_k", 1)
        require(
            self.top_k <= self.experts,
            f"MoEProfile.top_k must be at most experts = {self.experts}, got {self.top_k}",
        )
        _count(self.expert_parameter_bytes, "MoEProfile.expert_parameter_bytes", 0)
        for name in (
            "tokens_per_expert_per_sample",
            "dispatch_bytes_per_sample",
            "combine_bytes_per_sample",
        ):
            _size(getattr(self, name), f"MoEProfile.{name}")
        peak = self.max_tokens_per_expert_per_sample
        mean = self.tokens_per_expert_per_sample
        require(
            peak is None
            or (
                isinstance(peak, (int, float))
                and math.isfinite(peak)
                and peak >= mean * (1 - _SLACK)
            ),
            f"MoEProfile.max_tokens_per_expert_per_sample must be None or a number >= the mean "
            f"{mean}, got {peak!r}",
        )
        _load_shares(self.expert_load_shares, self.experts, "MoEProfile.expert_load_shares")
        router = _shares(self.router_time_share, "MoEProfile.router_time_share")
        expert = _shares(self.expert_time_share, "MoEProfile.expert_time_share")
        if router is not None and expert is not None:
            require(
                all(r + x <= 1 + _SLACK for r, x in zip(router, expert, strict=True)),
                f"MoEProfile: router {router} and expert {expert} time shares add up to more "
                "than the layer's time",
            )

    @property
    def imbalance(self) -> float:
        """Busiest expert's tokens over the mean (>= 1); 1.0 where not measured or no token is
        routed."""
        peak = self.max_tokens_per_expert_per_sample
        mean = self.tokens_per_expert_per_sample
        if peak is None or mean <= 0:
            return 1.0
        return max(1.0, peak / mean)

    def member_imbalance(self, width: int) -> float:
        """The busiest member's tokens over the mean at expert-parallel width e_s (>= 1):
        member q holds experts ``[q E / e_s, (q + 1) E / e_s)`` and computes the tokens of all
        of them, so its load is the sum of their :attr:`expert_load_shares` against ``1 /
        e_s``. 1.0 at e_s = 1 (every replica runs its own tokens through all experts); the
        busiest single expert's :attr:`imbalance` where the shares were not measured (a bound:
        a member's sum is at most that uneven).

        Raises:
            ValidationError: e_s does not divide E.
        """
        require(
            isinstance(width, int) and width >= 1 and self.experts % width == 0,
            f"expert-parallel width must be an integer >= 1 dividing the {self.experts} "
            f"experts, got {width!r}",
        )
        shares = self.expert_load_shares
        if width == 1:
            return 1.0
        if shares is None:
            return self.imbalance
        per = self.experts // width
        busiest = max(sum(shares[q * per : (q + 1) * per]) for q in range(width))
        return max(1.0, busiest * width / sum(shares)) if sum(shares) > 0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "experts": self.experts,
            "top_k": self.top_k,
            "expert_parameter_bytes": self.expert_parameter_bytes,
            "tokens_per_expert_per_sample": self.tokens_per_expert_per_sample,
            "dispatch_bytes_per_sample": self.dispatch_bytes_per_sample,
            "combine_bytes_per_sample": self.combine_bytes_per_sample,
        }
        if self.max_tokens_per_expert_per_sample is not None:
            d["max_tokens_per_expert_per_sample"] = self.max_tokens_per_expert_per_sample
        if self.router_time_share is not None:
            d["router_time_share"] = list(self.router_time_share)
        if self.expert_time_share is not None:
            d["expert_time_share"] = list(self.expert_time_share)
        if self.expert_load_shares is not None:
            d["expert_load_shares"] = list(self.expert_load_shares)
        return d

    @staticmethod
    def from_dict(d: Any, what: str = "moe") -> MoEProfile:
        """A record from its ``to_dict`` form.

        Raises:
            ValidationError: not an object, a missing or invalid field (named in the message).
        """
        require(isinstance(d, dict), f"{what} must be an object, got {d!r}"[:200])
        peak = d.get("max_tokens_per_expert_per_sample")
        return MoEProfile(
            experts=_count(get_field(d, "experts", what), f"{what}: experts", 1),
            top_k=_count(get_field(d, "top_k", what), f"{what}: top_k", 1),
            expert_parameter_bytes=_count(
                get_field(d, "expert_parameter_bytes", what), f"{what}: expert_parameter_bytes", 0
            ),
            tokens_per_expert_per_sample=_size(
                get_field(d, "tokens_per_expert_per_sample", what),
                f"{what}: tokens_per_expert_per_sample",
            ),
            max_tokens_per_expert_per_sample=None
            if peak is None
            else _size(peak, f"{what}: max_tokens_per_expert_per_sample"),
            dispatch_bytes_per_sample=_size(
                get_field(d, "dispatch_bytes_per_sample", what),
                f"{what}: dispatch_bytes_per_sample",
            ),
            combine_bytes_per_sample=_size(
                get_field(d, "combine_bytes_per_sample", what), f"{what}: combine_bytes_per_sample"
            ),
            router_time_share=_shares(d.get("router_time_share"), f"{what}: router_time_share"),
            expert_time_share=_shares(d.get("expert_time_share"), f"{what}: expert_time_share"),
            expert_load_shares=_load_shares(
                d.get("expert_load_shares"),
                _count(get_field(d, "experts", what), f"{what}: experts", 1),
                f"{what}: expert_load_shares",
            ),
        )

"""Mixture-of-experts and latent-attention shapes for the analytic profiler: no weights, no torch.

:class:`MoESpec` is a sparse feed-forward (Mixtral, Qwen-MoE, DeepSeek-V3): E routed SwiGLU
experts of width f_e, each token sent to k of them by a linear router, optional shared experts
every token passes through, and a first few dense blocks. :class:`MLASpec` is DeepSeek's
multi-head latent attention (queries and keys/values through low-rank projections, a rotary part
of each head kept apart). A :class:`~dapple.profiler.analytic_models.TransformerSpec` carries
either as its ``moe`` / ``mla`` field; :func:`moe_from_hf` and :func:`mla_from_hf` read them from
a Hugging Face ``config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dapple.errors import ValidationError

__all__ = ["MLASpec", "MoESpec", "mla_from_hf", "moe_from_hf"]


def _check_counts(owner: str, **values: int) -> None:
    for name, v in values.items():
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise ValidationError(f"{owner}.{name} must be an integer >= 0, got {v!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MoESpec:
    """A sparse SwiGLU feed-forward: ``experts`` routed experts, ``top_k`` per token."""

    experts: int
    """E: routed experts per MoE block."""
    top_k: int
    """k: routed experts each token is sent to."""
    expert_ffn: int
    """f_e: feed-forward width of one routed expert (gate/up output)."""
    shared_ffn: int = 0
    """Width of the shared experts every token passes through, all of them together (Qwen2-MoE's
    ``shared_expert_intermediate_size``, DeepSeek's ``n_shared_experts x f_e``); 0: none."""
    shared_gate: bool = False
    """A sigmoid gate ``h -> 1`` scales the shared experts' output (Qwen2-MoE)."""
    dense_layers: int = 0
    """The first blocks have a dense MLP of the model's ``ffn`` instead (DeepSeek-V3's
    ``first_k_dense_replace``)."""

    def __post_init__(self) -> None:
        _check_counts("MoESpec", shared_ffn=self.shared_ffn, dense_layers=self.dense_layers)
        for name in ("experts", "top_k", "expert_ffn"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValidationError(f"MoESpec.{name} must be an integer >= 1, got {v!r}")
        if self.top_k > self.experts:
            raise ValidationError(
                f"MoESpec.top_k must be at most experts = {self.experts}, got {self.top_k}"
            )

    def routed_parameters(self, hidden: int) -> int:
        """All E routed experts of one block: ``3 h f_e`` each (gate, up, down)."""
        return self.experts * 3 * hidden * self.expert_ffn

    def inactive_parameters(self, hidden: int) -> int:
        """Routed-expert parameters a token does not use: ``(E - k)`` experts."""
        return (self.experts - self.top_k) * 3 * hidden * self.expert_ffn

    def dense_parameters(self, hidden: int) -> int:
        """The rest of the feed-forward: router, shared experts and their gate (DeepSeek-V3's
        per-expert routing bias is a buffer updated outside the optimizer, not counted)."""
        n = hidden * self.experts + 3 * hidden * self.shared_ffn
        return n + (hidden if self.shared_gate else 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3), trained without weight absorption."""

    q_rank: int
    """Rank of the query projection ``h -> q_rank -> a (d_nope + d_rope)`` (``q_lora_rank``);
    0: a direct ``h -> a (d_nope + d_rope)`` projection."""
    kv_rank: int
    """Rank of the compressed keys/values ``h -> kv_rank (+ d_rope)`` (``kv_lora_rank``)."""
    nope_dim: int
    """d_nope: the part of a query/key head without rotary embedding."""
    rope_dim: int
    """d_rope: the rotary part of a query head; the key's is shared by all heads."""
    v_dim: int
    """d_v: width of a value head."""

    def __post_init__(self) -> None:
        _check_counts("MLASpec", q_rank=self.q_rank)
        for name in ("kv_rank", "nope_dim", "rope_dim", "v_dim"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValidationError(f"MLASpec.{name} must be an integer >= 1, got {v!r}")

    @property
    def qk_dim(self) -> int:
        """Width of a query/key head, ``d_nope + d_rope``."""
        return self.nope_dim + self.rope_dim

    def parameters(self, hidden: int, heads: int) -> int:
        """The attention's parameters: query, key/value and output projections and the two
        latent RMSNorms."""
        a = heads
        q = hidden * a * self.qk_dim
        if self.q_rank:
            q = hidden * self.q_rank + self.q_rank + self.q_rank * a * self.qk_dim
        kv = hidden * (self.kv_rank + self.rope_dim) + self.kv_rank
        kv += self.kv_rank * a * (self.nope_dim + self.v_dim)
        return q + kv + a * self.v_dim * hidden


def moe_from_hf(config: dict[str, Any], kind: str, name: str) -> MoESpec | None:
    """The :class:`MoESpec` of a Hugging Face ``config.json`` (None: a dense model type).

    Reads ``mixtral`` (``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size``),
    ``qwen2_moe`` (``num_experts``, ``moe_intermediate_size``,
    ``shared_expert_intermediate_size``; every block sparse) and ``deepseek_v3``
    (``n_routed_experts``, ``n_shared_experts``, ``first_k_dense_replace``).

    Raises:
        ValidationError: a missing field, or a Qwen2-MoE config with dense blocks between its
            sparse ones (``decoder_sparse_step`` > 1, ``mlp_only_layers``).
    """

    def get(key: str) -> int:
        if config.get(key) is None:
            raise ValidationError(f"hf config {name!r}: {key} is not set")
        return int(config[key])

    if kind == "mixtral":
        return MoESpec(experts=get("num_local_experts"), top_k=get("num_experts_per_tok"),
                       expert_ffn=get("intermediate_size"))  # fmt: skip
    if kind == "qwen2_moe":
        step, only = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
        if step != 1 or only:
            raise ValidationError(
                f"hf config {name!r}: dense blocks among the sparse ones (decoder_sparse_step="
                f"{step}, mlp_only_layers={only}) are not modelled; every block must be sparse"
            )
        return MoESpec(experts=get("num_experts"), top_k=get("num_experts_per_tok"),
                       expert_ffn=get("moe_intermediate_size"),
                       shared_ffn=int(config.get("shared_expert_intermediate_size") or 0),
                       shared_gate=bool(config.get("shared_expert_intermediate_size")))  # fmt: skip
    if kind == "deepseek_v3":
        f_e = get("moe_intermediate_size")
        return MoESpec(experts=get("n_routed_experts"), top_k=get("num_experts_per_tok"),
                       expert_ffn=f_e, shared_ffn=int(config.get("n_shared_experts") or 0) * f_e,
                       dense_layers=int(config.get("first_k_dense_replace") or 0))  # fmt: skip
    return None


def mla_from_hf(config: dict[str, Any], kind: str, name: str) -> MLASpec | None:
    """The :class:`MLASpec` of a ``deepseek_v3`` config (None for other model types).

    Raises:
        ValidationError: a missing latent-attention field.
    """
    if kind != "deepseek_v3":
        return None
    keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    missing = [k for k in keys if config.get(k) is None]
    if missing:
        raise ValidationError(f"hf config {name!r}: {', '.join(missing)} not set")
    return MLASpec(q_rank=int(config.get("q_lora_rank") or 0), kv_rank=int(config[keys[0]]),
                   nope_dim=int(config[keys[1]]), rope_dim=int(config[keys[2]]),
                   v_dim=int(config[keys[3]]))  # fmt: skip

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

__all__ = ["MOE_PUBLISHED", "MOE_SHAPES", "MLASpec", "MoESpec", "mla_from_hf", "moe_from_hf"]


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


MOE_SHAPES: dict[str, dict[str, Any]] = {
    # Mixtral-8x7B: mistralai/Mixtral-8x7B-v0.1's config.json on the Hugging Face hub (Mistral-7B
    # shapes, num_local_experts 8, num_experts_per_tok 2, intermediate_size 14336 per expert),
    # trained here at 4,096 tokens.
    "mixtral-8x7b": dict(
        hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=32000, seq=4096,
        moe=MoESpec(experts=8, top_k=2, expert_ffn=14336),
    ),
    # Qwen1.5-MoE-A2.7B: Qwen/Qwen1.5-MoE-A2.7B's config.json (qwen2_moe: 60 experts of
    # moe_intermediate_size 1408, top 4, a gated shared expert of 5632, q/k/v biases).
    "qwen1.5-moe-a2.7b": dict(
        hidden=2048, layers=24, heads=16, kv_heads=16, ffn=5632, vocab=151936, seq=4096,
        qkv_bias=True,
        moe=MoESpec(experts=60, top_k=4, expert_ffn=1408, shared_ffn=5632, shared_gate=True),
    ),
    # Qwen2-57B-A14B: Qwen/Qwen2-57B-A14B's config.json (qwen2_moe: 64 experts of 2560, top 8,
    # a gated shared expert of 20480, 4 key/value heads).
    "qwen2-57b-a14b": dict(
        hidden=3584, layers=28, heads=28, kv_heads=4, ffn=18944, vocab=151936, seq=4096,
        qkv_bias=True,
        moe=MoESpec(experts=64, top_k=8, expert_ffn=2560, shared_ffn=20480, shared_gate=True),
    ),
    # DeepSeek-V3: deepseek-ai/DeepSeek-V3's config.json (latent attention: q_lora_rank 1536,
    # kv_lora_rank 512, heads of 128 + 64 rotary, values of 128; 256 routed experts of 2048,
    # top 8, one shared expert, the first 3 blocks dense of 18432), pre-trained at 4,096 tokens
    # (technical report, section 4.2); the multi-token-prediction module is not counted.
    "deepseek-v3": dict(
        hidden=7168, layers=61, heads=128, kv_heads=128, ffn=18432, vocab=129280, seq=4096,
        mla=MLASpec(q_rank=1536, kv_rank=512, nope_dim=128, rope_dim=64, v_dim=128),
        moe=MoESpec(experts=256, top_k=8, expert_ffn=2048, shared_ffn=2048, dense_layers=3),
    ),
}  # fmt: skip
"""The ``TransformerSpec`` fields of the mixture-of-experts presets of
:data:`~dapple.profiler.analytic_presets.PRESETS` (SwiGLU, RMSNorm, rotary, untied; comments give
each configuration's source)."""

MOE_PUBLISHED: dict[str, tuple[str, str]] = {
    "mixtral-8x7b": ("46.7B", "12.9B"),
    "qwen1.5-moe-a2.7b": ("14.3B", "2.7B"),
    "qwen2-57b-a14b": ("57B", "14B"),
    "deepseek-v3": ("671B", "37B"),
}
"""Total and active parameters of the mixture-of-experts presets as their publishers print them
(Mistral AI's Mixtral announcement, the Qwen model cards, the DeepSeek-V3 technical report)."""

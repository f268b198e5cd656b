"""Transformer model descriptions for the analytic profiler: shapes only, no weights, no torch.

A :class:`TransformerSpec` holds the fields of a Hugging Face config (hidden size, layers,
heads, key/value heads, feed-forward width, vocabulary, sequence length) plus the choices that
change costs (SwiGLU or GELU MLP, RMSNorm or LayerNorm, biases, learned positions, tied
embeddings, causal or bidirectional attention). It describes Llama-family and GPT-family
decoders, BERT encoders and dapple's zoo ``transformer``, at any size: a 405B model needs no
memory to describe.

A mixture of experts (Mixtral, Qwen-MoE, DeepSeek-V3) adds an
:class:`~dapple.profiler.analytic_moe_models.MoESpec`, DeepSeek's latent attention an
:class:`~dapple.profiler.analytic_moe_models.MLASpec`.

Specs come from :mod:`dapple.profiler.analytic_presets`: a named preset, a Hugging Face
``config.json`` or the zoo transformer's arguments.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Literal

from dapple.errors import ValidationError
from dapple.profiler.analytic_moe_models import MLASpec, MoESpec

__all__ = ["ANALYTIC_KIND", "MAX_PARAMETERS", "MAX_SEQ", "TransformerSpec", "spec_fingerprint"]

MAX_SEQ = 2**24
"""The longest sample the analytic profiler counts (16,777,216 tokens), past any model's
context."""

MAX_PARAMETERS = 10**15
"""The most parameters the analytic profiler counts (a thousand times a 1T-parameter model)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerSpec:
    """Shapes of a transformer LM: embedding, ``layers`` blocks, final norm and head."""

    name: str
    """Model name (becomes the profile's ``model_name``)."""
    hidden: int
    """h: model width."""
    layers: int
    """L: transformer blocks."""
    heads: int
    """a: query heads."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: ``heads``."""
    head_dim: int | None = None
    """d: width of one head; None: ``hidden // heads``."""
    ffn: int
    """f: feed-forward width (the gate/up projections' output)."""
    vocab: int
    """V: vocabulary (embedding rows)."""
    seq: int
    """s: tokens per sample (the context the model is trained at)."""
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    """``swiglu``: gate, up and down projections (Llama); ``gelu``: two projections (GPT, BERT)."""
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    """Normalisation: RMSNorm (weight only) or LayerNorm (weight and bias)."""
    linear_bias: bool = False
    """Every linear layer has a bias (GPT-2, GPT-3, BERT, the zoo transformer)."""
    qkv_bias: bool = False
    """Only the query/key/value projections have biases (Qwen2)."""
    learned_positions: bool = False
    """A learned position table of ``max_positions`` rows (GPT, BERT); False: rotary (no
    parameters)."""
    max_positions: int | None = None
    """Rows of the learned position table; None: ``seq``."""
    token_types: int = 0
    """Rows of BERT's token-type table (0: none)."""
    embedding_norm: bool = False
    """A norm after the embeddings (BERT)."""
    final_norm: bool = True
    """A norm before the head (pre-LN models); BERT has none."""
    head_outputs: int | None = None
    """Outputs of the head's projection; None: ``vocab`` (an LM head with cross entropy over
    the vocabulary). BERT-48 on SQuAD: 2 (span start and end)."""
    head_bias: bool = False
    """The head's projection has a bias (the zoo transformer's ``nn.Linear``)."""
    tied_embeddings: bool = False
    """The LM head reuses the embedding table (GPT-2, GPT-3, Megatron GPT)."""
    causal: bool = True
    """Causal (decoder) attention; False: bidirectional (BERT)."""
    dropout: bool = False
    """Training with dropout after attention probabilities and after each residual branch
    (keeps one-byte masks)."""
    moe: MoESpec | None = None
    """The blocks' feed-forward is a mixture of experts (after ``moe.dense_layers`` dense
    blocks); None: a dense MLP of width ``ffn`` in every block."""
    mla: MLASpec | None = None
    """Multi-head latent attention instead of grouped-query attention; None: the latter."""

    def __post_init__(self) -> None:
        for f in ("hidden", "layers", "heads", "ffn", "vocab", "seq"):
            v = getattr(self, f)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ValidationError(
                    f"model {self.name!r}: {f} must be an integer >= 1, got {v!r}"
                )
        if self.seq > MAX_SEQ:
            raise ValidationError(
                f"model {self.name!r}: seq={self.seq:,} tokens per sample exceeds the analytic "
                f"profiler's limit of {MAX_SEQ:,}"
            )
        if self.head_dim is None and self.hidden % self.heads:
            raise ValidationError(
                f"model {self.name!r}: heads={self.heads} must divide hidden={self.hidden} "
                "(or give head_dim)"
            )
        if self.heads % self.n_kv_heads:
            raise ValidationError(
                f"model {self.name!r}: kv_heads={self.n_kv_heads} must divide heads={self.heads}"
            )
        if self.moe is not None and self.moe.dense_layers > self.layers:
            raise ValidationError(
                f"model {self.name!r}: {self.moe.dense_layers} dense blocks exceed its "
                f"{self.layers} blocks"
            )
        if self.learned_positions and self.positions < self.seq:
            raise ValidationError(
                f"model {self.name!r}: seq={self.seq} exceeds the {self.positions} learned positions"
            )
        if (n := self.parameters()) > MAX_PARAMETERS:
            raise ValidationError(
                f"model {self.name!r}: {n:.3g} parameters exceed the analytic profiler's limit "
                f"of {MAX_PARAMETERS:.0e} (hidden={self.hidden}, layers={self.layers}, "
                f"ffn={self.ffn}, vocab={self.vocab})"
            )

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def d_head(self) -> int:
        """d, the width of one head."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def positions(self) -> int:
        """Rows of the learned position table."""
        return self.max_positions if self.max_positions is not None else self.seq

    @property
    def outputs(self) -> int:
        """Outputs of the head's projection."""
        return self.head_outputs if self.head_outputs is not None else self.vocab

    @property
    def lm_head(self) -> bool:
        """Whether the head projects onto the vocabulary (with cross entropy over it)."""
        return self.head_outputs is None

    def block(self, i: int) -> TransformerSpec:
        """The spec of block ``i``: this one, or without its experts for a leading dense block."""
        if self.moe is None or i >= self.moe.dense_layers:
            return self
        return dataclasses.replace(self, moe=None)

    def with_seq(self, seq: int) -> TransformerSpec:
        """This model at another sequence length (the learned table keeps its rows)."""
        positions = self.positions if self.learned_positions else None
        return dataclasses.replace(self, seq=seq, max_positions=positions)

    # -- parameters ------------------------------------------------------------------------
    def embedding_parameters(self) -> int:
        """Token table, learned positions and token types, embedding norm."""
        h = self.hidden
        n = self.vocab * h
        n += self.positions * h if self.learned_positions else 0
        n += self.token_types * h
        n += self._norm_parameters() if self.embedding_norm else 0
        return n

    def block_parameters(self) -> int:
        """One transformer block: attention, MLP (all experts of a mixture), two norms."""
        h, q, kv = self.hidden, self.heads * self.d_head, self.n_kv_heads * self.d_head
        attn = h * q + 2 * h * kv + q * h
        if self.mla is not None:
            attn = self.mla.parameters(h, self.heads)
        elif self.linear_bias:
            attn += q + 2 * kv + h
        elif self.qkv_bias:
            attn += q + 2 * kv
        mlp = 3 * h * self.ffn if self.mlp == "swiglu" else 2 * h * self.ffn
        if self.linear_bias:
            mlp += (2 * self.ffn if self.mlp == "swiglu" else self.ffn) + h
        if self.moe is not None:
            mlp = self.moe.routed_parameters(h) + self.moe.dense_parameters(h)
        return attn + mlp + 2 * self._norm_parameters()

    def head_parameters(self) -> int:
        """Final norm and the head's projection (a tied head counts its copy of the table)."""
        n = self._norm_parameters() if self.final_norm else 0
        n += self.hidden * self.outputs + (self.outputs if self.head_bias else 0)
        return n

    def parameters(self, *, count_tied_once: bool = True) -> int:
        """All parameters; a tied head's table counted once unless ``count_tied_once`` is
        False."""
        dense = self.moe.dense_layers if self.moe is not None else 0
        n = self.embedding_parameters() + (self.layers - dense) * self.block_parameters()
        n += dense * self.block(0).block_parameters() + self.head_parameters()
        if self.tied_embeddings and count_tied_once:
            n -= self.hidden * self.outputs
        return n

    def active_parameters(self) -> int:
        """Parameters one token uses: :meth:`parameters` less the routed experts it is not
        sent to (``E - k`` per mixture-of-experts block)."""
        if self.moe is None:
            return self.parameters()
        blocks = self.layers - self.moe.dense_layers
        return self.parameters() - blocks * self.moe.inactive_parameters(self.hidden)

    def _norm_parameters(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    # -- parameters one by one ---------------------------------------------------------------
    def _norm_tensors(self) -> tuple[int, ...]:
        return (self.hidden, self.hidden) if self.norm == "layernorm" else (self.hidden,)

    def embedding_tensors(self) -> tuple[int, ...]:
        """:meth:`embedding_parameters` tensor by tensor in Hugging Face's registration
        order: the token table (a tied one included), positions, token types, norm. (The zoo
        transformer's embedding holds its position table before the token table: a module's
        own parameters come before its children's. They are the last tensors a stage cuts into
        buckets, so the order can move only its last buckets' cut.)"""
        h = self.hidden
        out = [self.vocab * h]
        out += [self.positions * h] if self.learned_positions else []
        out += [self.token_types * h] if self.token_types else []
        out += self._norm_tensors() if self.embedding_norm else ()
        return tuple(out)

    def block_tensors(self) -> tuple[int, ...] | None:
        """:meth:`block_parameters` tensor by tensor in registration order, each weight
        followed by its bias: a causal GELU block as GPT-2's and the zoo transformer's (norm,
        one query-key-value projection, output projection, norm, MLP), a bidirectional one
        as BERT's (query, key, value and output projections, norm, MLP, norm), any other as
        Llama's (query, key, value and output projections, MLP, two norms). None for latent
        attention or a mixture of experts (not listed)."""
        if self.mla is not None or self.moe is not None:
            return None
        h, q, kv, f = self.hidden, self.heads * self.d_head, self.n_kv_heads * self.d_head, self.ffn
        bias, qkv_bias = self.linear_bias, self.linear_bias or self.qkv_bias

        def proj(n_in: int, n_out: int, with_bias: bool) -> list[int]:
            return [n_in * n_out] + ([n_out] if with_bias else [])

        norm = list(self._norm_tensors())
        out = proj(q, h, bias)
        mlp = proj(h, f, bias) * (2 if self.mlp == "swiglu" else 1) + proj(f, h, bias)
        if self.mlp == "gelu" and self.causal:
            return (*norm, *proj(h, q + 2 * kv, qkv_bias), *out, *norm, *mlp)
        attn = proj(h, q, qkv_bias) + proj(h, kv, qkv_bias) * 2 + out
        if not self.causal:
            return (*attn, *norm, *mlp, *norm)
        return (*attn, *mlp, *norm, *norm)

    def head_tensors(self) -> tuple[int, ...]:
        """:meth:`head_parameters` tensor by tensor in registration order: the final norm,
        the projection (a tied table included) and its bias."""
        out = list(self._norm_tensors()) if self.final_norm else []
        out += [self.hidden * self.outputs] + ([self.outputs] if self.head_bias else [])
        return tuple(out)


ANALYTIC_KIND = "analytic-spec-v1"
"""What an analytic profile's fingerprint hashes (the prefix of its string): the layer count
and the spec's shapes (:func:`spec_fingerprint`)."""


def spec_fingerprint(spec: TransformerSpec, num_layers: int) -> str:
    """``analytic-spec-v1:`` and the sha256 (16 hex digits) of ``num_layers`` (the profile's
    chain) and every field of ``spec`` but its name and length (``seq``: a profile at another
    length is of the same model, unless the length sizes its learned position table, which is
    hashed): two analytic profiles of one name and layer count but other widths, heads or
    vocabularies differ in it."""
    fields = {k: v for k, v in dataclasses.asdict(spec).items() if k not in ("name", "seq")}
    fields["max_positions"] = spec.positions if spec.learned_positions else None
    text = json.dumps([num_layers, fields], sort_keys=True, default=str, separators=(",", ":"))
    return f"{ANALYTIC_KIND}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"

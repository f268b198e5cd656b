"""FLOPs, bytes and kept activations of a transformer's layers, operation by operation.

Pure, no torch: arithmetic over a :class:`~dapple.profiler.analytic_models.TransformerSpec`;
:mod:`dapple.profiler.analytic` times the ops with a roofline and builds the profile.

Layers are those of dapple's transformer workloads (the zoo transformer, Hugging Face models):
``embedding``, one ``block<i>`` per block, and ``lm_head`` (final norm, projection, loss). With
``fold_ends`` the embedding joins the first block and the head the last (Megatron-LM's stages
hold whole blocks; an interleaved schedule then splits blocks evenly).

Each layer is a list of :class:`Op`\\ s. Per sample of ``s`` tokens (h hidden, a heads of width
d, k key/value heads, f feed-forward width, V vocabulary, e bytes per activation element: 4 in
fp32, 2 otherwise):

* a linear ``n_in -> n_out`` (class ``matmul``): ``2 s n_in n_out`` FLOPs forward, twice that
  backward (input and weight gradients); bytes: its input and output per token, its weights
  once per call (and the fp32 weight gradient accumulated, read and written, backward);
* fused (flash) attention (class ``attention``): ``4 s s_kv a d`` FLOPs forward with
  ``s_kv = (s + 1) / 2`` for causal attention (masked tiles are skipped) and ``s`` otherwise;
  backward 2.5 times that (FlashAttention's backward recomputes the scores: five GEMMs to the
  forward's two); bytes: Q, K, V, O and the log-sum-exp;
* eager attention (fp32 models, the DAPPLE-era frameworks): the scores and context GEMMs
  (class ``matmul``, full ``s x s``, masked afterwards), softmax and attention dropout over
  the ``a s^2`` probabilities (class ``memory``);
* norms, activations, residual adds, rotary embeddings, dropout, embedding lookups and the
  cross entropy (class ``memory``): bytes read and written, as eager PyTorch kernels do.

Kept activations (bytes held from forward to backward) follow what autograd saves: a linear
its input, a norm its input and statistics, GELU its input, SwiGLU the gate, its SiLU and the
up projection, flash attention Q, K, V and the log-sum-exp (O is the output projection's
input), eager attention Q, K, V, the probabilities and the dropout mask; for a GPT block with
eager attention and dropout in 16 bits that is Korthikanti et al. (2022)'s ``34 s h + 5 a s^2``
bytes, plus the norms' fp32 statistics. ``recompute``: ``none``; ``selective`` (Korthikanti:
eager attention's core is recomputed, keeping Q, K, V only; nothing changes with flash
attention, which already does); ``full`` (every block keeps only its input and re-runs its
forward during the backward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from dapple.core.precision import ANALYTIC_PRECISIONS, precision_of
from dapple.core.recompute import RECOMPUTE_MODES, Recompute
from dapple.errors import ValidationError
from dapple.profiler.analytic_models import TransformerSpec

__all__ = [
    "ATTENTION_IMPLS",
    "LayerCost",
    "Op",
    "autocast_casts",
    "block_ops",
    "layer_costs",
    "linear_op",
]

ATTENTION_IMPLS = ("flash", "eager", "masked")
"""Attention implementations: fused (flash), materialised scores, or a fused kernel given an
explicit mask (``masked``: SDPA in a traced Hugging Face model)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Op:
    """One operation of a layer; FLOPs and bytes per sample unless marked per call."""

    name: str
    kind: str
    """``matmul``, ``attention`` or ``memory`` (the efficiency applied)."""
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0
    """HBM bytes read and written by the forward, per sample."""
    bwd_bytes: float = 0.0
    fwd_bytes_per_call: float = 0.0
    """Bytes independent of the batch (weights read), per call."""
    bwd_bytes_per_call: float = 0.0
    kept_bytes: float = 0.0
    """Bytes saved for the backward, per sample."""
    kernels: tuple[int, int] = (1, 2)
    """Kernels launched forward, backward."""
    weight_gemm: bool = False
    """A GEMM with a weight (runs in fp8 under ``fp8``; attention GEMMs stay in bf16)."""
    aligned: bool = True
    """Every GEMM dimension is a multiple of 8 elements (16 bytes in 16 bits): Tensor Core
    kernels need it; GPT-2's 50,257-word head is not."""
    core: bool = False
    """Part of eager attention's core (scores, softmax, dropout, context): what selective
    checkpointing recomputes."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCost:
    """One layer of the chain as ops, before timing."""

    name: str
    ops: tuple[Op, ...]
    parameters: int
    """Parameters (a tied head counts its copy)."""
    tied_parameters: int = 0
    """Parameters of ``parameters`` shared with another layer (tied embeddings)."""
    output_bytes_per_sample: float
    kept_bytes_per_sample: float
    """Kept activations after checkpointing."""
    recomputed: tuple[Op, ...] = ()
    """Ops whose forward re-runs during the backward (checkpointing)."""
    tensors: tuple[int, ...] | None = None
    """The untied parameters (``parameters - tied_parameters``) tensor by tensor, in
    registration order (``LayerProfile.parameter_sizes`` in elements); None: not listed."""

    @property
    def forward_flops(self) -> float:
        """FLOPs of one sample's forward."""
        return sum(op.fwd_flops for op in self.ops)

    @property
    def backward_flops(self) -> float:
        """FLOPs of one sample's backward, recomputation included."""
        return sum(op.bwd_flops for op in self.ops) + sum(op.fwd_flops for op in self.recomputed)


# -- op builders ---------------------------------------------------------------------------


def linear_op(name: str, n_in: int, n_out: int, s: float, e: int, *, bias: bool = False) -> Op:
    """A linear layer ``n_in -> n_out`` on ``s`` tokens per sample (keeps its input)."""
    return Op(
        name=name,
        kind="matmul",
        fwd_flops=2.0 * s * n_in * n_out,
        bwd_flops=4.0 * s * n_in * n_out,
        fwd_bytes=s * (n_in + n_out) * e,
        bwd_bytes=s * (2 * n_out + 2 * n_in + (n_out if bias else 0)) * e,
        fwd_bytes_per_call=float(n_in * n_out * e),
        bwd_bytes_per_call=float(n_in * n_out * (e + 8)),
        kept_bytes=s * n_in * e,
        kernels=(1, 3 if bias else 2),
        weight_gemm=True,
        aligned=n_in % 8 == 0 and n_out % 8 == 0,
    )


def _norm(name: str, spec: TransformerSpec, s: float, e: int) -> Op:
    stats = 8 if spec.norm == "layernorm" else 4  # fp32 mean and rstd, or rstd
    h = spec.hidden
    return Op(
        name=name,
        kind="memory",
        fwd_bytes=s * (2 * h * e + stats),
        bwd_bytes=s * (3 * h * e + stats),
        kept_bytes=s * (h * e + stats),
    )


def _pointwise(name: str, elements: float, e: int, *, reads: int, bwd: int, kept: float) -> Op:
    """An element-wise op over ``elements`` per sample: ``reads`` tensors read + 1 written
    forward, ``bwd`` tensors moved backward, ``kept`` elements saved."""
    return Op(
        name=name,
        kind="memory",
        fwd_bytes=elements * (reads + 1) * e,
        bwd_bytes=elements * bwd * e,
        kept_bytes=kept * e,
        kernels=(1, 1),
    )


def _dropout(name: str, elements: float, e: int, *, keep_output: bool = False) -> Op:
    """Dropout: reads, writes and a one-byte mask; keeps the mask (and its output when the
    next op saves it)."""
    return Op(
        name=name,
        kind="memory",
        fwd_bytes=elements * (2 * e + 1),
        bwd_bytes=elements * (2 * e + 1),
        kept_bytes=elements * (1 + (e if keep_output else 0)),
        kernels=(1, 1),
        core=keep_output,
    )


def _attention_ops(spec: TransformerSpec, s: float, e: int, impl: str) -> list[Op]:
    a, d = spec.heads, spec.d_head
    q_w, kv_w = a * d, spec.n_kv_heads * d
    if impl == "masked":
        return _masked_sdpa_ops(spec, s, e)
    if impl == "flash":
        s_kv = (s + 1) / 2 if spec.causal else s
        qkv = s * (q_w + 2 * kv_w) * e
        lse = a * s * 4.0
        fwd = 4.0 * s * s_kv * a * d
        return [
            Op(
                name="attention",
                kind="attention",
                fwd_flops=fwd,
                bwd_flops=2.5 * fwd,
                fwd_bytes=qkv + s * q_w * e + lse,
                bwd_bytes=2 * qkv + 2 * s * q_w * e + lse,
                kept_bytes=qkv + lse,
                kernels=(1, 2),
            )
        ]
    probs = a * s * s  # elements of the score / probability matrix; K, V expanded to a heads
    ops = [
        Op(
            name="scores",
            kind="matmul",
            fwd_flops=2.0 * s * s * a * d,
            bwd_flops=4.0 * s * s * a * d,
            fwd_bytes=2 * s * q_w * e + probs * e,
            bwd_bytes=probs * e + 4 * s * q_w * e,
            kept_bytes=2 * s * q_w * e,
            core=True,
        ),
        Op(
            name="softmax",
            kind="memory",
            fwd_bytes=2 * probs * e,
            bwd_bytes=3 * probs * e,
            kept_bytes=probs * e,
            kernels=(1, 1),
            core=True,
        ),
    ]
    if spec.dropout:
        ops.append(_dropout("attention_dropout", probs, e, keep_output=True))
    ops.append(
        Op(
            name="context",
            kind="matmul",
            fwd_flops=2.0 * s * s * a * d,
            bwd_flops=4.0 * s * s * a * d,
            fwd_bytes=probs * e + 2 * s * q_w * e,
            bwd_bytes=2 * probs * e + 4 * s * q_w * e,
            kept_bytes=s * q_w * e,  # V; the probabilities are kept by softmax or dropout
            core=True,
        )
    )
    return ops


def _masked_sdpa_ops(spec: TransformerSpec, s: float, e: int) -> list[Op]:
    """SDPA given an explicit mask (class ``attention``): what a traced Hugging Face model runs
    (the causal mask is materialised in its prologue, so no flash kernel; grouped K and V are
    expanded to every head first, ``repeat_kv``). A fused kernel over all ``s x s`` tiles (an
    arbitrary mask skips none): ``4 s^2 a d`` FLOPs forward, 2.5 times that backward; bytes:
    Q, expanded K and V, O, the log-sum-exp and the ``s x s`` additive mask (16 bits)."""
    a, d = spec.heads, spec.d_head
    q_w, kv_w = a * d, spec.n_kv_heads * d
    ops = []
    if kv_w != q_w:  # repeat_kv: K and V read, expanded copies written; gradients summed back
        ops.append(_pointwise("repeat_kv", s * 2 * q_w, e, reads=0, bwd=1, kept=0))
        ops[-1] = dataclasses.replace(
            ops[-1], fwd_bytes=s * 2 * (kv_w + q_w) * e, bwd_bytes=s * 2 * (kv_w + q_w) * e
        )
    qkv, lse, mask = s * 3 * q_w * e, a * s * 4.0, s * s * e
    fwd = 4.0 * s * s * a * d
    ops.append(Op(name="attention", kind="attention", fwd_flops=fwd, bwd_flops=2.5 * fwd,
                  fwd_bytes=qkv + s * q_w * e + lse + mask,
                  bwd_bytes=2 * qkv + 2 * s * q_w * e + lse + mask, kept_bytes=qkv + lse,
                  kernels=(1, 2)))  # fmt: skip
    return ops


def block_ops(spec: TransformerSpec, s: float, e: int, attention: str = "flash") -> list[Op]:
    """The ops of one transformer block on ``s`` tokens per sample, in execution order."""
    if spec.moe is not None or spec.mla is not None:  # built on this module's dense block
        from dapple.profiler.analytic_moe_ops import sparse_block_ops

        return sparse_block_ops(spec, s, e, attention)
    h, f = spec.hidden, spec.ffn
    q_w, kv_w = spec.heads * spec.d_head, spec.n_kv_heads * spec.d_head
    bias = spec.linear_bias
    ops = [_norm("attention_norm", spec, s, e)]
    ops.append(linear_op("qkv", h, q_w + 2 * kv_w, s, e, bias=bias or spec.qkv_bias))
    if not spec.learned_positions:
        ops.append(_pointwise("rotary", s * (q_w + kv_w), e, reads=1, bwd=2, kept=0))
    ops += _attention_ops(spec, s, e, attention)
    ops.append(linear_op("attention_out", q_w, h, s, e, bias=bias))
    if spec.dropout:
        ops.append(_dropout("attention_residual_dropout", s * h, e))
    ops.append(_pointwise("attention_residual", s * h, e, reads=2, bwd=3, kept=0))
    ops.append(_norm("mlp_norm", spec, s, e))
    if spec.mlp == "swiglu":
        ops.append(linear_op("gate_up", h, 2 * f, s, e, bias=bias))
        ops.append(  # silu(gate) * up: keeps the gate, its SiLU and the up projection
            Op(name="silu_mul", kind="memory", fwd_bytes=5 * s * f * e,
               bwd_bytes=8 * s * f * e, kept_bytes=3 * s * f * e, kernels=(2, 2))
        )  # fmt: skip
    else:
        ops.append(linear_op("fc1", h, f, s, e, bias=bias))
        ops.append(_pointwise("gelu", s * f, e, reads=1, bwd=3, kept=s * f))
    ops.append(linear_op("down" if spec.mlp == "swiglu" else "fc2", f, h, s, e, bias=bias))
    if spec.dropout:
        ops.append(_dropout("mlp_residual_dropout", s * h, e))
    ops.append(_pointwise("mlp_residual", s * h, e, reads=2, bwd=3, kept=0))
    return ops


def _embedding_ops(spec: TransformerSpec, s: float, e: int) -> list[Op]:
    h = spec.hidden
    ops = [
        Op(  # gather rows; backward: a dense fp32 gradient table, zeroed and accumulated
            name="token_embedding",
            kind="memory",
            fwd_bytes=s * (8 + 2 * h * e),
            bwd_bytes=s * h * (e + 8),
            bwd_bytes_per_call=float(spec.vocab * h * 12),
            kept_bytes=s * 8,
            kernels=(1, 3),
        )
    ]
    for name, present in (
        ("position_embedding", spec.learned_positions),
        ("token_type_embedding", spec.token_types > 0),
    ):
        if present:
            ops.append(_pointwise(name, s * h, e, reads=2, bwd=3, kept=0))
    if spec.embedding_norm:
        ops.append(_norm("embedding_norm", spec, s, e))
    if spec.dropout:
        ops.append(_dropout("embedding_dropout", s * h, e))
    return ops


def _head_ops(spec: TransformerSpec, s: float, e: int) -> list[Op]:
    ops = [_norm("final_norm", spec, s, e)] if spec.final_norm else []
    n = spec.outputs
    ops.append(linear_op("head", spec.hidden, n, s, e, bias=spec.head_bias))
    if spec.lm_head:  # logits cast to fp32, log-softmax (kept), NLL and their backwards
        cast = 0 if e == 4 else e + 4
        ops.append(
            Op(name="cross_entropy", kind="memory", fwd_bytes=s * n * (cast + 8),
               bwd_bytes=s * n * (cast + 16), kept_bytes=s * n * 4.0, kernels=(3, 3))
        )  # fmt: skip
    return ops


# -- layers ----------------------------------------------------------------------------------


def _layer(
    name: str, ops: list[Op], parameters: int, out_bytes: float, recompute: str,
    block_input: float, tied: int = 0, tensors: tuple[int, ...] | None = None,
) -> LayerCost:  # fmt: skip
    kept = sum(op.kept_bytes for op in ops)
    recomputed: tuple[Op, ...] = ()
    if recompute == Recompute.FULL:
        kept, recomputed = block_input, tuple(ops)
    elif recompute == Recompute.SELECTIVE and any(op.core for op in ops):
        core = [op for op in ops if op.core]
        # Q, K (the scores' inputs) and V (the context's) stay; probabilities and masks go
        kept -= sum(op.kept_bytes for op in core if op.name not in ("scores", "context"))
        recomputed = tuple(core)
    return LayerCost(
        name=name, ops=tuple(ops), parameters=parameters, tied_parameters=tied,
        output_bytes_per_sample=out_bytes, kept_bytes_per_sample=kept, recomputed=recomputed,
        tensors=tensors,
    )  # fmt: skip


def layer_costs(
    spec: TransformerSpec,
    precision: str = "bf16",
    *,
    attention: str | None = None,
    recompute: str = "none",
    fold_ends: bool = False,
    autocast: bool = False,
) -> list[LayerCost]:
    """The model's chain of layers as ops: embedding, ``spec.layers`` blocks, head.

    Args:
        spec: the model.
        precision: one of :data:`~dapple.core.precision.ANALYTIC_PRECISIONS`.
        attention: ``flash`` or ``eager``; None: eager in fp32, flash otherwise.
        recompute: one of :data:`RECOMPUTE_MODES`: what the blocks re-compute in the backward
            (activation checkpointing).
        fold_ends: merge the embedding into the first block and the head into the last.
        autocast: fp32 weights cast to 16 bits at every call (``torch.autocast`` in eager
            PyTorch, as dapple runs): each layer with weight GEMMs gets an
            ``autocast_weight_casts`` op (:func:`autocast_casts`).

    Raises:
        ValidationError: an unknown precision, attention or recompute mode.
    """
    _check(precision, ANALYTIC_PRECISIONS, "precision")
    prec = precision_of(precision)
    impl = attention or ("flash" if prec.autocast else "eager")
    _check(impl, ATTENTION_IMPLS, "attention")
    _check(recompute, RECOMPUTE_MODES, "recompute")
    e, s, h = prec.element_bytes, float(spec.seq), spec.hidden
    hidden_bytes = s * h * e
    tied = spec.hidden * spec.outputs if spec.tied_embeddings else 0
    table = spec.embedding_tensors()
    embedding = _layer(
        "embedding", _embedding_ops(spec, s, e), spec.embedding_parameters(), hidden_bytes,
        "none", 0.0, tied, table[1:] if tied else table,
    )  # fmt: skip
    ends = spec.head_tensors()
    proj = len(ends) - 1 - int(spec.head_bias)  # the projection's index, after the norm
    head = _layer(
        "lm_head", _head_ops(spec, s, e), spec.head_parameters(), s * spec.outputs * e, "none",
        0.0, tied, ends[:proj] + ends[proj + 1 :] if tied else ends,
    )  # fmt: skip
    blocks = [
        _layer(f"block{i}", block_ops(spec.block(i), s, e, impl),
               spec.block(i).block_parameters(), hidden_bytes, recompute, hidden_bytes,
               tensors=spec.block(i).block_tensors())
        for i in range(spec.layers)
    ]  # fmt: skip
    if autocast and prec.autocast:
        embedding, head = _with_casts(embedding, e), _with_casts(head, e)
        blocks = [_with_casts(b, e) for b in blocks]
    if not fold_ends:
        return [embedding, *blocks, head]
    blocks[0] = _merge(embedding, blocks[0], f"embedding+{blocks[0].name}")
    blocks[-1] = _merge(blocks[-1], head, f"{blocks[-1].name}+lm_head")
    return blocks


def autocast_casts(ops: Sequence[Op], e: int) -> Op | None:
    """The weight casts of autocast over ``ops``' weight GEMMs (None: none): forward, each fp32
    weight read and its ``e``-byte copy written; backward, the ``e``-byte weight gradient
    written, read back and cast to fp32 (4 bytes) for the fp32 ``.grad``; per call, one kernel
    per weight each way."""
    weights = [op.fwd_bytes_per_call / e for op in ops if op.weight_gemm]
    if not weights:
        return None
    n = sum(weights)
    return Op(name="autocast_weight_casts", kind="memory", fwd_bytes_per_call=n * (4 + e),
              bwd_bytes_per_call=n * (2 * e + 4), kernels=(len(weights), len(weights)))  # fmt: skip


def _with_casts(layer: LayerCost, e: int) -> LayerCost:
    cast = autocast_casts(layer.ops, e)
    if cast is None:
        return layer
    return dataclasses.replace(layer, ops=(*layer.ops, cast))


def _merge(a: LayerCost, b: LayerCost, name: str) -> LayerCost:
    return LayerCost(
        name=name,
        ops=a.ops + b.ops,
        parameters=a.parameters + b.parameters,
        tied_parameters=a.tied_parameters + b.tied_parameters,
        output_bytes_per_sample=b.output_bytes_per_sample,
        kept_bytes_per_sample=a.kept_bytes_per_sample + b.kept_bytes_per_sample,
        recomputed=a.recomputed + b.recomputed,
        tensors=None if a.tensors is None or b.tensors is None else a.tensors + b.tensors,
    )


def _check(value: str, allowed: Sequence[str], what: str) -> None:
    if value not in allowed:
        raise ValidationError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")

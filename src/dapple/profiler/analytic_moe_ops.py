"""FLOPs, bytes and kept activations of a mixture-of-experts feed-forward and of latent
attention, operation by operation (:mod:`dapple.profiler.analytic_ops` for the conventions).

Pure, no torch. Per sample of ``s`` tokens (h hidden, E routed experts of width f_e, k per
token, e bytes per activation element), a sparse block's feed-forward is, in the order Hugging
Face's grouped-matmul experts run it:

* ``router`` (class ``matmul``): the linear ``h -> E`` on every token;
* ``router_topk`` (``memory``): softmax over the E logits in fp32 and the top-k;
* ``dispatch`` (``memory``): each token copied to its k experts, sorted by expert (``s k h``
  elements read and written; the backward sums the copies' gradients back);
* ``experts_gate_up`` and ``experts_down`` (``matmul``): the experts' GEMMs on the ``s k``
  routed tokens, so only the active experts' FLOPs count, ``6 s k h f_e`` forward; the
  weights of all E experts are read once per call; ``experts_silu_mul`` between them;
* ``combine`` (``memory``): the expert outputs scaled by their routing weights and summed back
  to their tokens (keeps the ``s k h`` outputs for the weights' gradient);
* shared experts (a dense SwiGLU of the shared width on every token) and Qwen2-MoE's sigmoid
  gate on them.

Latent attention (DeepSeek-V3, trained without weight absorption): queries through the rank
``q_rank`` projection and its RMSNorm, keys/values through the rank ``kv_rank`` latent, its
RMSNorm and the up-projection to every head, rotary embedding of the ``d_rope`` parts, fused
attention over heads of ``d_nope + d_rope`` (queries, keys) and ``d_v`` (values):
``2 s s_kv a (d_qk + d_v)`` FLOPs forward, 2.5 times that backward; then ``a d_v -> h``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection

from dapple.core.moe_profile import MoEProfile
from dapple.profiler.analytic_models import TransformerSpec
from dapple.profiler.analytic_ops import LayerCost, Op, block_ops, linear_op

__all__ = [
    "EXPERT_OPS",
    "ROUTER_OPS",
    "mla_attention_ops",
    "moe_ffn_ops",
    "moe_record",
    "sparse_block_ops",
]

ROUTER_OPS = frozenset({"router", "router_topk"})
"""Names of the router's ops (``MoEProfile.router_time_share``)."""
EXPERT_OPS = frozenset({"experts_gate_up", "experts_silu_mul", "experts_down"})
"""Names of the routed experts' ops (``MoEProfile.expert_time_share``)."""


def sparse_block_ops(spec: TransformerSpec, s: float, e: int, attention: str) -> list[Op]:
    """The ops of a block with latent attention or a mixture of experts: the dense block's
    (:func:`~dapple.profiler.analytic_ops.block_ops`) with its attention projections and core
    (``qkv`` to ``attention_out``) replaced by :func:`mla_attention_ops` and its MLP by
    :func:`moe_ffn_ops`."""
    ops = block_ops(dataclasses.replace(spec, moe=None, mla=None), s, e, attention)
    if spec.mla is not None:
        names = [op.name for op in ops]
        ops[names.index("qkv") : names.index("attention_out") + 1] = mla_attention_ops(spec, s, e)
    if spec.moe is not None:
        names = [op.name for op in ops]
        first = names.index("gate_up" if spec.mlp == "swiglu" else "fc1")
        last = names.index("down" if spec.mlp == "swiglu" else "fc2")
        ops[first : last + 1] = moe_ffn_ops(spec, s, e)
    return ops


def _memory(name: str, fwd: float, bwd: float, kept: float = 0.0) -> Op:
    return Op(name=name, kind="memory", fwd_bytes=fwd, bwd_bytes=bwd, kept_bytes=kept,
              kernels=(1, 1))  # fmt: skip


def _swiglu(prefix: str, h: int, f: int, tokens: float, e: int, weights: int = 1) -> list[Op]:
    """gate/up, SiLU-times-up and down on ``tokens`` tokens per sample; the per-call weight
    bytes of ``weights`` copies (all experts of a grouped GEMM)."""
    ops = [linear_op(f"{prefix}gate_up", h, 2 * f, tokens, e),
           Op(name=f"{prefix}silu_mul", kind="memory", fwd_bytes=5 * tokens * f * e,
              bwd_bytes=8 * tokens * f * e, kept_bytes=3 * tokens * f * e, kernels=(2, 2)),
           linear_op(f"{prefix}down", f, h, tokens, e)]  # fmt: skip
    if weights == 1:
        return ops
    return [
        dataclasses.replace(op, fwd_bytes_per_call=op.fwd_bytes_per_call * weights,
                            bwd_bytes_per_call=op.bwd_bytes_per_call * weights)
        if op.weight_gemm else op
        for op in ops
    ]  # fmt: skip


def moe_ffn_ops(spec: TransformerSpec, s: float, e: int) -> list[Op]:
    """The ops of a sparse block's feed-forward on ``s`` tokens per sample (module docstring).

    Raises:
        ValueError: ``spec`` has no mixture of experts (``spec.moe`` is None).
    """
    moe = spec.moe
    if moe is None:
        raise ValueError(f"model {spec.name!r} has no mixture of experts")
    h, n_e, routed = spec.hidden, moe.experts, s * moe.top_k
    ops = [
        linear_op("router", h, n_e, s, e),
        _memory("router_topk", s * n_e * (e + 8), s * n_e * 12, kept=s * n_e * 4.0),
        _memory("dispatch", 2 * routed * h * e, 2 * routed * h * e),
        *_swiglu("experts_", h, moe.expert_ffn, routed, e, weights=n_e),
        _memory("combine", routed * h * e + s * h * e, 2 * routed * h * e + s * h * e,
                kept=routed * h * e),
    ]  # fmt: skip
    if moe.shared_ffn:
        ops += _swiglu("shared_", h, moe.shared_ffn, s, e)
    if moe.shared_gate:
        ops.append(linear_op("shared_gate", h, 1, s, e))
        ops.append(_memory("shared_gate_mul", 3 * s * h * e, 4 * s * h * e, kept=s * h * e))
    return ops


def mla_attention_ops(spec: TransformerSpec, s: float, e: int) -> list[Op]:
    """The ops of latent attention on ``s`` tokens per sample, from the block's input norm's
    output to the output projection (module docstring).

    Raises:
        ValueError: ``spec`` has no latent attention (``spec.mla`` is None).
    """
    mla = spec.mla
    if mla is None:
        raise ValueError(f"model {spec.name!r} has no latent attention")
    h, a, d_qk = spec.hidden, spec.heads, mla.qk_dim
    q_w, v_w = a * d_qk, a * mla.v_dim
    ops = []
    if mla.q_rank:
        ops += [linear_op("q_down", h, mla.q_rank, s, e), _rms("q_norm", mla.q_rank, s, e),
                linear_op("q_up", mla.q_rank, q_w, s, e)]  # fmt: skip
    else:
        ops.append(linear_op("q", h, q_w, s, e))
    ops += [
        linear_op("kv_down", h, mla.kv_rank + mla.rope_dim, s, e),
        _rms("kv_norm", mla.kv_rank, s, e),
        linear_op("kv_up", mla.kv_rank, a * (mla.nope_dim + mla.v_dim), s, e),
        _memory("rotary", s * (a + 1) * mla.rope_dim * 2 * e, s * (a + 1) * mla.rope_dim * 2 * e),
    ]
    s_kv = (s + 1) / 2 if spec.causal else s
    fwd = 2.0 * s * s_kv * a * (d_qk + mla.v_dim)
    qkv, lse = s * (2 * q_w + v_w) * e, a * s * 4.0
    ops.append(Op(name="attention", kind="attention", fwd_flops=fwd, bwd_flops=2.5 * fwd,
                  fwd_bytes=qkv + s * v_w * e + lse, bwd_bytes=2 * qkv + 2 * s * v_w * e + lse,
                  kept_bytes=qkv + lse, kernels=(1, 2)))  # fmt: skip
    ops.append(linear_op("attention_out", v_w, h, s, e))
    return ops


def _rms(name: str, width: int, s: float, e: int) -> Op:
    """An RMSNorm over ``width`` elements per token (keeps its input and fp32 rstd)."""
    return Op(name=name, kind="memory", fwd_bytes=s * (2 * width * e + 4),
              bwd_bytes=s * (3 * width * e + 4), kept_bytes=s * (width * e + 4))  # fmt: skip


def moe_record(
    layer: LayerCost, spec: TransformerSpec, e: int, op_ms: Callable[[Op, bool], float]
) -> MoEProfile | None:
    """The :class:`~dapple.core.moe_profile.MoEProfile` of an analytic layer holding a sparse
    block (None: no ``router`` op in it): all experts' fp32 parameter bytes, a balanced router
    (``s k / E`` tokens per expert), ``s k h e`` bytes each way, and the router's and routed
    experts' shares of the layer's times by ``op_ms(op, forward)`` (recomputed forwards
    counted in the backward).

    Args:
        layer: the layer's ops (:func:`~dapple.profiler.analytic_ops.layer_costs`).
        spec: the model (its ``moe``).
        e: bytes per activation element.
        op_ms: the time of one op's forward (True) or backward (False).
    """
    moe = spec.moe
    if moe is None or not any(op.name == "router" for op in layer.ops):
        return None
    s, h = float(spec.seq), spec.hidden

    def share(names: Collection[str], forward: bool) -> float:
        def ms(ops: tuple[Op, ...]) -> float:
            own = sum(op_ms(op, forward) for op in ops if op.name in names)
            again = sum(op_ms(op, True) for op in layer.recomputed if op.name in names)
            return own + (0.0 if forward else again)

        total = sum(op_ms(op, forward) for op in layer.ops)
        if not forward:
            total += sum(op_ms(op, True) for op in layer.recomputed)
        return min(1.0, ms(layer.ops) / total) if total > 0 else 0.0

    routed_bytes = s * moe.top_k * h * e
    return MoEProfile(
        experts=moe.experts,
        top_k=moe.top_k,
        expert_parameter_bytes=4 * moe.routed_parameters(h),
        tokens_per_expert_per_sample=s * moe.top_k / moe.experts,
        dispatch_bytes_per_sample=routed_bytes,
        combine_bytes_per_sample=routed_bytes,
        router_time_share=(share(ROUTER_OPS, True), share(ROUTER_OPS, False)),
        expert_time_share=(share(EXPERT_OPS, True), share(EXPERT_OPS, False)),
    )

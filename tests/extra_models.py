"""Small models for ``test_models_extra.py``, importable as specs (``extra_models:moe_lm``).

- :func:`moe_lm`: a causal LM whose blocks are top-2-of-4 mixtures of experts in plain torch,
  routed the way Hugging Face's grouped-matmul Mixtral experts route (sort by expert, gather,
  scatter back; ``torch.histc`` on float ids on the CPU, int ids elsewhere), with ``bincount``
  and ``one_hot`` in a load-balancing term.
- :func:`mixtral`: ``transformers``' ``MixtralForCausalLM`` from a tiny config (top-2 of 4).
- :func:`qwen2_moe`: ``transformers``' ``Qwen2MoeForCausalLM`` from a tiny config (top-2 of 4
  routed experts and a gated shared expert).
- :func:`varlen_lm` / :func:`varlen_llama`: causal LMs whose batches have 8, 12 or 16 tokens
  by seed, with no dimension declared dynamic (the length is found from the batches).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dapple.models.hf import causal_lm_loss
from dapple.models.split import workload_from_module
from dapple.models.workload import Workload

VOCAB, HIDDEN, EXPERTS, TOP_K = 128, 32, 4, 2
LENGTHS = (8, 12, 16)
"""Tokens per sample of the variable-length batches, by ``seed % 3``."""


class Experts(nn.Module):
    """``EXPERTS`` two-layer SiLU MLPs as 3-d weights, applied per routed (token, expert)."""

    def __init__(self, hidden: int, ff: int, experts: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(experts, ff, hidden))
        self.w_out = nn.Parameter(torch.empty(experts, hidden, ff))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_in, std=1 / math.sqrt(self.w_in.shape[2]))
        nn.init.normal_(self.w_out, std=1 / math.sqrt(self.w_out.shape[2]))

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``h``: (S, hidden) tokens sorted by expert, ``ids``: their experts (S,)."""
        u = torch.bmm(self.w_in[ids], h.unsqueeze(-1)).squeeze(-1)
        return torch.bmm(self.w_out[ids], F.silu(u).unsqueeze(-1)).squeeze(-1)


class TopTwoMoE(nn.Module):
    """A sparse mixture-of-experts feed-forward: each token goes to its top-2 of 4 experts."""

    def __init__(self, hidden: int = HIDDEN, experts: int = EXPERTS, k: int = TOP_K) -> None:
        super().__init__()
        self.num_experts, self.k = experts, k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(hidden, 2 * hidden, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = x.reshape(-1, d)
        probs = F.softmax(self.router(h), dim=-1)
        top_w, top_i = torch.topk(probs, self.k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        ids = top_i.reshape(-1)
        ids_g, perm = torch.sort(ids)
        # Tokens per expert; torch.histc takes no integer input on the CPU.
        hist_in = ids_g.float() if x.device.type == "cpu" else ids_g.int()
        load = torch.histc(hist_in, bins=self.num_experts, min=0, max=self.num_experts - 1)
        routed = torch.bincount(ids, minlength=self.num_experts).sum()
        gates = (F.one_hot(top_i, self.num_experts) * top_w.unsqueeze(-1)).sum(1)
        balance = self.num_experts * (load / routed * gates.mean(0)).sum()
        out = self.experts(h[perm // self.k], ids_g) * top_w.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0), device=x.device)
        out = out[inv].view(-1, self.k, d).sum(1)
        return out.view(b, s, d) + 0.01 * balance


class Attention(nn.Module):
    """Causal multi-head self-attention."""

    def __init__(self, hidden: int = HIDDEN, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, ffn: nn.Module, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class TinyLM(nn.Module):
    """Token and position embeddings, ``layers`` blocks, final norm and LM head."""

    def __init__(self, moe: bool, layers: int = 2, hidden: int = HIDDEN, seq: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, hidden)
        self.pos = nn.Embedding(seq, hidden)

        def ffn() -> nn.Module:
            if moe:
                return TopTwoMoE(hidden)
            return nn.Sequential(
                nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)
            )

        self.blocks = nn.ModuleList(Block(ffn(), hidden) for _ in range(layers))
        self.ln = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # type: ignore[no-any-return]


def moe_model() -> nn.Module:
    return TinyLM(moe=True)


def dense_model() -> nn.Module:
    return TinyLM(moe=False)


def _windows(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of ``length + 1`` random tokens as ``(w[:, :-1], w[:, 1:])``: ``length`` inputs
    and their next tokens (the targets :func:`causal_lm_loss` takes)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, VOCAB, (n, length + 1), generator=g)
    return w[:, :-1].clone(), w[:, 1:].clone()


def fixed_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """16 random tokens per sample and their next tokens."""
    return _windows(n, 16, seed)


def varlen_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``LENGTHS[seed % 3]`` random tokens per sample and their next tokens."""
    return _windows(n, LENGTHS[seed % 3], seed)


def moe_lm() -> Workload:
    """:class:`TinyLM` with :class:`TopTwoMoE` feed-forwards, 16 tokens per sample."""
    return workload_from_module(moe_model, fixed_batch, causal_lm_loss, name="moe-lm")


def varlen_lm() -> Workload:
    """A dense :class:`TinyLM` on batches of 8, 12 or 16 tokens (no declared dimension)."""
    return workload_from_module(dense_model, varlen_batch, causal_lm_loss, name="varlen-lm")


class HFLogits(nn.Module):
    """A ``transformers`` causal LM called as ``(input_ids, attention_mask)``, returning logits
    (what a user's spec file wraps it in)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits  # type: ignore[no-any-return]


def _hf_sizes() -> dict[str, Any]:
    return {
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 64,
    }


def mixtral_config() -> Any:
    import transformers as tf

    return tf.MixtralConfig(**_hf_sizes(), num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)


def mixtral_model() -> nn.Module:
    import transformers as tf

    return HFLogits(tf.MixtralForCausalLM(mixtral_config()))


def qwen2_moe_config() -> Any:
    import transformers as tf

    return tf.Qwen2MoeConfig(**_hf_sizes(), num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                             moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN)  # fmt: skip


def qwen2_moe_model() -> nn.Module:
    import transformers as tf

    return HFLogits(tf.Qwen2MoeForCausalLM(qwen2_moe_config()))


def llama_model() -> nn.Module:
    import transformers as tf

    return HFLogits(tf.LlamaForCausalLM(tf.LlamaConfig(**_hf_sizes())))


def _with_mask(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Any, torch.Tensor]:
    ids, targets = batch
    return (ids, torch.ones_like(ids)), targets


def fixed_hf_batch(n: int, seed: int) -> tuple[Any, torch.Tensor]:
    return _with_mask(fixed_batch(n, seed))


def varlen_hf_batch(n: int, seed: int) -> tuple[Any, torch.Tensor]:
    return _with_mask(varlen_batch(n, seed))


def mixtral() -> Workload:
    """``MixtralForCausalLM`` (top-2 of 4 experts) wrapped in a module, 16 tokens per sample."""
    return workload_from_module(mixtral_model, fixed_hf_batch, causal_lm_loss, name="mixtral")


def qwen2_moe() -> Workload:
    """``Qwen2MoeForCausalLM`` (top-2 of 4 experts, a shared expert) wrapped in a module, 16
    tokens per sample."""
    return workload_from_module(qwen2_moe_model, fixed_hf_batch, causal_lm_loss, name="qwen2-moe")


def varlen_llama() -> Workload:
    """``LlamaForCausalLM`` on batches of 8, 12 or 16 tokens (no declared dimension)."""
    return workload_from_module(llama_model, varlen_hf_batch, causal_lm_loss, name="varlen-llama")

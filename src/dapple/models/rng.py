"""Randomness that does not depend on the plan: dropout masks keyed by sample, not by process.

A pipeline splits each global batch into micro-batches and each micro-batch over a stage's
replicas, so a process's random generator sees other draws under every plan, schedule and
replica count. Here every random *site* of the model (each dropout, and the dropout inside each
attention) draws from a counter-based generator instead: the keep/drop decision of element ``c``
of global sample ``i`` at site ``k`` in step ``t`` of a run with seed ``seed`` is a hash of
``(seed, t, k, i, c)`` (:func:`keep_mask`). One process, any plan, any schedule, a
re-computation, a resume under another plan and a re-plan after a lost device therefore draw
the same masks, on CPU and CUDA alike (the hash is exact integer arithmetic).

What a caller provides:

- :func:`keyed` sets the run seed, the step and the global index of the first row of the batch
  a forward (and its backward: a re-computation draws again) works on;
- the traced pieces call :class:`KeyedDropout` / :class:`KeyedAttention` modules where the
  model called dropout or ``scaled_dot_product_attention`` (:mod:`dapple.models.rng_graph`),
  numbered in the order the model runs them, with the dimension that holds the batch;
- an eager model (the one-process reference) runs under :class:`KeyedRandomness`, which numbers
  its dropout and attention calls the same way.

A site's tensor may fold the batch into one dimension (``batch x heads`` or ``batch x
tokens``, sample-major): each sample owns an equal, contiguous share of that dimension. An
attention with dropout runs as its math formulation (the probabilities are materialised), so
plan-independent attention dropout costs the memory of the attention matrix; attention without
dropout keeps PyTorch's fused kernels. Outside :func:`keyed` (profiling) the keys are seed 0,
step 0, rows from 0.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from dapple.errors import ValidationError

__all__ = [
    "KeyedAttention",
    "KeyedDropout",
    "KeyedRandomness",
    "RngKeys",
    "keep_mask",
    "keyed",
    "keyed_attention",
    "keyed_dropout",
]

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B
"""Multiplier of the 32-bit integer hash (below 2**31: products of 32-bit values fit int64)."""
_CHUNK = 1 << 22
"""Elements hashed at a time (bounds the int64 temporaries to 32 MiB)."""


@dataclass(frozen=True, slots=True)
class RngKeys:
    """What a forward's random draws are keyed by, besides the site and the element."""

    seed: int
    step: int
    row0: int
    """Global index (in the step's global batch) of the first row of the batch."""
    rows: int | None
    """Samples in the batch (None: each index of the batch dimension is one sample)."""


_KEYS: ContextVar[RngKeys | None] = ContextVar("dapple_rng_keys", default=None)


@contextlib.contextmanager
def keyed(seed: int, step: int, row0: int, rows: int | None) -> Iterator[None]:
    """Key the random sites run inside by ``(seed, step)`` and rows ``row0 ..`` ``row0+rows``."""
    token = _KEYS.set(RngKeys(seed, step, row0, rows))
    try:
        yield
    finally:
        _KEYS.reset(token)


def _mix_int(x: int) -> int:
    """The 32-bit hash of :func:`_mix` on a Python int."""
    x &= _M32
    x ^= x >> 16
    x = (x * _MUL) & _M32
    x ^= x >> 16
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash, elementwise on int64 values in ``[0, 2**32)``."""
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def _site_key(keys: RngKeys, site: int) -> int:
    """One 32-bit key of (seed, step, site): every 32-bit word of each mixed in turn."""
    k = 0x9E3779B9
    for v in (keys.seed, keys.step, site):
        v &= (1 << 64) - 1
        k = _mix_int(k ^ (v & _M32))
        k = _mix_int(k ^ (v >> 32))
    return k


def keep_mask(
    shape: Sequence[int], p: float, site: int, batch_dim: int | None, device: torch.device
) -> torch.Tensor:
    """The boolean keep-mask of dropout with probability ``p`` at ``site`` over a tensor of
    ``shape`` whose dimension ``batch_dim`` holds the batch (None: no batch; one mask for all).

    Element ``c`` (row-major within its sample) of sample ``row0 + i`` is kept when
    ``hash(hash(c ^ k_i) ^ k'_i) >= p * 2**32``, with ``k_i``, ``k'_i`` hashes of the site key
    and the sample index.

    Raises:
        ValidationError: the batch dimension's size is not a multiple of the batch's rows, or a
            sample holds 2**32 elements or more.
    """
    keys = _KEYS.get() or RngKeys(0, 0, 0, None)
    shape = tuple(int(s) for s in shape)
    if batch_dim is None:
        n, per_sample = 1, math.prod(shape)
        front: tuple[int, ...] = shape
    else:
        size = shape[batch_dim]
        n = keys.rows if keys.rows is not None else size
        if n <= 0 or size % n:
            raise ValidationError(
                f"random site {site}: dimension {batch_dim} of shape {shape} is not a multiple "
                f"of the batch's {n} rows"
            )
        front = (n, *shape[:batch_dim], size // n, *shape[batch_dim + 1 :])
        per_sample = math.prod(front[1:])
    if per_sample >= 1 << 32:
        raise ValidationError(f"random site {site}: {per_sample} elements per sample (2**32 max)")
    base = _site_key(keys, site)
    rows = torch.arange(n, dtype=torch.int64, device=device)
    rows = rows + (keys.row0 if batch_dim is not None else 0)
    k1 = _mix((rows & _M32) ^ base).unsqueeze(1)
    k2 = _mix(k1 ^ 0x85EBCA6B)
    threshold = min(round(p * (1 << 32)), 1 << 32)
    mask = torch.empty((n, per_sample), dtype=torch.bool, device=device)
    cols = max(1, _CHUNK // n)
    for c0 in range(0, per_sample, cols):
        c = torch.arange(c0, min(c0 + cols, per_sample), dtype=torch.int64, device=device)
        mask[:, c0 : c0 + cols] = _mix(_mix(c.unsqueeze(0) ^ k1) ^ k2) >= threshold
    if batch_dim is None:
        return mask.reshape(shape)
    return mask.reshape(front).movedim(0, batch_dim).reshape(shape)


class _MaskedScale(torch.autograd.Function):
    """``x * mask * scale`` that keeps only the boolean mask for its backward (as dropout
    does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask * scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None, None


def keyed_dropout(
    x: torch.Tensor, p: float, site: int, batch_dim: int | None, training: bool = True
) -> torch.Tensor:
    """Dropout of ``x`` with probability ``p`` whose mask is :func:`keep_mask`."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    mask = keep_mask(x.shape, p, site, batch_dim, x.device)
    out: torch.Tensor = _MaskedScale.apply(x, mask, 1.0 / (1.0 - p))  # type: ignore[no-untyped-call]
    return out


def keyed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    site: int,
    batch_dim: int | None,
    training: bool = True,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` whose attention dropout is :func:`keyed_dropout`.

    Without dropout (``dropout_p == 0`` or not training) PyTorch's own kernel runs; with it,
    the math formulation: ``softmax(q k^T * scale + mask)``, keyed dropout, times ``v``.
    """
    if not training or dropout_p == 0.0:
        gqa = {"enable_gqa": True} if enable_gqa else {}  # an argument since torch 2.5
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask, 0.0, is_causal, scale=scale, **gqa
        )
    if enable_gqa and k.dim() >= 3 and q.size(-3) != k.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    s = scale if scale is not None else 1.0 / math.sqrt(q.size(-1))
    scores = torch.matmul(q, k.transpose(-2, -1)) * s
    if is_causal:
        ones = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device)
        scores = scores.masked_fill(~ones.tril(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = _safe_softmax(scores)
    probs = keyed_dropout(probs, dropout_p, site, batch_dim)
    return torch.matmul(probs, v)


def _safe_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension; rows masked entirely give zeros (as PyTorch's math
    attention does), not NaN."""
    safe = getattr(torch.ops.aten, "_safe_softmax", None)
    if safe is not None:
        return safe.default(scores, -1)  # type: ignore[no-any-return]
    return torch.softmax(scores, -1).nan_to_num(0.0)


class KeyedDropout(nn.Module):
    """Random site ``site``: dropout with probability ``p`` (off in ``eval()``)."""

    def __init__(self, p: float, site: int, batch_dim: int | None) -> None:
        super().__init__()
        self.p, self.site, self.batch_dim = float(p), site, batch_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(x, self.p, self.site, self.batch_dim, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}, site={self.site}, batch_dim={self.batch_dim}"


class KeyedAttention(nn.Module):
    """Random site ``site``: ``scaled_dot_product_attention`` with keyed attention dropout
    (off in ``eval()``); called with that function's arguments."""

    def __init__(self, site: int, batch_dim: int | None) -> None:
        super().__init__()
        self.site, self.batch_dim = site, batch_dim

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return keyed_attention(
            *args, **kwargs, site=self.site, batch_dim=self.batch_dim, training=self.training
        )

    def extra_repr(self) -> str:
        return f"site={self.site}, batch_dim={self.batch_dim}"


_DROPOUTS = (F.dropout, torch.dropout)
_ATTENTION = (F.scaled_dot_product_attention,)
_ATTENTION_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class KeyedRandomness(TorchFunctionMode):
    """Runs an eager model's dropout and attention calls as the traced pieces run their random
    sites: the ``k``-th such call of a forward is site ``k``.

    Args:
        batch_dims: The batch dimension of each site, in the order the model runs them (the
            traced graph's, :attr:`dapple.models.split_graph.SplitModel.random_sites`).

    Raises:
        ValidationError: (on exit) the forward ran another number of sites than the trace.
    """

    def __init__(self, batch_dims: Sequence[int | None]) -> None:
        super().__init__()
        self.batch_dims = list(batch_dims)
        self.count = 0

    def _site(self) -> tuple[int, int | None]:
        k = self.count
        if k >= len(self.batch_dims):
            raise ValidationError(
                f"the model ran more than the {len(self.batch_dims)} dropout and attention "
                "calls its trace holds: its random sites cannot be matched"
            )
        self.count += 1
        return k, self.batch_dims[k]

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            names = ("p", "training" if func is F.dropout else "train")
            x, *rest = args
            opts = dict(zip(names, rest, strict=False)) | kwargs
            site, dim = self._site()
            training = bool(opts.get("training", opts.get("train", True)))
            return keyed_dropout(x, float(opts.get("p", 0.5)), site, dim, training)
        if func in _ATTENTION:
            q, k, v, *rest = args
            opts = dict(zip(_ATTENTION_ARGS, rest, strict=False)) | kwargs
            site, dim = self._site()
            return keyed_attention(q, k, v, **opts, site=site, batch_dim=dim)
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        if exc[0] is None and self.count != len(self.batch_dims):
            raise ValidationError(
                f"the model ran {self.count} dropout and attention calls, its trace "
                f"{len(self.batch_dims)}: its random sites cannot be matched"
            )

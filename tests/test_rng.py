"""Plan-independent randomness (dapple.models.rng): masks keyed by sample, not by process."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dapple.errors import ValidationError
from dapple.models.rng import (
    KeyedRandomness,
    keep_mask,
    keyed,
    keyed_attention,
    keyed_dropout,
)
from dapple.models.split import random_sites, workload_from_module

CPU = torch.device("cpu")


def test_a_sample_draws_the_same_mask_in_any_split_of_the_batch() -> None:
    with keyed(7, 3, 0, 8):
        whole = keep_mask((8, 5, 6), 0.3, 2, 0, CPU)
    parts = []
    for lo, hi in [(0, 3), (3, 4), (4, 8)]:
        with keyed(7, 3, lo, hi - lo):
            parts.append(keep_mask((hi - lo, 5, 6), 0.3, 2, 0, CPU))
    assert torch.equal(whole, torch.cat(parts))


def test_a_folded_or_inner_batch_dimension_keeps_each_samples_mask() -> None:
    with keyed(1, 0, 4, 3):
        plain = keep_mask((3, 4, 5), 0.5, 0, 0, CPU)
        folded = keep_mask((3 * 4, 5), 0.5, 0, 0, CPU)  # (batch x 4, 5), sample-major
        inner = keep_mask((4, 3, 5), 0.5, 0, 1, CPU)  # batch in dimension 1
    assert torch.equal(plain.reshape(12, 5), folded)
    assert torch.equal(plain, inner.transpose(0, 1))


def test_masks_differ_by_seed_step_site_and_sample_and_keep_the_probability() -> None:
    def mask(seed: int, step: int, site: int) -> torch.Tensor:
        with keyed(seed, step, 0, 4):
            return keep_mask((4, 64, 64), 0.25, site, 0, CPU)

    base = mask(0, 0, 0)
    for other in (mask(1, 0, 0), mask(0, 1, 0), mask(0, 0, 1)):
        assert 0.3 < float((base != other).float().mean()) < 0.45  # ~ 2 p (1 - p) = 0.375
    assert not torch.equal(base[0], base[1])
    assert abs(float(base.float().mean()) - 0.75) < 0.01
    with keyed(0, 0, 0, 4):
        assert keep_mask((4, 64), 0.0, 0, 0, CPU).all()
        assert not keep_mask((4, 64), 1.0, 0, 0, CPU).any()


def test_a_batch_dimension_that_is_no_multiple_of_the_rows_is_an_error() -> None:
    with keyed(0, 0, 0, 3), pytest.raises(ValidationError, match="not a multiple"):
        keep_mask((4, 2), 0.1, 5, 0, CPU)


def test_keyed_dropout_scales_kept_elements_and_back_propagates_through_the_mask() -> None:
    x = torch.randn(4, 10, requires_grad=True)
    with keyed(0, 0, 0, 4):
        y = keyed_dropout(x, 0.2, 0, 0)
        mask = keep_mask(x.shape, 0.2, 0, 0, CPU)
    assert torch.allclose(y, x * mask / 0.8)
    y.sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, mask / 0.8)
    assert keyed_dropout(x, 0.2, 0, 0, training=False) is x


def test_re_computation_draws_the_forwards_masks() -> None:
    lin = nn.Linear(6, 6)
    x = torch.randn(5, 6)

    def fn(t: torch.Tensor) -> torch.Tensor:
        return keyed_dropout(lin(t), 0.5, 0, 0).tanh()

    grads = []
    for recompute in (False, True):
        lin.zero_grad()
        with keyed(0, 2, 10, 5):
            out = checkpoint(fn, x, use_reentrant=False) if recompute else fn(x)
        with keyed(0, 2, 10, 5):  # the runtime keys a backward by its micro-batch again
            out.sum().backward()
        assert lin.weight.grad is not None
        grads.append(lin.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("causal", [False, True])
def test_keyed_attention_is_sdpa_with_the_keyed_mask(causal: bool) -> None:
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    mask = torch.rand(6, 6) > 0.3
    mask.fill_diagonal_(True)
    mask = None if causal else mask
    plain = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
    assert torch.allclose(keyed_attention(q, k, v, mask, 0.0, causal, site=0, batch_dim=0), plain)
    with keyed(0, 0, 0, 2):
        out = keyed_attention(q, k, v, mask, 0.3, causal, site=4, batch_dim=0)
        keep = keep_mask((2, 4, 6, 6), 0.3, 4, 0, CPU)
    scores = q @ k.transpose(-2, -1) / 8**0.5
    allowed = torch.ones(6, 6, dtype=torch.bool).tril() if causal else mask
    assert allowed is not None
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    assert torch.allclose(out, (probs * keep / 0.7) @ v, atol=1e-6)


def test_grouped_query_attention_repeats_the_key_heads() -> None:
    q = torch.randn(2, 4, 5, 8)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    with keyed(0, 0, 0, 2):
        out = keyed_attention(q, k, v, None, 0.5, True, enable_gqa=True, site=0, batch_dim=0)
        ref = keyed_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), None, 0.5, True,
            site=0, batch_dim=0,
        )  # fmt: skip
    assert torch.equal(out, ref)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        p = 0.5 if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        h = self.drop(a.transpose(1, 2).reshape(b, s, 16))
        flat = F.dropout(h.reshape(b * s, 16), 0.1, self.training)  # batch x tokens
        return x + flat.view(b, s, 16)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(16, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.emb(ids), 0.2, self.training)
        for blk in self.blocks:
            h = blk(h)
        return self.head(h)  # type: ignore[no-any-return]


def _net_batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (n, 6), generator=g)
    return ids, ids


def _net_loss(out: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), tgt.flatten())


def test_traced_pieces_and_the_eager_model_draw_the_same_masks() -> None:
    wl = workload_from_module(_Net, _net_batch, _net_loss, name="rng-net")
    assert random_sites(wl) == [0] + [0, 0, 0] * 3  # emb, then sdpa / drop / flat per block
    model = wl.build_model(0)  # the pieces, each keyed
    ids, _ = _net_batch(6, 1)
    eager = _Net()
    eager.load_state_dict({n: p for layer in model for n, p in layer.state_dict().items()})
    with keyed(3, 1, 0, 6), KeyedRandomness(random_sites(wl)):
        want = eager(ids)
    got = []
    for lo, hi in [(0, 2), (2, 6)]:  # two micro-batches, as a pipeline would run them
        with keyed(3, 1, lo, hi - lo):
            got.append(model(ids[lo:hi]))
    assert torch.allclose(torch.cat(got), want, atol=1e-6)
    with keyed(3, 2, 0, 6):
        assert not torch.allclose(model(ids), want, atol=1e-3)  # another step, other masks
    model.eval()
    eager.eval()
    assert torch.allclose(model(ids), eager(ids), atol=1e-6)  # eval(): no dropout


def test_an_eager_model_running_other_sites_than_its_trace_is_an_error() -> None:
    x = torch.randn(2, 3)
    with pytest.raises(ValidationError, match="ran 1 dropout"), KeyedRandomness([0, 0]):
        F.dropout(x, 0.1)
    with pytest.raises(ValidationError, match="more than the 1"), KeyedRandomness([0]):
        F.dropout(F.dropout(x, 0.1), 0.1)

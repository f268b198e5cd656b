"""What may cross a cut: tensors that fold the batch into dimension 0, constants the forward
makes (lifted tensors)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dapple.models.split import workload_from_module

HEADS = 3


class _BiasBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.lin(x).view(b, s, 1, 8).expand(b, s, HEADS, 8).transpose(1, 2)
        h = h.reshape(b * HEADS, s, 8) + bias  # bias: (batch x heads, 1, 8), sample-major
        root = torch.tensor(math.sqrt(HEADS), dtype=x.dtype)  # a constant of each block
        return x + h.view(b, HEADS, s, 8).mean(1) * scale / root


class _AlibiNet(nn.Module):
    """Each block takes a (batch x heads)-folded bias made from the input, and a constant
    tensor the forward makes once, before the first block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_BiasBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        slopes = torch.arange(1, HEADS + 1, dtype=x.dtype).view(1, HEADS, 1, 1)
        bias = (x.mean(1, keepdim=True).unsqueeze(1) * slopes).reshape(b * HEADS, 1, 8)
        scale = torch.tensor([0.5, 2.0, 1.0, 3.0, 1.5, 0.25, 1.0, 2.0])
        for blk in self.blocks:
            x = blk(x, bias, scale)
        return x


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, 8, generator=g)
    return x, x


def test_a_batch_folded_tensor_crosses_a_cut_as_batch_by_factor() -> None:
    wl = workload_from_module(_AlibiNet, _batch, F.mse_loss, name="alibi")
    pieces = wl.build_model(0)
    x, _ = _batch(4, 1)
    eager = _AlibiNet()
    eager.load_state_dict(
        {n: p for layer in pieces for n, p in layer.state_dict().items() if "lifted" not in n}
    )
    out = pieces[0](x)
    folded = [t for t in out if t.dim() == 4]
    assert [tuple(t.shape) for t in folded] == [(4, HEADS, 1, 8)]  # (batch, heads, 1, 8) in transit
    halves = [pieces(x[:1]), pieces(x[1:])]  # any split of the batch: replicas' rows
    assert torch.allclose(torch.cat(halves), eager(x), atol=1e-6)


def test_constants_the_forward_makes_reach_every_piece_that_uses_them() -> None:
    wl = workload_from_module(_AlibiNet, _batch, F.mse_loss, name="alibi")
    for i in range(wl.num_layers):
        layer = wl.build_layer(i, 0)
        for name, t in layer.named_buffers():
            assert not t.is_meta, (i, name)
    scales = [
        dict(wl.build_layer(i, 0).named_buffers()).get("lifted_tensor_0")
        for i in range(1, wl.num_layers)
    ]
    assert all(s is not None and s[1] == 2.0 for s in scales[:3])

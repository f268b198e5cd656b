"""Traced mixture-of-experts models under bf16 autocast: Hugging Face's Mixtral casts its
router's logits with ``.float()``, and the check ``torch.export`` put before that cast (the
logits are fp32 when traced, bf16 under autocast) stopped every bf16 run at its first forward.
The traced pieces now run as the eager model does, one process."""

from __future__ import annotations

import pytest
import torch

import extra_models as em
from dapple.models.split import model_factory_of
from dapple.runtime.precision import Precision


@pytest.mark.parametrize("factory", ["mixtral", "qwen2_moe"])
def test_the_traced_moe_model_runs_under_bf16_autocast_as_the_eager_one(factory: str) -> None:
    pytest.importorskip("transformers")
    wl = getattr(em, factory)()
    traced = wl.build_model(0)
    eager = model_factory_of(wl)()
    weights = {n: t for piece in traced for n, t in piece.state_dict().items()}
    missing, unexpected = eager.load_state_dict(weights, strict=False)
    left = [n for n in (*missing, *unexpected) if "rotary_emb" not in n]  # buffers made anew
    assert not left, left
    inputs, targets = wl.make_batch(2, 0)
    with Precision("bf16", torch.device("cpu")).autocast():
        got = traced(inputs)
        want = eager(*inputs)
    assert got.dtype == torch.bfloat16 == want.dtype
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    loss = wl.loss_fn(got.float(), targets)
    loss.backward()
    experts = [p for n, p in traced.named_parameters() if n.endswith("experts.gate_up_proj")]
    router = [p for n, p in traced.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(experts) == 2 and len(router) == 2
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in experts + router)

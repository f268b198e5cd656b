"""The planner gives a tiny Hugging Face MoE model (Mixtral, Qwen2-MoE from a local config) an
expert-parallel width where one must win: experts whose state does not fit a device whole.

Why e_s > 1 must win here: at ZeRO 0 a stage that holds an MoE block with its experts whole
holds the block's parameters, gradients and AdamW's two moments on every replica, 4 x its
parameter bytes (the profile is fp32), whatever the stage's other layers, replicas or M. The
devices are given less than that, but more than the 2:2 plan with e_s = 2 needs (one block
per stage, half of each block's experts per replica). So no plan without a width fits, and
the search must shard experts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dapple.core.cluster import GIB, Cluster
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.pipeline import pipeline_latency
from dapple.errors import InfeasibleError
from dapple.planner import make_plan
from dapple.planner.search import dapple_search
from dapple.profiler.analytic import analytic_profile

tf = pytest.importorskip("transformers")

B = 8
SIZES: dict[str, Any] = dict(hidden_size=32, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                             max_position_embeddings=64, num_experts_per_tok=2)  # fmt: skip
"""Experts of 512 wide on a width of 32: they hold ~99% of each block's parameters."""

# 2 servers of 2 devices; the memory is set per model below
CLUSTER = Cluster(name="t", servers=2, devices_per_server=2, device_memory_bytes=GIB,
                  intra_server_bandwidth_gbps=8000, inter_server_bandwidth_gbps=100,
                  reserved_memory_bytes=0)  # fmt: skip


def _config(kind: str) -> Any:
    if kind == "mixtral":
        return tf.MixtralConfig(**SIZES, num_local_experts=8)
    return tf.Qwen2MoeConfig(**SIZES, num_experts=8, moe_intermediate_size=512,
                             shared_expert_intermediate_size=64)  # fmt: skip


def _profile(kind: str, tmp_path: Path) -> ModelProfile:
    """The analytic profile of the model's ``config.json`` (``hf:DIR``): embedding, 2 MoE
    blocks, head; fp32, 16 tokens per sample."""
    folder = tmp_path / kind
    _config(kind).save_pretrained(folder)
    return analytic_profile(f"hf:{folder}", "h100", precision="fp32", seq_len=16,
                            batch_sizes=(1, 2, 4, 8))  # fmt: skip


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_experts_that_fit_a_device_only_sharded_are_planned_with_a_width(
    kind: str, tmp_path: Path
) -> None:
    prof = _profile(kind, tmp_path)
    blocks = [x for x in prof.layers if x.moe is not None]
    assert len(blocks) == 2 and all(x.moe.experts == 8 for x in blocks)  # type: ignore[union-attr]
    whole = min(4 * x.parameter_bytes for x in blocks)  # any stage holding a block at e_s = 1
    two = straight_plan(len(prof.layers), [0, 2], global_batch_size=B, num_micro_batches=B,
                        replicas=[2, 2])  # fmt: skip
    halves = dataclasses.replace(
        two, stages=tuple(dataclasses.replace(st, expert_width=2) for st in two.stages)
    )
    need = max(r.memory_bytes for r in pipeline_latency(halves, prof, CLUSTER).stages)
    assert need < whole, (need, whole)
    cluster = dataclasses.replace(CLUSTER, device_memory_bytes=int((need + whole) / 2))

    plan = make_plan(prof, cluster, B, tensor_widths=[1])
    assert any(st.expert_width > 1 for st in plan.stages), plan.stages
    assert pipeline_latency(plan, prof, cluster).fits_memory
    for st in plan.stages:  # a stage holding a block shards its experts
        if any(x.moe is not None for x in prof.layers[st.layers[0] : st.layers[1]]):
            assert st.expert_width > 1, st
    with pytest.raises(InfeasibleError):  # without the widths offered nothing fits
        dapple_search(prof, cluster, B, tensor_widths=[1], experts=False)

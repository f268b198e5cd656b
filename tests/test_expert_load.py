"""Expert load per step (:mod:`dapple.runtime.parallel.expert.load`): the tokens each MoE layer
sends to each expert, counted on the device and summed over the ranks in the step's one
collective, against a hand count from Hugging Face's eager model (its router's logits, top-k,
counted per expert); and its load-balancing loss against ``transformers``' own; shown in the step line, the metrics
file and TensorBoard's scalars."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import extra_models as em
from dapple.core.plan import Plan, straight_plan
from dapple.models.split import model_factory_of
from dapple.runtime.parallel.expert.load import (
    count_expert_load,
    expert_report,
    imbalance,
    load_layout,
)
from dapple.runtime.step_metrics import StepMetrics
from ep_runs import plan_1_2_1


def hand_count(
    wl: Any, model: torch.nn.Module, inputs: Any
) -> tuple[tuple[tuple[int, ...], ...], list[float]]:
    """Per MoE layer, the rows per expert of the eager HF model (``model``'s weights) on
    ``inputs`` - its router's top-k indices counted - and its load-balancing loss
    (``transformers``' ``load_balancing_loss_func`` on the layer's router logits)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    eager = model_factory_of(wl)()
    weights = {n: t for piece in model for n, t in piece.state_dict().items()}
    eager.load_state_dict(weights, strict=False)
    ids, mask = inputs
    with torch.no_grad():
        out = eager.lm(input_ids=ids, attention_mask=mask, output_router_logits=True,
                       use_cache=False)  # fmt: skip
    k, E = em.TOP_K, em.EXPERTS
    loads = tuple(tuple(torch.bincount(r.topk(k, -1).indices.flatten(), minlength=E).tolist())
                  for r in out.router_logits)  # fmt: skip
    return loads, [float(load_balancing_loss_func((r,), E, k)) for r in out.router_logits]


def _one_stage(wl: Any) -> Plan:
    return straight_plan(wl.num_layers, [0], global_batch_size=2, num_micro_batches=1,
                         replicas=[1])  # fmt: skip


@pytest.mark.parametrize("factory", ["mixtral", "qwen2_moe"])
def test_the_counters_count_what_the_router_chose_once_per_training_forward(factory: str) -> None:
    pytest.importorskip("transformers")
    wl = getattr(em, factory)()
    layout = load_layout(wl)
    assert layout.layers == (1, 2) and layout.experts == (4, 4) and layout.columns == 16
    model = wl.build_model(0)
    loads = count_expert_load(_one_stage(wl), wl, 0, model, torch.device("cpu"))
    assert loads is not None and sorted(loads.counters) == [0, 8]
    inputs, targets = wl.make_batch(3, 0)
    want, want_aux = hand_count(wl, model, inputs)
    assert [sum(x) for x in want] == [3 * 16 * em.TOP_K] * 2

    def check() -> None:
        got, aux = layout.split(loads.vector().tolist())
        assert got == want
        assert aux == pytest.approx(want_aux, rel=1e-5)
        assert min(aux) > em.TOP_K  # not balanced (k at balance)

    wl.loss_fn(model(inputs), targets).backward()
    check()
    with torch.no_grad():  # the boundary probe, evaluation: not counted
        model(inputs)
    check()
    loads.begin_step()
    assert loads.vector().sum() == 0
    # re-computation inside the backward is not counted again
    ids, mask = inputs
    out = checkpoint(lambda a, b: model((a, b)), ids, mask, use_reentrant=False)
    wl.loss_fn(out, targets).backward()
    check()


def test_a_dense_model_and_a_tensor_rank_other_than_0_count_nothing() -> None:
    pytest.importorskip("transformers")
    dense = em.varlen_llama()
    assert load_layout(dense).columns == 0
    assert count_expert_load(_one_stage(dense), dense, 0, None, torch.device("cpu")) is None
    wl = em.mixtral()
    model = wl.build_model(0)
    loads = count_expert_load(_one_stage(wl), wl, 0, model, torch.device("cpu"), tensor_rank=1)
    assert loads is not None
    inputs, targets = wl.make_batch(2, 0)
    wl.loss_fn(model(inputs), targets).backward()
    assert loads.vector().tolist() == [0.0] * 16
    beyond = count_expert_load(_one_stage(wl), wl, 5, None, torch.device("cpu"))
    assert beyond is not None and beyond.vector().tolist() == [0.0] * 16  # sends zeros


def test_a_site_without_a_softmax_router_has_no_probabilities_to_sum() -> None:
    pytest.importorskip("transformers.integrations.moe")
    from torch import fx

    from dapple.runtime.parallel.expert.load import router_probs
    from dapple.runtime.parallel.expert.sites import find_sites
    from test_expert_parallel import _Experts

    (site,) = find_sites(fx.symbolic_trace(_Experts()))
    assert router_probs(site) is None


def test_the_aux_loss_is_k_when_balanced_and_nan_without_probabilities() -> None:
    from dapple.runtime.parallel.expert.load import aux_loss

    assert aux_loss([2, 2, 2, 2], [1.0, 1.0, 1.0, 1.0]) == pytest.approx(2.0)  # T=4 tokens, k=2
    assert aux_loss([4, 0, 0, 0], [4.0, 0.0, 0.0, 0.0]) == pytest.approx(4.0)
    assert math.isnan(aux_loss([1, 1], [0.0, 0.0]))


def test_imbalance_is_max_over_mean() -> None:
    assert imbalance([4, 4, 4, 4]) == 1.0
    assert imbalance([8, 0, 0, 0]) == 4.0
    assert imbalance([3, 1, 2, 2]) == 1.5
    assert imbalance([0, 0]) == 1.0


def test_the_guard_sums_the_loads_over_ranks_on_the_device_and_reads_them_with_the_row() -> None:
    from dapple.runtime.guard import NonFiniteGuard

    guard = NonFiniteGuard.__new__(NonFiniteGuard)
    guard.world = 1
    mine = torch.tensor([1.0, 2.0], dtype=torch.float64)
    rows, table = guard._gather(mine, torch.tensor([3.0, 0.0, 5.0], dtype=torch.float64))
    assert rows == [[1.0, 2.0]] and table.shape == (1, 2) and guard.sums == [3.0, 0.0, 5.0]


def test_the_step_line_json_and_tensorboard_scalars_show_the_loads() -> None:
    from dapple.runtime.metrics import metrics_from_dict
    from dapple.runtime.reporting import scalars

    load = ((6, 2, 4, 4), (10, 2, 2, 2))
    fields: dict[str, Any] = {"expert_layers": (1, 2), "expert_load": load,
                              "expert_imbalance": (1.5, 2.5), "expert_aux_loss": (2.25, None)}  # fmt: skip
    m = StepMetrics(step=3, loss=1.0, step_ms=10.0, samples_per_s=1.0, peak_memory_bytes=(0,),
                    memory_kind="held_activations", **fields)  # fmt: skip
    assert "expert max/mean 2.50 (layer 2, worst of 2)" in m.line()
    back = metrics_from_dict(json.loads(json.dumps(m.to_dict())))
    assert {k: getattr(back, k) for k in fields} == fields
    tags = scalars(m)
    assert tags["moe/max_over_mean/layer_1"] == 1.5 and tags["moe/max_over_mean/layer_2"] == 2.5
    assert tags["moe/aux_loss/layer_1"] == 2.25 and "moe/aux_loss/layer_2" not in tags
    plain = StepMetrics(step=3, loss=1.0, step_ms=10.0, samples_per_s=1.0,
                        peak_memory_bytes=(0,), memory_kind="held_activations")  # fmt: skip
    assert "expert" not in plain.line() and not any(t.startswith("moe/") for t in scalars(plain))
    wl = em.mixtral()
    loads = count_expert_load(_one_stage(wl), wl, 5, None, torch.device("cpu"))
    assert expert_report(loads, (load, (2.25, math.nan))) == fields
    assert expert_report(None, ((), ())) == {}


# -- distributed: against the hand count, at most one host read per step ---------------------

STEPS_FEW, STEPS_MANY = 2, 4
KERNEL_READS = ("_grouped_mm_fallback", "_grouped_mm_fallback_bwd")
"""Host reads of ``transformers``' CPU grouped-matmul kernel itself (its loop over the experts
reads the offsets, per MoE layer and micro-batch, forward and backward; on CUDA
``aten._grouped_mm`` takes them on the device): the model's, not the runtime's, left out."""


def load_worker(rank: int, world: int, out_dir: str) -> None:
    """Mixtral on 1:2:1 (uneven slices) with EP 2 and without; the run without EP also for
    more steps with the host reads counted (:func:`test_sync_count.patch_syncs`)."""
    from dapple.runtime import TrainConfig, init_distributed, run_plan, shutdown_distributed
    from test_sync_count import patch_syncs

    device = init_distributed(TrainConfig(timeout_s=120), world)
    wl, out = em.mixtral(), {}
    calls: list[str] = []
    patch_syncs(calls)
    for name, e, steps in (("ep", 2, STEPS_FEW), ("plain", 1, STEPS_FEW),
                           ("plain-many", 1, STEPS_MANY)):  # fmt: skip
        cfg = TrainConfig(steps=steps, seed=2, optimizer="adamw", lr=1e-2, timeout_s=120,
                          metrics_path=str(Path(out_dir, f"{name}.jsonl")))  # fmt: skip
        calls.clear()
        run_plan(plan_1_2_1(e), wl, cfg, device=device, exact_world=False)
        out[name] = list(calls)
    Path(out_dir, f"calls{rank}.json").write_text(json.dumps(out))
    shutdown_distributed()


@pytest.mark.slow
def test_the_step_metrics_hold_the_expert_load_of_a_hand_count_and_add_no_host_read(
    tmp_path: Path,
) -> None:
    """Step 0's loads (weights as built) equal the hand count on the global batch, with EP 2
    and without; every step's loads sum to tokens x top-k per layer; without EP (whose token
    exchange reads its route table on the host) the counting and summing add no host read:
    at most one per step besides the CPU grouped-matmul kernel's own (:data:`KERNEL_READS`), as
    without MoE (tests/test_sync_count.py)."""
    pytest.importorskip("transformers")
    from dapple.runtime import spawn

    spawn(load_worker, 4, str(tmp_path), timeout_s=900)
    wl = em.mixtral()
    plan = plan_1_2_1(1)
    G = plan.global_batch_size
    inputs, _ = wl.make_batch(G, 2)  # step 0's batch of seed 2
    want, want_aux = hand_count(wl, wl.build_model(2), inputs)
    for name in ("ep", "plain", "plain-many"):
        lines = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert [m["expert_layers"] for m in lines] == [[1, 2]] * len(lines), name
        assert tuple(map(tuple, lines[0]["expert_load"])) == want, name
        assert lines[0]["expert_aux_loss"] == pytest.approx(want_aux, rel=1e-5), name
        for m in lines:
            assert [sum(x) for x in m["expert_load"]] == [G * 16 * em.TOP_K] * 2, name
            assert m["expert_imbalance"] == pytest.approx([imbalance(x) for x in m["expert_load"]])
    for rank in range(4):
        calls = {k: [c for c in v if not c.endswith(KERNEL_READS)]
                 for k, v in json.loads((tmp_path / f"calls{rank}.json").read_text()).items()}  # fmt: skip
        extra = Counter(calls["plain-many"]) - Counter(calls["plain"])
        per_step = (len(calls["plain-many"]) - len(calls["plain"])) / (STEPS_MANY - STEPS_FEW)
        assert per_step <= 1, f"rank {rank}: {per_step:g} host reads per step: {extra}"

"""Tensor parallelism (t_s > 1) and ZeRO-3 in the runtime (:mod:`dapple.runtime.parallel.stage_mesh`).

Pure tests of the peer pairing and the refusals; (slow tier) ``dapple verify`` on gloo - every
parameter, gradient, loss and gradient norm against one process, step by step - for one stage
DP2 x TP2, stage 0 TP2 + stage 1 DP2, 1:2 with ZeRO-3 on the replicated stage and TP2 x FSDP2
on one 4-rank stage, on the zoo transformer (traced into pieces, its
:data:`~dapple.runtime.parallel.tp.TRANSFORMER_TP_PLAN`) and a tiny Hugging Face LLaMA from a config;
both under ZB-H1 (split backward) and under interleaved 1F1B (two chunks per rank); with
ZeRO-1/2 under TP; tied embeddings under TP; re-computation under TP and ZeRO-3; bf16
autocast.
Checkpoints and evaluation of such plans: ``tests/test_tp_checkpoint.py``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from dapple.core.plan import Plan, StagePlan, interleave
from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.runtime.parallel.stage_mesh import check_mesh_run, peer_ranks
from dapple.runtime.parallel.tp import TRANSFORMER_TP_PLAN
from dapple.runtime.train_config import TrainConfig

ZOO = {"layers": 2, "hidden": 32, "heads": 4, "seq": 16, "vocab": 64}
LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 64,
    "max_position_embeddings": 64,
}
G, M = 8, 2


def _zoo_model() -> torch.nn.Module:
    from dapple.models.zoo.transformer import transformer

    return transformer(**ZOO).build_model()


def zoo() -> Workload:
    """The zoo transformer traced into pieces (embedding, block, block, head), with its plan
    (the factory of :func:`zoo_spec`)."""
    from dapple.models.split import workload_from_module
    from dapple.models.zoo.transformer import transformer

    wl = transformer(**ZOO)
    traced = workload_from_module(_zoo_model, wl.make_batch, wl.loss_fn, split_at=["1", "2", "3"])
    return replace(traced, tp_plan=dict(TRANSFORMER_TP_PLAN))


def zoo_spec() -> Workload:
    """:func:`zoo` loaded from its spec (it pickles: verify's workers load it again)."""
    import dapple.api as dp

    return dp.load(f"{Path(__file__).resolve()}:zoo")


def llama(path: Path, layers: int = 2, tied: bool = False) -> Workload:
    """A tiny LLaMA of ``layers`` decoder layers saved from a config (no dropout; ``tied``:
    the LM head tied to the embedding), loaded as ``hf:DIR`` (its config's
    ``base_model_tp_plan``)."""
    tf = pytest.importorskip("transformers")
    import dapple.api as dp

    torch.manual_seed(0)
    config = tf.LlamaConfig(**{**LLAMA, "num_hidden_layers": layers, "tie_word_embeddings": tied})
    tf.LlamaForCausalLM(config).save_pretrained(path)
    return dp.load(f"hf:{path}")


def plan_of(stages: list[StagePlan], schedule: str = "dapple") -> Plan:
    return Plan(planner="manual", global_batch_size=G, micro_batch_size=G // M,
                num_micro_batches=M, stages=tuple(stages), schedule=schedule)  # fmt: skip


def dp2_tp2(n: int) -> Plan:
    return plan_of([StagePlan(layers=(0, n), devices=(0, 1, 2, 3), tensor_width=2)])


def tp2_then_dp2(n: int, schedule: str = "dapple") -> Plan:
    return plan_of(
        [
            StagePlan(layers=(0, 2), devices=(0, 1), tensor_width=2),
            StagePlan(layers=(2, n), devices=(2, 3)),
        ],
        schedule,
    )


def one_then_zero3(n: int) -> Plan:
    return plan_of(
        [
            StagePlan(layers=(0, 2), devices=(0,)),
            StagePlan(layers=(2, n), devices=(1, 2), zero_stage=3),
        ]
    )


def tp2_then_zero3(n: int) -> Plan:
    return plan_of(
        [
            StagePlan(layers=(0, 2), devices=(0, 1), tensor_width=2),
            StagePlan(layers=(2, n), devices=(2, 3), zero_stage=3),
        ]
    )


def tp2_fsdp2(n: int) -> Plan:
    return plan_of([StagePlan(layers=(0, n), devices=(0, 1, 2, 3), tensor_width=2, zero_stage=3)])


def regathering(plan: Plan) -> Plan:
    """``plan`` with its ZeRO-3 stages gathering their parameters per micro-batch."""
    stages = tuple(replace(st, regather=st.zero_stage == 3) for st in plan.stages)
    return replace(plan, stages=stages)


def one_then_zero3_regather(n: int) -> Plan:
    """1:2 with ZeRO-3 gathering per micro-batch (each piece an FSDP unit)."""
    return regathering(one_then_zero3(n))


def recomputing(plan: Plan) -> Plan:
    """``plan`` with every stage re-computing its forward in the backward."""
    return replace(plan, stages=tuple(replace(st, recompute="full") for st in plan.stages))


# -- pure -----------------------------------------------------------------------------------
def test_tensor_groups_pair_by_index_modulo_the_senders_width() -> None:
    wide = StagePlan(layers=(0, 1), devices=(4, 5, 6, 7), tensor_width=4)
    narrow = StagePlan(layers=(0, 1), devices=(0, 1), tensor_width=2)
    # a rank of index k of the wide group receives from the narrow group's rank k mod 2
    assert [peer_ranks(narrow, 0, k, 4, False) for k in range(4)] == [[0], [1], [0], [1]]
    # the narrow group's rank i sends to the wide ranks k with k mod 2 == i
    assert [peer_ranks(wide, 0, i, 2, True) for i in range(2)] == [[4, 6], [5, 7]]
    # and back: a narrow rank receives from the wide rank of its own index; wide ranks 0, 1 send
    assert [peer_ranks(wide, 0, i, 2, False) for i in range(2)] == [[4], [5]]
    assert [peer_ranks(narrow, 0, k, 4, True) for k in range(4)] == [[0], [1], [], []]
    dp2 = StagePlan(layers=(0, 1), devices=(2, 3))
    assert peer_ranks(dp2, 1, 1, 2, False) == [3]
    assert peer_ranks(dp2, 1, 0, 2, True) == [3]
    assert peer_ranks(dp2, 1, 1, 2, True) == []  # tensor rank 1 of a TP2 sender: nothing


def _cfg(**kw: Any) -> TrainConfig:
    return TrainConfig(steps=1, **kw)


def test_unsupported_mesh_runs_are_refused_in_one_line() -> None:
    wl = zoo()
    bare = replace(wl, tp_plan={})
    with pytest.raises(ValidationError, match="has no TP plan"):
        check_mesh_run(dp2_tp2(4), bare, _cfg())
    with pytest.raises(ValidationError, match=r"stages \[1\] re-gather .* schedule 'zbh1'"):
        replace(regathering(one_then_zero3(4)), schedule="zbh1")  # the plan itself
    check_mesh_run(replace(one_then_zero3(4), schedule="zbh1"), wl, _cfg())
    with pytest.raises(ValidationError, match="ZeRO-3 regather with precision bf16"):
        check_mesh_run(regathering(tp2_fsdp2(4)), wl, _cfg(precision="bf16"))
    check_mesh_run(tp2_fsdp2(4), wl, _cfg(precision="bf16"))
    with pytest.raises(ValidationError, match="precision fp16 with TP or ZeRO-3"):
        check_mesh_run(dp2_tp2(4), wl, _cfg(precision="fp16"))
    check_mesh_run(dp2_tp2(4), wl, _cfg())  # supported
    check_mesh_run(dp2_tp2(4), wl, _cfg(zero_stage=2))
    tied = replace(wl, tied_parameters=(((0, "tok.weight"), (3, "head.weight")),))
    check_mesh_run(dp2_tp2(4), tied, _cfg())
    with pytest.raises(ValidationError, match=r"ZeRO-3 on a stage holding tied parameters"):
        check_mesh_run(tp2_fsdp2(4), tied, _cfg())
    inner = replace(tied, tied_parameters=(((1, "ln1.weight"), (2, "ln1.weight")),))
    check_mesh_run(tp2_then_dp2(4), inner, _cfg())  # no ZeRO-3 stage
    with pytest.raises(ValidationError, match=r"tied parameters \[\(2, 'ln1.weight'\)\]"):
        check_mesh_run(one_then_zero3(4), inner, _cfg())  # stage 1 (layers 2-4) holds one
    first = replace(tied, tied_parameters=(((0, "tok.weight"), (1, "ln1.weight")),))
    check_mesh_run(one_then_zero3(4), first, _cfg())  # ZeRO-3 on stage 1, the copies in stage 0
    check_mesh_run(dp2_tp2(4), wl, _cfg(precision="bf16"))
    check_mesh_run(interleave(tp2_then_zero3(4), 2), wl, _cfg())
    check_mesh_run(recomputing(dp2_tp2(4)), wl, _cfg(recompute="full"))
    check_mesh_run(recomputing(tp2_fsdp2(4)), wl, _cfg(recompute="full"))
    # checkpoints and evaluation: tests/test_tp_checkpoint.py
    check_mesh_run(tp2_fsdp2(4), wl, _cfg(checkpoint_dir="/tmp/x", eval_every=1))
    check_mesh_run(plan_of([StagePlan(layers=(0, 4), devices=(0, 1))]), bare, _cfg())  # nothing cut


# -- slow: dapple verify against one process --------------------------------------------------
def _verify_cfg(**kw: Any) -> TrainConfig:
    """Both runs' options of every verify case here (``kw`` on top)."""
    return TrainConfig(steps=2, optimizer="adamw", lr=1e-2, clip_grad_norm=0.5, timeout_s=300,
                       device="cpu", **kw)  # fmt: skip


def _verify(plan: Plan, wl: Workload, **kw: Any) -> Any:
    from dapple.runtime.verify import verify

    rep = verify(plan, wl, _verify_cfg(**kw))
    assert rep.ok, rep
    assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)
    assert rep.grad_norms == pytest.approx(rep.reference_grad_norms, rel=1e-4)
    return rep


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "case", [dp2_tp2, tp2_then_dp2, one_then_zero3, tp2_fsdp2, one_then_zero3_regather]
)
def test_verify_zoo_transformer(case: Any) -> None:
    _verify(case(4), zoo_spec())


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [dp2_tp2, tp2_then_dp2, one_then_zero3, tp2_fsdp2])
def test_verify_hf_llama(case: Any, tmp_path: Path) -> None:
    _verify(case(4), llama(tmp_path / "llama"))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [dp2_tp2, tp2_then_dp2, one_then_zero3, tp2_fsdp2])
def test_verify_zoo_transformer_under_zb_h1(case: Any) -> None:
    _verify(replace(case(4), schedule="zbh1"), zoo_spec())


def _verify_all(
    cases: list[tuple[Plan, Workload]], precision: str = "fp32", zero_stage: int = 0
) -> None:
    """:func:`_verify`'s checks on every case, with one launch of the workers (bf16: within
    verify's stated bf16 tolerances, both runs under autocast)."""
    from dapple.runtime.precision import tolerances_for
    from dapple.runtime.verify import verify_many

    reps = verify_many(cases, _verify_cfg(precision=precision, zero_stage=zero_stage))
    assert len(reps) == len(cases)
    low = tolerances_for(precision)[0] if precision != "fp32" else None
    for rep in reps:
        assert rep.ok, rep
        assert rep.losses == pytest.approx(rep.reference_losses, rel=low or 1e-5)
        assert rep.grad_norms == pytest.approx(rep.reference_grad_norms, rel=low or 1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_tp_and_zero3_under_bf16_autocast() -> None:
    """bf16 autocast over cut stages: each rank casts its own weight slices, the row-parallel
    all-reduces sum bf16 partial products; ZeRO-3 reduce-scatters after the step's last
    backward has completed every weight gradient (a stage whose inputs carry gradients, 1:2,
    is where FSDP2's own post-backward would come too early)."""
    wl = zoo_spec()
    cases = [dp2_tp2(4), tp2_then_dp2(4), interleave(tp2_then_dp2(4), 2), one_then_zero3(4),
             tp2_fsdp2(4), interleave(tp2_then_zero3(4), 2)]  # fmt: skip
    _verify_all([(c, wl) for c in cases], precision="bf16")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_verify_tp_with_zero_1_and_2(zero_stage: int, tmp_path: Path) -> None:
    """ZeRO-1/2 over the replicas of each tensor index: each replica updates its pieces of the
    stage's slices (the gradient norm counts them once; verify sees the reduced gradients)."""
    wl = zoo_spec()
    cases = [(dp2_tp2(4), wl), (interleave(tp2_then_dp2(4), 2), wl),
             (dp2_tp2(4), llama(tmp_path / "llama"))]  # fmt: skip
    _verify_all(cases, zero_stage=zero_stage)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_verify_tied_embeddings_under_tp(zero_stage: int, tmp_path: Path) -> None:
    """The LM head tied to the embedding, both whole on every tensor rank: in one TP2 stage (a
    local sum), and across a TP2 and a DP2 stage, 1F1B and interleaved (the cross-stage sum
    over every device of both stages, each tensor rank adding 1/t_s)."""
    wl = llama(tmp_path / "tied", tied=True)
    assert wl.tied_parameters
    cases = [dp2_tp2(4), tp2_then_dp2(4), interleave(tp2_then_dp2(4), 2)]
    _verify_all([(c, wl) for c in cases], zero_stage=zero_stage)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_hf_llama_under_zb_h1(tmp_path: Path) -> None:
    wl = llama(tmp_path / "llama")
    _verify_all([(replace(c(4), schedule="zbh1"), wl) for c in (dp2_tp2, tp2_then_dp2,
                                                                 one_then_zero3, tp2_fsdp2)])  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_interleaved_1f1b_with_tp_and_zero3(tmp_path: Path) -> None:
    """Interleaved 1F1B (v=2): each rank holds two chunks, cut over its device group's tensor
    group and/or sharded over its replicas, each chunk an FSDP root of its own; a chunk without
    a layer of the TP plan (the embedding, the head) runs whole on every tensor rank; chunks
    may differ in length."""
    zoo = [tp2_then_dp2, one_then_zero3, tp2_then_zero3, one_then_zero3_regather]
    cases = [(interleave(c(4), 2), zoo_spec()) for c in zoo]
    tp2, z3 = (
        StagePlan(layers=(0, 2), devices=(0, 1), tensor_width=2),
        StagePlan(layers=(2, 3), devices=(2, 3), zero_stage=3),
    )
    uneven = Plan(  # chunks of 2, 1, 1 and 1 layers, as the planner's re-cut chunks may be
        planner="manual", global_batch_size=G, micro_batch_size=G // M, num_micro_batches=M,
        stages=(tp2, z3, replace(tp2, layers=(3, 4)), replace(z3, layers=(4, 5))),
        schedule="interleaved", virtual_stages=2,
    )  # fmt: skip
    _verify_all([*cases, (interleave(tp2_then_zero3(4), 2), llama(tmp_path / "llama")),
                 (uneven, llama(tmp_path / "llama3", layers=3))])  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verify_zoo_transformer_with_recompute_under_tp_and_zero3() -> None:
    """Re-computation replays a cut block's forward, its row-parallel all-reduces included, in
    the backward: every rank of the tensor group replays the same collectives; a ZeRO-3 stage
    replays its FSDP2 root's forward (re-gathered: its all-gathers too), under 1F1B, ZB-H1 and
    interleaved 1F1B."""
    wl = zoo_spec()
    cases = [dp2_tp2(4), tp2_then_dp2(4), one_then_zero3(4), one_then_zero3_regather(4),
             replace(tp2_fsdp2(4), schedule="zbh1"), interleave(tp2_then_zero3(4), 2)]  # fmt: skip
    _verify_all([(recomputing(c), wl) for c in cases])

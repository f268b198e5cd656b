"""Tensor parallelism on dapple's stage pieces (:mod:`dapple.runtime.parallel.tp`).

Pure tests of plans, layouts and refusals on the traced pieces, one single-rank run of the
rewritten graph, and (slow tier) TP2 on two gloo ranks against one process: outputs, input and
parameter gradients, two AdamW steps, and the collectives per transformer block (Megatron's two
all-reduces forward and two backward), on a tiny Hugging Face LLaMA (its ``base_model_tp_plan``)
and on the zoo transformer (:data:`~dapple.runtime.parallel.tp.TRANSFORMER_TP_PLAN`).

``python tests/test_tensor_parallel.py`` measures, on two ranks, the same LLaMA block as plain
DTensors (PyTorch's own propagation) beside the local shards: collectives and step times
(the facts in ``/work/shared/notes/3d-parallel-facts.md``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dapple.errors import ValidationError
from dapple.models.workload import Workload
from dapple.runtime.parallel.tp import (
    TRANSFORMER_TP_PLAN,
    ShardLayout,
    check_width,
    match_style,
    parallelize_piece,
    parallelize_stage,
    plan_layouts,
)
from dapple.runtime.verify.report import ATOL, GRAD_NORM_RTOL, GRAD_RTOL, RTOL

tf = pytest.importorskip("transformers")

LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
ZOO = {"layers": 2, "hidden": 64, "heads": 4, "seq": 16, "vocab": 128}
BATCH = 4


# -- models ---------------------------------------------------------------------------------
def save_llama(path: Path) -> Path:
    """The tiny LLaMA of issue 30's checks, saved with ``save_pretrained``."""
    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA)).save_pretrained(path)
    return path


def llama(path: Path) -> tuple[Workload, dict[str, str]]:
    """The LLaMA as dapple loads it (``hf:DIR``: embedding, one piece per block, head) and its
    config's ``base_model_tp_plan``."""
    import dapple.api as dp

    plan = tf.AutoConfig.from_pretrained(path).base_model_tp_plan
    return dp.load(f"hf:{path}"), dict(plan)


def _zoo_model() -> nn.Module:
    from dapple.models.zoo.transformer import transformer

    return transformer(**ZOO).build_model()


def zoo() -> tuple[Workload, dict[str, str]]:
    """The zoo transformer traced into pieces (embedding, block, block, head) as dapple traces
    any ``nn.Module``, and its TP plan."""
    from dapple.models.split import workload_from_module
    from dapple.models.zoo.transformer import transformer

    wl = transformer(**ZOO)
    traced = workload_from_module(_zoo_model, wl.make_batch, wl.loss_fn, split_at=["1", "2", "3"])
    return traced, dict(TRANSFORMER_TP_PLAN)


def block_inputs(wl: Workload, batch: int = BATCH, seed: int = 0) -> Any:
    """What the first block piece receives: the prologue (embedding) run on a real batch."""
    inputs, _ = wl.make_batch(batch, seed)
    with torch.no_grad():
        return wl.build_stage(0, 1)(inputs)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama(tmp_path_factory.mktemp("llama"))


# -- plans and layouts ------------------------------------------------------------------------
def test_plan_patterns_match_one_name_component_and_whole_names() -> None:
    plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    assert match_style("model.layers.0.self_attn.q_proj", plan) == "colwise"
    assert match_style("layers.11.mlp.down_proj", plan) == "rowwise"
    assert match_style("model.layers.0.self_attn.q_proj_extra", plan) is None
    assert match_style("model.layers.0.1.self_attn.q_proj", plan) is None
    assert match_style("model.xlayers.0.self_attn.q_proj", plan) is None
    assert match_style("1.qkv", TRANSFORMER_TP_PLAN) == "packed_colwise"
    assert match_style("1.ln1", TRANSFORMER_TP_PLAN) is None
    with pytest.raises(ValidationError, match="not supported"):
        match_style("lm_head", {"lm_head": "colwise_rep"})
    with pytest.raises(ValidationError, match="matches styles"):
        match_style("a.b", {"*.b": "colwise", "a.*": "rowwise"})


@pytest.mark.parametrize("t", [1, 2, 4])
def test_layouts_cut_and_join_back(t: int) -> None:
    full = torch.randn(12, 8)
    cases = [
        ShardLayout("w", "colwise", 0, (12,)),
        ShardLayout("w", "rowwise", 1, (8,)),
        ShardLayout("w", "packed_colwise", 0, (4, 4, 4)),
    ]
    for lay in cases:
        shards = [lay.shard(full, r, t) for r in range(t)]
        assert torch.equal(lay.unshard(shards), full)
    q, k, v = full.split(4)
    packed = cases[2].shard(full, 1, 2)  # rank 1 holds the second half of q, of k and of v
    assert torch.equal(packed, torch.cat([q[2:], k[2:], v[2:]]))
    with pytest.raises(ValidationError, match="TP width 3 does not divide"):
        cases[1].shard(full, 0, 3)  # 8 columns


def test_llama_pieces_follow_the_configs_tp_plan(llama_dir: Path) -> None:
    wl, plan = llama(llama_dir)
    piece = wl.build_stage(1, 2)[0]
    layouts, _ = plan_layouts(piece, plan)
    dims = {name.split(".")[-2]: (lay.style, lay.dim) for name, lay in layouts.items()}
    assert dims == {
        "q_proj": ("colwise", 0),
        "k_proj": ("colwise", 0),
        "v_proj": ("colwise", 0),
        "o_proj": ("rowwise", 1),
        "gate_proj": ("colwise", 0),
        "up_proj": ("colwise", 0),
        "down_proj": ("rowwise", 1),
    }
    assert all(name.startswith("model.layers.0.") for name in layouts)
    with pytest.raises(ValidationError, match="matches no parameter"):
        plan_layouts(wl.build_stage(0, 1)[0], plan)  # the embedding


def test_zoo_qkv_is_cut_part_by_part_and_colwise_is_refused() -> None:
    wl, plan = zoo()
    piece = wl.build_stage(1, 2)[0]
    layouts, _ = plan_layouts(piece, plan)
    assert layouts["1.qkv.weight"].parts == (64, 64, 64)
    assert layouts["1.qkv.bias"].parts == (64, 64, 64)
    assert "1.proj.bias" not in layouts and "1.fc2.bias" not in layouts  # added once, whole
    with pytest.raises(ValidationError, match="packed_colwise"):
        plan_layouts(piece, {**plan, "*.qkv": "colwise"})


def test_plans_that_would_not_be_exact_fail_before_any_compute(llama_dir: Path) -> None:
    wl, _ = llama(llama_dir)
    piece = wl.build_stage(1, 2)[0]
    with pytest.raises(ValidationError, match="spans the cut dimension"):  # the residual add
        plan_layouts(piece, {"*.down_proj": "colwise"})
    with pytest.raises(ValidationError, match="needs its input cut"):
        plan_layouts(piece, {"*.q_proj": "rowwise"})
    with pytest.raises(ValidationError, match="needs a whole input"):
        attention_cut = {f"*.{m}_proj": "colwise" for m in "qkvo"}  # o_proj must be rowwise
        plan_layouts(piece, attention_cut)
    with pytest.raises(ValidationError, match=r"only aten\.linear"):
        plan_layouts(piece, {"*.input_layernorm": "colwise"})


def test_widths_that_do_not_divide_heads_fail_before_any_compute(llama_dir: Path) -> None:
    wl, plan = llama(llama_dir)
    piece = wl.build_stage(1, 2)[0]
    check_width(piece, plan, 2)
    with pytest.raises(ValidationError, match="TP width 4 does not divide size 2 of dimension 2"):
        check_width(piece, plan, 4)  # 2 key/value heads (k_proj's 32 rows would divide)
    with pytest.raises(ValidationError, match="TP width 3 does not divide"):
        check_width(piece, plan, 3)


def test_attention_dropout_on_cut_heads_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = tf.LlamaConfig(**LLAMA, attention_dropout=0.1)
    tf.LlamaForCausalLM(config).save_pretrained(tmp_path)
    wl, plan = llama(tmp_path)
    with pytest.raises(ValidationError, match="attention dropout on cut heads"):
        plan_layouts(wl.build_stage(1, 2)[0], plan)


@pytest.fixture
def one_rank() -> Any:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_one_rank_group_runs_the_rewritten_graph(one_rank: Any) -> None:
    wl, plan = zoo()
    stage = wl.build_stage(1, 4)  # two blocks and the head (which the plan leaves whole)
    tp = parallelize_stage(stage, plan, one_rank)
    x = block_inputs(wl)
    got, ref = _forward_backward(tp.module, x), _forward_backward(stage, x)
    torch.testing.assert_close(got[0], ref[0], rtol=RTOL, atol=ATOL)
    grads = tp.full_parameters(grads=True)
    for name, p in stage.named_parameters():
        torch.testing.assert_close(grads[name], p.grad)
    assert sum("dapple_tp_reduce" in n for n, _ in tp.module.named_modules()) == 4
    again = copy.deepcopy(tp.module)  # shares the process group (which cannot be copied)
    torch.testing.assert_close(_forward_backward(again, x)[0], got[0], rtol=0, atol=0)


# -- two ranks ------------------------------------------------------------------------------
def _forward_backward(module: nn.Module, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of ``module`` under a fixed random output gradient."""
    xs = inputs if isinstance(inputs, tuple) else (inputs,)
    xs = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in xs)
    out = module(xs if isinstance(inputs, tuple) else xs[0])
    y = out[-1] if isinstance(out, tuple) else out
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    (y * gy).sum().backward()
    floating = next(t for t in xs if t.is_floating_point())
    assert floating.grad is not None
    return y.detach(), floating.grad


def _counts(mode: Any) -> dict[str, int]:
    return {
        str(op).split("'")[1] if "'" in str(op) else str(op): n
        for op, n in mode.get_comm_counts().items()
    }


def _gaps(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per name: [max |got - ref|, max |ref|]."""
    return {n: [float((got[n] - r).abs().max()), float(r.abs().max())] for n, r in ref.items()}


def _check_stage(stage: nn.Sequential, plan: dict[str, str], x: Any) -> dict[str, Any]:
    """TP over the world group vs ``stage`` whole, on every rank (the same seed everywhere)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ref_stage = copy.deepcopy(stage)
    tp = parallelize_stage(stage, plan, mesh)
    y_ref, gx_ref = _forward_backward(ref_stage, x)
    ref_grads = {n: p.grad.clone() for n, p in ref_stage.named_parameters() if p.grad is not None}
    xs = x if isinstance(x, tuple) else (x,)
    xs = tuple(t.clone().requires_grad_(t.is_floating_point()) for t in xs)
    with CommDebugMode() as fwd:
        out = tp.module(xs if isinstance(x, tuple) else xs[0])
    y = out[-1] if isinstance(out, tuple) else out
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    with CommDebugMode() as bwd:
        (y * gy).sum().backward()
    gx = next(t for t in xs if t.is_floating_point()).grad
    assert gx is not None
    grads = tp.full_parameters(grads=True)
    whole = {n: p.grad for n, p in tp.module.named_parameters() if n not in tp.layouts}
    digest = hashlib.sha1(b"".join(g.numpy().tobytes() for g in whole.values())).hexdigest()  # type: ignore[union-attr]
    steps = _adamw_steps(tp, ref_stage, x)
    return {
        "out": _gaps({"y": y.detach(), "gx": gx}, {"y": y_ref, "gx": gx_ref}),
        "grads": _gaps(grads, ref_grads),
        "steps": steps,
        "fwd": _counts(fwd),
        "bwd": _counts(bwd),
        "whole_grads": digest,
        "cut": sorted(tp.layouts),
    }


def _adamw_steps(tp: Any, ref: nn.Module, x: Any, steps: int = 2) -> list[dict[str, Any]]:
    """AdamW on the local slices, step by step against the whole stage (as ``dapple verify``
    checks: free-running Adam turns rounding-level gradients into steps of ``lr``): each step
    the reference takes the TP run's weights, computes its own gradients (which must match the
    gathered TP ones) and applies the TP gradients; the weights must then match the TP run's."""
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (tp.module, ref))
    out = []
    for _ in range(steps):
        losses = []
        for m, o in ((tp.module, opt), (ref, ref_opt)):
            if m is ref:
                _load(ref, tp.full_parameters())
            o.zero_grad()
            y = m(x)
            loss = (y[-1] if isinstance(y, tuple) else y).square().mean()
            loss.backward()
            losses.append(float(loss.detach()))
        grads = tp.full_parameters(grads=True)
        grad_gaps = _gaps(grads, {n: p.grad for n, p in ref.named_parameters()})
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        ref_opt.step()
        params = {n: p.detach() for n, p in ref.named_parameters()}
        out.append({
            "losses": losses,
            "grads": grad_gaps,
            "params": _gaps(tp.full_parameters(), params),
        })  # fmt: skip
    return out


def _load(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(tensors[n])


def tp_worker(rank: int, world: int, out_dir: str, llama_path: str) -> None:
    """Each check on every rank of the world (the tensor group); results to ``rank<r>.json``."""
    from dapple.runtime import TrainConfig, init_distributed, shutdown_distributed

    init_distributed(TrainConfig(timeout_s=120), world)
    results: dict[str, Any] = {}
    lw, lplan = llama(Path(llama_path))
    zw, zplan = zoo()
    cases = {
        "llama_block": (lw, lplan, 1, 2),
        "llama_stage": (lw, lplan, 1, 4),  # both blocks and the head
        "zoo_block": (zw, zplan, 1, 2),
        "zoo_stage": (zw, zplan, 1, 4),
    }
    for name, (wl, plan, lo, hi) in cases.items():
        torch.manual_seed(0)
        results[name] = _check_stage(wl.build_stage(lo, hi), plan, block_inputs(wl))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    shutdown_distributed()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> list[dict[str, Any]]:
    from dapple.runtime import spawn

    out = tmp_path_factory.mktemp("tp2")
    spawn(tp_worker, 2, str(out), str(llama_dir), timeout_s=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


CASES = ["llama_block", "llama_stage", "zoo_block", "zoo_stage"]
BLOCKS = {"llama_block": 1, "llama_stage": 2, "zoo_block": 1, "zoo_stage": 2}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_tp2_equals_one_process(two_ranks: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(two_ranks):
        r = res[case]
        for what, (gap, scale) in r["out"].items():
            assert gap <= ATOL + RTOL * scale, (rank, case, what, gap)
        for name, (gap, scale) in r["grads"].items():
            assert gap <= GRAD_RTOL * scale, (rank, case, name, gap, scale)
        for k, step in enumerate(r["steps"]):  # AdamW on the slices, step by step
            got, ref = step["losses"]
            assert got == pytest.approx(ref, rel=GRAD_NORM_RTOL), (rank, case, k)
            for name, (gap, scale) in step["grads"].items():
                assert gap <= GRAD_RTOL * scale, (rank, case, k, name, gap, scale)
            for name, (gap, scale) in step["params"].items():
                assert gap <= ATOL + RTOL * scale, (rank, case, k, name, gap)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES)
def test_tp2_runs_megatrons_collectives_per_block(
    two_ranks: list[dict[str, Any]], case: str
) -> None:
    blocks = BLOCKS[case]
    for res in two_ranks:
        assert res[case]["fwd"] == {"c10d.allreduce_": 2 * blocks}
        assert res[case]["bwd"] == {"c10d.allreduce_": 2 * blocks}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tp2_whole_parameters_get_identical_gradients_on_every_rank(
    two_ranks: list[dict[str, Any]],
) -> None:
    for case in CASES:
        assert two_ranks[0][case]["whole_grads"] == two_ranks[1][case]["whole_grads"], case
        assert two_ranks[0][case]["cut"] == two_ranks[1][case]["cut"]


# -- measurement: DTensor beside local shards (not a test) ----------------------------------
def _dtensor_block(piece: nn.Module, plan: dict[str, str], mesh: Any) -> nn.Module:
    """``piece`` with DTensor parameters (the notes' approach) and a local attention call."""
    import torch.nn.functional as F
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.experimental import local_map

    gm = copy.deepcopy(piece)
    for node in list(gm.graph.nodes):  # DTensor has no rule for this assertion
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()
    layouts, _ = plan_layouts(gm, plan)
    for name, p in list(gm.named_parameters()):
        lay = layouts.get(name)
        placement = Shard(lay.dim) if lay else Replicate()
        owner, _, leaf = name.rpartition(".")
        d = distribute_tensor(p.detach(), mesh, [placement])
        setattr(gm.get_submodule(owner), leaf, nn.Parameter(d))

    class _Attention(nn.Module):  # CPU SDPA has no DTensor rule: it decomposes for minutes
        def forward(self, q: Any, k: Any, v: Any, mask: Any, scale: float | None = None) -> Any:
            fn = local_map(
                lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m, scale=scale),
                out_placements=[Shard(1)],
                in_placements=([Shard(1)], [Shard(1)], [Shard(1)], [Replicate()]),
            )
            return fn(q, k, v, mask)

    for name, mod in list(gm.named_children()):
        if type(mod).__name__ == "KeyedAttention":
            setattr(gm, name, _Attention())
    return gm


def _time_block(
    piece: nn.Module, local: nn.Module, dt: nn.Module, mesh: Any, inputs: Any
) -> dict[str, Any]:
    """Collectives of one forward+backward of each variant, and median times of 30
    interleaved ones (the machine is shared)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.experimental import implicit_replication

    hidden, mask = inputs

    def run_plain(m: nn.Module) -> None:
        m((hidden.clone().requires_grad_(), mask))[1].sum().backward()

    def run_dtensor() -> None:
        with implicit_replication():
            x = DTensor.from_local(hidden.clone(), mesh, [Replicate()]).requires_grad_()
            dt((x, DTensor.from_local(mask, mesh, [Replicate()])))[1].sum().backward()

    variants = {"whole": lambda: run_plain(piece), "local": lambda: run_plain(local)}
    variants["dtensor"] = run_dtensor
    res: dict[str, Any] = {}
    for name, fn in variants.items():
        with CommDebugMode() as mode:
            fn()
        res[name] = {"collectives": _counts(mode)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(30):
        for name, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    for name, ts in times.items():
        res[name]["median_ms"] = sorted(ts)[len(ts) // 2]
    return res


def measure_worker(rank: int, world: int, llama_path: str, out_dir: str) -> None:
    """Collectives and forward+backward times of one LLaMA block: whole, local shards, DTensor."""
    from torch.distributed.device_mesh import init_device_mesh

    from dapple.runtime import TrainConfig, init_distributed, shutdown_distributed

    init_distributed(TrainConfig(timeout_s=600), world)
    torch.set_num_threads(1)  # the same per rank at 1 and 2 ranks (2 threads oversubscribe)
    mesh = init_device_mesh("cpu", (world,))
    wl, plan = llama(Path(llama_path))
    piece = wl.build_stage(1, 2)[0]
    local = parallelize_piece(piece, plan, mesh).module
    dt = _dtensor_block(piece, plan, mesh)
    res: dict[str, Any] = {
        f"batch {b}": _time_block(piece, local, dt, mesh, block_inputs(wl, batch=b))
        for b in (8, 64)
    }
    res["threads"] = torch.get_num_threads()
    res["torch"] = torch.__version__
    res["aten_ops_forward"] = sum(n.op == "call_function" for n in piece.graph.nodes)
    if rank == 0:
        Path(out_dir, f"measure{world}.json").write_text(json.dumps(res, indent=1))
    shutdown_distributed()


if __name__ == "__main__":
    import tempfile

    from dapple.runtime import spawn

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    with tempfile.TemporaryDirectory() as tmp:
        path = save_llama(Path(tmp, "llama"))
        for world in (1, 2):  # 1: DTensor's dispatch alone (its collectives are no-ops)
            spawn(measure_worker, world, str(path), tmp, timeout_s=900)
            print(f"{world} rank(s):", Path(tmp, f"measure{world}.json").read_text())

"""Splitting an arbitrary nn.Module into the layer chain: equality, cuts, tied weights."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from dapple.errors import ValidationError
from dapple.models.split import original_model, split_module, workload_from_module
from dapple.models.split_graph import default_cut_names, parse_split_at
from dapple.models.tied import find_tied_parameters, sum_tied_grads_local, sync_tied_grads
from dapple.models.workload import Workload

VOCAB, SEQ, DIM = 16, 6, 8


class Block(nn.Module):
    """Pre-norm residual MLP whose update is masked per position."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.out(torch.relu(self.fc(self.ln(x))))
        return x + h * mask.unsqueeze(-1).to(x.dtype)


class Net(nn.Module):
    """Embedding, blocks in a ModuleList (fed a mask and a shape), tied LM head."""

    def __init__(self, layers: int = 3, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(layers))
        self.side = nn.ModuleList([nn.Linear(DIM, DIM)])  # smaller list: not the default cut
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        n = ids.size(0)
        x = self.side[0](self.emb(ids) + self.pos)
        skip = x
        for block in self.blocks:
            x = block(x, mask).reshape(n, SEQ, DIM)
        return self.head(self.norm(x + skip))


def make_batch(
    batch_size: int, seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    mask = (torch.rand(batch_size, SEQ, generator=gen) > 0.3).long()
    return (ids, mask), ids.roll(1, dims=1)


def lm_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))


def net_workload(split_at: list[str] | None = None, tied: bool = True) -> Workload:
    return _net_workload(tuple(split_at) if split_at is not None else None, tied)


@functools.cache
def _net_workload(split_at: tuple[str, ...] | None, tied: bool) -> Workload:
    """Traced once per argument set (tracing dominates these tests' time)."""
    return workload_from_module(lambda: Net(tied=tied), make_batch, lm_loss, split_at=split_at)


def assert_chain_equals_model(w: Workload, seed: int = 5, batch: int = 3) -> None:
    """Outputs, loss and every parameter gradient of the chain equal the original model's."""
    model = original_model(w, seed)
    chain = w.build_model(seed)
    inputs, targets = w.make_batch(batch, 11)
    ref_out = model(*inputs)
    out = chain(inputs)
    torch.testing.assert_close(out, ref_out)
    ref_loss = w.loss_fn(ref_out, targets)
    loss = w.loss_fn(out, targets)
    torch.testing.assert_close(loss, ref_loss)
    ref_loss.backward()
    loss.backward()
    sum_tied_grads_local(list(chain), w.tied_parameters)
    covered = set()
    for piece in chain:
        for name, p in piece.named_parameters():
            ref = model.get_parameter(name)
            covered.add(id(ref))
            torch.testing.assert_close(p, ref.detach())
            assert p.grad is not None, name
            torch.testing.assert_close(p.grad, ref.grad, msg=lambda m, n=name: f"{n}: {m}")
    assert covered == {id(p) for p in model.parameters() if p.requires_grad}


def test_default_cut_is_largest_module_list() -> None:
    assert default_cut_names(Net()) == ["blocks.0", "blocks.1", "blocks.2"]
    with pytest.raises(ValidationError, match=r"no nn\.ModuleList"):
        default_cut_names(nn.Linear(2, 2))


def test_default_split_pieces_and_names() -> None:
    w = net_workload()
    assert list(w.layer_names) == ["prologue", "blocks.0", "blocks.1", "blocks.2", "epilogue"]
    chain = w.build_model(0)
    assert all(isinstance(p, nn.Module) for p in chain)
    # Cuts carry the mask, the residual stream and (once they differ) the skip as one tuple.
    (ids, mask), _ = w.make_batch(2, 0)
    x = chain[0]((ids, mask))
    assert isinstance(x, tuple) and len(x) == 2
    assert any(t.dtype == torch.long for t in x)  # the int mask flows through the cut
    y = chain[1](x)
    assert isinstance(y, tuple) and len(y) == 3
    # Block pieces own only their block's parameters.
    assert {n for n, _ in chain[2].named_parameters()} == {
        f"blocks.1.{n}" for n, _ in Block(DIM).named_parameters()
    }


def test_chain_equals_model_outputs_and_grads() -> None:
    assert_chain_equals_model(net_workload())


@pytest.mark.parametrize("batch", [1, 4])
def test_any_batch_size(batch: int) -> None:
    """The traced batch dimension is symbolic: batch 1 and 4 work though it was traced at 2."""
    assert_chain_equals_model(net_workload(), batch=batch)


def test_untied_model_has_no_groups() -> None:
    w = net_workload(tied=False)
    assert w.tied_parameters == ()
    assert_chain_equals_model(w)


def test_split_at_names() -> None:
    w = net_workload(["head", "blocks.2", "blocks.1.fc"])
    assert list(w.layer_names) == ["prologue", "blocks.1.fc", "blocks.2", "head"]
    chain = w.build_model(0)
    assert "blocks.1.ln.weight" in dict(chain[0].named_parameters())
    assert "blocks.1.fc.weight" in dict(chain[1].named_parameters())
    assert "norm.weight" in dict(chain[2].named_parameters())
    assert set(dict(chain[3].named_parameters())) == {"head.weight"}
    assert_chain_equals_model(w)


def test_split_at_bad_name_lists_valid_names() -> None:
    with pytest.raises(ValidationError, match=r"blocks\.9") as info:
        net_workload(["blocks.9"])
    msg = str(info.value)
    for name in ("blocks.0", "blocks.2.fc", "head", "norm", "emb"):
        assert name in msg


def test_split_at_same_place_rejected() -> None:
    with pytest.raises(ValidationError, match="same place"):
        net_workload(["blocks.1", "blocks.1.ln"])


def test_parse_split_at() -> None:
    assert parse_split_at("blocks.2, head") == ["blocks.2", "head"]
    assert parse_split_at(None) is None
    assert parse_split_at(" , ") is None


def test_build_stage_matches_build_model() -> None:
    w = net_workload()
    full = w.build_model(7)
    stage = w.build_stage(2, 4, 7)
    for a, b in zip(stage, list(full)[2:4], strict=True):
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert na == nb
            torch.testing.assert_close(pa, pb)
    other = w.build_model(8)
    assert not torch.equal(
        other[1].get_parameter("blocks.0.fc.weight"), full[1].get_parameter("blocks.0.fc.weight")
    )


def test_pieces_are_independent_copies() -> None:
    w = net_workload()
    a, b = w.build_layer(0, 0), w.build_layer(0, 0)
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert pa is not pb and pa.data_ptr() != pb.data_ptr()


def test_tied_detected() -> None:
    w = net_workload()
    assert len(w.tied_parameters) == 1
    group = sorted(w.tied_parameters[0])
    assert group == [(0, "emb.weight"), (4, "head.weight")]
    chain = w.build_model(3)
    (i0, n0), (i1, n1) = group
    # Each piece has its own copy with the same initial value.
    p0, p1 = chain[i0].get_parameter(n0), chain[i1].get_parameter(n1)
    assert p0 is not p1
    torch.testing.assert_close(p0, p1)


def test_find_tied_parameters_on_shared_pieces() -> None:
    pieces, _ = split_module(Net(), make_batch(2, 0)[0])
    groups = find_tied_parameters(pieces)
    assert len(groups) == 1 and {i for i, _ in groups[0]} == {0, len(pieces) - 1}


def test_grads_differ_without_tied_sum() -> None:
    """Sanity: the tied copies' local gradients are not the model's gradient on their own."""
    w = net_workload()
    model, chain = original_model(w, 1), w.build_model(1)
    inputs, targets = w.make_batch(2, 0)
    w.loss_fn(model(*inputs), targets).backward()
    w.loss_fn(chain(inputs), targets).backward()
    (i, name), _ = w.tied_parameters[0]
    ref = model.get_parameter(name).grad
    assert not torch.allclose(chain[i].get_parameter(name).grad, ref)


def test_sync_tied_grads_calls_group_sum_for_local_groups_only() -> None:
    w = net_workload()
    chain = w.build_model(0)
    inputs, targets = w.make_batch(2, 0)
    w.loss_fn(chain(inputs), targets).backward()
    (i_first, name_first), (i_last, _) = sorted(w.tied_parameters[0])
    calls: list[int] = []

    def fake_allreduce(g: int, t: torch.Tensor) -> torch.Tensor:
        calls.append(g)
        return t * 10

    before = chain[i_first].get_parameter(name_first).grad.clone()
    sync_tied_grads({i_first: chain[i_first]}, w.tied_parameters, fake_allreduce)
    assert calls == [0]
    torch.testing.assert_close(chain[i_first].get_parameter(name_first).grad, before * 10)
    calls.clear()
    sync_tied_grads({1: chain[1], 2: chain[2]}, w.tied_parameters, fake_allreduce)
    assert calls == []
    assert i_last not in (1, 2)


def test_three_sgd_steps_with_tied_weights_equal_original() -> None:
    w = net_workload()
    model, chain = original_model(w, 2), w.build_model(2)
    opt_ref = torch.optim.SGD(model.parameters(), lr=0.5)
    opt = torch.optim.SGD(chain.parameters(), lr=0.5)
    for step in range(3):
        inputs, targets = w.make_batch(4, step)
        opt_ref.zero_grad()
        opt.zero_grad()
        ref_loss = w.loss_fn(model(*inputs), targets)
        loss = w.loss_fn(chain(inputs), targets)
        torch.testing.assert_close(loss, ref_loss)
        ref_loss.backward()
        loss.backward()
        sum_tied_grads_local(list(chain), w.tied_parameters)
        opt_ref.step()
        opt.step()
    for piece in chain:
        for name, p in piece.named_parameters():
            torch.testing.assert_close(p, model.get_parameter(name).detach())


def test_original_model_rejects_other_workloads() -> None:
    w = Workload("plain", [lambda: nn.Linear(2, 2)], make_batch, lm_loss)
    with pytest.raises(ValidationError, match="workload_from_module"):
        original_model(w)


def test_untraceable_model_is_validation_error() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(2, 2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent control flow cannot be exported
                return self.blocks[0](x)
            return x

    with pytest.raises(ValidationError, match=r"torch\.export"):
        workload_from_module(
            DataDependent,
            lambda b, s: (torch.ones(b, 2), torch.zeros(b)),
            lambda o, t: o.sum(),
        )


class TableBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x + table))


class TableNet(nn.Module):
    """Blocks share a (SEQ, DIM) table built from a buffer: it has no batch dimension."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.register_buffer("inv", torch.linspace(0.1, 1.0, DIM))
        self.blocks = nn.ModuleList(TableBlock() for _ in range(3))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        table = torch.sin(torch.arange(SEQ, dtype=torch.float32)[:, None] * self.inv[None, :])
        x = self.emb(ids) * mask.unsqueeze(-1)
        for block in self.blocks:
            x = block(x, table)
        return self.head(x)


def test_batch_free_tensors_are_recomputed_not_passed() -> None:
    w = workload_from_module(TableNet, make_batch, lm_loss)
    chain = w.build_model(0)
    x, _ = w.make_batch(3, 0)
    for piece in list(chain)[:-1]:
        x = piece(x)
        assert isinstance(x, torch.Tensor) and x.shape == (3, SEQ, DIM)  # only the stream
    assert "inv" in dict(chain[2].named_buffers())  # each block piece rebuilds the table
    assert_chain_equals_model(w)


class SeqFirstNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).transpose(0, 1)  # (seq, batch, dim) between the blocks
        for block in self.blocks:
            x = block(x)
        return x.transpose(0, 1)


def test_cut_carrying_non_batch_major_tensor_rejected() -> None:
    with pytest.raises(ValidationError, match="dimension 0 is not the batch"):
        workload_from_module(SeqFirstNet, make_batch, lm_loss)


class FixedBatchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(SEQ, SEQ)])

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](ids.float().reshape(2, SEQ))


def test_model_fixing_the_batch_size_rejected() -> None:
    with pytest.raises(ValidationError, match="fixes the batch size"):
        workload_from_module(FixedBatchNet, make_batch, lm_loss)


def _run_on(w: Workload, device: str) -> torch.Tensor:
    chain = w.build_model(0).to(device)
    (ids, mask), _ = w.make_batch(2, 0)
    return chain((ids.to(device), mask.to(device)))


@pytest.mark.parametrize("net", [Net, TableNet])
def test_pieces_follow_their_inputs_device(net: type[nn.Module]) -> None:
    """Ops traced with ``device=cpu`` (arange, masks) run on the device of the piece's input."""
    out = _run_on(workload_from_module(net, make_batch, lm_loss), "meta")
    assert out.device.type == "meta" and out.shape == (2, SEQ, VOCAB)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chain_on_cuda_equals_cpu() -> None:
    w = workload_from_module(TableNet, make_batch, lm_loss)
    torch.testing.assert_close(_run_on(w, "cuda").cpu(), _run_on(w, "cpu"))


def test_workload_pickles() -> None:
    import pickle

    w = workload_from_module(Net, make_batch, lm_loss, split_at="blocks.1,head")
    clone = pickle.loads(pickle.dumps(w))
    assert clone.layer_names == w.layer_names == ("prologue", "blocks.1", "head")
    for a, b in zip(clone.build_model(2), w.build_model(2), strict=True):
        torch.testing.assert_close(dict(a.named_parameters()), dict(b.named_parameters()))


class RowsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.tanh(self.fc(x.reshape(rows, DIM))).reshape(-1, SEQ, DIM)


class ShapeNet(nn.Module):
    """Only a size is computed before the blocks; that product of sizes is used after cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RowsBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.size(0) * SEQ
        for block in self.blocks:
            x = block(x, rows)
        return x


def _shape_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, SEQ, DIM, generator=gen), torch.zeros(batch_size)


def test_size_only_prologue_is_merged_and_sizes_recomputed() -> None:
    w = workload_from_module(ShapeNet, _shape_batch, lambda out, t: out.square().mean())
    assert list(w.layer_names) == ["blocks.0", "blocks.1", "blocks.2"]
    chain, model = w.build_model(1), original_model(w, 1)
    for batch in (1, 5):
        x, _ = w.make_batch(batch, 0)
        h = x
        for piece in chain:
            h = piece(h)
            assert isinstance(h, torch.Tensor)  # sizes never cross a cut as values
        torch.testing.assert_close(h, model(x))


class BNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.bn = nn.BatchNorm1d(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BNBlock() for _ in range(2))
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_buffers_start_at_init_and_update_like_the_model() -> None:
    """Tracing runs forward; the pieces still start from the untouched BatchNorm statistics."""

    def batch(b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(b, DIM, generator=torch.Generator().manual_seed(seed)), torch.zeros(b)

    w = workload_from_module(BNNet, batch, lambda out, t: out.square().mean())
    chain, model = w.build_model(0), original_model(w, 0)
    assert list(w.layer_names) == ["blocks.0", "blocks.1", "epilogue"]
    assert torch.all(chain[0].get_buffer("blocks.0.bn.running_mean") == 0)
    for seed in range(2):
        x, _ = w.make_batch(4, seed)
        torch.testing.assert_close(chain(x), model(x))
    for i, block in enumerate(model.blocks):
        torch.testing.assert_close(
            chain[i].get_buffer(f"blocks.{i}.bn.running_var"), block.bn.running_var
        )

"""The passes that cut an exported graph into pieces (models/split_passes.py), one by one."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from dapple.errors import ValidationError
from dapple.models.split_graph import executed_module_names
from dapple.models.split_passes import (
    assign_pieces,
    batch_dependent,
    batch_free,
    last_uses,
    layout_pieces,
    live_values,
    merge_empty_pieces,
)
from dapple.models.trace import export_model

DIM = 4


class Chain(nn.Module):
    """Three linear blocks, each adding a table that does not depend on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.arange(DIM, dtype=torch.float32)
        for block in self.blocks:
            x = block(x) + table
        return x


class SeqFirst(nn.Module):
    """Carries (seq, batch, dim) between its blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        return x.transpose(0, 1)


def _graph(model: nn.Module, example: torch.Tensor) -> tuple[list[fx.Node], list[tuple[int, str]]]:
    """The exported graph's nodes and a cut before every block."""
    traced = export_model(model, (example,)).module(check_guards=False)
    nodes = list(traced.graph.nodes)
    spans = executed_module_names(traced.graph)
    cuts = sorted((spans[f"blocks.{i}"][0], f"blocks.{i}") for i in range(len(model.blocks)))  # type: ignore[arg-type]
    return nodes, cuts


def _calls(nodes: list[fx.Node]) -> list[fx.Node]:
    return [n for n in nodes if n.op == "call_function"]


def test_each_compute_node_goes_to_the_piece_of_its_position() -> None:
    nodes, cuts = _graph(Chain(), torch.randn(2, DIM))
    piece_of, names = assign_pieces(nodes, cuts)
    assert names == ["prologue", "blocks.0", "blocks.1", "blocks.2"]
    assert set(piece_of) == set(_calls(nodes))
    position = {n: i for i, n in enumerate(nodes)}
    bounds = [0, *(p for p, _ in cuts)]
    for node, k in piece_of.items():
        assert bounds[k] <= position[node] and (
            k + 1 == len(bounds) or position[node] < bounds[k + 1]
        )
    assert sorted(set(piece_of.values())) == [0, 1, 2, 3]  # the table is built in the prologue


def test_pieces_without_a_tensor_join_the_next_one() -> None:
    nodes, _ = _graph(Chain(), torch.randn(2, DIM))
    calls = _calls(nodes)
    piece_of = {n: 2 for n in calls}  # pieces 0, 1 and 3 compute nothing
    merged, names = merge_empty_pieces(piece_of, ["prologue", "a", "b", "c"])
    assert names == ["b"] and set(merged.values()) == {0}
    with pytest.raises(ValidationError, match="computes no tensor"):
        merge_empty_pieces({}, ["prologue"])


def test_last_use_is_the_last_reading_piece_and_outputs_are_used_by_the_model() -> None:
    nodes, cuts = _graph(Chain(), torch.randn(2, DIM))
    piece_of, names = merge_empty_pieces(*assign_pieces(nodes, cuts))
    final = list(nodes[-1].all_input_nodes)
    last = last_uses(nodes, piece_of, final, len(names))
    for v in final:
        assert last[v] == len(names)
    table = next(n for n in nodes if "arange" in str(n.target))
    assert last[table] == len(names) - 1  # the last block still adds it


def test_tables_built_without_the_input_are_batch_free() -> None:
    nodes, _ = _graph(Chain(), torch.randn(2, DIM))
    placeholders = [n for n in nodes if n.op == "placeholder"]
    dep = batch_dependent(nodes, placeholders)
    free = batch_free(nodes, dep)
    table = next(n for n in nodes if "arange" in str(n.target))
    assert table in free and table not in dep
    assert free.isdisjoint(dep) and free | {n for n in dep if n.op == "call_function"} >= set(
        n for n in _calls(nodes) if n.target is not torch.ops.aten.sym_size.int
    )


def test_only_the_stream_crosses_each_cut() -> None:
    nodes, cuts = _graph(Chain(), torch.randn(2, DIM))
    piece_of, names = merge_empty_pieces(*assign_pieces(nodes, cuts))
    final = list(nodes[-1].all_input_nodes)
    dep = batch_dependent(nodes, [n for n in nodes if n.op == "placeholder"])
    crossing, folded = live_values(
        nodes, piece_of, last_uses(nodes, piece_of, final, len(names)), dep, names
    )
    assert [len(c) for c in crossing] == [1, 1, 1] and not folded  # the table is recomputed


def test_a_cut_carrying_a_tensor_without_the_batch_first_is_refused() -> None:
    nodes, cuts = _graph(SeqFirst(), torch.randn(2, 3, DIM))
    with pytest.raises(
        ValidationError,
        match=r"cut before 'blocks.0' would carry transpose .* dimension 0 is not the batch",
    ):
        layout_pieces(nodes, cuts)


def test_layout_pieces_ties_the_passes_together() -> None:
    nodes, cuts = _graph(Chain(), torch.randn(2, DIM))
    layout = layout_pieces(nodes, cuts)
    assert layout.num == 4 and layout.names[0] == "prologue"
    assert layout.live_in[0] == [n for n in nodes if n.op == "placeholder"]
    assert layout.live_in[-1] == list(nodes[-1].all_input_nodes)
    bodies = [layout.body(nodes, k) for k in range(layout.num)]
    assert sum(len(b) for b in bodies) == len(_calls(nodes))  # every compute node, once

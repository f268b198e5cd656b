"""Cut a model's ``torch.export`` graph into pieces that each take and return tensors.

Used by :mod:`dapple.models.split` (see its docstring for the design). A *cut* is a position in the
exported graph's node list; each run of nodes between two cuts becomes a
``torch.fx.GraphModule`` whose parameters keep the original model's qualified names.
"""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from dapple.errors import ValidationError
from dapple.models.rng_graph import key_random_sites, number_random_sites
from dapple.models.shapes import DimsMap
from dapple.models.split_passes import PieceLayout, batch_symbols, layout_pieces
from dapple.models.trace import export_model, fake_to_meta, output_is_tuple, traced_dims

__all__ = [
    "EXAMPLE_BATCH",
    "SplitModel",
    "default_cut_names",
    "executed_module_names",
    "parse_split_at",
]

EXAMPLE_BATCH = 2
"""Batch size the model is traced at (0 and 1 would be specialised by ``torch.export``)."""


def parse_split_at(text: str | None) -> list[str] | None:
    """Parse a CLI ``--split-at NAME,NAME`` value (``None`` or empty: default cuts)."""
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    return names or None


def _as_tuple(inputs: Any) -> tuple[Any, ...]:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each parameter/buffer that is reachable under several names."""
    by_id: dict[int, list[str]] = {}
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        by_id.setdefault(id(t), []).append(name)
    return {n: names for names in by_id.values() if len(names) > 1 for n in names}


def _fetch(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _install(root: nn.Module, target: str, obj: Any) -> None:
    """Set ``root.<target> = obj``, creating plain parent modules; tensors become buffers."""
    *prefix, field = target.split(".")
    mod = root
    for part in prefix:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter):
        mod.register_buffer(field, obj)
    else:
        setattr(mod, field, obj)


def _has_device(obj: Any) -> bool:
    if isinstance(obj, torch.device):
        return True
    if isinstance(obj, (tuple, list)):
        return any(_has_device(x) for x in obj)
    if isinstance(obj, dict):
        return any(_has_device(x) for x in obj.values())
    return False


def _follow_input_device(graph: fx.Graph, after: fx.Node, source: fx.Node) -> None:
    """Replace the trace device baked into ops (``arange(..., device=cpu)``) by the device
    of the piece's first input at run time, so a piece moved with ``.to(device)`` runs there."""
    users = [n for n in graph.nodes if n.op == "call_function" and _has_device((n.args, n.kwargs))]
    if not users:
        return
    with graph.inserting_after(after):
        dev = graph.call_function(getattr, (source, "device"))

    def swap(x: Any) -> Any:
        return dev if isinstance(x, torch.device) else x

    for node in users:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)


def _follow_device_in_submodules(traced: fx.GraphModule) -> None:
    """:func:`_follow_input_device` inside the graphs of higher-order ops (``autocast`` or
    ``no_grad`` regions): each follows the device of its first tensor argument."""
    for sub in traced.modules():
        if sub is traced or not isinstance(sub, fx.GraphModule):
            continue
        holders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        tensors = [n for n in holders if isinstance(n.meta.get("val"), torch.Tensor)] or holders
        if tensors:
            _follow_input_device(sub.graph, holders[-1], tensors[0])
            sub.recompile()


def _drop_float_dtype_asserts(traced: fx.GraphModule) -> None:
    """Remove the trace's checks that a tensor has the floating dtype it had when traced
    (``aten._assert_tensor_metadata``, which ``torch.export`` puts before each ``.to(dtype)``;
    in the graphs of higher-order ops too). Under autocast a matmul's output is bf16 or fp16
    where the trace saw fp32: Mixtral's router casts its logits with ``.float()``, and the
    check before that cast would stop every bf16 run. The casts themselves stay."""
    assert_op = torch.ops.aten._assert_tensor_metadata.default
    for gm in traced.modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        checks = [
            n
            for n in gm.graph.nodes
            if n.op == "call_function"
            and n.target is assert_op
            and not n.users
            and isinstance(n.kwargs.get("dtype"), torch.dtype)
            and n.kwargs["dtype"].is_floating_point
        ]
        for n in checks:
            gm.graph.erase_node(n)
        if checks:
            gm.recompile()


def _module_fqns(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [str(v[0]) for v in stack.values() if isinstance(v, tuple) and v and v[0]]


def executed_module_names(graph: fx.Graph) -> dict[str, tuple[int, int]]:
    """Module names that ran in ``graph``, mapped to (first, last) node positions.

    Args:
        graph: A graph from ``torch.export`` whose nodes carry ``nn_module_stack``.
    """
    spans: dict[str, tuple[int, int]] = {}
    for pos, node in enumerate(graph.nodes):
        for fqn in _module_fqns(node):
            first, _ = spans.get(fqn, (pos, pos))
            spans[fqn] = (first, pos)
    return spans


def default_cut_names(model: nn.Module) -> list[str]:
    """Names of the elements of the model's largest ``nn.ModuleList`` (the blocks).

    Args:
        model: The original model.

    Raises:
        ValidationError: The model has no non-empty ``nn.ModuleList``.
    """
    best: tuple[int, int, str] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            size = sum(p.numel() for p in mod.parameters())
            key = (len(mod), size, name)
            if best is None or key[:2] > best[:2]:
                best = key
    if best is None:
        raise ValidationError(
            f"{type(model).__name__} has no nn.ModuleList to split at; give split_at names"
        )
    prefix = f"{best[2]}." if best[2] else ""
    return [f"{prefix}{i}" for i in range(best[0])]


class SplitModel:
    """A model traced once and cut into pieces (templates; weights loaded per seed)."""

    def __init__(
        self,
        model: nn.Module,
        example_inputs: Any,
        split_at: Sequence[str] | None = None,
        dynamic_dims: DimsMap | None = None,
    ) -> None:
        """Trace ``model`` on ``example_inputs`` and cut it.

        Args:
            model: The original model, called as ``model(*inputs)``.
            example_inputs: A tensor or tuple of tensors (batch in dimension 0).
            split_at: Module names to cut before (or one comma-separated string); ``None``:
                before every block of the largest ``nn.ModuleList`` and after the last block.
            dynamic_dims: Non-batch input dimensions traced dynamic (see
                :mod:`dapple.models.shapes`); :attr:`dynamic_dims` holds them with the ranges
                the traced graph is valid for.

        Raises:
            ValidationError: A name in ``split_at`` did not run in the model (the message lists
                the valid names), two names cut at the same place, or tracing failed (also: the
                model cannot take a dynamic dimension; the message names it).
        """
        if isinstance(split_at, str):  # "a,b" from a CLI --set split_at=a,b
            split_at = parse_split_at(split_at)
        inputs = _as_tuple(example_inputs)
        self.input_is_tuple = isinstance(example_inputs, tuple)
        program = export_model(model, inputs, dynamic_dims)
        self.dynamic_dims = traced_dims(program, dynamic_dims or {})
        self.output_is_tuple = output_is_tuple(model, program)
        self.traced = program.module(check_guards=False)
        fake_to_meta(self.traced)
        _follow_device_in_submodules(self.traced)
        _drop_float_dtype_asserts(self.traced)
        self.aliases = _aliases(model)
        nodes = list(self.traced.graph.nodes)
        self.random_sites = number_random_sites(
            self.traced.graph, batch_symbols([n for n in nodes if n.op == "placeholder"])
        )
        """The batch dimension of each random site (dropout, attention), in run order
        (:mod:`dapple.models.rng`)."""
        modules = dict(model.named_modules(remove_duplicate=False))
        spans = {
            n: span for n, span in executed_module_names(self.traced.graph).items() if n in modules
        }
        cuts = self._cut_positions(model, spans, split_at)
        self.pieces, self.names = self._build_pieces(nodes, cuts)
        for piece in self.pieces:
            key_random_sites(piece)

    # -- cutting ------------------------------------------------------------------------------

    @staticmethod
    def _cut_positions(
        model: nn.Module,
        spans: dict[str, tuple[int, int]],
        split_at: Sequence[str] | None,
    ) -> list[tuple[int, str]]:
        if split_at is None:
            blocks = [b for b in default_cut_names(model) if b in spans]
            if not blocks:
                raise ValidationError("no block of the largest nn.ModuleList ran in forward")
            cuts = [(spans[b][0], b) for b in blocks]
            cuts.append((spans[blocks[-1]][1] + 1, "epilogue"))
            return cuts
        unknown = [n for n in split_at if n not in spans]
        if unknown:
            valid = sorted(spans, key=lambda n: (spans[n][0], n))
            raise ValidationError(
                f"split_at names {unknown} are not modules that run in "
                f"{type(model).__name__}.forward; valid names: {', '.join(valid)}"
            )
        cuts = sorted((spans[n][0], n) for n in split_at)
        for (p, a), (q, b) in itertools.pairwise(cuts):
            if p == q:
                raise ValidationError(f"split_at names {a!r} and {b!r} cut at the same place")
        return cuts

    def _build_pieces(
        self, nodes: list[fx.Node], cuts: list[tuple[int, str]]
    ) -> tuple[list[fx.GraphModule], list[str]]:
        """The pieces of ``nodes`` cut at ``cuts``, and their names (which nodes each piece
        computes and takes: :func:`~dapple.models.split_passes.layout_pieces`)."""
        layout = layout_pieces(nodes, cuts)
        self._batch_free, self._folded = layout.batch_free, layout.folded
        return [self._piece_module(nodes, layout, k) for k in range(layout.num)], layout.names

    def _piece_module(self, nodes: list[fx.Node], layout: PieceLayout, k: int) -> fx.GraphModule:
        """Piece ``k`` as a graph module whose attributes keep the original model's names; it
        takes and returns one tensor, or a tuple (several, or the model's own tuple)."""
        live_in, last = layout.live_in, layout.num - 1
        pack_in = self.input_is_tuple if k == 0 else len(live_in[k]) > 1
        pack_out = self.output_is_tuple if k == last else len(live_in[k + 1]) > 1
        body = layout.body(nodes, k)
        graph, attrs = self._piece_graph(k, live_in[k], body, live_in[k + 1], pack_in, pack_out)
        root = nn.Module()
        for target, obj in attrs.items():
            _install(root, target, obj)
        return fx.GraphModule(root, graph, class_name=f"Piece{k}")

    # -- one piece ----------------------------------------------------------------------------

    def _piece_graph(
        self,
        k: int,
        inputs: list[fx.Node],
        body: list[fx.Node],
        outputs: list[fx.Node],
        pack_in: bool,
        pack_out: bool,
    ) -> tuple[fx.Graph, dict[str, Any]]:
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        attrs: dict[str, Any] = {}
        members = set(body)
        raw: list[fx.Node] = []
        if pack_in:
            arg = graph.placeholder("inputs")
            raw = [graph.call_function(operator.getitem, (arg, i)) for i in range(len(inputs))]
        else:
            raw.append(graph.placeholder(inputs[0].name))
        batch = graph.call_function(torch.ops.aten.sym_size.int, (raw[0], 0))
        for v, node in zip(inputs, raw, strict=True):
            node.meta = copy.copy(v.meta)
            env[v] = node
            if v in self._folded:  # arrives as (batch, f, ...): back to (batch * f, ...)
                env[v] = graph.call_function(torch.ops.aten.flatten.using_ints, (node, 0, 1))
                env[v].meta = copy.copy(v.meta)

        def lookup(a: fx.Node) -> fx.Node:
            if a in env:
                return env[a]
            if a.op == "get_attr":
                target = self._alias(str(a.target), [u for u in a.users if u in members])
                attrs[target] = _fetch(self.traced, str(a.target))
                env[a] = graph.get_attr(target)
                env[a].meta = copy.copy(a.meta)
                return env[a]
            if a in self._batch_free:
                env[a] = graph.node_copy(a, lookup)
                return env[a]
            return self._materialize(graph, env, a, inputs, k)

        for node in body:
            env[node] = graph.node_copy(node, lookup)
        outs = tuple(
            graph.call_function(torch.ops.aten.unflatten.int, (lookup(v), 0, [batch, -1]))
            if v in self._folded
            else lookup(v)
            for v in outputs
        )
        graph.output(outs if pack_out else outs[0])
        if not batch.users:
            graph.erase_node(batch)
        _follow_input_device(graph, raw[-1], raw[0])
        graph.lint()
        return graph, attrs

    def _alias(self, target: str, users: list[fx.Node]) -> str:
        """Of the names of a shared tensor, the one owned by a module that uses it here."""
        names = self.aliases.get(target, [target])
        owners = {fqn for u in users for fqn in _module_fqns(u)}
        owned = [n for n in names if n.rpartition(".")[0] in owners]
        return max(owned, key=lambda n: n.count(".")) if owned else target

    @staticmethod
    def _materialize(
        graph: fx.Graph,
        env: dict[fx.Node, fx.Node],
        value: fx.Node,
        inputs: list[fx.Node],
        k: int,
    ) -> fx.Node:
        """Recompute a symbolic size from an input tensor's shape instead of passing it."""
        val = value.meta.get("val")
        if isinstance(val, torch.SymInt):
            for v in inputs:
                fake = v.meta.get("val")
                if not isinstance(fake, torch.Tensor):
                    continue
                for d, size in enumerate(fake.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr == val.node.expr:
                        new = graph.call_function(torch.ops.aten.sym_size.int, (env[v], d))
                        new.meta = copy.copy(value.meta)
                        env[value] = new
                        return new
            if value.op == "call_function" and value.target is not torch.ops.aten.sym_size.int:
                new = graph.node_copy(
                    value,
                    lambda a: (
                        env[a] if a in env else SplitModel._materialize(graph, env, a, inputs, k)
                    ),
                )
                env[value] = new
                return new
        raise ValidationError(
            f"piece {k} needs {value.name} ({type(val).__name__}) computed before the cut and "
            "it cannot be passed as a tensor; choose other split_at names"
        )

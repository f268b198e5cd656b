"""Any ``nn.Module`` as the layer chain the planner cuts between, traced with ``torch.export``.

Design choices:
    - The model is captured once per process with ``torch.export.export`` (non-strict, batch
      dimension of every input dynamic), giving a flat ATen graph whose nodes carry the
      ``nn_module_stack`` of the module that ran them. We do not write a tracer.
    - A *cut* is a position in that graph's node list: "before module X" is the first node X
      ran. By default we cut before every element of the model's largest ``nn.ModuleList``
      (the transformer blocks) and after the last one; ``split_at`` names other modules.
    - Each run of nodes between two cuts becomes one *piece*: a ``torch.fx.GraphModule`` that
      takes one tensor or a tuple of tensors and returns the tensors later pieces (or the final
      output) need, in graph order. Values that skip pieces are passed through.
    - Integer/bool tensors (attention masks, position ids) flow like any other tensor. Symbolic
      sizes (``x.size(0)``) never cross a cut: a piece re-reads them from the shape of one of
      its own input tensors (``aten.sym_size``).
    - A parameter reached from two pieces (tied weights such as GPT-2's ``wte``/``lm_head``) is
      copied into each; :func:`find_tied_parameters` records the groups so the runtime can sum
      their gradients with :mod:`dapple.tied` (re-exported here).
    - Parameter names inside a piece are the original model's fully qualified names, so the
      weights of seed ``s`` are loaded into the traced pieces by name.

Piece ``i``'s factory builds the whole model under the run's base seed (recovered from the
per-layer seed :meth:`dapple.workload.Workload.build_layer` sets) and returns a copy of piece
``i`` holding that model's weights, so ``build_stage(i, j, seed)`` equals the layers ``[i, j)``
of ``build_model(seed)`` and tied copies start equal.
"""

from __future__ import annotations

import copy
import itertools
import logging
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from dapple.errors import ValidationError
from dapple.tied import find_tied_parameters, sum_tied_grads_local, sync_tied_grads
from dapple.workload import Workload, layer_seed

__all__ = [
    "SplitModel",
    "default_cut_names",
    "executed_module_names",
    "find_tied_parameters",
    "original_model",
    "parse_split_at",
    "split_module",
    "sum_tied_grads_local",
    "sync_tied_grads",
    "workload_from_module",
]

log = logging.getLogger(__name__)

_SEED_MOD = 2**63 - 1
_EXAMPLE_BATCH = 2  # traced batch size: 0 and 1 get specialised by torch.export


def parse_split_at(text: str | None) -> list[str] | None:
    """Parse a CLI ``--split-at NAME,NAME`` value (``None`` or empty: default cuts)."""
    if text is None:
        return None
    names = [t.strip() for t in text.split(",") if t.strip()]
    return names or None


def _as_tuple(inputs: Any) -> tuple[Any, ...]:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _export(model: nn.Module, inputs: tuple[Any, ...]) -> fx.GraphModule:
    dyn = torch.export.Dim.DYNAMIC
    shapes = tuple(
        {0: dyn} if isinstance(t, torch.Tensor) and t.dim() > 0 else None for t in inputs
    )
    try:
        ep = torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)
    except Exception as e:  # torch raises many types; report them as one user error
        raise ValidationError(
            f"cannot trace {type(model).__name__} with torch.export: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}"
        ) from e
    return ep.module(check_guards=False)


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
    ) -> None:
        """Trace ``model`` on ``example_inputs`` and cut it.

        Args:
            model: The original model, called as ``model(*inputs)``.
            example_inputs: A tensor or tuple of tensors (batch in dimension 0).
            split_at: Module names to cut before (or one comma-separated string); ``None``:
                before every block of the largest ``nn.ModuleList`` and after the last block.

        Raises:
            ValidationError: A name in ``split_at`` did not run in the model (the message lists
                the valid names), two names cut at the same place, or tracing failed.
        """
        if isinstance(split_at, str):  # "a,b" from a CLI --set split_at=a,b
            split_at = parse_split_at(split_at)
        inputs = _as_tuple(example_inputs)
        self.input_is_tuple = isinstance(example_inputs, tuple)
        with torch.no_grad():
            eager_out = model(*inputs)
        if isinstance(eager_out, torch.Tensor):
            self.output_is_tuple = False
        elif isinstance(eager_out, tuple) and all(isinstance(t, torch.Tensor) for t in eager_out):
            self.output_is_tuple = True
        else:
            raise ValidationError(
                f"{type(model).__name__} must return a tensor or a tuple of tensors, "
                f"got {type(eager_out).__name__}"
            )
        self.traced = _export(model, inputs)
        self.aliases = _aliases(model)
        nodes = list(self.traced.graph.nodes)
        modules = dict(model.named_modules(remove_duplicate=False))
        spans = {
            n: span for n, span in executed_module_names(self.traced.graph).items() if n in modules
        }
        cuts = self._cut_positions(model, spans, split_at, len(nodes))
        self.pieces, self.names = self._build_pieces(nodes, cuts)

    # -- cutting ------------------------------------------------------------------------------

    @staticmethod
    def _cut_positions(
        model: nn.Module,
        spans: dict[str, tuple[int, int]],
        split_at: Sequence[str] | None,
        num_nodes: int,
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
        position = {n: i for i, n in enumerate(nodes)}
        bounds = [0, *[p for p, _ in cuts], len(nodes)]
        names = ["prologue", *[n for _, n in cuts]]
        # Assign compute nodes to raw pieces by position.
        piece_of: dict[fx.Node, int] = {}
        for node in nodes:
            if node.op == "call_function":
                pos = position[node]
                piece_of[node] = max(k for k in range(len(names)) if bounds[k] <= pos)
        # getitem on a list-valued node stays with that node (lists never cross a cut).
        for node in nodes:
            if node.op == "call_function" and node.target is operator.getitem:
                src = node.args[0]
                if isinstance(src, fx.Node) and src in piece_of:
                    piece_of[node] = piece_of[src]
        # Drop empty pieces (e.g. nothing runs before the first block).
        used = sorted(set(piece_of.values()))
        renumber = {old: new for new, old in enumerate(used)}
        piece_of = {n: renumber[k] for n, k in piece_of.items()}
        names = [names[k] for k in used]
        num = len(names)

        placeholders = [n for n in nodes if n.op == "placeholder"]
        output = next(n for n in nodes if n.op == "output")
        final = list(output.all_input_nodes)
        # Last piece (num = the output) that uses each tensor value.
        last_use: dict[fx.Node, int] = {}
        for node in nodes:
            if node.op != "call_function":
                continue
            for arg in node.all_input_nodes:
                last_use[arg] = max(last_use.get(arg, -1), piece_of[node])
        for arg in final:
            last_use[arg] = num

        def defined_in(v: fx.Node) -> int:
            return -1 if v.op == "placeholder" else piece_of.get(v, -2)

        def is_tensor(v: fx.Node) -> bool:
            return isinstance(v.meta.get("val"), torch.Tensor)

        values = [v for v in nodes if v.op in ("placeholder", "call_function") and is_tensor(v)]
        live_in: list[list[fx.Node]] = [placeholders]
        for k in range(1, num):
            live_in.append(
                [
                    v
                    for v in values
                    if defined_in(v) < k <= last_use.get(v, -1) and defined_in(v) > -2
                ]
            )
        live_in.append(final)
        for v in final:
            if not is_tensor(v):
                raise ValidationError(f"model output {v.name} is not a tensor")

        pieces = []
        for k in range(num):
            body = [n for n in nodes if piece_of.get(n) == k]
            pack_in = self.input_is_tuple if k == 0 else len(live_in[k]) > 1
            pack_out = self.output_is_tuple if k == num - 1 else len(live_in[k + 1]) > 1
            graph, attrs = self._piece_graph(k, live_in[k], body, live_in[k + 1], pack_in, pack_out)
            root = nn.Module()
            for target, obj in attrs.items():
                _install(root, target, obj)
            pieces.append(fx.GraphModule(root, graph, class_name=f"Piece{k}"))
        return pieces, names

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
        if pack_in:
            arg = graph.placeholder("inputs")
            for i, v in enumerate(inputs):
                env[v] = graph.call_function(operator.getitem, (arg, i))
                env[v].meta = copy.copy(v.meta)
        else:
            (v,) = inputs
            env[v] = graph.placeholder(v.name)
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
            return self._materialize(graph, env, a, inputs, k)

        for node in body:
            env[node] = graph.node_copy(node, lookup)
        outs = tuple(lookup(v) for v in outputs)
        graph.output(outs if pack_out else outs[0])
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


def _base_seed_of_current_rng(index: int) -> int:
    """The run seed's layer-0 seed, recovered inside ``Workload.build_layer(index, seed)``.

    ``layer_seed(seed, i) = layer_seed(seed, 0) + layer_seed(0, i) (mod 2**63 - 1)``, so every
    piece of one run maps to the same base seed and builds the same whole model.
    """
    return (torch.initial_seed() - layer_seed(0, index)) % _SEED_MOD


class _PieceFactory:
    """Zero-argument factory of piece ``index`` (see the module docstring)."""

    def __init__(self, owner: _Splitter, index: int) -> None:
        self.owner = owner
        self.index = index

    def __call__(self) -> nn.Module:
        return self.owner.piece(self.index, _base_seed_of_current_rng(self.index))


class _Splitter:
    """Per-process cache: the traced templates and the whole model of recent base seeds."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        split: SplitModel,
        first_model: tuple[int, nn.Module],
    ) -> None:
        self.model_factory = model_factory
        self.split = split
        self.models: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._remember(*first_model)

    def _remember(self, base: int, model: nn.Module) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        state.update(model.named_buffers(remove_duplicate=False))
        self.models[base] = state
        while len(self.models) > 2:
            self.models.popitem(last=False)
        return state

    def state(self, base: int) -> dict[str, torch.Tensor]:
        if base in self.models:
            self.models.move_to_end(base)
            return self.models[base]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base)
            return self._remember(base, self.model_factory())

    def piece(self, index: int, base: int) -> nn.Module:
        state = self.state(base)
        piece = copy.deepcopy(self.split.pieces[index])
        with torch.no_grad():
            for name, t in [*piece.named_parameters(), *piece.named_buffers()]:
                if name in state:
                    t.copy_(state[name])
        return piece


def split_module(
    model: nn.Module, example_inputs: Any, split_at: Sequence[str] | None = None
) -> tuple[list[fx.GraphModule], list[str]]:
    """Cut ``model`` into pieces sharing its parameter objects (no copy, no seed handling).

    Args:
        model: The model, called as ``model(*inputs)``.
        example_inputs: A tensor or tuple of tensors with the batch in dimension 0.
        split_at: Module names to cut before (``None``: the default block cuts).

    Raises:
        ValidationError: See :class:`SplitModel`.
    """
    split = SplitModel(model, example_inputs, split_at)
    return split.pieces, split.names


def workload_from_module(
    model_factory: Callable[[], nn.Module],
    make_batch: Callable[[int, int], tuple[Any, torch.Tensor]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    split_at: Sequence[str] | None = None,
    name: str | None = None,
) -> Workload:
    """A :class:`Workload` whose layers are the pieces of any model, cut at module boundaries.

    Args:
        model_factory: Builds the original model (random init from the global RNG).
        make_batch: ``(batch_size, seed) -> (inputs, targets)``; ``inputs`` are passed to the
            model as ``model(*inputs)`` (a single tensor: ``model(inputs)``).
        loss_fn: Mean loss of the model's output against ``targets``.
        split_at: Module names to cut before; ``None``: before every element of the largest
            ``nn.ModuleList`` and after the last one.
        name: Workload name (default: the model's class name).

    Raises:
        ValidationError: Bad ``split_at`` names (the message lists the valid ones) or a model
            ``torch.export`` cannot trace.
    """
    base = layer_seed(0, 0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base)
        model = model_factory()
    inputs, _ = make_batch(_EXAMPLE_BATCH, 0)
    split = SplitModel(model, inputs, split_at)
    splitter = _Splitter(model_factory, split, (base, model))
    log.debug("split %s into %d pieces: %s", type(model).__name__, len(split.names), split.names)
    return Workload(
        name=name or type(model).__name__,
        layer_factories=[_PieceFactory(splitter, i) for i in range(len(split.pieces))],
        make_batch=make_batch,
        loss_fn=loss_fn,
        layer_names=tuple(split.names),
        tied_parameters=tuple(tuple(g) for g in find_tied_parameters(split.pieces)),
    )


def original_model(workload: Workload, seed: int = 0) -> nn.Module:
    """The unsplit model whose weights ``workload.build_model(seed)``'s pieces carry.

    Args:
        workload: A workload made by :func:`workload_from_module`.
        seed: The run seed given to ``build_model``.

    Raises:
        ValidationError: ``workload`` was not made by :func:`workload_from_module`.
    """
    factory = workload.layer_factories[0] if workload.num_layers else None
    if not isinstance(factory, _PieceFactory):
        raise ValidationError(f"workload {workload.name!r} was not made by workload_from_module")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, 0))
        return factory.owner.model_factory()

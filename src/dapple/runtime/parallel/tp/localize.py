"""Cut a stage piece over a tensor group: local shards, local shapes, explicit all-reduces.

The approach of Megatron-LM (Shoeybi et al. 2019), applied to dapple's aten graphs instead of
hand-written layers: every rank runs the *same graph on plain local tensors*. The rewrite

1. replaces each planned parameter by this rank's slice (:class:`~dapple.runtime.parallel.tp.plan.ShardLayout`);
2. divides by ``t`` the shape constants of the views, reshapes, expands and splits that act on
   a cut dimension (``view(x, [b, s, 4, 16])`` becomes ``[b, s, 2, 16]`` at ``t = 2``; ``-1``
   and symbolic sizes stay as they are);
3. inserts Megatron's ``f`` once on each whole value that enters a sharded region (the norm's
   output that feeds q/k/v, the one that feeds gate/up) and ``g`` after each row-parallel
   product, before its bias.

Why not DTensor (measured on torch 2.13, gloo, in ``/work/shared/notes/3d-parallel-facts.md``):
on the same aten graph DTensor keeps a row-parallel output ``Partial`` until some op needs it
whole, so the residual stream stays partial, the next norm's output is partial, and its cost
model then all-gathers the MLP weights: per LLaMA block it ran 2 all-reduces + 2 all-gathers +
1 reduce-scatter forward and 3 + 4 + 3 backward, against Megatron's 2 and 2; and its CPU
attention (``_scaled_dot_product_flash_attention_for_cpu``) has no sharding rule, so it
propagates through the decomposition for minutes. Local shards give exactly 2 + 2 per block,
no dispatch overhead, and plain parameters that FSDP2 can shard again over the replicas.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh

from dapple.errors import ValidationError
from dapple.runtime.parallel.tp.collectives import CopyToGroup, ReduceFromGroup, all_gather_list
from dapple.runtime.parallel.tp.plan import ShardLayout, Style, match_style
from dapple.runtime.parallel.tp.propagate import Sharded, State, propagate, shape_of

__all__ = [
    "TensorParallelModule",
    "check_width",
    "parallelize_piece",
    "parallelize_stage",
    "plan_layouts",
]

log = logging.getLogger(__name__)

aten = torch.ops.aten
COPY, REDUCE = "dapple_tp_copy", "dapple_tp_reduce"
"""Name prefixes of the inserted ``f`` and ``g`` modules (one instance per call site)."""

_SHAPE_ARG = {
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.expand.default,
}
_SPLIT = {aten.split.Tensor, aten.split_with_sizes.default}


@dataclass
class TensorParallelModule:
    """A piece or stage cut over a tensor group of ``t`` ranks, and how to put its parameters
    back together."""

    module: nn.Module
    """The rewritten piece (or stage of pieces): local parameters under their original names."""
    layouts: dict[str, ShardLayout]
    """Cut parameters by qualified name; every other parameter is whole on every rank."""
    group: dist.ProcessGroup
    rank: int
    """This rank's index in ``group``."""
    t: int

    def full_parameters(
        self, grads: bool = False, local: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Every parameter (or its gradient) whole, gathered from the group (collective:
        call on every rank of the group).

        Args:
            grads: Gather the gradients instead of the weights.
            local: This rank's slices to join instead of the module's own (e.g. gathered over
                an FSDP replica mesh first: :func:`dapple.runtime.parallel.fsdp.full_parameters`).
        """
        if local is None:
            own = {n: p.grad if grads else p.detach() for n, p in self.module.named_parameters()}
            local = {n: t for n, t in own.items() if t is not None}
        return {
            name: t if name not in self.layouts
            else self.layouts[name].unshard(all_gather_list(t, self.group))
            for name, t in local.items()
        }  # fmt: skip


def _weight_styles(gm: fx.GraphModule, plan: Mapping[str, str]) -> dict[str, tuple[Style, str]]:
    """Planned parameter name -> (style, weight name), checking that each is only a linear's
    weight or bias."""
    styles: dict[str, tuple[Style, str]] = {}
    params = dict(gm.named_parameters())
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not isinstance(node.target, str):
            continue
        owner, _, leaf = node.target.rpartition(".")
        style = match_style(owner, plan)
        if style is None or node.target not in params:
            continue
        for user in node.users:
            pos = [i for i, a in enumerate(user.args) if a is node]
            if user.target is not aten.linear.default or pos not in ([1], [2]):
                raise ValidationError(
                    f"tensor parallel: planned parameter {node.target} is used by "
                    f"{user.name} ({user.target}); only aten.linear weights and biases can be cut"
                )
            if pos == [2] and style == "rowwise":
                continue  # a row-parallel bias stays whole (added after the reduction)
            weight = user.args[1]
            assert isinstance(weight, fx.Node)
            styles[node.target] = (style, str(weight.target))
        if leaf not in ("weight", "bias"):
            raise ValidationError(f"tensor parallel: cannot cut parameter {node.target}")
    return styles


def _packed_parts(gm: fx.GraphModule, states: dict[fx.Node, State]) -> dict[str, tuple[int, ...]]:
    """Packed weight name -> the global sizes of its parts, from the split that separates them."""
    parts: dict[str, tuple[int, ...]] = {}
    for node in gm.graph.nodes:
        splits = node.op == "call_function" and node.target in (*_SPLIT, aten.chunk.default)
        src = node.args[0] if splits else None
        st = states.get(src) if isinstance(src, fx.Node) else None
        if isinstance(st, Sharded) and st.packed is not None:
            vals = node.meta["val"]
            sizes = tuple(int(v.shape[st.dim]) for v in vals)
            if parts.setdefault(st.packed, sizes) != sizes:
                raise ValidationError(f"tensor parallel: {st.packed} is split two ways")
    return parts


def plan_layouts(
    gm: fx.GraphModule, plan: Mapping[str, str]
) -> tuple[dict[str, ShardLayout], dict[fx.Node, State]]:
    """The layout of every cut parameter of ``gm`` under ``plan``, and every node's state
    (no communication, no rank: any process can check a plan with it).

    Raises:
        ValidationError: the plan cuts nothing, a planned parameter outside a linear, an op
            whose local computation would not be exact (see :mod:`~dapple.runtime.parallel.tp.propagate`).
    """
    styles = _weight_styles(gm, plan)
    if not styles:
        raise ValidationError("tensor parallel: the TP plan matches no parameter of this piece")
    states = propagate(gm, styles)
    packed = _packed_parts(gm, states)
    layouts: dict[str, ShardLayout] = {}
    for name, (style, weight) in styles.items():
        shape = gm.get_parameter(name).shape
        dim = 1 if style == "rowwise" else 0
        if style == "packed_colwise" and weight not in packed:
            raise ValidationError(f"tensor parallel: packed {weight}'s output is never split")
        parts = packed[weight] if style == "packed_colwise" else (shape[dim],)
        layouts[name] = ShardLayout(name, style, dim, parts)
    return layouts, states


def check_width(
    gm: fx.GraphModule, plan: Mapping[str, str], t: int
) -> tuple[dict[str, ShardLayout], dict[fx.Node, State]]:
    """:func:`plan_layouts`, and ``t`` divides every cut size (each part of every cut
    parameter, the cut dimension of every value: heads, key/value heads, hidden units).

    Raises:
        ValidationError: as :func:`plan_layouts`; the first size ``t`` does not divide.
    """
    layouts, states = plan_layouts(gm, plan)
    for name, lay in layouts.items():
        lay.check(gm.get_parameter(name).shape, t)
    for node, st in states.items():
        shape = shape_of(node)
        if isinstance(st, Sharded) and shape is not None and shape[st.dim] % t:
            raise ValidationError(
                f"TP width {t} does not divide size {shape[st.dim]} of dimension {st.dim} of "
                f"{node.name} (shape {list(shape)}; e.g. the key/value heads)"
            )
    return layouts, states


def _group(group: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValidationError(f"tensor parallel: need a 1-D tensor mesh, got {group.ndim}-D")
        return group.get_group()
    return group


def _local(size: Any, t: int, node: fx.Node) -> Any:
    if not isinstance(size, int) or size == -1:
        return size
    if size % t:
        raise ValidationError(
            f"TP width {t} does not divide size {size} of the cut dimension at {node.name}"
        )
    return size // t


def _rewrite_shapes(gm: fx.GraphModule, states: dict[fx.Node, State], t: int) -> None:
    for node in gm.graph.nodes:
        st = states.get(node)
        if node.op != "call_function":
            continue
        if node.target in _SHAPE_ARG and isinstance(st, Sharded):
            shape = list(node.args[1])
            shape[st.dim] = _local(shape[st.dim], t, node)
            node.args = (node.args[0], shape, *node.args[2:])
        elif node.target in _SPLIT:
            src = states.get(node.args[0])
            dim = node.args[2] if len(node.args) > 2 else 0
            nd = len(shape_of(node.args[0]) or ())
            if isinstance(src, Sharded) and dim % nd == src.dim:
                sizes = node.args[1]
                new = (
                    [_local(s, t, node) for s in sizes]
                    if isinstance(sizes, (list, tuple))
                    else _local(sizes, t, node)
                )
                node.args = (node.args[0], new, *node.args[2:])


def _call(gm: fx.GraphModule, module: nn.Module, prefix: str, after: fx.Node) -> fx.Node:
    """A call of ``module`` (registered as ``prefix_<k>``) on ``after``'s value, right after it."""
    k = sum(name.startswith(prefix) for name, _ in gm.named_children())
    gm.add_module(f"{prefix}_{k}", module)
    with gm.graph.inserting_after(after):
        return gm.graph.call_module(f"{prefix}_{k}", (after,))


def _insert_collectives(
    gm: fx.GraphModule,
    states: dict[fx.Node, State],
    layouts: Mapping[str, ShardLayout],
    group: dist.ProcessGroup,
) -> tuple[int, int]:
    """Megatron's ``f`` before sharded regions, ``g`` after row-parallel products; returns how
    many of each were inserted."""
    cut = set(layouts)
    copies: dict[fx.Node, fx.Node] = {}
    n_reduce = 0
    for node in list(gm.graph.nodes):
        st = states.get(node)
        sharded = isinstance(st, Sharded) or (isinstance(st, list) and any(st))
        if node.op == "call_function" and node.target is aten.linear.default and st is None:
            w = node.args[1]
            if (
                isinstance(w, fx.Node)
                and w.target in cut
                and layouts[str(w.target)].style == "rowwise"
            ):
                n_reduce += _reduce_after(gm, node, group)
                continue
        if not sharded:
            continue
        for a in node.all_input_nodes:
            if states.get(a) is not None or a.target in cut or not _float_tensor(a):
                continue
            if a not in copies:
                copies[a] = _call(gm, CopyToGroup(group), COPY, a)
            node.replace_input_with(a, copies[a])
    return len(copies), n_reduce


def _float_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _reduce_after(gm: fx.GraphModule, node: fx.Node, group: dist.ProcessGroup) -> int:
    """``linear(x, w, b)`` -> ``g(linear(x, w)) + b``."""
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    node.args, node.kwargs = (node.args[0], node.args[1]), {}
    red = _call(gm, ReduceFromGroup(group), REDUCE, node)
    last = red
    if bias is not None:
        with gm.graph.inserting_after(red):
            last = gm.graph.call_function(aten.add.Tensor, (red, bias))
    node.replace_all_uses_with(last, delete_user_cb=lambda u: u is not red)
    return 1


def _set_parameter(gm: nn.Module, name: str, value: torch.Tensor, requires_grad: bool) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(gm.get_submodule(owner), leaf, nn.Parameter(value, requires_grad=requires_grad))


def parallelize_piece(
    piece: fx.GraphModule,
    plan: Mapping[str, str],
    group: dist.ProcessGroup | DeviceMesh,
) -> TensorParallelModule:
    """Cut ``piece`` over the tensor group ``group`` (a process group or a 1-D ``DeviceMesh``).

    Every rank of the group calls this with the same whole ``piece``; each gets its own slices.
    The result's forward takes and returns what ``piece``'s does (whole tensors on every rank);
    its outputs equal ``piece``'s and its gradients are the slices of ``piece``'s (whole
    parameters' gradients are equal on every rank: no further reduction is needed).

    Args:
        piece: A stage piece from :mod:`dapple.models.split` (left unchanged).
        plan: Module-name pattern -> ``colwise`` / ``packed_colwise`` / ``rowwise``, e.g. a
            Hugging Face config's ``base_model_tp_plan``.
        group: The tensor group (``t`` ranks).

    Raises:
        ValidationError: see :func:`check_width` (before any communication).
    """
    pg = _group(group)
    t, rank = dist.get_world_size(pg), dist.get_rank(pg)
    gm = copy.deepcopy(piece)
    layouts, states = check_width(gm, plan, t)
    for name, lay in layouts.items():
        p = gm.get_parameter(name)
        _set_parameter(gm, name, lay.shard(p.detach(), rank, t), p.requires_grad)
    _rewrite_shapes(gm, states, t)
    n_copy, n_reduce = _insert_collectives(gm, states, layouts, pg)
    gm.graph.lint()
    gm.recompile()
    log.debug("cut %d parameters over %d ranks: %d f, %d g", len(layouts), t, n_copy, n_reduce)
    return TensorParallelModule(gm, layouts, pg, rank, t)


def parallelize_stage(
    stage: nn.Sequential,
    plan: Mapping[str, str],
    group: dist.ProcessGroup | DeviceMesh,
    *,
    require: bool = True,
) -> TensorParallelModule:
    """:func:`parallelize_piece` on each piece of ``stage`` that ``plan`` cuts; the others
    (an embedding, a head) run whole on every rank of the group.

    Args:
        require: Refuse a stage of which ``plan`` cuts no piece (False: such a stage runs
            whole, e.g. one chunk of an interleaved plan whose other chunks are cut).

    Raises:
        ValidationError: ``plan`` cuts no piece of the stage (with ``require``), or as
            :func:`parallelize_piece`.
    """
    pg = _group(group)
    pieces: list[nn.Module] = []
    layouts: dict[str, ShardLayout] = {}
    for k, piece in enumerate(stage):
        if not isinstance(piece, fx.GraphModule) or not _weight_styles(piece, plan):
            pieces.append(copy.deepcopy(piece))
            continue
        tp = parallelize_piece(piece, plan, pg)
        pieces.append(tp.module)
        layouts.update(
            {f"{k}.{name}": replace(lay, name=f"{k}.{name}") for name, lay in tp.layouts.items()}
        )
    if require and not layouts:
        raise ValidationError("tensor parallel: the TP plan matches no parameter of this stage")
    return TensorParallelModule(
        nn.Sequential(*pieces), layouts, pg, dist.get_rank(pg), dist.get_world_size(pg)
    )

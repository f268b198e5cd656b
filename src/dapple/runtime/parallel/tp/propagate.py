"""Which values of a piece's aten graph are cut over the tensor group, and along which dimension.

Forward sharding propagation over an ``fx.Graph`` from ``torch.export`` (global shapes in each
node's ``meta["val"]``). A value is *whole* (None: the same on every rank) or
:class:`Sharded` along one dimension (each rank holds its contiguous ``1/t``). Column-parallel
linears start sharded regions, row-parallel ones end them; in between only ops whose local
computation on local slices is exact are allowed (pointwise, views that keep the cut dimension
outermost, transposes, batched matmul and attention over the cut heads, reductions over other
dimensions). Anything else raises a ValidationError naming the node, before any compute: the
run never falls back to gathering (contrast DTensor, which redistributes silently).

Shapes: symbolic sizes (the batch) are replaced by distinct large primes, so the products the
view rule compares never equal a static size by accident.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx

from dapple.errors import ValidationError
from dapple.models.rng import KeyedAttention, KeyedDropout
from dapple.runtime.parallel.tp.plan import Style

__all__ = [
    "ModuleKind",
    "Sharded",
    "State",
    "attention_args",
    "module_kinds",
    "propagate",
    "shape_of",
]

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Sharded:
    """A value cut along ``dim``; ``packed``: the packed-colwise weight it came from, until the
    graph splits it into its parts."""

    dim: int
    packed: str | None = None


State = Sharded | None | list["Sharded | None"]

ModuleKind = Literal["attention", "identity", "dropout"]

_PRIMES = (1_000_003, 1_000_033, 1_000_037, 1_000_039, 1_000_081, 1_000_099)


def _size(s: Any) -> int:
    if isinstance(s, torch.SymInt):
        expr = s.node.expr
        subs = {
            sym: _PRIMES[i % len(_PRIMES)]
            for i, sym in enumerate(sorted(expr.free_symbols, key=str))
        }
        return int(expr.subs(subs))
    return int(s)


def shape_of(node: Any) -> tuple[int, ...] | None:
    """Global shape of a tensor-valued node (None: not a tensor)."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(_size(s) for s in val.shape)
    return None


def _fail(node: fx.Node, why: str) -> ValidationError:
    return ValidationError(f"tensor parallel: node {node.name} ({node.target}): {why}")


def _dim(d: Any, nd: int) -> int:
    return int(d) % nd if nd else 0


def _arg(node: fx.Node, i: int, name: str = "", default: Any = None) -> Any:
    """Argument ``i`` (or keyword ``name``) of ``node``, untyped as fx stores it."""
    if i < len(node.args):
        return node.args[i]
    return node.kwargs.get(name, default)


# -- rules ------------------------------------------------------------------------------------
Rule = Callable[[fx.Node, Callable[[Any], State]], State]


def _only(node: fx.Node, st: State) -> Sharded:
    if not isinstance(st, Sharded):
        raise _fail(node, "expected one sharded tensor")
    return st


def _not_packed(node: fx.Node, st: Sharded) -> None:
    if st.packed is not None:
        raise _fail(
            node,
            f"the packed output of {st.packed} must be split into its parts before this op",
        )


def _pointwise(node: fx.Node, state: Callable[[Any], State]) -> State:
    """Broadcasting rule: sharded operands agree on the output dimension; whole operands have
    size 1 there (or lack it)."""
    out = shape_of(node)
    if out is None:
        raise _fail(node, "no shape recorded for a pointwise op")
    nd = len(out)
    tensors = [a for a in (*node.args, *node.kwargs.values()) if shape_of(a) is not None]
    found: set[tuple[int, str | None]] = set()
    for a in tensors:
        st = state(a)
        if isinstance(st, Sharded):
            found.add((st.dim + nd - len(shape_of(a) or ()), st.packed))
    if len(found) != 1:
        raise _fail(node, f"operands cut along different dimensions {sorted(found, key=str)}")
    ((od, packed),) = found
    for a in tensors:
        shp = shape_of(a) or ()
        k = od - (nd - len(shp))
        if state(a) is None and 0 <= k < len(shp) and shp[k] != 1:
            raise _fail(node, f"whole operand {a} spans the cut dimension {od}")
    return Sharded(od, packed)


def _view_dim(node: fx.Node, src: fx.Node, d: int) -> int:
    """Output dimension of a reshape that carries input dimension ``d`` as a contiguous cut."""
    ins, out = shape_of(src), shape_of(node)
    assert ins is not None and out is not None
    prefix = math.prod(ins[:d])
    for o in range(len(out)):
        if math.prod(out[:o]) == prefix and out[o] != 1:
            return o
    raise _fail(node, f"reshape {ins} -> {out} does not keep dimension {d} outermost")


def _view(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    _not_packed(node, st)
    return Sharded(_view_dim(node, _arg(node, 0), st.dim))


def _expand(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    _not_packed(node, st)
    out, ins = shape_of(node), shape_of(node.args[0])
    assert out is not None and ins is not None
    return Sharded(st.dim + len(out) - len(ins))


def _transpose(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    _not_packed(node, st)
    nd = len(shape_of(node) or ())
    if node.target is aten.t.default:
        a, b = 0, 1
    else:
        a, b = _dim(_arg(node, 1), nd), _dim(_arg(node, 2), nd)
    return Sharded(b if st.dim == a else a if st.dim == b else st.dim)


def _permute(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    _not_packed(node, st)
    nd = len(shape_of(node) or ())
    perm = [_dim(p, nd) for p in _arg(node, 1)]
    return Sharded(perm.index(st.dim))


def _slice(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    ins = shape_of(node.args[0])
    assert ins is not None
    dim = _dim(_arg(node, 1, "dim", 0), len(ins))
    if dim == st.dim and shape_of(node) != ins:
        raise _fail(node, f"slices the cut dimension {dim}")
    return st


def _select(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    _not_packed(node, st)
    dim = _dim(_arg(node, 1), len(shape_of(node.args[0]) or ()))
    if dim == st.dim:
        raise _fail(node, f"selects along the cut dimension {dim}")
    return Sharded(st.dim - (dim < st.dim))


def _split(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    ins = shape_of(node.args[0])
    assert ins is not None
    dim = _dim(_arg(node, 2, "dim", 0), len(ins))
    outs = node.meta.get("val")
    n = len(outs) if isinstance(outs, (list, tuple)) else 0
    if dim != st.dim:
        _not_packed(node, st)
        return [Sharded(st.dim)] * n
    if st.packed is None:
        raise _fail(
            node,
            "splits the cut dimension of a colwise output: a fused projection needs the "
            "'packed_colwise' style",
        )
    return [Sharded(st.dim)] * n


def _cat(node: fx.Node, state: Callable[[Any], State]) -> State:
    tensors = list(_arg(node, 0))
    states = [state(a) for a in tensors]
    nd = len(shape_of(node) or ())
    dim = _dim(_arg(node, 1, "dim", 0), nd)
    dims = {s.dim if isinstance(s, Sharded) and s.packed is None else None for s in states}
    if len(dims) != 1 or None in dims or dim in dims:
        raise _fail(node, "concatenates whole and cut tensors, or along the cut dimension")
    return states[0]


def _matmul(node: fx.Node, state: Callable[[Any], State]) -> State:
    a, b = node.args[0], node.args[1]
    sa, sb = state(a), state(b)
    na, nb = len(shape_of(a) or ()), len(shape_of(b) or ())
    out = shape_of(node)
    assert out is not None
    no = len(out)
    if na < 2 or nb < 2:
        raise _fail(node, "a cut vector operand")
    found: set[int] = set()
    for st, n, contract in ((sa, na, na - 1), (sb, nb, nb - 2)):
        if isinstance(st, Sharded):
            _not_packed(node, st)
            if st.dim == contract:
                raise _fail(node, "contracts over the cut dimension (use a rowwise linear)")
            found.add(st.dim + no - n)
    if len(found) != 1:
        raise _fail(node, "operands cut along different dimensions")
    (od,) = found
    if od < no - 2:  # a batch dimension: both sides must be cut there, or broadcast
        for st, arg, n in ((sa, a, na), (sb, b, nb)):
            k = od - (no - n)
            if st is None and 0 <= k < n and (shape_of(arg) or ())[k] != 1:
                raise _fail(node, f"whole operand {arg} spans the cut batch dimension")
    elif isinstance(sa, Sharded) and isinstance(sb, Sharded):
        raise _fail(node, "both operands cut along non-batch dimensions")
    return Sharded(od)


def _dims_arg(node: fx.Node, nd: int) -> tuple[list[int] | None, bool]:
    dims, keep = _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False)
    if dims is None:
        return None, bool(keep)
    seq = [dims] if isinstance(dims, int) else list(dims)
    return [_dim(d, nd) for d in seq], bool(keep)


def _reduce(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    _not_packed(node, st)
    nd = len(shape_of(node.args[0]) or ())
    dims, keep = _dims_arg(node, nd)
    if not dims or st.dim in dims:
        raise _fail(node, f"reduces over the cut dimension {st.dim}")
    return Sharded(st.dim if keep else st.dim - sum(d < st.dim for d in dims))


def _softmax(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    _not_packed(node, st)
    if _dim(_arg(node, 1), len(shape_of(node) or ())) == st.dim:
        raise _fail(node, "softmax over the cut dimension")
    return st


def _norm(node: fx.Node, state: Callable[[Any], State]) -> State:
    st = _only(node, state(node.args[0]))
    nd = len(shape_of(node.args[0]) or ())
    if st.dim >= nd - len(_arg(node, 1)):
        raise _fail(node, "normalises over the cut dimension")
    return st


def attention_args(node: fx.Node) -> tuple[Any, Any, Any, Any, float]:
    """``(q, k, v, attn_mask, dropout_p)`` of an attention node."""
    q, k, v = (_arg(node, i, n) for i, n in enumerate(("query", "key", "value")))
    return q, k, v, _arg(node, 3, "attn_mask"), float(_arg(node, 4, "dropout_p", 0.0) or 0.0)


def _attention(node: fx.Node, state: Callable[[Any], State]) -> State:
    q, k, v, mask, dropout_p = attention_args(node)
    nd = len(shape_of(q) or ())
    heads = nd - 3
    if any(state(x) != Sharded(heads) for x in (q, k, v)):
        raise _fail(node, "query, key and value must all be cut along the heads dimension")
    if dropout_p:
        raise _fail(node, "attention dropout on cut heads (its keyed masks index global heads)")
    if mask is not None and state(mask) is None:
        shp = shape_of(mask) or ()
        k_ = heads - (nd - len(shp))
        if 0 <= k_ < len(shp) and shp[k_] != 1:
            raise _fail(node, "a whole attention mask with one row per head")
    return Sharded(heads)


def _linear(
    node: fx.Node, state: Callable[[Any], State], styles: Mapping[str, tuple[Style, str]]
) -> State:
    x, w = node.args[0], node.args[1]
    sx = state(x)
    nd = len(shape_of(node) or ())
    style = styles.get(str(w.target)) if isinstance(w, fx.Node) and w.op == "get_attr" else None
    if style is None:
        if isinstance(sx, Sharded):
            _not_packed(node, sx)
            if sx.dim == nd - 1:
                raise _fail(node, "a whole linear on a cut feature dimension (plan it rowwise)")
        return sx
    kind, weight = style
    if kind == "rowwise":
        if sx != Sharded(nd - 1):
            raise _fail(node, f"rowwise {weight} needs its input cut along the features")
        return None
    if sx is not None:
        raise _fail(node, f"colwise {weight} needs a whole input")
    return Sharded(nd - 1, weight if kind == "packed_colwise" else None)


_POINTWISE_EXTRA = {
    aten.to.dtype,
    aten.to.dtype_layout,
    aten._to_copy.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
}

_RULES: dict[Any, Rule] = {
    **dict.fromkeys(
        (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
         aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.flatten.using_ints),
        _view,
    ),
    aten.expand.default: _expand,
    **dict.fromkeys((aten.transpose.int, aten.t.default), _transpose),
    aten.permute.default: _permute,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    **dict.fromkeys((aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default), _split),
    aten.cat.default: _cat,
    **dict.fromkeys((aten.matmul.default, aten.bmm.default), _matmul),
    **dict.fromkeys((aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default), _reduce),
    **dict.fromkeys(
        (aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default),
        _softmax,
    ),
    aten.layer_norm.default: _norm,
    aten.rms_norm.default: _norm,
    aten.scaled_dot_product_attention.default: _attention,
}  # fmt: skip
if hasattr(aten, "_safe_softmax"):
    _RULES[aten._safe_softmax.default] = _softmax


def _is_pointwise(target: Any) -> bool:
    return target in _POINTWISE_EXTRA or (
        isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags
    )


def _inputs(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def module_kinds(gm: fx.GraphModule) -> dict[str, ModuleKind]:
    """What each ``call_module`` target of a dapple piece does: its random sites
    (:mod:`dapple.models.rng`) are attention, dropout, or dropout with ``p = 0`` (identity)."""
    kinds: dict[str, ModuleKind] = {}
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        if isinstance(mod, KeyedAttention):
            kinds[node.target] = "attention"
        elif isinstance(mod, KeyedDropout):
            kinds[node.target] = "identity" if mod.p == 0.0 else "dropout"
    return kinds


def propagate(
    gm: fx.GraphModule,
    styles: Mapping[str, tuple[Style, str]],
    modules: Mapping[str, ModuleKind] | None = None,
) -> dict[fx.Node, State]:
    """The sharding state of every node of ``gm``'s graph.

    Args:
        gm: A piece from :mod:`dapple.models.split` (nodes with ``meta["val"]``).
        styles: Planned weight name -> (style, weight name); biases follow their weight.
        modules: What the ``call_module`` targets do (default :func:`module_kinds`).

    Raises:
        ValidationError: a node whose local computation on cut inputs would not be exact, or
            a piece output that is still cut.
    """
    kinds = module_kinds(gm) if modules is None else modules
    states: dict[fx.Node, State] = {}

    def state(a: Any) -> State:
        return states.get(a) if isinstance(a, fx.Node) else None

    for node in gm.graph.nodes:
        ins = [state(a) for a in _inputs(node)]
        if node.op == "output":
            if any(s is not None for s in ins):
                raise _fail(
                    node, "a piece output is still cut: end the region with a rowwise layer"
                )
            continue
        if node.op == "call_function" and node.target is aten.linear.default:
            states[node] = _linear(node, state, styles)
            continue
        if all(s is None for s in ins):
            states[node] = None
            continue
        states[node] = _rule(node, state, kinds)
    return states


def _rule(node: fx.Node, state: Callable[[Any], State], kinds: Mapping[str, ModuleKind]) -> State:
    if node.op == "call_function" and node.target is operator.getitem:
        src = state(node.args[0])
        return src[_arg(node, 1)] if isinstance(src, list) else src
    if node.op == "call_module":
        kind = kinds.get(str(node.target))
        if kind == "attention":
            return _attention(node, state)
        if kind == "identity":
            return state(node.args[0])
        if kind == "dropout":
            raise _fail(node, "dropout on a cut tensor (its keyed masks index global elements)")
    if node.op == "call_function" and node.target is aten.sym_size.int:
        raise _fail(node, "reads the size of a cut dimension")
    if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
        if node.kwargs.get("size") is not None:
            raise _fail(node, "asserts the size of a cut tensor")
        return None
    if node.op == "call_function" and node.target in _RULES:
        return _RULES[node.target](node, state)
    if node.op == "call_function" and _is_pointwise(node.target):
        return _pointwise(node, state)
    raise _fail(node, "no exact local rule for this op on a cut tensor")

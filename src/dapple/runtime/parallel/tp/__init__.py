"""Tensor parallelism inside a stage: a piece's linears cut over a tensor group (Megatron-LM).

:func:`parallelize_piece` rewrites a stage piece (the ``fx.GraphModule`` of aten ops that
:mod:`dapple.models.split` builds) so that each rank of a ``t``-rank tensor group runs it on
plain local slices, with two all-reduces forward and two backward per transformer block; see
:mod:`dapple.runtime.parallel.tp.localize` for the design and why it is not DTensor.
"""

from dapple.runtime.parallel.tp.collectives import CopyToGroup, ReduceFromGroup
from dapple.runtime.parallel.tp.localize import (
    TensorParallelModule,
    check_width,
    parallelize_piece,
    parallelize_stage,
    plan_layouts,
)
from dapple.runtime.parallel.tp.plan import (
    STYLES,
    TRANSFORMER_TP_PLAN,
    ShardLayout,
    Style,
    match_style,
)

__all__ = [
    "STYLES",
    "TRANSFORMER_TP_PLAN",
    "CopyToGroup",
    "ReduceFromGroup",
    "ShardLayout",
    "Style",
    "TensorParallelModule",
    "check_width",
    "match_style",
    "parallelize_piece",
    "parallelize_stage",
    "plan_layouts",
]

"""Which layers of a workload a tensor group can cut: the model's TP plan and the pieces it matches.

A TP plan maps module-name patterns to a style, in the format of a Hugging Face config's
``base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise", ...}``): ``*`` stands for
one name component and a pattern matches a module name that equals it or ends with ``.`` and
it (a piece's parameters keep the whole model's names, ``model.layers.0.self_attn.q_proj``).
A model's plan is its own (``Workload.tp_plan``), else its Hugging Face config's
(:func:`tp_plan_of`).

The runtime (:func:`dapple.runtime.parallel.tp.parallelize_stage`) cuts exactly the pieces of a stage
that are traced graphs (``fx.GraphModule``, :mod:`dapple.models.split`) with a parameter whose
owning module the plan matches (:func:`cut_by`); every other layer (an embedding, a head, a
layer of a model without a plan) runs whole on every rank of the group. The profiler marks the
same layers ``LayerProfile.tensor_parallel``, so the planner and the runtime agree on them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from torch import fx, nn

from dapple.errors import ValidationError
from dapple.models.workload import Workload

__all__ = [
    "HF_CUT_SIZES",
    "STYLES",
    "TRANSFORMER_TP_PLAN",
    "Style",
    "cut_by",
    "hf_tensor_widths",
    "match_style",
    "tp_plan_of",
]

HF_CUT_SIZES = (
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "key/value heads"),
    ("intermediate_size", "MLP hidden units (intermediate_size)"),
)
"""The Hugging Face config sizes a tensor group cuts (Megatron's column-parallel q/k/v and
gate/up projections), and how an error names them."""


def hf_tensor_widths(config: object, widths: tuple[int, ...]) -> tuple[int, ...]:
    """The ``widths`` that divide every size of ``config`` a tensor group cuts
    (:data:`HF_CUT_SIZES`; a size the config lacks does not limit them)."""
    sizes = [getattr(config, key, None) for key, _ in HF_CUT_SIZES]
    return tuple(t for t in widths if all(not isinstance(n, int) or n % t == 0 for n in sizes))


Style = Literal["colwise", "packed_colwise", "rowwise"]
STYLES: tuple[Style, ...] = ("colwise", "packed_colwise", "rowwise")
"""The TP styles a piece can be cut with (Hugging Face's other styles are refused)."""

TRANSFORMER_TP_PLAN: Mapping[str, Style] = {
    "*.qkv": "packed_colwise",
    "*.proj": "rowwise",
    "*.fc1": "colwise",
    "*.fc2": "rowwise",
}
"""The zoo transformer's (:mod:`dapple.models.zoo.transformer`) plan: attention heads and the
MLP's hidden units cut over the tensor group, as Megatron cuts a GPT block."""


def _pattern(text: str) -> re.Pattern[str]:
    body = r"[^.]+".join(re.escape(part) for part in text.split("*"))
    return re.compile(rf"(?:^|.*\.){body}")


def match_style(module: str, plan: Mapping[str, str]) -> Style | None:
    """The style ``plan`` gives module ``module`` (None: kept whole on every rank).

    Raises:
        ValidationError: ``module`` matches patterns of different styles, or a style this
            module does not implement.
    """
    found = {style for pat, style in plan.items() if _pattern(pat).fullmatch(module)}
    if len(found) > 1:
        raise ValidationError(f"TP plan: module {module!r} matches styles {sorted(found)}")
    if not found:
        return None
    style = found.pop()
    if style not in STYLES:
        raise ValidationError(
            f"TP plan: style {style!r} of module {module!r} is not supported; "
            f"supported: {', '.join(STYLES)}"
        )
    return style


def tp_plan_of(workload: Workload) -> dict[str, str]:
    """The model's TP plan: its own (``Workload.tp_plan``), else a Hugging Face config's
    ``base_model_tp_plan``; empty: the model cannot be cut."""
    if workload.tp_plan:
        return dict(workload.tp_plan)
    from dapple.models.hf import hf_config

    config = hf_config(workload)
    return dict(getattr(config, "base_model_tp_plan", None) or {})


def cut_by(layer: nn.Module, plan: Mapping[str, str]) -> bool:
    """Whether the runtime cuts ``layer`` over a tensor group under ``plan``: a traced piece
    one of whose parameters belongs to a module the plan matches.

    Raises:
        ValidationError: as :func:`match_style` (a module matched by two styles, or by a style
            that is not supported).
    """
    if not plan or not isinstance(layer, fx.GraphModule):
        return False
    params = {name for name, _ in layer.named_parameters(remove_duplicate=False)}
    for node in layer.graph.nodes:
        if node.op == "get_attr" and node.target in params:
            owner = str(node.target).rpartition(".")[0]
            if match_style(owner, plan) is not None:
                return True
    return False

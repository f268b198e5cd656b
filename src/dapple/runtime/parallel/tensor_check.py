"""Refuse, before any process starts, a plan whose tensor groups cannot cut the model.

A stage of tensor width t_s > 1 is cut by :func:`dapple.runtime.parallel.tp.parallelize_stage` in each
worker, once the processes run; what it would refuse there is checked here first, in the
process that launches them (:func:`check_tensor_run`):

- the model has a TP plan (:func:`dapple.models.tp_plan.tp_plan_of`);
- t_s divides every size the plan cuts. For a Hugging Face model these are its config's
  attention heads, key/value heads and MLP hidden units (``intermediate_size``), checked on the
  config alone; for a model with its own plan (``Workload.tp_plan``) each layer of the stage is
  built, one at a time, and checked as the runtime checks it
  (:func:`dapple.runtime.parallel.tp.check_width`), which also refuses a stage the plan cuts nothing of;
- with a cluster, every tensor group sits inside one server
  (:func:`dapple.core.tensor_layout.check_tensor_groups`).
"""

from __future__ import annotations

import gc
from typing import Any

from dapple.core.cluster import Cluster
from dapple.core.plan import Plan, StagePlan
from dapple.core.tensor_layout import check_tensor_groups
from dapple.errors import ValidationError
from dapple.models.tp_plan import HF_CUT_SIZES, cut_by, tp_plan_of
from dapple.models.workload import Workload

__all__ = ["HF_CUT_SIZES", "check_tensor_run"]


def check_tensor_run(plan: Plan, workload: Workload, cluster: Cluster | None = None) -> None:
    """Refuse a plan whose stages of tensor width t_s > 1 the runtime could not cut.

    Args:
        plan: the plan to run.
        workload: the model.
        cluster: the cluster the plan is for, when known (its servers bound the tensor groups).

    Raises:
        ValidationError: one line naming the stage, its width and the model: no TP plan, a
            size the width does not divide, no layer of the stage that the plan cuts, or a
            tensor group across servers.
    """
    if cluster is not None:
        check_tensor_groups(plan, cluster)
    wide = [(s, st) for s, st in enumerate(plan.stages) if st.parallel.tensor_parallel]
    if not wide:
        return
    tp_plan = tp_plan_of(workload)
    if not tp_plan:
        s, st = wide[0]
        zoo = " (-m transformer-tp is the zoo transformer with one)" * (
            workload.name == "transformer"
        )
        raise ValidationError(
            f"{_what(s, st)}: model {workload.name!r} has no TP plan (no Workload.tp_plan, no "
            "Hugging Face base_model_tp_plan), so it cannot be cut over a tensor group; plan "
            f"it with tensor width 1{zoo}"
        )
    from dapple.models.hf import hf_config

    config = hf_config(workload) if not workload.tp_plan else None
    for s, st in wide:
        if config is not None:
            _check_config(s, st, config, workload.name)
        else:
            _check_layers(s, st, workload, tp_plan)


def _what(s: int, st: StagePlan) -> str:
    return f"plan stage {s} {list(st.layers)} (tensor_width {st.tensor_width})"


def _check_config(s: int, st: StagePlan, config: Any, name: str) -> None:
    """t_s divides the config's heads, key/value heads and MLP hidden units."""
    t = st.tensor_width
    sizes = [(key, what, getattr(config, key, None)) for key, what in HF_CUT_SIZES]
    bad = [f"{n} {what}" for _, what, n in sizes if isinstance(n, int) and n % t]
    if bad:
        given = ", ".join(f"{key} {n}" for key, _, n in sizes if n is not None)
        hidden = getattr(config, "hidden_size", None)
        raise ValidationError(
            f"{_what(s, st)}: TP width {t} does not divide the {' or the '.join(bad)} of "
            f"model {name!r} ({given}, hidden_size {hidden})"
        )


def _check_layers(s: int, st: StagePlan, workload: Workload, tp_plan: dict[str, str]) -> None:
    """Build the stage's layers one at a time and check each the plan cuts as the runtime
    does; at least one must be cut."""
    from torch import fx

    from dapple.runtime.parallel.tp import check_width

    cut = 0
    for i in range(*st.layers):
        layer = workload.build_layer(i)
        try:
            if isinstance(layer, fx.GraphModule) and cut_by(layer, tp_plan):
                check_width(layer, tp_plan, st.tensor_width)
                cut += 1
        except ValidationError as e:
            raise ValidationError(f"{_what(s, st)}: layer {workload.name_of(i)}: {e}") from None
        del layer
        gc.collect()  # traced pieces hold reference cycles
    if not cut:
        raise ValidationError(
            f"{_what(s, st)}: the TP plan of model {workload.name!r} cuts none of its layers; "
            "give the stage tensor width 1 or layers that shard"
        )

"""Checks the Python API's running side makes before any worker starts, and the inputs of a
run it resolves (:mod:`dapple.api.running`, :mod:`dapple.api.verifying`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dapple.api._inputs import WorkloadLike
from dapple.core.cluster import Cluster
from dapple.core.plan import Plan
from dapple.errors import ValidationError
from dapple.models.workload import Workload

__all__ = ["check_host", "check_run", "dataset", "seq_overrides"]


def check_run(plan: Plan, wl: Workload, cluster: Cluster | None = None) -> None:
    """The plan was made for this model (:meth:`~dapple.core.plan.Plan.check_model`) and its
    tensor groups can cut it (:func:`dapple.runtime.parallel.tensor_check.check_tensor_run`)."""
    from dapple.runtime.parallel.tensor_check import check_tensor_run

    plan.check_model(wl.name, wl.num_layers)
    check_tensor_run(plan, wl, cluster)


def check_host(wl: Workload, device: str, optimizer: str, momentum: float, what: str) -> None:
    """What this host must have before any worker starts or layer is built: the device the
    run asks for (``cuda`` where torch sees none is refused once here, not by every worker:
    :func:`dapple.profiler.host_fit.check_device_available`); and, for a run whose processes
    all start on this host and compute on its CPU, the memory to hold the model once with
    gradients and optimizer state (:func:`dapple.profiler.host_fit.check_training_memory`).
    Under torchrun each host holds only its own ranks' stages: memory not checked."""
    import os

    from dapple.profiler.host_fit import check_device_available

    check_device_available(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    import torch

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return
    from dapple.profiler.host_fit import check_training_memory
    from dapple.runtime.train_config import OPTIMIZERS, state_factor

    if optimizer in OPTIMIZERS:  # another name is refused by the run's own checks
        check_training_memory(wl, state_factor(optimizer, momentum), what=what)


def seq_overrides(
    workload: WorkloadLike, overrides: Mapping[str, Any] | None, seq_len: int | None
) -> Mapping[str, Any] | None:
    """``overrides`` with ``seq=seq_len`` for a spec string (a built workload stays as is)."""
    if seq_len is None or not isinstance(workload, str):
        return overrides
    given = dict(overrides or {})
    if given.setdefault("seq", seq_len) != seq_len:
        raise ValidationError(f"overrides seq={given['seq']} disagrees with seq_len={seq_len}")
    return given


def dataset(data: Any, seq_len: int | None, documents: str | None = None) -> Any:
    """A dataset as given, or the token file (``documents``: the documents) at a path."""
    from dapple.api.run_config import open_run_data

    return None if data is None else open_run_data(data, seq_len, documents)

"""Python API: profile, plan, simulate, train and verify from a script or a notebook.

Every function takes the objects the CLI reads and writes (:class:`~dapple.core.profile.ModelProfile`,
:class:`~dapple.core.cluster.Cluster`, :class:`~dapple.core.plan.Plan`) or the paths of their JSON files,
and a model as a :class:`~dapple.models.workload.Workload` or a spec string (a zoo name,
``package.module:factory`` or ``path/to/file.py:factory``) with keyword ``overrides`` for the
factory (``--set KEY=VALUE`` and ``--split-at`` on the command line)::

    import dapple.api as dp

    prof = dp.profile("dapple.models.hf:gpt2", batch_sizes=[1, 2, 4], overrides={"layers": 2})
    plan = dp.plan(prof, "local-cpu", global_batch_size=8)
    print(dp.simulate(plan, prof, "local-cpu").step_ms)
    report = dp.verify(plan, "dapple.models.hf:gpt2", steps=2, overrides={"layers": 2})
    assert report.ok

A training run is also one typed configuration, :class:`~dapple.api.run_config.RunConfig`
(``dapple train``'s flags and a run file read into it, or ``dapple verify``'s flags):
``dp.train(cfg)`` runs it and ``dp.verify(cfg)`` checks it against one process; what it names
is loaded once by :func:`run_inputs` (:class:`RunInputs`), its plan under the schedule and
policy asked for by :func:`plan_with`. A plan is asked for by a
:class:`~dapple.planner.plan_config.PlanConfig` (``dapple plan``'s flags and a config file's
``[planning]`` section read into it): ``dp.plan(cfg)`` makes it, on what :func:`plan_inputs`
loads (:class:`PlanInputs`).

Workloads loaded from a spec (:func:`load`) pickle as their spec: spawned worker processes load
them again, so models defined in a ``file.py`` train and verify like installed ones.

A profile is asked for by a :class:`~dapple.api.profiling.ProfileConfig` (``dapple profile``'s
flags read into it): ``dp.profile(cfg)`` measures it, or counts it with ``analytic``.

A simulation is asked for by a :class:`~dapple.api.simulating.SimulateConfig` (``dapple
simulate``'s flags read into it): ``dp.simulate(cfg)``.

The functions live in :mod:`dapple.api.profiling` (profile), :mod:`dapple.api.planning`
(plan, plan_local), :mod:`dapple.api.simulating` (simulate), :mod:`dapple.api.running` (train,
generate) and :mod:`dapple.api.verifying` (verify, verify_many). They load on first use
(:pep:`562`), so a command that reads its configuration (:class:`~dapple.api.profiling.ProfileConfig`)
refuses a bad value without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dapple.api._inputs import PlanInputs, RunInputs, plan_inputs, plan_with, run_inputs
    from dapple.api.planning import plan, plan_local
    from dapple.api.profiling import ProfileConfig, profile
    from dapple.api.running import generate, train
    from dapple.api.simulating import SimulateConfig, simulate
    from dapple.api.verifying import verify, verify_many
    from dapple.models.spec import load

_HOMES = {
    "PlanInputs": "dapple.api._inputs",
    "RunInputs": "dapple.api._inputs",
    "plan_inputs": "dapple.api._inputs",
    "plan_with": "dapple.api._inputs",
    "run_inputs": "dapple.api._inputs",
    "plan": "dapple.api.planning",
    "plan_local": "dapple.api.planning",
    "SimulateConfig": "dapple.api.simulating",
    "simulate": "dapple.api.simulating",
    "ProfileConfig": "dapple.api.profiling",
    "profile": "dapple.api.profiling",
    "generate": "dapple.api.running",
    "train": "dapple.api.running",
    "verify": "dapple.api.verifying",
    "verify_many": "dapple.api.verifying",
    "load": "dapple.models.spec",
}


def __getattr__(name: str) -> Any:
    """A public name from its home module, or a submodule (``dapple.api.verifying``) as an
    attribute path names it before it was imported."""
    home = _HOMES.get(name)
    if home is not None:
        return getattr(importlib.import_module(home), name)
    try:
        return importlib.import_module(f"dapple.api.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"dapple.api.{name}":
            raise
        raise AttributeError(f"module 'dapple.api' has no attribute {name!r}") from None


__all__ = [
    "PlanInputs",
    "ProfileConfig",
    "RunInputs",
    "SimulateConfig",
    "generate",
    "load",
    "plan",
    "plan_inputs",
    "plan_local",
    "plan_with",
    "profile",
    "run_inputs",
    "simulate",
    "train",
    "verify",
    "verify_many",
]

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
policy asked for by :func:`plan_with`; :func:`check_outputs` refuses, before anything is
loaded, a metrics file or a TensorBoard or checkpoint directory rank 0 could not write. A plan
is asked for by a :class:`~dapple.planner.plan_config.PlanConfig` (``dapple plan``'s flags
and a config file's ``[planning]`` section read into it): ``dp.plan(cfg)`` makes it, on what
:func:`plan_inputs` loads (:class:`PlanInputs`).

Workloads loaded from a spec (:func:`load`) pickle as their spec: spawned worker processes load
them again, so models defined in a ``file.py`` train and verify like installed ones.

A profile is asked for by a :class:`~dapple.api.profiling.ProfileConfig` (``dapple profile``'s
flags read into it): ``dp.profile(cfg)`` measures it, or counts it with ``analytic``.

A simulation is asked for by a :class:`~dapple.api.simulating.SimulateConfig` (``dapple
simulate``'s flags read into it): ``dp.simulate(cfg)``.

The other commands each read their flags into a typed configuration too, which one function
takes: :class:`~dapple.api.generating.GenerateConfig` (``dp.generate(cfg)``),
:class:`~dapple.api.planning_local.PlanLocalConfig` (``dp.plan_local(cfg)``),
:class:`~dapple.api.calibrating.CalibrateConfig` (``dp.calibrate(cfg)``),
:class:`~dapple.api.profiling.ImportConfig` (``dp.import_pipedream(cfg)``),
:class:`~dapple.api.splitting.SplitConfig` (``dp.split(cfg)``),
:class:`~dapple.api.exporting.ExportConfig` (``dp.export(cfg)``) and
:class:`~dapple.api.preparing.PrepareConfig` (``dp.prepare_data(cfg)``).

The functions live in :mod:`dapple.api.profiling` (profile, import_pipedream),
:mod:`dapple.api.planning` (plan), :mod:`dapple.api.planning_local` (plan_local),
:mod:`dapple.api.simulating` (simulate),
:mod:`dapple.api.running` (train), :mod:`dapple.api.verifying` (verify, verify_many),
:mod:`dapple.api.generating` (generate), :mod:`dapple.api.calibrating` (calibrate),
:mod:`dapple.api.splitting` (split), :mod:`dapple.api.exporting` (export) and
:mod:`dapple.api.preparing` (prepare_data). They load on first use
(:pep:`562`), so a command that reads its configuration (:class:`~dapple.api.profiling.ProfileConfig`)
refuses a bad value without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dapple.api._checks import check_outputs
    from dapple.api._inputs import PlanInputs, RunInputs, plan_inputs, plan_with, run_inputs
    from dapple.api.calibrating import CalibrateConfig, calibrate
    from dapple.api.exporting import ExportConfig, export
    from dapple.api.generating import GenerateConfig, generate
    from dapple.api.planning import plan
    from dapple.api.planning_local import PlanLocalConfig, plan_local
    from dapple.api.preparing import PrepareConfig, prepare_data
    from dapple.api.profiling import ImportConfig, ProfileConfig, import_pipedream, profile
    from dapple.api.running import train
    from dapple.api.simulating import SimulateConfig, simulate
    from dapple.api.splitting import SplitConfig, split
    from dapple.api.verifying import verify, verify_many
    from dapple.models.spec import load

_HOMES = {
    "check_outputs": "dapple.api._checks",
    "PlanInputs": "dapple.api._inputs",
    "RunInputs": "dapple.api._inputs",
    "plan_inputs": "dapple.api._inputs",
    "plan_with": "dapple.api._inputs",
    "run_inputs": "dapple.api._inputs",
    "plan": "dapple.api.planning",
    "plan_local": "dapple.api.planning_local",
    "PlanLocalConfig": "dapple.api.planning_local",
    "SimulateConfig": "dapple.api.simulating",
    "simulate": "dapple.api.simulating",
    "ProfileConfig": "dapple.api.profiling",
    "profile": "dapple.api.profiling",
    "generate": "dapple.api.generating",
    "GenerateConfig": "dapple.api.generating",
    "ImportConfig": "dapple.api.profiling",
    "import_pipedream": "dapple.api.profiling",
    "SplitConfig": "dapple.api.splitting",
    "split": "dapple.api.splitting",
    "ExportConfig": "dapple.api.exporting",
    "export": "dapple.api.exporting",
    "PrepareConfig": "dapple.api.preparing",
    "prepare_data": "dapple.api.preparing",
    "CalibrateConfig": "dapple.api.calibrating",
    "calibrate": "dapple.api.calibrating",
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
    "CalibrateConfig",
    "ExportConfig",
    "GenerateConfig",
    "ImportConfig",
    "PlanInputs",
    "PlanLocalConfig",
    "PrepareConfig",
    "ProfileConfig",
    "RunInputs",
    "SimulateConfig",
    "SplitConfig",
    "calibrate",
    "check_outputs",
    "export",
    "generate",
    "import_pipedream",
    "load",
    "plan",
    "plan_inputs",
    "plan_local",
    "plan_with",
    "prepare_data",
    "profile",
    "run_inputs",
    "simulate",
    "split",
    "train",
    "verify",
    "verify_many",
]

"""The Python API's profiling side: one typed :class:`ProfileConfig` behind ``dapple profile``
and :func:`profile`.

``dapple profile``'s flags (the model also from a run file's ``[model]`` section) are read once
into a :class:`ProfileConfig`; ``profile(cfg)`` measures the model it names (or counts it, with
``analytic``), and the keyword form ``profile(workload, batch_sizes, ...)`` builds one and goes
down the same path: the same checks, the same measurement, the experts of a mixture of experts
measured apart. Torch loads with the measurement, not with this module: ``dapple profile``
reads its flags into a :class:`ProfileConfig` and refuses a bad value without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dapple.api.run_config import ModelConfig
from dapple.core.profile import ModelProfile
from dapple.core.recompute import RECOMPUTE_MODES, recompute_of
from dapple.errors import ValidationError, check_integer_fields, one_line
from dapple.files.output_path import check_output_file

if TYPE_CHECKING:
    from dapple.api._inputs import WorkloadLike
    from dapple.models.workload import Workload
    from dapple.profiler.measure import ProgressFn

__all__ = ["MAX_RUNS", "ImportConfig", "ProfileConfig", "import_pipedream", "profile"]

MAX_RUNS = 1000
"""The most timed (``repeats``) or untimed (``warmup``) runs per layer, batch size and length a
measured profile makes: 10^12 ran without end."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileConfig:
    """What ``dapple profile`` is asked for: the model, how to measure it (or count it), and
    the profile file to write."""

    model: ModelConfig
    """The model (``-m`` and its flags, or a run file's ``[model]`` section)."""
    output: str | None = None
    """The profile JSON to write (``dapple profile`` requires it)."""
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    """Batch sizes to time (the fit is affine in the batch size)."""
    seq_lens: tuple[int, ...] | None = None
    """Also measure at these lengths of the model's dynamic (sequence) dimension."""
    device: str = "auto"
    """The torch device a measured profile runs on."""
    repeats: int = 5
    """Timed runs per layer (median kept)."""
    warmup: int = 2
    """Untimed runs per layer first."""
    threads: int | None = 1
    """Torch threads when profiling on CPU (None: unchanged)."""
    co_workers: int = 1
    """CPU: profile as one of this many local workers sharing the cores."""
    precision: str | None = None
    """Autocast while measuring (None: fp32; analytic: the datasheet's 16-bit format)."""
    split_backward: bool = False
    """Also time each backward's input- and weight-gradient halves."""
    input_shape: tuple[int, ...] | None = None
    """Per-sample input shape for ``nn.Sequential`` factories (measured profiles)."""
    analytic: str | None = None
    """Count the layers and time them with this datasheet's roofline instead of measuring
    (``""``: asked for without a datasheet, refused)."""
    recompute: str = "none"
    """With ``analytic``: what every block re-computes in its backward
    (:data:`~dapple.core.recompute.RECOMPUTE_MODES`)."""
    kernels: str | None = None
    """With ``analytic``: the kernel setting whose fitted efficiencies time the layers
    (:data:`~dapple.profiler.analytic_devices.KERNEL_SETTINGS`: ``eager``, what dapple runs;
    ``fused``, compiled or fused kernels); None: the datasheet's default (``h200``: eager;
    the others: their own efficiencies)."""


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ProfileConfig)}
"""Each :class:`ProfileConfig` field's default."""


@overload
def profile(workload: ProfileConfig, *, progress: ProgressFn | None = None) -> ModelProfile: ...
@overload
def profile(
    workload: WorkloadLike,
    batch_sizes: Sequence[int] = (1, 2, 4),
    device: str = "auto",
    *,
    overrides: Mapping[str, Any] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    num_threads: int | None = 1,
    co_workers: int = 1,
    output: str | Path | None = None,
    precision: str = "fp32",
    split_backward: bool = False,
    seq_lens: Sequence[int] | None = None,
) -> ModelProfile: ...
def profile(
    workload: ProfileConfig | WorkloadLike,
    batch_sizes: Sequence[int] = (1, 2, 4),
    device: str = "auto",
    *,
    overrides: Mapping[str, Any] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    num_threads: int | None = 1,
    co_workers: int = 1,
    output: str | Path | None = None,
    precision: str = "fp32",
    split_backward: bool = False,
    seq_lens: Sequence[int] | None = None,
    progress: ProgressFn | None = None,
) -> ModelProfile:
    """Measure every layer of a model (``dapple profile``): ``profile(cfg)`` what a
    :class:`ProfileConfig` asks for (``dapple profile``'s flags read into it), or
    ``profile(workload, ...)`` what its keyword arguments ask for, down the same path.

    Args:
        workload: A :class:`ProfileConfig` (then only ``progress`` goes beside it), a
            :class:`Workload` or a spec string.
        batch_sizes: Batch sizes to time (the fit is affine in the batch size).
        device: ``auto`` (``cuda`` when available, else ``cpu``), ``cpu`` or ``cuda[:N]``.
        overrides: Factory keyword arguments when ``workload`` is a spec.
        repeats: Timed runs per layer and batch size (median kept).
        warmup: Untimed runs first.
        num_threads: Torch threads on CPU while profiling (``None``: unchanged).
        co_workers: CPU: profile as one of this many local workers sharing the cores (CPU
            time while the others train the model; see ``profile_workload``).
        output: Also save the profile JSON here.
        precision: ``fp32``, ``bf16`` or ``fp16`` autocast while measuring (recorded in the
            profile; the planner's memory model follows it).
        split_backward: Also time each backward's input- and weight-gradient halves
            (zero-bubble ``I`` and ``W``) as the runtime runs them, recorded as
            ``LayerProfile.backward_input`` and ``backward_weight``.
        seq_lens: Also measure at these lengths of the model's dynamic (sequence) dimension:
            its own batches cut or tiled to each length, same layers
            (:mod:`dapple.profiler.length_passes`); :func:`plan` with ``mean_seq_len`` interpolates
            between them in tokens.
        progress: ``progress(done, total, detail)`` of a measured profile: first ``(0, total,
            the model's name)`` once the model is built and the checks passed, then after
            each layer measured at a batch size and length.

    Raises:
        ValidationError: Bad model spec, batch sizes, device, precision, counts, or lengths (a
            model without a dynamic dimension, a length outside its range); an option of the
            other kind of profile (``recompute`` measured, timing counts analytic); more
            processes or a batch than this host's memory holds; with a ``ProfileConfig``, any
            keyword option beside it.
    """
    from dapple.api._inputs import as_workload

    if isinstance(workload, ProfileConfig):
        _only_config(locals())
        return _profile(workload, None, progress)
    spec = workload if isinstance(workload, str) else None
    cfg = ProfileConfig(
        model=ModelConfig(spec=spec, set=dict(overrides or {})),
        output=None if output is None else str(output), batch_sizes=tuple(batch_sizes),
        seq_lens=None if seq_lens is None else tuple(seq_lens), device=device, repeats=repeats,
        warmup=warmup, threads=num_threads, co_workers=co_workers, precision=precision,
        split_backward=split_backward,
    )  # fmt: skip
    given = workload
    return _profile(cfg, lambda: as_workload(given, overrides), progress)


def _only_config(given: dict[str, Any]) -> None:
    """``profile(cfg)`` takes its options from ``cfg``: none of the keyword form's beside it.

    Raises:
        ValidationError: naming those given.
    """
    import inspect

    params = inspect.signature(profile).parameters
    extra = [n for n, p in params.items()
             if n not in ("workload", "progress") and given[n] != p.default]  # fmt: skip
    if extra:
        raise ValidationError(
            f"profile(cfg) takes the profiling options from cfg, got also {', '.join(extra)}"
        )


def _profile(
    cfg: ProfileConfig,
    load: Callable[[], Workload] | None,
    progress: ProgressFn | None,
) -> ModelProfile:
    """The profile ``cfg`` asks for (of the workload ``load`` builds when given, else of
    ``cfg.model``); saved to ``cfg.output`` when given. ``cfg``'s options and the output file
    are checked before anything is built or measured."""
    check_mode_options(cfg)
    if cfg.output is not None:
        check_output_file(cfg.output, "output profile file")
    if cfg.analytic is not None:
        prof = _analytic(cfg)
    else:
        prof = _measured(cfg, None if load is None else load(), progress)
    if cfg.output is not None:
        prof.save(cfg.output)
    return prof


def _analytic(cfg: ProfileConfig) -> ModelProfile:
    """The profile from shapes and a datasheet
    (:func:`dapple.profiler.analytic.analytic_profile`), at one or several lengths.

    Raises:
        ValidationError: a torch device given, or no known datasheet.
    """
    from dapple.profiler.analytic import analytic_profile
    from dapple.profiler.analytic_devices import DEVICES

    names, sizes, lens = ", ".join(DEVICES), list(cfg.batch_sizes), cfg.seq_lens
    if cfg.device in DEVICES:  # the spelling before --analytic took the datasheet
        raise ValidationError(
            f"--device {cfg.device} is a datasheet: write --analytic {cfg.device} (--device is "
            "the torch device a measured profile runs on)"
        )
    if cfg.device != "auto":
        raise ValidationError(
            f"--device {cfg.device} applies to measured profiles; --analytic takes a datasheet "
            f"({names})"
        )
    if cfg.analytic not in DEVICES:
        got = f", got {cfg.analytic!r}" if cfg.analytic else ""
        raise ValidationError(f"--analytic takes a datasheet: {names}{got}")
    device = cfg.analytic
    overrides = cfg.model.overrides()
    precision = cfg.precision or DEVICES[device].default_precision

    def at(seq: int | None) -> ModelProfile:
        return analytic_profile(
            str(cfg.model.spec), device, precision=precision, seq_len=seq,
            recompute=cfg.recompute, batch_sizes=sizes, overrides=overrides, kernels=cfg.kernels,
        )  # fmt: skip

    if lens and len(set(lens)) > 1:
        from dapple.profiler.length_passes import combine_lengths

        return combine_lengths([(n, at(n)) for n in sorted(set(lens))])
    return at(lens[0] if lens else None)


def _measured(
    cfg: ProfileConfig, workload: Workload | None, progress: ProgressFn | None
) -> ModelProfile:
    """The profile measured with torch: the device resolved and the host's memory checked
    before the model is built and measured; a mixture of experts' experts measured apart."""
    from dapple.host.cpu_cores import usable_cores
    from dapple.models.zoo import load_workload
    from dapple.profiler.host_fit import (
        check_batch_memory,
        check_host_memory,
        check_local_processes,
    )
    from dapple.profiler.measure import profile_workload, resolve_device

    sizes = list(cfg.batch_sizes)
    dev = resolve_device(cfg.device)  # fail fast, before building the model
    cores = usable_cores()
    threads = cfg.threads
    if dev.type == "cpu" and threads is not None and not 1 <= threads <= cores:
        raise ValidationError(  # 10^5 threads crash torch
            f"--threads must be from 1 to the {cores} usable cores, got {threads}"
        )
    if workload is None:
        workload = load_workload(
            str(cfg.model.spec), input_shape=cfg.input_shape, **cfg.model.overrides()
        )
    held = max(1, cfg.co_workers) if dev.type == "cpu" else 1  # co-workers run on CPU only
    check_local_processes(held - 1, f"--co-workers {cfg.co_workers}", forked=True)
    check_host_memory(workload, held)  # before building any layer
    check_batch_memory(workload, max(sizes), f"--batch-sizes {','.join(map(str, sizes))}")
    if progress is not None:
        passes = len(set(cfg.seq_lens)) if cfg.seq_lens else 1
        progress(0, workload.num_layers * len(set(sizes)) * passes, workload.name)
    with _out_of_memory_said(sizes):
        prof = profile_workload(
            workload, sizes, device=cfg.device, warmup=cfg.warmup, repeats=cfg.repeats,
            progress=progress, num_threads=threads, co_workers=cfg.co_workers,
            precision=cfg.precision or "fp32", split_backward=cfg.split_backward,
            seq_lens=cfg.seq_lens,
        )  # fmt: skip
        return _with_measured_experts(cfg, workload, sizes, prof)


def check_mode_options(cfg: ProfileConfig) -> None:
    """Refuse, rather than ignore, an option of the other kind of profile: ``recompute`` is
    counted by ``analytic`` only; ``co_workers`` share the CPU of a measured profile only,
    and ``repeats``, ``warmup`` and ``threads`` (other than their defaults) time its
    layers. A measured profile's counts are checked here, before the model is built.

    Raises:
        ValidationError: naming the option (as ``dapple profile``'s flag) and the kind of
            profile it applies to, or a count out of range.
    """
    check_integer_fields(cfg)  # the keyword form passes counts through as given
    timing = (("--repeats", cfg.repeats, "repeats"), ("--warmup", cfg.warmup, "warmup"),
              ("--threads", cfg.threads, "threads"))  # fmt: skip
    if cfg.analytic is not None:
        for flag, value, name in timing:
            if value != _DEFAULTS[name]:
                raise ValidationError(
                    f"{flag} {value} applies to measured profiles only (it times the layers); "
                    "--analytic runs nothing"
                )
    elif not (1 <= cfg.repeats <= MAX_RUNS and 0 <= cfg.warmup <= MAX_RUNS):
        raise ValidationError(
            f"--repeats must be from 1 to {MAX_RUNS} (timed runs per layer) and --warmup from 0 "
            f"to {MAX_RUNS}, got {cfg.repeats} and {cfg.warmup}"
        )
    if cfg.co_workers < 1:
        raise ValidationError(f"--co-workers must be >= 1, got {cfg.co_workers}")
    recompute_of(cfg.recompute, "--recompute", RECOMPUTE_MODES)
    if cfg.analytic is None and cfg.recompute != "none":
        raise ValidationError(
            f"--recompute {cfg.recompute} applies to --analytic profiles only; a measured "
            "profile times each layer once (dapple train --recompute full re-computes the stages)"
        )
    _check_kernels(cfg)
    if cfg.analytic is not None and cfg.co_workers != 1:
        raise ValidationError(
            f"--co-workers {cfg.co_workers} applies to measured CPU profiles only; --analytic "
            "runs nothing"
        )


def _check_kernels(cfg: ProfileConfig) -> None:
    """Refuse a kernel setting without ``analytic`` (a measured profile times the kernels it
    runs) and one that is not a setting.

    Raises:
        ValidationError: naming the setting.
    """
    from dapple.profiler.analytic_devices import KERNEL_SETTINGS

    if cfg.kernels is None:
        return
    if cfg.analytic is None:
        raise ValidationError(
            f"--kernels {cfg.kernels} applies to --analytic profiles only; a measured profile "
            "times the kernels it runs"
        )
    if cfg.kernels not in KERNEL_SETTINGS:
        raise ValidationError(
            f"--kernels must be one of {', '.join(KERNEL_SETTINGS)}, got {cfg.kernels!r}"
        )


def _with_measured_experts(
    cfg: ProfileConfig, workload: Workload, sizes: list[int], prof: ModelProfile
) -> ModelProfile:
    """``prof`` with the router, experts and expert load of a Hugging Face mixture of experts
    measured apart (:mod:`dapple.profiler.moe_measure`); ``prof`` itself for a dense model."""
    from dapple.profiler.moe_measure import configured_experts, measure_moe, with_moe

    if not configured_experts(workload):
        return prof
    measured = measure_moe(workload, sizes, warmup=cfg.warmup, repeats=cfg.repeats,
                           device=cfg.device, num_threads=cfg.threads)  # fmt: skip
    return with_moe(prof, measured)


@contextlib.contextmanager
def _out_of_memory_said(sizes: list[int]) -> Iterator[None]:
    """A host allocation that fails while profiling (a batch too large for this host's memory)
    ends as one error line naming the batch sizes, not torch's traceback."""
    try:
        yield
    except RuntimeError as e:
        if "can't allocate memory" not in str(e):
            raise
        raise ValidationError(
            f"profiling at --batch-sizes {','.join(map(str, sizes))} ran out of host memory "
            f"({one_line(e)}): give smaller batch sizes"
        ) from e


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportConfig:
    """What ``dapple import-pipedream`` is asked for: a PipeDream profile and the profile file
    to write."""

    graph: str
    """PipeDream's ``graph.txt``."""
    output: str | None = None
    """The profile JSON to write (``dapple import-pipedream`` requires it; None: not saved)."""
    batch_size: int = 1
    """PipeDream's profiling batch size (times and activations are divided by it)."""
    name: str | None = None
    """The model's name (None: the graph's folder or file name)."""


def import_pipedream(cfg: ImportConfig) -> ModelProfile:
    """The per-sample profile of a PipeDream ``graph.txt``, its graph linearised
    (:func:`dapple.profiler.pipedream.import_pipedream`); saved to ``cfg.output`` when given.

    Raises:
        ValidationError: an unreadable file, a malformed line, a cycle, a bad batch size.
    """
    from dapple.profiler.pipedream import import_pipedream as read_graph

    prof = read_graph(cfg.graph, batch_size=cfg.batch_size, model_name=cfg.name)
    if cfg.output is not None:
        prof.save(cfg.output)
    return prof

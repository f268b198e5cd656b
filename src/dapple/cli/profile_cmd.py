"""``dapple profile``: measure a model's layers with torch (or count them, ``--analytic``) and
write a profile JSON.

The flags (the model also from ``--config FILE``'s ``[model]`` section) are read once into a
:class:`ProfileConfig`; :func:`run_config` profiles it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from dapple.cli._console import StepProgress, console, print_table
from dapple.cli._model_args import add_model_arguments
from dapple.cli._profile_config import add_profile_config_arguments, model_config_of
from dapple.cli._renamed import renamed
from dapple.cli._run_args import add_device_argument
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError, one_line
from dapple.profiler.analytic_devices import DEVICES
from dapple.profiler.analytic_ops import RECOMPUTE_MODES

if TYPE_CHECKING:
    from dapple.runtime.run_config import ModelConfig

__all__ = [
    "ProfileConfig",
    "parse_batch_sizes",
    "print_experts",
    "print_profile",
    "profile_config_of",
    "register",
    "run_config",
]


MAX_RUNS = 1000
"""The most timed (``--repeats``) or untimed (``--warmup``) runs per layer, batch size and
length a measured profile makes: 10^12 ran without end."""


def _lengths(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        lens = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise ValidationError(f"--seq-lens must be comma-separated integers, got {text!r}") from e
    if not lens or min(lens) < 1:
        raise ValidationError(f"--seq-lens must be positive integers, got {text!r}")
    return lens


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "profile", help="measure per-layer times and sizes of a model and write a profile JSON"
    )
    add_model_arguments(p)
    p.add_argument(
        "--batch-sizes", default="1,2,4", help="comma-separated batch sizes (default 1,2,4)"
    )
    p.add_argument(
        "--seq-lens",
        default=None,
        metavar="L,L,...",
        help="also measure at these lengths of the model's dynamic (sequence) dimension, each at "
        "every batch size: its batches cut or tiled to the length (the model must declare the "
        "dimension, e.g. --set seq_choices=[...]); `dapple plan --seq-len` then interpolates "
        "in tokens",
    )
    add_device_argument(p)
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help=f"timed runs per layer, median kept (1 to {MAX_RUNS}; default %(default)s; not "
        "with --analytic)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help=f"untimed runs per layer (0 to {MAX_RUNS}; default %(default)s; not with --analytic)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads when profiling on CPU (default 1: stable timings, one per process; "
        "not with --analytic)",
    )
    p.add_argument(
        "--co-workers",
        type=int,
        default=1,
        metavar="N",
        help="CPU: profile as one of N local workers sharing the cores (N-1 processes train "
        "the model meanwhile; times are CPU time); use the number of processes the plan "
        "will run (`dapple train` starts one per device of the plan)",
    )
    p.add_argument(
        "--precision",
        default=None,
        metavar="P",
        help="fp32, bf16 or fp16: time the layers and measure activations under this autocast, "
        "as `dapple train --precision` runs them (default fp32; --analytic: also fp8, default "
        "the datasheet's 16-bit format: bf16, fp16 on a V100)",
    )
    p.add_argument(
        "--split-backward",
        action="store_true",
        help="also time each backward's input- and weight-gradient halves (the zero-bubble I and "
        "W) as the zbh1 runtime runs them; without it an even split of layers with parameters "
        "is assumed",
    )
    p.add_argument(
        "--input-shape", help="per-sample input shape for nn.Sequential factories, e.g. 3,32,32"
    )
    p.add_argument(
        "--analytic",
        nargs="?",
        const="",
        default=None,
        metavar="DATASHEET",
        help="do not run the model: count each layer's FLOPs and bytes from its shapes and time "
        f"them with this GPU datasheet's roofline ({', '.join(DEVICES)}; -m a preset such as "
        "llama3-8b, llama3.1-405b, gpt3-175b, mixtral-8x7b, deepseek-v3, hf:DIR or a zoo "
        "transformer; --precision also "
        "accepts fp8; --recompute)",
    )
    p.add_argument(
        "--recompute",
        default="none",
        choices=RECOMPUTE_MODES,
        help="with --analytic: what every block re-computes in its backward (activation "
        "checkpointing): none, selective (the attention core) or full (the whole block) "
        "(default %(default)s)",
    )
    p.add_argument("--act-checkpoint", action=renamed("--recompute"), help=argparse.SUPPRESS)
    add_profile_config_arguments(p)  # the model from a run file's [model] section
    p.set_defaults(func=run)


def parse_batch_sizes(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``.

    Raises:
        ValidationError: empty, non-integer or non-positive entries.
    """
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise ValidationError(
            f"--batch-sizes must be comma-separated integers, got {text!r}"
        ) from e
    if not sizes or min(sizes) < 1:
        raise ValidationError(f"--batch-sizes must be positive integers, got {text!r}")
    return sizes


def _parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError as e:
        raise ValidationError(
            f"--input-shape must be comma-separated integers, got {text!r}"
        ) from e


def print_profile(con: Console, prof: ModelProfile) -> None:
    """Print the layers of ``prof`` as a rich table (times at the largest batch size; the
    layers holding the other copies of a layer's tied parameters, when there are any)."""
    b = max(prof.batch_sizes) if prof.batch_sizes else 1
    tied = any(ly.tied_parameter_bytes for ly in prof.layers)
    t = Table(
        title=f"{prof.model_name} on {prof.device}, {prof.precision} ({prof.num_layers} layers)"
    )
    for col in (
        "#",
        "layer",
        f"fwd ms (b={b})",
        f"bwd ms (b={b})",
        "out KB/sample",
        "kept KB/sample",
        "params",
        *(["tied with"] if tied else []),
    ):
        t.add_column(col, justify="left" if col == "layer" else "right")
    for i, ly in enumerate(prof.layers):
        t.add_row(
            str(i),
            ly.name,
            f"{ly.forward.at(b):.3f}",
            f"{ly.backward.at(b):.3f}",
            f"{ly.output_bytes_per_sample / 1024:.1f}",
            f"{ly.kept_activation_bytes_per_sample / 1024:.1f}",
            f"{ly.parameter_bytes // 4:,}"
            if prof.dtype == "float32"
            else f"{ly.parameter_bytes:,} B",
            *([", ".join(map(str, ly.tied_layers))] if tied else []),
        )
    print_table(con, t)


def print_experts(con: Console, prof: ModelProfile) -> None:
    """Print the mixture-of-experts layers of ``prof`` (nothing for a dense model): experts E
    and top-k, routed experts' MiB, tokens per expert per sample (mean, and the busiest
    expert's where measured), the router's and experts' shares of the forward."""
    rows = [(i, ly, ly.moe) for i, ly in enumerate(prof.layers) if ly.moe is not None]
    if not rows:
        return
    t = Table(title=f"{prof.model_name}: mixture-of-experts layers ({len(rows)})")
    for col in ("#", "layer", "E", "k", "experts MiB", "tokens/expert", "busiest", "router %",
                "experts %"):  # fmt: skip
        t.add_column(col, justify="left" if col == "layer" else "right")
    for i, ly, moe in rows:
        peak = moe.max_tokens_per_expert_per_sample
        router, experts = moe.router_time_share, moe.expert_time_share
        t.add_row(
            str(i), ly.name, str(moe.experts), str(moe.top_k),
            f"{moe.expert_parameter_bytes / 2**20:.1f}", f"{moe.tokens_per_expert_per_sample:g}",
            "-" if peak is None else f"{peak:g} ({moe.imbalance:.2f}x)",
            "-" if router is None else f"{100 * router[0]:.1f}",
            "-" if experts is None else f"{100 * experts[0]:.1f}",
        )  # fmt: skip
    print_table(con, t)


def print_lengths(con: Console, prof: ModelProfile) -> None:
    """Print the whole model's forward + backward time and kept bytes at each measured length
    and batch size, with the time per token."""
    t = Table(title=f"{prof.model_name}: whole model by length")
    for col in ("length", "batch", "tokens", "fwd+bwd ms", "us/token", "kept MiB"):
        t.add_column(col, justify="right")
    for x in prof.by_length:
        for b in prof.batch_sizes:
            ms = sum(ly.forward.at(b) + ly.backward.at(b) for ly in x.layers)
            kept = sum(ly.kept_activation_bytes_per_sample for ly in x.layers) * b
            n = b * x.seq_len
            t.add_row(
                f"{x.seq_len:g}", str(b), f"{n:g}", f"{ms:.3f}", f"{ms * 1e3 / n:.2f}",
                f"{kept / 2**20:.2f}",
            )  # fmt: skip
    print_table(con, t)


def _run_analytic(cfg: ProfileConfig) -> int:
    """``dapple profile --analytic``: the profile from shapes and a datasheet
    (:func:`dapple.profiler.analytic.analytic_profile`), at one or several lengths."""
    from dapple.profiler.analytic import analytic_profile

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
            recompute=cfg.recompute, batch_sizes=sizes, overrides=overrides,
        )  # fmt: skip

    if lens and len(set(lens)) > 1:
        from dapple.profiler.lengths import combine_lengths

        prof = combine_lengths([(n, at(n)) for n in sorted(set(lens))])
    else:
        prof = at(lens[0] if lens else None)
    con = console()
    print_profile(con, prof)
    print_experts(con, prof)
    if prof.by_length:
        print_lengths(con, prof)
    prof.save(cfg.output)
    con.print(
        f"wrote {cfg.output}: {prof.num_layers} layers, {prof.parameter_bytes // 4:,} parameters "
        f"(analytic, {prof.device})"
    )
    return 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfileConfig:
    """What ``dapple profile`` is asked for: the model, how to measure it (or count it), and
    the profile file to write."""

    model: ModelConfig
    """The model (``-m`` and its flags, or a run file's ``[model]`` section)."""
    output: str
    """The profile JSON to write."""
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
    threads: int = 1
    """Torch threads when profiling on CPU."""
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
    """With ``analytic``: what every block re-computes in its backward."""


def profile_config_of(args: argparse.Namespace) -> ProfileConfig | None:
    """The :class:`ProfileConfig` of ``dapple profile``'s flags (the model also from
    ``--config FILE``); with ``--print-config`` the model printed as TOML instead (None).

    Raises:
        ValidationError: a bad file or value, or no model at all.
    """
    model = model_config_of(args)
    if model is None:
        return None
    analytic = args.analytic is not None  # measured profiles only read --input-shape
    lens = _lengths(args.seq_lens)
    return ProfileConfig(
        model=model, output=args.output, batch_sizes=tuple(parse_batch_sizes(args.batch_sizes)),
        seq_lens=None if lens is None else tuple(lens), device=args.device, repeats=args.repeats,
        warmup=args.warmup, threads=args.threads, co_workers=args.co_workers,
        precision=args.precision, split_backward=args.split_backward,
        input_shape=None if analytic else _parse_shape(args.input_shape), analytic=args.analytic,
        recompute=args.recompute,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    cfg = profile_config_of(args)  # --config FILE's [model], --print-config
    return 0 if cfg is None else run_config(cfg)


def run_config(cfg: ProfileConfig) -> int:
    """Profile what ``cfg`` asks for, print the layers and write the profile (``dapple
    profile`` once its flags are read)."""
    from dapple.core.output_path import check_output_file

    check_output_file(cfg.output, "--output profile file")  # before any measuring
    _check_mode_options(cfg)
    if cfg.analytic is not None:
        return _run_analytic(cfg)
    sizes, lens = list(cfg.batch_sizes), cfg.seq_lens
    overrides = cfg.model.overrides()
    from dapple.core.cpu_cores import usable_cores
    from dapple.models.zoo import load_workload
    from dapple.profiler.host_fit import (
        check_batch_memory,
        check_host_memory,
        check_local_processes,
    )
    from dapple.profiler.measure import profile_workload, resolve_device

    dev = resolve_device(cfg.device)  # fail fast, before building the model
    cores = usable_cores()
    if dev.type == "cpu" and not 1 <= cfg.threads <= cores:  # 10^5 threads crash torch
        raise ValidationError(
            f"--threads must be from 1 to the {cores} usable cores, got {cfg.threads}"
        )
    workload = load_workload(str(cfg.model.spec), input_shape=cfg.input_shape, **overrides)
    held = max(1, cfg.co_workers) if dev.type == "cpu" else 1  # co-workers run on CPU only
    check_local_processes(held - 1, f"--co-workers {cfg.co_workers}", forked=True)
    check_host_memory(workload, held)  # before building any layer
    check_batch_memory(workload, max(sizes), f"--batch-sizes {','.join(map(str, sizes))}")
    con = console()
    passes = len(set(lens)) if lens else 1
    total = workload.num_layers * len(set(sizes)) * passes
    with (
        _out_of_memory_said(sizes),
        StepProgress(f"profile {workload.name}", total, console=con) as progress,
    ):
        prof = profile_workload(
            workload,
            sizes,
            device=cfg.device,
            warmup=cfg.warmup,
            repeats=cfg.repeats,
            progress=progress,
            num_threads=cfg.threads,
            co_workers=cfg.co_workers,
            precision=cfg.precision or "fp32",
            split_backward=cfg.split_backward,
            seq_lens=lens,
        )
        prof = _with_measured_experts(cfg, workload, sizes, prof)
    print_profile(con, prof)
    print_experts(con, prof)
    if prof.by_length:
        print_lengths(con, prof)
    prof.save(cfg.output)
    con.print(
        f"wrote {cfg.output}: {prof.num_layers} layers, {prof.parameter_bytes:,} parameter bytes"
    )
    return 0


def _check_mode_options(cfg: ProfileConfig) -> None:
    """Refuse, rather than ignore, an option of the other kind of profile: ``--recompute`` is
    counted by ``--analytic`` only; ``--co-workers`` share the CPU of a measured profile only,
    and ``--repeats``, ``--warmup`` and ``--threads`` (other than their defaults) time its
    layers. A measured profile's counts are checked here, before the model is built.

    Raises:
        ValidationError: naming the option and the kind of profile it applies to, or a count
            out of range.
    """
    timing = (("--repeats", cfg.repeats, "repeats"), ("--warmup", cfg.warmup, "warmup"),
              ("--threads", cfg.threads, "threads"))  # fmt: skip
    if cfg.analytic is not None:
        for flag, value, name in timing:
            if value != _PROFILE_DEFAULTS[name]:
                raise ValidationError(
                    f"{flag} {value} applies to measured profiles only (it times the layers); "
                    "--analytic runs nothing"
                )
    elif not (1 <= cfg.repeats <= MAX_RUNS and 0 <= cfg.warmup <= MAX_RUNS):
        raise ValidationError(
            f"--repeats must be from 1 to {MAX_RUNS} (timed runs per layer) and --warmup from 0 "
            f"to {MAX_RUNS}, got {cfg.repeats} and {cfg.warmup}"
        )
    if cfg.analytic is None and cfg.recompute != "none":
        raise ValidationError(
            f"--recompute {cfg.recompute} applies to --analytic profiles only; a measured "
            "profile times each layer once (dapple train --recompute re-computes the stages)"
        )
    if cfg.analytic is not None and cfg.co_workers != 1:
        raise ValidationError(
            f"--co-workers {cfg.co_workers} applies to measured CPU profiles only; --analytic "
            "runs nothing"
        )


_PROFILE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ProfileConfig)}
"""Each :class:`ProfileConfig` field's default."""


def _with_measured_experts(
    cfg: ProfileConfig, workload: Any, sizes: list[int], prof: ModelProfile
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

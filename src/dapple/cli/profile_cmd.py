"""``dapple profile``: measure a model's layers with torch (or count them, ``--analytic``) and
write a profile JSON.

The flags (the model also from ``--config FILE``'s ``[model]`` section) are read once into a
:class:`~dapple.api.profiling.ProfileConfig`; :func:`run_config` profiles it with
:func:`dapple.api.profile` and prints it.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from dapple.api.profiling import MAX_RUNS, ProfileConfig
from dapple.cli._console import StepProgress, console, print_table
from dapple.cli._model_args import add_model_arguments
from dapple.cli._profile_flags import add_profile_config_arguments, model_config_of
from dapple.cli._renamed import renamed
from dapple.cli._run_args import add_device_argument
from dapple.core.profile import ModelProfile
from dapple.core.recompute import RECOMPUTE_MODES
from dapple.errors import ValidationError
from dapple.profiler.analytic_devices import DEVICES, KERNEL_SETTINGS

if TYPE_CHECKING:
    pass

__all__ = [
    "parse_batch_sizes",
    "print_experts",
    "print_profile",
    "profile_config_of",
    "register",
    "run_config",
]


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
        "dimension, e.g. --set seq_choices=[...]); `dapple plan --mean-seq-len` then interpolates "
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
    p.add_argument(
        "--kernels",
        default=None,
        choices=KERNEL_SETTINGS,
        help="with --analytic: time the layers with the efficiencies fitted for eager PyTorch "
        "under autocast (eager: what dapple runs) or for fused/compiled kernels (fused: "
        "torchtitan, Megatron) on the measured H200 (h100, h200 only; default: h200 eager, "
        "other datasheets their own efficiencies; benchmarks/gpu_fit.md)",
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
        recompute=args.recompute, kernels=args.kernels,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    cfg = profile_config_of(args)  # --config FILE's [model], --print-config
    return 0 if cfg is None else run_config(cfg)


def run_config(cfg: ProfileConfig) -> int:
    """Profile what ``cfg`` asks for (:func:`dapple.api.profile`), print the layers and write
    the profile (``dapple profile`` once its flags are read)."""
    from dapple.api import profile
    from dapple.files.output_path import check_output_file

    assert cfg.output is not None  # -o is a required flag
    check_output_file(cfg.output, "--output profile file")  # before any measuring
    con = console()
    with contextlib.ExitStack() as shown:
        bar: list[StepProgress] = []

        def progress(done: int, total: int | None = None, detail: str | None = None) -> None:
            if not bar:  # the first call names the model built: the bar starts then
                bar.append(shown.enter_context(
                    StepProgress(f"profile {detail}", total, console=con)))  # fmt: skip
            else:
                bar[0](done, total, detail)

        prof = profile(cfg, progress=progress)
    print_profile(con, prof)
    print_experts(con, prof)
    if prof.by_length:
        print_lengths(con, prof)
    if cfg.analytic is not None:
        con.print(
            f"wrote {cfg.output}: {prof.num_layers} layers, {prof.parameter_bytes // 4:,} "
            f"parameters ({prof.device})"
        )
    else:
        con.print(
            f"wrote {cfg.output}: {prof.num_layers} layers, {prof.parameter_bytes:,} parameter "
            "bytes"
        )
    return 0

"""``dapple verify``: train a plan distributed and on one process from the same seed; compare.

Prints, per stage, the largest absolute and relative difference of its parameters (over all
replicas) from the single-process reference after N steps, and the loss of every step side by
side, with the global gradient norm (before clipping) of both runs. Exit code 0 when every
parameter is within the tolerances (``torch.testing.assert_close`` float32 defaults unless
``--rtol``/``--atol``) and every step's gradient norm within a relative 1e-4, 1 otherwise.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from dapple.cli._data_args import open_datasets, with_seq_len
from dapple.cli._model_args import model_overrides
from dapple.cli._optim_args import optim_options
from dapple.cli._run_args import add_run_arguments, load_run_plan

if TYPE_CHECKING:
    from dapple.runtime.verify import VerifyReport

__all__ = ["print_report", "register", "run"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "verify",
        help="check a plan's distributed training against a single-process run (same seed)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p, steps=2)
    p.add_argument(
        "--rtol", type=float, default=None, help="relative tolerance (default 1.3e-6; bf16: 1.6e-2)"
    )
    p.add_argument(
        "--atol", type=float, default=None, help="absolute tolerance (default 1e-5; bf16: 1e-3)"
    )
    p.set_defaults(func=run)


def _g(x: float) -> str:
    return f"{x:.3g}"


def print_report(con: Console, report: VerifyReport) -> None:
    """Print the per-stage parameter table and the per-step losses of ``report``."""
    plan = report.plan
    t = Table(
        title=(
            f"{report.model_name}: {plan.replication} ({plan.schedule}, policy {plan.policy}), "
            f"{report.options.get('steps')} steps {report.options.get('precision', 'fp32')} "
            + (f"zero stage {zero} " if (zero := report.options.get("zero_stage", 0)) else "")
            + f"vs {report.reference} "
            f"(rtol {report.rtol:g}, atol {report.atol:g})"
        )
    )
    for col in ("stage", "layers", "replicas", "#params", "max abs diff", "max rel diff", "ok"):
        t.add_column(col, justify="right" if col != "ok" else "center")
    for s in report.stages:
        t.add_row(
            str(s.stage),
            f"[{s.layers[0]}, {s.layers[1]})",
            str(s.replicas),
            f"{s.num_params:,}",
            _g(s.max_abs_diff),
            _g(s.max_rel_diff),
            "[green]ok[/green]" if s.ok else "[red]FAIL[/red]",
        )
    con.print(t)
    for s in report.stages:
        if not s.ok:
            con.print(f"stage {s.stage}: largest difference in {s.worst}")
    lt = Table(title="loss and global gradient norm (before clipping) per step")
    for col in ("step", "loss", "reference", "abs diff", "grad norm", "reference", "rel diff"):
        lt.add_column(col, justify="right")
    norms = report.grad_norms or (float("nan"),) * len(report.losses)
    ref_norms = report.reference_grad_norms or (float("nan"),) * len(report.losses)
    rows = zip(report.losses, report.reference_losses, norms, ref_norms, strict=True)
    for i, (a, b, n, rn) in enumerate(rows):
        rel = abs(n - rn) / abs(rn) if rn else abs(n - rn)
        lt.add_row(str(i), f"{a:.7f}", f"{b:.7f}", _g(abs(a - b)), f"{n:.7g}", f"{rn:.7g}", _g(rel))
    con.print(lt)
    if not report.grad_norms_ok:
        con.print(
            f"gradient norms differ from the reference by more than rtol {report.grad_norm_rtol:g}"
        )
    verdict = "[green]OK[/green]" if report.ok else "[red]MISMATCH[/red]"
    con.print(f"{verdict}: largest parameter difference {_g(report.max_abs_diff)}")


def run(args: argparse.Namespace) -> int:
    from dapple.api import verify

    overrides = with_seq_len(args, model_overrides(args))
    data, _ = open_datasets(args)
    tol = {k: v for k, v in (("rtol", args.rtol), ("atol", args.atol)) if v is not None}
    report = verify(
        load_run_plan(args),
        args.model,
        args.steps,
        overrides=overrides,
        seed=args.seed,
        optimizer=args.optimizer,
        lr=args.lr,
        device=args.device,
        timeout_s=args.timeout_s,
        data=data,
        precision=args.precision,
        **tol,
        **optim_options(args),
    )
    print_report(Console(), report)
    return 0 if report.ok else 1

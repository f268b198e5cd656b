"""``dapple verify``: train a plan distributed and check it step by step against one process.

At every step the one-process reference starts from the distributed run's weights: every rank's
gradients must match the reference's on those weights (to ``--grad-rtol`` of their layer's
largest gradient), and every replica's weights after the update must match the reference
optimizer's update with the same gradients (``--rtol``/``--atol``); losses and global gradient
norms must match to a relative 1e-4. Prints, per stage, the largest gradient and weight
differences over all replicas and steps, the losses and norms of every step side by side, and
the first check out of tolerance. Exit code 0 when everything is within tolerance, 1 otherwise.

The flags are read once into the run's :class:`~dapple.api.run_config.RunConfig` (as
``dapple train``'s) and the tolerances given; :func:`dapple.api.verify` runs that.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from dapple.cli._config_args import record_given_flags
from dapple.cli._console import console, plain_doc, print_table
from dapple.cli._run_args import add_run_arguments
from dapple.cli._train_flags import verify_config_of

if TYPE_CHECKING:
    from dapple.api.run_config import RunConfig
    from dapple.runtime.verify import VerifyReport

__all__ = ["print_report", "register", "run", "run_config"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "verify",
        help="check a plan's distributed training against a single-process run (same seed)",
        description=plain_doc(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p, steps=2)
    p.add_argument(
        "--rtol", type=float, default=None,
        help="relative tolerance of a weight after an update from the same gradients "
        "(default 1.3e-6)",
    )  # fmt: skip
    p.add_argument(
        "--atol", type=float, default=None,
        help="absolute tolerance of a weight after such an update (default 1e-5)",
    )  # fmt: skip
    p.add_argument(
        "--grad-rtol", type=float, default=None,
        help="tolerance of a gradient element as a fraction of its layer's largest "
        "(default 1e-4; bf16: 1.6e-2)",
    )  # fmt: skip
    record_given_flags(p)
    p.set_defaults(func=run)


def _g(x: float) -> str:
    return f"{x:.3g}"


def print_report(con: Console, report: VerifyReport) -> None:
    """Print the per-stage table, the per-step losses and norms, and the verdict."""
    plan = report.plan
    t = Table(
        title=(
            f"{report.model_name}: {plan.replication} ({plan.schedule}, policy {plan.policy}), "
            f"{report.options.get('steps')} steps {report.options.get('precision', 'fp32')} "
            + (f"zero stage {zero} " if (zero := report.options.get("zero_stage", 0)) else "")
            + f"vs {report.reference}, step by step (gradients within {report.grad_rtol:g} of "
            f"their layer's scale; weights after each update rtol {report.rtol:g}, "
            f"atol {report.atol:g})"
        )
    )
    for col in ("stage", "layers", "replicas", "#params", "gradient diff / scale",
                "weight abs diff", "weight rel diff", "ok"):  # fmt: skip
        t.add_column(col, justify="right" if col != "ok" else "center")
    for s in report.stages:
        good = s.ok and s.grad_ok
        t.add_row(
            str(s.stage),
            f"[{s.layers[0]}, {s.layers[1]})",
            str(s.replicas),
            f"{s.num_params:,}",
            _g(s.max_grad_diff),
            _g(s.max_abs_diff),
            _g(s.max_rel_diff),
            "[green]ok[/green]" if good else "[red]FAIL[/red]",
        )
    print_table(con, t)
    lt = Table(title="loss and global gradient norm (before clipping) per step, both runs")
    for col in ("step", "loss", "reference", "abs diff", "grad norm", "reference", "rel diff"):
        lt.add_column(col, justify="right")
    norms = report.grad_norms or (float("nan"),) * len(report.losses)
    ref_norms = report.reference_grad_norms or (float("nan"),) * len(report.losses)
    rows = zip(report.losses, report.reference_losses, norms, ref_norms, strict=True)
    for i, (a, b, n, rn) in enumerate(rows):
        rel = abs(n - rn) / abs(rn) if rn else abs(n - rn)
        lt.add_row(str(i), f"{a:.7f}", f"{b:.7f}", _g(abs(a - b)), f"{n:.7g}", f"{rn:.7g}", _g(rel))
    print_table(con, lt)
    for line in report.failures:
        con.print(f"first out of tolerance: {line}", markup=False)
    verdict = "[green]OK[/green]" if report.ok else "[red]MISMATCH[/red]"
    con.print(
        f"{verdict}: largest gradient difference {_g(report.max_grad_diff)} of its layer's "
        f"scale, largest weight difference after an update {_g(report.max_abs_diff)}"
    )


def run(args: argparse.Namespace) -> int:
    given = (("rtol", args.rtol), ("atol", args.atol), ("grad_rtol", args.grad_rtol))
    return run_config(verify_config_of(args), {k: v for k, v in given if v is not None})


def run_config(cfg: RunConfig, tolerances: dict[str, Any]) -> int:
    """Verify the run ``cfg`` asks for with the ``tolerances`` given (``dapple verify`` once its
    flags are read); its inputs are loaded here, their messages naming the flags."""
    from dapple.api import run_inputs, verify

    report = verify(cfg, inputs=run_inputs(cfg, cli=True), **tolerances)
    print_report(console(), report)
    return 0 if report.ok else 1

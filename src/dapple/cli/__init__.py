"""``dapple`` command line: one sub-module per command, each exposing ``register(subparsers)``.

Errors derived from :class:`dapple.errors.DappleError` (and bad files) are printed as one line
``dapple: error: ...`` with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dapple.cli._file_roles import refuse_input_overwrite
from dapple.errors import DappleError
from dapple.host.host_memory import keep_freed_memory
from dapple.host.parent_death import end_with_parent
from dapple.log_lines import LogLines, use_log_lines

__all__ = ["LogLines", "build_parser", "main"]

# Each module defines ``register(sub: argparse._SubParsersAction) -> None`` and sets
# ``func=callable(args) -> int`` on its parser.
_COMMANDS: list[str] = [
    "dapple.cli.simulate_cmd",
    "dapple.cli.calibrate_cmd",
    "dapple.cli.demo_cmd",
    "dapple.cli.profile_cmd",
    "dapple.cli.import_cmd",
    "dapple.cli.train_cmd",
    "dapple.cli.split_cmd",
    "dapple.cli.plan_cmd",
    "dapple.cli.plan_local_cmd",
    "dapple.cli.verify_cmd",
    "dapple.cli.export_cmd",
    "dapple.cli.generate_cmd",
    "dapple.cli.data_cmd",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dapple",
        description=(
            "Plan, simulate and run synchronous pipeline + data parallel training (DAPPLE)."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def end_with_torchrun_agent() -> None:
    """Under ``torchrun`` (its ``TORCHELASTIC_RUN_ID`` set): end when the elastic agent that
    started this process ends, however it ends - a SIGKILLed ``torchrun`` leaves no rank
    training on its own."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        end_with_parent(os.getppid())


def main(argv: list[str] | None = None) -> int:
    end_with_torchrun_agent()
    parser = build_parser()
    args = parser.parse_args(argv)
    use_log_lines(verbose=args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    keep_freed_memory()  # profiles measure steps as the CPU ranks run them
    try:
        refuse_input_overwrite(args)
        rc = args.func(args)
    except DappleError as e:
        if "TORCHELASTIC_RUN_ID" in os.environ:  # one rank of a torchrun job: its one line
            from dapple.runtime.launch.refusal import end_refused

            end_refused(e)
        print(f"dapple: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        # a launcher's closing line says it all
        local = sys.modules.get("dapple.runtime.launch.local")
        if local is None or not isinstance(e, local.Interrupted):
            print("dapple: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)

"""``dapple import-pipedream``: convert a PipeDream ``graph.txt`` into a profile JSON."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "import-pipedream", help="convert a PipeDream graph.txt profile into a dapple profile JSON"
    )
    p.add_argument("graph", help="PipeDream graph.txt")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.add_argument(
        "--batch-size", type=int, default=1, help="PipeDream's profiling batch size (default 1)"
    )
    p.add_argument("--name", help="model name (default: the graph's folder or file name)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dapple.cli._console import console
    from dapple.cli.profile_cmd import print_profile
    from dapple.core.output_path import check_output_file
    from dapple.profiler.pipedream import import_pipedream

    check_output_file(args.output, "--output profile file")
    prof = import_pipedream(args.graph, batch_size=args.batch_size, model_name=args.name)
    con = console()
    print_profile(con, prof)
    prof.save(args.output)
    con.print(f"wrote {args.output}: {prof.num_layers} layers (linearised PipeDream graph)")
    return 0

"""``dapple import-pipedream``: convert a PipeDream ``graph.txt`` into a profile JSON.

The flags are read once into a :class:`~dapple.api.profiling.ImportConfig`; :func:`run_config`
converts it (:func:`dapple.api.import_pipedream`) and prints the profile.
"""

from __future__ import annotations

import argparse

from dapple.api.profiling import ImportConfig

__all__ = ["import_config_of", "register", "run_config"]


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


def import_config_of(args: argparse.Namespace) -> ImportConfig:
    """The :class:`~dapple.api.profiling.ImportConfig` of ``dapple import-pipedream``'s flags."""
    return ImportConfig(
        graph=args.graph, output=args.output, batch_size=args.batch_size, name=args.name
    )


def run(args: argparse.Namespace) -> int:
    return run_config(import_config_of(args))


def run_config(cfg: ImportConfig) -> int:
    """Convert the graph ``cfg`` names (:func:`dapple.api.import_pipedream`, which writes the
    profile), print its layers and say what was written (``dapple import-pipedream`` once its
    flags are read)."""
    from dapple import api
    from dapple.cli._console import console
    from dapple.cli.profile_cmd import print_profile
    from dapple.files.output_path import check_output_file

    assert cfg.output is not None  # -o is a required flag
    check_output_file(cfg.output, "--output profile file")
    prof = api.import_pipedream(cfg)
    con = console()
    print_profile(con, prof)
    con.print(f"wrote {cfg.output}: {prof.num_layers} layers (linearised PipeDream graph)")
    return 0

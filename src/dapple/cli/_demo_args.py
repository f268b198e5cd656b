"""``dapple demo``'s arguments, checked before anything is written or measured: a run that
would be refused 30-50 s in (after the profile and calibration), or leave a partial
``--out-dir`` behind, is refused in one line at once."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from dapple.core.output_path import check_output_dir
from dapple.errors import ValidationError

__all__ = ["DEMO_MARKER", "check_demo_args"]

DEMO_MARKER = ".dapple-demo"
"""The file the demo writes first into its ``--out-dir``: a directory holding it (or the
``summary.json`` of a finished demo) is the demo's own, whose outputs a new run replaces."""


def check_demo_args(args: argparse.Namespace) -> Path:
    """Check the demo's counts, corpus size and output directory (whose ``checkpoints`` the
    demo starts over in: a checkpoint directory there holding files dapple did not write is
    refused, and so is any other non-empty directory the demo did not make); returns
    ``--out-dir``.

    Raises:
        ValidationError: naming the first offending flag and its value.
    """
    if args.nproc < 3:
        raise ValidationError(
            f"--nproc {args.nproc}: the demo runs a pipeline with uneven replication, which "
            "needs at least 3 processes (2:1)"
        )
    from dapple.profiler.host_fit import check_local_processes  # imports torch: not at --help

    check_local_processes(args.nproc, f"--nproc {args.nproc}")
    for flag, value in (
        ("--steps", args.steps),
        ("--global-batch-size", args.global_batch_size),
        ("--seq-len", args.seq_len),
    ):
        if value < 1:
            raise ValidationError(f"{flag} must be >= 1, got {value}")
    if not (math.isfinite(args.corpus_mib) and args.corpus_mib > 0):
        raise ValidationError(f"--corpus-mib must be a number > 0, got {args.corpus_mib}")
    corpus = _corpus_bytes(args.corpus_mib)  # bytes at most, one token each
    need = args.global_batch_size * args.seq_len + 1
    if need > corpus:  # not one global batch of training samples: refused, never wrongly
        raise ValidationError(
            f"--global-batch-size {args.global_batch_size} x --seq-len {args.seq_len} needs "
            f"{need:,} tokens, more than the {corpus:,} tokens (bytes) of --corpus-mib "
            f"{args.corpus_mib:g}"
        )
    out = check_output_dir(args.out_dir, "--out-dir")
    from dapple.runtime.checkpoint import refuse_foreign

    refuse_foreign(out / "checkpoints", "give the demo another --out-dir")  # it starts over there
    _refuse_a_users_dir(out)
    return out


def _corpus_bytes(mib: float) -> int:
    """The bytes of ``--corpus-mib`` ``mib``, at most what the standard library's sources hold.

    Raises:
        ValidationError: ``mib`` above what they hold (the demo would take less, unsaid).
    """
    from dapple.cli._demo_corpus import stdlib_files

    root, files = stdlib_files()
    held = sum(p.stat().st_size for p in files)
    if mib * 2**20 > held:
        raise ValidationError(
            f"--corpus-mib {mib:g} is more than this machine's Python standard library sources "
            f"hold: {held / 2**20:.2f} MiB in {len(files)} files under {root}; give at most "
            f"{math.floor(held / 2**20 * 100) / 100:g}"
        )
    return int(mib * 2**20)


def _refuse_a_users_dir(out: Path) -> None:
    """A non-empty ``--out-dir`` the demo did not make is refused: the demo writes
    ``plan.json``, ``profile.json``, ``data/train.bin`` ... there, over whatever has the name.

    Raises:
        ValidationError: naming the directory and a few of its entries.
    """
    if not out.is_dir() or (out / DEMO_MARKER).exists() or (out / "summary.json").is_file():
        return
    held = sorted(p.name for p in out.iterdir())
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise ValidationError(
            f"--out-dir '{out}' holds files the demo did not write ({shown}); the demo writes "
            "plan.json, profile.json, data/ ... there: give a new or empty directory"
        )

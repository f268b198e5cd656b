"""``dapple demo``'s arguments, checked before anything is written or measured: a run that
would be refused 30-50 s in (after the profile and calibration), or leave a partial
``--out-dir`` behind, is refused in one line at once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dapple.errors import ValidationError
from dapple.files.output_path import check_output_dir

__all__ = ["DEMO_MARKER", "DemoConfig", "check_demo_args"]

DEMO_MARKER = ".dapple-demo"
"""The file the demo writes first into its ``--out-dir``: a directory holding it (or the
``summary.json`` of a finished demo) is the demo's own, whose outputs a new run replaces."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """What ``dapple demo`` is asked for (its flags, with their defaults)."""

    out_dir: str = "out/demo"
    """Everything the demo writes goes here."""
    nproc: int = 4
    """Local processes (devices), at least 3: the demo trains an uneven pipeline."""
    steps: int = 240
    """Training steps."""
    global_batch_size: int = 16
    """Samples per step."""
    seq_len: int = 64
    """Tokens (bytes) per sample; the model is built with ``seq`` of it."""
    corpus_mib: float = 2.0
    """MiB of standard library sources to train on."""
    model: str = "transformer"
    """The model spec (the default: the zoo transformer at :data:`~dapple.cli.demo_cmd.
    DEMO_MODEL`'s sizes)."""


def check_demo_args(cfg: DemoConfig) -> Path:
    """Check the demo's counts, corpus size and output directory (whose ``checkpoints`` the
    demo starts over in: a checkpoint directory there holding files dapple did not write is
    refused, and so is any other non-empty directory the demo did not make); returns
    ``--out-dir``.

    Raises:
        ValidationError: naming the first offending flag and its value.
    """
    if cfg.nproc < 3:
        raise ValidationError(
            f"--nproc {cfg.nproc}: the demo runs a pipeline with uneven replication, which "
            "needs at least 3 processes (2:1)"
        )
    from dapple.profiler.host_fit import check_local_processes  # imports torch: not at --help

    check_local_processes(cfg.nproc, f"--nproc {cfg.nproc}")
    for flag, value in (
        ("--steps", cfg.steps),
        ("--global-batch-size", cfg.global_batch_size),
        ("--seq-len", cfg.seq_len),
    ):
        if value < 1:
            raise ValidationError(f"{flag} must be >= 1, got {value}")
    if not (math.isfinite(cfg.corpus_mib) and cfg.corpus_mib > 0):
        raise ValidationError(f"--corpus-mib must be a number > 0, got {cfg.corpus_mib}")
    corpus = _corpus_bytes(cfg.corpus_mib)  # bytes at most, one token each
    need = cfg.global_batch_size * cfg.seq_len + 1
    if need > corpus:  # not one global batch of training samples: refused, never wrongly
        raise ValidationError(
            f"--global-batch-size {cfg.global_batch_size} x --seq-len {cfg.seq_len} needs "
            f"{need:,} tokens, more than the {corpus:,} tokens (bytes) of --corpus-mib "
            f"{cfg.corpus_mib:g}"
        )
    out = check_output_dir(cfg.out_dir, "--out-dir")
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

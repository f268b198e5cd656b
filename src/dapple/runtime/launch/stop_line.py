"""The closing line of a run its launcher stopped on SIGTERM or SIGINT: the last step logged and
the checkpoint to resume from."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["last_logged_step", "stop_line"]


def last_logged_step(metrics_path: str | None) -> int | None:
    """The step of the last step record of a metrics file (JSON lines), None without one."""
    if not metrics_path or not Path(metrics_path).is_file():
        return None
    step = None
    with open(metrics_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                d = json.loads(line)
            except ValueError:  # a line cut by the stop
                continue
            if isinstance(d, dict) and "event" not in d and isinstance(d.get("step"), int):
                step = d["step"]
    return step


def stop_line(signal_name: str, metrics_path: str | None, checkpoint_dir: str | None) -> str:
    """``dapple: stopped by SIGTERM after step N; last checkpoint: step K (DIR), resume with
    --resume`` - the parts the run can tell (no step without a metrics file)."""
    text = f"dapple: stopped by {signal_name}"
    step = last_logged_step(metrics_path)
    if step is not None:
        text += f" after step {step}"
    if checkpoint_dir is None:
        return text + "; nothing saved (no --checkpoint-dir)"
    from dapple.runtime.checkpoint.files import latest_checkpoint

    try:
        ck = latest_checkpoint(checkpoint_dir)
    except Exception:  # a damaged directory: the closing line still comes
        ck = None
    if ck is None:
        return text + f"; no complete checkpoint in {checkpoint_dir}"
    return text + f"; last checkpoint: step {ck.step} ({ck.path}), resume with --resume"

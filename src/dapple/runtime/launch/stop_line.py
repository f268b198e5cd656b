"""The closing line of a run its launcher stopped on SIGTERM or SIGINT: the last step logged and
the checkpoint to resume from; and :class:`RunClosing`, the same for a run of several launches."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["RunClosing", "last_logged_step", "stop_line"]


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


class RunClosing:
    """SIGTERM to a run of several launches (an elastic run: its attempts and the re-plans
    between them), which the default handler would end at once, inside the ``with`` block of
    ``folder``: write the run's closing line (``line(signal name)``), remove ``folder``, then
    deliver the signal again under the default handler, so the process still dies of it.

    A launch waiting inside it (:class:`~dapple.runtime.launch.local.StopSignals`) notes the
    signal, stops its workers, writes its own closing line, sets :attr:`said` and delivers the
    signal again - here, where only ``folder`` then goes: one closing line either way.
    Installed only in the main thread, and only over the default handler (a handler of the
    caller's own returns or raises through the ``with`` blocks, which remove their folders).
    """

    def __init__(self, folder: str, line: Callable[[str], str]) -> None:
        self.folder = folder
        self._line = line
        self.said = False
        """A launch inside wrote the closing line already."""
        self._installed = False

    def __enter__(self) -> RunClosing:
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        ):
            signal.signal(signal.SIGTERM, self)
            self._installed = True
        return self

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if not self.said:
            sys.stdout.flush()
            os.write(2, (self._line(signal.Signals(signum).name) + "\n").encode())
        shutil.rmtree(self.folder, ignore_errors=True)
        signal.signal(signum, signal.SIG_DFL)
        self._installed = False
        signal.raise_signal(signum)

    def __exit__(self, *exc: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._installed = False

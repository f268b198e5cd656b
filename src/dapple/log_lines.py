"""dapple's log records as the command line prints them: a warning is one ``dapple: warning:
...`` line, as the commands' own; other records name their level and logger (``--verbose``).

The CLI sets this up in its process (:func:`use_log_lines`), and so does every worker process
the runtime starts (:mod:`dapple.runtime.launch.local`), whose warnings (a checkpoint folder
kept by ``--keep``, a damaged checkpoint passed over) would otherwise reach stderr bare.
Importable from anywhere, as :mod:`dapple.errors`.
"""

from __future__ import annotations

import logging

__all__ = ["LogLines", "use_log_lines"]


class LogLines(logging.Formatter):
    """The command line's log lines: a warning reads as the commands' own (``dapple: warning:
    ...``, one line); other records name their level and logger."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.WARNING:
            return f"dapple: warning: {record.getMessage()}"
        return super().format(record)


def use_log_lines(*, verbose: bool = False) -> None:
    """Log through one stderr handler formatted by :class:`LogLines`: warnings and above, or
    everything with ``verbose``. A process whose root logger has a handler already keeps it
    (:func:`logging.basicConfig`)."""
    lines = logging.StreamHandler()
    lines.setFormatter(LogLines())
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[lines])

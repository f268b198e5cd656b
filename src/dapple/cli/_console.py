"""What the CLI prints, readable in a terminal and in a log file alike.

- :func:`console`: the console every command prints through. Off a terminal (a pipe, a log
  file) rich would wrap every line at 80 columns; there lines are kept whole instead.
- :func:`print_table`: prints a ``rich`` table with no cell ever cut to an ellipsis: in a
  terminal too narrow for it, its cells wrap (``overflow="fold"``); off a terminal the table
  is printed as wide as its longest cells need, however wide that is.
- :class:`StepProgress`: the progress of a long loop. In a terminal a transient ``rich``
  progress bar; off a terminal plain lines, as torchtitan logs its steps::

      profile: 3/12 (b=2 transformer.h.2) 25% elapsed 4.1 s eta 12.3 s

  one at the start, then at most one per ``interval_s`` (also while one step outlasts the
  interval: a heartbeat repeats the last state with the time elapsed), and a closing
  ``profile: done 12/12 in 16.4 s``.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

__all__ = [
    "PLAIN_INTERVAL_S",
    "StepProgress",
    "console",
    "format_seconds",
    "plain_doc",
    "print_table",
]

PLAIN_INTERVAL_S = 5.0
"""Off a terminal, the fewest seconds between two progress lines of one :class:`StepProgress`."""
_UNBOUNDED = 1 << 20
"""A width no table reaches: the bound its natural width is measured under."""


def console(*, stderr: bool = False) -> Console:
    """The console a command prints through (``stderr``: to stderr, e.g. progress beside a
    command whose stdout is its result): ``rich``'s own in a terminal; off one, lines are not
    wrapped (``soft_wrap``) so a log holds one line per message."""
    con = Console(stderr=stderr)
    if not con.is_terminal:
        con.soft_wrap = True
    return con


_default_console = console  # StepProgress's ``console`` argument hides the function


def print_table(con: Console, table: Table) -> None:
    """Print ``table`` on ``con`` with every cell whole (module docstring): its columns wrap
    rather than cut, and off a terminal ``con`` is widened to the table's natural width while
    the table prints."""
    for column in table.columns:
        column.overflow = "fold"
    if con.is_terminal:
        con.print(table)
        return
    natural = con.measure(table, options=con.options.update_width(_UNBOUNDED)).maximum
    width = con.width
    con.width = max(width, natural)
    try:
        con.print(table)
    finally:
        con.width = width


def format_seconds(s: float) -> str:
    """``4.1 s``, ``12m05s``, ``2h03m``; ``?`` when unknown (not finite)."""
    if not math.isfinite(s):
        return "?"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


class StepProgress:
    """The progress of a long loop: a ``rich`` bar in a terminal, plain lines off one (module
    docstring). A context manager; the object is itself the loop's
    ``progress(done, total, detail)`` callback (``total`` and ``detail`` optional: a
    ``progress(done, total)`` callback too).

    Example::

        with StepProgress("profile", total=12, console=con) as bar:
            profile_workload(..., progress=bar)
    """

    def __init__(
        self,
        what: str,
        total: int | None = None,
        *,
        detail: str = "",
        console: Console | None = None,
        interval_s: float = PLAIN_INTERVAL_S,
        delay_s: float = 0.0,
        heartbeat: bool = True,
        after: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args:
        what: what runs (``profile``, ``calibrate``), the start of every line.
        total: steps in all (None: unknown; lines then show the time elapsed only).
        detail: what the current step is (each call may replace it).
        console: where to print (default: :func:`console`).
        interval_s: off a terminal, the fewest seconds between two progress lines.
        delay_s: show nothing before this many seconds (a loop that ends sooner prints
            nothing at all).
        heartbeat: off a terminal, repeat the last state every ``interval_s`` while no step
            ends; on one, bring the bar's ETA up to date every second (a thread); without it
            lines and the bar change on the calls only.
        after: what still runs once the last of ``total`` steps is done (e.g. a search's
            refinement); from then on lines and the bar say it, with the steps done, the time
            elapsed and no percentage or ETA (the work left is unknown). Empty: nothing runs
            after the last step.
        clock: seconds, monotonic (tests pass a fake one).
        """
        self.what = what
        self.total = total
        self.detail = detail
        self.done = 0
        self._con = console if console is not None else _default_console()
        self._interval_s = interval_s
        self._delay_s = delay_s
        self._heartbeat = heartbeat
        self._after = after
        self._clock = clock
        self._plain = not self._con.is_terminal
        self._lock = threading.Lock()
        self._start = 0.0
        self._last_line = -math.inf  # when the last plain line printed
        self._shown = False  # a line or the bar has been shown
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the context ----------------------------------------------------------------------------
    def __enter__(self) -> StepProgress:
        self._start = self._clock()
        self._show()
        if self._heartbeat:  # off a terminal a line, on one the bar's ETA, every second
            self._thread = threading.Thread(target=self._beat, name="progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
            elif self._plain and self._shown:
                self._print(self._closing(failed=exc_type is not None))

    def __call__(self, done: int, total: int | None = None, detail: str | None = None) -> None:
        """The loop's callback: ``done`` steps of ``total`` (None: unchanged), now at
        ``detail`` (None: unchanged)."""
        with self._lock:
            self.done = done
            if total is not None:
                self.total = total
            if detail is not None:
                self.detail = detail
        self._show()

    # -- lines and the bar ----------------------------------------------------------------------
    def line(self) -> str:
        """The plain line of the current state."""
        elapsed = self._clock() - self._start
        if self.total is None:  # what is known: the steps done so far, if any, and the time
            parts = [str(self.done)] if self.done else []
            parts += [self.detail] if self.detail else []
            return f"{self.what}: {', '.join([*parts, f'elapsed {format_seconds(elapsed)}'])}"
        detail = f" ({self.detail})" if self.detail else ""
        if self._finishing():
            return (
                f"{self.what}: {self.done}/{self.total}{detail} done, then {self._after}: "
                f"elapsed {format_seconds(elapsed)}"
            )
        frac = self.done / self.total if self.total > 0 else 0.0
        return (
            f"{self.what}: {self.done}/{self.total}{detail} {100 * frac:.0f}% "
            f"elapsed {format_seconds(elapsed)} eta {format_seconds(self._eta(elapsed))}"
        )

    def _finishing(self) -> bool:
        """Whether every step is done and ``after``'s work runs (its length unknown)."""
        return bool(self._after) and self.total is not None and self.done >= self.total

    def _eta(self, elapsed: float) -> float:
        """Seconds left at the mean time per step so far, elapsed time included: it moves
        with the clock (up during a slow step, down as steps end), inf before the first."""
        if self.total is None or self.done <= 0:
            return math.inf
        return elapsed / self.done * max(self.total - self.done, 0)

    def _closing(self, failed: bool) -> str:
        elapsed = format_seconds(self._clock() - self._start)
        count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
        if failed:
            return f"{self.what}: stopped at {count} after {elapsed}"
        if self.total is None:
            return f"{self.what}: done in {elapsed}"
        return f"{self.what}: done {count} in {elapsed}"

    def _show(self) -> None:
        """A plain line if one is due, or the bar brought up to date."""
        with self._lock:
            now = self._clock()
            if now - self._start < self._delay_s:
                return
            if self._plain:
                if now - self._last_line >= self._interval_s:
                    self._print(self.line())
                    self._last_line = now
                return
            if self._bar is None:
                self._bar = self._new_bar()
                self._bar.start()
                self._task = self._bar.add_task("", total=self.total, eta="-")
            assert self._task is not None
            if self._finishing():
                self._show_after()
                return
            eta = format_seconds(self._eta(now - self._start))
            self._bar.update(self._task, completed=self.done, total=self.total,
                             description=escape(self.detail), eta=eta)  # fmt: skip
            self._shown = True

    def _show_after(self) -> None:
        """The bar once every step is done and ``after``'s work runs: ``done/?``, a pulsing
        bar, ``after`` and no ETA (the lock held)."""
        assert self._bar is not None and self._task is not None
        task = self._bar.tasks[-1]
        if task.total is not None:  # a task of unknown total in its place, elapsed time kept
            started = task.start_time
            self._bar.remove_task(self._task)
            self._task = self._bar.add_task("", total=None, eta="?")
            self._bar.tasks[-1].start_time = started
        self._bar.update(self._task, completed=self.done,
                         description=escape(f"{self.detail} done, then {self._after}"))  # fmt: skip
        self._shown = True

    def _print(self, line: str) -> None:
        self._con.print(line, markup=False, highlight=False, soft_wrap=True)
        self._shown = True

    def _new_bar(self) -> Progress:
        head = TextColumn(f"[bold]{escape(self.what)}[/bold] {{task.description}}")
        if self.total is None:
            return Progress(SpinnerColumn(), head, TimeElapsedColumn(), console=self._con, transient=True)  # fmt: skip
        return Progress(
            head,
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            console=self._con,
            transient=True,
        )

    def _beat(self) -> None:
        """Off a terminal: a line every ``interval_s`` while no call brings one."""
        while not self._stop.wait(min(self._interval_s, 1.0)):
            self._show()


def plain_doc(doc: str | None) -> str:
    """A module docstring as ``--help`` text: reStructuredText roles (``:func:`x```) and double
    backticks dropped, so the terminal shows ``x`` as plain x."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc or "")
    return text.replace("``", "")

"""Step x column text grids of programs, with marked cells: how every schedule error shows
where it is (torch.distributed.pipelining's habit), and the failure that carries one.

Pure, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from dapple.errors import ValidationError

__all__ = ["Cell", "Problem", "fail", "format_grid"]

Cell = tuple[int, int]
"""(column key: device or stage, row: program step)."""
Problem = tuple[str, list[Cell]]
"""A message and the cells it marks."""

_MAX_PROBLEMS = 8
_CONTEXT_ROWS = 2


def format_grid(
    programs: Mapping[int, Sequence[object]],
    marks: Iterable[Cell] = (),
    column_label: str = "dev",
) -> str:
    """Render programs as a step x column text grid, marking ``marks`` as ``>>cell<<``.

    Long programs are cut to the rows near a mark (``...`` stands for skipped rows).

    Args:
        programs: column key (device or stage) -> its ordered actions.
        marks: ``(column key, step)`` cells to highlight.
        column_label: header prefix of each column.
    """
    cols = sorted(programs)
    marked = set(marks)
    nrows = max((len(p) for p in programs.values()), default=0)
    cells: dict[Cell, str] = {}
    for c in cols:
        for r, a in enumerate(programs[c]):
            cells[(c, r)] = f">>{a}<<" if (c, r) in marked else str(a)
    for c, r in marked:  # a mark past the end of a program (e.g. a missing action)
        if r >= len(programs.get(c, ())):
            cells[(c, r)] = ">><<"
            nrows = max(nrows, r + 1)
    header = ["step", *(f"{column_label} {c}" for c in cols)]
    widths = [max(len(header[0]), len(str(max(nrows - 1, 0))))]
    for i, c in enumerate(cols):
        widths.append(
            max([len(header[i + 1])] + [len(cells.get((c, r), "")) for r in range(nrows)])
        )
    if nrows <= 24 or not marked:
        shown = list(range(min(nrows, 60)))
    else:
        keep = {
            r2
            for _c, r in marked
            for r2 in range(r - _CONTEXT_ROWS, r + _CONTEXT_ROWS + 1)
            if 0 <= r2 < nrows
        }
        shown = sorted(keep)

    def line(parts: Sequence[str]) -> str:
        return " | ".join(p.ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip()

    out = [line(header), "-+-".join("-" * w for w in widths)]
    prev = -1
    for r in shown:
        if r != prev + 1:
            out.append("...")
        out.append(line([str(r), *(cells.get((c, r), "") for c in cols)]))
        prev = r
    if shown and shown[-1] < nrows - 1:
        out.append("...")
    return "\n".join(out)


def fail(
    what: str,
    problems: list[Problem],
    programs: Mapping[int, Sequence[object]],
    column_label: str,
) -> None:
    if not problems:
        return
    msgs = [p for p, _ in problems[:_MAX_PROBLEMS]]
    if len(problems) > _MAX_PROBLEMS:
        msgs.append(f"... and {len(problems) - _MAX_PROBLEMS} more")
    marks = [c for _, cs in problems[:_MAX_PROBLEMS] for c in cs]
    raise ValidationError(
        f"invalid {what}: "
        + "; ".join(msgs)
        + "\n"
        + format_grid(programs, marks, column_label=column_label)
    )

"""Leave-one-out errors of the efficiencies fitted on published rows (``published.py``).

Each (part, precision) of :data:`_published_model.FIT_ROWS` has its ``matmul`` efficiency fitted
on one row; the judged rows are predicted with fits on other rows, so their errors already
are leave-one-out errors. A fit row is judged here by a fit that excludes it:

* ``peers``: the median of the matmul efficiencies fitted on each of its peers (rows of the
  same part, precision and unmodelled features, expressible, publishing a throughput, not
  fit rows themselves), the row predicted with it;
* ``base``: the row predicted with the library's value before any fit on a row
  (:func:`_published_model.base_efficiency`: the H200-measured fused GEMM on the H100 in 16
  bits), unless that value is itself the fit on this row.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from _published_model import (
    FIT_ROWS,
    base_efficiency,
    blockers,
    fitted_matmul,
    part_of,
    predict,
    published_samples_per_s,
    unmodelled,
    with_matmul,
)

__all__ = ["LeftOut", "leave_one_out", "loo_lines", "peers"]


@dataclass(frozen=True, slots=True)
class LeftOut:
    """One fit row predicted without itself."""

    part: str
    precision: str
    row: str
    fitted: float
    """The matmul efficiency fitted on the row."""
    peers: tuple[str, ...]
    peer_matmul: float | None
    """Median of the peers' fits (None: no peer)."""
    peer_error: float | None
    base_matmul: float | None
    """The library's value before any row fit (None: it is this row's fit)."""
    base_error: float | None


def peers(run: dict[str, Any], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows a fit row's efficiency could be fitted on instead (module docstring)."""
    fit_ids = set(FIT_ROWS.values())
    key = (part_of(run), run["parallel"]["precision"], tuple(unmodelled(run)))
    return [
        r for r in runs
        if r["id"] not in fit_ids and not blockers(r) and published_samples_per_s(r) is not None
        and (part_of(r), r["parallel"]["precision"], tuple(unmodelled(r))) == key
    ]  # fmt: skip


def _error(run: dict[str, Any], matmul: float) -> float:
    base = base_efficiency(part_of(run), run["parallel"]["precision"])
    got = predict(run, with_matmul(base, matmul, part_of(run))).samples_per_s
    published = published_samples_per_s(run)
    assert published is not None, run["id"]
    return got / published - 1


def leave_one_out(runs: list[dict[str, Any]]) -> list[LeftOut]:
    """Every fit row predicted by the fits that exclude it."""
    by_id = {r["id"]: r for r in runs}
    out = []
    for (part, prec), rid in FIT_ROWS.items():
        run = by_id[rid]
        mine = peers(run, runs)
        peer = statistics.median(fitted_matmul(r["id"]) for r in mine) if mine else None
        base = base_efficiency(part, prec)
        own = rid in base.note  # the library's value is this row's fit
        out.append(LeftOut(
            part, prec, rid, fitted_matmul(rid), tuple(r["id"] for r in mine), peer,
            None if peer is None else _error(run, peer), None if own else base.matmul,
            None if own else _error(run, base.matmul),
        ))  # fmt: skip
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def loo_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The ``Leave-one-out`` section of ``published.md``."""
    rows = leave_one_out(runs)
    lines = ["## Leave-one-out errors of the fitted efficiencies", "",
             "The judged rows above are predicted with efficiencies fitted on other rows (their "
             "errors are leave-one-out errors). Each fit row, predicted without itself: `peers`: "
             "with the median matmul efficiency fitted on each of its peers (same part, precision "
             "and unmodelled features); `base`: with the library's value before any row fit (on "
             "the H100 in 16 bits the GEMM measured on the H200, `benchmarks/gpu_fit.md`; `-` "
             "where the library's value is this row's own fit).", "",
             "| part | precision | fit row | fitted matmul | peers | peers' matmul | error | "
             "base matmul | error |", "|---|---|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for x in rows:
        lines.append(
            f"| {x.part} | {x.precision} | {x.row} | {x.fitted:.3f} | "
            f"{', '.join(x.peers) or 'none'} | "
            f"{'-' if x.peer_matmul is None else f'{x.peer_matmul:.3f}'} | {_pct(x.peer_error)} | "
            f"{'-' if x.base_matmul is None else f'{x.base_matmul:.3f}'} | {_pct(x.base_error)} |"
        )
    within = [x for x in rows if x.peer_error is not None]
    lines += ["", f"- fit rows within 15% of their published throughput when left out (peers): "
              f"{sum(abs(x.peer_error or 0) <= 0.15 for x in within)} of {len(within)} with "
              f"peers; {len(rows) - len(within)} without a peer.", ""]  # fmt: skip
    return lines

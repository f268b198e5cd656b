"""The judged misses of ``published.md`` by cause, read off three predictions of each row.

Each expressed row is predicted three ways (:mod:`_published_model`): as its framework runs it
(the communication its framework hides under compute left out, :func:`overlap_for`), with all
communication on the critical path (dapple's runtime, :func:`no_overlap_step_ms`), and with
free links (:func:`free_comm_step_ms`). A miss (more than 15% off) is classified by where the
published number lies among them (:func:`cause`):

* ``exposed communication``: slow, and within 15% with free links: the model charges
  communication the framework hides (what the overlap model keeps exposed: tensor-parallel
  all-reduces, the first gather and the last reduce).
* ``compute, slow``: more than 15% slow even with free links: the compute side (or a
  schedule) costs more than the run's; no communication model can fix it.
* ``compute, fast``: fast. The prediction is never faster than with free links, so the compute
  side is too fast; the ``no overlap`` column tells whether hiding less communication would
  bring the row within 15%.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cause", "miss_lines"]

TOLERANCE = 0.15


def cause(pred: float, free: float, published: float) -> str:
    """The cause of a miss of ``pred`` samples/s against ``published`` (module docstring); ``-``
    within :data:`TOLERANCE`. ``pred`` <= ``free`` as the model gives them."""
    err = pred / published - 1
    if abs(err) <= TOLERANCE:
        return "-"
    if err < 0:
        return "exposed communication" if free / published - 1 >= -TOLERANCE else "compute, slow"
    return "compute, fast"


def miss_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The section of ``published.md`` listing every judged miss with its three predictions and
    its cause. ``rows``: per judged row with a published throughput, a dict of ``id``,
    ``framework``, ``published``, ``pred``, ``no_overlap``, ``free`` (samples/s) and
    ``left_out`` (what the prediction does not model)."""
    lines = ["## Misses by cause", "",
             "Every judged row more than 15% off, predicted three ways: as its framework runs it "
             "(`predicted`: the data-parallel and FSDP traffic its framework overlaps with "
             "compute left out, `dapple.cost.overlap`), with all communication on the critical "
             "path (`no overlap`, as dapple's runtime runs it) and with free links (`free comm`). "
             "The cause is read off where the published number lies among them "
             "(`benchmarks/_published_misses.py`): `exposed communication` (slow, within 15% "
             "with free links), `compute, slow` (more than 15% slow even with free links), "
             "`compute, fast` (fast: the prediction never exceeds the free-link bound; `no "
             "overlap` shows whether exposing all communication would bring it within 15%).", "",
             "| row | framework | published | predicted | error | no overlap | free comm | cause | "
             "left out |", "|---|---|---:|---:|---:|---:|---:|---|---|"]  # fmt: skip
    counts: dict[str, int] = {}
    for r in rows:
        c = cause(r["pred"], r["free"], r["published"])
        if c == "-":
            continue
        counts[c] = counts.get(c, 0) + 1
        pub = r["published"]
        lines.append(
            f"| {r['id']} | {r['framework']} | {pub:.2f} | {r['pred']:.2f} | "
            f"{100 * (r['pred'] / pub - 1):+.1f}% | {100 * (r['no_overlap'] / pub - 1):+.1f}% | "
            f"{100 * (r['free'] / pub - 1):+.1f}% | {c} | {r['left_out'] or '-'} |"
        )
    tally = ", ".join(f"{n} {c}" for c, n in sorted(counts.items(), key=lambda x: -x[1]))
    return [*lines, "", f"- {sum(counts.values())} misses: {tally or 'none'}.", ""]

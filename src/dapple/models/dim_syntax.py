"""The text syntax of declared dynamic input dimensions: ``INPUT:DIM=NAME[:MIN..MAX]`` or
``INPUT:DIM=static`` (``--dynamic-dims``, a run file's ``[model] dynamic_dims``), parsed into
the ``dynamic_dims`` mapping :func:`dapple.models.spec.load` takes.

``INPUT`` is a position or a ``forward`` argument name; items are separated by commas or given
as several strings; either end of a range may be left out. Torch-free.
"""

from __future__ import annotations

from dapple.errors import ValidationError

__all__ = ["parse_dynamic_dims"]

_DIM_SYNTAX = "INPUT:DIM=NAME[:MIN..MAX] or INPUT:DIM=static"


def _parse_dim(item: str) -> tuple[str | int, int, str | tuple[str, int, int | None] | None]:
    """One ``INPUT:DIM=VALUE`` item (see the module docstring)."""
    where, sep, value = item.partition("=")
    inp, colon, dim = where.rpartition(":")
    if not sep or not colon or not inp or not value:
        raise ValidationError(f"--dynamic-dims expects {_DIM_SYNTAX}, got {item!r}")
    if not dim.isdigit():
        raise ValidationError(f"--dynamic-dims {item!r}: dimension {dim!r} is not a number")
    key: str | int = int(inp) if inp.isdigit() else inp
    if value == "static":
        return key, int(dim), None
    name, colon, span = value.partition(":")
    if not name:
        raise ValidationError(f"--dynamic-dims {item!r}: the dimension needs a name")
    if not colon:
        return key, int(dim), name
    lo, dots, hi = span.partition("..")
    if not dots or not (lo == "" or lo.isdigit()) or not (hi == "" or hi.isdigit()):
        raise ValidationError(
            f"--dynamic-dims {item!r}: the range must be MIN..MAX (whole numbers; either may "
            f"be left out), got {span!r}"
        )
    return key, int(dim), (name, int(lo) if lo else 1, int(hi) if hi else None)


def parse_dynamic_dims(
    items: list[str],
) -> dict[str | int, dict[int, str | tuple[str, int, int | None] | None]]:
    """``["input_ids:1=seq:2..512,mask:1=seq", "0:2=static"]`` -> the API's ``dynamic_dims``
    (``{"input_ids": {1: ("seq", 2, 512)}, "mask": {1: "seq"}, 0: {2: None}}``).

    Raises:
        ValidationError: an item that is not ``INPUT:DIM=NAME[:MIN..MAX]`` or
            ``INPUT:DIM=static``, or one dimension declared twice.
    """
    out: dict[str | int, dict[int, str | tuple[str, int, int | None] | None]] = {}
    for group in items:
        for item in (x.strip() for x in group.split(",")):
            if not item:
                continue
            key, dim, value = _parse_dim(item)
            if dim in out.get(key, {}):
                raise ValidationError(
                    f"--dynamic-dims declares input {key!r} dimension {dim} twice"
                )
            out.setdefault(key, {})[dim] = value
    return out

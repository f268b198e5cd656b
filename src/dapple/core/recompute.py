"""Re-computation (activation checkpointing): one vocabulary for ``dapple profile --recompute``,
``dapple train --recompute``, their API keywords and config keys, and ``StagePlan.recompute``.

:class:`Recompute` names what is re-computed in the backward: ``none``; ``selective`` (eager
attention's core only, Korthikanti et al. 2022); ``full`` (every forward op, keeping only the
inputs). An analytic profile's blocks take all three (:data:`RECOMPUTE_MODES`,
:mod:`dapple.profiler.analytic_ops`); a plan's stages and the runtime take ``none`` and ``full``
(:data:`STAGE_RECOMPUTE`): the runtime re-computes a whole stage's forward
(``torch.utils.checkpoint`` over the stage), not parts of a block. A :class:`Recompute` is true
when something is re-computed.
"""

from __future__ import annotations

from enum import Enum

from dapple.errors import ValidationError

__all__ = ["RECOMPUTE_MODES", "STAGE_RECOMPUTE", "Recompute", "full_if", "recompute_of"]


class Recompute(str, Enum):
    """What the backward re-computes (module docstring); equal to, and printed as, its value."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    def __bool__(self) -> bool:
        """True when something is re-computed (``selective`` or ``full``)."""
        return self is not Recompute.NONE

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


RECOMPUTE_MODES: tuple[str, ...] = tuple(m.value for m in Recompute)
"""Every mode: what an analytic profile's blocks may re-compute."""

STAGE_RECOMPUTE: tuple[str, ...] = (Recompute.NONE.value, Recompute.FULL.value)
"""The modes of a plan's stage and of the runtime, which re-computes whole stages."""


def recompute_of(value: object, name: str, allowed: tuple[str, ...] = STAGE_RECOMPUTE) -> Recompute:
    """``value`` as a :class:`Recompute`, one of ``allowed``.

    Raises:
        ValidationError: one line naming ``name`` and the allowed values, for any value
            outside ``allowed``; for a bool (``dapple train``'s old switch) also the value it
            is now (``full`` for true, ``none`` for false).
    """
    choices = " or ".join(allowed) if len(allowed) == 2 else ", ".join(allowed)
    if isinstance(value, bool):
        raise ValidationError(
            f"{name} must be {choices}, not {value!r} (a bool was train's old switch: "
            f"{'full' if value else 'none'} now)"
        )
    if value not in allowed:
        why = " (the runtime re-computes whole stages)" if value in RECOMPUTE_MODES else ""
        raise ValidationError(f"{name} must be {choices}{why}, got {value!r}"[:300])
    return Recompute(value)


def full_if(recomputes: bool) -> Recompute:
    """A stage's mode from a yes/no choice (the planner's): ``full`` or ``none``."""
    return Recompute.FULL if recomputes else Recompute.NONE

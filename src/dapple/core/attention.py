"""How a traced Hugging Face causal LM calls attention (``--set attention=``), by name: what the
runtime applies (:mod:`dapple.models.hf_attention`) and the analytic profile times
(:func:`dapple.profiler.analytic.analytic_profile`) check the same names here."""

from __future__ import annotations

from dapple.errors import ValidationError

__all__ = ["ATTENTION_MODES", "CAUSAL", "MASKED", "check_attention"]

MASKED = "masked"
"""SDPA given the materialised causal mask (the traced model as ``transformers`` leaves it)."""
CAUSAL = "causal"
"""SDPA with ``is_causal=True`` and no mask where the mask is causal alone."""
ATTENTION_MODES = (MASKED, CAUSAL)


def check_attention(mode: object) -> None:
    """Refuse a mode other than :data:`ATTENTION_MODES` (one line naming them)."""
    if mode not in ATTENTION_MODES:
        raise ValidationError(
            f"attention must be one of {', '.join(ATTENTION_MODES)}, got {mode!r}"
        )

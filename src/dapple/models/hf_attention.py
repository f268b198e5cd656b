"""How a traced Hugging Face causal LM calls attention: ``masked`` or ``causal``.

``torch.export`` cannot read a tensor's values, so a Hugging Face causal LM traced by dapple never
takes the shortcut its eager forward takes for an all-ones attention mask (SDPA with
``is_causal=True`` and no mask): the traced model materialises the ``[b, 1, s, s]`` causal mask in
its prologue and hands it to every block's SDPA, which then cannot use its flash kernel, runs over
all ``s^2`` tiles and, for grouped-query attention, gets K and V copied to every head first
(``repeat_kv``). That is ``masked`` (:data:`dapple.core.attention.MASKED`), the traced model
as ``transformers`` leaves it.

``causal`` registers an attention implementation with ``transformers``
(:data:`IMPLEMENTATION`): the same SDPA function, with a mask function that returns no mask where
the mask would be causal alone (no sliding window, no extra mask function, queries and keys of the
same positions), so every block calls SDPA with ``is_causal=True`` and no mask, as the eager
model does for an unpadded batch; any other mask (a sliding window, an offset cache) is built as
before. The padding in ``attention_mask`` is then not read: dapple's causal-LM batches have none
(:class:`dapple.models.hf._CausalBatch`, :class:`dapple.runtime.data.CausalLMSamples`).

Only the families of :data:`CAUSAL_FAMILIES` take it: a family must call its attention through
``transformers``' attention registry, or it runs its own code for an implementation it does not
know. Falcon does: given :data:`IMPLEMENTATION` it runs its eager attention, and without the
mask that attention is no longer causal (``tests/test_hf_attention.py`` shows its loss change).
Each family listed trains to the same loss and gradients either way in that test.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from dapple.core.attention import CAUSAL, MASKED, check_attention
from dapple.errors import ValidationError

__all__ = ["CAUSAL_FAMILIES", "IMPLEMENTATION", "use_attention"]

IMPLEMENTATION = "dapple_causal_sdpa"
"""The attention implementation ``causal`` registers with ``transformers``."""
CAUSAL_FAMILIES = ("codegen", "gemma", "gpt_neox", "llama", "mistral", "opt", "phi", "qwen2",
                   "stablelm")  # fmt: skip
"""The ``model_type``s ``causal`` is checked for (``tests/test_hf_attention.py``)."""


def _causal_only_mask(*args: Any, **kwargs: Any) -> Any:
    """``transformers``' SDPA mask, except None (SDPA's ``is_causal``) where the mask would be
    the causal mask alone: as many queries as keys, the plain causal mask function, no local
    window, skipping allowed (``create_causal_mask`` forbids it for extra or packed masks) and
    queries and keys starting at position 0 of the same sequence."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    names = ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "mask_function")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    q_length, kv_length = given.get("q_length"), given.get("kv_length")
    plain = (
        (q_length is kv_length or q_length == kv_length)
        and given.get("mask_function", causal_mask_function) is causal_mask_function
        and given.get("local_size") is None
        and given.get("allow_is_causal_skip", True)
        and all(
            isinstance(given.get(k, 0), int) and given.get(k, 0) == 0
            for k in ("q_offset", "kv_offset")
        )
    )
    return None if plain else sdpa_mask(*args, **kwargs)


def _register() -> None:
    """Register :data:`IMPLEMENTATION` with ``transformers`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, sdpa_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, _causal_only_mask)


def use_attention(model: nn.Module, mode: str) -> nn.Module:
    """``model`` (a ``transformers`` causal LM) set to attention ``mode``; returned.

    Raises:
        ValidationError: an unknown mode, or ``causal`` for a family outside
            :data:`CAUSAL_FAMILIES` or a model that does not run SDPA (its config's attention
            implementation is named).
    """
    check_attention(mode)
    if mode == MASKED:
        return model
    config: Any = model.config
    family = getattr(config, "model_type", None)
    if family not in CAUSAL_FAMILIES:
        raise ValidationError(
            f"attention={CAUSAL} is checked for the families {', '.join(CAUSAL_FAMILIES)}; "
            f"{type(model).__name__} is {family!r}: use attention={MASKED}"
        )
    impl = config._attn_implementation
    if impl not in ("sdpa", IMPLEMENTATION):
        raise ValidationError(
            f"attention={CAUSAL} calls SDPA with is_causal, but {type(model).__name__} runs "
            f"{impl!r} attention; use attention={MASKED}"
        )
    _register()
    config._attn_implementation = IMPLEMENTATION
    return model

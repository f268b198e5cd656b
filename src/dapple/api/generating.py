"""The Python API's generating side: one typed :class:`GenerateConfig` behind ``dapple
generate`` and :func:`generate`.

``dapple generate``'s flags are read once into a :class:`GenerateConfig`; ``generate(cfg)``
continues its prompt with the model it names, and the keyword form ``generate(workload, prompt,
...)`` takes the same options. Torch loads with the model, not with this module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from dapple.api.run_config import ModelConfig
from dapple.errors import ValidationError

if TYPE_CHECKING:
    from dapple.api._inputs import WorkloadLike
    from dapple.models.generate import Generated

__all__ = ["SEED_RANGE", "GenerateConfig", "check_prompt_and_seed", "generate"]

Progress = Callable[[int, int], None]

SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds torch's generators take (a signed 64-bit seed)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateConfig:
    """What ``dapple generate`` is asked for: the model and its weights, the prompt, and how
    to continue it."""

    model: ModelConfig
    """The model as it was trained (``-m`` and its flags; pretrained weights: ``weights``)."""
    prompt: str
    """The text to continue."""
    max_new_tokens: int = 64
    """Tokens to add (end-of-sequence does not stop it)."""
    checkpoint_dir: str | None = None
    """A checkpoint root (its newest complete checkpoint) or one ``step-NNNNNNNN`` directory;
    None: the model's own weights."""
    tokenizer: str | None = None
    """A local Hugging Face tokenizer directory (None: an ``hf:DIR`` model's own, else bytes)."""
    temperature: float = 0.0
    """0: greedy; above 0: sampled from ``softmax(logits / temperature)``."""
    seed: int = 0
    """Seed of the sampling."""


@overload
def generate(workload: GenerateConfig, *, progress: Progress | None = None) -> Generated: ...
@overload
def generate(
    workload: WorkloadLike,
    prompt: str,
    max_new_tokens: int = 64,
    *,
    checkpoint: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    tokenizer: str | Path | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    progress: Progress | None = None,
) -> Generated: ...


def generate(
    workload: GenerateConfig | WorkloadLike,
    prompt: str | None = None,
    max_new_tokens: int = 64,
    *,
    checkpoint: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    tokenizer: str | Path | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    progress: Progress | None = None,
) -> Generated:
    """Continue ``prompt`` with a trained causal language model (``dapple generate``), on the
    CPU (:func:`dapple.models.generate.generate_text`).

    Args:
        workload: A :class:`GenerateConfig` (then only ``progress`` goes beside it), or a
            :class:`Workload` or a spec string; the model as it was trained.
        prompt: The text to continue.
        max_new_tokens: Tokens to add (generation does not stop at end-of-sequence).
        checkpoint: A checkpoint root (its newest complete checkpoint) or one
            ``step-NNNNNNNN`` directory; ``None``: the workload's own weights (pretrained ones
            with ``overrides={"weights": DIR}``).
        overrides: Factory keyword arguments when ``workload`` is a spec.
        tokenizer: A Hugging Face tokenizer directory; ``None``: an ``hf:DIR`` model's own
            tokenizer when DIR has one, else bytes (vocabulary 256).
        temperature: 0: greedy; above 0: sampled from ``softmax(logits / temperature)``.
        seed: Seed of the sampling.
        progress: Called after each new token with ``(done, max_new_tokens)``.

    Returns:
        A :class:`~dapple.models.generate.Generated`: ``text`` (the prompt and its
        continuation), ``ids``, ``prompt_tokens``, ``new_tokens``.

    Raises:
        ValidationError: An empty prompt or one that is not text, a seed torch's generator
            does not take (:func:`check_prompt_and_seed`), no checkpoint under ``checkpoint``, a tokenizer whose
            vocabulary does not fit the model's, a bad spec or temperature, a count outside
            1 .. :data:`~dapple.models.generate.MAX_NEW_TOKENS`.
        CheckpointError: A checkpoint of another model, or a damaged one.
    """
    from dapple.api._inputs import as_workload
    from dapple.models.generate import check_request, generate_text, tokenizer_for
    from dapple.runtime.checkpoint import check_compatible, restore_stage
    from dapple.runtime.export import newest_checkpoint, no_checkpoint_reason

    subject: WorkloadLike | None
    if isinstance(workload, GenerateConfig):
        c = workload
        subject, prompt, max_new_tokens = c.model.spec, c.prompt, c.max_new_tokens
        checkpoint, overrides, tokenizer = c.checkpoint_dir, c.model.overrides(), c.tokenizer
        temperature, seed = c.temperature, c.seed
    else:
        subject = workload
    if subject is None or prompt is None:
        raise ValidationError(
            f"generate needs a model and a prompt, got {subject!r} and {prompt!r}"
        )
    check_prompt_and_seed(prompt, seed)
    wl = as_workload(subject, overrides)
    tok = tokenizer_for(wl, tokenizer)
    check_request(tok, prompt, max_new_tokens, temperature)  # before the model is built
    ckpt = None if checkpoint is None else newest_checkpoint(checkpoint)
    if checkpoint is not None and ckpt is None:
        raise ValidationError(no_checkpoint_reason(checkpoint))
    from dapple.profiler.host_fit import check_training_memory

    check_training_memory(wl, 0.0, what="generating with")  # the whole model, once
    model = wl.build_model(0)
    if ckpt is not None:
        check_compatible(ckpt, model_name=wl.name, num_layers=wl.num_layers)
        restore_stage(ckpt, model, 0)
    return generate_text(wl, model, prompt, max_new_tokens, tokenizer=tok,
                         temperature=temperature, seed=seed, progress=progress)  # fmt: skip


def check_prompt_and_seed(prompt: str, seed: int, *, flags: bool = False) -> None:
    """The prompt is text (bytes that are not UTF-8 reach Python as lone surrogates, which no
    tokenizer takes) and the seed fits torch's generator (:data:`SEED_RANGE`), before the model
    is loaded; ``flags``: messages name ``dapple generate``'s flags.

    Raises:
        ValidationError: naming the first bad byte, or the seed.
    """
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = prompt[e.start].encode("utf-8", "surrogateescape")
        raise ValidationError(
            f"{'--prompt' if flags else 'the prompt'} is not UTF-8 text: byte 0x{byte.hex()} at "
            f"character {e.start}"
        ) from e
    low, high = SEED_RANGE
    if not (isinstance(seed, int) and low <= seed <= high):
        raise ValidationError(
            f"{'--seed' if flags else 'seed'} must be an integer from {low} to {high}, got {seed}"
        )

"""Text generation with a trained causal language model (a layer chain: ids -> logits).

- Tokens are bytes (vocabulary 256, what ``dapple data prepare`` makes without a tokenizer) or
  those of a local Hugging Face tokenizer directory, encoded as ``data prepare`` encodes text:
  no special tokens added.
- Each new token costs one forward over the last ``context`` tokens (no KV cache: a chain's
  pieces are traced graphs). A chain traced at one length takes exactly that many tokens, so
  :func:`chain_logits` right-pads the window to the context; the model is causal, so the logits
  at the last real token never see the padding.
- Temperature 0 takes the argmax; above 0 it samples ``softmax(logits / T)`` from a generator
  seeded with ``seed``. Only ids the tokenizer knows are drawn (a Hugging Face model's
  vocabulary may be padded past its tokenizer's). Generation does not stop at end-of-sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from dapple.datasets.tokenizer_dir import TOKENIZER_FILES, load_hf_tokenizer
from dapple.errors import ValidationError
from dapple.models.workload import Workload

__all__ = [
    "BYTES",
    "MAX_NEW_TOKENS",
    "TOKENIZER_FILES",
    "Generated",
    "Tokenizer",
    "chain_logits",
    "check_request",
    "generate_text",
    "greedy_generate",
    "load_tokenizer",
    "sample_tokens",
    "tokenizer_for",
]

LogitsFn = Callable[[torch.Tensor], torch.Tensor]
"""1-D window of token ids -> the model's 1-D logits for the token after it."""
Progress = Callable[[int, int], None]
"""Called after each new token with ``(tokens done, tokens in all)``."""

MAX_NEW_TOKENS = 1 << 16
"""The most tokens one request adds. The window slides, so a model's positions (its context)
do not limit the count; each token costs one forward pass over the context, so this bounds
the work."""


@dataclass(frozen=True, slots=True)
class Tokenizer:
    """Text <-> token ids."""

    name: str
    """``bytes`` or the tokenizer's directory."""
    vocab_size: int
    """Ids are ``0 .. vocab_size - 1`` (``len(tokenizer)``, as ``data prepare`` records)."""
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]


def _byte_decode(ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


BYTES = Tokenizer("bytes", 256, lambda text: list(text.encode()), _byte_decode)
"""UTF-8 bytes, vocabulary 256 (``dapple data prepare`` without ``--tokenizer``)."""


def load_tokenizer(where: str | Path) -> Tokenizer:
    """The Hugging Face tokenizer saved in directory ``where`` (offline,
    :func:`dapple.datasets.tokenizer_dir.load_hf_tokenizer`).

    Raises:
        ValidationError: no such directory, none of :data:`TOKENIZER_FILES` in it, no
            ``transformers``, or no tokenizer they can load there.
    """
    tok = load_hf_tokenizer(where)
    return Tokenizer(
        name=str(Path(where)),
        vocab_size=len(tok),
        encode=lambda text: [int(t) for t in tok.encode(text, add_special_tokens=False)],
        decode=lambda ids: str(tok.decode([int(i) for i in ids])),
    )


def tokenizer_for(workload: Workload, where: str | Path | None = None) -> Tokenizer:
    """The tokenizer in ``where``; without it, an ``hf:DIR`` model's own (when DIR holds
    tokenizer files), else :data:`BYTES`.

    Raises:
        ValidationError: see :func:`load_tokenizer`.
    """
    if where is not None:
        return load_tokenizer(where)
    from dapple.models.hf import hf_config

    config = hf_config(workload)
    home = Path(str(getattr(config, "name_or_path", "") or "")) if config is not None else None
    if home is not None and home.is_dir() and any((home / f).is_file() for f in TOKENIZER_FILES):
        return load_tokenizer(home)
    return BYTES


def chain_logits(workload: Workload, model: nn.Module) -> tuple[LogitsFn, int]:
    """How to ask ``model`` (``workload``'s chain) for next-token logits, and its context.

    The context is the longest input the chain takes: the upper end of a dynamic token
    dimension, else the length of the workload's samples (a traced chain takes only that
    length; the zoo's position table has that many rows). Windows are right-padded to it with
    id 0 (and mask 0 when the model takes ``(input_ids, attention_mask)``).

    Raises:
        ValidationError: a model whose inputs are not token ids or ``(ids, mask)``.
    """
    inputs, _ = workload.make_batch(1, 0)
    with_mask = isinstance(inputs, (tuple, list))
    ids = inputs[0] if with_mask else inputs
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dim() != 2
        or ids.dtype.is_floating_point
        or (with_mask and len(inputs) != 2)
    ):
        raise ValidationError(
            f"cannot generate with {workload.name!r}: its inputs are not (batch, tokens) ids or "
            "(ids, attention mask)"
        )
    dim = workload.dynamic_dims.get(0, {}).get(1)
    context = int(dim.max) if dim is not None and dim.max is not None else int(ids.shape[1])
    mask_dtype = inputs[1].dtype if with_mask else torch.long

    def next_logits(window: torch.Tensor) -> torch.Tensor:
        n = window.numel()
        padded = torch.zeros(1, context, dtype=torch.long)
        padded[0, :n] = window
        if with_mask:
            mask = torch.zeros(1, context, dtype=mask_dtype)
            mask[0, :n] = 1
            out = model((padded, mask))
        else:
            out = model(padded)
        if not isinstance(out, torch.Tensor) or out.dim() != 3:
            what = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValidationError(
                f"cannot generate with {workload.name!r}: its output {what} is not "
                "(batch, tokens, vocabulary) logits"
            )
        return out[0, n - 1]

    return next_logits, context


@torch.no_grad()
def sample_tokens(
    next_logits: LogitsFn,
    prompt: torch.Tensor,
    new_tokens: int,
    context: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    vocab: int | None = None,
    progress: Progress | None = None,
) -> torch.Tensor:
    """Append ``new_tokens`` tokens to ``prompt``, each drawn from the logits of the last
    ``context`` tokens: the argmax at ``temperature`` 0, else a sample of
    ``softmax(logits / temperature)`` (a generator seeded with ``seed``).

    Args:
        next_logits: 1-D window (at most ``context`` ids) -> next-token logits.
        prompt: 1-D token ids (at least one).
        vocab: draw only ids below it (``None``: every id of the logits).
        progress: called after each token with ``(done, new_tokens)``.

    Returns:
        The prompt followed by the generated tokens (1-D).

    Raises:
        ValidationError: an empty prompt, a negative count, a context below 1 or a bad
            temperature.
    """
    if prompt.dim() != 1 or prompt.numel() < 1:
        raise ValidationError(
            f"prompt must be 1-D with at least one token, got {tuple(prompt.shape)}"
        )
    if new_tokens < 0 or context < 1:
        raise ValidationError(f"need new_tokens >= 0 and context >= 1, got {new_tokens}, {context}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValidationError(f"temperature must be finite and >= 0 (0: greedy), got {temperature}")
    gen = torch.Generator().manual_seed(seed)
    ids = prompt.clone()
    for done in range(1, new_tokens + 1):
        logits = next_logits(ids[-context:])[:vocab].float()
        if temperature == 0:
            nxt = logits.argmax().reshape(1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt.to(ids.dtype)])
        if progress is not None:
            progress(done, new_tokens)
    return ids


def greedy_generate(
    model: nn.Module, prompt: torch.Tensor, new_tokens: int, context: int
) -> torch.Tensor:
    """Append ``new_tokens`` tokens to ``prompt``, each the argmax of the model's next-token
    logits over the last ``context`` tokens.

    Args:
        model: maps ``(1, t)`` token ids to ``(1, t, vocab)`` logits, ``t <= context``.
        prompt: 1-D token ids (at least one).
        new_tokens: tokens to add.
        context: the most tokens the model takes at once (its positions).

    Returns:
        The prompt followed by the generated tokens (1-D).
    """
    was_training = model.training
    model.eval()
    try:
        return sample_tokens(lambda w: model(w.unsqueeze(0))[0, -1], prompt, new_tokens, context)
    finally:
        model.train(was_training)


@dataclass(frozen=True, slots=True)
class Generated:
    """What :func:`generate_text` made."""

    text: str
    """The prompt followed by the decoded new tokens."""
    ids: tuple[int, ...]
    """The prompt's ids followed by the new ones."""
    prompt_tokens: int
    tokenizer: str
    """``bytes`` or the tokenizer's directory."""
    context: int = 0
    """The most tokens the model sees at once: a longer prompt is continued from its last
    ``context`` tokens (0: not stated)."""

    @property
    def new_tokens(self) -> int:
        return len(self.ids) - self.prompt_tokens


def _check_vocab(tok: Tokenizer, model_vocab: int) -> None:
    """The tokenizer fits the model: bytes exactly 256 logits, others at most the model's."""
    if tok.name == BYTES.name and model_vocab != 256:
        raise ValidationError(
            f"the model's vocabulary is {model_vocab} tokens, not the 256 bytes: give the "
            "tokenizer its data was prepared with (--tokenizer DIR)"
        )
    if tok.vocab_size > model_vocab:
        raise ValidationError(
            f"tokenizer {tok.name} has {tok.vocab_size} tokens but the model's vocabulary is "
            f"{model_vocab}: not the tokenizer it was trained with"
        )


def check_request(tok: Tokenizer, prompt: str, new_tokens: int, temperature: float) -> list[int]:
    """The ids of ``prompt``, once the request is checked (before any model is built).

    Raises:
        ValidationError: an empty prompt or one that encodes to no tokens, a count of new
            tokens outside 1 .. :data:`MAX_NEW_TOKENS`, a negative or non-finite temperature.
    """
    if not prompt:
        raise ValidationError("the prompt is empty: give some text to continue")
    if (
        isinstance(new_tokens, bool)
        or not isinstance(new_tokens, int)
        or not 1 <= new_tokens <= MAX_NEW_TOKENS
    ):
        raise ValidationError(
            f"--max-new-tokens must be an integer from 1 to {MAX_NEW_TOKENS}, got "
            f"{new_tokens!r} (each new token is one forward pass over the model's context; the "
            "window slides, so the model's positions do not limit the count)"
        )
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValidationError(f"temperature must be finite and >= 0 (0: greedy), got {temperature}")
    ids = tok.encode(prompt)
    if not ids:
        raise ValidationError(f"the prompt {prompt!r} encodes to no tokens with {tok.name}")
    return ids


def generate_text(
    workload: Workload,
    model: nn.Module,
    prompt: str,
    new_tokens: int,
    *,
    tokenizer: Tokenizer | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    progress: Progress | None = None,
) -> Generated:
    """Continue ``prompt`` by ``new_tokens`` tokens with ``model``, ``workload``'s chain.

    Args:
        tokenizer: ``None``: :func:`tokenizer_for` the workload.
        temperature: 0: greedy; above 0: sampled, reproducibly for one ``seed``.
        progress: called after each new token with ``(done, new_tokens)``.

    Raises:
        ValidationError: an empty prompt, a tokenizer whose vocabulary does not fit the
            model's, a bad count or temperature, a model that does not map ids to logits.
    """
    tok = tokenizer if tokenizer is not None else tokenizer_for(workload)
    prompt_ids = check_request(tok, prompt, new_tokens, temperature)
    next_logits, context = chain_logits(workload, model)
    ids = torch.tensor(prompt_ids, dtype=torch.long)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():  # the prompt's ids may not fit an ill-matched model: probe id 0
            _check_vocab(tok, next_logits(torch.zeros(1, dtype=torch.long)).numel())
        out = sample_tokens(
            next_logits,
            ids,
            new_tokens,
            context,
            temperature=temperature,
            seed=seed,
            vocab=tok.vocab_size,
            progress=progress,
        )
    finally:
        model.train(was_training)
    all_ids = [int(i) for i in out]
    full, head = tok.decode(all_ids), tok.decode(prompt_ids)
    tail = full[len(head) :] if full.startswith(head) else tok.decode(all_ids[len(prompt_ids) :])
    return Generated(prompt + tail, tuple(all_ids), len(prompt_ids), tok.name, context)

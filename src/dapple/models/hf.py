"""Hugging Face GPT-2 and BERT built from a config (offline, random init) as split workloads.

``transformers`` is an optional extra (``pip install dapple[hf]``); it is imported only when a
factory runs. The models are cut with :func:`dapple.models.split.workload_from_module`: before every
transformer block and after the last one, so a model with ``layers`` blocks has
``layers + 2`` pieces (embeddings, blocks, final norm + LM head). Input and LM-head weights
stay tied and are reported in ``Workload.tied_parameters``.

Zoo-style specs: ``dapple.models.hf:gpt2`` and ``dapple.models.hf:bert`` (keyword arguments as below),
and ``hf:DIR``: any causal LM whose ``config.json`` is in the local directory ``DIR``
(:func:`hf_causal_lm`).

Causal-LM targets follow the nanoGPT convention of token files (and of the zoo transformer): a
window ``w`` of ``seq + 1`` tokens is the sample ``x = w[:-1]`` (``input_ids``), ``y = w[1:]``
(targets), so ``y[t]`` is the token after ``x[t]`` and :func:`causal_lm_loss` compares
``logits[:, t]`` with ``targets[:, t]`` for every ``t``, without a shift: all ``seq`` targets
train (Hugging Face's ``labels`` shift inside the model instead, and a window of ``seq`` labels
trains only ``seq - 1`` of them).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dapple.core.attention import MASKED, check_attention
from dapple.datasets.documents import IGNORE_INDEX, masked_token_loss
from dapple.errors import ValidationError, one_line
from dapple.models.hf_attention import use_attention
from dapple.models.shapes import DynamicDim
from dapple.models.split import workload_from_module
from dapple.models.workload import Workload

__all__ = [
    "bert",
    "bert_mlm_loss",
    "causal_lm_loss",
    "gpt2",
    "hf_bert",
    "hf_causal_lm",
    "hf_config",
    "hf_gpt2",
]


MIN_TRANSFORMERS = (5, 23)
"""The oldest ``transformers`` dapple runs (pyproject's ``hf`` extra, ``transformers>=5.23``):
5.17 fails inside an HF LLaMA's rotary embedding under bf16 autocast ("Tensor dtype mismatch")."""


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string (``5.24.0.dev0`` -> ``(5, 24, 0)``)."""
    return tuple(int(n) for n in re.findall(r"\d+", version.split("+")[0].split("dev")[0])[:3])


def _transformers() -> Any:
    """The ``transformers`` module, checked against :data:`MIN_TRANSFORMERS`.

    Raises:
        ValidationError: Not installed, or older than the minimum (one line naming both).
    """
    try:
        import transformers
    except ImportError as e:
        raise ValidationError(
            "Hugging Face workloads need the optional dependency: pip install 'dapple[hf]'"
        ) from e
    installed = str(getattr(transformers, "__version__", "0"))
    if _release(installed) < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ValidationError(
            f"transformers {installed} is installed; dapple's Hugging Face models need "
            f"transformers>={need} (pip install 'transformers>={need}')"
        )
    return transformers


@functools.cache
def _bert_class() -> type[nn.Module]:
    tf = _transformers()

    class BertMLMLogits(tf.BertForMaskedLM):  # type: ignore[misc, name-defined]
        """``BertForMaskedLM`` called positionally, returning only the logits."""

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask)
            return out.logits  # type: ignore[no-any-return]

    return BertMLMLogits


@functools.cache
def _causal_lm_class(base: type[nn.Module]) -> type[nn.Module]:
    """``base`` (a ``transformers`` causal-LM class) called positionally, returning logits.

    ``transformers`` decides whether a model may use its traceable mixture-of-experts kernels
    (``grouped_mm``, the default) by reading the source of the module that defines the model
    class; the subclass is defined here, so it answers with ``base``'s module. Without that, a
    mixture of experts such as Mixtral falls back to the eager loop over the experts that were
    hit, which ``torch.export`` cannot trace (its trip count depends on the routing).
    """

    class CausalLMLogits(base):  # type: ignore[misc, valid-type]
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            out = super().forward(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            )
            return out.logits  # type: ignore[no-any-return]

    base_can_set = getattr(base, "_can_set_experts_implementation", None)
    if base_can_set is not None:  # a classmethod bound to base: answers for base's module
        CausalLMLogits._can_set_experts_implementation = classmethod(lambda cls: base_can_set())
    CausalLMLogits.__name__ = CausalLMLogits.__qualname__ = base.__name__
    return CausalLMLogits


def _config_from_dir(path: str) -> Any:
    """The ``config.json`` of the model directory ``path`` (offline).

    Raises:
        ValidationError: one line: no such directory, no ``config.json`` in it, or one
            ``transformers`` cannot read (not JSON, an unknown ``model_type``...).
    """
    d = Path(path)
    if not d.is_dir():
        what = "is a file, not a directory" if d.exists() else "does not exist"
        raise ValidationError(f"hf:DIR {path!r} {what}: give a Hugging Face model directory")
    if not (d / "config.json").is_file():
        raise ValidationError(
            f"hf:DIR {path!r} holds no config.json: give a Hugging Face model directory (as "
            "save_pretrained writes it)"
        )
    tf = _transformers()
    try:
        return tf.AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # OSError, ValueError (unknown model_type), JSON errors
        raise ValidationError(
            f"cannot read the Hugging Face config {str(d / 'config.json')!r}: {one_line(e)}"
        ) from e


class _DirModel:
    """Picklable factory: the causal LM whose ``config.json`` is in ``path`` (offline), its
    attention as ``attention`` says (:func:`~dapple.models.hf_attention.use_attention`)."""

    def __init__(self, path: str, attention: str = MASKED) -> None:
        self.path = path
        self.attention = attention

    def hf_config(self) -> Any:
        return _config_from_dir(self.path)

    def hf_class(self, config: Any) -> Any:
        """The ``transformers`` causal-LM class ``AutoModelForCausalLM`` maps ``config`` to."""
        mapping = _transformers().models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
        try:
            return mapping[type(config)]
        except KeyError as e:
            raise ValidationError(
                f"{self.path}: {type(config).__name__} has no causal-LM model in transformers"
            ) from e

    def __call__(self) -> nn.Module:
        config = self.hf_config()
        config.use_cache = False
        model = _causal_lm_class(self.hf_class(config))(config)
        return use_attention(model, self.attention)


class _Model:
    """Picklable factory: the logits-only model class ``kind`` built from config kwargs."""

    def __init__(self, kind: str, config: dict[str, Any]) -> None:
        self.kind = kind
        self.config = config

    def hf_config(self) -> Any:
        tf = _transformers()
        return (tf.GPT2Config if self.kind == "gpt2" else tf.BertConfig)(**self.config)

    def hf_class(self, config: Any) -> Any:
        tf = _transformers()
        return tf.GPT2LMHeadModel if self.kind == "gpt2" else tf.BertForMaskedLM

    def __call__(self) -> nn.Module:
        config = self.hf_config()
        if self.kind == "gpt2":
            return _causal_lm_class(self.hf_class(config))(config)
        return _bert_class()(config)


class _CausalBatch:
    """``(batch_size, seed) -> ((x, attention_mask), y)``: windows ``w`` of ``n + 1`` random
    tokens, ``x = w[:, :-1]``, ``y = w[:, 1:]`` (the next tokens), an all-ones mask; ``n`` is
    ``seq``, or ``seq_choices[seed % len(seq_choices)]`` when given."""

    def __init__(self, vocab: int, seq: int, seq_choices: Sequence[int] = ()) -> None:
        self.vocab = vocab
        self.seq = seq
        self.seq_choices = tuple(int(c) for c in seq_choices)

    def __call__(self, batch_size: int, seed: int) -> tuple[Any, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        n = self.seq_choices[seed % len(self.seq_choices)] if self.seq_choices else self.seq
        window = torch.randint(0, self.vocab, (batch_size, n + 1), generator=gen)
        mask = torch.ones(batch_size, n, dtype=torch.long)
        return (window[:, :-1].clone(), mask), window[:, 1:].clone()


def _seq_dims(seq: int, seq_choices: Sequence[int] | None) -> dict[int | str, Any] | None:
    """``seq_choices`` checked against the position table, and the token dimension of
    ``input_ids`` and ``attention_mask`` declared dynamic in ``[2, seq]``."""
    if not seq_choices:
        return None
    if any(not 2 <= int(c) <= seq for c in seq_choices):
        raise ValidationError(
            f"seq_choices {list(seq_choices)} must lie in [2, seq={seq}] (the position table)"
        )
    dim = DynamicDim("seq", 2, seq)
    return {0: {1: dim}, 1: {1: dim}}


class _MaskedBatch:
    """Right-padded samples with ``n_mask`` ``[MASK]`` positions each (see :func:`hf_bert`)."""

    def __init__(self, vocab: int, seq: int, n_mask: int, min_len: int) -> None:
        self.vocab = vocab
        self.seq = seq
        self.n_mask = n_mask
        self.min_len = min_len

    def __call__(self, batch_size: int, seed: int) -> tuple[Any, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        seq, mask_id = self.seq, self.vocab - 1
        ids = torch.randint(1, mask_id, (batch_size, seq), generator=gen)
        lengths = torch.randint(self.min_len, seq + 1, (batch_size,), generator=gen)
        attention = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        ids = ids * attention
        targets = torch.full_like(ids, IGNORE_INDEX)
        for b in range(batch_size):
            pos = torch.randperm(int(lengths[b]), generator=gen)[: self.n_mask]
            targets[b, pos] = ids[b, pos]
            ids[b, pos] = mask_id
        return (ids, attention), targets


def _check(**values: int) -> None:
    bad = {k: v for k, v in values.items() if v < 1}
    if bad:
        raise ValidationError(f"Hugging Face workload sizes must be >= 1, got {bad}")
    if values["hidden"] % values["heads"]:
        raise ValidationError(
            f"hidden={values['hidden']} is not divisible by heads={values['heads']}"
        )


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy: ``logits[:, t]`` against ``targets[:, t]`` for every ``t``.

    ``targets`` are already the next tokens (``y[t]`` is the token after ``x[t]``, see the module
    docstring), so nothing is shifted and every target trains. Positions whose target is
    ``IGNORE_INDEX`` (padding) do not count: each sample's mean over its own targets, then the
    mean over samples (:func:`~dapple.datasets.masked_token_loss`), so a slice of ``k`` of ``G``
    samples contributes ``loss * k / G`` (the :class:`~dapple.models.workload.Workload` loss
    convention). Without padding every sample has the same count and this is the plain token
    mean, Hugging Face's loss over the same targets.
    """
    return masked_token_loss(logits, targets)


def bert_mlm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Masked-LM cross-entropy over positions whose label is not ``IGNORE_INDEX`` (mean).

    The batch maker masks the same number of positions in every sample, so the mean over
    masked tokens is the mean of per-sample means.
    """
    vocab = logits.size(-1)
    return F.cross_entropy(
        logits.reshape(-1, vocab).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


def hf_gpt2(
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 256,
    seq: int = 32,
    dropout: float = 0.0,
    split_at: Sequence[str] | None = None,
    seq_choices: Sequence[int] | None = None,
) -> Workload:
    """GPT-2 causal LM (tied embeddings) from a config, inputs ``(input_ids, attention_mask)``.

    Args:
        layers: Transformer blocks (``n_layer``).
        hidden: Model width (``n_embd``).
        heads: Attention heads.
        vocab: Vocabulary size.
        seq: Sequence length of every sample (also ``n_positions``).
        dropout: Dropout probability of residual, embedding and attention dropout.
        split_at: Module names to cut before (e.g. ``["transformer.h.2", "lm_head"]``);
            ``None``: every block.
        seq_choices: Tokens per sample changing from step to step (seed ``t``:
            ``seq_choices[t % len]``, each in ``[2, seq]``); the pieces are traced with the
            token dimension dynamic. None: always ``seq``.

    Raises:
        ValidationError: Bad sizes, bad ``split_at`` names, or ``transformers`` is missing.
    """
    _check(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq)
    _transformers()
    config = dict(
        n_layer=layers,
        n_embd=hidden,
        n_head=heads,
        vocab_size=vocab,
        n_positions=seq,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        use_cache=False,
        tie_word_embeddings=True,
    )
    return workload_from_module(
        _Model("gpt2", config),
        _CausalBatch(vocab, seq, seq_choices or ()),
        causal_lm_loss,
        split_at=split_at,
        name=f"hf-gpt2-{layers}x{hidden}",
        dynamic_dims=_seq_dims(seq, seq_choices),
    )


def hf_bert(
    layers: int = 4,
    hidden: int = 64,
    heads: int = 4,
    vocab: int = 256,
    seq: int = 32,
    dropout: float = 0.0,
    masked_per_sample: int | None = None,
    split_at: Sequence[str] | None = None,
) -> Workload:
    """BERT masked LM (tied decoder) from a config, inputs ``(input_ids, attention_mask)``.

    Each sample is right-padded to ``seq`` from a random length in ``[seq/2, seq]`` and has
    exactly ``masked_per_sample`` non-pad positions replaced by the ``[MASK]`` id
    (``vocab - 1``); targets hold the original ids there and ``IGNORE_INDEX`` elsewhere.

    Args:
        layers: Encoder layers.
        hidden: Model width.
        heads: Attention heads.
        vocab: Vocabulary size (id ``vocab - 1`` is ``[MASK]``, ``0`` is padding).
        seq: Sequence length (also ``max_position_embeddings``).
        dropout: Hidden and attention dropout probability.
        masked_per_sample: Masked positions per sample (default ``max(1, seq // 8)``).
        split_at: Module names to cut before (e.g. ``["bert.encoder.layer.2", "cls"]``);
            ``None``: every layer.

    Raises:
        ValidationError: Bad sizes, bad ``split_at`` names, or ``transformers`` is missing.
    """
    _check(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq)
    n_mask = masked_per_sample if masked_per_sample is not None else max(1, seq // 8)
    min_len = max(1, seq // 2)
    if not 1 <= n_mask <= min_len:
        raise ValidationError(f"masked_per_sample={n_mask} must be in [1, {min_len}]")
    if vocab < 3:
        raise ValidationError(f"vocab={vocab} must be >= 3 (padding, tokens, [MASK])")
    _transformers()
    config = dict(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        vocab_size=vocab,
        max_position_embeddings=seq,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    return workload_from_module(
        _Model("bert", config),
        _MaskedBatch(vocab, seq, n_mask, min_len),
        bert_mlm_loss,
        split_at=split_at,
        name=f"hf-bert-{layers}x{hidden}",
    )


def hf_config(workload: Workload) -> Any | None:
    """The ``transformers`` config of a workload built by this module (``None`` for others),
    with ``architectures`` naming the ``transformers`` model class."""
    from dapple.models.split import model_factory_of

    try:
        factory = model_factory_of(workload)
    except ValidationError:
        return None
    if not isinstance(factory, (_DirModel, _Model)):
        return None
    config = factory.hf_config()
    config.architectures = [factory.hf_class(config).__name__]
    return config


def hf_causal_lm(
    path: str | Path,
    seq: int = 32,
    split_at: Sequence[str] | None = None,
    seq_choices: Sequence[int] | None = None,
    attention: str = MASKED,
) -> Workload:
    """Any ``transformers`` causal LM from a local directory holding its ``config.json``.

    The model class is the one ``AutoModelForCausalLM`` maps the config to (LLaMA, Mistral,
    Qwen2, GPT-2, ...), built offline with random weights on the meta device; it trains as a
    causal LM on synthetic tokens of the config's vocabulary. Give pretrained weights with the
    ``weights`` override of :func:`dapple.models.spec.load` (``--weights`` on the CLI).

    Args:
        path: Directory with ``config.json``.
        seq: Tokens per sample (at most the config's ``max_position_embeddings``).
        split_at: Module names to cut before; ``None``: every decoder block.
        seq_choices: Tokens per sample changing from step to step, as in :func:`hf_gpt2`.
        attention: ``masked`` (SDPA given the causal mask, as the traced model comes) or
            ``causal`` (SDPA's ``is_causal``, no mask; a family of
            :data:`~dapple.models.hf_attention.CAUSAL_FAMILIES` that runs SDPA):
            :mod:`dapple.models.hf_attention`.

    Raises:
        ValidationError: No readable config, no causal-LM class for it, a bad ``seq``, an
            unknown ``attention`` (or ``causal`` for another family or a model without SDPA),
            or a model ``torch.export`` cannot trace.
    """
    check_attention(attention)
    where = str(Path(path).resolve())
    config = _config_from_dir(where)
    vocab = int(config.vocab_size)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if seq < 2 or (limit is not None and seq > int(limit)):
        raise ValidationError(f"seq={seq} must be in [2, {limit}] for the config in {where}")
    return workload_from_module(
        _DirModel(where, attention),
        _CausalBatch(vocab, seq, seq_choices or ()),
        causal_lm_loss,
        split_at=split_at,
        name=f"hf-{config.model_type}",
        dynamic_dims=_seq_dims(seq, seq_choices),
    )


def gpt2(**kwargs: Any) -> Workload:
    """Zoo spec ``dapple.models.hf:gpt2``: :func:`hf_gpt2` with the same keyword arguments."""
    return hf_gpt2(**kwargs)


def bert(**kwargs: Any) -> Workload:
    """Zoo spec ``dapple.models.hf:bert``: :func:`hf_bert` with the same keyword arguments."""
    return hf_bert(**kwargs)

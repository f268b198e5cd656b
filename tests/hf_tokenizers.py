"""Tiny Hugging Face tokenizers made offline (need ``transformers`` and ``tokenizers``)."""

from __future__ import annotations

from pathlib import Path

TEXTS = ["hello world", "the cat sat on the mat", "hello cat", "a mat for the world"]
"""What the tokenizer is trained on: prompts should use these characters."""


def save_tokenizer(path: Path, extra_tokens: int = 0, chat_template: bool = False) -> Path:
    """A byte-level BPE tokenizer of 36 tokens (+ ``extra_tokens`` added ones) trained on
    :data:`TEXTS`, saved into ``path`` with ``save_pretrained``."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=36, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(TEXTS, trainer)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    if extra_tokens:
        fast.add_tokens([f"<extra{i}>" for i in range(extra_tokens)])
    if chat_template:
        fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(path)
    return path

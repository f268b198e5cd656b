"""``dapple generate``: continue a prompt with your own trained model.

The weights are a training run's newest checkpoint (``--checkpoint-dir``) or pretrained ones
(``--weights``); the model is given as on ``dapple train`` (``-m``, ``--set``). Tokens are bytes
(vocabulary 256, what ``dapple data prepare`` makes without a tokenizer) unless ``--tokenizer
DIR`` names a Hugging Face tokenizer, or the ``hf:DIR`` model's directory holds one. The prompt
and its continuation are printed on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import unicodedata
from typing import TYPE_CHECKING

from dapple.api.generating import GenerateConfig
from dapple.cli._console import StepProgress, console
from dapple.cli._model_args import add_model_arguments, model_config
from dapple.errors import ValidationError

if TYPE_CHECKING:
    from dapple.models.generate import Generated

__all__ = [
    "PROGRESS_DELAY_S",
    "PROGRESS_MIN_TOKENS",
    "generate_config_of",
    "register",
    "run_config",
]

PROGRESS_MIN_TOKENS = 256
"""A request for at least this many tokens shows progress on stderr (fewer: none)."""
PROGRESS_DELAY_S = 2.0
"""Seconds before that progress first shows: a long request that ends sooner prints none."""


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "generate",
        help="continue a prompt with a trained model (a checkpoint or --weights), bytes or a "
        "Hugging Face tokenizer",
    )
    p.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="checkpoint root (its newest complete checkpoint) or one step-NNNNNNNN directory; "
        "give the model as trained (-m, --set; --set seq=N for train's --seq-len N)",
    )
    add_model_arguments(p)  # the model as on `dapple train`; --weights instead of a checkpoint
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        metavar="N",
        help="tokens to add, 1 to 65536 (default %(default)s; end-of-sequence does not stop it; "
        "the window slides, so the model's positions do not limit N)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="a local Hugging Face tokenizer directory (default: an hf:DIR model's own "
        "tokenizer when DIR has one, else bytes, vocabulary 256)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0: greedy; above 0: sample softmax(logits / T) (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of the sampling (default 0)"
    )
    p.set_defaults(func=run)


def generate_config_of(args: argparse.Namespace) -> GenerateConfig:
    """The :class:`~dapple.api.generating.GenerateConfig` of ``dapple generate``'s flags.

    Raises:
        ValidationError: a ``--set`` item without ``=``.
    """
    return GenerateConfig(
        model=model_config(args),
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        checkpoint_dir=args.checkpoint_dir,
        tokenizer=args.tokenizer,
        temperature=args.temperature,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    return run_config(generate_config_of(args))


def run_config(cfg: GenerateConfig) -> int:
    """Continue ``cfg``'s prompt (:func:`dapple.api.generate`) and print it with its
    continuation on stdout (``dapple generate`` once its flags are read)."""
    from dapple import api
    from dapple.api.generating import check_prompt_and_seed

    if (cfg.checkpoint_dir is None) == (cfg.model.weights is None):
        raise ValidationError(
            "give the weights to generate with: --checkpoint-dir DIR (a training run's "
            "checkpoints) or --weights PATH (pretrained), one of them"
        )
    check_prompt_and_seed(cfg.prompt, cfg.seed, flags=True)
    loaded = None
    if cfg.checkpoint_dir is not None:
        from dapple.runtime.export import newest_checkpoint

        loaded = newest_checkpoint(cfg.checkpoint_dir)  # none: api.generate says so, one line
    with _progress(cfg.max_new_tokens) as progress:
        result = api.generate(cfg, progress=progress)
    if loaded is not None:
        print(
            f"generated from the checkpoint of step {loaded.step} ({loaded.path})", file=sys.stderr
        )
    cut = prompt_cut(result)
    if cut:
        print(cut, file=sys.stderr)
    print(terminal_safe(result.text) if sys.stdout.isatty() else result.text)
    return 0


def _progress(new_tokens: int) -> contextlib.AbstractContextManager[StepProgress | None]:
    """Progress on stderr (so stdout holds only the text) for a request of at least
    :data:`PROGRESS_MIN_TOKENS` tokens, shown once it has run :data:`PROGRESS_DELAY_S`."""
    if new_tokens < PROGRESS_MIN_TOKENS:
        return contextlib.nullcontext()
    return StepProgress(
        "generate", new_tokens, console=console(stderr=True), delay_s=PROGRESS_DELAY_S
    )


def terminal_safe(text: str) -> str:
    """``text`` with control and other non-printing characters (but newlines and tabs) shown
    as escapes (``\\x1b``), so a generated escape sequence cannot drive the terminal."""
    return "".join(
        c
        if c in "\n\t" or unicodedata.category(c)[0] != "C"
        else c.encode("unicode_escape").decode()
        for c in text
    )


def prompt_cut(result: Generated) -> str:
    """A warning when the prompt is longer than the model's context (``--set seq``): the model
    continues from its last ``context`` tokens only; empty otherwise."""
    n, c = result.prompt_tokens, result.context
    if not c or n <= c:
        return ""
    return (
        f"dapple: warning: the prompt is {n} tokens but the model sees at most {c} (--set "
        f"seq): it continued from the last {c}, the first {n - c} are printed but were not seen"
    )

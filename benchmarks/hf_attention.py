"""What a traced Hugging Face causal LM's attention costs (issue 46): forward + backward of the
eager HF model, of dapple's traced pieces as they come (``attention=masked``: SDPA given the
materialised causal mask, K and V copied per head) and with ``attention=causal`` (SDPA's
``is_causal``, no mask; :mod:`dapple.models.hf_attention`), same weights and batch.

One process, one torch thread, CPU. The three run back to back in each round (the order rotates),
after two warm-up passes each; a row gives each side's median ms and the paired ratios (the
eager model's time over the pieces' in the same round: 1.0 is the eager model's speed), median
and range over the rounds. Llama configurations (GQA: half as many KV heads as query heads).

    python benchmarks/hf_attention.py [--rounds 12] [--sizes tiny,medium,long] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _bench_common import header, load_note, write_report

SIZES = {
    "tiny": {"hidden": 64, "layers": 2, "seq": 32, "batch": 2},
    "medium": {"hidden": 256, "layers": 4, "seq": 256, "batch": 4},
    "long": {"hidden": 256, "layers": 2, "seq": 1024, "batch": 1},
}
SIDES = ("eager HF", "pieces masked", "pieces causal")


def _llama_dir(size: dict[str, int], root: Path) -> str:
    """A Llama ``config.json`` of ``size`` in a folder under ``root``; its ``hf:`` spec."""
    h = size["hidden"]
    d = root / f"llama-{h}x{size['layers']}"
    d.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
              "intermediate_size": 4 * h, "num_hidden_layers": size["layers"],
              "num_attention_heads": max(4, h // 64), "num_key_value_heads": max(2, h // 128),
              "vocab_size": 2048, "max_position_embeddings": max(2048, size["seq"]),
              "tie_word_embeddings": False}  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    return f"hf:{d}"


def _passes(spec: str, size: dict[str, int]) -> dict[str, Any]:
    """Each side's forward + backward as a function returning its ms (the pieces share their
    weights: both built from seed 0)."""
    from dapple import api
    from dapple.models.hf import _transformers, causal_lm_loss

    seq = size["seq"]
    masked = api.load(spec, seq=seq, attention="masked")
    causal = api.load(spec, seq=seq, attention="causal")
    (ids, mask), y = masked.make_batch(size["batch"], 0)
    pieces_m, pieces_c = masked.build_model(0).train(), causal.build_model(0).train()
    tf = _transformers()
    hf = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(spec[3:])).train()

    def timed(forward: Any) -> Any:
        def run() -> float:
            t0 = time.perf_counter()
            causal_lm_loss(forward().float(), y).backward()
            return (time.perf_counter() - t0) * 1e3

        return run

    return {
        "eager HF": timed(lambda: hf(input_ids=ids, attention_mask=mask, use_cache=False).logits),
        "pieces masked": timed(lambda: pieces_m((ids, mask))),
        "pieces causal": timed(lambda: pieces_c((ids, mask))),
    }


def measure(name: str, rounds: int, root: Path) -> list[str]:
    import torch

    torch.set_num_threads(1)
    size = SIZES[name]
    passes = _passes(_llama_dir(size, root), size)
    for side in SIDES:
        passes[side]()
        passes[side]()
    ms: dict[str, list[float]] = {s: [] for s in SIDES}
    for r in range(rounds):
        order = SIDES[r % 3 :] + SIDES[: r % 3]
        for side in order:
            ms[side].append(passes[side]())
    cells = []
    for side in SIDES[1:]:
        ratios = [e / p for e, p in zip(ms["eager HF"], ms[side], strict=True)]
        cells.append(f"{statistics.median(ratios):.3f} [{min(ratios):.2f}-{max(ratios):.2f}]")
    med = [f"{statistics.median(ms[s]):.2f}" for s in SIDES]
    return [f"| {name} {size} | {' | '.join(med)} | {' | '.join(cells)} |"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--sizes", default="tiny,medium,long")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    command = "python benchmarks/hf_attention.py " + " ".join(sys.argv[1:])
    lines = header("A traced HF causal LM's attention: masked vs causal vs the eager model",
                   command.strip())  # fmt: skip
    lines += [
        f"Forward + backward of one batch, 1 torch thread, {args.rounds} rounds (order rotating), "
        "2 warm-up passes per side; ms = median; ratio = eager HF ms / pieces ms in the same "
        "round (1.0: the eager model's speed), median [range].",
        "",
        "| model | eager HF ms | pieces masked ms | pieces causal ms | masked: eager/pieces "
        "| causal: eager/pieces |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes.split(","):
            lines += measure(name, args.rounds, Path(tmp))
            print(lines[-1], flush=True)
    lines += ["", f"End: {load_note()}."]
    write_report(lines, args.out)


if __name__ == "__main__":
    main()

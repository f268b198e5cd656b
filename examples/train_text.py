"""Train a small transformer on a text file with a 3:1 pipeline on 4 CPU processes.

Run: ``python examples/train_text.py [TEXT_FILE]`` (default: this repository's README; about
a minute on 2 cores).

The text becomes byte tokens (``train.bin``, ``val.bin``, ``meta.json`` in a temporary
directory); the run saves a checkpoint half-way, and a second launch resumes from it and
continues with exactly the batches an uninterrupted run would take.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import dapple.api as dp
from dapple.core.plan import straight_plan
from dapple.datasets import prepare

MODEL = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256}
SEQ_LEN, STEPS = 32, 20


def main() -> int:
    text = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "README.md"
    with tempfile.TemporaryDirectory(prefix="dapple-text-") as tmp:
        data = prepare([text], Path(tmp) / "train.bin", val_fraction=0.05)
        print(f"{data.train_tokens:,} training tokens, {data.val_tokens:,} validation tokens")
        # transformer: embedding, 2 blocks, head; 3 replicas of [0, 2), one process for [2, 4)
        plan = straight_plan(4, [0, 2], global_batch_size=16, num_micro_batches=2, replicas=[3, 1])
        run = dict(data=data.train, seq_len=SEQ_LEN, overrides=MODEL, optimizer="adam", lr=3e-3)
        ck = str(Path(tmp) / "ck")
        first = dp.train(
            plan, "transformer", STEPS // 2, checkpoint_dir=ck, save_every=STEPS // 2, **run
        )
        rest = dp.train(plan, "transformer", STEPS, checkpoint_dir=ck, resume=True, **run)
        for m in first + rest:
            print(f"step {m.step:3d} loss {m.loss:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

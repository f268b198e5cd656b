"""What the GPU check's steps share: the step context, the model shapes, and small helpers.

The realistic size is Llama-3-8B's block cut to 2 blocks (hidden 4096, 32 heads, 8 KV heads,
FFN 14,336, vocabulary 128,256) at 4,096 tokens per sample, global batch 2, AdamW, bf16
autocast, as in ``../shared/evidence/h200-2026-11-28/run2-realistic.md``. A dry run (no GPU, CI)
runs every step on the CPU at :data:`TINY` shapes instead.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SKIPPED = 3
"""Exit code of a step that skipped itself (its reason is its last output line)."""

LLAMA3_8B_2L = {"layers": 2, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336,
                "vocab": 128256, "seq": 4096}  # fmt: skip
"""Llama-3-8B's shapes (its ``config.json``), 2 blocks, seq 4096."""

TINY = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 160, "vocab": 256, "seq": 32}
"""The dry run's shapes: the same structure (GQA, SwiGLU, untied head), CPU-sized."""

GLOBAL_BATCH = 2
"""Samples per step of the realistic steps."""


@dataclass(frozen=True)
class Ctx:
    """One step's run: where it writes, and at which size and on which device it runs."""

    work: Path
    """The part's folder: every input and output of the step goes here."""
    dry: bool
    """CPU at :data:`TINY` shapes (CI); else CUDA at :data:`LLAMA3_8B_2L`."""
    device: str
    """``cuda`` or ``cpu`` (dry run)."""

    @property
    def shapes(self) -> dict[str, int]:
        return TINY if self.dry else LLAMA3_8B_2L

    @property
    def rounds(self) -> int:
        """Interleaved rounds of a comparison (the dry run: 1)."""
        return 1 if self.dry else 2

    @property
    def timing(self) -> dict[str, int]:
        """``repeats`` and ``warmup`` of a profile (dapple's defaults; the dry run: fewer)."""
        return {"repeats": 2, "warmup": 1} if self.dry else {"repeats": 5, "warmup": 2}

    def path(self, name: str) -> Path:
        return self.work / name


def context(work: Path, dry: bool) -> Ctx:
    """The context of a step: a dry run runs on the CPU; otherwise the step needs CUDA and,
    without it, stops here (exit :data:`SKIPPED` with the reason)."""
    import torch

    if dry:
        return Ctx(work, True, "cpu")
    if not torch.cuda.is_available():
        print("skipped: no CUDA device (run with --dry-run for the CPU dry run)")
        sys.exit(SKIPPED)
    return Ctx(work, False, "cuda")


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    """Free cached blocks and restart ``max_memory_allocated`` (CUDA)."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_mib(device: str) -> float:
    """``torch.cuda.max_memory_allocated`` in MiB; NaN on the CPU."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")


def llama_config(shapes: dict[str, int]) -> Any:
    """An HF ``LlamaConfig`` of these shapes (no download; dapple's transformers check first)."""
    from dapple.models.hf import _transformers

    tf = _transformers()
    return tf.LlamaConfig(
        num_hidden_layers=shapes["layers"], hidden_size=shapes["hidden"],
        intermediate_size=shapes["ffn"], num_attention_heads=shapes["heads"],
        num_key_value_heads=shapes["kv_heads"], vocab_size=shapes["vocab"],
        max_position_embeddings=max(8192, shapes["seq"]), rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu",
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip


def llama_spec(ctx: Ctx) -> str:
    """``hf:DIR`` of the Llama config, written into the step's folder (an input kept in OUT)."""
    d = ctx.path("llama3-8b-2l" if not ctx.dry else "llama-tiny")
    d.mkdir(parents=True, exist_ok=True)
    llama_config(ctx.shapes).save_pretrained(d)
    return f"hf:{d}"


def gpt2_spec(ctx: Ctx) -> str:
    """``hf:DIR`` of a GPT-2 at the Llama's width (2 blocks, vocabulary 50,257; dry: tiny)."""
    from dapple.models.hf import _transformers

    s = ctx.shapes
    d = ctx.path("gpt2-4096-2l" if not ctx.dry else "gpt2-tiny")
    d.mkdir(parents=True, exist_ok=True)
    _transformers().GPT2Config(
        n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"],
        vocab_size=50257 if not ctx.dry else s["vocab"], n_positions=s["seq"],
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, architectures=["GPT2LMHeadModel"],
    ).save_pretrained(d)  # fmt: skip
    return f"hf:{d}"


def save_json(ctx: Ctx, name: str, obj: Any) -> str:
    """Write ``obj`` as JSON into the step's folder; its file name."""
    ctx.path(name).write_text(json.dumps(obj, indent=1, default=str) + "\n")
    return name


def cores() -> str:
    """This process's CPU affinity, e.g. ``0-3 (4 of 16)``."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    total = os.cpu_count() or 0
    if not mine:
        return f"all {total}"
    span = f"{mine[0]}-{mine[-1]}" if mine == list(range(mine[0], mine[-1] + 1)) else str(mine)
    return f"{span} ({len(mine)} of {total})"


SINK: Path | None = None
"""Where :func:`say` keeps the step's report lines so far (set by the runner; a step that
fails or runs out of time keeps what it said)."""


def say(lines: list[str], line: str = "") -> None:
    """Append a report line, echo it to the step's log and keep the lines so far in
    :data:`SINK`."""
    lines.append(line)
    print(line, flush=True)
    if SINK is not None:
        SINK.write_text(json.dumps(lines))

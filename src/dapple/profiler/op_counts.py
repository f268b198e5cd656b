"""What runs in a stretch of code, counted: ``aten::`` ops (``torch.profiler`` CPU events,
nested ones included) and Python calls (``cProfile``). Counts, never time: they do not move
with the machine's load, so a test can bound them."""

from __future__ import annotations

import cProfile
import pstats
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["OpCounter", "OpCounts"]


@dataclass(frozen=True)
class OpCounts:
    """Counts of one window: each ``aten::`` op by name, each Python function by
    ``file:line(name)``."""

    ops: Counter[str]
    calls: Counter[str]

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())


class OpCounter:
    """Counts what runs between :meth:`start` and :meth:`stop` (one window at a time)."""

    def start(self) -> None:
        self._calls = cProfile.Profile()
        ops: Any = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False
        )
        self._ops = ops
        ops.__enter__()
        self._calls.enable()

    def stop(self) -> OpCounts:
        self._calls.disable()
        self._ops.__exit__(None, None, None)
        stats: Any = pstats.Stats(self._calls)
        calls: Counter[str] = Counter()
        for (path, line, name), v in stats.stats.items():
            calls[f"{Path(path).name}:{line}({name})"] += v[1]
        ops = Counter(e.name for e in self._ops.events() if e.name.startswith("aten::"))
        return OpCounts(ops=ops, calls=calls)

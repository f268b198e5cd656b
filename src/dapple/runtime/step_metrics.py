"""What a training run reports for each step: :class:`StepMetrics`, from rank 0.

Torch-free: the CLI prints :meth:`StepMetrics.line`; the runtime fills the records
(:mod:`dapple.runtime.metrics`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["StepMetrics"]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"  # pragma: no cover


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One training step as seen from rank 0."""

    step: int
    loss: float
    """Mean loss over the global batch (summed from the last stage's slices)."""
    step_ms: float
    """Wall time per step: rank 0's time from the previous step's collective to this step's
    (the first step of a run: from its start), where every rank meets (see
    :mod:`dapple.runtime.engine`); with ``on_nonfinite="off"`` where rank 0 posts its row,
    waiting for no other rank (:mod:`dapple.runtime.late_rows`)."""
    samples_per_s: float
    """Global batch over ``step_ms``."""
    peak_memory_bytes: tuple[int, ...]
    """Per stage, max over its replicas (CUDA: over the same period as ``step_ms``); with
    interleaving per device group (all its chunks)."""
    memory_kind: str
    """``cuda_max_allocated`` or ``held_activations`` (CPU, see :mod:`dapple.runtime.memory`)."""
    predicted_step_ms: float | None = None
    peak_resident_bytes: tuple[int, ...] = ()
    """Per stage, max over its replicas: the process's peak resident memory so far (CPU:
    ``VmHWM``, read again when ``getrusage``'s peak moves, so it may lag by the kernel's
    per-CPU counter slack, :class:`~dapple.runtime.metrics.PeakResident`; CUDA:
    ``max_memory_reserved`` over the same period as ``step_ms``)."""
    stage_resident_bytes: tuple[int, ...] = ()
    """Per stage, max over its replicas: ``peak_resident_bytes`` less the resident memory before
    the rank built its stage - what the stage's weights, gradients, optimizer state and
    activations added (the planner's per-replica estimate models this)."""
    resident_kind: str = ""
    """``VmHWM`` or ``cuda_max_reserved`` (empty: not measured)."""
    lr: float | None = None
    """The learning rate the step's optimizer update used (None: no update ran)."""
    grad_norm: float | None = None
    """The global gradient norm of the whole model before clipping (None: not computed)."""
    eval_loss: float | None = None
    """Mean validation loss measured after this step (None: no evaluation this step)."""
    tokens_per_s: float | None = None
    """Target tokens of the global batch over ``step_ms`` (None: not a token workload)."""
    tokens: int | None = None
    """Target tokens of the step's global batch; changes from step to step with the sequence
    length (None: not a token workload)."""
    expert_layers: tuple[int, ...] = ()
    """The layer of each MoE layer counted (model order; empty: the model has none the runtime
    counts, :mod:`dapple.runtime.parallel.expert.load`)."""
    expert_load: tuple[tuple[int, ...], ...] = ()
    """Per MoE layer, the token rows its router sent to each expert in this step, summed over
    the replicas (a token counts once per chosen expert: a layer's loads sum to tokens x top-k)."""
    expert_imbalance: tuple[float, ...] = ()
    """Per MoE layer, max/mean of its expert load (1: balanced; E: one expert got every row)."""
    expert_aux_loss: tuple[float | None, ...] = ()
    """Per MoE layer, its load-balancing loss ``E * sum_i f_i * P_i`` over the step's tokens (k:
    balanced; None: its router's probabilities not found)."""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        mem = " ".join(f"s{i}={_human(b)}" for i, b in enumerate(self.peak_memory_bytes))
        pred = (
            f" (predicted {self.predicted_step_ms:.1f} ms)"
            if self.predicted_step_ms is not None
            else ""
        )
        resident = " ".join(f"s{i}={_human(b)}" for i, b in enumerate(self.peak_resident_bytes))
        resident = f" peak[{self.resident_kind}] {resident}" if resident else ""
        opt = f" lr {self.lr:.3g}" if self.lr is not None else ""
        opt += f" grad_norm {self.grad_norm:.4g}" if self.grad_norm is not None else ""
        ev = f" eval_loss {self.eval_loss:.6f}" if self.eval_loss is not None else ""
        tok = f" {self.tokens} tokens" if self.tokens is not None else ""
        tok += f" {self.tokens_per_s:.0f} tokens/s" if self.tokens_per_s is not None else ""
        if self.expert_imbalance:  # the worst MoE layer
            worst = max(range(len(self.expert_imbalance)), key=self.expert_imbalance.__getitem__)
            tok += (f" expert max/mean {self.expert_imbalance[worst]:.2f} (layer "
                    f"{self.expert_layers[worst]}, worst of {len(self.expert_imbalance)})")  # fmt: skip
        return (
            f"step {self.step} loss {self.loss:.6f}{opt}{ev} time {self.step_ms:.1f} ms{pred} "
            f"{self.samples_per_s:.1f} samples/s{tok} peak[{self.memory_kind}] {mem}{resident}"
        )

"""Peak memory of one replica over a training step, phase by phase (what
``torch.cuda.max_memory_allocated`` reads): the memory model the planner fits stages into (D,
the most micro-batches in flight: :func:`in_flight_limit`), the cost model reports
(:func:`stage_peak`) and the schedule replay and simulator follow over time
(:func:`device_peak`).

Pure, no torch. Bytes are what the runtime (:mod:`dapple.runtime.interpreter`,
:mod:`dapple.runtime.stage`) holds, tensor by tensor:

* **always** (``static``): fp32 parameters, optimizer state (AdamW: two fp32 moments), ZeRO's and
  the AllReduce's buffers (:func:`~dapple.cost.memory.parameter_state_bytes` without the
  gradients), autocast's weight cast cache from the first forward until ``OPT``
  (:func:`~dapple.cost.memory.weight_cast_bytes`: 2 bytes per *cast* parameter,
  ``LayerProfile.cast_parameter_bytes``; an embedding table is looked up, never cast), and on
  CUDA the per-process workspaces (:data:`CUDA_WORKSPACE_BYTES`).
* **gradients** G = P (fp32): the runtime sets them to None at the start of every step
  (``p.grad = None``), so they appear during the step's first backward, layer by layer from the
  last, while that micro-batch's activations are freed; ZeRO's flat buckets and shards stay
  (counted in ``static`` instead).
* **activations** of one micro-batch A: every layer's kept bytes (the stage input only under
  re-computation), the stage output the runtime holds until its gradient comes back (not on the
  last stage), and on the last stage the loss's fp32 log-softmax (:func:`loss_bytes`).
* **the moment of a layer's backward** (layer j of the stage, micro-batch being back-propagated):
  the kept bytes of layers ``<= j`` (later ones are freed), the gradient arriving at its output
  (``output_bytes``), and its weight gradient before it is added to ``.grad``: the 16-bit
  gradient of a cast weight and its fp32 copy (``P_j + cast_j``), an fp32 gradient otherwise
  (the embedding's dense ``V x h`` table). A layer counts as one tensor, an upper bound for a
  block (its largest weight is a fraction of it).
* **the loss moment** (last stage, first in every backward): the fp32 log-softmax (kept) plus the
  NLL gradient and the log-softmax gradient, both fp32 logits-shaped (:func:`loss_bytes`).

Phases, with K in-flight micro-batches (K_i of the schedule) out of M:

* first backward: ``(K - 1) A`` of the other micro-batches, no gradients but those of the layers
  already back-propagated; the forwards before it hold at most ``K A``, which this bounds;
* later backwards (M > 1): all of G, and the other micro-batches in flight: ``K - 1`` when
  a forward runs between backwards (M > K, one-forward-one-backward), ``K - 2`` when they all
  ran before (M == K: GPipe, or DAPPLE's first stages with few micro-batches);
* ``OPT``: G and ``static`` less the cast cache (fused AdamW allocates nothing more).

Measured on one H200 (``shared/evidence/h200-2026-11-28/run2-realistic.md``), the cost model's
older sum (all gradients + a largest layer's gradient + K A at once, the cast of every
parameter, no loss) over-estimated stage 0 of a 1:1 plan by 16% and under-estimated its last
stage by 20%: ``benchmarks/gpu_memory_fit.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dapple.core.layer_profile import LayerProfile
from dapple.core.parallelism import ONE_DEVICE, Parallelism
from dapple.core.plan import StagePlan
from dapple.core.precision import precision_of
from dapple.core.profile import ModelProfile
from dapple.cost.memory import (
    UNBOUNDED_IN_FLIGHT,
    boundary_bytes,
    gradients_in_flight_bytes,
    parameter_state_bytes,
    tensor_kept_bytes_per_sample,
    weight_cast_factor,
)
from dapple.cost.moe import expert_parts, expert_sharded_profile
from dapple.schedule.ir import Action, ActionKind

__all__ = [
    "CUDA_WORKSPACE_BYTES",
    "LOSS_BACKWARD_FP32_COPIES",
    "LOSS_KEPT_FP32_COPIES",
    "StageBytes",
    "StagePeak",
    "cast_bytes",
    "device_peak",
    "device_static",
    "expert_stage_state_bytes",
    "in_flight_limit",
    "loss_bytes",
    "plan_stage_bytes",
    "stage_bytes",
    "stage_peak",
    "stage_state_bytes",
    "workspace_bytes",
]

CUDA_WORKSPACE_BYTES = 64 * 2**20
"""Memory a CUDA process allocates through the caching allocator whatever the model: two cuBLAS
workspaces of 32 MiB (torch's default ``:4096:8`` on Hopper, one per handle: the forward's
thread and autograd's device thread, which runs the backward). Measured: tiny models' peaks
were 63.4-65.8 MiB above the plan on an H200
(``shared/evidence/h200-2026-11-28/run1-gpu_check.md``, profile table: 78.2 - 14.8 ...
67.1 - 1.9 MiB)."""

LOSS_KEPT_FP32_COPIES = 1
"""Logits-shaped fp32 tensors the loss keeps from forward to backward: the log-softmax output
(saved by ``LogSoftmaxBackward`` and ``NllLossBackward``)."""

LOSS_BACKWARD_FP32_COPIES = 2
"""Logits-shaped fp32 tensors the loss's backward adds at its peak: the NLL gradient and the
log-softmax gradient (alive together in ``LogSoftmaxBackward``). Before it, the forward held at
most the 16-bit logits, their fp32 copy (``to_fp32``) and the log-softmax, fewer bytes."""


def workspace_bytes(device: str) -> float:
    """Fixed per-process bytes on ``device`` (``cuda``: :data:`CUDA_WORKSPACE_BYTES`; else 0)."""
    return float(CUDA_WORKSPACE_BYTES) if device.startswith("cuda") else 0.0


def _element_bytes(profile: ModelProfile) -> int:
    return precision_of(profile.precision).element_bytes


def loss_bytes(profile: ModelProfile, samples: int) -> tuple[float, float]:
    """``(kept, backward)`` bytes of the runtime's loss on ``samples`` samples.

    The runtime casts the last layer's output (the logits, ``n`` elements per sample in the
    profile's precision: ``output_bytes_per_sample / e``) to fp32 and takes the cross entropy:
    kept ``4 n`` (:data:`LOSS_KEPT_FP32_COPIES`), and its backward adds ``8 n``
    (:data:`LOSS_BACKWARD_FP32_COPIES`). Llama-3's head at s = 4,096, V = 128,256: n = 525M,
    2,004 MiB kept and 4,008 MiB more in the backward, per sample.
    """
    n = profile.layers[-1].output_bytes_per_sample / _element_bytes(profile) * samples
    return 4.0 * n * LOSS_KEPT_FP32_COPIES, 4.0 * n * LOSS_BACKWARD_FP32_COPIES


def cast_bytes(profile: ModelProfile, layer: LayerProfile) -> float:
    """Autocast's 16-bit copy of ``layer``'s cast parameters (0 in fp32)."""
    cast = (
        layer.parameter_bytes if layer.cast_parameter_bytes is None else layer.cast_parameter_bytes
    )
    return cast * weight_cast_factor(profile.precision)


@dataclass(frozen=True, slots=True, kw_only=True)
class StagePeak:
    """One replica's bytes per phase of a step (module docstring)."""

    static: float
    """Parameters, optimizer state, ZeRO/AllReduce buffers, cast cache, workspaces."""
    first_backward: float
    """Above ``static`` at the worst moment of the step's first backward."""
    later_backward: float
    """Above ``static`` at the worst moment of a later backward (0 when M = 1)."""
    optimizer: float
    """Above ``static`` during ``OPT`` (the gradients, less the cast cache freed before it)."""

    @property
    def peak(self) -> float:
        """The step's peak."""
        return self.static + max(self.first_backward, self.later_backward, self.optimizer)

    @property
    def phase(self) -> str:
        """The phase that sets the peak."""
        phases = {
            "first backward": self.first_backward,
            "later backward": self.later_backward,
            "optimizer": self.optimizer,
        }
        return max(phases, key=lambda k: phases[k])


@dataclass(frozen=True, slots=True, kw_only=True)
class StageBytes:
    """The terms of one replica's step peak (module docstring), for one stage and slice."""

    static: float
    """Always held: parameters, optimizer state, ZeRO/AllReduce buffers, cast cache; without
    :attr:`shared` (no workspaces)."""
    shared: float
    """The gradients in flight of a stage whose gradients stay (ZeRO buckets, shards, tensor
    ranks): one backward runs at a time on a device, so a device counts its chunks' largest."""
    grads: float
    """G: the gradients set to None each step (0 where they stay, counted in ``static``)."""
    other: float
    """Held from a micro-batch's F to its B: its activations (the stage input only under
    re-computation), the stage output, the loss's log-softmax."""
    first: float
    """The moment of this stage's first backward, above ``static``: the micro-batch being
    back-propagated, the gradients it creates, its loss moment (at least ``other``: what the
    micro-batch held stays until its backward ends)."""
    later: float
    """The moment of a later backward, above ``static`` and the stage's G."""
    cache: float
    """Autocast's cast cache (freed before ``OPT``)."""


def stage_bytes(
    profile: ModelProfile,
    layers: tuple[int, int],
    samples: int,
    parallel: Parallelism = ONE_DEVICE,
    *,
    state: tuple[float, float] | None = None,
) -> tuple[StageBytes, StageBytes]:
    """:class:`StageBytes` of layers ``[start, end)`` on one replica (back-propagating a slice
    of ``samples`` samples) of a stage laid out as ``parallel``: ``(without, with
    re-computation)``, from one pass over the layers; ``state``: their
    :func:`stage_state_bytes` when the caller has it."""
    profile = profile.for_memory
    s, e = layers
    t = parallel.tensor_width
    last = e == len(profile.layers)
    mine = profile.layers[s:e]
    if state is None:
        state = stage_state_bytes(profile, layers, parallel)
    state_bytes, in_flight = state
    casts = [cast_bytes(profile, layer) for layer in mine]
    cache = sum(casts) / t  # t_s = 1: whole
    if not parallel.tensor_parallel and not parallel.shards_optimizer:  # .grad None each step
        grads = [float(layer.parameter_bytes) for layer in mine]
        in_flight_grad = [g + c for g, c in zip(grads, casts, strict=True)]
        static, shared = state_bytes - in_flight - sum(grads), 0.0
    else:  # ZeRO buckets, shards, tensor ranks: the gradients stay as the older model counts
        grads = [0.0] * len(mine)
        in_flight_grad = grads
        static, shared = state_bytes - in_flight, in_flight
    kept = [tensor_kept_bytes_per_sample(layer, t) * samples for layer in mine]
    held_out = 0.0 if last else boundary_bytes(profile, e, samples)
    loss_kept, loss_backward = loss_bytes(profile, samples) if last else (0.0, 0.0)
    full = sum(kept) + held_out + loss_kept  # the micro-batch being back-propagated
    moments = _backward_moments(kept, grads, in_flight_grad, mine, samples, held_out)
    loss_moment = full + loss_backward if last else 0.0
    first = max(loss_moment, *(mo + later for mo, later in moments))
    later = max(loss_moment, *(mo for mo, _ in moments))

    def held(other: float) -> StageBytes:
        return StageBytes(static=static, shared=shared, grads=sum(grads), other=other,
                          first=max(other, first), later=max(other, later), cache=cache)  # fmt: skip

    return held(full), held(boundary_bytes(profile, s, samples) + held_out + loss_kept)


def stage_state_bytes(
    profile: ModelProfile, layers: tuple[int, int], parallel: Parallelism = ONE_DEVICE
) -> tuple[float, float]:
    """What :func:`stage_bytes` holds whatever the slice: :func:`parameter_state_bytes` and
    :func:`gradients_in_flight_bytes` of layers ``[start, end)`` on one replica of a stage laid
    out as ``parallel`` (a planner costs the same stage at several b)."""
    profile = profile.for_memory
    return (
        parameter_state_bytes(profile, layers, parallel),
        gradients_in_flight_bytes(profile, layers, parallel),
    )


def stage_peak(
    profile: ModelProfile,
    stage: StagePlan,
    micro_batch_size: int,
    in_flight: int,
    num_micro_batches: int | None = None,
    zero_stage: int = 0,
    workspace: float = 0.0,
    samples: int | None = None,
) -> StagePeak:
    """Peak bytes of one replica of ``stage`` over a step, by phase (module docstring).

    Args:
        profile: sizes (activations at :attr:`ModelProfile.for_memory`).
        stage: layers, replicas, tensor width, re-computation.
        micro_batch_size: b (a replica's slice: the largest of ``stage.slice_sizes(b)``).
        in_flight: K, micro-batches whose activations the stage holds at once.
        num_micro_batches: M; None: more than K (a forward between backwards).
        zero_stage: as :func:`~dapple.cost.memory.parameter_state_bytes`.
        workspace: fixed per-process bytes (:func:`workspace_bytes`).
        samples: the replica's slice; None: the stage's largest (:func:`plan_stage_bytes`).
    """
    sb = plan_stage_bytes(profile, stage, micro_batch_size, zero_stage, samples=samples)
    k = max(in_flight, 1)
    m = num_micro_batches if num_micro_batches is not None else k + 1
    later = 0.0
    if m > 1:
        others = k - 1 if m > k else max(k - 2, 0)
        later = sb.grads + others * sb.other + sb.later
    return StagePeak(
        static=sb.static + sb.shared + workspace,
        first_backward=(k - 1) * sb.other + sb.first,
        later_backward=later,
        optimizer=sb.grads - sb.cache,
    )


def expert_stage_state_bytes(
    profile: ModelProfile, layers: tuple[int, int], parallel: Parallelism
) -> tuple[float, float]:
    """:func:`stage_state_bytes` of one replica of a stage of EP width e_s under ZeRO-1/2
    (``parallel``), as ``dapple.runtime.parallel.expert`` shards it: the dense part
    (:func:`~dapple.cost.moe.expert_parts`) over the r_s replicas, the rank's E/e_s experts
    over the r_s / e_s copies of its shard (whole at e_s = r_s: no other holder). Raises
    ValueError unless ``parallel`` shards the optimizer state and not the parameters."""
    if not parallel.shards_optimizer or parallel.shards_params:
        raise ValueError(
            f"expert_stage_state_bytes prices ZeRO-1/2 on r_s > 1, got zero_stage "
            f"{parallel.zero_stage} on {parallel.replicas} replicas"
        )
    width = parallel.expert_width
    dense, experts = expert_parts(profile.for_memory, width)
    d = stage_state_bytes(
        dense, layers, Parallelism(replicas=parallel.replicas, zero_stage=parallel.zero_stage)
    )
    copies = Parallelism(replicas=parallel.replicas // width, zero_stage=parallel.zero_stage)
    x = stage_state_bytes(experts, layers, copies)
    return d[0] + x[0], d[1] + x[1]


def plan_stage_bytes(
    profile: ModelProfile,
    stage: StagePlan,
    micro_batch_size: int,
    zero_stage: int = 0,
    *,
    samples: int | None = None,
) -> StageBytes:
    """:func:`stage_bytes` of one replica of ``stage`` as it runs (re-computing or not): its
    slice of ``samples`` (None: the largest slice of b, under its ``shares`` if any), its zero
    stage or ``zero_stage`` where higher; each MoE layer's experts ``1/e_s`` under an EP width
    e_s (:func:`~dapple.cost.moe.expert_sharded_profile`), their state under ZeRO-1/2 sharded
    over each shard's copies (:func:`expert_stage_state_bytes`)."""
    par = stage.parallel.floored(zero_stage)
    state = None
    if par.expert_parallel:
        if par.shards_optimizer and not par.shards_params:
            state = expert_stage_state_bytes(profile, stage.layers, par)
        profile = expert_sharded_profile(profile.for_memory, stage.expert_width)
    plain, redone = stage_bytes(
        profile,
        stage.layers,
        max(stage.slice_sizes(micro_batch_size)) if samples is None else samples,
        par,
        state=state,
    )
    return redone if stage.recompute else plain


def in_flight_limit(sb: StageBytes, memory: float, num_micro_batches: int) -> int:
    """D: the most micro-batches one replica holds at once within ``memory`` bytes (the
    phases of :func:`stage_peak` with K in flight out of M; 0 when not even one fits,
    :data:`~dapple.cost.memory.UNBOUNDED_IN_FLIGHT` when a micro-batch takes no memory).

    The peak grows by ``other`` per micro-batch while K < M; at K = M the later backwards
    hold one fewer (GPipe), which is checked on its own.
    """
    m = num_micro_batches
    later = sb.grads + sb.later if m > 1 else 0.0
    free = memory - sb.static - sb.shared
    if free < max(sb.first, later, sb.grads - sb.cache):
        return 0
    if sb.other <= 0:
        return UNBOUNDED_IN_FLIGHT
    d = 1 + int((free - max(sb.first, later)) // sb.other)
    if d == m - 1 and m > 1:  # K = M: the first backward holds M - 1 others, later ones M - 2
        at_m = max((m - 1) * sb.other + sb.first, sb.grads + (m - 2) * sb.other + sb.later)
        if at_m <= free:
            return m
    return d


def device_peak(parts: Mapping[int, StageBytes], order: Sequence[Action]) -> StagePeak:
    """The step peak of one device running ``order`` (its compute actions: one stage, or its
    chunks under interleaving), replayed action by action from ``parts`` (stage index ->
    :class:`StageBytes` of this device's slice).

    F adds the micro-batch's held bytes; a backward (``B``, or either half ``I``/``W`` of a
    split one, each charged as a whole backward) holds the other micro-batches in flight,
    the gradients already created and its moment (the stage's first or later one); ``B`` or
    ``W`` frees the micro-batch and leaves the stage's gradients (a stage may run some
    micro-batches' backward whole and others' split, as DualPipeV does). ``OPT``: every
    gradient, the cast caches freed. Under 1F1B and GPipe the replay is :func:`stage_peak`'s closed form.
    """
    level = grads = 0.0
    first_b = later_b = 0.0
    seen: set[int] = set()
    for a in order:
        sb = parts[a.stage]
        if a.kind is ActionKind.FORWARD:
            level += sb.other
            first_b = max(first_b, level + grads)
        elif a.kind.is_compute:
            if a.stage in seen:
                later_b = max(later_b, level - sb.other + grads + sb.later)
            else:
                first_b = max(first_b, level - sb.other + grads + sb.first)
            if a.kind is not ActionKind.BACKWARD_INPUT:  # B, or W after its I
                level -= sb.other
                if a.stage not in seen:
                    seen.add(a.stage)
                    grads += sb.grads
    return StagePeak(
        static=device_static(parts.values()),
        first_backward=first_b,
        later_backward=later_b,
        optimizer=sum(p.grads - p.cache for p in parts.values()),
    )


def device_static(parts: Iterable[StageBytes]) -> float:
    """What a device holds all step for its stages (its chunks under interleaving): each
    one's ``static``, and the largest ``shared`` once (one backward runs at a time)."""
    held = list(parts)
    return sum(p.static for p in held) + max((p.shared for p in held), default=0.0)


def _backward_moments(
    kept: list[float],
    grads: list[float],
    in_flight_grad: list[float],
    layers: tuple[LayerProfile, ...],
    samples: int,
    held_out: float,
) -> list[tuple[float, float]]:
    """Per layer j of the stage: ``(live, later_grads)`` during its backward: the kept bytes of
    layers ``<= j``, the held stage output, its output's gradient and its weight gradient in
    flight; and the gradients of the layers after it (present in a first backward)."""
    out = []
    below, after = 0.0, sum(grads)  # running sums: kept of layers <= j, gradients after j
    for j, layer in enumerate(layers):
        below += kept[j]
        after -= grads[j]
        live = below + held_out + layer.output_bytes_per_sample * samples + in_flight_grad[j]
        out.append((live, after))
    return out

"""How one pipeline stage is parallelised: replicas, tensor width, ZeRO stage and expert width.

Pure data model, no torch. A stage of the plan runs its layers on r_s replicas (data
parallelism, DAPPLE's AllReduce AR(P_s, r_s)), each replica a tensor-parallel group of t_s
devices (Megatron-LM); the replicas may shard the stage's optimizer state, gradients and
parameters (ZeRO-1/2/3, Rajbhandari et al. 2020; 3 runs as FSDP), ZeRO-3 optionally
re-gathering the parameters per micro-batch; and a mixture-of-experts stage may shard its
experts over e_s of its replicas (expert parallelism).

:class:`Parallelism` holds these five values of one stage (``StagePlan.parallel``) and answers
what they mean - whether the stage is tensor parallel, which ZeRO sharding is in effect, which
group reduces the dense gradients - so that code reads one named property instead of comparing
widths and stage numbers, like torchtitan's ``ParallelDims``.

ZeRO shards over the replicas: on one replica it shards nothing, so the ``shards_*``
properties are False there whatever ``zero_stage`` says (the plan keeps the number it was
given; 3 is refused on one replica).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dapple.core._json import require

__all__ = ["ONE_DEVICE", "ZERO_STAGES", "Parallelism"]

ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages a plan's stage may name: 0 none, 1 optimizer state, 2 + gradients, 3 +
parameters (FSDP)."""


def _whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    """The parallel layout of one stage: ``replicas x tensor_width`` devices, ZeRO over the
    replicas, experts over groups of ``expert_width`` replicas.

    Raises:
        ValidationError: a value out of range, or a combination no stage can run (ZeRO-3 on
            one replica, ``regather`` without ZeRO-3, ``expert_width`` not dividing the
            replicas); one line naming the values.
    """

    replicas: int = 1
    """r_s: the stage's replicas (tensor groups), each computing a slice of every micro-batch."""
    tensor_width: int = 1
    """t_s: devices of one replica's tensor-parallel group, a power of two; 1: none."""
    zero_stage: int = 0
    """ZeRO over the replicas: 1 shards the optimizer state, 2 the gradients too, 3 the
    parameters too (FSDP); 0 none."""
    regather: bool = False
    """ZeRO-3 only: re-shard the parameters after every forward and backward and all-gather
    them per micro-batch; False: gather once per step."""
    expert_width: int = 1
    """e_s: replicas over which each mixture-of-experts layer's experts are sharded (a divisor
    of r_s); 1: every replica holds every expert."""

    def __post_init__(self) -> None:
        r, t, z, e = self.replicas, self.tensor_width, self.zero_stage, self.expert_width
        require(_whole(r) and r >= 1, f"replicas must be an integer >= 1, got {r!r}")
        require(z in ZERO_STAGES, f"zero_stage must be 0, 1, 2 or 3, got {z!r}")
        require(
            _whole(t) and t >= 1 and t & (t - 1) == 0,
            f"tensor_width must be a power of two >= 1, got {t!r}",
        )
        require(
            z != 3 or r > 1,
            f"zero_stage 3 shards parameters over the replicas, but the stage has one replica "
            f"(replicas={r}, tensor_width={t})",
        )
        require(isinstance(self.regather, bool), f"regather must be a bool, got {self.regather!r}")
        require(
            not self.regather or z == 3,
            f"regather applies to zero_stage 3 only, got zero_stage {z}",
        )
        require(
            _whole(e) and e >= 1 and r % e == 0,
            f"expert_width must be a divisor >= 1 of its {r} replicas, got {e!r}",
        )

    @property
    def data_parallel(self) -> bool:
        """More than one replica: the replicas reduce the stage's gradients (AR(P_s, r_s))."""
        return self.replicas > 1

    @property
    def tensor_parallel(self) -> bool:
        """Each replica's layers are cut over a tensor group of t_s > 1 devices."""
        return self.tensor_width > 1

    @property
    def expert_parallel(self) -> bool:
        """The experts are sharded over groups of e_s > 1 replicas (all-to-all routing)."""
        return self.expert_width > 1

    @property
    def shards_optimizer(self) -> bool:
        """ZeRO-1 or above on r_s > 1: each replica updates the ``1/r_s`` slice of the state."""
        return self.zero_stage >= 1 and self.replicas > 1

    @property
    def shards_grads(self) -> bool:
        """ZeRO-2 or above on r_s > 1: the replicas reduce-scatter the gradients into ``1/r_s``
        shards too."""
        return self.zero_stage >= 2 and self.replicas > 1

    @property
    def reduces_each_backward(self) -> bool:
        """ZeRO-2 on r_s > 1: a reduce-scatter after each of the M backward passes (ZeRO-3
        reduce-scatters once per step, after the last)."""
        return self.zero_stage == 2 and self.replicas > 1

    def gradient_reductions(self, micro_batches: int) -> int:
        """Reduce-scatters (or AllReduces) of the stage's gradients in one step of M
        ``micro_batches``: M under ZeRO-2 (:attr:`reduces_each_backward`), else 1."""
        return micro_batches if self.reduces_each_backward else 1

    def floored(self, zero_floor: int) -> Parallelism:
        """This layout under a run-wide ZeRO floor (``TrainConfig.zero_stage``, the cost
        model's ``zero_stage``): the higher of ``zero_floor`` and :attr:`zero_stage` on a
        replicated stage; a stage of one replica as it is (ZeRO shards nothing there).

        Raises:
            ValidationError: ``zero_floor`` not one of :data:`ZERO_STAGES`.
        """
        require(zero_floor in ZERO_STAGES, f"zero floor must be 0, 1, 2 or 3, got {zero_floor!r}")
        if self.replicas == 1 or zero_floor <= self.zero_stage:
            return self
        return replace(self, zero_stage=zero_floor)

    def unsharded(self) -> Parallelism:
        """This layout without ZeRO: the replicas and widths, every replica holding its whole
        state."""
        return replace(self, zero_stage=0, regather=False)

    @property
    def shards_params(self) -> bool:
        """ZeRO-3 (FSDP): the replicas shard the parameters too and gather them to compute."""
        return self.zero_stage == 3

    @property
    def meshed(self) -> bool:
        """The stage's layers run on a device mesh: cut over a tensor group (TP) or sharded
        over the replicas (FSDP), ``dapple.runtime.parallel.stage_mesh``."""
        return self.tensor_parallel or self.shards_params


ONE_DEVICE = Parallelism()
"""A stage on one device: one replica, no tensor group, nothing sharded."""

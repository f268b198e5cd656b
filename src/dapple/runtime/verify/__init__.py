"""Check a distributed run against one process, step by step: same seed, same batches, same
optimizer.

``verify`` trains a plan with the runtime (one process per plan device, gloo/NCCL) while every
rank records, at each ``OPT``, its weights and the gradients its optimizer is about to apply
(final: micro-batches accumulated, AllReduce or reduce-scatter done, tied copies summed,
unclipped). In this process the unsplit model then follows that run step by step
(:class:`~dapple.runtime.verify.reference.ForcedReference`). For every step ``t``:

1. **Gradients on the same weights.** The reference loads the distributed weights of step
   ``t`` and computes the full batch's loss and gradients. Every rank's gradients (every
   replica's, every ZeRO piece) must match them to ``grad_rtol`` (:data:`GRAD_RTOL`, float32)
   of the largest gradient element of their layer: the two runs add the same terms in another
   order, so they differ by rounding of the layer's scale, while a dropped micro-batch, a
   replica that missed the AllReduce, rows swapped at a split-concat or a tied copy not summed
   move a gradient by a sizeable part of its scale. The loss and the global gradient norm
   must match to :data:`GRAD_NORM_RTOL`.
2. **The update from the same gradients.** The reference optimizer (its state built from the
   distributed gradients of every earlier step) applies the distributed gradients - clipped
   with their own global norm, at the step's learning rate - to the distributed weights of step
   ``t``. Every replica's weights of step ``t + 1`` must match to float32 rounding of the
   update's arithmetic (:data:`RTOL`, :data:`ATOL`): a stale ZeRO shard, a skipped or doubled
   update, a wrong learning rate or clipping shows here.

Before the first step every replica's weights must equal the reference's initial weights.

Why not compare two free-running trainings: their weights drift apart by summation order, and
Adam turns a gradient within rounding of zero (attention's key bias, whose true gradient is 0)
into a step of about ``lr`` whose sign is the rounding's, so correct runs differed by more than
any fixed tolerance. Step by step, rounding never compounds and each check's tolerance follows
from its own arithmetic, under every optimizer.

Design choices:
    - The reference is the *original* model when the workload was made by
      :func:`dapple.models.split.workload_from_module` (``original_model``: tied weights are one
      parameter there, so this also checks the cut and the tied-gradient sums), otherwise the
      layer chain ``workload.build_model(seed)`` with tied gradients summed by
      :func:`dapple.models.tied.sum_tied_grads_local`.
    - Under bf16 both runs autocast; gradients are judged at bf16's ``rtol``
      (:func:`dapple.runtime.precision.tolerances_for`), losses and norms too, while the update
      (fp32 master weights) keeps the float32 tolerances.
    - Each rank keeps a copy of its weights and gradients per step on the CPU: verify is for
      models that fit one process (the reference holds the whole model).
    - Several plans run in ONE launch of ``max(devices)`` processes (ranks outside a plan idle
      through its collectives).
    - Test hooks: ``DAPPLE_TEST_PERTURB_GRAD_RANK=k`` adds ``PERTURBATION`` to every gradient
      of rank ``k``; ``DAPPLE_TEST_VERIFY_SETUP=module:function`` is called in every worker
      with its rank before training (to inject a defect).

Dropout may be on: every random site draws a mask keyed by the step and the sample, the same in
the ranks and in the reference (:mod:`dapple.models.rng`); other random operations must be off.
"""

from dapple.runtime.verify.reference import ForcedReference, reference_run
from dapple.runtime.verify.report import (
    ATOL,
    GRAD_NORM_RTOL,
    GRAD_RTOL,
    RTOL,
    StageDiff,
    VerifyReport,
    grad_diffs,
    stage_diffs,
)
from dapple.runtime.verify.run import (
    PERTURB_GRAD_RANK_ENV,
    PERTURBATION,
    WORKER_SETUP_ENV,
    perturbed,
    verify,
    verify_many,
)

__all__ = [
    "ATOL",
    "GRAD_NORM_RTOL",
    "GRAD_RTOL",
    "PERTURBATION",
    "PERTURB_GRAD_RANK_ENV",
    "RTOL",
    "WORKER_SETUP_ENV",
    "ForcedReference",
    "StageDiff",
    "VerifyReport",
    "grad_diffs",
    "perturbed",
    "reference_run",
    "stage_diffs",
    "verify",
    "verify_many",
]

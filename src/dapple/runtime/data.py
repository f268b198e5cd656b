"""Training on a dataset: each rank's rows, the checks before any compute, the resume record.

With ``run_plan(..., data=dataset)`` step ``t`` trains on the global batch
:class:`~dapple.datasets.EpochSampler` picks for ``t`` (seeded by ``TrainConfig.seed``) instead
of ``workload.make_batch(G, seed + t)``. Each rank reads only its rows
(:func:`rank_rows`): stage-0 replicas the inputs of their split-concat slice of every
micro-batch, last-stage replicas the targets, middle stages and ranks beyond the plan nothing.

Checkpoints record :func:`data_state` (dataset length, sampler seed, ``G``, ``seq_len``) beside
the step; since the sampler position is a pure function of the step, resuming at step ``t``
reads exactly the batch an uninterrupted run reads, and :func:`check_data_resume` rejects a
resume on another dataset, seed or global batch.

Samples are ``(inputs, targets)`` as the workload's ``make_batch`` rows are. A token window
``w`` of ``seq_len + 1`` tokens is ``(x, y) = (w[:-1], w[1:])``: ``y[t]`` is the token after
``x[t]``, and every model trains on all ``seq_len`` targets without shifting them. The pair fits
the zoo transformer as it is; for a Hugging Face causal LM, whose batches are
``((input_ids, attention_mask), next ids)`` (:mod:`dapple.models.hf`), :func:`fit_data`
presents each window as ``((x, ones), y)``. Documents packed or padded
(:mod:`dapple.datasets.packing`) bring their loss, which masks the padding, and padded ones
their dynamic token dimension (:func:`fit_workload`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from dapple.core.plan import Plan, slice_bounds
from dapple.datasets import Batch, BatchSource, EvalBatches, TokenFile, read_rows
from dapple.errors import ValidationError
from dapple.models.materialize import build_meta
from dapple.models.workload import Workload
from dapple.runtime.checkpoint.files import CheckpointError

__all__ = [
    "CausalLMSamples",
    "RankData",
    "check_data",
    "check_data_resume",
    "data_dims",
    "data_state",
    "fit_data",
    "fit_workload",
    "model_limits",
    "open_data",
    "rank_rows",
]

log = logging.getLogger(__name__)


def open_data(data: Dataset[Any] | str | Path, seq_len: int | None) -> Dataset[Any]:
    """A dataset as given, or the :class:`TokenFile` at a path (``seq_len`` required then).

    Raises:
        ValidationError: a path without ``seq_len``, or a bad token file.
    """
    if isinstance(data, (str, Path)):
        if seq_len is None:
            raise ValidationError(f"a token file ({data}) needs seq_len (--seq-len)")
        return TokenFile(data, seq_len)
    return data


class CausalLMSamples(Dataset[tuple[Any, torch.Tensor]]):
    """Next-token samples ``(x, y)`` as a Hugging Face causal LM's: ``((x, ones), y)``.

    The loss (:func:`dapple.models.hf.causal_lm_loss`) predicts ``y[t]`` (the token after
    ``x[t]``) from ``x[:t + 1]``: all ``seq_len`` targets of a sample train.
    """

    def __init__(self, base: Dataset[Any]) -> None:
        self.base = base
        self.seq_len: int | None = getattr(base, "seq_len", None)

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[Any, torch.Tensor]:
        x, y = self.base[i]
        return (x, torch.ones_like(x)), y


def _is_causal_lm_batch(inputs: Any, targets: torch.Tensor) -> bool:
    """``((x, all-ones mask), y)`` with ``y`` the next tokens (``y[:, t] == x[:, t + 1]``): the
    Hugging Face causal-LM batch convention of :mod:`dapple.models.hf`."""
    if not (
        isinstance(inputs, (tuple, list))
        and len(inputs) == 2
        and all(isinstance(t, torch.Tensor) for t in inputs)
    ):
        return False
    ids, mask = inputs
    return (
        ids.dtype == torch.int64
        and ids.dim() == 2
        and targets.shape == ids.shape
        and targets.dtype == torch.int64
        and torch.equal(targets[:, :-1], ids[:, 1:])
        and bool((mask == 1).all())
    )


def fit_workload(workload: Workload, data: Dataset[Any] | None) -> Workload:
    """The workload as it trains on ``data``: documents (:mod:`dapple.datasets.packing`) bring
    their loss (padding masked) and, padded, their dynamic token dimension.

    Raises:
        ValidationError: documents for a model whose batches are not ``(token ids, next
            token ids)`` (a Hugging Face causal LM takes ``(input_ids, attention_mask)``), or
            whose token dimension was traced static (declare it dynamic:
            ``--dynamic-dims 0:1=seq``).
    """
    loss_fn = getattr(data, "loss_fn", None)
    if data is None or loss_fn is None:
        return workload
    if _is_causal_lm_batch(*workload.make_batch(2, 0)):
        raise ValidationError(
            f"{_describe(data)}: packed or padded documents train models that take token ids "
            f"and predict the next ids (e.g. the zoo transformer); {workload.name!r} is a "
            "Hugging Face causal LM taking (input_ids, attention_mask), which documents do not "
            "feed yet"
        )
    from dapple.models.shapes import resolve_dims
    from dapple.models.split import is_traced

    wanted = resolve_dims(getattr(data, "dynamic_dims", None) or {}, ["0"])
    own = {i: dict(ds) for i, ds in workload.dynamic_dims.items()}
    for i, ds in wanted.items():
        for d, dim in ds.items():
            if d not in own.get(i, {}) and not is_traced(workload):
                own.setdefault(i, {})[d] = dim  # a layer chain runs eager modules: declare it
                continue
            have = own.get(i, {}).get(d)
            if have is None:
                raise ValidationError(
                    f"{_describe(data)}: padded documents change input {i} dimension {d} from "
                    f"batch to batch, but model {workload.name!r} takes it static; declare it "
                    f"dynamic (--dynamic-dims {i}:{d}=seq, dynamic_dims={{{i}: {{{d}: 'seq'}}}})"
                )
            if have.max is not None and dim is not None and have.max < (dim.max or 0):
                raise ValidationError(
                    f"{_describe(data)}: padded documents reach {dim.max} along input {i} "
                    f"dimension {d}, but model {workload.name!r} takes at most {have.max} "
                    f"({have.name} in {have.range_text()}); lower --seq-len"
                )
    return dataclasses.replace(workload, loss_fn=loss_fn, dynamic_dims=own)


def data_dims(workload: Workload) -> dict[int, dict[int, Any]]:
    """The dynamic dimensions of a run on a dataset: the workload's declared ones (after
    :func:`fit_workload`), without those declared static."""
    out = {
        i: {d: v for d, v in ds.items() if v is not None} for i, ds in workload.dynamic_dims.items()
    }
    return {i: ds for i, ds in out.items() if ds}


def fit_data(workload: Workload, data: Dataset[Any] | None, seed: int = 0) -> Dataset[Any] | None:
    """``data`` as the workload's samples: token pairs wrapped in :class:`CausalLMSamples` for
    a Hugging Face causal LM, anything else as given."""
    if data is None or isinstance(data, CausalLMSamples):
        return data
    x, y = data[0]
    pairs = isinstance(x, torch.Tensor) and x.shape == y.shape and x.dtype == torch.int64
    if pairs and _is_causal_lm_batch(*workload.make_batch(2, seed)):
        return CausalLMSamples(data)
    return data


def rank_rows(plan: Plan, rank: int) -> tuple[list[int], list[int]]:
    """Rows of the global batch whose ``(inputs, targets)`` rank ``rank`` reads.

    Row ``m * b + r`` is sample ``r`` of micro-batch ``m``; replica ``j`` of stage ``s`` holds
    samples ``slice_bounds(b, replicas_s, shares_s)[j]`` of every micro-batch.
    """
    if rank not in plan.devices:
        return [], []
    s, j = plan.stage_of_device(rank)
    b, M = plan.micro_batch_size, plan.num_micro_batches
    lo, hi = slice_bounds(b, plan.stages[s].replicas, plan.stages[s].shares)[j]
    rows = [m * b + r for m in range(M) for r in range(lo, hi)]
    held = plan.stages_of_device(rank)  # with v > 1 chunks: the first and the last stage
    return (rows if 0 in held else []), (rows if plan.num_stages - 1 in held else [])


class RankData:
    """One rank's training batches (``data``) and fixed evaluation batches (``eval_data``).

    Args:
        plan: the plan (rows and ``G``).
        rank: this rank.
        seed: the sampler's seed.
        data: training items ``(inputs, targets)``, or None (synthetic batches).
        eval_data: evaluation items, or None.
        stop: no prefetch at or beyond this step (the run's step count).
        eval_plan: the plan evaluation runs (its G and rows; default ``plan``).
        prefetch: read the next step's rows on a background thread while this step computes.
            Worth it where the host is idle during compute (a GPU rank). On a CPU rank the
            compute threads already use the cores and the reader only competes with them: a
            1-process bf16 plan of a small GPT measured 50-62 ms per step with the thread and
            49-50 ms reading in the step (2 cores, 3 paired rounds).
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        seed: int,
        data: Dataset[Any] | None,
        eval_data: Dataset[Any] | None,
        stop: int | None = None,
        *,
        prefetch: bool = True,
        eval_plan: Plan | None = None,
    ) -> None:
        G = plan.global_batch_size
        inputs, targets = rank_rows(plan, rank)
        self.source = (
            BatchSource(data, G, seed, inputs, targets, prefetch=prefetch, stop=stop)
            if data is not None
            else None
        )
        ev = eval_plan or plan
        self.eval = (
            EvalBatches(eval_data, ev.global_batch_size, *rank_rows(ev, rank))
            if eval_data is not None
            else None
        )

    def batch(self, step: int) -> Batch:
        """Step ``step``'s global batch (``G`` rows, zero where this rank reads nothing)."""
        assert self.source is not None
        return self.source.batch(step)

    def eval_batch(self, k: int) -> Batch:
        """Evaluation batch ``k``: items ``[k*G_e, (k+1)*G_e)`` of ``eval_data`` in order.

        Raises:
            ValidationError: no evaluation data, or ``k`` beyond its whole batches.
        """
        if self.eval is None:
            raise ValidationError("no evaluation data was given to the run (eval_data)")
        return self.eval.batch(k)

    @property
    def eval_batches(self) -> int:
        """Whole evaluation batches (0 without evaluation data)."""
        return self.eval.num_batches if self.eval is not None else 0

    def close(self) -> None:
        if self.source is not None:
            self.source.close()


def sample_row(data: Dataset[Any]) -> Batch:
    """Item 0 as a one-row batch (the runtime infers its boundary specs from it)."""
    return read_rows(data, [0], [0], [0])


# -- checks before any compute ---------------------------------------------------------------
def _shapes(x: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    ts = x if isinstance(x, (tuple, list)) else (x,)
    return [(tuple(t.shape), t.dtype) for t in ts]


def _fmt(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> str:
    return ", ".join(f"{list(s)} {str(d).removeprefix('torch.')}" for s, d in shapes)


def model_limits(workload: Workload, seed: int = 0) -> tuple[int | None, int | None]:
    """``(vocabulary, positions)`` of the model, None where not found.

    A Hugging Face model (:func:`dapple.models.hf.hf_config`): its config's ``vocab_size`` and
    ``max_position_embeddings`` / ``n_positions``. Otherwise the first layer, built on the
    ``meta`` device (no weight memory): the vocabulary is its first ``nn.Embedding``'s
    ``num_embeddings``; the positions a config's ``max_position_embeddings`` /
    ``n_positions`` on one of its modules, else a position embedding's ``num_embeddings`` (a
    module named ``wpe`` or ``*pos*``), else the rows of a parameter named ``pos``. A layer
    that cannot be built on ``meta`` gives ``(None, None)``.
    """
    from dapple.models.hf import hf_config

    config = hf_config(workload)
    if config is not None:  # a Hugging Face model: its config says
        limit = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )
        return int(config.vocab_size), (int(limit) if limit is not None else None)
    try:
        layer = build_meta(partial(workload.build_layer, 0, seed), seed)
    except Exception as e:  # an arbitrary factory: the checks are best effort
        log.debug("no meta build of %s layer 0: %s", workload.name, e)
        return None, None
    vocab = positions = None
    for name, mod in layer.named_modules():
        config = getattr(mod, "config", None)
        for key in ("max_position_embeddings", "n_positions"):
            if positions is None and isinstance(getattr(config, key, None), int):
                positions = int(getattr(config, key))
        if isinstance(mod, nn.Embedding):
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "wpe" or "pos" in leaf:
                positions = positions if positions is not None else mod.num_embeddings
            elif vocab is None:
                vocab = mod.num_embeddings
    for name, p in layer.named_parameters():
        if positions is None and name.rsplit(".", 1)[-1] == "pos" and p.dim() >= 1:
            positions = int(p.shape[0])
    return vocab, positions


def _describe(data: Dataset[Any]) -> str:
    if isinstance(data, CausalLMSamples):
        return _describe(data.base)
    path = getattr(data, "path", None)
    return str(path) if path is not None else type(data).__name__


def _check_one(
    data: Dataset[Any],
    what: str,
    workload: Workload,
    G: int,
    seed: int,
    limits: tuple[int | None, int | None],
) -> None:
    n = len(data)  # type: ignore[arg-type]
    if n < G:
        raise ValidationError(
            f"{what} {_describe(data)}: {n} samples are fewer than one global batch of {G}"
        )
    vocab, positions = limits
    seq_len = getattr(data, "seq_len", None)
    if positions is not None and seq_len is not None and seq_len > positions:
        raise ValidationError(
            f"--seq-len {seq_len} exceeds the {positions} positions of model {workload.name!r}"
        )
    tokens = data.base if isinstance(data, CausalLMSamples) else data
    if hasattr(tokens, "max_token") and vocab is not None:
        top = tokens.max_token()
        if top >= vocab:
            raise ValidationError(
                f"{what} {_describe(tokens)} holds token id {top} >= the vocabulary of model "
                f"{workload.name!r} ({vocab})"
            )
    x, y = data[0]
    wx, wy = workload.make_batch(1, seed)
    got = _shapes(x) + _shapes(y)
    want = [(s[1:], d) for s, d in _shapes(wx) + _shapes(wy)]
    if getattr(data, "dynamic_dims", None):  # padded documents: lengths vary, ranks do not
        got = [(tuple(-1 for _ in s), d) for s, d in got]
        want = [(tuple(-1 for _ in s), d) for s, d in want]
    if got != want:
        raise ValidationError(
            f"{what} {_describe(data)}: a sample is ({_fmt(got)}) but model {workload.name!r} "
            f"takes ({_fmt(want)}) (inputs, then targets); build the model for the data's "
            "sequence length (--seq-len sets the zoo and Hugging Face models' seq)"
        )


def check_data(
    workload: Workload,
    data: Dataset[Any] | None,
    global_batch_size: int,
    seed: int = 0,
    *,
    eval_data: Dataset[Any] | None = None,
    eval_batch_size: int | None = None,
) -> None:
    """Everything about the datasets that can fail, before any compute (the evaluation data
    against ``eval_batch_size``, default ``global_batch_size``).

    Raises:
        ValidationError: fewer samples than one global batch, a token id beyond the model's
            vocabulary, a sequence length beyond its positions, or samples of another shape
            or dtype than the model's batches.
    """
    if data is None and eval_data is None:
        return
    workload = fit_workload(workload, data if data is not None else eval_data)
    limits = model_limits(workload, seed)
    data, eval_data = fit_data(workload, data, seed), fit_data(workload, eval_data, seed)
    if data is not None:
        _check_one(data, "data", workload, global_batch_size, seed, limits)
    if eval_data is not None:
        G_e = eval_batch_size or global_batch_size
        _check_one(eval_data, "evaluation data", workload, G_e, seed, limits)


# -- checkpoints -----------------------------------------------------------------------------
def data_state(
    data: Dataset[Any] | None, seed: int, global_batch_size: int
) -> dict[str, Any] | None:
    """What a checkpoint records about the training data (None: synthetic batches)."""
    if data is None:
        return None
    return {
        "sampler": "epoch-permutation",
        "items": len(data),  # type: ignore[arg-type]
        "seed": seed,
        "global_batch_size": global_batch_size,
        "seq_len": getattr(data, "seq_len", None),
        "source": _describe(data),
    }


def check_data_resume(
    saved: Mapping[str, Any] | None, current: Mapping[str, Any] | None, where: str | Path
) -> None:
    """Resuming continues the same data stream: same dataset length, seed, ``G`` and length.

    Raises:
        CheckpointError: the checkpoint at ``where`` was saved on other data (or synthetic
            batches where this run has data, or the other way round).
    """
    if saved is None and current is None:
        return
    if saved is None:
        raise CheckpointError(
            f"checkpoint {where} was saved training on synthetic batches; resume it without --data"
        )
    if current is None:
        raise CheckpointError(
            f"checkpoint {where} was saved training on data {saved.get('source')} "
            f"({saved.get('items')} samples); resume it with the same --data"
        )
    diffs = [
        f"{k} {saved.get(k)} (now {current.get(k)})"
        for k in ("items", "seed", "global_batch_size", "seq_len")
        if saved.get(k) != current.get(k)
    ]
    if diffs:
        raise CheckpointError(
            f"checkpoint {where} was saved on other data: {', '.join(diffs)}; resume with the "
            "same dataset, --seed, global batch and --seq-len"
        )

"""Checkpoints by layer: save under one plan, resume under any other.

A checkpoint is a directory ``<root>/step-<step:08d>/`` holding one file per *layer of the
chain* (not per rank): ``layer-<i:05d>.pt`` with the layer's ``state_dict`` (parameters and
buffers) and the optimizer state of each of its parameters keyed by the parameter's NAME in
the layer (torch optimizers key state by position in the optimizer, which changes with the
stage cut). Each rank also writes ``rng-rank<r:05d>.pt`` (torch, python and numpy RNG states)
and ``part-<save id>-rank<r:05d>.json`` (names, sizes and sha256 of the files it wrote). One
rank, after a barrier, merges the parts into ``manifest.json``: schema version, model name,
layer count, step (the index of the next step), samples consumed, the plan, and per layer its
file, size, sha256 and tensor shapes.

Design choices:
    - every file is written to a temporary name, flushed, fsync'ed and renamed; the manifest
      is written last, so a crash mid-save leaves a directory without a manifest, which
      :func:`latest_checkpoint` skips - the previous checkpoint stays whole;
    - only replica 0 of a stage writes its layers (the caller passes only those states);
    - loading is by layer (:func:`load_layer_states`, :func:`restore_stage`), so a stage of
      any plan reads exactly the layers it holds and rebuilds its optimizer state in its own
      parameter order;
    - every bad input raises :class:`CheckpointError`, one line naming the file and the problem,
      and nothing ever modifies an existing complete checkpoint except pruning to ``keep`` (and
      :func:`delete_checkpoints`, when a run is asked to start over);
    - a resume takes the newest checkpoint whose every file is intact
      (:func:`find_resume_checkpoint`): a damaged newer one (:class:`DamagedCheckpointError`) is
      skipped with a warning, never deleted.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dapple.runtime.checkpoint.files import (
    CHECKPOINT_SCHEMA_VERSION,
    CRASH_IN_SAVE_ENV,
    MANIFEST_NAME,
    Checkpoint,
    CheckpointError,
    CheckpointMeta,
    DamagedCheckpointError,
    atomic_write,
    capture_rng_state,
    check_files,
    fsync_dir,
    latest_checkpoint,
    list_checkpoints,
    merge_parts_into_manifest,
    read_checkpoint,
    read_verified,
    rec_dict,
    restore_rng_state,
    step_dir,
    to_bytes,
)
from dapple.runtime.checkpoint.ownership import (
    delete_checkpoints,
    describe_steps,
    prune_checkpoints,
    refuse_foreign,
    refuse_occupied,
)
from dapple.runtime.checkpoint.probe import check_writable

__all__ = [
    "CHECKPOINT_SCHEMA_VERSION",
    "CRASH_IN_SAVE_ENV",
    "MANIFEST_NAME",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMeta",
    "DamagedCheckpointError",
    "LayerState",
    "ResumePoint",
    "capture_rng_state",
    "check_compatible",
    "check_files",
    "check_layer_shapes",
    "check_optimizer_states",
    "check_optimizer_type",
    "check_writable",
    "delete_checkpoints",
    "describe_steps",
    "find_resume_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_layer_states",
    "load_rng_state",
    "prune_checkpoints",
    "read_checkpoint",
    "refuse_foreign",
    "refuse_occupied",
    "restore_rng_state",
    "restore_stage",
    "save_checkpoint",
    "slice_state",
    "stage_layer_states",
    "step_dir",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LayerState:
    """One layer's saved tensors."""

    index: int
    """Position of the layer in the chain."""
    tensors: dict[str, torch.Tensor]
    """The layer's ``state_dict()`` (parameters and persistent buffers), on CPU."""
    optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Optimizer state per parameter name in the layer (``{}`` for a parameter without state)."""


# -- per-layer state ----------------------------------------------------------------------------
def _cpu_copy(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, dict):
        return {k: _cpu_copy(x) for k, x in v.items()}
    return copy.deepcopy(v)


def _layer_ids(first_layer: int | Sequence[int], n: int) -> list[int]:
    """The chain index of each of ``n`` children: ``first_layer, first_layer + 1, ...``, or
    the indices given (a rank holding several chunks, :meth:`Plan.layers_of_device`)."""
    if isinstance(first_layer, int):
        return list(range(first_layer, first_layer + n))
    ids = list(first_layer)
    if len(ids) != n:
        raise ValueError(f"{len(ids)} layer indices for {n} layers")
    return ids


def stage_layer_states(
    module: nn.Module,
    first_layer: int | Sequence[int],
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[int, LayerState]:
    """Split a stage's weights and optimizer state into per-layer states.

    Args:
        module: the stage, whose children are the chain's layers ``first_layer, ...`` in
            order (as :meth:`Workload.build_stage` builds it).
        first_layer: chain index of the first child, or of every child.
        optimizer: the optimizer over the stage's parameters (state keyed by parameter name).

    Returns:
        ``{chain index: LayerState}`` with CPU copies of every tensor.
    """
    out: dict[int, LayerState] = {}
    children = list(module.children())
    for i, layer in zip(_layer_ids(first_layer, len(children)), children, strict=True):
        opt: dict[str, dict[str, Any]] = {}
        if optimizer is not None:
            for name, p in layer.named_parameters(remove_duplicate=False):
                st = optimizer.state.get(p)
                if st:
                    opt[name] = _cpu_copy(dict(st))
        tensors = {k: _cpu_copy(v) for k, v in layer.state_dict().items()}
        out[i] = LayerState(i, tensors, opt)
    return out


# -- save ---------------------------------------------------------------------------------------
def _save_id(meta: CheckpointMeta) -> str:
    key = json.dumps([meta.plan, meta.world_size, meta.step, meta.num_layers], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def save_checkpoint(
    root: str | Path,
    meta: CheckpointMeta,
    layer_states: Mapping[int, LayerState],
    *,
    rank: int = 0,
    write_manifest: bool = True,
    barrier: Callable[[], None] | None = None,
    keep: int | None = None,
    rng_state: Mapping[str, Any] | None = None,
) -> Path:
    """Save this rank's share of a checkpoint; one rank then completes it with the manifest.

    Every rank of the run calls it (a rank with no layers to write - a replica other than 0 -
    passes ``{}``). Order: write layer files, the RNG file and this rank's part list (each
    atomically), ``barrier()``, then the ``write_manifest`` rank merges every part into
    ``manifest.json`` (atomically, last) and deletes checkpoints older than the ``keep``
    newest complete ones.

    Args:
        root: checkpoint root directory (created if missing).
        meta: model, step, data position, plan; identical on every rank.
        layer_states: the layers this rank writes (see :func:`stage_layer_states`).
        rank: this rank (names its RNG and part files).
        write_manifest: True on exactly one rank.
        barrier: waits until every rank has written its files (``dist.barrier``); None when
            a single process saves everything.
        keep: keep only this many newest complete checkpoints (None: keep all).
        rng_state: this rank's RNG states (default: :func:`capture_rng_state` now).

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: a file cannot be written, or after the barrier some layer of the
            chain was written by no rank (no manifest is written then).
    """
    d = step_dir(root, meta.step)
    sid = _save_id(meta)
    try:
        d.mkdir(parents=True, exist_ok=True)
        if write_manifest:  # re-saving a step: the old manifest must not vouch for new files
            (d / MANIFEST_NAME).unlink(missing_ok=True)
        crash = os.environ.get(CRASH_IN_SAVE_ENV) == str(meta.step) and (
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"  # not after a restart
        )
        layers = []
        for idx in sorted(layer_states):
            ls = layer_states[idx]
            payload = {"index": idx, "tensors": ls.tensors, "optimizer": ls.optimizer}
            rec = atomic_write(d / f"layer-{idx:05d}.pt", to_bytes(payload))
            shapes = {k: list(v.shape) for k, v in ls.tensors.items()}
            layers.append({"index": idx, **rec_dict(rec), "shapes": shapes})
            if crash:
                os._exit(3)  # test hook: die mid-save, before the manifest
        rng = atomic_write(
            d / f"rng-rank{rank:05d}.pt",
            to_bytes(dict(rng_state) if rng_state is not None else capture_rng_state()),
        )
        part = {"save_id": sid, "rank": rank, "layers": layers, "rng": rec_dict(rng)}
        atomic_write(d / f"part-{sid}-rank{rank:05d}.json", json.dumps(part).encode())
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint {str(d)!r}: {e.strerror or e} ({e.filename or d})"
        ) from e
    if barrier is not None:
        barrier()
    if write_manifest:
        merge_parts_into_manifest(d, meta, sid)
        fsync_dir(d)
        if keep is not None:
            prune_checkpoints(root, keep, newest_step=meta.step)
    return d


# -- load ---------------------------------------------------------------------------------------
def load_layer_states(ckpt: Checkpoint, layers: Iterable[int]) -> dict[int, LayerState]:
    """Read the given layers' states, checking each file's size and sha256.

    Raises:
        CheckpointError: a layer index outside the checkpoint, or a truncated, corrupted or
            unreadable layer file (the message names the file).
    """
    out: dict[int, LayerState] = {}
    for i in layers:
        if not 0 <= i < ckpt.meta.num_layers:
            raise CheckpointError(
                f"checkpoint {str(ckpt.path)!r} has layers 0..{ckpt.meta.num_layers - 1}, "
                f"layer {i} requested"
            )
        rec = ckpt.layers[i]
        payload = read_verified(ckpt.path, rec.file, f"layer {i}")
        if not (isinstance(payload, dict) and payload.get("index") == i):
            raise DamagedCheckpointError(
                f"layer file {str(ckpt.path / rec.file.file)!r} is not layer {i}"
            )
        out[i] = LayerState(i, dict(payload["tensors"]), dict(payload.get("optimizer", {})))
    return out


def load_rng_state(ckpt: Checkpoint, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s saved RNG states, or None when that rank did not save any."""
    rec = ckpt.rng.get(rank)
    if rec is None:
        return None
    state = read_verified(ckpt.path, rec, f"rng state of rank {rank}")
    return dict(state)


def check_compatible(
    ckpt: Checkpoint,
    *,
    model_name: str,
    num_layers: int,
    plan_num_layers: int | None = None,
    optimizer_type: str | None = None,
) -> None:
    """Reject a checkpoint of another model or optimizer, or a plan that does not cover the model.

    Args:
        optimizer_type: the class name of the optimizer that would resume (``AdamW``); None:
            not checked.

    Raises:
        CheckpointError: model name or layer count differ, the plan's layer count differs, or
            the checkpoint holds another optimizer's state.
    """
    where = str(ckpt.manifest_path)
    if ckpt.meta.model_name != model_name:
        raise CheckpointError(
            f"checkpoint {where!r} is of model {ckpt.meta.model_name!r}, not {model_name!r}"
        )
    if ckpt.meta.num_layers != num_layers:
        raise CheckpointError(
            f"checkpoint {where!r} has {ckpt.meta.num_layers} layers but model {model_name!r} "
            f"has {num_layers}"
        )
    if plan_num_layers is not None and plan_num_layers != num_layers:
        raise CheckpointError(
            f"plan covers {plan_num_layers} layers but model {model_name!r} (and checkpoint "
            f"{where!r}) has {num_layers}"
        )
    if optimizer_type is not None:
        check_optimizer_type(ckpt, optimizer_type)


def check_optimizer_type(ckpt: Checkpoint, optimizer_type: str) -> None:
    """Refuse (:class:`CheckpointError`) a checkpoint holding another optimizer's state."""
    if ckpt.meta.optimizer_type not in ("", optimizer_type):
        raise CheckpointError(
            f"checkpoint {str(ckpt.manifest_path)!r} has {ckpt.meta.optimizer_type} optimizer "
            f"state; cannot resume with {optimizer_type}"
        )


def check_layer_shapes(ckpt: Checkpoint, index: int, want: Mapping[str, list[int]]) -> None:
    """Layer ``index`` of ``ckpt`` holds exactly the tensors ``want`` names, in those (whole)
    shapes.

    Raises:
        CheckpointError: the first tensor whose shape differs or that one side lacks.
    """
    have = ckpt.layers[index].shapes
    if dict(want) != have:
        k = next(k for k in [*want, *have] if want.get(k) != have.get(k))
        raise CheckpointError(
            f"checkpoint {str(ckpt.manifest_path)!r} is of another model: layer {index} tensor "
            f"{k!r} has shape {have.get(k)} there but {want.get(k)} in the model"
        )


def restore_stage(
    ckpt: Checkpoint,
    module: nn.Module,
    first_layer: int | Sequence[int],
    optimizer: torch.optim.Optimizer | None = None,
    views: Mapping[int, tuple[nn.Parameter, int]] | None = None,
) -> None:
    """Load layers ``first_layer ..`` (or the chain indices given, one per child) into
    ``module``'s children and rebuild the optimizer state.

    The optimizer state is re-keyed from parameter names to the optimizer's own parameter
    order, so a stage of any plan can resume; hyperparameters (lr, betas, ...) stay those of
    ``optimizer``.

    Args:
        views: ``id(optimizer parameter) -> (stage parameter, offset)`` for optimizer
            parameters that are 1-D pieces of a stage parameter (a ZeRO shard,
            :meth:`dapple.runtime.parallel.zero.FlatShards.views`): they take that slice of its state.

    Raises:
        CheckpointError: a layer's tensor names or shapes differ from the checkpoint's (another
            model), the optimizer class differs, a layer file is damaged, or the checkpoint has
            optimizer state but not (all of) it for a parameter the optimizer updates.
    """
    children = list(module.children())
    idxs = _layer_ids(first_layer, len(children))
    for i, layer in zip(idxs, children, strict=False):
        if i >= ckpt.meta.num_layers:
            break
        check_layer_shapes(ckpt, i, {k: list(v.shape) for k, v in layer.state_dict().items()})
    if optimizer is not None:
        check_optimizer_type(ckpt, type(optimizer).__name__)
    states = load_layer_states(ckpt, idxs)
    by_param: dict[int, dict[str, Any]] = {}
    for i, layer in zip(idxs, children, strict=False):
        layer.load_state_dict(states[i].tensors)
        for name, p in layer.named_parameters(remove_duplicate=False):
            st = states[i].optimizer.get(name)
            if st and id(p) not in by_param:
                by_param[id(p)] = st
    if optimizer is None:
        return
    sd = optimizer.state_dict()
    order = [p for g in optimizer.param_groups for p in g["params"]]
    views = views or {}
    names = {id(p): (i, n) for i, c in zip(idxs, children, strict=False)
             for n, p in c.named_parameters(remove_duplicate=False)}  # fmt: skip
    sd["state"] = {}
    for n, p in enumerate(order):
        origin, offset = views.get(id(p), (p, -1))
        st = by_param.get(id(origin))
        if st is None:
            if by_param and p.requires_grad:
                where = names.get(id(origin))
                raise CheckpointError(
                    f"checkpoint {str(ckpt.manifest_path)!r} is incomplete: layer "
                    f"{where[0] if where else '?'} parameter {where[1] if where else '?'!r} has "
                    "no optimizer state"
                )
            continue
        sd["state"][n] = st if offset < 0 else slice_state(st, offset, p.numel())
    optimizer.load_state_dict(sd)


def slice_state(state: Mapping[str, Any], offset: int, n: int) -> dict[str, Any]:
    """Elements ``[offset, offset + n)`` of every non-scalar tensor of one parameter's state."""
    return {
        k: v.reshape(-1)[offset : offset + n].clone()
        if isinstance(v, torch.Tensor) and v.ndim > 0
        else v
        for k, v in state.items()
    }


def check_optimizer_states(ckpt: Checkpoint) -> None:
    """Every layer's optimizer state is whole: each entry names a tensor of the layer, has that
    tensor's shape in every non-scalar state, and has the same state names as the other
    entries (a checkpoint assembled from ZeRO shards with one missing fails here). Reads one
    layer file at a time.

    Raises:
        DamagedCheckpointError: the first incomplete entry, named with its layer and parameter.
    """
    keys: tuple[str, ...] | None = None
    where = str(ckpt.manifest_path)
    for rec in ckpt.layers:
        ls = load_layer_states(ckpt, [rec.index])[rec.index]
        for name, st in ls.optimizer.items():
            have = tuple(sorted(st))
            keys = have if keys is None else keys
            what = f"checkpoint {where!r} is incomplete: layer {rec.index} parameter {name!r}"
            if have != keys:
                raise DamagedCheckpointError(
                    f"{what} has optimizer state {list(have)}, others {list(keys)}"
                )
            t = ls.tensors.get(name)
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.ndim > 0 and (t is None or v.shape != t.shape):
                    shape = None if t is None else list(t.shape)
                    raise DamagedCheckpointError(
                        f"{what}: optimizer state {k!r} has shape {list(v.shape)}, the "
                        f"parameter {shape}"
                    )


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a resume starts: :func:`find_resume_checkpoint`'s answer."""

    checkpoint: Checkpoint | None
    """The newest intact checkpoint; None when the directory holds none (missing or empty)."""
    skipped: tuple[str, ...] = ()
    """One line per newer checkpoint passed over as damaged (what is wrong with it)."""


def find_resume_checkpoint(root: str | Path) -> ResumePoint:
    """The newest checkpoint under ``root`` whose manifest reads, whose every file has the size
    and sha256 its manifest lists (:func:`check_files`) and whose optimizer state is whole
    (:func:`check_optimizer_states`); newer damaged ones are passed over and named.

    Reads every file of the checkpoint it returns (and of the damaged ones before it): called
    once per resume, by the launcher and by rank 0 (:meth:`dapple.runtime.longrun.LongRun.resume`).

    Raises:
        CheckpointError: a manifest from a newer dapple (refused, not skipped), or every
            checkpoint is damaged (the newest one's problem).
    """
    skipped: list[str] = []
    for d in reversed(list_checkpoints(root)):
        if not (d / MANIFEST_NAME).is_file():  # a save that crashed: not a checkpoint
            continue
        try:
            ck = read_checkpoint(d)
            check_files(ck)
            check_optimizer_states(ck)
        except DamagedCheckpointError as e:
            skipped.append(str(e))
            continue
        return ResumePoint(ck, tuple(skipped))
    if skipped:
        raise DamagedCheckpointError(f"{skipped[0]}; no older intact checkpoint to resume from")
    return ResumePoint(None)

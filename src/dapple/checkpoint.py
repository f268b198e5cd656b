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
      and nothing ever modifies an existing complete checkpoint except pruning to ``keep``.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dapple.errors import DappleError

__all__ = [
    "CHECKPOINT_SCHEMA_VERSION",
    "CRASH_IN_SAVE_ENV",
    "MANIFEST_NAME",
    "Checkpoint",
    "CheckpointError",
    "CheckpointMeta",
    "LayerState",
    "capture_rng_state",
    "check_compatible",
    "check_writable",
    "latest_checkpoint",
    "list_checkpoints",
    "load_layer_states",
    "load_rng_state",
    "read_checkpoint",
    "restore_rng_state",
    "restore_stage",
    "save_checkpoint",
    "stage_layer_states",
    "step_dir",
]

logger = logging.getLogger(__name__)

CHECKPOINT_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
CRASH_IN_SAVE_ENV = "DAPPLE_TEST_CRASH_IN_SAVE"
"""Test hook: at the save of this step, a writing rank ``os._exit(3)``s after its first layer
file, before the barrier and the manifest."""
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(DappleError):
    """A checkpoint is missing, damaged, incompatible, or cannot be written."""


@dataclass(frozen=True, slots=True)
class LayerState:
    """One layer's saved tensors."""

    index: int
    """Position of the layer in the chain."""
    tensors: dict[str, torch.Tensor]
    """The layer's ``state_dict()`` (parameters and persistent buffers), on CPU."""
    optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Optimizer state per parameter name in the layer (``{}`` for a parameter without state)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointMeta:
    """What a checkpoint records besides the layer tensors."""

    model_name: str
    """Workload name; a checkpoint loads only into the same model."""
    num_layers: int
    """N, the length of the layer chain."""
    step: int
    """Optimizer steps completed = the index of the next step to run (the data position)."""
    samples_consumed: int = 0
    """Training samples consumed so far (``step x global batch`` for a fixed batch)."""
    plan: dict[str, Any] | None = None
    """The plan (``Plan.to_dict()``) the run was saved under."""
    optimizer_type: str = ""
    """Class name of the optimizer (``SGD``, ``Adam``); empty when no optimizer was saved."""
    world_size: int = 1
    """Number of ranks of the run that saved (RNG states are per rank)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-serialisable run information (seed, lr, skipped steps...)."""


@dataclass(frozen=True, slots=True)
class _FileRecord:
    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class _LayerRecord:
    index: int
    file: _FileRecord
    shapes: dict[str, list[int]]


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint on disk (its manifest was read and checked)."""

    path: Path
    meta: CheckpointMeta
    layers: tuple[_LayerRecord, ...]
    rng: dict[int, _FileRecord]

    @property
    def step(self) -> int:
        return self.meta.step

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_NAME


# -- file helpers -----------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _atomic_write(path: Path, data: bytes) -> _FileRecord:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return _FileRecord(path.name, len(data), hashlib.sha256(data).hexdigest())


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _read_verified(ckpt_dir: Path, rec: _FileRecord, what: str) -> Any:
    path = ckpt_dir / rec.file
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {what} file {str(path)!r}: {e.strerror or e}") from e
    if len(data) != rec.bytes:
        raise CheckpointError(
            f"{what} file {str(path)!r} is truncated or damaged: {len(data)} bytes, "
            f"the manifest says {rec.bytes}"
        )
    if hashlib.sha256(data).hexdigest() != rec.sha256:
        raise CheckpointError(
            f"{what} file {str(path)!r} is corrupted: sha256 does not match the manifest"
        )
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # one line, whatever torch raises
        raise CheckpointError(f"{what} file {str(path)!r} cannot be read by torch: {e}") from e


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken after ``step`` completed steps."""
    return Path(root) / f"step-{step:08d}"


# -- RNG --------------------------------------------------------------------------------------
def capture_rng_state() -> dict[str, Any]:
    """This process's torch (CPU and CUDA), python and numpy RNG states."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _listify(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        state["numpy"] = [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(gauss)]
    except ImportError:  # pragma: no cover
        pass
    return state


def _listify(x: Any) -> Any:
    return [_listify(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuplify(x: Any) -> Any:
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Set this process's RNGs from :func:`capture_rng_state`'s result."""
    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


# -- per-layer state ----------------------------------------------------------------------------
def _cpu_copy(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu", copy=True)
    if isinstance(v, dict):
        return {k: _cpu_copy(x) for k, x in v.items()}
    return copy.deepcopy(v)


def stage_layer_states(
    module: nn.Module, first_layer: int, optimizer: torch.optim.Optimizer | None = None
) -> dict[int, LayerState]:
    """Split a stage's weights and optimizer state into per-layer states.

    Args:
        module: the stage, whose children are the chain's layers ``first_layer, ...`` in
            order (as :meth:`Workload.build_stage` builds it).
        first_layer: chain index of the first child.
        optimizer: the optimizer over the stage's parameters (state keyed by parameter name).

    Returns:
        ``{chain index: LayerState}`` with CPU copies of every tensor.
    """
    out: dict[int, LayerState] = {}
    for i, layer in enumerate(module.children()):
        opt: dict[str, dict[str, Any]] = {}
        if optimizer is not None:
            for name, p in layer.named_parameters(remove_duplicate=False):
                st = optimizer.state.get(p)
                if st:
                    opt[name] = _cpu_copy(dict(st))
        tensors = {k: _cpu_copy(v) for k, v in layer.state_dict().items()}
        out[first_layer + i] = LayerState(first_layer + i, tensors, opt)
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
        crash = os.environ.get(CRASH_IN_SAVE_ENV) == str(meta.step)
        layers = []
        for idx in sorted(layer_states):
            ls = layer_states[idx]
            payload = {"index": idx, "tensors": ls.tensors, "optimizer": ls.optimizer}
            rec = _atomic_write(d / f"layer-{idx:05d}.pt", _to_bytes(payload))
            shapes = {k: list(v.shape) for k, v in ls.tensors.items()}
            layers.append({"index": idx, **_rec_dict(rec), "shapes": shapes})
            if crash:
                os._exit(3)  # test hook: die mid-save, before the manifest
        rng = _atomic_write(
            d / f"rng-rank{rank:05d}.pt",
            _to_bytes(dict(rng_state) if rng_state is not None else capture_rng_state()),
        )
        part = {"save_id": sid, "rank": rank, "layers": layers, "rng": _rec_dict(rng)}
        _atomic_write(d / f"part-{sid}-rank{rank:05d}.json", json.dumps(part).encode())
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint {str(d)!r}: {e.strerror or e} ({e.filename or d})"
        ) from e
    if barrier is not None:
        barrier()
    if write_manifest:
        _write_manifest(d, meta, sid)
        _fsync_dir(d)
        if keep is not None:
            prune_checkpoints(root, keep)
    return d


def _rec_dict(rec: _FileRecord) -> dict[str, Any]:
    return {"file": rec.file, "bytes": rec.bytes, "sha256": rec.sha256}


def _write_manifest(d: Path, meta: CheckpointMeta, sid: str) -> None:
    layers: dict[int, dict[str, Any]] = {}
    rng: dict[int, dict[str, Any]] = {}
    for part_path in sorted(d.glob(f"part-{sid}-rank*.json")):
        part = json.loads(part_path.read_text())
        rng[int(part["rank"])] = part["rng"]
        for rec in part["layers"]:
            layers.setdefault(int(rec["index"]), rec)
    missing = [i for i in range(meta.num_layers) if i not in layers]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(d)!r}: layers {missing} were written by no rank; manifest not written"
        )
    manifest = {
        "schema_version": CHECKPOINT_SCHEMA_VERSION,
        "model_name": meta.model_name,
        "num_layers": meta.num_layers,
        "step": meta.step,
        "samples_consumed": meta.samples_consumed,
        "optimizer_type": meta.optimizer_type,
        "world_size": meta.world_size,
        "plan": meta.plan,
        "extra": meta.extra,
        "layers": [layers[i] for i in range(meta.num_layers)],
        "rng": {str(r): rec for r, rec in sorted(rng.items())},
    }
    try:
        _atomic_write(d / MANIFEST_NAME, (json.dumps(manifest, indent=1) + "\n").encode())
    except OSError as e:
        raise CheckpointError(f"cannot write {str(d / MANIFEST_NAME)!r}: {e.strerror or e}") from e


# -- find and read --------------------------------------------------------------------------------
def _bad(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(f"checkpoint manifest {str(path)!r}: {problem}")


def _file_record(x: Any, path: Path, what: str) -> _FileRecord:
    ok = (
        isinstance(x, dict)
        and isinstance(x.get("file"), str)
        and "/" not in x["file"]
        and isinstance(x.get("bytes"), int)
        and isinstance(x.get("sha256"), str)
    )
    if not ok:
        raise _bad(path, f"{what} must have file, bytes and sha256, got {x!r}")
    return _FileRecord(x["file"], x["bytes"], x["sha256"])


def read_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check the manifest of the checkpoint directory ``path``.

    Raises:
        CheckpointError: no manifest (incomplete save), not JSON, a newer schema version,
            missing or malformed fields, or a listed file that is missing.
    """
    d = Path(path)
    mp = d / MANIFEST_NAME
    try:
        data = json.loads(mp.read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{str(d)!r} is not a complete checkpoint: no {MANIFEST_NAME}") from e
    except OSError as e:
        raise CheckpointError(f"cannot read {str(mp)!r}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise _bad(mp, f"not valid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(data, dict):
        raise _bad(mp, f"must hold a JSON object, got {type(data).__name__}")
    v = data.get("schema_version")
    if not isinstance(v, int):
        raise _bad(mp, f"schema_version must be an integer, got {v!r}")
    if v > CHECKPOINT_SCHEMA_VERSION:
        raise _bad(
            mp,
            f"schema_version {v} is newer than this dapple understands "
            f"({CHECKPOINT_SCHEMA_VERSION}); upgrade dapple",
        )
    for key, typ in (("model_name", str), ("num_layers", int), ("step", int), ("layers", list)):
        if not isinstance(data.get(key), typ):
            raise _bad(mp, f"field {key!r} must be a {typ.__name__}, got {data.get(key)!r}")
    n = data["num_layers"]
    if len(data["layers"]) != n:
        raise _bad(mp, f"lists {len(data['layers'])} layers but num_layers is {n}")
    layers = []
    for i, x in enumerate(data["layers"]):
        rec = _file_record(x, mp, f"layer {i}")
        if x.get("index") != i or not isinstance(x.get("shapes"), dict):
            raise _bad(mp, f"layer entry {i} has index {x.get('index')!r} or no shapes")
        layers.append(_LayerRecord(i, rec, {k: list(s) for k, s in x["shapes"].items()}))
    rng_raw = data.get("rng", {})
    rng = {int(r): _file_record(x, mp, f"rng of rank {r}") for r, x in rng_raw.items()}
    for rec in [lr.file for lr in layers] + list(rng.values()):
        if not (d / rec.file).is_file():
            raise CheckpointError(
                f"checkpoint {str(d)!r}: file {rec.file!r} listed in the manifest is missing"
            )
    meta = CheckpointMeta(
        model_name=data["model_name"],
        num_layers=n,
        step=data["step"],
        samples_consumed=int(data.get("samples_consumed", 0)),
        plan=data.get("plan"),
        optimizer_type=str(data.get("optimizer_type", "")),
        world_size=int(data.get("world_size", 1)),
        extra=dict(data.get("extra") or {}),
    )
    return Checkpoint(d, meta, tuple(layers), rng)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint directories under ``root`` (complete or not), oldest step first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in r.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Checkpoint | None:
    """The newest COMPLETE checkpoint under ``root``, or None when there is none.

    Directories without a manifest (a save that crashed) are skipped. A manifest that is
    present but invalid or from a newer schema raises instead of silently falling back.

    Raises:
        CheckpointError: the newest manifest is damaged or from a newer dapple.
    """
    for d in reversed(list_checkpoints(root)):
        if not (d / MANIFEST_NAME).is_file():
            logger.info("skipping incomplete checkpoint %s (no manifest)", d)
            continue
        return read_checkpoint(d)
    return None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints, and incomplete ones older than
    the newest complete one. Returns the deleted directories."""
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1, got {keep}")
    dirs = list_checkpoints(root)
    complete = [d for d in dirs if (d / MANIFEST_NAME).is_file()]
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = complete[-1]
    doomed = [d for d in dirs if d not in kept and d.name < newest.name]
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


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
        payload = _read_verified(ckpt.path, rec.file, f"layer {i}")
        if not (isinstance(payload, dict) and payload.get("index") == i):
            raise CheckpointError(f"layer file {str(ckpt.path / rec.file.file)!r} is not layer {i}")
        out[i] = LayerState(i, dict(payload["tensors"]), dict(payload.get("optimizer", {})))
    return out


def load_rng_state(ckpt: Checkpoint, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s saved RNG states, or None when that rank did not save any."""
    rec = ckpt.rng.get(rank)
    if rec is None:
        return None
    state = _read_verified(ckpt.path, rec, f"rng state of rank {rank}")
    return dict(state)


def check_compatible(
    ckpt: Checkpoint, *, model_name: str, num_layers: int, plan_num_layers: int | None = None
) -> None:
    """Reject a checkpoint of another model, or a plan that does not cover the model.

    Raises:
        CheckpointError: model name or layer count differ, or the plan's layer count differs.
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


def restore_stage(
    ckpt: Checkpoint,
    module: nn.Module,
    first_layer: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Load layers ``first_layer ..`` into ``module``'s children and rebuild the optimizer state.

    The optimizer state is re-keyed from parameter names to the optimizer's own parameter
    order, so a stage of any plan can resume; hyperparameters (lr, betas, ...) stay those of
    ``optimizer``.

    Raises:
        CheckpointError: a layer's tensor names or shapes differ from the checkpoint's (another
            model), the optimizer class differs, or a layer file is damaged.
    """
    children = list(module.children())
    idxs = range(first_layer, first_layer + len(children))
    for i, layer in zip(idxs, children, strict=False):
        if i >= ckpt.meta.num_layers:
            break
        want = {k: list(v.shape) for k, v in layer.state_dict().items()}
        have = ckpt.layers[i].shapes
        if want != have:
            k = next(k for k in [*want, *have] if want.get(k) != have.get(k))
            raise CheckpointError(
                f"checkpoint {str(ckpt.manifest_path)!r} is of another model: layer {i} tensor "
                f"{k!r} has shape {have.get(k)} there but {want.get(k)} in the model"
            )
    if optimizer is not None and ckpt.meta.optimizer_type not in ("", type(optimizer).__name__):
        raise CheckpointError(
            f"checkpoint {str(ckpt.manifest_path)!r} has {ckpt.meta.optimizer_type} optimizer "
            f"state; cannot resume with {type(optimizer).__name__}"
        )
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
    sd["state"] = {n: by_param[id(p)] for n, p in enumerate(order) if id(p) in by_param}
    optimizer.load_state_dict(sd)


def check_writable(root: str | Path) -> Path:
    """Create ``root`` if needed and prove a file can be written there (before training).

    Raises:
        CheckpointError: the directory cannot be created or written.
    """
    r = Path(root)
    try:
        r.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dapple-write-probe-", dir=r)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(
            f"checkpoint directory {str(r)!r} is not writable: {e.strerror or e}"
        ) from e
    return r

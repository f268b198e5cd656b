"""Checkpoint files: atomic writes, the manifest (schema, per-file size and sha256), RNG states
and finding checkpoints (pruning and the checks of a directory before a run:
:mod:`dapple.runtime.checkpoint.ownership`).

Private to :mod:`dapple.runtime.checkpoint`, which re-exports the public names.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dapple.errors import DappleError
from dapple.files.atomic_file import write_atomically

logger = logging.getLogger("dapple.runtime.checkpoint")

CHECKPOINT_SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
CRASH_IN_SAVE_ENV = "DAPPLE_TEST_CRASH_IN_SAVE"
"""Test hook: at the save of this step, a writing rank ``os._exit(3)``s after its first layer
file, before the barrier and the manifest (not in a worker ``torchrun`` restarted)."""
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointError(DappleError):
    """A checkpoint is missing, damaged, incompatible, or cannot be written."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are damaged: a truncated, corrupted, unreadable or missing file, a
    manifest that is not valid, or incomplete optimizer state. A resume falls back past such a
    checkpoint to an older intact one (a checkpoint of another model, optimizer or a newer
    dapple is refused instead)."""


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


# -- RNG states (one file per rank) --------------------------------------------------------------------------------------
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


# -- file helpers -----------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
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


def atomic_write(path: Path, data: bytes) -> _FileRecord:
    """Write ``data`` whole at ``path`` (:func:`~dapple.files.atomic_file.write_atomically`);
    its record for the manifest (name, size, sha256)."""
    write_atomically(path, data)
    return _FileRecord(path.name, len(data), hashlib.sha256(data).hexdigest())


def to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _check_bytes(path: Path, data: bytes, rec: _FileRecord, what: str) -> None:
    """``data`` (the file at ``path``) has the size and sha256 the manifest lists."""
    if len(data) != rec.bytes:
        raise DamagedCheckpointError(
            f"{what} file {str(path)!r} is truncated or damaged: {len(data)} bytes, "
            f"the manifest says {rec.bytes}"
        )
    if hashlib.sha256(data).hexdigest() != rec.sha256:
        raise DamagedCheckpointError(
            f"{what} file {str(path)!r} is corrupted: sha256 does not match the manifest"
        )


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DamagedCheckpointError(
            f"cannot read {what} file {str(path)!r}: {e.strerror or e}"
        ) from e


def read_verified(ckpt_dir: Path, rec: _FileRecord, what: str) -> Any:
    path = ckpt_dir / rec.file
    data = _read(path, what)
    _check_bytes(path, data, rec, what)
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # one line, whatever torch raises
        raise DamagedCheckpointError(
            f"{what} file {str(path)!r} cannot be read by torch: {e}"
        ) from e


def check_files(ckpt: Checkpoint) -> None:
    """Every file the manifest lists (layers, RNG states) has its listed size and sha256: the
    launcher's one check before any worker starts, so a damaged checkpoint is one error line.

    Raises:
        CheckpointError: the first truncated, corrupted or unreadable file (named).
    """
    records = [(f"layer {lr.index}", lr.file) for lr in ckpt.layers]
    records += [(f"rng of rank {r}", rec) for r, rec in sorted(ckpt.rng.items())]
    for what, rec in records:
        path = ckpt.path / rec.file
        _check_bytes(path, _read(path, what), rec, what)


def step_dir(root: str | Path, step: int) -> Path:
    """The directory of the checkpoint taken after ``step`` completed steps."""
    return Path(root) / f"step-{step:08d}"


def rec_dict(rec: _FileRecord) -> dict[str, Any]:
    return {"file": rec.file, "bytes": rec.bytes, "sha256": rec.sha256}


def merge_parts_into_manifest(d: Path, meta: CheckpointMeta, sid: str) -> None:
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
        atomic_write(d / MANIFEST_NAME, (json.dumps(manifest, indent=1) + "\n").encode())
    except OSError as e:
        raise CheckpointError(f"cannot write {str(d / MANIFEST_NAME)!r}: {e.strerror or e}") from e


# -- find and read --------------------------------------------------------------------------------
def _bad(path: Path, problem: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(f"checkpoint manifest {str(path)!r}: {problem}")


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
        raise DamagedCheckpointError(
            f"{str(d)!r} is not a complete checkpoint: no {MANIFEST_NAME}"
        ) from e
    except OSError as e:
        raise DamagedCheckpointError(f"cannot read {str(mp)!r}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise _bad(mp, f"not valid JSON ({e.msg} at line {e.lineno})") from e
    if not isinstance(data, dict):
        raise _bad(mp, f"must hold a JSON object, got {type(data).__name__}")
    v = data.get("schema_version")
    if not isinstance(v, int):
        raise _bad(mp, f"schema_version must be an integer, got {v!r}")
    if v > CHECKPOINT_SCHEMA_VERSION:  # not damage: refused, never skipped
        raise CheckpointError(
            f"checkpoint manifest {str(mp)!r}: schema_version {v} is newer than this dapple "
            f"understands ({CHECKPOINT_SCHEMA_VERSION}); upgrade dapple"
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
            raise DamagedCheckpointError(
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
    try:
        entries = list(Path(root).iterdir())
    except (FileNotFoundError, NotADirectoryError):  # absent, or removed meanwhile by another
        return []  # rank's write probe (:func:`dapple.runtime.checkpoint.probe.check_writable`)
    found = [(int(m.group(1)), p) for p in entries if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Checkpoint | None:
    """The newest COMPLETE checkpoint under ``root`` whose manifest reads, or None when there is
    none.

    Directories without a manifest (a save that crashed) are skipped; so is a damaged manifest
    (or one listing a missing file) when an older checkpoint reads, with a warning. Only the
    manifest is checked here, not the files' checksums (:func:`check_files` does that).

    Raises:
        CheckpointError: a manifest from a newer dapple, or every manifest is damaged (the
            newest one's problem).
    """
    first: DamagedCheckpointError | None = None
    for d in reversed(list_checkpoints(root)):
        if not (d / MANIFEST_NAME).is_file():
            logger.info("skipping incomplete checkpoint %s (no manifest)", d)
            continue
        try:
            ck = read_checkpoint(d)
        except DamagedCheckpointError as e:
            first = first or e
            continue
        if first is not None:
            logger.warning("%s; using the older checkpoint %s", first, d)
        return ck
    if first is not None:
        raise first
    return None

"""Weights out: a layer checkpoint as one Hugging Face style directory of safetensors shards.

The checkpoint is read one layer file at a time and written into shards of at most
``max_shard_bytes``; at most one layer and one shard are in memory, never the whole model twice.
Given the workload it was trained as, the directory also gets that model's ``config.json``
(Hugging Face models, :func:`dapple.models.hf.hf_config`) and holds exactly the tensors of the
model's ``state_dict`` (a tied parameter once, under its first name), so
``AutoModelForCausalLM.from_pretrained(DIR)`` loads it. Given a layer chain (a zoo model, no
module to follow) the checkpoint's shapes are checked against its layers built on ``meta``.
Without a workload, or with a layer chain, every tensor of every layer is written: under its
name in the layer when no two layers share a name (a Hugging Face model's layers hold its
canonical names, so ``--weights`` reads that back), otherwise every name is prefixed with its
layer, ``layers.{i}.{name}`` (the zoo's blocks all hold ``fc1.weight``). Either way the count written must equal the count held, or nothing is.

The directory is assembled under a temporary name beside the target and renamed at the end:
nothing is overwritten. Its place is proved writable before the checkpoint is read, and a
refused export leaves no directory behind (not even the target's missing parents). Files and
directories get the modes the process umask gives a plain ``open()``/``mkdir`` (``tempfile``'s
private 0700 directory and ``safetensors``' 0600 files are not what a user publishes).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dapple.errors import ValidationError
from dapple.models.generate import TOKENIZER_FILES
from dapple.models.workload import Workload
from dapple.runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_compatible,
    check_layer_shapes,
    latest_checkpoint,
    list_checkpoints,
    load_layer_states,
    read_checkpoint,
)

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "ExportResult",
    "check_export_target",
    "export_checkpoint",
    "newest_checkpoint",
    "no_checkpoint_reason",
]

log = logging.getLogger(__name__)

DEFAULT_SHARD_BYTES = 5 * 1024**3
"""Shard size limit (5 GiB, as ``transformers``' ``save_pretrained``)."""

_INDEX = "model.safetensors.index.json"
_COMPANIONS = (*TOKENIZER_FILES, "generation_config.json")
"""Files of an ``hf:DIR`` model's directory copied into its export, when present."""
_COMPANION_DIRS = ("additional_chat_templates",)
"""Directories of such files (``transformers`` saves extra chat templates there)."""


@dataclass(frozen=True, slots=True)
class ExportResult:
    """What :func:`export_checkpoint` wrote."""

    path: Path
    step: int
    """The checkpoint's step (optimizer steps done)."""
    files: tuple[str, ...]
    num_tensors: int
    total_bytes: int
    config: bool
    """Whether a ``config.json`` was written."""
    copied: tuple[str, ...] = ()
    """Files copied from the ``hf:DIR`` model's directory (tokenizer, generation config)."""


def _target(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValidationError(f"export target {out} exists and is not an empty directory")


def _make_workspace(target: Path) -> tuple[Path, list[Path]]:
    """A temporary directory beside ``target`` and the parents created for it (outermost first).

    Raises:
        ValidationError: the place cannot be created or written (nothing is left behind).
    """
    made: list[Path] = []
    try:
        for p in reversed([p for p in target.parents if not p.exists()]):  # outermost first
            p.mkdir()
            made.append(p)
        return _mkdir_unique(target.parent, f".{target.name}-"), made
    except OSError as e:
        _remove_dirs(made)
        raise ValidationError(f"cannot write the export to {target}: {e.strerror or e}") from e


def _mkdir_unique(parent: Path, prefix: str) -> Path:
    """A new directory ``parent/prefix<random>``, made by ``mkdir``: mode 0777 less the umask
    (``tempfile.mkdtemp`` makes 0700, and the export is renamed into place with that mode)."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def _file_mode() -> int:
    """The mode ``open()`` gives a new file: 0666 less the process umask."""
    try:  # Linux says it without changing it
        status = Path("/proc/self/status").read_text()
        umask = int(next(x.split()[1] for x in status.splitlines() if x.startswith("Umask:")), 8)
    except (OSError, StopIteration, IndexError, ValueError):
        umask = os.umask(0o077)  # POSIX reads it only by setting it
        os.umask(umask)
    return 0o666 & ~umask


def check_export_target(out: str | Path) -> None:
    """The export target is absent or an empty directory and its place is writable; checked
    before anything is read or built, leaving nothing behind.

    Raises:
        ValidationError: a non-empty target, or a place that cannot be created or written.
    """
    target = Path(out).resolve()
    _target(target)
    tmp, made = _make_workspace(target)
    tmp.rmdir()
    _remove_dirs(made)


def _remove_dirs(made: list[Path]) -> None:
    """Remove the directories ``made`` (outermost first) that are still empty, innermost first."""
    for p in reversed(made):
        try:
            p.rmdir()
        except OSError:
            break


def _layer_prefixed(ckpt: Checkpoint) -> bool:
    """Whether two layers of the checkpoint hold a tensor of the same name."""
    seen: set[str] = set()
    for rec in ckpt.layers:
        if seen & rec.shapes.keys():
            return True
        seen |= rec.shapes.keys()
    return False


def _wanted_names(workload: Workload | None) -> tuple[dict[str, str] | None, Any]:
    """Checkpoint tensor name -> exported name (``None``: all), and the HF config if any.
    A layer chain (a zoo model, not cut from one module) has no model ``state_dict`` to
    follow: all of its tensors, as without a workload."""
    from dapple.models.split import is_traced, model_factory_of

    if workload is None or not is_traced(workload):
        return None, None
    from dapple.models.hf import hf_config
    from dapple.models.materialize import build_meta, canonical_names

    config = hf_config(workload)
    model = build_meta(model_factory_of(workload), 0)
    canonical = canonical_names(model)
    keys = set(model.state_dict(keep_vars=True))
    names = {n: canonical.get(n, n) for n in keys}
    return names, config


class _Shards:
    """Tensors written into ``model-XXXXX.safetensors`` shards of at most ``limit`` bytes."""

    def __init__(self, root: Path, limit: int) -> None:
        self.root, self.limit = root, limit
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[str] = []
        self.where: dict[str, int] = {}
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + size > self.limit:
            self.flush()
        self.pending[name] = t.detach().to("cpu").contiguous()
        self.pending_bytes += size
        self.where[name] = len(self.files)
        self.total += size

    def flush(self) -> None:
        if not self.pending:
            return
        from safetensors.torch import save_file

        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.root / name), metadata={"format": "pt"})
        os.chmod(self.root / name, _file_mode())  # safetensors writes 0600 (a renamed temp file)
        self.files.append(name)
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Rename the shards to their final names and write the index (several shards)."""
        self.flush()
        n = len(self.files)
        if n == 1:
            final = ["model.safetensors"]
        else:
            final = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for old, new in zip(self.files, final, strict=True):
            os.replace(self.root / old, self.root / new)
        if n > 1:
            index = {
                "metadata": {"total_size": self.total},
                "weight_map": {k: final[i] for k, i in sorted(self.where.items())},
            }
            (self.root / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
            final.append(_INDEX)
        return final


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    workload: Workload | None = None,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> ExportResult:
    """Write a checkpoint's weights as a Hugging Face style directory.

    Args:
        checkpoint: A checkpoint root (its newest complete checkpoint is used) or one
            ``step-NNNNNNNN`` directory.
        out: The directory to create (absent or empty).
        workload: The model it was trained as: checked against the checkpoint, and for a
            Hugging Face model the directory gets its ``config.json`` and exactly its tensors;
            for an ``hf:DIR`` model also DIR's tokenizer files and ``generation_config.json``.
        max_shard_bytes: Shard size limit.

    Raises:
        ValidationError: The target exists and is not empty or cannot be written, a bad shard
            size, or a checkpoint of another model.
        CheckpointError: No checkpoint, a damaged one (the message names the file), or the
            tensors written would not be every tensor held. Nothing is left behind then.
    """
    if max_shard_bytes < 1:
        raise ValidationError(f"max shard size must be positive, got {max_shard_bytes}")
    target = Path(out).resolve()
    _target(target)
    tmp, made = _make_workspace(target)
    try:
        ckpt, shards, files, config = _write(Path(checkpoint), tmp, workload, max_shard_bytes)
        copied = _copy_companions(_source_dir(config), tmp)
        if target.exists():
            target.rmdir()  # empty, checked above
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_dirs(made)
        raise
    log.info("exported %s step %d to %s (%d files)", ckpt.path, ckpt.step, target, len(files))
    if copied:
        log.info("copied %s from %s", ", ".join(copied), _source_dir(config))
    return ExportResult(
        path=target,
        step=ckpt.step,
        files=(*files, *copied),
        num_tensors=len(shards.where),
        total_bytes=shards.total,
        config=config is not None,
        copied=tuple(copied),
    )


def _write(
    src: Path, tmp: Path, workload: Workload | None, max_shard_bytes: int
) -> tuple[Checkpoint, _Shards, list[str], Any]:
    """Write the checkpoint at ``src`` into ``tmp``: its shards, index and config.

    Raises:
        CheckpointError: no checkpoint, a damaged one, or the tensors written are not exactly
            the tensors held: the model's ``state_dict`` (a tied parameter once), or without a
            model every tensor of every layer.
    """
    ckpt = newest_checkpoint(src)
    if ckpt is None:
        raise CheckpointError(no_checkpoint_reason(src))
    if workload is not None:
        check_compatible(ckpt, model_name=workload.name, num_layers=workload.num_layers)
        _check_chain_shapes(ckpt, workload)
    names, config = _wanted_names(workload)
    prefixed = names is None and _layer_prefixed(ckpt)
    shards = _Shards(tmp, max_shard_bytes)
    held = 0
    for i in range(ckpt.meta.num_layers):  # one layer file in memory at a time
        for name, t in load_layer_states(ckpt, [i])[i].tensors.items():
            held += 1
            if names is None:
                key: str | None = f"layers.{i}.{name}" if prefixed else name
            else:  # None: not in the model's state_dict (a buffer the layer alone keeps)
                key = names.get(name)
            if key is not None and key not in shards.where:  # a tied parameter: once
                shards.add(key, t)
    want = held if names is None else len(set(names.values()))
    if len(shards.where) != want:
        missing = sorted(set(names.values()) - shards.where.keys()) if names is not None else []
        raise CheckpointError(
            f"export of {str(ckpt.path)!r} would write {len(shards.where)} of {want} tensors"
            + (f"; the checkpoint lacks {missing[:5]}" if missing else "")
            + "; nothing written"
        )
    files = shards.finish()
    if config is not None:
        config.save_pretrained(tmp)
        files.append("config.json")
    return ckpt, shards, files, config


def _check_chain_shapes(ckpt: Checkpoint, workload: Workload) -> None:
    """A layer chain's checkpoint holds its layers' tensors in their shapes (another size of
    the same zoo model is refused; a traced model is checked against its ``state_dict``).

    Raises:
        CheckpointError: the first tensor whose shape differs (``check_layer_shapes``).
    """
    from dapple.models.fingerprint import layer_tensors
    from dapple.models.split import is_traced

    if is_traced(workload):
        return
    for i in range(min(workload.num_layers, len(ckpt.layers))):
        tensors = layer_tensors(workload, i)
        if tensors is not None:
            check_layer_shapes(ckpt, i, {k: shape for k, (shape, _) in tensors.items()})


def newest_checkpoint(src: str | Path) -> Checkpoint | None:
    """The checkpoint at ``src``: that ``step-NNNNNNNN`` directory, or the newest complete one
    under a checkpoint root (a damaged newer one is skipped with a warning); ``None`` if none.

    Raises:
        CheckpointError: a damaged checkpoint directory, or every one under the root damaged.
    """
    src = Path(src)
    ckpt = read_checkpoint(src) if (src / "manifest.json").is_file() else latest_checkpoint(src)
    newest = [d for d in list_checkpoints(src) if (d / "manifest.json").is_file()]
    if ckpt is not None and newest and newest[-1] != ckpt.path:
        log.warning("%s is damaged: using the older %s", newest[-1], ckpt.path)
    return ckpt


def no_checkpoint_reason(src: str | Path) -> str:
    """Why ``src``, where :func:`newest_checkpoint` found none, holds no checkpoint: a path
    that does not exist, a file, or a directory without a complete one (one line)."""
    p, shown = Path(src), repr(str(src))
    if not p.exists():
        return f"no checkpoint under {shown}: no such directory"
    if not p.is_dir():
        return f"no checkpoint under {shown}: it is a file, not a checkpoint directory"
    return f"no complete checkpoint under {shown}"


def _source_dir(config: Any) -> Path | None:
    """The directory of an ``hf:DIR`` model (its config's ``name_or_path``), else ``None``."""
    where = str(getattr(config, "name_or_path", "") or "")
    return Path(where) if where and Path(where).is_dir() else None


def _copy_companions(src: Path | None, tmp: Path) -> list[str]:
    """Copy the tokenizer files and ``generation_config.json`` present in ``src`` into ``tmp``.

    ``shutil.copyfile`` creates each file as ``open()`` does (mode from the umask, not the
    source's). Returns the names copied (``DIR/NAME`` for a file of a directory).

    Raises:
        ValidationError: a file that cannot be read (nothing is left behind).
    """
    if src is None:
        return []
    copied = [n for n in _COMPANIONS if (src / n).is_file()]
    try:
        for name in copied:
            shutil.copyfile(src / name, tmp / name)
        for sub in (d for d in _COMPANION_DIRS if (src / d).is_dir()):
            (tmp / sub).mkdir()
            for f in sorted(p for p in (src / sub).iterdir() if p.is_file()):
                shutil.copyfile(f, tmp / sub / f.name)
                copied.append(f"{sub}/{f.name}")
    except OSError as e:
        raise ValidationError(f"cannot copy {e.filename} into the export: {e.strerror or e}") from e
    return copied

"""The Python API's export side: one typed :class:`ExportConfig` behind ``dapple export`` and
:func:`export`.

``dapple export``'s flags are read once into an :class:`ExportConfig`; ``export(cfg)`` writes
the checkpoint it names as a Hugging Face style directory
(:func:`dapple.runtime.export.export_checkpoint`). Torch loads with the export, not with this
module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dapple.api.run_config import ModelConfig

if TYPE_CHECKING:
    from dapple.runtime.export import ExportResult

__all__ = ["MAX_SHARD_BYTES", "ExportConfig", "export"]

MAX_SHARD_BYTES = 5 * 10**9
"""The largest safetensors shard by default (``--max-shard-size 5GB``; the runtime's own
default, :data:`dapple.runtime.export.DEFAULT_SHARD_BYTES`, is 5 GiB)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportConfig:
    """What ``dapple export`` is asked for: the checkpoint, the directory to write and the
    model it was trained as."""

    checkpoint_dir: str
    """A checkpoint root (its newest complete checkpoint) or one ``step-NNNNNNNN`` directory."""
    out_dir: str
    """The directory to create (absent or empty)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model as trained (``-m`` and its flags); no ``spec``: the weights alone, without
    ``config.json``."""
    max_shard_bytes: int = MAX_SHARD_BYTES
    """The largest safetensors shard, in bytes."""


def export(cfg: ExportConfig) -> ExportResult:
    """Write ``cfg.checkpoint_dir``'s weights as a Hugging Face style directory at
    ``cfg.out_dir``; the target is checked before the model is built or the checkpoint read.

    Raises:
        ValidationError: a target that is not absent or empty, a bad model spec, no checkpoint.
        CheckpointError: a checkpoint of another model, or a damaged one.
    """
    from dapple.models.spec import load
    from dapple.runtime.export import check_export_target, export_checkpoint

    check_export_target(cfg.out_dir)
    m = cfg.model
    workload = load(m.spec, **m.overrides()) if m.spec else None
    return export_checkpoint(
        cfg.checkpoint_dir, cfg.out_dir, workload, max_shard_bytes=cfg.max_shard_bytes
    )

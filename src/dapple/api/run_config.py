"""What a training run is asked for: one typed configuration behind ``dapple train``, a
``run.toml`` file and :func:`dapple.api.train`.

:class:`RunConfig` holds the model (:class:`ModelConfig`), the plan to run
(:class:`PlanChoice`), the data (:class:`DataConfig`), the runtime's :class:`TrainConfig` and
the options the front doors resolve around it (:class:`RunOptions`). ``dapple train`` builds it
from ``--config FILE`` and the flags given on top, :func:`load_run_config` from a file alone, and
either hands it to :func:`dapple.api.train`; the API's keyword form takes the same options with
the same defaults and builds it too (a test walks every flag). A file groups the keys in the
sections of :data:`RUN_SECTIONS`; each key is its field's name, which is also the API's
keyword::

    [model]
    spec = "transformer"
    set = { layers = 4, hidden = 64 }

    [plan]
    path = "plan.json"

    [optimizer]
    optimizer = "adamw"
    lr = 3e-4

:class:`RunOptions` are resolved into the :class:`TrainConfig` a run gets by
:func:`resolve_train_config`: ``keep = 0`` keeps every checkpoint (TrainConfig: None), an unset
``eval_batches`` is 4 or as many as the evaluation data holds, and evaluation data without
``eval_every`` evaluates after the last step. The model is loaded with
:meth:`RunConfig.model_overrides` (its factory keywords, and ``seq`` from the data's
``seq_len``), whose messages name the command line's flags.

A :class:`RunConfig` is a front door's request and contains the runtime's
:class:`~dapple.runtime.train_config.TrainConfig`; it is a separate class, not more fields of
:class:`TrainConfig`, because only the front doors read the rest (api and cli: the model is
built, the plan file read and the data opened before any worker starts), and the runtime gets
the resolved :class:`TrainConfig` alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapple.errors import ValidationError, check_integer_fields
from dapple.files.config_file import Schema, build_over, dump, load, parse_values
from dapple.runtime.train_config import OPTIM_FIELDS, TrainConfig

__all__ = [
    "DEFAULT_EVAL_BATCHES",
    "DEFAULT_KEEP",
    "NOT_IN_FILE",
    "RUN_SECTIONS",
    "VERIFY_FIELDS",
    "DataConfig",
    "ModelConfig",
    "PlanChoice",
    "RunConfig",
    "RunOptions",
    "check_documents",
    "dump_run_config",
    "load_run_config",
    "open_run_data",
    "resolve_eval",
    "resolve_train_config",
    "resolve_verify_config",
    "run_config_from",
    "seq_len_overrides",
]

DEFAULT_KEEP = 3
"""Checkpoints kept on disk unless told (each holds weights, optimizer state and RNG states)."""
DEFAULT_EVAL_BATCHES = 4
"""K, global batches per evaluation, unless told (fewer when the evaluation data holds fewer)."""

POLICIES = ("A", "B")
DOCUMENT_MODES = ("pack", "pad")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """The model to train (``-m/--model`` and its flags; the API's ``workload``, ``overrides``)."""

    spec: str | None = None
    """A zoo name, ``package.module:factory``, ``file.py:factory`` or ``hf:DIR`` (required)."""
    set: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the model factory (``--set KEY=VALUE``)."""
    split_at: tuple[str, ...] = ()
    """Cut the model before these modules (``--split-at``; default: every block)."""
    weights: str | None = None
    """Pretrained weights: a Hugging Face directory, a ``.safetensors`` or a state_dict file."""
    dynamic_dims: tuple[str, ...] = ()
    """Input dimensions whose size changes from step to step, ``INPUT:DIM=NAME[:MIN..MAX]`` or
    ``INPUT:DIM=static`` (``--dynamic-dims``)."""

    def overrides(self) -> dict[str, Any]:
        """The keyword arguments of :func:`dapple.models.spec.load`: ``set``, with ``split_at``,
        ``weights`` and ``dynamic_dims`` (parsed, :mod:`dapple.models.dim_syntax`) when given.

        Raises:
            ValidationError: a bad ``dynamic_dims`` item; ``weights`` missing or empty.
        """
        from dapple.models.dim_syntax import parse_dynamic_dims

        out = dict(self.set)
        names = [n.strip() for n in self.split_at if n.strip()]
        if names:
            out["split_at"] = names
        if self.weights:
            out["weights"] = _checked_weights(self.weights)
        dims = parse_dynamic_dims(list(self.dynamic_dims))
        if dims:
            out["dynamic_dims"] = dims
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanChoice:
    """The plan to run and how (``--plan``, ``--schedule``, ``--virtual-stages``, ``--policy``)."""

    path: str | None = None
    """The plan JSON file (``dapple plan -o``; required)."""
    schedule: str | None = None
    """Run this schedule instead of the plan's."""
    virtual_stages: int = 1
    """v, model chunks per device group with ``schedule = "interleaved"``."""
    policy: str | None = None
    """DAPPLE warm-up policy ``A`` or ``B`` (K_i) instead of the plan's."""

    def __post_init__(self) -> None:
        if self.virtual_stages < 1:
            raise ValidationError(f"virtual_stages must be >= 1, got {self.virtual_stages}")
        if self.policy is not None and self.policy not in POLICIES:
            raise ValidationError(f"policy must be A or B, got {self.policy!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class DataConfig:
    """What the run trains and evaluates on (``--data``, ``--eval-data``, ``--seq-len``,
    ``--pack``/``--pad``; default: the model's synthetic batches)."""

    path: str | None = None
    """Training token file (``dapple data prepare``), or documents with ``documents``."""
    eval_path: str | None = None
    """Evaluation token file (its first global batches, in order)."""
    seq_len: int | None = None
    """Tokens per sample of the files (the model is built with ``seq = seq_len``)."""
    documents: str | None = None
    """``pack``: whole documents packed into samples; ``pad``: one document per sample, each
    batch padded to its longest; None: the file is read as fixed windows."""

    def __post_init__(self) -> None:
        if self.documents is not None and self.documents not in DOCUMENT_MODES:
            raise ValidationError(f"documents must be pack or pad, got {self.documents!r}")
        if self.seq_len is not None and self.seq_len < 1:
            raise ValidationError(f"seq_len must be >= 1, got {self.seq_len}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """What the front doors resolve around the runtime: options whose meaning needs the data,
    the disk or a profile (:func:`resolve_train_config`)."""

    keep: int = DEFAULT_KEEP
    """Keep the K newest checkpoints (0 keeps every one)."""
    eval_batches: int | None = None
    """Global batches per evaluation (None: 4, or as many as the evaluation data holds)."""
    require_resume: bool = False
    """As ``resume``, but fail when ``checkpoint_dir`` holds no checkpoint to resume."""
    profile: str | None = None
    """A profile JSON or ``paper:NAME``: the simulated step time is shown beside the measured."""
    cluster: str | None = None
    """The cluster (a preset or a file) the prediction is for; with ``profile``."""
    loss_curve: str | None = None
    """Where ``dapple train`` writes the loss-curve PNG (default: beside ``metrics_path``)."""
    elastic: bool = False
    """Re-plan for the devices left when one is lost and go on from the newest checkpoint
    (:mod:`dapple.runtime.launch.elastic`; needs ``profile``, ``cluster``, ``checkpoint_dir`` and
    ``save_every``); under ``torchrun``, plan for each attempt's ``WORLD_SIZE``."""
    min_devices: int = 1
    """An elastic run stops, resumable, rather than go on with fewer devices."""
    max_restarts: int = 3
    """Re-plans an elastic run may make."""

    def __post_init__(self) -> None:
        check_integer_fields(self)
        if self.keep < 0:
            raise ValidationError(f"keep must be >= 0 (0 keeps every checkpoint), got {self.keep}")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValidationError(f"eval_batches must be >= 1, got {self.eval_batches}")
        if (self.profile is None) != (self.cluster is None):
            raise ValidationError("profile and cluster must be given together")
        if self.elastic and self.profile is None:
            raise ValidationError(
                "elastic re-plans with the planner: give profile and cluster (--profile, --cluster)"
            )
        if self.min_devices < 1 or self.max_restarts < 0:
            raise ValidationError(
                f"min_devices must be >= 1 and max_restarts >= 0, got {self.min_devices} and "
                f"{self.max_restarts}"
            )
        if not self.elastic and (self.min_devices, self.max_restarts) != (1, 3):
            raise ValidationError(
                f"min_devices ({self.min_devices}) and max_restarts ({self.max_restarts}) apply "
                "to elastic runs only: add elastic (--elastic) or drop them"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """One training run: model, plan, data, the runtime's options and the front doors' ones.

    ``train.keep`` and ``train.eval_batches`` are not read: :class:`RunOptions` holds them as
    the doors take them (:func:`resolve_train_config`).
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    plan: PlanChoice = field(default_factory=PlanChoice)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunOptions = field(default_factory=RunOptions)

    def __post_init__(self) -> None:
        if self.run.require_resume and self.train.checkpoint_dir is None:
            raise ValidationError("require_resume needs a checkpoint_dir")
        t = self.train
        if self.run.elastic and (t.checkpoint_dir is None or t.save_every <= 0):
            raise ValidationError(
                "an elastic run resumes from its checkpoints: give it checkpoint_dir and "
                f"save_every (got checkpoint_dir={t.checkpoint_dir!r}, save_every={t.save_every!r})"
            )

    def model_overrides(self) -> dict[str, Any]:
        """The keyword arguments the model is loaded with: :meth:`ModelConfig.overrides`, and
        ``seq = data.seq_len`` with a data file (:func:`seq_len_overrides`).

        Raises:
            ValidationError: a bad model option, or data options that do not fit together.
        """
        d = self.data
        return seq_len_overrides(self.model.overrides(), data=d.path, eval_data=d.eval_path,
                                 seq_len=d.seq_len, documents=d.documents)  # fmt: skip


def _checked_weights(path: str) -> str:
    """``weights`` when it names a directory or a non-empty file: checked before any worker
    starts (the weights themselves are read as the model loads).

    Raises:
        ValidationError: a missing path, an empty file or an empty directory.
    """
    p = Path(path)
    if not p.exists():
        raise ValidationError(f"--weights {path!r}: no such file or directory")
    if p.is_file() and p.stat().st_size == 0:
        raise ValidationError(f"--weights {path!r} is an empty file")
    if p.is_dir() and not any(p.iterdir()):
        raise ValidationError(f"--weights {path!r} is an empty directory")
    return path


def check_documents(data: Any, documents: str | None) -> None:
    """``documents`` (``pack`` or ``pad``) reads the training data: it needs ``data``.

    Raises:
        ValidationError: ``documents`` without ``data``.
    """
    if documents is not None and data is None:
        raise ValidationError(f"--{documents} applies to --data; give a documents file")


def seq_len_overrides(
    overrides: dict[str, Any],
    *,
    data: Any,
    eval_data: Any,
    seq_len: int | None,
    documents: str | None,
) -> dict[str, Any]:
    """``overrides`` plus ``seq = seq_len`` when a data file is given (the model is built for
    the data's sequence length).

    Raises:
        ValidationError: ``seq_len`` without a data file, a data file without ``seq_len``,
            ``seq`` in ``overrides`` disagreeing with ``seq_len``; ``documents`` without
            ``data``.
    """
    check_documents(data, documents)
    if data is None and eval_data is None:
        if seq_len is not None:
            raise ValidationError("--seq-len applies to --data / --eval-data; give a data file")
        return overrides
    if seq_len is None:
        raise ValidationError("--data / --eval-data need --seq-len N (tokens per sample)")
    if seq_len < 1:
        raise ValidationError(f"--seq-len must be >= 1, got {seq_len}")
    if "seq" in overrides and overrides["seq"] != seq_len:
        raise ValidationError(f"--set seq={overrides['seq']} disagrees with --seq-len {seq_len}")
    return {**overrides, "seq": seq_len}


def _own(part: str, cls: type[Any], skip: tuple[str, ...] = ()) -> tuple[tuple[str, str], ...]:
    return tuple((part, f.name) for f in dataclasses.fields(cls) if f.name not in skip)


RUN_SECTIONS: Schema = {
    "model": _own("model", ModelConfig),
    "plan": _own("plan", PlanChoice),
    "data": _own("data", DataConfig),
    "train": tuple(
        ("train", n)
        for n in ("steps", "seed", "device", "precision", "timeout_s", "recompute", "on_nonfinite")
    ),
    "optimizer": (("train", "optimizer"), ("train", "lr"), *(("train", n) for n in OPTIM_FIELDS)),
    "checkpoint": (
        *(("train", n) for n in ("checkpoint_dir", "save_every")),
        ("run", "keep"),
        ("train", "resume"),
        ("run", "require_resume"),
        ("train", "overwrite_checkpoints"),
    ),
    "eval": (("train", "eval_every"), ("run", "eval_batches"), ("train", "eval_batch_size")),
    "report": (
        ("train", "metrics_path"),
        ("train", "grad_norm_every"),
        ("train", "tensorboard_dir"),
        *(("run", n) for n in ("profile", "cluster", "loss_curve")),
    ),
    "elastic": (("run", "elastic"), ("run", "min_devices"), ("run", "max_restarts")),
}
"""The sections of a run file and the fields their keys set (each key is its field's name)."""

NOT_IN_FILE = {
    "echo": "output: dapple train always prints its step lines (the API: echo=)",
    "progress": "output: dapple train always asks for a progress bar (the API: progress=)",
    "predicted_step_ms": "derived: simulated from [report] profile and cluster",
    "keep": "[checkpoint] keep sets RunOptions.keep (0 keeps every checkpoint)",
    "eval_batches": "[eval] eval_batches sets RunOptions.eval_batches (unset: up to 4)",
}
"""The :class:`TrainConfig` fields no key sets, and why."""

PLAN_SECTIONS_OF_OTHER_COMMANDS = ("planning", "simulate")
"""Sections ``dapple plan --config`` reads (one file may serve both commands)."""


def load_run_config(
    path: str | Path, *, over: dict[tuple[str, str], Any] | None = None
) -> RunConfig:
    """The :class:`RunConfig` of a run file, with ``over`` (``(part, field) -> value``) on top.

    Raises:
        ValidationError: an unreadable file, an unknown section or key, a value of the wrong
            type, or a bad option (each naming the file).
    """
    return load(path, RUN_SECTIONS, RunConfig, ignore=PLAN_SECTIONS_OF_OTHER_COMMANDS, over=over)


def run_config_from(
    tables: dict[str, Any], where: str, *, over: dict[tuple[str, str], Any] | None = None
) -> RunConfig:
    """The :class:`RunConfig` of a run file's ``tables`` as read
    (:func:`~dapple.files.config_file.read_toml`), with ``over`` on top: what
    :func:`load_run_config` makes of the file, for a reader that holds its tables already.

    Raises:
        ValidationError: as :func:`load_run_config`, naming the file as ``where``.
    """
    values = parse_values(tables, RUN_SECTIONS, RunConfig, where,
                          ignore=PLAN_SECTIONS_OF_OTHER_COMMANDS)  # fmt: skip
    return build_over(RunConfig, values, over or {}, where)


def dump_run_config(cfg: RunConfig) -> str:
    """``cfg`` as a run file that :func:`load_run_config` reads back to ``cfg``.

    Raises:
        ValidationError: a value TOML cannot hold (a None inside ``[model] set``).
    """
    return dump(cfg, RUN_SECTIONS, "dapple train --config FILE (flags given beside it win)")


def resolve_eval(
    eval_every: int,
    eval_batches: int | None,
    eval_batch_size: int | None,
    steps: int,
    eval_samples: int | None,
    G: int,
) -> tuple[int, int]:
    """``(eval_every, eval_batches)`` a run uses: with evaluation data of ``eval_samples``
    samples, at least after the last step; K left unset: :data:`DEFAULT_EVAL_BATCHES`, or as
    many batches of ``eval_batch_size`` (default G) as the data holds if fewer."""
    every = eval_every or (steps if eval_samples is not None else 0)
    if eval_batches is not None:
        return every, eval_batches
    if eval_samples is None:
        return every, DEFAULT_EVAL_BATCHES
    return every, max(1, min(DEFAULT_EVAL_BATCHES, eval_samples // (eval_batch_size or G)))


def resolve_train_config(
    train: TrainConfig, run: RunOptions, eval_samples: int | None, G: int, **fields: Any
) -> TrainConfig:
    """The :class:`TrainConfig` a run gets: ``train`` with :class:`RunOptions` resolved
    (``keep = 0``: None; ``eval_batches``/``eval_every``: :func:`resolve_eval`; ``require_resume``
    resumes) and ``fields`` set.

    Raises:
        ValidationError: the result's own checks.
    """
    every, batches = resolve_eval(
        train.eval_every, run.eval_batches, train.eval_batch_size, train.steps, eval_samples, G
    )
    return dataclasses.replace(
        train,
        keep=run.keep or None,
        eval_every=every,
        eval_batches=batches,
        resume=train.resume or run.require_resume,
        **fields,
    )


VERIFY_FIELDS = ("steps", "seed", "optimizer", "lr", "timeout_s", "device", "precision",
                 *OPTIM_FIELDS)  # fmt: skip
"""The :class:`TrainConfig` fields ``dapple verify`` runs with (:func:`resolve_verify_config`)."""


def resolve_verify_config(train: TrainConfig) -> TrainConfig:
    """The :class:`TrainConfig` both runs of ``dapple verify`` get: ``train``'s
    :data:`VERIFY_FIELDS`, every other field at its default (a verified run writes no
    checkpoint, metrics or evaluation)."""
    return TrainConfig(**{n: getattr(train, n) for n in VERIFY_FIELDS})


def open_run_data(data: Any, seq_len: int | None, documents: str | None = None) -> Any:
    """A dataset as given, or the file at a path: a token file, or (``documents`` ``pack`` or
    ``pad``) documents packed or padded into samples of ``seq_len``.

    Raises:
        ValidationError: a path without ``seq_len``, or a bad file.
    """
    from dapple.runtime.data import open_data

    if documents is None or not isinstance(data, str | Path):
        return open_data(data, seq_len)
    from dapple.datasets import open_documents

    if seq_len is None:
        raise ValidationError(f"a documents file ({data}) needs seq_len (--seq-len)")
    return open_documents(data, seq_len, documents)

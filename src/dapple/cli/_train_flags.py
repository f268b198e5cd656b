"""``dapple train``'s and ``dapple verify``'s flags as :class:`~dapple.api.run_config.RunConfig`
fields.

:data:`TRAIN_FLAGS` is the one table from the parsed flags to the config: ``dapple train``
builds its :class:`RunConfig` from ``--config FILE`` with the flags the command line gave on top
(:func:`run_config_of`), once; ``dapple verify`` builds it from its flags alone, the rows of
:data:`RUN_FLAGS` (:func:`verify_config_of`). From there on each command reads the config, not
the flags. Torch-free at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING, Any

from dapple.cli._config_args import (
    Flag,
    flags_named,
    given,
    given_values,
    missing_required,
    one,
    parsed_values,
)
from dapple.cli._optim_args import zero_stage_flag
from dapple.errors import ValidationError

if TYPE_CHECKING:
    from dapple.api.run_config import RunConfig

__all__ = [
    "FILE_GIVES",
    "RUN_FLAGS",
    "TRAIN_FLAGS",
    "TRAIN_SECTIONS_HELP",
    "read_run_config",
    "required_inputs",
    "run_config_of",
    "verify_config_of",
]


def _set_items(items: list[str]) -> tuple[dict[str, Any]]:
    from dapple.cli._model_args import parse_overrides

    return (parse_overrides(items),)


def _split_names(text: str | None) -> tuple[tuple[str, ...]]:
    return (tuple(t.strip() for t in (text or "").split(",") if t.strip()),)


def _keep(k: int) -> tuple[int]:
    if k < 0:
        raise ValidationError(f"--keep must be >= 0 (0 keeps every checkpoint), got {k}")
    return (k,)


RUN_FLAGS: tuple[Flag, ...] = (
    # model: -m/--model and its flags (dapple.cli._model_args)
    one("model", "spec", "model"),
    Flag(
        "set",
        (("model", "set"),),
        _set_items,
        lambda v: [f"{k}={json.dumps(x)}" for k, x in v[0].items()],
    ),
    Flag("split_at", (("model", "split_at"),), _split_names, lambda v: ",".join(v[0]) or None),
    one("model", "weights"),
    Flag("dynamic_dims", (("model", "dynamic_dims"),), lambda v: (tuple(v),), lambda v: list(v[0])),
    # the plan and how to run it
    one("plan", "path", "plan"),
    one("plan", "schedule"),
    one("plan", "virtual_stages"),
    one("plan", "policy"),
    # data (dapple.cli._data_args)
    one("data", "path", "data"),
    one("data", "seq_len"),
    one("data", "documents"),
    # the run
    *(one("train", n) for n in ("steps", "seed", "device", "timeout_s", "precision")),
    # optimisation (dapple.cli._optim_args)
    *(one("train", n) for n in ("optimizer", "lr", "weight_decay", "momentum")),
    Flag("betas", (("train", "betas"),), lambda v: (tuple(v),), lambda v: list(v[0])),
    *(one("train", n) for n in ("eps", "lr_schedule", "warmup_steps", "min_lr", "clip_grad_norm")),
    Flag(
        "zero_stage",
        (("train", "zero_stage"),),
        lambda v: (zero_stage_flag(v),),
        lambda v: str(v[0]),
    ),
)
"""The flags ``dapple train`` and ``dapple verify`` share
(:func:`dapple.cli._run_args.add_run_arguments`), as config fields."""

TRAIN_FLAGS: tuple[Flag, ...] = (
    *RUN_FLAGS,
    one("data", "eval_path", "eval_data"),
    one("train", "recompute"),
    one("train", "on_nonfinite"),
    # long runs
    *(one("train", n) for n in ("checkpoint_dir", "save_every")),
    Flag("keep", (("run", "keep"),), _keep),
    one("train", "resume"),
    one("run", "require_resume"),
    one("train", "overwrite_checkpoints"),
    # evaluation and reporting (dapple.cli._train_show)
    one("train", "eval_every"),
    one("run", "eval_batches"),
    one("train", "eval_batch_size"),
    one("train", "metrics_path", "metrics"),
    one("train", "grad_norm_every"),
    one("train", "tensorboard_dir", "tensorboard"),
    one("run", "loss_curve"),
    one("run", "profile"),
    one("run", "cluster"),
    # elastic runs
    *(one("run", n) for n in ("elastic", "min_devices", "max_restarts")),
)
"""Every flag of ``dapple train`` but ``--config`` and ``--print-config``, as config fields."""

FILE_GIVES = ("plan", "model")
"""Required flags a config file may give instead (``[plan] path``, ``[model] spec``)."""

TRAIN_SECTIONS_HELP = (
    "[model] [plan] [data] [train] [optimizer] [checkpoint] [eval] [report] [elastic]"
)

_REQUIRED = {("plan", "path"): "--plan", ("model", "spec"): "-m/--model"}

_ELASTIC_ONLY = {("run", "min_devices"): "--min-devices", ("run", "max_restarts"): "--max-restarts"}
"""The flags that do nothing but in an elastic run. At their defaults (``--min-devices 1``) the
config cannot tell them from no flag, so the command line's own are checked."""

_CHECKPOINT_ONLY = {
    ("train", "save_every"): "--save-every",
    ("run", "keep"): "--keep",
    ("train", "resume"): "--resume",
    ("run", "require_resume"): "--require-resume",
    ("train", "overwrite_checkpoints"): "--overwrite-checkpoints",
}
"""The flags that do nothing without checkpoints (``--checkpoint-dir``): checked like
:data:`_ELASTIC_ONLY`, before the run's own checks (which name the fields, not the flags)."""


def _file_key(f: tuple[str, str]) -> str:
    from dapple.api.run_config import RUN_SECTIONS

    section = next(s for s, fields in RUN_SECTIONS.items() if f in fields)
    return f"[{section}] {f[1]}"


def run_config_of(args: argparse.Namespace) -> RunConfig:
    """The run ``--config FILE`` and the flags the command line gave (those win) ask for
    (:func:`read_run_config`).

    Raises:
        ValidationError: a bad file (:func:`~dapple.api.run_config.load_run_config`) or a
            bad value.
    """
    return read_run_config(args)[0]


def read_run_config(args: argparse.Namespace) -> tuple[RunConfig, bool]:
    """The run ``--config FILE`` (read once) and the flags the command line gave (those win)
    ask for, and whether it saves checkpoints after its last step only: it saves them
    (``--checkpoint-dir`` or ``[checkpoint] checkpoint_dir``) and neither the command line nor
    the file says how often (``--save-every``, ``[checkpoint] save_every``); its
    ``save_every`` is then its steps.

    Raises:
        ValidationError: a bad file (:func:`~dapple.api.run_config.load_run_config`) or a
            bad value.
    """
    from dapple.api.run_config import RunConfig, run_config_from
    from dapple.files.config_file import build, read_toml

    over = given_values(args, TRAIN_FLAGS)
    file = {} if args.config is None else read_toml(args.config)
    _check_flags_apply(file, over)  # before the config's own checks, which name no flag
    _check_elastic_checkpoints(file, over)
    with flags_named(args, TRAIN_FLAGS):
        cfg = (
            build(RunConfig, over)
            if args.config is None
            else run_config_from(file, str(args.config), over=over)
        )
    section = file.get("checkpoint", {})
    at_end = not (
        cfg.train.checkpoint_dir is None
        or "save_every" in given(args)
        or (isinstance(section, dict) and "save_every" in section)
    )
    if at_end:
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, save_every=cfg.train.steps)
        )
    return cfg, at_end


def _from(file: dict[str, Any], over: dict[tuple[str, str], Any], section: str, f: Any) -> Any:
    """Field ``f`` as the command line (``over``) or else the file's ``section`` sets it."""
    if f in over:
        return over[f]
    table = file.get(section)
    return table.get(f[1]) if isinstance(table, dict) else None


def _check_flags_apply(file: dict[str, Any], over: dict[tuple[str, str], Any]) -> None:
    """The flags of :data:`_ELASTIC_ONLY` and :data:`_CHECKPOINT_ONLY` the command line gave
    apply to this run: an elastic one (``--elastic`` or ``[elastic] elastic = true``), one that
    saves checkpoints (``--checkpoint-dir`` or ``[checkpoint] checkpoint_dir``); ``file``: the
    ``--config`` file's tables (empty without one).

    Raises:
        ValidationError: the first one given to a run it does not apply to, with its value.
    """
    elastic = _from(file, over, "elastic", ("run", "elastic")) is True
    saves = _from(file, over, "checkpoint", ("train", "checkpoint_dir")) is not None
    rules = (
        (_ELASTIC_ONLY, elastic,
         "applies to elastic runs only (re-planning when a device is lost): add --elastic"),
        (_CHECKPOINT_ONLY, saves,
         "applies to checkpoints only, and this run has no checkpoint folder: add "
         "--checkpoint-dir DIR"),
    )  # fmt: skip
    for flags, applies, why in rules:
        given = [(flag, over[field]) for field, flag in flags.items() if field in over]
        if given and not applies:
            flag, value = given[0]
            shown = "" if isinstance(value, bool) else f" {value}"
            raise ValidationError(f"{flag}{shown} {why}, or drop it")


def _check_elastic_checkpoints(file: dict[str, Any], over: dict[tuple[str, str], Any]) -> None:
    """An elastic run (``--elastic`` or ``[elastic] elastic = true``) saves checkpoints every N
    steps (``--checkpoint-dir``, ``--save-every`` or the file's ``[checkpoint]`` keys): it goes
    on from the newest one when a device is lost.

    Raises:
        ValidationError: either missing (or N < 1), naming the flags and what was given.
    """
    if _from(file, over, "elastic", ("run", "elastic")) is not True:
        return
    ck = _from(file, over, "checkpoint", ("train", "checkpoint_dir"))
    every = _from(file, over, "checkpoint", ("train", "save_every"))
    if ck is None or not (isinstance(every, int) and every >= 1):
        shown = ["(none)" if x is None else x for x in (ck, every)]
        got = f"--checkpoint-dir {shown[0]}, --save-every {shown[1]}"
        raise ValidationError(
            "--elastic goes on from the newest checkpoint when a device is lost: give "
            f"--checkpoint-dir DIR and --save-every N (N >= 1; got {got})"
        )


def verify_config_of(args: argparse.Namespace) -> RunConfig:
    """The run ``dapple verify``'s flags ask for (every flag of :data:`RUN_FLAGS`, given or
    defaulted: ``--steps`` defaults to 2 there).

    Raises:
        ValidationError: a bad value.
    """
    from dapple.api.run_config import RunConfig
    from dapple.files.config_file import build

    with flags_named(args, RUN_FLAGS):
        return build(RunConfig, parsed_values(args, RUN_FLAGS))


def required_inputs(cfg: RunConfig) -> tuple[str, str]:
    """The plan file and the model spec of ``cfg``, which a run needs.

    Raises:
        ValidationError: no plan or no model, named as the flag (or the file's key).
    """
    from dapple.api.run_config import RUN_SECTIONS
    from dapple.files.config_file import values_of

    missing = missing_required(values_of(cfg, RUN_SECTIONS), _REQUIRED, _file_key)
    if missing or cfg.plan.path is None or cfg.model.spec is None:
        raise ValidationError(missing or "a run needs a plan and a model")
    return cfg.plan.path, cfg.model.spec

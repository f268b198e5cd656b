"""A model's tensors as its layers build them on ``meta``, and a fingerprint of them.

Two models of the same name and layer count (a zoo transformer at two widths) differ in their
layers' tensors. Each layer is built on ``meta`` (:func:`dapple.models.materialize.build_meta`:
no memory, no initialisation) and its ``state_dict`` read: each tensor's name, shape and dtype.
``dapple train --resume`` holds a checkpoint's shapes against them; ``dapple profile`` writes
:func:`model_fingerprint`, a hash of them, into the profile
(:attr:`dapple.core.profile.ModelProfile.model_fingerprint`), and the commands that take a
profile beside a model refuse a profile of another model (:func:`check_profile_model`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable

import torch

from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.models.workload import Workload

log = logging.getLogger(__name__)

__all__ = [
    "check_plan_model",
    "check_profile_model",
    "fingerprint_once",
    "layer_tensors",
    "model_fingerprint",
]

FINGERPRINT_KIND = "meta-state-v1"
"""What the fingerprint hashes (the prefix of its string): the layer count and each layer's
``state_dict`` names, shapes and dtypes, in chain order."""


def layer_tensors(workload: Workload, index: int) -> dict[str, tuple[list[int], str]] | None:
    """Layer ``index`` of ``workload`` built on ``meta`` (a traced model's piece as traced,
    which makes no tensor): each ``state_dict`` tensor's name -> (shape, dtype); None when the
    layer cannot be built so (its check is left to the real layer)."""
    from dapple.models.split import piece_template

    try:
        layer = piece_template(workload, index)
        if layer is None:  # every tensor the factory makes on meta: no memory, whatever the size
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                layer = workload.layer_factories[index]()
        state = layer.state_dict()
    except Exception:  # a factory that needs real tensors: nothing to compare here
        return None
    return {k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()}


def model_fingerprint(workload: Workload) -> str | None:
    """``meta-state-v1:`` and the sha256 (16 hex digits) of ``workload``'s layer count and each
    layer's tensor names, shapes and dtypes (:func:`layer_tensors`); None when a layer cannot
    be built on ``meta``."""
    layers = []
    for i in range(workload.num_layers):
        t = layer_tensors(workload, i)
        if t is None:
            return None
        layers.append(sorted(t.items()))
    text = json.dumps([workload.num_layers, layers], separators=(",", ":"))
    return f"{FINGERPRINT_KIND}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


Fingerprint = Callable[[], str | None]
"""A workload's :func:`model_fingerprint`, built when first called (:func:`fingerprint_once`)."""


def fingerprint_once(workload: Workload) -> Fingerprint:
    """:func:`model_fingerprint` of ``workload``, built at the first call and kept: the checks
    of one run share it (each build reads every layer on ``meta``)."""
    return functools.cache(lambda: model_fingerprint(workload))


def check_profile_model(
    profile: ModelProfile, workload: Workload, what: str, fingerprint: Fingerprint | None = None
) -> None:
    """``profile`` was measured on ``workload``: the same layer count and, when the profile
    records a fingerprint of the model's tensors, the same one; one logged warning naming both
    models when it records none (imported, older, analytic and the paper's profiles: an
    analytic profile's fingerprint hashes the shapes it counted), whatever its model's name.

    Args:
        profile: the profile given beside the model.
        workload: the model.
        what: the profile's option and file, for the message (``--profile p.json``).
        fingerprint: ``workload``'s, shared with the run's other checks (None: built here).

    Raises:
        ValidationError: one line naming the profile's model and this one.
    """
    theirs = f"{profile.model_name!r} ({profile.num_layers} layers)"
    ours = f"{workload.name!r} ({workload.num_layers} layers)"
    if profile.num_layers != workload.num_layers:
        raise ValidationError(
            f"{what} was measured on {theirs}, not on the model {ours}; profile this model "
            "(dapple profile -m MODEL ...)"
        )
    if not _of_tensors(profile.model_fingerprint):  # imported, analytic or older: names are all
        named = f" and was profiled as {profile.model_name!r}" if profile.model_name else ""
        log.warning(
            "%s records no fingerprint of its model's tensors (analytic, imported or older)%s: "
            "dapple cannot check it was measured on the model %s, so what it predicts may be "
            "another model's",
            what, named, ours,
        )  # fmt: skip
        return
    mine = _other_fingerprint(profile.model_fingerprint, workload, fingerprint)
    if mine is not None:
        raise ValidationError(
            f"{what} was measured on another model than {ours}: same layer count, other "
            f"tensor shapes or dtypes (fingerprint {profile.model_fingerprint} there, {mine} "
            f"here; profiled as {profile.model_name!r}); profile this model with the same "
            "--set options (dapple profile -m MODEL --set ...)"
        )


def check_plan_model(
    fingerprint: str | None, workload: Workload, built: Fingerprint | None = None
) -> None:
    """A plan made from a profile whose fingerprint was ``fingerprint``
    (:attr:`~dapple.core.plan.Plan.model_fingerprint`; None: not checked) runs this model's
    tensors: its memory and step time were planned for them. ``built``: ``workload``'s
    fingerprint, shared with the run's other checks (None: built here).

    Raises:
        ValidationError: one line naming both fingerprints.
    """
    mine = _other_fingerprint(fingerprint, workload, built)
    if mine is not None:
        raise ValidationError(
            f"the plan was made for another {workload.name!r} ({workload.num_layers} layers): "
            f"same layer count, other tensor shapes or dtypes (fingerprint {fingerprint} in the "
            f"plan, {mine} here), so its memory and step time do not hold; profile and plan this "
            "model with the same --set options (dapple profile -m MODEL --set ...; dapple plan)"
        )


def _of_tensors(fingerprint: str | None) -> bool:
    """Whether ``fingerprint`` hashes a model's tensors (:func:`model_fingerprint`), which this
    model's can be held against."""
    return fingerprint is not None and fingerprint.startswith(f"{FINGERPRINT_KIND}:")


def _other_fingerprint(
    recorded: str | None, workload: Workload, built: Fingerprint | None
) -> str | None:
    """``workload``'s fingerprint (``built()``, else built here) when ``recorded`` is another
    one; None when they agree, either is unknown or ``recorded`` hashes no tensors."""
    if not _of_tensors(recorded):
        return None
    mine = built() if built is not None else model_fingerprint(workload)
    return mine if mine is not None and mine != recorded else None

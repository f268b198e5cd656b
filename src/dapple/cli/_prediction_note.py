"""What a predicted step time rests on: ``dapple train``'s, printed beside the measured one, and
``dapple plan``'s on the ``local-cpu`` preset."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free, and no import at start-up
    from dapple.core.cluster import Cluster

__all__ = ["OFF_RATIO", "local_preset_note", "prediction_basis"]

OFF_RATIO = 1.5
"""Measured / predicted (or its inverse) above which the note points to ``dapple calibrate``."""


def _cluster_words(spec: str) -> tuple[str, bool]:
    """Words for the cluster ``spec`` and whether it holds calibrated host CPU terms."""
    from dapple.core.cluster_presets import PRESETS, load_cluster

    if spec in PRESETS:
        words = f"the preset cluster {spec!r} (datasheet or default numbers, not calibrated here)"
        return words, False
    try:
        cluster = load_cluster(spec)
    except Exception:  # the run already read it; here only words are at stake
        return f"the cluster file {spec!r}", False
    how = "calibrated host CPU terms" if cluster.host_overheads else "no host CPU terms"
    return f"the cluster file {spec!r} ({how})", cluster.host_overheads


def _profile_words(spec: str) -> str:
    from dapple.core.profile import ModelProfile

    if not Path(spec).is_file():
        return f"the profile {spec!r}"
    try:
        device = ModelProfile.load(spec).device
    except Exception:  # the run already read it; here only words are at stake
        return f"the profile {spec!r}"
    if "analytic" in device:
        return f"the analytic profile {spec!r} ({device}: datasheet numbers, not measured)"
    return (
        f"the profile {spec!r} (layer times measured on {device}, under whatever else the "
        "machine ran then)"
    )


def prediction_basis(profile: str, cluster: str, measured_ms: float, predicted_ms: float) -> str:
    """One or two lines: the profile and cluster the prediction is simulated from, and, when
    measured and predicted differ by more than :data:`OFF_RATIO` either way, by how much and
    what to run (``dapple calibrate``, a co-worker profile)."""
    cluster_words, calibrated = _cluster_words(cluster)
    text = f"the prediction rests on {_profile_words(profile)} and {cluster_words}"
    if measured_ms <= 0 or predicted_ms <= 0:
        return text
    ratio = measured_ms / predicted_ms
    if max(ratio, 1 / ratio) <= OFF_RATIO:
        return text
    if calibrated:
        advice = (
            "the profile and the calibration saw this machine as it was loaded then; re-run "
            "`dapple calibrate` and `dapple profile --co-workers N` when the load is what "
            "training meets, and re-plan with them"
        )
    else:
        advice = (
            "measure this machine with `dapple calibrate --nproc N -o cluster.json` (on shared "
            "CPU cores also `dapple profile --co-workers N`), re-plan with them and train with "
            "`--cluster cluster.json`"
        )
    return f"{text}\nmeasured is {ratio:.2f}x the prediction: {advice}"


def local_preset_note(cluster: Cluster) -> str | None:
    """For a plan predicted on the ``local-cpu`` preset (default numbers for CPU processes,
    nothing measured on this machine): a line saying so and what to run instead; None for
    any other cluster."""
    from dapple.core.cluster_presets import PRESETS

    if cluster != PRESETS["local-cpu"]:
        return None
    return (
        "the prediction rests on the preset cluster 'local-cpu' (default numbers for 4 CPU "
        "processes, not measured here): a run on this machine can take several times as "
        "long; for a prediction of it, measure the machine with `dapple calibrate --nproc N "
        "-o cluster.json` (on shared CPU cores also profile with `dapple profile --co-workers "
        "N`) and plan with `--cluster cluster.json`"
    )

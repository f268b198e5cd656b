"""Analytic V100 profiles of the paper's six benchmark models (table 1), without torch.

The layer arithmetic (parameters, FLOPs, activations) is in
:mod:`dapple.profiler._paper_arch`; this module turns it into :class:`ModelProfile`\\ s with a
simple roofline-style time model of one V100 (fp32, 15.7 TFLOP/s peak, 900 GB/s HBM2):

    F(b) = FORWARD_OVERHEAD_MS + b * (flops / (u * PEAK) + traffic / (e * HBM))
    B(b) = BACKWARD_OVERHEAD_MS + b * BACKWARD_FACTOR * (same per-sample term)

with ``u`` the model's fraction of peak (:data:`UTILISATION`: 0.6 for the dense CNNs, 0.55
for BERT, 0.5 for XLNet, 0.4 for the LSTM and AmoebaNet's small convolutions), ``e = 0.8``,
``traffic = 2 x (kept + output bytes)`` (each element-wise result written once, read once) and
``BACKWARD_FACTOR = 2`` (gradients of inputs and of weights each cost about one forward).

Choices the paper leaves open (documented, not measured):
    - images are ImageNet 224 x 224; BERT-48 and XLNet-36 use SQuAD with sequence length 512
      (table 3's comments give 2.2 MB / 2 MB per sample at the cut, i.e. 512 x 1024 fp32);
      GNMT-16 uses 50-token source and target sentences (0.4 MB per sample at its 9:7 cut =
      decoder hidden state + attention context, 2 x 50 x 1024 fp32) and the 32320-word vocabulary
      of PipeDream's GNMT;
    - layer granularity: one layer per transformer block / conv layer (VGG) / bottleneck block
      (ResNet) / LSTM layer / AmoebaNet cell, plus embedding (or stem) and head layers, so
      BERT-48 has 50 layers and the paper's split position ``23:25`` is ``24:26`` here;
    - table 1's parameter counts appear to mix units: VGG-19 (143.7M = 137.0 x 2^20),
      ResNet-50 (25.6M = 24.4 x 2^20) and XLNet-36 (524M = 500 x 2^20) match it in units of
      2^20, BERT-48 (636M vs 640M) and GNMT-16 (278M vs 291M) in decimal millions;
    - AmoebaNet-D's cell is approximated (see :func:`_paper_arch.amoebanet36_layers`).

The profiles are shipped as ``dapple/data/paper-<name>.json``; regenerate them with
``python -m dapple.profiler.paper_models --write``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.profiler import _paper_arch as arch

__all__ = [
    "BACKWARD_FACTOR",
    "PAPER_GLOBAL_BATCH",
    "PAPER_MODELS",
    "PAPER_PARAMS_M",
    "PAPER_PREFIX",
    "PAPER_PROFILE_BATCH",
    "UTILISATION",
    "V100_HBM_BYTES_PER_S",
    "V100_PEAK_FP32_FLOPS",
    "load_paper_profile",
    "load_profile",
    "paper_name",
    "paper_profile",
    "write_paper_profiles",
]

V100_PEAK_FP32_FLOPS = 15.7e12
"""V100 (SXM2) fp32 peak, FLOP/s."""
V100_HBM_BYTES_PER_S = 900e9
"""V100 HBM2 bandwidth, bytes/s."""
MEMORY_EFFICIENCY = 0.8
"""Fraction of the HBM bandwidth element-wise kernels reach."""
BACKWARD_FACTOR = 2.0
"""Backward per-sample time over forward per-sample time."""
FORWARD_OVERHEAD_MS = 0.05
"""Fixed per-layer, per-call forward cost (kernel launches, framework)."""
BACKWARD_OVERHEAD_MS = 0.1
"""Fixed per-layer, per-call backward cost."""

PAPER_MODELS: tuple[str, ...] = ("resnet50", "vgg19", "gnmt16", "bert48", "xlnet36", "amoebanet36")
"""The paper's benchmark models (table 1), by profile name."""

PAPER_PREFIX = "paper:"
"""Prefix of a profile spec naming a shipped paper profile: ``paper:bert48``."""

PAPER_PARAMS_M: dict[str, float] = {
    "gnmt16": 291.0,
    "bert48": 640.0,
    "xlnet36": 500.0,
    "resnet50": 24.5,
    "vgg19": 137.0,
    "amoebanet36": 933.0,
}
"""Parameter counts of table 1, in millions (as printed; see the module notes on units)."""

PAPER_PROFILE_BATCH: dict[str, int] = {
    "gnmt16": 64,
    "bert48": 2,
    "xlnet36": 1,
    "resnet50": 128,
    "vgg19": 32,
    "amoebanet36": 1,
}
"""Profiling batch sizes of table 1."""

PAPER_GLOBAL_BATCH: dict[str, int] = {
    "resnet50": 2048,
    "vgg19": 2048,
    "gnmt16": 1024,
    "bert48": 64,
    "xlnet36": 128,
    "amoebanet36": 128,
}
"""Global batch sizes (GBS) of the paper's planning-results table (section 7.2)."""

UTILISATION: dict[str, float] = {
    "resnet50": 0.6,
    "vgg19": 0.6,
    "gnmt16": 0.4,
    "bert48": 0.55,
    "xlnet36": 0.5,
    "amoebanet36": 0.4,
}
"""Assumed fraction of the V100 fp32 peak the model's matrix products reach."""

_OPTIMIZER_STATE_FACTOR: dict[str, float] = {
    "gnmt16": 3.0,  # Adam: gradient + two moments
    "bert48": 3.0,
    "xlnet36": 3.0,
    "resnet50": 2.0,  # SGD with momentum: gradient + momentum
    "vgg19": 2.0,
    "amoebanet36": 3.0,  # RMSProp with momentum: gradient + mean square + momentum
}

_INPUT_BYTES_PER_SAMPLE: dict[str, float] = {
    "resnet50": 3 * 224 * 224 * 4,
    "vgg19": 3 * 224 * 224 * 4,
    "amoebanet36": 3 * 224 * 224 * 4,
    "bert48": 2 * 512 * 8,  # token and segment ids, int64
    "xlnet36": 2 * 512 * 8,
    "gnmt16": 2 * 50 * 8,  # source and target token ids
}

_BUILDERS: dict[str, Callable[[], list[arch.LayerSpec]]] = {
    "resnet50": arch.resnet50_layers,
    "vgg19": arch.vgg19_layers,
    "gnmt16": arch.gnmt16_layers,
    "bert48": arch.bert48_layers,
    "xlnet36": arch.xlnet36_layers,
    "amoebanet36": arch.amoebanet36_layers,
}


def _check_name(name: str) -> None:
    if name not in _BUILDERS:
        raise ValidationError(f"unknown paper model {name!r}; known: {', '.join(PAPER_MODELS)}")


def _layer_profile(spec: arch.LayerSpec, utilisation: float) -> LayerProfile:
    out_bytes = 4.0 * spec.output_elements_per_sample
    compute_ms = spec.forward_flops_per_sample / (utilisation * V100_PEAK_FP32_FLOPS) * 1e3
    traffic_bytes = 2.0 * (spec.kept_bytes_per_sample + out_bytes)
    memory_ms = traffic_bytes / (MEMORY_EFFICIENCY * V100_HBM_BYTES_PER_S) * 1e3
    fwd_ms = compute_ms + memory_ms
    return LayerProfile(
        name=spec.name,
        forward=AffineTime(fixed_ms=FORWARD_OVERHEAD_MS, per_sample_ms=fwd_ms),
        backward=AffineTime(fixed_ms=BACKWARD_OVERHEAD_MS, per_sample_ms=BACKWARD_FACTOR * fwd_ms),
        output_bytes_per_sample=out_bytes,
        parameter_bytes=4 * spec.parameter_count,
        kept_activation_bytes_per_sample=float(spec.kept_bytes_per_sample),
    )


def paper_profile(name: str) -> ModelProfile:
    """Generate the analytic V100 profile of paper model ``name``.

    Args:
        name: one of :data:`PAPER_MODELS`.

    Raises:
        ValidationError: unknown model name.
    """
    _check_name(name)
    u = UTILISATION[name]
    return ModelProfile(
        model_name=name,
        layers=tuple(_layer_profile(s, u) for s in _BUILDERS[name]()),
        input_bytes_per_sample=float(_INPUT_BYTES_PER_SAMPLE[name]),
        dtype="float32",
        device="V100 (analytic)",
        batch_sizes=(PAPER_PROFILE_BATCH[name],),
        optimizer_state_factor=_OPTIMIZER_STATE_FACTOR[name],
    )


def _data_dir() -> Path:
    return Path(str(resources.files("dapple"))) / "data"


def load_paper_profile(name: str) -> ModelProfile:
    """Load the shipped ``dapple/data/paper-<name>.json`` profile.

    Args:
        name: one of :data:`PAPER_MODELS`.

    Raises:
        ValidationError: unknown model name, or a missing or malformed file.
    """
    _check_name(name)
    return ModelProfile.load(_data_dir() / f"paper-{name}.json")


def paper_name(spec: str | Path) -> str | None:
    """The model name of a ``paper:NAME`` profile spec (``None`` for a file path).

    Raises:
        ValidationError: ``NAME`` is not one of :data:`PAPER_MODELS`.
    """
    if not isinstance(spec, str) or not spec.startswith(PAPER_PREFIX):
        return None
    name = spec.removeprefix(PAPER_PREFIX)
    if name not in _BUILDERS:
        known = ", ".join(PAPER_PREFIX + n for n in PAPER_MODELS)
        raise ValidationError(f"unknown paper profile {spec!r}; known: {known}")
    return name


def load_profile(spec: str | Path) -> ModelProfile:
    """A profile from a JSON file, or a shipped paper profile for ``paper:NAME``.

    Every command and API function that takes a profile resolves it here.

    Args:
        spec: a profile JSON path, or ``paper:`` followed by one of :data:`PAPER_MODELS`.

    Raises:
        ValidationError: unknown paper model, or a missing or malformed file.
    """
    name = paper_name(spec)
    return ModelProfile.load(spec) if name is None else load_paper_profile(name)


def write_paper_profiles(directory: str | Path | None = None) -> list[Path]:
    """Write every paper profile as ``paper-<name>.json`` (default: the package data folder).

    Args:
        directory: target folder; created if missing.
    """
    out_dir = Path(directory) if directory is not None else _data_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PAPER_MODELS:
        path = out_dir / f"paper-{name}.json"
        path.write_text(json.dumps(paper_profile(name).to_dict(), indent=2) + "\n")
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    """``python -m dapple.profiler.paper_models [--write [DIR]]``: summary or regeneration."""
    parser = argparse.ArgumentParser(prog="python -m dapple.profiler.paper_models")
    parser.add_argument("--write", nargs="?", const="", default=None, metavar="DIR")
    args = parser.parse_args(argv)
    if args.write is not None:
        for p in write_paper_profiles(args.write or None):
            print(f"wrote {p}")
        return 0
    for name in PAPER_MODELS:
        prof = paper_profile(name)
        params_m = prof.parameter_bytes / 4 / 1e6
        step_ms = sum(ly.forward.at(1) + ly.backward.at(1) for ly in prof.layers)
        print(
            f"{name:12s} layers={prof.num_layers:3d} params={params_m:8.1f}M "
            f"(table 1: {PAPER_PARAMS_M[name]:.1f}M) fwd+bwd/sample={step_ms:8.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

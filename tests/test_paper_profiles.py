"""Analytic paper profiles: parameter counts against table 1, shipped JSON, time model."""

from __future__ import annotations

import json
import sys

import pytest

from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.profiler import paper_models as pm
from dapple.profiler._paper_arch import resnet50_layers, vgg19_layers


@pytest.mark.parametrize("name", pm.PAPER_MODELS)
def test_param_count_matches_table_1(name: str) -> None:
    params = pm.paper_profile(name).parameter_bytes / 4
    table = pm.PAPER_PARAMS_M[name]
    # table 1 mixes decimal millions and units of 2^20 (see the module notes): accept either
    rel = min(abs(params / 1e6 - table), abs(params / 2**20 - table)) / table
    assert rel < 0.05, (name, params, table)


def test_torchvision_reference_counts() -> None:
    # well-known exact counts of torchvision's resnet50 and vgg19
    assert sum(x.parameter_count for x in resnet50_layers()) == 25_557_032
    assert sum(x.parameter_count for x in vgg19_layers()) == 143_667_240


@pytest.mark.parametrize("name", pm.PAPER_MODELS)
def test_shipped_json_equals_generator(name: str) -> None:
    assert pm.load_paper_profile(name).to_dict() == pm.paper_profile(name).to_dict()


def test_layer_counts_follow_paper_granularity() -> None:
    counts = {n: pm.paper_profile(n).num_layers for n in pm.PAPER_MODELS}
    # blocks/LSTM layers/cells + embedding (stem) + head
    assert counts == {
        "resnet50": 18,
        "vgg19": 19,
        "gnmt16": 18,
        "bert48": 50,
        "xlnet36": 38,
        "amoebanet36": 42,
    }


def test_activation_sizes_at_paper_cuts() -> None:
    # table 3 comments: BERT 2.2 MB/sample (512 x 1024 fp32), GNMT 0.4 MB/sample at the 9:7 cut
    bert = pm.paper_profile("bert48")
    assert bert.layers[24].output_bytes_per_sample == 512 * 1024 * 4
    gnmt = pm.paper_profile("gnmt16")
    cut = gnmt.layers[1 + 8 + 1 - 1 + 1]  # after embeddings, 8 encoder layers, decoder0, decoder1
    assert cut.name == "decoder1"
    assert cut.output_bytes_per_sample == 2 * 50 * 1024 * 4


def test_time_model() -> None:
    prof = pm.paper_profile("bert48")
    blk = prof.layers[1]
    assert blk.forward.fixed_ms == pm.FORWARD_OVERHEAD_MS
    assert blk.backward.per_sample_ms == pytest.approx(
        pm.BACKWARD_FACTOR * blk.forward.per_sample_ms
    )
    # a BERT-large-width block at seq 512 is ~25.8 GFLOP forward; at 55% of 15.7 TFLOP/s ~3 ms
    flops = 24 * 512 * 1024**2 + 4 * 512**2 * 1024
    assert blk.forward.per_sample_ms > flops / (pm.UTILISATION["bert48"] * 15.7e12) * 1e3
    assert blk.forward.per_sample_ms < 2 * flops / (pm.UTILISATION["bert48"] * 15.7e12) * 1e3
    for name in pm.PAPER_MODELS:
        p = pm.paper_profile(name)
        assert all(
            ly.forward.per_sample_ms > 0 and ly.kept_activation_bytes_per_sample > 0
            for ly in p.layers
        )
        assert p.device == "V100 (analytic)"


def test_global_batches_and_unknown_name() -> None:
    assert set(pm.PAPER_GLOBAL_BATCH) == set(pm.PAPER_MODELS)
    assert pm.PAPER_GLOBAL_BATCH["bert48"] == 64
    with pytest.raises(ValidationError, match="resnet50"):
        pm.paper_profile("resnet51")
    with pytest.raises(ValidationError, match="known"):
        pm.load_paper_profile("nope")


def test_write_and_reload(tmp_path) -> None:  # type: ignore[no-untyped-def]
    paths = pm.write_paper_profiles(tmp_path)
    assert len(paths) == 6
    prof = ModelProfile.load(tmp_path / "paper-gnmt16.json")
    assert prof.to_dict() == json.loads((tmp_path / "paper-gnmt16.json").read_text())


def test_paper_models_is_pure() -> None:
    import subprocess

    code = "import sys, dapple.profiler.paper_models; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

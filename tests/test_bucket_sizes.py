"""The profile's parameters one by one (``LayerProfile.parameter_sizes``) and the gradient
buckets the cost model cuts from them (issue #41): the same buckets as the runtime's
``FlatShards`` on a stage whose blocks are larger than
:data:`~dapple.core.buckets.BUCKET_BYTES`, from a measured and from an analytic profile."""

from __future__ import annotations

import dataclasses

import pytest

from dapple.core.buckets import BUCKET_BYTES
from dapple.core.layer_profile import AffineTime, LayerProfile
from dapple.core.parallelism import Parallelism
from dapple.core.plan import straight_plan
from dapple.core.profile import ModelProfile
from dapple.cost.memory import zero2_bucket_bytes, zero2_in_flight_bytes
from dapple.errors import ValidationError
from dapple.profiler.analytic import analytic_profile
from dapple.profiler.analytic_presets import PRESETS, resolve_spec

Z2 = Parallelism(replicas=2, zero_stage=2)
T1 = AffineTime(fixed_ms=0.0, per_sample_ms=1.0)
MIB = 2**20
ZOO = {"layers": 2, "hidden": 768, "heads": 12, "seq": 16, "vocab": 256}
"""The zoo transformer with blocks of 7.1M parameters (28.4 MB, above the 25 MiB cap)."""


def _layer(params: int, sizes: tuple[int, ...] | None = None, tied: int = 0) -> LayerProfile:
    return LayerProfile(name="l", forward=T1, backward=T1, output_bytes_per_sample=1.0,
                        parameter_bytes=params, kept_activation_bytes_per_sample=1.0,
                        tied_parameter_bytes=tied, tied_layers=(1,) if tied else (),
                        parameter_sizes=sizes)  # fmt: skip


def test_the_cost_model_cuts_blocks_above_the_cap_as_flat_shards_does() -> None:
    """The runtime's buckets of the whole zoo transformer on 2 replicas (``FlatShards``,
    ZeRO-2) against :func:`zero2_bucket_bytes` of its measured profile and of its analytic
    one: the same bytes in the same order. Cut by layers, each block would be one bucket."""
    from dapple import api
    from dapple.profiler.measure import profile_workload
    from dapple.runtime.parallel.zero import FlatShards, flat_parameters

    wl = api.load("transformer", **ZOO)
    n = wl.num_layers
    plan = straight_plan(n, [0], global_batch_size=4, num_micro_batches=2, replicas=[2])
    module = wl.build_stage(0, n, 0)
    shards = FlatShards(plan, 0, 0, module, flat_parameters(plan, wl, 0, module), None, 2)
    runtime = [float(sum(p.numel() * p.element_size() for p in bk.params)) for bk in shards.buckets]
    shards.close()
    measured = profile_workload(wl, [1], warmup=0, repeats=1, num_threads=1)
    analytic = analytic_profile("transformer", "h100", precision="fp32", overrides=ZOO,
                                batch_sizes=(1,))  # fmt: skip
    assert max(x.parameter_bytes for x in measured.layers) > BUCKET_BYTES
    assert runtime == [22_061_056, 25_982_976, 10_288_128]  # 57.6 MB in 3, blocks across two
    (emb, *rest), (table_first, *same) = measured.layers, analytic.layers
    assert [x.parameter_sizes for x in same] == [x.parameter_sizes for x in rest]
    assert emb.parameter_sizes == (4 * 16 * 768, 4 * 256 * 768)  # the zoo's own table first
    assert table_first.parameter_sizes == emb.parameter_sizes[::-1]
    for prof in (measured, analytic):
        assert zero2_bucket_bytes(prof, (0, n), Z2) == runtime
    layers = tuple(dataclasses.replace(x, parameter_sizes=None) for x in measured.layers)
    whole = dataclasses.replace(measured, layers=layers)  # cut by layers: 4 buckets
    assert len(zero2_bucket_bytes(whole, (0, n), Z2)) == 4


def test_llama3_8b_block_under_zero2_holds_two_mlp_matrices_beside_two_staged() -> None:
    """A Llama-3-8B block (analytic, fp32 parameters) cut at its matrices: norms (32 KiB),
    down, up, gate (224 MiB each), output (64), value and key (16 each), query (64); the peak
    is at the gate: 2 x 224 MiB fresh and staged, beside up and down being reduced with their
    1/2 outputs, 1.5 x 448 MiB. As one 832 MiB bucket it was 2 x 832 MiB."""
    prof = analytic_profile("llama3-8b", "h100", precision="bf16", batch_sizes=(1,))
    block = prof.layers[1]
    assert block.name == "block0" and block.parameter_bytes == 4 * 218_112_000
    got = zero2_bucket_bytes(prof, (1, 2), Z2)
    assert got == [
        32 * 1024.0,
        *[224.0 * MIB] * 3,
        *[64.0 * MIB, 16.0 * MIB, 16.0 * MIB, 64.0 * MIB],
    ]
    assert zero2_in_flight_bytes(prof, (1, 2), Z2) == 2 * 224 * MIB + 1.5 * 448 * MIB


@pytest.mark.parametrize(
    "spec", ["llama3-8b", "gpt3-5b", "paper-bert-48", "megatron-gpt2-1.2b", "transformer"]
)
def test_analytic_tensors_add_up_to_each_layers_untied_parameters(spec: str) -> None:
    for fold in (False, True):
        prof = analytic_profile(spec, "h100", precision="bf16", batch_sizes=(1,), fold_ends=fold)
        for x in prof.layers:
            assert x.parameter_sizes is not None and all(s > 0 for s in x.parameter_sizes)
            assert sum(x.parameter_sizes) == x.parameter_bytes - x.tied_parameter_bytes, x.name


def test_a_tied_table_in_one_folded_layer_is_listed_once_and_first() -> None:
    prof = analytic_profile("transformer", "h100", precision="bf16", batch_sizes=(1,),
                            fold_ends=True, overrides={"layers": 1})  # fmt: skip
    spec = dataclasses.replace(resolve_spec("transformer", layers=1), tied_embeddings=True)
    tied = analytic_profile(spec, "h100", precision="bf16", batch_sizes=(1,), fold_ends=True)
    (one,), (both,) = prof.layers, tied.layers
    assert both.tied_parameter_bytes == 0 and both.parameter_sizes is not None
    assert both.parameter_sizes[0] == 4 * spec.vocab * spec.hidden
    assert sum(both.parameter_sizes) == both.parameter_bytes < one.parameter_bytes


def test_mixtures_and_latent_attention_are_not_listed() -> None:
    moe = next(name for name, s in PRESETS.items() if s.moe is not None and s.moe.dense_layers == 0)
    spec = dataclasses.replace(PRESETS[moe], layers=2, seq=64)
    prof = analytic_profile(spec, "h100", precision="bf16", batch_sizes=(1,))
    assert any(x.moe is not None and x.parameter_sizes is None for x in prof.layers)


def test_old_profiles_load_and_bucket_each_layer_as_one_tensor() -> None:
    listed = _layer(1000, (600, 300, 50), tied=40)
    d = listed.to_dict()
    assert d["parameter_sizes"] == [600, 300, 50]
    assert LayerProfile.from_dict(d) == listed
    del d["parameter_sizes"]
    old = LayerProfile.from_dict(d)
    assert old.parameter_sizes is None and old.bucketed_sizes() == (960,)
    assert _layer(0).bucketed_sizes() == ()
    untied = (_layer(950, (600, 300, 50)), _layer(960))
    prof = ModelProfile(model_name="m", layers=untied, batch_sizes=(1,))
    assert zero2_bucket_bytes(prof, (0, 2), Z2, 700) == [960.0, 50.0 + 300.0, 600.0]


def test_sizes_beyond_the_untied_bytes_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"parameter_sizes .* 960, got \(600, 400\)"):
        _layer(1000, (600, 400), tied=40)
    with pytest.raises(ValidationError, match="parameter_sizes"):
        _layer(1000, (-1,))

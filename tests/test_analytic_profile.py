"""Analytic profiles (issue 31): FLOP and byte counts against hand counts, affine times, preset
parameter counts against the published ones, the CLI, and the published-runs data file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from dapple.cli import main
from dapple.core.profile import ModelProfile
from dapple.errors import ValidationError
from dapple.profiler.analytic import (
    analytic_profile,
    block_ops,
    layer_costs,
    layer_time_ms,
    linear_op,
)
from dapple.profiler.analytic_devices import DEVICES, Efficiency, get_device
from dapple.profiler.analytic_models import TransformerSpec
from dapple.profiler.analytic_presets import (
    PRESETS,
    PUBLISHED_PARAMETERS,
    from_hf_config,
    llama_ffn,
    resolve_spec,
)

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _gpt_block(**kw: object) -> TransformerSpec:
    """A GPT block: h = 64, a = 4 (d = 16), f = 4h, s = 32, LayerNorm, biases."""
    base = dict(name="gpt", hidden=64, layers=2, heads=4, ffn=256, vocab=100, seq=32,
                mlp="gelu", norm="layernorm", linear_bias=True, learned_positions=True)  # fmt: skip
    return TransformerSpec(**{**base, **kw})  # type: ignore[arg-type]


# -- hand counts ---------------------------------------------------------------------------


def test_linear_flops_and_bytes_are_the_hand_count() -> None:
    op = linear_op("fc", 64, 32, s=10, e=2)
    assert op.fwd_flops == 2 * 10 * 64 * 32  # one multiply-add per weight per token
    assert op.bwd_flops == 2 * op.fwd_flops  # input gradient + weight gradient
    assert op.fwd_bytes == 10 * (64 + 32) * 2  # input read, output written
    assert op.fwd_bytes_per_call == 64 * 32 * 2  # the weights, once per call
    assert op.bwd_bytes_per_call == 64 * 32 * (2 + 8)  # read, and fp32 gradient accumulated
    assert op.kept_bytes == 10 * 64 * 2  # autograd keeps the input
    assert op.kind == "matmul" and op.weight_gemm


@pytest.mark.parametrize(("causal", "s_kv"), [(True, (32 + 1) / 2), (False, 32)])
def test_flash_attention_flops_count_the_causal_half(causal: bool, s_kv: float) -> None:
    spec = _gpt_block(causal=causal)
    (att,) = [op for op in block_ops(spec, 32, 2, "flash") if op.kind == "attention"]
    # QK^T and PV: 2 GEMMs of 2 * s * s_kv * d FLOPs per head
    assert att.fwd_flops == 2 * 2 * 32 * s_kv * 16 * 4
    assert att.bwd_flops == 2.5 * att.fwd_flops  # flash backward: five GEMMs to two
    assert att.kept_bytes == 32 * 3 * 64 * 2 + 4 * 32 * 4  # Q, K, V and the log-sum-exp


def test_eager_attention_computes_the_full_square_even_when_causal() -> None:
    ops = {op.name: op for op in block_ops(_gpt_block(), 32, 2, "eager")}
    assert ops["scores"].fwd_flops == ops["context"].fwd_flops == 2 * 32 * 32 * 16 * 4
    assert ops["softmax"].kept_bytes == 4 * 32 * 32 * 2  # a s^2 probabilities


def test_gpt_block_flops_are_megatrons_24sh2_plus_4s2h() -> None:
    s, h = 32, 64
    fwd = sum(op.fwd_flops for op in block_ops(_gpt_block(), s, 2, "eager"))
    assert fwd == 24 * s * h * h + 4 * s * s * h  # Narayanan et al. 2021, per layer
    bwd = sum(op.bwd_flops for op in block_ops(_gpt_block(), s, 2, "eager"))
    assert bwd == 2 * fwd


def test_llama_block_flops_are_the_hand_count_with_gqa() -> None:
    spec = TransformerSpec(name="l", hidden=64, layers=1, heads=8, kv_heads=2, ffn=160,
                           vocab=100, seq=32)  # fmt: skip
    s, h, d = 32, 64, 8
    fwd = sum(op.fwd_flops for op in block_ops(spec, s, 2, "flash"))
    proj = 2 * s * (h * (64 + 2 * 16) + 64 * h + 3 * h * 160)  # q, k, v, o; gate, up, down
    attention = 4 * s * (s + 1) / 2 * 8 * d
    assert fwd == proj + attention


def test_gpt_block_keeps_korthikantis_34sh_plus_5as2_bytes() -> None:
    s, h, a = 32, 64, 4
    spec = _gpt_block(dropout=True)
    stats = 2 * 8 * s  # two LayerNorms' fp32 mean and rstd, not in the paper's count
    (none, sel, full) = (
        layer_costs(spec, "fp16", attention="eager", recompute=c)[1].kept_bytes_per_sample
        for c in ("none", "selective", "full")
    )
    assert none == 34 * s * h + 5 * a * s * s + stats  # Korthikanti et al. 2022, eq. 1
    assert sel == 34 * s * h + stats  # selective recompute drops the 5 a s^2 terms
    assert full == 2 * s * h  # the block input only
    flash = layer_costs(spec, "fp16", attention="flash")[1].kept_bytes_per_sample
    assert flash == 34 * s * h + stats + a * s * 4  # + the log-sum-exp


def test_full_checkpointing_reruns_the_forward_in_the_backward() -> None:
    spec = _gpt_block()
    plain, full = (layer_costs(spec, "bf16", recompute=c)[1] for c in ("none", "full"))
    assert full.backward_flops == plain.backward_flops + plain.forward_flops
    dev, eff = get_device("h100"), get_device("h100").efficiency_for("bf16")
    f, b = layer_time_ms(plain, 4, dev, "bf16", eff)
    f2, b2 = layer_time_ms(full, 4, dev, "bf16", eff)
    assert f2 == pytest.approx(f) and b2 == pytest.approx(b + f)


def test_embedding_and_lm_head_counts() -> None:
    spec = _gpt_block()
    emb, *_, head = layer_costs(spec, "bf16")
    assert emb.forward_flops == 0  # a lookup: bytes only
    ops = {op.name: op for op in head.ops}
    assert ops["head"].fwd_flops == 2 * 32 * 64 * 100
    assert ops["cross_entropy"].kept_bytes == 32 * 100 * 4  # fp32 log-probabilities


# -- time ---------------------------------------------------------------------------------


def test_times_are_affine_in_the_batch_size_and_match_the_roofline() -> None:
    prof = analytic_profile("llama3-8b", "h100", precision="bf16", batch_sizes=(1, 2, 4, 8))
    costs = layer_costs(PRESETS["llama3-8b"], "bf16")
    dev = get_device("h100")
    eff = dev.efficiency_for("bf16")
    for layer, cost in zip(prof.layers, costs, strict=True):
        assert layer.forward.fixed_ms >= 0 and layer.forward.per_sample_ms > 0
        for b in (1, 2, 4, 8):
            f, bw = layer_time_ms(cost, b, dev, "bf16", eff)
            assert layer.forward.at(b) == pytest.approx(f, rel=0.02)
            assert layer.backward.at(b) == pytest.approx(bw, rel=0.02)
    # a block at 8,192 tokens per sample is in one roofline regime at every batch size: the
    # affine fit is exact, fixed = kernel gaps and weight reads of one call
    block, cost = prof.layers[1], costs[1]
    for b in (1, 3, 8):
        f, bw = layer_time_ms(cost, b, dev, "bf16", eff)
        assert block.forward.at(b) == pytest.approx(f, rel=1e-9)
        assert block.backward.at(b) == pytest.approx(bw, rel=1e-9)


def test_block_time_is_its_flops_at_the_matmul_efficiency_when_compute_bound() -> None:
    spec = PRESETS["llama3-70b"]
    cost = layer_costs(spec, "bf16")[1]
    dev = get_device("h100")
    eff = Efficiency(matmul=0.5, attention=0.5, memory=0.8)
    f, _ = layer_time_ms(cost, 1, dev, "bf16", eff)
    lower = cost.forward_flops / (0.5 * dev.peak_flops["bf16"]) * 1e3
    assert lower <= f <= 1.15 * lower  # GEMMs dominate; norms and activations add a little


def test_fp8_speeds_up_weight_gemms_only() -> None:
    bf16 = analytic_profile("llama2-7b", "h100", precision="bf16", batch_sizes=(1, 2))
    eff = get_device("h100").efficiency_for("bf16")
    fp8 = analytic_profile("llama2-7b", "h100", precision="fp8", batch_sizes=(1, 2), efficiency=eff)
    ratio = fp8.layers[1].forward.at(2) / bf16.layers[1].forward.at(2)
    assert 0.5 < ratio < 0.75  # GEMMs twice as fast, attention and element-wise unchanged
    assert fp8.precision == "bf16"  # the memory model's precision: bf16 activations


# -- models ---------------------------------------------------------------------------------


def _printed(text: str) -> tuple[float, float]:
    """``"8.03B"`` -> (8.03e9, half a unit of the last printed digit)."""
    unit = {"B": 1e9, "M": 1e6}[text[-1]]
    digits = text[:-1]
    places = len(digits.partition(".")[2])
    return float(digits) * unit, 0.5 * 10**-places * unit


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_preset_parameters_match_the_published_counts(name: str) -> None:
    count = PRESETS[name].parameters()
    published, rounding = _printed(PUBLISHED_PARAMETERS[name])
    assert abs(count - published) <= max(0.01 * published, rounding), (count, published)


def test_llama3_8b_is_8_03b_and_its_ffn_is_14336() -> None:
    assert llama_ffn(4096, 1.3, 1024) == 14336
    assert llama_ffn(16384, 1.2, 4096) == 53248
    assert round(PRESETS["llama3-8b"].parameters() / 1e9, 2) == 8.03


def test_zoo_transformer_parameters_match_torch_layer_by_layer() -> None:
    from dapple.models.zoo import transformer

    kw = dict(layers=2, hidden=32, heads=4, seq=16, vocab=50, ffn=96)
    wl = transformer(**kw)  # type: ignore[arg-type]
    counts = [sum(p.numel() for p in f().parameters()) for f in wl.layer_factories]
    prof = analytic_profile("transformer", "h100", precision="fp32", overrides=kw, batch_sizes=(1,))
    assert [ly.parameter_bytes // 4 for ly in prof.layers] == counts
    assert [ly.name for ly in prof.layers] == wl.layer_names
    assert prof.model_name == wl.name


def test_hf_config_llama_and_gpt2(tmp_path: Path) -> None:
    cfg = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256, "max_position_embeddings": 131072}  # fmt: skip
    spec = from_hf_config(cfg, "llama3.1-8b")
    assert spec.parameters() == PRESETS["llama3.1-8b"].parameters()
    assert spec.seq == 8192  # capped
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve_spec(f"hf:{tmp_path}", seq_len=4096).seq == 4096
    gpt2 = from_hf_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                           "vocab_size": 50257, "n_positions": 1024})  # fmt: skip
    assert round(gpt2.parameters() / 1e6) == 124  # GPT-2 small
    with pytest.raises(ValidationError, match="not supported"):
        from_hf_config({"model_type": "t5"})


def test_bad_inputs_raise_validation_errors() -> None:
    with pytest.raises(ValidationError, match="unknown analytic model"):
        resolve_spec("llama9")
    with pytest.raises(ValidationError, match="no fp8 peak"):
        analytic_profile("llama2-7b", "v100", precision="fp8")
    with pytest.raises(ValidationError, match="recompute"):
        analytic_profile("llama2-7b", "h100", recompute="some")
    with pytest.raises(ValidationError, match="unknown analytic device"):
        get_device("tpu")
    with pytest.raises(ValidationError, match="apply to zoo"):
        resolve_spec("llama2-7b", layers=2)
    with pytest.raises(ValidationError, match="in \\(0, 1\\]"):
        Efficiency(matmul=1.5, attention=0.5, memory=0.5)


def test_paper_bert48_is_the_papers_encoder_and_bert48_the_zoos() -> None:
    paper, zoo = resolve_spec("paper-bert-48"), resolve_spec("bert-48")
    assert not paper.causal and paper.head_outputs == 2 and paper.dropout  # SQuAD fine-tuning
    assert zoo.causal and zoo.lm_head and zoo.name == "bert-48"  # the zoo workload's name


def test_405b_builds_without_memory_and_folds_ends() -> None:
    prof = analytic_profile("llama3.1-405b", "h100", precision="bf16", recompute="full",
                            batch_sizes=(1, 2), fold_ends=True)  # fmt: skip
    assert prof.num_layers == 126
    assert prof.layers[0].name == "embedding+block0" and prof.layers[-1].name == "block125+lm_head"
    assert round(prof.parameter_bytes / 4 / 1e9) == 406
    assert ModelProfile.from_dict(prof.to_dict()) == prof


def test_tied_embeddings_are_tied_layers() -> None:
    prof = analytic_profile("gpt3-5b", "h100", precision="bf16", batch_sizes=(1,))
    first, last = prof.layers[0], prof.layers[-1]
    assert first.tied_layers == (prof.num_layers - 1,) and last.tied_layers == (0,)
    assert first.tied_parameter_bytes == last.tied_parameter_bytes == 4 * 50304 * 4096
    one = analytic_profile(_gpt_block(layers=1, tied_embeddings=True), "h100", batch_sizes=(1,),
                           fold_ends=True)  # fmt: skip
    assert one.num_layers == 1 and one.parameter_bytes // 4 == _gpt_block(
        layers=1, tied_embeddings=True).parameters()  # fmt: skip


# -- CLI --------------------------------------------------------------------------------------


def test_cli_profile_analytic_writes_a_profile(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    rc = main(["profile", "--analytic", "a100", "--precision", "bf16", "-m",
               "llama3-8b", "--batch-sizes", "1,2", "--recompute", "full", "-o", str(out)])  # fmt: skip
    assert rc == 0
    prof = ModelProfile.load(out)
    assert prof.num_layers == 34 and prof.precision == "bf16" and "A100" in prof.device
    assert prof.layers[1].kept_activation_bytes_per_sample == 8192 * 4096 * 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], r"--analytic takes a datasheet: v100, a100, h100, h200$"),
        (["gpu9"], r"--analytic takes a datasheet: v100, a100, h100, h200, got 'gpu9'"),
        (["--device", "h100"], r"--device h100 is a datasheet: write --analytic h100 \(--device"),
        (["h100", "--device", "cpu"], r"--device cpu applies to measured profiles"),
    ],
)
def test_cli_profile_analytic_takes_the_datasheet(
    flags: list[str], message: str, tmp_path: Path
) -> None:
    from dapple.cli import build_parser
    from dapple.cli.profile_cmd import run

    out = tmp_path / "x.json"
    argv = ["profile", "-m", "llama3-8b", "-o", str(out), "--analytic", *flags]
    with pytest.raises(ValidationError, match=message):
        run(build_parser().parse_args(argv))
    assert not out.exists()


def test_every_device_has_an_efficiency_per_precision() -> None:
    for dev in DEVICES.values():
        assert set(dev.efficiency) == set(dev.peak_flops), dev.name


# -- published runs -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def published():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCH))
    import published as mod

    return mod


def test_published_runs_parse_and_name_their_sources(published) -> None:  # type: ignore[no-untyped-def]
    sources, runs = published.load_runs()
    assert len(runs) >= 15 and len({r["source"] for r in runs}) >= 3
    for r in runs:
        src = sources[r["source"]]
        assert r["locator"] and src["tables"], r["id"]
        assert ("repo" in src and "path" in src and len(src["commit"]) == 40) or "where" in src
        assert published.published_samples_per_s(r) is not None or r["published"].get("oom")


def test_published_check_names_the_bad_row(published) -> None:  # type: ignore[no-untyped-def]
    sources, runs = published.load_runs()
    bad = dict(runs[0], source="nowhere", id="broken-row")
    with pytest.raises(ValueError, match="broken-row: no source"):
        published.check_runs(sources, [bad])


def test_published_fit_row_reproduces_its_number(published) -> None:  # type: ignore[no-untyped-def]
    _, runs = published.load_runs()
    by_id = {r["id"]: r for r in runs}
    row = by_id[published.FIT_ROWS[("v100", "fp32")]]
    assert not published.blockers(row)
    pred = published.predict(row)  # the library's fitted constant
    assert pred.samples_per_s == pytest.approx(published.published_samples_per_s(row), rel=0.01)
    assert published.blockers(by_id["torchtitan-h100-8b-fsdp8"]) == []
    assert published.blockers(by_id["torchtitan-h100-8b-cp2"]) == ["context parallelism (CP 2)"]


def test_blocks_shard_over_a_tensor_group_and_the_ends_do_not() -> None:
    prof = analytic_profile("llama3-8b", "h100")
    marks = {x.name: x.tensor_parallel for x in prof.layers}
    assert marks.pop("embedding") is False and marks.pop("lm_head") is False
    assert set(marks.values()) == {True} and len(marks) == 32


@pytest.mark.parametrize(("device", "precision"), [("h100", "bf16"), ("v100", "fp16")])
def test_cli_profile_analytic_defaults_to_the_datasheets_16_bit_format(
    device: str, precision: str, tmp_path: Path
) -> None:
    out = tmp_path / "p.json"
    rc = main(["profile", "--analytic", device, "-m", "llama3-8b",
               "--batch-sizes", "1", "-o", str(out)])  # fmt: skip
    assert rc == 0 and ModelProfile.load(out).precision == precision


def test_cli_profile_analytic_of_a_hf_config_takes_set_seq(tmp_path: Path) -> None:
    """``--set seq=N`` sets a Hugging Face config's length, as for its measured profile."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 8192}))  # fmt: skip
    profiles = {}
    for seq in (1024, 2048):
        out = tmp_path / f"p{seq}.json"
        rc = main(["profile", "--analytic", "h100", "-m", f"hf:{tmp_path / 'cfg'}",
                   "--set", f"seq={seq}", "--batch-sizes", "1", "-o", str(out)])  # fmt: skip
        assert rc == 0
        profiles[seq] = ModelProfile.load(out)
    block = [p.layers[1].kept_activation_bytes_per_sample for p in profiles.values()]
    assert block[1] == 2 * block[0]  # a block's kept activations grow with the length


def test_the_old_spelling_of_recompute_is_refused_with_the_new_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    argv = ["profile", "--analytic", "h100", "-m", "llama3-8b", "-o", str(out)]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--act-checkpoint", "full"])
    assert exit_.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert err == "dapple: error: --act-checkpoint is spelled --recompute now (same meaning)\n"


@pytest.mark.parametrize("sizes", [(1.5,), (True, 2), (), (0, 1), (2**21,)])
def test_analytic_batch_sizes_are_positive_integers_within_the_limit(
    sizes: tuple[object, ...],
) -> None:
    """The API's doors reach ``analytic_profile`` without the CLI's parsing: a float batch
    size (which gave an affine fit through batch 1.5) or a bool is refused as the measured
    profiler refuses it."""
    with pytest.raises(ValidationError, match=r"batch_sizes must be positive|exceeds the analytic"):
        analytic_profile("llama3-8b", "h100", batch_sizes=sizes)  # type: ignore[arg-type]

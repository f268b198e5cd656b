"""Pretrained weights in: Hugging Face directories, shards, state_dict files, ``hf:DIR`` specs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dapple import api
from dapple.cli import main
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.models.split import original_model
from dapple.models.workload import Workload
from hf_dirs import save_llama

tf = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SEQ = 12


def _llama(tmp: Path, name: str = "llama", hidden: int = 32, tied: bool = False) -> Path:
    """A small LLaMA saved as a Hugging Face directory (its own random weights)."""
    return save_llama(tmp / name, hidden=hidden, tied=tied)


def _reference_logits(path: Path, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # type: ignore[no-any-return]


def _logits(wl: Workload, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return wl.build_model(0)((ids, mask))  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _llama(tmp_path_factory.mktemp("weights"))


def test_hf_dir_with_weights_gives_the_logits_of_transformers(llama: Path) -> None:
    wl = api.load(f"hf:{llama}", weights=llama, seq=SEQ)
    assert list(wl.layer_names) == ["prologue", "model.layers.0", "model.layers.1", "epilogue"]
    (ids, mask), _ = wl.make_batch(3, 7)
    ref = _reference_logits(llama, ids, mask)
    torch.testing.assert_close(_logits(wl, ids, mask), ref, rtol=0, atol=1e-6)
    # another plan: the stages of a different cut, each built alone, give the same logits
    other = api.load(f"hf:{llama}", weights=llama, seq=SEQ, split_at=["model.layers.1"])
    first, second = other.build_stage(0, 1, 0), other.build_stage(1, 2, 0)
    with torch.no_grad():
        torch.testing.assert_close(second(first((ids, mask))), ref, rtol=0, atol=1e-6)
    # the original model (verify's reference) carries the same weights
    with torch.no_grad():
        whole = original_model(wl, 0)(ids, mask)
    torch.testing.assert_close(whole, ref, rtol=0, atol=1e-6)


def test_without_weights_hf_dir_is_a_random_init_of_the_config(llama: Path) -> None:
    wl = api.load(f"hf:{llama}", seq=SEQ)
    (ids, mask), _ = wl.make_batch(2, 0)
    assert not torch.allclose(_logits(wl, ids, mask), _reference_logits(llama, ids, mask))


def test_sharded_safetensors_and_tied_weights(tmp_path: Path) -> None:
    path = _llama(tmp_path, tied=True)
    model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    shards = tmp_path / "sharded"
    model.save_pretrained(shards, max_shard_size="20KB")
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once
    wl = api.load(f"hf:{shards}", weights=shards, seq=SEQ)
    (ids, mask), _ = wl.make_batch(2, 1)
    torch.testing.assert_close(
        _logits(wl, ids, mask), _reference_logits(path, ids, mask), rtol=0, atol=1e-6
    )


def test_state_dict_file_and_gpt2(tmp_path: Path) -> None:
    wl = api.load("dapple.models.hf:gpt2", layers=2, hidden=16, heads=2, vocab=32, seq=8)
    model = original_model(wl, 5)  # some weights other than seed 0's
    torch.save(model.state_dict(), tmp_path / "gpt2.pt")
    loaded = api.load(
        "dapple.models.hf:gpt2",
        layers=2,
        hidden=16,
        heads=2,
        vocab=32,
        seq=8,
        weights=tmp_path / "gpt2.pt",
    )
    (ids, mask), _ = wl.make_batch(2, 3)
    with torch.no_grad():
        torch.testing.assert_close(_logits(loaded, ids, mask), model(ids, mask))


def test_bad_weights_fail_before_any_compute(llama: Path, tmp_path: Path) -> None:
    spec = f"hf:{llama}"
    state = tf.AutoModelForCausalLM.from_pretrained(llama, local_files_only=True).state_dict()
    missing = dict(state)
    del missing["model.layers.1.mlp.up_proj.weight"]
    torch.save(missing, tmp_path / "missing.pt")
    with pytest.raises(ValidationError, match=r"lack tensors 'model\.layers\.1\.mlp\.up_proj"):
        api.load(spec, weights=tmp_path / "missing.pt")
    wide = _llama(tmp_path, "wide", hidden=64)
    with pytest.raises(ValidationError, match=r"'model\.embed_tokens\.weight' .* shape \[48, 64\]"):
        api.load(spec, weights=wide)
    ints = {k: v.to(torch.int32) if "norm" in k else v for k, v in state.items()}
    torch.save(ints, tmp_path / "ints.pt")
    with pytest.raises(
        ValidationError, match=r"'model\.layers\.0\.input_layernorm\.weight'.*int32"
    ):
        api.load(spec, weights=tmp_path / "ints.pt")
    with pytest.raises(ValidationError, match="does not exist"):
        api.load(spec, weights=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValidationError, match="no weights in"):
        api.load(spec, weights=tmp_path / "empty")
    with pytest.raises(ValidationError, match=r"holds no config\.json"):
        api.load(f"hf:{tmp_path / 'empty'}")
    with pytest.raises(
        ValidationError,
        match=r"pretrained weights load into a model split from one nn\.Module.*'mlp' is built layer by layer",
    ):
        api.load("mlp", weights=llama)


def test_cli_weights_flag(llama: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["split", "-m", f"hf:{llama}", "--weights", str(llama)]) == 0
    assert "model.layers.1" in capfd.readouterr().out
    assert main(["split", "-m", f"hf:{llama}", "--weights", str(tmp_path / "nowhere")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dapple: error:") and "nowhere" in err[0]


@pytest.mark.slow
def test_verify_llama_with_pretrained_weights_under_uneven_plans(llama: Path) -> None:
    wl = api.load(f"hf:{llama}", weights=llama, seq=SEQ)
    shapes = [([0, 1, 3], [1, 2, 1], 4), ([0, 3], [3, 1], 6), ([0, 2], [2, 2], 4)]
    plans = [
        straight_plan(4, cuts, global_batch_size=gbs, num_micro_batches=2, replicas=reps)
        for cuts, reps, gbs in shapes
    ]
    reports = api.verify_many([(p, wl) for p in plans], steps=2)
    for plan, rep in zip(plans, reports, strict=True):
        assert rep.ok, (plan.replication, [(s.stage, s.max_abs_diff) for s in rep.stages])
        assert [s.replicas for s in rep.stages] == [st.replicas for st in plan.stages]
        assert rep.losses == pytest.approx(rep.reference_losses, rel=1e-5)


def test_a_model_torch_export_cannot_trace_is_one_error_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert main(["split", "-m", "runtime_workloads:untraceable"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dapple: error:"), err
    assert "cannot trace _Branchy with torch.export" in err[0]

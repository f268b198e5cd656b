"""Weights out: checkpoints exported as Hugging Face directories that ``transformers`` loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dapple import api
from dapple.cli import main
from dapple.cli.export_cmd import parse_size
from dapple.core.plan import straight_plan
from dapple.errors import DappleError, ValidationError
from dapple.models.tied import sum_tied_grads_local
from dapple.models.workload import Workload
from dapple.runtime.checkpoint import (
    CheckpointMeta,
    latest_checkpoint,
    load_layer_states,
    save_checkpoint,
    stage_layer_states,
)
from dapple.runtime.export import export_checkpoint
from hf_dirs import save_llama

tf = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SEQ = 12


def _llama_dir(root: Path) -> Path:
    return save_llama(root / "pretrained", seed=7)


def _trained_checkpoint(wl: Workload, root: Path) -> torch.nn.Sequential:
    """One SGD step of the whole chain in this process (tied gradients summed, as the runtime
    does), saved as a layer checkpoint."""
    chain = wl.build_model(0)
    inputs, targets = wl.make_batch(4, 1)
    wl.loss_fn(chain(inputs), targets).backward()
    sum_tied_grads_local(list(chain), wl.tied_parameters)  # tied copies stay equal
    with torch.no_grad():
        for p in chain.parameters():
            p -= 0.5 * p.grad
    meta = CheckpointMeta(model_name=wl.name, num_layers=wl.num_layers, step=1)
    save_checkpoint(root, meta, stage_layer_states(chain, 0))
    return chain


def _hf_logits(path: Path, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # type: ignore[no-any-return]


def test_export_llama_loads_in_transformers_with_the_trained_logits(tmp_path: Path) -> None:
    pre = _llama_dir(tmp_path)
    wl = api.load(f"hf:{pre}", weights=pre, seq=SEQ)
    chain = _trained_checkpoint(wl, tmp_path / "ckpt")
    out = tmp_path / "export"
    result = export_checkpoint(tmp_path / "ckpt", out, wl, max_shard_bytes=40_000)
    assert result.config and result.step == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert set(index["weight_map"]) == set(
        tf.LlamaForCausalLM(tf.AutoConfig.from_pretrained(out)).state_dict()
    )
    (ids, mask), _ = wl.make_batch(3, 5)
    with torch.no_grad():
        trained = chain((ids, mask))
    torch.testing.assert_close(_hf_logits(out, ids, mask), trained, rtol=0, atol=1e-6)
    # and back in, under another cut: the same logits
    again = api.load(f"hf:{out}", weights=out, seq=SEQ, split_at=["model.layers.1"])
    with torch.no_grad():
        torch.testing.assert_close(again.build_model(0)((ids, mask)), trained, rtol=0, atol=1e-6)


def test_export_tied_gpt2_once_and_without_a_model(tmp_path: Path) -> None:
    wl = api.load("dapple.models.hf:gpt2", layers=2, hidden=16, heads=2, vocab=32, seq=8)
    chain = _trained_checkpoint(wl, tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", wl)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    (ids, mask), _ = wl.make_batch(2, 0)
    with torch.no_grad():
        trained = chain((ids, mask))
    torch.testing.assert_close(_hf_logits(tmp_path / "hf", ids, mask), trained)
    # no model: every tensor of every layer by name, loadable with --weights
    raw = export_checkpoint(tmp_path / "ckpt", tmp_path / "raw")
    assert not raw.config and raw.num_tensors > 0
    back = api.load(
        "dapple.models.hf:gpt2",
        layers=2,
        hidden=16,
        heads=2,
        vocab=32,
        seq=8,
        weights=tmp_path / "raw" / "model.safetensors",
    )
    with torch.no_grad():
        torch.testing.assert_close(back.build_model(0)((ids, mask)), trained)


def test_export_refuses_bad_targets_and_checkpoints(tmp_path: Path) -> None:
    wl = api.load("dapple.models.hf:gpt2", layers=1, hidden=8, heads=2, vocab=16, seq=4)
    _trained_checkpoint(wl, tmp_path / "ckpt")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(ValidationError, match="exists and is not an empty directory"):
        export_checkpoint(tmp_path / "ckpt", busy, wl)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    with pytest.raises(DappleError, match=r"no checkpoint under .*: no such directory"):
        export_checkpoint(tmp_path / "nothing", tmp_path / "out")
    other = api.load("dapple.models.hf:gpt2", layers=2, hidden=8, heads=2, vocab=16, seq=4)
    with pytest.raises(DappleError, match="model"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out", other)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers
    assert parse_size("5GB") == 5 * 10**9 and parse_size("200MiB") == 200 * 2**20
    with pytest.raises(ValidationError, match="5GB or 200MiB"):
        parse_size("lots")


@pytest.mark.slow
def test_cli_train_under_a_plan_export_and_reload(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Pretrained weights in, two steps under 1:1 pipeline, export, equal logits."""
    pre = _llama_dir(tmp_path)
    spec = f"hf:{pre}"
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(tmp_path / "plan.json")
    model = ["-m", spec, "--weights", str(pre), "--set", f"seq={SEQ}"]
    ckpt = tmp_path / "ckpt"
    train = ["train", "--plan", str(tmp_path / "plan.json"), *model, "--steps", "2"]
    assert main([*train, "--checkpoint-dir", str(ckpt), "--save-every", "2"]) == 0
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint-dir", str(ckpt), "--out-dir", str(out), *model]) == 0
    assert "exported step 2" in capfd.readouterr().out
    wl = api.load(spec, weights=pre, seq=SEQ)
    ck = latest_checkpoint(ckpt)
    assert ck is not None
    chain = wl.build_model(0)
    states = load_layer_states(ck, range(wl.num_layers))
    for i, layer in enumerate(chain):
        layer.load_state_dict(states[i].tensors)
    (ids, mask), _ = wl.make_batch(2, 9)
    with torch.no_grad():
        trained = chain((ids, mask))
        before = wl.build_model(0)((ids, mask))
    assert not torch.allclose(trained, before)  # training moved the weights
    torch.testing.assert_close(_hf_logits(out, ids, mask), trained, rtol=0, atol=1e-6)

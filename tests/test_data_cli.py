"""``dapple data prepare`` and ``dapple train/verify --data``: the happy paths, and every bad
input rejected with one ``dapple: error:`` line before any compute, nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dapple.cli import main
from dapple.core.plan import straight_plan
from dapple.datasets import TokenFile
from dapple.errors import ValidationError
from dapple.models.zoo import transformer
from dapple.runtime.data import check_data, model_limits

TESTS = Path(__file__).parent
SEQ, G = 8, 4
MODEL = ["--model", "transformer", "--set", "layers=2", "--set", "hidden=16", "--set", "heads=2"]


def tokens(path: Path, n: int, top: int = 256, seed: int = 0) -> Path:
    np.random.default_rng(seed).integers(0, top, n).astype(np.uint16).tofile(path)
    return path


@pytest.fixture
def plan_file(tmp_path: Path) -> Path:
    straight_plan(4, [0, 2], global_batch_size=G, num_micro_batches=2).save(tmp_path / "p.json")
    return tmp_path / "p.json"


def _one_error_line(capsys, *needles: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dapple: error: "), err
    for needle in needles:
        assert needle in err[0], err[0]


# -- dapple data prepare -------------------------------------------------------------------
def test_data_prepare_writes_train_val_and_meta(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.txt").write_text("hello tokens " * 20)
    out = tmp_path / "d" / "train.bin"
    rc = main(["data", "prepare", str(tmp_path / "a.txt"), "--output", str(out),
               "--val-fraction", "0.25"])  # fmt: skip
    assert rc == 0
    assert "vocabulary 256 (uint16)" in capsys.readouterr().out
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["train"]["tokens"] == 195 and meta["val"]["tokens"] == 65
    assert TokenFile(out, SEQ)[0][0].tolist() == list(b"hello to")
    assert (tmp_path / "d" / "val.bin").stat().st_size == 2 * 65


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["missing.txt"], "does not exist"),
        (["a.txt", "--val-fraction", "1.5"], "--val-fraction must be in [0, 1)"),
        (["a.txt", "--tokenizer", "nope"], "tokenizer directory"),
    ],
)
def test_data_prepare_rejects_bad_input(tmp_path: Path, capsys, extra, needle) -> None:
    (tmp_path / "a.txt").write_text("text")
    args = [str(tmp_path / a) if a.endswith(".txt") else a for a in extra]
    assert main(["data", "prepare", *args, "--output", str(tmp_path / "o" / "train.bin")]) == 2
    _one_error_line(capsys, needle)
    assert not (tmp_path / "o").exists()


# -- dapple train: bad data, before any compute ----------------------------------------------
def _hf_dir(tmp_path: Path) -> Path:
    tf = pytest.importorskip("transformers")
    d = tmp_path / "llama"
    tf.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=48, max_position_embeddings=32,
    ).save_pretrained(d)  # fmt: skip
    return d


BAD = {
    "missing": (lambda d: [*MODEL, "--data", str(d / "none.bin"), "--seq-len", "8"],
                "data file", "does not exist"),
    "empty": (lambda d: [*MODEL, "--data", str(d / "empty.bin"), "--seq-len", "8"],
              "empty.bin", "is empty"),
    "short": (lambda d: [*MODEL, "--data", str(d / "short.bin"), "--seq-len", "8"],
              "short.bin", "3 samples are fewer than one global batch of 4"),
    "vocab": (lambda d: [*MODEL, "--set", "vocab=100", "--data", str(d / "ok.bin"),
                         "--seq-len", "8"], "ok.bin", ">= the vocabulary of model"),
    "no-seq-len": (lambda d: [*MODEL, "--data", str(d / "ok.bin")], "", "need --seq-len"),
    "seq-len-alone": (lambda d: [*MODEL, "--seq-len", "8"], "", "give a data file"),
    "seq-disagrees": (lambda d: [*MODEL, "--set", "seq=16", "--data", str(d / "ok.bin"),
                                 "--seq-len", "8"], "", "--set seq=16 disagrees"),
    "eval-short": (lambda d: [*MODEL, "--data", str(d / "ok.bin"), "--eval-data",
                              str(d / "short.bin"), "--seq-len", "8"],
                   "evaluation data", "fewer than one global batch"),
    "positions": (lambda d: ["--model", f"hf:{_hf_dir(d)}", "--data", str(d / "ok.bin"),
                             "--seq-len", "64"], "seq=64", "must be in [2, 32]"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_train_rejects_bad_data_before_any_compute(
    tmp_path: Path, plan_file: Path, capsys, case: str
) -> None:
    (tmp_path / "empty.bin").write_bytes(b"")
    tokens(tmp_path / "short.bin", 3 * SEQ + 1)  # 3 samples < G = 4
    tokens(tmp_path / "ok.bin", 40 * SEQ + 1)  # ids up to 255
    args, where, needle = BAD[case]
    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    rc = main(["train", "--plan", str(plan_file), *args(tmp_path), "--metrics", str(metrics),
               "--checkpoint-dir", str(ck), "--save-every", "1"])  # fmt: skip
    assert rc == 2
    _one_error_line(capsys, where, needle)
    assert not metrics.exists() and not ck.exists()


# -- the checks themselves ----------------------------------------------------------------------
def test_model_limits_find_vocabulary_and_positions() -> None:
    assert model_limits(transformer(layers=1, hidden=8, heads=2, seq=12, vocab=99)) == (99, 12)


def test_check_data_names_positions_shapes_and_token_ids(tmp_path: Path) -> None:
    wl = transformer(layers=1, hidden=8, heads=2, seq=SEQ, vocab=256)
    long = TokenFile(tokens(tmp_path / "a.bin", 200), 16)
    with pytest.raises(ValidationError, match="--seq-len 16 exceeds the 8 positions"):
        check_data(wl, long, G)
    short = TokenFile(tmp_path / "a.bin", 4)
    with pytest.raises(ValidationError, match=r"a sample is \(\[4\] int64, \[4\] int64\) but"):
        check_data(wl, short, G)
    tokens(tmp_path / "b.bin", 200, top=40)
    small_vocab = transformer(layers=1, hidden=8, heads=2, seq=SEQ, vocab=40)
    check_data(small_vocab, TokenFile(tmp_path / "b.bin", SEQ), G)  # ids < 40: fine
    np.append(np.fromfile(tmp_path / "b.bin", np.uint16), np.uint16(40)).tofile(tmp_path / "b.bin")
    with pytest.raises(ValidationError, match=r"holds token id 40 >= the vocabulary .* \(40\)"):
        check_data(small_vocab, TokenFile(tmp_path / "b.bin", SEQ), G)


# -- end to end ---------------------------------------------------------------------------------
def _dapple(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "dapple", *args], capture_output=True, text=True, env=env,
        timeout=180,
    )  # fmt: skip


@pytest.mark.slow
def test_train_and_verify_on_prepared_text(tmp_path: Path, plan_file: Path) -> None:
    from dapple.runtime.verify import reference_run

    (tmp_path / "book.txt").write_text("It was the best of times, it was the worst of times. " * 8)
    assert main(["data", "prepare", str(tmp_path / "book.txt"),
                 "--output", str(tmp_path / "train.bin"), "--val-fraction", "0.2"]) == 0  # fmt: skip
    run = ["--plan", str(plan_file), *MODEL, "--data", str(tmp_path / "train.bin"),
           "--seq-len", str(SEQ), "--seed", "3", "--lr", "0.05", "--timeout-s", "60"]  # fmt: skip
    ck = tmp_path / "ck"
    proc = _dapple(["train", *run, "--steps", "3", "--metrics", str(tmp_path / "m.jsonl"),
                    "--eval-data", str(tmp_path / "val.bin"),
                    "--checkpoint-dir", str(ck), "--save-every", "3"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    losses = [json.loads(x)["loss"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    wl = transformer(layers=2, hidden=16, heads=2, seq=SEQ)
    ref, _, _ = reference_run(
        wl, G, 3, seed=3, lr=0.05, data=TokenFile(tmp_path / "train.bin", SEQ)
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref))
    manifest = json.loads((ck / "step-00000003" / "manifest.json").read_text())
    assert manifest["extra"]["data"]["seed"] == 3
    # resuming with another seed would read another data stream: refused before launch
    proc = _dapple(["train", *[a if a != "3" else "4" for a in run], "--steps", "4",
                    "--checkpoint-dir", str(ck), "--resume"])  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("dapple: error: checkpoint")
    assert "seed 3 (now 4)" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = _dapple(["verify", *run, "--steps", "2"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


# -- Hugging Face causal LMs --------------------------------------------------------------------
def test_hf_causal_lm_takes_token_windows_as_input_ids(tmp_path: Path) -> None:
    from dapple.models.spec import load
    from dapple.runtime.data import CausalLMSamples, fit_data

    wl = load(f"hf:{_hf_dir(tmp_path)}", seq=SEQ)
    assert model_limits(wl) == (48, 32)
    ds = TokenFile(tokens(tmp_path / "t.bin", 20 * SEQ + 1, top=48), SEQ)
    check_data(wl, ds, G)
    fitted = fit_data(wl, ds)
    assert isinstance(fitted, CausalLMSamples) and fit_data(wl, fitted) is fitted
    (ids, mask), targets = fitted[3]
    # all SEQ next tokens are targets (no shift in the loss): the window's x and y as they are
    assert torch.equal(ids, ds[3][0]) and torch.equal(targets, ds[3][1]) and mask.eq(1).all()
    tokens(tmp_path / "big.bin", 20 * SEQ + 1, top=60, seed=1)
    with pytest.raises(ValidationError, match=r"token id 5\d >= the vocabulary .* \(48\)"):
        check_data(wl, TokenFile(tmp_path / "big.bin", SEQ), G)


@pytest.mark.slow
def test_verify_a_hf_causal_lm_on_a_token_file(tmp_path: Path) -> None:
    from dapple import api

    d = _hf_dir(tmp_path)
    tokens(tmp_path / "t.bin", 20 * SEQ + 1, top=48)
    plan = straight_plan(4, [0, 2], global_batch_size=G, num_micro_batches=2)
    report = api.verify(
        plan, f"hf:{d}", 2, data=tmp_path / "t.bin", seq_len=SEQ, device="cpu", timeout_s=60
    )
    assert report.ok and report.max_loss_diff < 1e-5, report

"""``dapple generate`` and ``dapple.api.generate``: a prompt continued by your own model, from
a checkpoint or ``--weights``, in bytes or with a Hugging Face tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from builders import boom
from dapple import api
from dapple.cli import generate_cmd, main
from dapple.core.plan import straight_plan
from dapple.errors import ValidationError
from dapple.models.generate import BYTES, MAX_NEW_TOKENS, chain_logits
from dapple.models.workload import Workload
from dapple.runtime.checkpoint import CheckpointMeta, save_checkpoint, stage_layer_states

SEQ = 16
ZOO = {"layers": 1, "hidden": 16, "heads": 2, "seq": SEQ}
ZOO_ARGS = ["-m", "transformer", *(x for k, v in ZOO.items() for x in ("--set", f"{k}={v}"))]


def _checkpoint(wl: Workload, root: Path, seed: int = 5) -> torch.nn.Sequential:
    """One SGD step of the whole chain (built with ``seed``) in this process, saved as a layer
    checkpoint at step 1."""
    chain = wl.build_model(seed)
    inputs, targets = wl.make_batch(4, 1)
    wl.loss_fn(chain(inputs), targets).backward()
    with torch.no_grad():
        for p in chain.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    meta = CheckpointMeta(model_name=wl.name, num_layers=wl.num_layers, step=1)
    save_checkpoint(root, meta, stage_layer_states(chain, 0))
    return chain


@torch.no_grad()
def _padded_argmax(
    chain: torch.nn.Module, prompt: list[int], n: int, context: int, vocab: int, mask: bool
) -> list[int]:
    """The greedy continuation, step by step: the last ``context`` ids right-padded with 0 to
    ``context`` (mask 0 there), the argmax over the first ``vocab`` logits at the last id."""
    chain.eval()
    ids = list(prompt)
    for _ in range(n):
        window = ids[-context:]
        x = torch.zeros(1, context, dtype=torch.long)
        x[0, : len(window)] = torch.tensor(window)
        m = (torch.arange(context) < len(window)).long().unsqueeze(0)
        logits = chain((x, m) if mask else x)[0, len(window) - 1, :vocab]
        ids.append(int(logits.argmax()))
    return ids


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def test_bytes_from_a_checkpoint_cli_and_api_agree_with_the_greedy_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = api.load("transformer", **ZOO)
    chain = _checkpoint(wl, tmp_path / "ckpt")
    prompt = "def __init__(self, x"  # 20 bytes: longer than the 16 positions
    argv = ["generate", "--checkpoint-dir", str(tmp_path / "ckpt"), *ZOO_ARGS]
    assert main([*argv, "--prompt", prompt, "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    r = api.generate("transformer", prompt, 12, checkpoint=tmp_path / "ckpt", overrides=ZOO)
    assert out == r.text + "\n" and r.text.startswith(prompt)
    assert (r.prompt_tokens, r.new_tokens, r.tokenizer) == (20, 12, "bytes")
    assert list(r.ids) == _padded_argmax(chain, list(prompt.encode()), 12, SEQ, 256, mask=False)
    assert r.text == BYTES.decode(r.ids)
    # one step-NNNNNNNN directory works as the root does; the weights are the checkpoint's
    step = api.generate(wl, prompt, 12, checkpoint=tmp_path / "ckpt" / "step-00000001")
    assert step == r
    assert api.generate(wl, prompt, 12).ids != r.ids  # the random initial weights differ


def test_padding_keeps_the_logits_of_a_causal_model(tmp_path: Path) -> None:
    wl = api.load("transformer", **ZOO)
    chain = wl.build_model(3).eval()
    next_logits, context = chain_logits(wl, chain)
    window = torch.tensor([5, 7, 200, 1, 9])
    assert context == SEQ
    with torch.no_grad():
        torch.testing.assert_close(next_logits(window), chain(window.unsqueeze(0))[0, -1])


def test_sampling_is_reproducible_from_its_seed(tmp_path: Path) -> None:
    wl = api.load("transformer", **ZOO)
    _checkpoint(wl, tmp_path / "ckpt")
    draws = [
        api.generate(wl, "hi", 24, checkpoint=tmp_path / "ckpt", temperature=2.0, seed=s)
        for s in (0, 0, 1)
    ]
    assert draws[0] == draws[1] and draws[0].ids != draws[2].ids
    assert all(d.new_tokens == 24 and d.text.startswith("hi") for d in draws)
    greedy = api.generate(wl, "hi", 24, checkpoint=tmp_path / "ckpt")
    assert draws[0].ids != greedy.ids


def test_hf_model_with_its_own_tokenizer_weights_and_a_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from hf_dirs import save_llama
    from hf_tokenizers import save_tokenizer

    pre = save_tokenizer(save_llama(tmp_path / "pretrained", seed=7))
    spec, seq = f"hf:{pre}", 12
    model = ["-m", spec, "--set", f"seq={seq}"]
    # --weights, and the tokenizer of the model's own directory
    argv = ["generate", "--weights", str(pre), *model, "--prompt", "hello cat"]
    assert main([*argv, "--max-new-tokens", "7"]) == 0
    out = capsys.readouterr().out
    r = api.generate(spec, "hello cat", 7, overrides={"weights": str(pre), "seq": seq})
    assert out == r.text + "\n" and r.text.startswith("hello cat")
    assert r.new_tokens == 7 and r.tokenizer == str(pre)
    assert max(r.ids) < 36  # the tokenizer's ids only, below the model's vocabulary of 48
    # a checkpoint and --tokenizer elsewhere: (ids, mask) padded to the traced length
    bare = save_llama(tmp_path / "bare", seed=7)
    tok = save_tokenizer(tmp_path / "tok")
    wl = api.load(f"hf:{bare}", seq=seq)
    chain = _checkpoint(wl, tmp_path / "ckpt")
    prompt = "the cat sat on the mat a world for the hello"  # more tokens than the context
    got = api.generate(wl, prompt, 6, checkpoint=tmp_path / "ckpt", tokenizer=tok)
    assert got.prompt_tokens > seq and got.new_tokens == 6 and got.text.startswith(prompt)
    start = list(got.ids[: got.prompt_tokens])
    assert list(got.ids) == _padded_argmax(chain, start, 6, seq, 36, mask=True)


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wl = api.load("transformer", **ZOO)
    _checkpoint(wl, tmp_path / "ckpt")
    ok = ["generate", "--checkpoint-dir", str(tmp_path / "ckpt"), *ZOO_ARGS]
    cases = {
        "no such directory": ["generate", "--checkpoint-dir", str(tmp_path / "no"),
                                         *ZOO_ARGS, "--prompt", "x"],
        "give the weights to generate with": ["generate", *ZOO_ARGS, "--prompt", "x"],
        "the prompt is empty": [*ok, "--prompt", ""],
        "--max-new-tokens must be an integer from 1 to 65536, got -1": [
            *ok, "--prompt", "x", "--max-new-tokens", "-1"],
        "temperature must be finite and >= 0": [*ok, "--prompt", "x", "--temperature", "-1"],
        "tokenizer directory": [*ok, "--prompt", "x", "--tokenizer", str(tmp_path / "none")],
    }  # fmt: skip
    for message, argv in cases.items():
        assert main(argv) == 2, message
        line = _err_line(capsys)
        assert line.startswith("dapple: error: ") and message in line, line
    both = [*ok, "--weights", str(tmp_path), "--prompt", "x"]
    assert main(both) == 2 and "give the weights" in _err_line(capsys)


def test_a_vocabulary_mismatch_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wide = api.load("transformer", **ZOO, vocab=300)
    _checkpoint(wide, tmp_path / "ckpt")
    argv = ["generate", "--checkpoint-dir", str(tmp_path / "ckpt"), *ZOO_ARGS, "--set", "vocab=300"]
    assert main([*argv, "--prompt", "x"]) == 2
    assert _err_line(capsys) == (
        "dapple: error: the model's vocabulary is 300 tokens, not the 256 bytes: give the "
        "tokenizer its data was prepared with (--tokenizer DIR)"
    )
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from hf_dirs import save_llama
    from hf_tokenizers import save_tokenizer

    pre = save_llama(tmp_path / "pretrained")  # vocabulary 48, no tokenizer: bytes
    over = {"weights": str(pre), "seq": 8}
    with pytest.raises(ValidationError, match="vocabulary is 48 tokens, not the 256 bytes"):
        api.generate(f"hf:{pre}", "hello", 3, overrides=over)
    big = save_tokenizer(tmp_path / "big", extra_tokens=20)
    with pytest.raises(ValidationError, match=r"has 56 tokens but the model's vocabulary is 48"):
        api.generate(f"hf:{pre}", "hello", 3, overrides=over, tokenizer=big)


@pytest.mark.slow
def test_prepare_train_one_process_and_generate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole flow on the command line: bytes prepared, a 1-process run, its checkpoint."""
    text = tmp_path / "corpus.txt"
    text.write_text("def generate(model, prompt):\n    return model(prompt)\n" * 200)
    data = tmp_path / "data" / "train.bin"
    assert main(["data", "prepare", str(text), "-o", str(data)]) == 0
    straight_plan(3, [0], global_batch_size=2, num_micro_batches=1).save(tmp_path / "plan.json")
    model = ["-m", "transformer", "--set", "layers=1", "--set", "hidden=16", "--set", "heads=2"]
    train = ["train", "--plan", str(tmp_path / "plan.json"), *model, "--data", str(data)]
    ckpt = tmp_path / "ckpt"
    train += ["--seq-len", str(SEQ), "--steps", "2", "--checkpoint-dir", str(ckpt)]
    assert main([*train, "--save-every", "2", "--device", "cpu"]) == 0
    capsys.readouterr()
    argv = ["generate", "--checkpoint-dir", str(ckpt), *model, "--set", f"seq={SEQ}"]
    assert main([*argv, "--prompt", "def ", "--max-new-tokens", "10"]) == 0
    out = capsys.readouterr().out
    overrides = {"layers": 1, "hidden": 16, "heads": 2, "seq": SEQ}
    r = api.generate("transformer", "def ", 10, checkpoint=ckpt, overrides=overrides)
    assert out == r.text + "\n" and r.text.startswith("def ") and r.new_tokens == 10


@pytest.mark.parametrize("count", ["0", "-1", str(MAX_NEW_TOKENS + 1), "10000000000000"])
def test_max_new_tokens_is_bounded_before_any_compute(
    count: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = api.load("transformer", **ZOO)
    _checkpoint(wl, tmp_path / "ckpt")
    monkeypatch.setattr(Workload, "build_model", boom)  # refused before the model is built
    argv = ["generate", "--checkpoint-dir", str(tmp_path / "ckpt"), *ZOO_ARGS, "--prompt", "x"]
    assert main([*argv, "--max-new-tokens", count]) == 2
    assert _err_line(capsys) == (
        f"dapple: error: --max-new-tokens must be an integer from 1 to {MAX_NEW_TOKENS}, got "
        f"{count} (each new token is one forward pass over the model's context; the window "
        "slides, so the model's positions do not limit the count)"
    )


def test_the_help_states_the_bound(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert f"tokens to add, 1 to {MAX_NEW_TOKENS} " in " ".join(capsys.readouterr().out.split())


def test_progress_after_each_token(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    r = api.generate("transformer", "hi", 5, overrides=ZOO, progress=lambda *a: calls.append(a))
    assert r.new_tokens == 5 and calls == [(i, 5) for i in range(1, 6)]


def test_a_long_generation_shows_progress_on_stderr_a_short_one_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = api.load("transformer", **ZOO)
    _checkpoint(wl, tmp_path / "ckpt")
    argv = ["generate", "--checkpoint-dir", str(tmp_path / "ckpt"), *ZOO_ARGS, "--prompt", "hi"]
    assert main([*argv, "--max-new-tokens", "8"]) == 0  # under PROGRESS_MIN_TOKENS: none
    short = capsys.readouterr()
    assert "generate:" not in short.err and short.err.count("\n") == 1  # the step loaded
    monkeypatch.setattr(generate_cmd, "PROGRESS_MIN_TOKENS", 8)  # "long", shown at once
    monkeypatch.setattr(generate_cmd, "PROGRESS_DELAY_S", 0.0)
    assert main([*argv, "--max-new-tokens", "8"]) == 0
    long = capsys.readouterr()
    assert long.out == short.out  # stdout holds the text only
    lines = long.err.splitlines()
    assert lines[0].startswith("generate: 0/8 ") and "generate: done 8/8 in " in lines[-2]
    assert lines[-1].startswith("generated from the checkpoint of step 1 ")

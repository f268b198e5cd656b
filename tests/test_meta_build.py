"""Models built on the meta device: per-owner initialisation and memory that scales with the stage."""

from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from dapple.errors import ValidationError
from dapple.models.materialize import build_meta, init_parameters, is_meta_built, materialize
from dapple.models.split import original_model, workload_from_module


class Gated(nn.Module):
    """Standard layers beside a parameter made in ``__init__`` (no ``reset_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.gates = nn.Parameter(torch.randn(3))
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for gate, block in zip(self.gates, self.blocks, strict=True):
            x = x + gate * torch.tanh(block(x))
        return self.head(x)


def _batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 11, (n, 5), generator=torch.Generator().manual_seed(seed))
    return ids, ids


def _loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, 11), targets.reshape(-1))


def test_build_meta_keeps_only_unrecoverable_parameters_real() -> None:
    model = build_meta(Gated, seed=3)
    assert is_meta_built(model)
    real = {n for n, p in model.named_parameters() if not p.is_meta}
    assert real == {"gates"}  # Gated has no reset_parameters: its constructor value is kept
    torch.testing.assert_close(model.gates, build_meta(Gated, seed=3).gates)
    assert not torch.equal(model.gates, build_meta(Gated, seed=4).gates)


def test_a_parameter_does_not_depend_on_which_others_are_made() -> None:
    model = build_meta(Gated, seed=1)
    whole = init_parameters(model, [n for n, _ in model.named_parameters()], seed=1)
    alone = init_parameters(model, ["blocks.2.weight"], seed=1)
    torch.testing.assert_close(alone["blocks.2.weight"], whole["blocks.2.weight"])
    tied = init_parameters(model, ["head.weight"], seed=1)  # an alias: the owner is emb
    torch.testing.assert_close(tied["head.weight"], whole["emb.weight"])
    other = init_parameters(model, ["blocks.2.weight"], seed=2)
    assert not torch.equal(other["blocks.2.weight"], alone["blocks.2.weight"])


def test_materialize_keeps_ties_and_the_modules_own_init() -> None:
    model = materialize(build_meta(Gated, seed=0), seed=0)
    assert not is_meta_built(model)
    assert model.head.weight is model.emb.weight
    bound = 1 / 6**0.5  # nn.Linear.reset_parameters: U(-1/sqrt(in), 1/sqrt(in))
    assert float(model.blocks[0].weight.detach().abs().max()) <= bound
    assert float(model.emb.weight.detach().std()) > 0.5  # nn.Embedding: N(0, 1)


def test_pieces_are_made_without_the_whole_model_and_equal_it() -> None:
    w = workload_from_module(Gated, _batch, _loss)
    chain = w.build_model(4)
    ref = original_model(w, 4)
    for piece in chain:
        for name, p in piece.named_parameters():
            torch.testing.assert_close(p, ref.get_parameter(name))
    ids, _ = _batch(2, 9)
    torch.testing.assert_close(chain(ids), ref(ids))


def test_owner_without_an_init_method_is_a_clear_error() -> None:
    hf = pytest.importorskip("transformers.pytorch_utils")

    class HFOutside(nn.Module):  # a Hugging Face layer outside any PreTrainedModel
        def __init__(self) -> None:
            super().__init__()
            self.proj = hf.Conv1D(4, 3)

    with pytest.raises(ValidationError, match=r"'proj' \(Conv1D\).*reset_parameters"):
        init_parameters(build_meta(HFOutside, seed=0), ["proj.weight"], seed=0)


class FixedDevice(nn.Module):
    """A forward that makes a tensor on the CPU (traced with fake CPU tensors, no weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) + torch.ones(4, device="cpu")
        return x


def test_a_model_that_makes_cpu_tensors_traces_without_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 4, generator=torch.Generator().manual_seed(seed)), torch.zeros(n, 4)

    with caplog.at_level(logging.WARNING, logger="dapple.models.split_pieces"):
        w = workload_from_module(FixedDevice, batch, lambda o, t: (o - t).square().mean())
    assert "traced with real weights" not in caplog.text
    x, _ = batch(3, 0)
    torch.testing.assert_close(w.build_model(2)(x), original_model(w, 2)(x))


_MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys
    import torch
    from dapple.models.hf import hf_gpt2
    hf_gpt2(layers=1, hidden=8, heads=1, vocab=8, seq=4)  # imports and export machinery warm

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    torch.set_num_threads(1)
    before = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    w = hf_gpt2(layers=8, hidden=1024, heads=16, vocab=256, seq=16)  # traced here
    if sys.argv[1] == "stage":  # 2 of 8 blocks: a quarter of the model
        held = w.build_stage(1, 3, seed=0)
    elif sys.argv[1] == "profile":  # every layer, one at a time
        from dapple.profiler.measure import profile_workload
        prof = profile_workload(w, [1, 2], warmup=0, repeats=1)
        held = torch.nn.Linear(1, 1)
    else:
        from dapple.models.split import original_model
        held = original_model(w, 0)
    held_bytes = sum(p.numel() * p.element_size() for p in held.parameters())
    if sys.argv[1] == "profile":
        held_bytes = sum(layer.parameter_bytes for layer in prof.layers)
    print(json.dumps({"peak": status("VmHWM:") - before, "held": held_bytes}))
    """
)


@pytest.mark.slow
def test_no_process_holds_the_whole_model_to_build_a_stage() -> None:
    """Resident peak of loading a ~400 MB GPT-2 (tracing it) and building a quarter of it or
    profiling it, against building it whole."""

    def probe(what: str) -> dict[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_PROBE, what],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    whole = probe("whole")
    stage = probe("stage")
    profiled = probe("profile")
    model_bytes = whole["held"]
    assert model_bytes > 350e6
    assert whole["peak"] > 0.8 * model_bytes  # the probe sees a whole model being built
    assert stage["held"] < 0.3 * model_bytes
    assert stage["peak"] < 0.5 * model_bytes, (stage, model_bytes)
    assert profiled["held"] >= model_bytes  # every parameter (tied copies once per piece)
    assert profiled["peak"] < 0.5 * model_bytes, (profiled, model_bytes)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bloom", "opt"])
def test_layer_tensors_of_a_traced_model_are_the_built_layers(
    family: str, tmp_path: pathlib.Path
) -> None:
    """The fingerprint reads a traced model's pieces as traced (no tensor is made): the same
    names, shapes and dtypes as each layer built for real."""
    pytest.importorskip("transformers")
    from dapple.models.fingerprint import layer_tensors
    from dapple.models.hf import hf_causal_lm
    from hf_families import save_family

    w = hf_causal_lm(save_family(family, tmp_path), seq=8)
    for i in range(w.num_layers):
        built = w.build_layer(i, seed=0).state_dict()
        assert layer_tensors(w, i) == {
            k: (list(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in built.items()
        }

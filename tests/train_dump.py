"""Dump the parameters a few plans train to, as sha256 per layer tensor, in JSON.

A behaviour check for refactors of the runtime, schedules and planner, not a pytest test: dump
before a change, dump after, and compare - every trained tensor must be equal, bit for bit.
It complements ``tests/cost_dump.py`` (every number of the cost model and the simulator).

    python tests/train_dump.py --out /tmp/train_before.json
    python tests/train_dump.py --out /tmp/train_after.json
    python tests/train_dump.py --compare /tmp/train_before.json /tmp/train_after.json

Each case trains 2 steps of AdamW on 2 to 4 gloo processes (the zoo transformer under the
schedules GPipe, DAPPLE, interleaved 1F1B and ZB-H1 and with re-computation; the MLP under
ZeRO-1 and an uneven 1:2 plan with ZeRO-2; the zoo transformer under tensor parallelism,
ZeRO-3 (also re-gathering per micro-batch) and TP with ZeRO-2; with ``transformers`` installed,
a Hugging Face GPT-2 with dropout on, 1:2, and Mixtral with expert parallelism), saves a
checkpoint and hashes every layer's tensors and optimizer state from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from dapple import api
from dapple.core.plan import Plan, interleave, straight_plan
from dapple.runtime.checkpoint import latest_checkpoint, load_layer_states

_GPT = {"layers": 2, "hidden": 32, "heads": 2, "seq": 16}  # 4 chain layers


def _zero(plan: Plan, stage: int, recompute: bool = False) -> Plan:
    """``plan`` with ZeRO ``stage`` on its replicated stages (and re-computation if asked)."""
    stages = tuple(
        dataclasses.replace(
            s, zero_stage=stage if s.replicas > 1 else 0, recompute="full" if recompute else "none"
        )
        for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages)


def _two(n: int, m: int, schedule: str = "dapple", replicas: list[int] | None = None) -> Plan:
    p = straight_plan(n, [0, 2], global_batch_size=8, num_micro_batches=m, replicas=replicas)
    return dataclasses.replace(p, schedule=schedule)


Case = tuple[str, dict[str, Any], Callable[[], Plan]]


def _cases(root: Path) -> dict[str, Case]:
    cases: dict[str, Case] = {
        "transformer-gpipe": ("transformer", _GPT, lambda: _two(4, 4, "gpipe")),
        "transformer-dapple": ("transformer", _GPT, lambda: _two(4, 4)),
        "transformer-zbh1": ("transformer", _GPT, lambda: _two(4, 4, "zbh1")),
        "transformer-interleaved": ("transformer", _GPT, lambda: interleave(_two(4, 4), 2)),
        "transformer-recompute": ("transformer", _GPT, lambda: _zero(_two(4, 2), 0, True)),
        "mlp-dp-zero1": ("mlp", {}, lambda: _zero(
            straight_plan(5, [0], global_batch_size=8, num_micro_batches=2, replicas=[2]), 1)),
        "mlp-uneven-zero2": ("mlp", {}, lambda: _zero(_two(5, 2, replicas=[1, 2]), 2)),
    }  # fmt: skip
    cases.update(_parallel_cases())
    try:
        from hf_families import save_family  # type: ignore[import-not-found]

        gpt2 = save_family("gpt2", root / "gpt2")  # dropout on; 6 chain layers
    except ImportError:  # transformers is an optional extra
        return cases
    cases["hf-gpt2-dropout-uneven"] = (f"hf:{gpt2}", {}, lambda: _two(6, 2, replicas=[1, 2]))
    return cases


def _parallel_cases() -> dict[str, Case]:
    """The zoo transformer (with its TP plan, ``test_tp_runtime:zoo``) under tensor parallelism,
    ZeRO-3 and ZeRO-3 re-gathering per micro-batch, and TP with ZeRO-2; with ``transformers``,
    Mixtral on 1:2:1 with its middle stage's experts over 2 replicas (``expert_width`` 2)."""
    import test_tp_runtime as tp

    here = Path(__file__).resolve().parent
    zoo = f"{here / 'test_tp_runtime.py'}:zoo"
    cases: dict[str, Case] = {
        "zoo-tp2-then-zero3": (zoo, {}, lambda: tp.tp2_then_zero3(4)),
        "zoo-tp2-fsdp2": (zoo, {}, lambda: tp.tp2_fsdp2(4)),
        "zoo-zero3-regather": (zoo, {}, lambda: tp.one_then_zero3_regather(4)),
        "zoo-dp2-tp2-zero2": (zoo, {}, lambda: _zero(tp.dp2_tp2(4), 2)),
    }
    try:
        import transformers  # noqa: F401
    except ImportError:
        return cases
    ep = straight_plan(4, [0, 1, 3], global_batch_size=6, num_micro_batches=2, replicas=[1, 2, 1])
    mid = dataclasses.replace(ep.stages[1], expert_width=2)
    ep = dataclasses.replace(ep, stages=(ep.stages[0], mid, ep.stages[2]))
    cases["mixtral-ep2"] = (f"{here / 'extra_models.py'}:mixtral", {}, lambda: ep)
    return cases


def _digest(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:24]
    if isinstance(t, dict):
        return {str(k): _digest(v) for k, v in sorted(t.items(), key=lambda kv: str(kv[0]))}
    return repr(t)


def _train(spec: str, overrides: dict[str, Any], plan: Plan, root: Path) -> dict[str, Any]:
    ck = root / "ck"
    metrics = api.train(plan, spec, 2, overrides=overrides, optimizer="adamw", lr=1e-2, seed=3,
                        checkpoint_dir=str(ck), save_every=2)  # fmt: skip
    last = latest_checkpoint(ck)
    assert last is not None, f"no checkpoint in {ck}"
    states = load_layer_states(last, range(last.meta.num_layers))
    return {
        "losses": [repr(m.loss) for m in metrics],
        "layers": {str(i): {"tensors": _digest(s.tensors), "optimizer": _digest(s.optimizer)}
                   for i, s in sorted(states.items())},
    }  # fmt: skip


def dump(out: Path, only: list[str] | None) -> None:
    result: dict[str, Any] = {}
    sys.path.insert(0, str(Path(__file__).parent))
    with tempfile.TemporaryDirectory() as models:
        for name, (spec, overrides, make) in _cases(Path(models)).items():
            if only and name not in only:
                continue
            with tempfile.TemporaryDirectory() as d:
                result[name] = _train(spec, overrides, make(), Path(d))
            print(f"{name}: losses {result[name]['losses']}", flush=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True))


def compare(a: Path, b: Path) -> int:
    before, after = json.loads(a.read_text()), json.loads(b.read_text())
    bad = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
    for k in bad:
        print(f"DIFFERENT: {k}")
    print(f"{len(before) - len(bad)} of {len(before)} cases identical")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        ap.error("--out or --compare is required")
    dump(args.out, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())

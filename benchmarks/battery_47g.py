"""Issue 47's mini-battery G over what landed after battery F: mixed clusters given one profile
per device kind (``--profile KIND=FILE``), the V schedules under ``train``, expert-parallel plans
under ``train`` and ``simulate`` with the ZeRO flags, ``--checkpoint-dir`` saving at the run's
end (with ``--save-every``, ``--keep``, ``--resume``, ``generate``), and ``profile --analytic``'s
length and size limits.

Each case runs ``python -m dapple ...`` under ``timeout`` and is recorded with its exit code,
the first line of stderr and its seconds, and judged as :mod:`_battery` says. A case may also
name the checkpoints its folder must hold afterwards (a lost or extra save is flagged). Run as
``python benchmarks/battery_47g.py --out benchmarks/battery_47g.md`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _battery import EXAMPLES, TINY_MOE, run_battery
from _bench_common import HERE

ZOO = ["-m", "transformer", "--set", "layers=2", "--set", "hidden=32"]
"""A zoo transformer of 4 layers (embedding, 2 blocks, head)."""

ZOO6 = ["-m", "transformer", "--set", "layers=6", "--set", "hidden=32"]
"""A zoo transformer of 8 layers, two per device group of a 2-rank V."""

Case = tuple[str, str, list[str], "list[str] | None"]
"""``(group, expectation, argv, checkpoints the folder W/ck must hold after, or None)``."""


_MIXED4 = {
    "schema_version": 1, "name": "mixed4", "devices_per_server": 2, "profile_device": "h100",
    "kinds": [{"name": "H100", "servers": 1, "datasheet": "h100"},
              {"name": "A100-40GB", "servers": 1, "datasheet": "a100", "device_memory_gib": 40}],
    "intra_server_bandwidth_gbps": 2400, "inter_server_bandwidth_gbps": 400,
    "intra_server_latency_ms": 0.003, "inter_server_latency_ms": 0.01,
}  # fmt: skip
"""``examples/mixed.json`` on 2 devices per server: the kind cases plan in seconds."""


def _kind_cases(w: Path) -> list[Case]:
    mixed = str(w / "mixed4.json")
    h, a = f"H100={w / 'h.json'}", f"A100-40GB={w / 'a.json'}"
    plan = ["plan", "--cluster", mixed, "--global-batch-size", "16"]
    sim = ["simulate", "--plan", str(w / "kp.json"), "--cluster", mixed]
    g = "kind profiles"
    return [
        (g, "ok", ["plan", "--cluster", str(EXAMPLES / "mixed.json"), "--global-batch-size", "8",
                   "--profile", h, "--profile", a], None),
        (g, "ok", [*plan, "--profile", h, "--profile", a], None),
        (g, "ok", [*plan, "--profile", a, "--profile", h, "--schedule", "zbv"], None),
        (g, "ok", [*plan, "--profile", h, "--profile", a, "--zero-stage", "auto"], None),
        (g, "ok", [*plan, "--profile", h, "--profile", a, "--planner", "grid"], None),
        (g, "ok", [*plan, "--profile", f"H100={w / 'moe_h.json'}", "--profile",
                   f"A100-40GB={w / 'moe_a.json'}"], None),
        (g, "refuse", [*plan, "--profile", h], None),  # a kind without a profile
        (g, "refuse", [*plan, "--profile", h, "--profile", a, "--profile", f"V100={w / 'h.json'}"],
         None),
        (g, "refuse", [*plan, "--profile", h, "--profile", f"H100={w / 'a.json'}"], None),
        (g, "refuse", [*plan, "--profile", h, "--profile", f"A100-40GB={w / 'other.json'}"], None),
        (g, "refuse", [*plan, "--profile", h, "--profile", f"A100-40GB={w / 'nothere.json'}"],
         None),
        (g, "refuse", [*plan, "--profile", h, "--profile", f"A100-40GB={w / 'bin.json'}"], None),
        (g, "refuse", [*plan, "--profile", h, "--profile", f"A100-40GB={w}"], None),
        (g, "refuse", [*plan, "--profile", h, "--profile", "A100-40GB="], None),
        (g, "refuse", [*plan, "--profile", h, "--profile", f"={w / 'a.json'}"], None),
        (g, "refuse", [*plan, "--profile", str(w / "h.json"), "--profile", a], None),
        (g, "refuse", ["plan", "--cluster", "paper-a", "--profile", h, "--profile", a], None),
        (g, "refuse", [*plan, "--profile", h, "--profile", a, "--servers", "2"], None),
        (g, "ok", [*sim, "--profile", h, "--profile", a], None),
        # kp.json is one device group (replication 1) as the planner now plans it: no V
        (g, "refuse", [*sim, "--profile", h, "--profile", a, "--schedule", "dualpipev"], None),
        (g, "ok", [*sim, "--profile", str(w / "h.json")], None),
        (g, "refuse", [*sim, "--profile", f"H100={w / 'other.json'}", "--profile", a], None),
        (g, "ok", [*sim, "--profile", h, "--profile", a, "--gantt", str(w / "g.svg")], None),
    ]  # fmt: skip


def _train_cases(w: Path) -> list[Case]:
    t = ["train", "--device", "cpu", "--steps", "2"]
    p4, p8, ep = str(w / "p4.json"), str(w / "p8.json"), str(w / "ep.json")
    moe = ["-m", f"hf:{w / 'tiny_moe'}"]
    ck = ["--checkpoint-dir", str(w / "ck")]
    v, m, c = "V schedules", "expert parallelism", "checkpoint at the end"
    return [
        (v, "ok", [*t, "--plan", p8, *ZOO6, "--schedule", "zbv"], None),
        # M = 2 < 2P = 4 micro-batches: DualPipeV refuses it
        (v, "refuse", [*t, "--plan", p8, *ZOO6, "--schedule", "dualpipev"], None),
        (v, "ok", [*t, "--plan", p4, *ZOO, "--schedule", "zbv"], None),  # 1 layer a chunk
        (v, "refuse", [*t, "--plan", str(w / "p1.json"), *ZOO, "--schedule", "dualpipev"], None),
        (v, "refuse", [*t, "--plan", p8, *ZOO6, "--schedule", "zbv", "--virtual-stages", "3"],
         None),
        (m, "ok", [*t, "--plan", ep, *moe], None),
        (m, "ok", [*t, "--plan", ep, *moe, "--zero-stage", "1"], None),
        (m, "refuse", [*t, "--plan", ep, *moe, "--zero-stage", "3"], None),
        # interleaved keeps v = 1 on a 1-stage plan: 1F1B, which EP runs
        (m, "ok", [*t, "--plan", ep, *moe, "--schedule", "interleaved"], None),
        (m, "refuse", [*t, "--plan", ep, *ZOO], None),  # a dense model under expert widths
        (m, "ok", ["simulate", "--plan", ep, "--profile", str(w / "tiny_moe.json"), "--cluster",
                   "h100-8x"], None),
        (m, "refuse", ["simulate", "--plan", ep, "--profile", str(w / "h.json"), "--cluster",
                       "h100-8x"], None),
        (c, "ok", [*t, "--plan", p4, *ZOO, *ck], ["step-00000002"]),
        (c, "refuse", [*t, "--plan", p4, *ZOO, *ck], ["step-00000002"]),  # holds checkpoints
        (c, "refuse", [*t, "--plan", p4, *ZOO, *ck, "--resume", "--steps", "1"],
         ["step-00000002"]),
        (c, "ok", [*t, "--plan", p4, *ZOO, *ck, "--resume", "--steps", "3"],
         ["step-00000002", "step-00000003"]),
        (c, "ok", ["generate", *ZOO, *ck, "--prompt", "ab", "--max-new-tokens", "2"],
         ["step-00000002", "step-00000003"]),
        (c, "ok", [*t, "--plan", p4, *ZOO, *ck, "--resume", "--steps", "5", "--save-every", "1",
                   "--keep", "1"], ["step-00000005"]),
        (c, "ok", [*t, "--plan", p4, *ZOO, *ck, "--overwrite-checkpoints", "--save-every", "0"],
         ["step-00000005"]),
        (c, "refuse", [*t, "--plan", p4, *ZOO, *ck, "--save-every", "-1"], ["step-00000005"]),
        (c, "refuse", [*t, "--plan", p4, *ZOO, *ck, "--keep", "-1"], ["step-00000005"]),
        (c, "refuse", [*t, "--plan", p4, *ZOO, "--checkpoint-dir", str(w / "h.json")], None),
        # root writes into a read-only folder: there the run saves
        (c, "ok" if os.geteuid() == 0 else "refuse",
         [*t, "--plan", p4, *ZOO, "--checkpoint-dir", str(w / "ro" / "ck")], None),
        (c, "refuse", [*t, "--plan", p4, *ZOO, *ck, "--resume", "--steps", "0"], ["step-00000005"]),
    ]  # fmt: skip


def _analytic_cases(w: Path) -> list[Case]:
    a = ["profile", "--analytic", "h100", "-o", str(w / "pa.json")]
    g = "analytic limits"
    return [
        (g, "refuse", [*a, "-m", "llama3-8b", "--seq-lens", "1000000000000"], None),
        (g, "refuse", [*a, "-m", "llama3-8b", "--seq-lens", "4096,100000000"], None),
        (g, "refuse", [*a, "-m", "llama3-8b", "--batch-sizes", "1000000000000"], None),
        (g, "refuse", [*a, "-m", "transformer", "--set", "hidden=1000000000000"], None),
        # 1.3e14 parameters on a 64-wide model: under the 1e15 limit
        (g, "ok", [*a, "-m", "transformer", "--set", "vocab=1000000000000"], None),
        (g, "refuse", [*a, "-m", f"hf:{w / 'huge_moe'}"], None),
        (g, "ok", [*a, "-m", "llama3-8b", "--seq-lens", "131072"], None),
    ]


def _cases(w: Path) -> list[Case]:
    return [*_kind_cases(w), *_train_cases(w), *_analytic_cases(w)]


def _setup(w: Path) -> None:
    """The inputs: per-kind profiles of one zoo transformer (and another's), MoE ones, plans
    for the train cases, a binary file and a read-only folder."""
    from dapple.core.plan import straight_plan

    for d, cfg in (
        ("tiny_moe", TINY_MOE),
        ("huge_moe", {**TINY_MOE, "hidden_size": 2**22, "intermediate_size": 2**24}),
    ):
        (w / d).mkdir()
        (w / d / "config.json").write_text(json.dumps(cfg))
    (w / "mixed4.json").write_text(json.dumps(_MIXED4))
    zoo4 = ["-m", "transformer", "--set", "layers=4"]
    runs = [
        ["profile", "--analytic", "h100", *zoo4, "-o", str(w / "h.json")],
        ["profile", "--analytic", "a100", *zoo4, "-o", str(w / "a.json")],
        ["profile", "--analytic", "a100", "-m", "transformer", "--set", "layers=5", "-o",
         str(w / "other.json")],
        ["profile", "--analytic", "h100", "-m", f"hf:{w / 'tiny_moe'}", "-o",
         str(w / "tiny_moe.json")],
        ["profile", "--analytic", "h100", "-m", f"hf:{w / 'tiny_moe'}", "-o", str(w / "moe_h.json")],
        ["profile", "--analytic", "a100", "-m", f"hf:{w / 'tiny_moe'}", "-o", str(w / "moe_a.json")],
        ["plan", "--profile", f"H100={w / 'h.json'}", "--profile", f"A100-40GB={w / 'a.json'}",
         "--cluster", str(w / "mixed4.json"), "--global-batch-size", "16", "-o",
         str(w / "kp.json")],
    ]  # fmt: skip
    for argv in runs:
        subprocess.run([sys.executable, "-m", "dapple", *argv], check=True, capture_output=True)
    straight_plan(4, [0, 2], global_batch_size=4, num_micro_batches=2).save(w / "p4.json")
    straight_plan(4, [0], global_batch_size=4, num_micro_batches=2).save(w / "p1.json")
    straight_plan(8, [0, 4], global_batch_size=4, num_micro_batches=2).save(w / "p8.json")
    d = straight_plan(4, [0], global_batch_size=4, num_micro_batches=2, replicas=[2]).to_dict()
    d["stages"][0]["expert_width"] = 2
    (w / "ep.json").write_text(json.dumps(d))
    (w / "bin.json").write_bytes(bytes(range(256)) * 4)
    (w / "ro").mkdir()
    (w / "ro").chmod(0o555)


def _checkpoints(w: Path) -> list[str]:
    ck = w / "ck"
    return sorted(p.name for p in ck.iterdir() if p.name.startswith("step-")) if ck.is_dir() else []


def _saves_as_wanted(w: Path, i: int) -> str | None:
    """Why case ``i`` is BAD by the checkpoints it left (None: those it names, or it names
    none)."""
    want = _cases(w)[i][3]
    if want is None or _checkpoints(w) == want:
        return None
    return f"checkpoints {_checkpoints(w)}, expected {want}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "battery_47g.md"))
    ap.add_argument("--only", default=None, help="comma-separated groups to run (default: all)")
    args = ap.parse_args()
    run_battery("battery_47g", "Issue 47 mini-battery G: kind profiles, V and EP under train, "
                "end saves, analytic limits", lambda w: [c[:3] for c in _cases(w)], _setup,
                out=args.out, only=None if args.only is None else set(args.only.split(",")),
                after=_saves_as_wanted, flagged=", checkpoints other than expected")  # fmt: skip


if __name__ == "__main__":
    main()

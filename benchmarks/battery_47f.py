"""Issue 47's mini-battery over the day's newest features: ``plan``/``simulate`` with the V
schedules (``--schedule zbv|dualpipev``), expert widths in plan files, mixed clusters
(``examples/mixed.json``, preset ``mixed-h100-a100``), ``profile --analytic``, and odd values
(0, negative, nan, huge, fractional) for every numeric flag of ``plan``, ``simulate`` and
``profile``.

Each case runs ``python -m dapple ...`` under ``timeout`` and is recorded with its exit code,
the first line of stderr and its seconds, and judged as :mod:`_battery` says. Run as
``python benchmarks/battery_47f.py --out benchmarks/battery_47f.md`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from _battery import EXAMPLES, Case, run_battery
from _bench_common import HERE

_MIX = {
    "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 512,
    "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 1024,
    "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}  # fmt: skip
"""A Mixtral of 4 blocks of 8 experts (hf:DIR): an MoE profile that plans in seconds."""

ODD = ("0", "-1", "nan", "1e12", "1000000000000", "2.5")
"""The odd values every numeric flag is given (``1e12`` in a float's spelling and as digits)."""

VALID = {("--zero-stage", "0"), ("--servers", "1000000000000"),
         ("--global-batch-size", "1000000000000")}  # fmt: skip
"""The odd values that are a flag's valid choice (10^12 servers: planned on the devices the
batch can use; a global batch of 10^12: planned as that many samples)."""


def _cases(w: Path) -> list[Case]:
    """``(group, expectation, argv)`` of every case; ``w`` holds the setup's files."""
    b48 = ["--profile", "paper:bert48", "--cluster", "paper-a"]
    sim = ["simulate", "--plan", str(w / "b48.json"), *b48]
    moe = ["--profile", str(w / "moe.json")]
    mixed = str(EXAMPLES / "mixed.json")
    out: list[Case] = []
    for s in ("zbv", "dualpipev"):  # the V schedules
        out += [
            ("V schedules", "ok", ["plan", *b48, "--schedule", s]),
            ("V schedules", "ok", ["plan", *b48, "--schedule", s, "--zero-stage", "1"]),
            ("V schedules", "refuse", ["plan", *b48, "--schedule", s, "--virtual-stages", "3"]),
            ("V schedules", "refuse", ["plan", *b48, "--schedule", s, "--interleave"]),
            ("V schedules", "refuse", ["plan", *b48, "--schedule", s, "--planner", "dp"]),
            ("V schedules", "ok", ["plan", *b48, "--schedule", s, "--planner", "straight"]),
            ("V schedules", "ok", [*sim, "--schedule", s]),
            ("V schedules", "ok", [*sim, "--schedule", s, "--other-schedule"]),
            ("V schedules", "refuse", [*sim, "--schedule", s, "--virtual-stages", "4"]),
            ("V schedules", "ok", ["plan", *moe, "--cluster", "h100-8x", "--servers", "2",
                                   "--global-batch-size", "64", "--schedule", s]),
        ]  # fmt: skip
    for name, width in (("ew2", 2), ("ew8", 8), ("ew3", 3), ("ew0", 0), ("ew-1", -1),
                        ("ew1.5", 1.5), ("ewstr", "2"), ("ewnull", None), ("ewhuge", 1e300),
                        ("ew16", 16)):  # fmt: skip
        expect = "ok" if width in (2, 8) else "refuse"
        out.append(("expert widths", expect, ["simulate", "--plan", str(w / f"{name}.json"),
                                              *moe, "--cluster", "h100-8x", "--servers", "2"]))  # fmt: skip
    out += [
        ("expert widths", "refuse", ["simulate", "--plan", str(w / "ew2.json"), "--profile",
                                     "paper:bert48", "--cluster", "h100-8x", "--servers", "2"]),
        ("expert widths", "ok", ["simulate", "--plan", str(w / "ew8.json"), *moe, "--cluster",
                                 "h100-8x", "--servers", "2", "--schedule", "zbv"]),
        ("mixed clusters", "ok", ["plan", *moe, "--cluster", mixed, "--global-batch-size", "64"]),
        ("mixed clusters", "ok", ["plan", *moe, "--cluster", "mixed-h100-a100",
                                  "--global-batch-size", "64", "--schedule", "zbv"]),
        ("mixed clusters", "ok", ["plan", "--profile", "paper:bert48", "--cluster", mixed,
                                  "--planner", "grid"]),
        ("mixed clusters", "refuse", ["plan", "--profile", "paper:bert48", "--cluster", mixed,
                                      "--servers", "3"]),
        # a cluster of device kinds: its servers are changed in the file, not by --servers
        ("mixed clusters", "refuse", ["plan", "--profile", "paper:bert48", "--cluster", mixed,
                                      "--servers", "1"]),
        ("mixed clusters", "ok", ["simulate", "--plan", str(w / "b48.json"), "--profile",
                                  "paper:bert48", "--cluster", "mixed-h100-a100"]),
        ("mixed clusters", "ok", ["plan", *moe, "--cluster", "mixed-h100-a100",
                                  "--global-batch-size", "64", "--tensor-widths", "8"]),
    ]  # fmt: skip
    numeric = [
        ("plan", "--servers", ["plan", *b48]),
        ("plan", "--global-batch-size", ["plan", *b48]),
        ("plan", "--virtual-stages", ["plan", *b48, "--schedule", "interleaved"]),
        ("plan", "--zero-stage", ["plan", *b48]),
        ("plan", "--mean-seq-len", ["plan", *moe, "--cluster", "h100-8x", "--global-batch-size", "8"]),
        ("plan", "--tensor-widths", ["plan", *moe, "--cluster", "h100-8x",
                                     "--global-batch-size", "8"]),
        ("simulate", "--servers", sim),
        ("simulate", "--virtual-stages", [*sim, "--schedule", "interleaved"]),
        ("profile", "--batch-sizes", ["profile", "--analytic", "h100", "-m", "llama3-8b"]),
        ("profile", "--seq-lens", ["profile", "--analytic", "h100", "-m", "llama3-8b"]),
        ("profile", "--repeats", ["profile", "--analytic", "h100", "-m", "llama3-8b"]),
        ("profile", "--warmup", ["profile", "--analytic", "h100", "-m", "llama3-8b"]),
        ("profile", "--threads", ["profile", "--analytic", "h100", "-m", "llama3-8b"]),
        ("profile", "--set hidden", ["profile", "--analytic", "h100", "-m", "transformer"]),
    ]  # fmt: skip
    for command, flag, argv in numeric:
        for v in ODD:
            given = [f"{flag}={v}"] if " " not in flag else ["--set", f"hidden={v}"]
            if command == "profile":
                given += ["-o", str(w / "p_out.json")]
            expect = "ok" if (flag, v) in VALID else "refuse"
            out.append((f"{command} numeric", expect, [*argv, *given]))
    return out


def _setup(w: Path) -> None:
    """The inputs: a bert48 plan on paper-a, an analytic MoE profile, plan files of expert
    widths."""
    from dapple.core.plan import straight_plan

    (w / "mix").mkdir()
    (w / "mix" / "config.json").write_text(json.dumps(_MIX))
    for argv in (["plan", "--profile", "paper:bert48", "--cluster", "paper-a", "-o",
                  str(w / "b48.json")],
                 ["profile", "--analytic", "h100", "-m", f"hf:{w / 'mix'}", "-o",
                  str(w / "moe.json")]):  # fmt: skip
        subprocess.run([sys.executable, "-m", "dapple", *argv], check=True, capture_output=True)
    layers = json.loads((w / "moe.json").read_text())["layers"]
    plan = straight_plan(len(layers), [0, len(layers) // 2], global_batch_size=64,
                         num_micro_batches=8, replicas=[8, 8])  # fmt: skip
    for name, width in (("ew2", 2), ("ew8", 8), ("ew3", 3), ("ew0", 0), ("ew-1", -1),
                        ("ew1.5", 1.5), ("ewstr", "2"), ("ewnull", None), ("ewhuge", 1e300),
                        ("ew16", 16)):  # fmt: skip
        d = plan.to_dict()
        d["model_name"] = json.loads((w / "moe.json").read_text())["model_name"]
        d["stages"][0]["expert_width"] = width
        (w / f"{name}.json").write_text(json.dumps(d))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "battery_47f.md"))
    ap.add_argument("--only", default=None, help="comma-separated groups to run (default: all)")
    args = ap.parse_args()
    run_battery("battery_47f", "Issue 47 mini-battery F: V schedules, expert widths, mixed "
                "clusters, odd numbers", _cases, _setup, out=args.out,
                only=None if args.only is None else set(args.only.split(",")))  # fmt: skip


if __name__ == "__main__":
    main()

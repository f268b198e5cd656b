"""Elastic recovery measured: kill -9 one worker of a 4-process 3:1 run mid-run, 3 times.

    python benchmarks/elastic.py --out benchmarks/elastic.md

Each repetition starts ``dapple.runtime.train(..., elastic=...)`` (the zoo MLP, G=16, M=2, AdamW,
a checkpoint every step) in a subprocess, waits for a chosen step, SIGKILLs a chosen worker and
records: seconds from the kill to the next completed step (a new step line in the metrics file,
polled every 20 ms), the steps run again (those completed after the checkpoint resumed from),
the re-plan, whether every loss equals an uninterrupted one-process run of the same seed and
data order (relative 1e-5), and whether every checkpoint left on disk reads back whole.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dapple.core.plan import Plan, straight_plan
from dapple.runtime.checkpoint import check_files, list_checkpoints, read_checkpoint
from dapple.runtime.launch.elastic import metrics_lines

STEPS = 40
REPS = ((4, 2), (9, 3), (15, 1))
"""(step to kill at, worker to kill by start order) of each repetition."""

_SCRIPT = """
import sys
from dapple.core.cluster_presets import PRESETS
from dapple.core.plan import Plan
from dapple.core.profile import ModelProfile
from dapple.runtime.launch.elastic import ElasticPolicy
from dapple.runtime.train_config import TrainConfig
from dapple.runtime.launch.launcher import train

if __name__ == "__main__":
    out, steps = sys.argv[1], int(sys.argv[2])
    policy = ElasticPolicy(ModelProfile.load(f"{out}/profile.json"), PRESETS["local-cpu"],
                           max_restarts=2)
    cfg = TrainConfig(steps=steps, checkpoint_dir=f"{out}/ck", save_every=1,
                      metrics_path=f"{out}/m.jsonl", echo=False, optimizer="adamw", lr=1e-2,
                      seed=5, device="cpu", timeout_s=60)
    train(Plan.load(f"{out}/plan.json"), "mlp", cfg, elastic=policy)
"""


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in text.splitlines() if x.strip() and x.endswith("}")]


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)],
                         capture_output=True, text=True, check=False).stdout  # fmt: skip
    return sorted(int(x.split()[0]) for x in out.splitlines() if "spawn_main" in x)


def _profile(out: Path) -> None:
    subprocess.run([sys.executable, "-m", "dapple", "profile", "-m", "mlp", "-o",
                    str(out / "profile.json")], check=True, capture_output=True)  # fmt: skip


def _one(out: Path, kill_at: int, victim: int) -> dict[str, Any]:
    _profile(out)
    straight_plan(5, [0, 2], global_batch_size=16, num_micro_batches=2, replicas=[3, 1]).save(
        out / "plan.json"
    )
    (out / "run.py").write_text(textwrap.dedent(_SCRIPT))
    proc = subprocess.Popen([sys.executable, str(out / "run.py"), str(out), str(STEPS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics = out / "m.jsonl"
    while sum("step" in d and "event" not in d for d in _lines(metrics)) < kill_at:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    workers = _workers(proc.pid)
    done_before = max(d["step"] for d in _lines(metrics) if "event" not in d)
    os.kill(workers[victim], signal.SIGKILL)
    killed = time.monotonic()
    seen = len(_lines(metrics))
    while True:
        new = [d for d in _lines(metrics)[seen:] if "event" not in d]
        if new:
            recovered = time.monotonic() - killed
            break
        assert proc.poll() is None or new, "the run ended without a step after the kill"
        time.sleep(0.02)
    _, err = proc.communicate(timeout=600)
    records, events = metrics_lines(metrics)
    last = {r["step"]: r["loss"] for r in records}
    intact = True
    for d in list_checkpoints(out / "ck"):
        try:
            check_files(read_checkpoint(d))
        except Exception:
            intact = False
    return {
        "kill_at": kill_at, "victim": victim, "rc": proc.returncode, "recovered_s": recovered,
        "rerun": done_before + 1 - events[0]["resume_step"] if events else None,
        "replan": f"{_rep(events[0]['old_plan'])} -> {_rep(events[0]['new_plan'])}"
                  if events else "none",
        "losses": [last.get(i) for i in range(STEPS)], "intact": intact,
        "checkpoints": len(list_checkpoints(out / "ck")), "err": err[-500:],
    }  # fmt: skip


def _rep(plan_d: dict[str, Any]) -> str:
    return Plan.from_dict(plan_d).replication


def _reference() -> list[float]:
    from dapple import api

    one = straight_plan(5, [0], global_batch_size=16, num_micro_batches=2)
    ms = api.train(one, "mlp", STEPS, optimizer="adamw", lr=1e-2, seed=5, device="cpu")
    return [m.loss for m in ms]


def _same(a: list[float | None], b: list[float]) -> bool:
    return all(x is not None and abs(x - y) <= 1e-5 * abs(y) for x, y in zip(a, b, strict=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/elastic.md"))
    args = ap.parse_args()
    ref = _reference()
    rows = []
    for kill_at, victim in REPS:
        with tempfile.TemporaryDirectory() as d:
            r = _one(Path(d), kill_at, victim)
        rows.append(r)
        print(f"kill at step {kill_at}, worker {victim}: recovered in {r['recovered_s']:.2f} s, "
              f"re-ran {r['rerun']}, {r['replan']}, losses equal {_same(r['losses'], ref)}",
              flush=True)  # fmt: skip
    load = os.getloadavg()
    lines = [
        "# Elastic recovery: kill -9 of one worker, re-plan, resume",
        "",
        f"- command: `python benchmarks/elastic.py --out {args.out}`",
        f"- machine: {platform.platform()}, {os.cpu_count()} cores, load average "
        f"{load[0]:.1f} at the end (other work shared the machine)",
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- run: zoo MLP, 4 processes as 3:1, G=16, M=2, AdamW, {STEPS} steps, a checkpoint "
        "every step; the re-plan is the planner's own search for the survivors (local-cpu "
        "cluster less the lost device); recovery reads the newest checkpoint (a recovery from "
        "the survivors' memory without a checkpoint is not built)",
        "",
        "| kill at step | worker killed | kill -> next step (s) | steps re-run | re-plan | "
        "losses = uninterrupted (rel 1e-5) | checkpoints whole | exit |",
        "|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kill_at']} | {r['victim']} | {r['recovered_s']:.2f} | {r['rerun']} | "
            f"{r['replan']} | {_same(r['losses'], ref)} | {r['intact']} ({r['checkpoints']}) | "
            f"{r['rc']} |"
        )
    lines += [
        "",
        "The seconds from the kill to the next step are start-up of the new processes (import, "
        "model build, rendezvous) plus the re-plan and the checkpoint read; on a GPU cluster the "
        "process start and NCCL rendezvous dominate in the same way.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    return 0 if all(r["rc"] == 0 and _same(r["losses"], ref) and r["intact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

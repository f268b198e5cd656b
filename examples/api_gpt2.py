"""Profile, plan, simulate and verify a small Hugging Face GPT-2 on 4 CPU processes.

Run: ``python examples/api_gpt2.py`` (needs ``pip install 'dapple[hf]'``; ~1 minute on 2 cores).

The planner's plan for ``local-cpu`` (1 server x 4 processes) and a hand-written 1:2:1 pipeline
are both trained for 2 steps on 4 processes and compared, parameter by parameter, with the
original (unsplit, tied-embedding) model trained on one process from the same seed.
"""

from __future__ import annotations

import dapple.api as dp
from dapple.core.plan import straight_plan

GPT2 = {"layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seq": 16}


def main() -> int:
    workload = dp.load("dapple.models.hf:gpt2", **GPT2)  # 4 pieces: embeddings, 2 blocks, LM head
    profile = dp.profile(workload, batch_sizes=[1, 2, 4], repeats=3)
    plan = dp.plan(profile, "local-cpu", global_batch_size=8)
    sim = dp.simulate(plan, profile, "local-cpu")
    print(
        f"planner: {plan.replication}, M={plan.num_micro_batches}, simulated {sim.step_ms:.2f} ms"
    )

    pipeline = straight_plan(
        workload.num_layers, [0, 1, 3], global_batch_size=8, num_micro_batches=2, replicas=[1, 2, 1]
    )
    print(f"1:2:1 pipeline: simulated {dp.simulate(pipeline, profile, 'local-cpu').step_ms:.2f} ms")

    reports = dp.verify_many([(plan, workload), (pipeline, workload)], steps=2)
    for rep in reports:
        worst = max(rep.stages, key=lambda s: s.max_abs_diff)
        print(
            f"verify {rep.plan.replication} ({rep.plan.schedule}): "
            f"{'OK' if rep.ok else 'MISMATCH'}, largest difference {rep.max_abs_diff:.2g} "
            f"({worst.worst}), losses {[round(x, 5) for x in rep.losses]} "
            f"vs reference {[round(x, 5) for x in rep.reference_losses]}"
        )
    return 0 if all(rep.ok for rep in reports) else 1


if __name__ == "__main__":
    raise SystemExit(main())

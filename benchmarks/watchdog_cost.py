"""Stall detection's cost per iteration (issue 35, acceptance 6): the same rl_train run with the watchdog on
(`watchdog.stall_s`, default 600) and off (0), alternated per repeat so drift on a shared box hits both alike.

    python -m benchmarks.watchdog_cost [--repeats 3] [--iterations 4] [--out benchmarks/results/X.json]

An iteration's time is its `perf/iteration_s` (metrics.jsonl); the first iteration (warm-up) is left out. The
figure is the ratio of the medians (on / off) and the spread of the per-repeat ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path


def one_run(root: str, stall_s: float, iterations: int, prompts: int) -> list[float]:
    from rollflow.flows.config import RunConfig
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train

    cfg = RunConfig.model_validate(
        {
            "run": f"wd-{int(stall_s)}-{uuid.uuid4().hex[:6]}",
            "iterations": iterations,
            "checkpoint_every": iterations,
            "store": {"root": root},
            "data": {"prompts_per_rollout": prompts},
            "rollout": {"n_samples_per_prompt": 4},
            "train": {"num_steps_per_rollout": 1},
            "watchdog": {"stall_s": stall_s, "probe_every": 0},
        }
    )
    rl_train(cfg)
    return [float(r["perf/iteration_s"]) for r in read_metrics(cfg)][1:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from prefect.testing.utilities import prefect_test_harness

    from rollflow.infra.workers import ensure_ray

    ensure_ray(None, num_cpus=2)
    on: list[list[float]] = []
    off: list[list[float]] = []
    with prefect_test_harness(server_startup_timeout=120), tempfile.TemporaryDirectory() as root:
        for r in range(args.repeats):
            order = [(600.0, on), (0.0, off)] if r % 2 == 0 else [(0.0, off), (600.0, on)]
            for stall_s, sink in order:
                sink.append(one_run(root, stall_s, args.iterations, args.prompts))
    ratios = [statistics.median(a) / statistics.median(b) for a, b in zip(on, off)]
    report = {
        "what": "rl_train per-iteration time, watchdog.stall_s=600 (on) vs 0 (off), same config, alternated",
        "date": time.strftime("%Y-%m-%d"),
        "device": "cpu",
        "config": {
            "iterations": args.iterations,
            "prompts_per_rollout": args.prompts,
            "n_samples_per_prompt": 4,
            "model": "builtin:addition (the demo)",
            "repeats": args.repeats,
        },
        "iteration_s_on": on,
        "iteration_s_off": off,
        "median_iteration_s_on": statistics.median(x for run in on for x in run),
        "median_iteration_s_off": statistics.median(x for run in off for x in run),
        "ratio_on_off_per_repeat": ratios,
        "ratio_on_off_median": statistics.median(ratios),
        "ratio_spread": [min(ratios), max(ratios)],
        "goal": "<= 1.02 (stall detection costs at most 2% of an iteration)",
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

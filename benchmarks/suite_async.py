"""Suite 7: iteration time of rl_train with pipeline.max_staleness=0 (generate -> train -> sync in sequence)
vs N >= 1 (async: the engine generates rollout i+N while the trainer trains on rollout i, a queue N deep in
lock step, docs/async.md), in one run.

Two configurations, each run both ways back to back (so both see the same machine load):
- `embedded default`: the demo's shape (256 prompts x 8 samples, 8 optimizer steps);
- `balanced`: generation and training of similar cost (the engine rescores its samples with the
  trainer's forward, `rollout.logprobs=teacher_forced`; the trainer skips reference log-probs).

An iteration's time is the gap between the starts of consecutive `rl_iteration` flow runs, read from the
Prefect API. Only steady iterations count: the first is left out (start-up, and an async run fills its queue
there) and so are an async run's last N (its queue drains: nothing left to generate beside them). Each
repeat runs every mode back to back, so a speed-up is a ratio within one repeat; the figure is the median of
the repeats with their spread. Generate and train task durations are reported beside it.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid

from benchmarks.core import BenchContext, Goal, SuiteResult

TITLE = "async: rl_train iteration time, max_staleness 0 vs 1, 2, 4"
CONFIGS = {
    "embedded default": {},
    "balanced": {"rollout": {"logprobs": "teacher_forced"}, "train": {"compute_ref_log_probs": False}},
}
DEPTHS = {"embedded default": (0, 1, 2, 4), "balanced": (0, 1, 2)}  # max_staleness values run per config
GOALS = {1: 1.3, 2: 1.6}  # speed-up over the synchronous loop (issue goals); N=4 is reported without one


def _config(ctx: BenchContext, label: str, staleness: int, prompts: int, n: int, iterations: int):
    from rollflow.flows.config import RunConfig

    extra = CONFIGS[label]
    return RunConfig.model_validate(
        {
            "run": f"async{staleness}-{uuid.uuid4().hex[:6]}",
            "iterations": iterations,
            "checkpoint_every": iterations,
            "store": {"root": str(ctx.workdir / "async")},
            "data": {"prompts_per_rollout": prompts, "eval_prompts": prompts},
            "rollout": {"n_samples_per_prompt": n, **extra.get("rollout", {})},
            "train": extra.get("train", {}),
            "pipeline": {"max_staleness": staleness},
        }
    )


def _timeline(run: str, drained: int) -> tuple[list[float], dict[str, list[float]]]:
    """Steady iteration times (gaps between rl_iteration starts, the last one to its end; the first iteration and
    the last `drained` left out) and each task's durations, from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )

    async def read():
        async with get_client() as client:
            flows = await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=f"{run}/iter-"))
            )
            flows = sorted((f for f in flows if f.name.startswith(f"{run}/iter-")), key=lambda f: f.name)
            tasks = await client.read_task_runs(
                task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[f.id for f in flows])), limit=200
            )
        return flows, tasks

    flows, tasks = asyncio.run(read())
    starts = [f.start_time.timestamp() for f in flows]
    ends = [f.end_time.timestamp() for f in flows]
    gaps = [b - a for a, b in zip(starts, starts[1:])] + [ends[-1] - starts[-1]]
    durations: dict[str, list[float]] = {}
    for t in tasks:
        if t.start_time and t.end_time:
            durations.setdefault(t.name.rsplit("-", 1)[0], []).append((t.end_time - t.start_time).total_seconds())
    return gaps[1 : len(gaps) - drained], durations


def run(ctx: BenchContext) -> SuiteResult:
    from rollflow.flows.train import rl_train

    res = SuiteResult("async", TITLE)
    ctx.services.prefect()
    ctx.services.ray()
    prompts, n = (64, 4) if ctx.quick else (256, 8)
    steady = 2 if ctx.quick else 3  # steady iterations per run, for every mode
    repeats = ctx.n(3, 1)
    res.params = {
        "size": f"{prompts}x{n}",
        "steady_iterations": steady,
        "repeats": repeats,
        "depths": {k: list(v) for k, v in DEPTHS.items()},
        "configs": {k: v or "defaults" for k, v in CONFIGS.items()},
    }
    for label in CONFIGS:
        depths = DEPTHS[label] if not ctx.quick else (0, 1)
        times: dict[int, list[float]] = {d: [] for d in depths}
        speedups: dict[int, list[float]] = {d: [] for d in depths if d}
        tasks: dict[int, dict[str, list[float]]] = {d: {} for d in depths}
        for _ in range(repeats):
            medians = {}
            for staleness in depths:  # back to back: every mode under the same load
                cfg = _config(ctx, label, staleness, prompts, n, 1 + steady + staleness)
                rl_train(cfg)
                gaps, durations = _timeline(cfg.run, drained=staleness)
                times[staleness] += gaps
                medians[staleness] = statistics.median(gaps)
                for name, values in durations.items():
                    tasks[staleness].setdefault(name, []).extend(values)
            for d in speedups:
                speedups[d].append(medians[0] / medians[d])
        for d in depths:
            res.add(f"{label}: iteration, max_staleness={d}", "s", times[d])
        res.add(f"{label}: generate task (sync run)", "s", tasks[0].get("generate-train", []))
        res.add(f"{label}: train task (sync run)", "s", tasks[0].get("train", []))
        for d, values in speedups.items():
            res.ratio(
                f"{label}: speed-up (sync / max_staleness={d} iteration)",
                values,
                goal=Goal(">=", GOALS[d]) if d in GOALS else None,
                note="per repeat: median steady iteration of the sync run / of this mode's run, run back to back",
                limit="lock step: one rollout generated beside each train step whatever N, so the overlap hides at "
                "most the shorter of generate and train; both share the CPU cores",
            )
    return res

"""Suite 7: iteration time of rl_train with pipeline.max_staleness=0 (generate -> train -> sync in sequence)
vs 1 (one-step-off: the engine generates rollout i+1 while the trainer trains on rollout i), in one run.

Two configurations, each run both ways back to back (so both see the same machine load):
- `embedded default`: the demo's shape (256 prompts x 8 samples, 8 optimizer steps);
- `balanced`: generation and training of similar cost (the engine rescores its samples with the
  trainer's forward, `rollout.logprobs=teacher_forced`; the trainer skips reference log-probs).

An iteration's time is the gap between the starts of consecutive `rl_iteration` flow runs, read from the
Prefect API (the first iteration is left out: start-up, and the async run's first rollout is generated
before training can start). Generate and train task durations are reported beside it.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid

from benchmarks.core import BenchContext, Goal, SuiteResult

TITLE = "async: rl_train iteration time, max_staleness 0 vs 1"
CONFIGS = {
    "embedded default": {},
    "balanced": {"rollout": {"logprobs": "teacher_forced"}, "train": {"compute_ref_log_probs": False}},
}


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


def _timeline(run: str) -> tuple[list[float], dict[str, list[float]]]:
    """Iteration times (gaps between rl_iteration starts, the last one to its end; the first iteration left out)
    and each task's durations, from the Prefect API."""
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
    return gaps[1:], durations


def run(ctx: BenchContext) -> SuiteResult:
    from rollflow.flows.train import rl_train

    res = SuiteResult("async", TITLE)
    ctx.services.prefect()
    ctx.services.ray()
    prompts, n = (64, 4) if ctx.quick else (256, 8)
    iterations = 3 if ctx.quick else 5
    repeats = ctx.n(1, 1)
    res.params = {
        "size": f"{prompts}x{n}",
        "iterations": iterations,
        "repeats": repeats,
        "configs": {k: v or "defaults" for k, v in CONFIGS.items()},
    }
    for label in CONFIGS:
        times: dict[int, list[float]] = {0: [], 1: []}
        tasks: dict[int, dict[str, list[float]]] = {0: {}, 1: {}}
        for _ in range(repeats):
            for staleness in (0, 1):  # back to back: both modes under the same load
                cfg = _config(ctx, label, staleness, prompts, n, iterations)
                rl_train(cfg)
                gaps, durations = _timeline(cfg.run)
                times[staleness] += gaps
                for name, values in durations.items():
                    tasks[staleness].setdefault(name, []).extend(values)
        res.add(f"{label}: iteration, max_staleness=0", "s", times[0])
        res.add(f"{label}: iteration, max_staleness=1", "s", times[1])
        res.add(f"{label}: generate task (sync run)", "s", tasks[0].get("generate-train", []))
        res.add(f"{label}: train task (sync run)", "s", tasks[0].get("train", []))
        res.ratio(
            f"{label}: speed-up (sync / async iteration)",
            [statistics.median(times[0]) / statistics.median(times[1])],
            goal=Goal(">=", 1.3),
            note="medians of the iterations after the first, both runs in this command",
            limit="the overlap hides at most the shorter of generate and train; both share the CPU cores",
        )
    return res

"""Suite 1: orchestration overhead, the same iterations as a bare Python loop vs through rollflow.

Same model (builtin:addition), batch, seeds and thread counts in both:
- bare: `RolloutWorker.rollout` -> `score_samples` -> `train_on_samples` -> `update_weights`, plain
  calls in this process (as tests/test_rollout_train_sync.py does);
- rollflow: `rollflow.flows.train.rl_train` against a local Prefect server: one `rl_iteration` sub-flow run
  per iteration, engine and trainer as Ray actors, every rollout persisted as an artifact and read
  back by the trainer, weight parity checked after each sync.
An iteration of the flow is the time between the starts of consecutive `rl_iteration` runs (so the
sub-flow's exit is included); the last iteration (checkpoint, flow exit) and the first (warm-up) are
left out of both sides, and iterations are paired by rollout id (same data, same work; the metrics
of both sides are checked to be identical). The bare loop runs before and after the flow runs and
each rollout id's two times are averaged, so drift on a shared box hits both sides alike.

At the largest size a design alternative runs too (patched in for the run, flows/ unchanged): no
sub-flow run per iteration. (flows/iteration.py already `quote()`s the Samples it hands to tasks.)
Mechanism figures isolate
Prefect's costs: a no-op task taking a rollout's Samples (plain and quoted), an empty
rl_iteration-shaped sub-flow, the same six tasks without a sub-flow.
"""

from __future__ import annotations

import statistics
import time
import uuid

import torch

from benchmarks.core import BenchContext, Goal, SuiteResult

TITLE = "orchestration overhead: rl_train (Prefect + Ray + artifacts) vs the bare loop"
GOAL = Goal("<=", 0.02, "<= 2% of the iteration")


def sizes_for(ctx: BenchContext) -> list[tuple[int, int, int]]:
    """(prompts, samples per prompt, flow iterations)."""
    if ctx.quick:
        return [(16, 4, 4), (64, 4, 4)]
    return [(64, 4, 8), (256, 8, 5)]


def _config(ctx: BenchContext, prompts: int, n: int, iterations: int):
    from rollflow.flows.config import RunConfig

    return RunConfig.model_validate(
        {
            "run": f"orch-{prompts}x{n}-{uuid.uuid4().hex[:6]}",
            "iterations": iterations,
            "checkpoint_every": iterations,  # the bare loop checkpoints nothing: only the final one here
            "eval_every": 0,
            "store": {"root": str(ctx.workdir / "orchestration")},
            "data": {"prompts_per_rollout": prompts, "eval_prompts": prompts},
            "rollout": {"n_samples_per_prompt": n},
        }
    )


def bare_loop(cfg, count: int) -> dict:
    """`count` iterations as plain calls; extras the flow adds are timed apart (not in `iteration_s`)."""
    from rollflow.artifacts.manifest import EngineInfo
    from rollflow.artifacts.store import RolloutStore
    from rollflow.tasks.rollout.rewards import resolve_reward_fn, score_samples
    from rollflow.tasks.rollout.worker import RolloutWorker
    from rollflow.tasks.sync.parity import checksums, compare
    from rollflow.tasks.train.step import train_on_samples
    from rollflow.tasks.train.worker import build_backend

    worker = RolloutWorker(cfg.model.path, cfg.rollout, cfg.data)
    backend = build_backend(cfg.model.path, cfg.train, temperature=cfg.rollout.temperature or 1.0)
    reward_fn = resolve_reward_fn(cfg.rollout.reward)
    store = RolloutStore(cfg.store.root)
    out: dict = {"iteration_s": [], "metrics": [], "artifact_s": [], "parity_s": []}
    for rollout_id in range(count):
        start = time.perf_counter()
        samples = score_samples(worker.rollout(rollout_id), reward_fn, reward_key=cfg.rollout.reward_key)
        result = train_on_samples(
            backend,
            samples,
            cfg.algo,
            group_size=cfg.rollout.n_samples_per_prompt,
            compute_ref=cfg.train.compute_ref_log_probs,
        )
        worker.update_weights(backend.named_weights(), rollout_id + 1)
        out["iteration_s"].append(time.perf_counter() - start)
        out["metrics"].append(result.metrics)
        # What rl_iteration adds on top, timed here on their own: artifact round trip, parity check.
        t0 = time.perf_counter()
        store.write(
            cfg.run + "-bare",
            "train",
            rollout_id,
            samples,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            engine=EngineInfo(backend="hf", model=cfg.model.path, weight_version=rollout_id),
            config_hash=cfg.config_hash(),
        )
        store.load(cfg.run + "-bare", "train", rollout_id)
        t1 = time.perf_counter()
        compare(checksums(backend.named_weights()), worker.weight_checksums())
        out["artifact_s"].append(t1 - t0)
        out["parity_s"].append(time.perf_counter() - t1)
    return out


def heartbeats(enabled: bool):
    """Prefect flow-run heartbeats on (the default, every 180 s) or off for the flow runs started inside.

    The heartbeat thread sleeps in 1 s steps and a flow run joins it at exit, so every flow run's
    exit waits for the current 1 s step to end: 0-1 s per rl_iteration run, whatever its length.
    """
    import contextlib

    if enabled:
        return contextlib.nullcontext()
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    return temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None})


def flow_loop(cfg, *, with_heartbeats: bool = True, inline_iterations: bool = False) -> dict:
    """rl_train(cfg), timed per iteration. The design alternative, applied by patching for the run:
    - `inline_iterations`: each iteration's body runs as a plain function inside the rl_train flow
      run (its tasks stay Prefect task runs) instead of as an rl_iteration sub-flow run.
    (The Sample lists handed to the reward and persist tasks are `quote()`d by flows/iteration.py
    itself since this suite measured what Prefect's walk over them costs.)"""
    import contextlib

    import rollflow.flows.train as train_mod
    from rollflow.flows import reporting
    from rollflow.flows.reporting import read_metrics
    from rollflow.flows.train import rl_train

    stamps: dict[int, float] = {}

    def hook(name: str, iteration, line) -> None:
        if name == "start" and iteration is not None and iteration not in stamps:
            stamps[iteration] = time.perf_counter()

    token = reporting.STAGE_HOOK.set(hook)
    start = time.perf_counter()
    with contextlib.ExitStack() as patches:
        if inline_iterations:
            from rollflow.flows.iteration import rl_iteration

            patches.enter_context(_patched(train_mod, "run_iteration", rl_iteration.fn))
        patches.enter_context(heartbeats(with_heartbeats))
        try:
            rl_train(cfg)
        finally:
            reporting.STAGE_HOOK.reset(token)
    total = time.perf_counter() - start
    its = sorted(stamps)
    intervals = {it: stamps[it + 1] - stamps[it] for it in its if it + 1 in stamps}
    rows = {row["rollout_id"]: row for row in read_metrics(cfg)}
    return {"total_s": total, "setup_s": stamps[its[0]] - start if its else None, "interval_s": intervals, "rows": rows}


class _patched:
    def __init__(self, module, name: str, value):
        self.module, self.name, self.value = module, name, value

    def __enter__(self):
        self.old = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.old)


# A flow shaped like rl_iteration with nothing inside: Prefect's own floor per iteration.
def _floor_flows():
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE

    @task(name="noop", cache_policy=NO_CACHE)
    def noop(x: int) -> int:
        return x

    @flow(name="bench_empty_iteration")
    def empty_iteration(i: int) -> int:
        for _ in range(6):  # generate, reward, persist, train, sync, checkpoint
            noop(i)
        return i

    @flow(name="bench_empty_train")
    def empty_train(count: int) -> list[float]:
        stamps = []
        for i in range(count):
            stamps.append(time.perf_counter())
            empty_iteration(i)
        stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps, stamps[1:])]

    @flow(name="bench_tasks_only")
    def tasks_only(count: int) -> list[float]:
        stamps = []
        for i in range(count):
            stamps.append(time.perf_counter())
            for _ in range(6):
                noop(i)
        stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps, stamps[1:])]

    return empty_train, tasks_only


def _task_argument_cost(n_samples: int, repeats: int) -> dict[str, list[float]]:
    """What a Prefect task call costs when a rollout's Samples are its argument, plain vs quote()d."""
    from prefect import flow, task
    from prefect.cache_policies import NO_CACHE
    from prefect.utilities.annotations import quote

    from benchmarks.models import synthetic_samples

    @task(name="noop-samples", cache_policy=NO_CACHE)
    def take(samples) -> int:
        return len(samples)

    @flow(name="bench_task_argument")
    def measure(n: int, count: int) -> dict[str, list[float]]:
        samples = synthetic_samples(n, 9, 5, 15)  # an addition rollout: ~9 prompt + ~5 response tokens
        out: dict[str, list[float]] = {"plain": [], "quoted": []}
        for _ in range(count + 1):
            for key, arg in (("plain", lambda: samples), ("quoted", lambda: quote(samples))):
                t0 = time.perf_counter()
                take(arg())
                out[key].append(time.perf_counter() - t0)
        return {k: v[1:] for k, v in out.items()}

    return measure(n_samples, repeats)


def run(ctx: BenchContext) -> SuiteResult:
    res = SuiteResult("orchestration", TITLE)
    api = ctx.services.prefect()
    ctx.services.ray()
    threads_before = torch.get_num_threads()
    sizes = sizes_for(ctx)
    res.params = {
        "sizes": [f"{p}x{n}" for p, n, _ in sizes],
        "model": "builtin:addition",
        "flow_iterations": {f"{p}x{n}": k for p, n, k in sizes},
        "prefect_api": api,
        "prefect_server_start_s": ctx.services.prefect_start_s,
        "ray_init_s": ctx.services.ray_start_s,
        "threads": "rollout.threads = train.threads = 1 (RunConfig defaults) on both sides",
        "checkpoint_every": "= iterations (the bare loop writes no checkpoints)",
    }
    largest = sizes[-1]
    headline = None
    try:
        for prompts, n, k in sizes:
            label = f"{prompts}x{n}"
            cfg = _config(ctx, prompts, n, k)
            # Bare before and after the flow runs, averaged per rollout id: drift of a shared, noisy
            # box over the minutes in between hits both sides alike.
            bare = bare_loop(cfg, k - 1)
            flow = flow_loop(cfg)
            alts = {}
            if (prompts, n, k) == largest:
                alts["no sub-flow per iteration"] = flow_loop(
                    cfg.model_copy(update={"run": cfg.run + "-alt"}), inline_iterations=True
                )
            again = bare_loop(cfg.model_copy(update={"run": cfg.run + "-again"}), k - 1)
            bare["iteration_s"] = [(a + b) / 2 for a, b in zip(bare["iteration_s"], again["iteration_s"])]
            ids = [rid for rid in range(1, k - 1) if (rid + 1) in flow["interval_s"]]
            bare_s = [bare["iteration_s"][rid] for rid in ids]
            flow_s = [flow["interval_s"][rid + 1] for rid in ids]
            over_s = [f - b for f, b in zip(flow_s, bare_s)]
            res.add(f"{label} bare iteration", "s", bare_s)
            res.add(f"{label} rl_train iteration", "s", flow_s)
            res.add(f"{label} overhead per iteration", "s", over_s)
            is_largest = (prompts, n, k) == largest
            fig = res.ratio(
                f"{label} overhead / rl_train iteration",
                [o / f for o, f in zip(over_s, flow_s)],
                unit="fraction",
                goal=GOAL if is_largest else None,
                note="paired by rollout id",
            )
            if is_largest:
                headline = fig
            res.add(f"{label} artifact write + read (in bare process)", "s", bare["artifact_s"][1:])
            res.add(f"{label} parity check (in bare process)", "s", bare["parity_s"][1:])
            if flow["setup_s"] is not None:
                res.add(
                    f"{label} rl_train start until iteration 1",
                    "s",
                    [flow["setup_s"]],
                    note="Ray actors start, model loads, flow run creation",
                )
            same = [_same(bare["metrics"][rid], flow["rows"].get(rid, {})) for rid in range(k - 1)]
            res.notes.append(
                f"{label}: bare and flow metrics identical for rollout ids 0..{k - 2}: {all(same)} "
                f"({sum(same)}/{len(same)})"
            )
            if is_largest and over_s:
                med = statistics.median(over_s)
                res.add(
                    "iteration length at which the overhead is 2%",
                    "s",
                    [o / 0.02 for o in over_s],
                    note=f"median fixed overhead {med:.2f} s per iteration / 0.02",
                )
                for vname, alt in alts.items():
                    ids_q = [rid for rid in ids if (rid + 1) in alt["interval_s"]]
                    q_s = [alt["interval_s"][rid + 1] for rid in ids_q]
                    q_over = [q - bare["iteration_s"][rid] for q, rid in zip(q_s, ids_q)]
                    res.add(
                        f"{label} rl_train iteration, {vname}",
                        "s",
                        q_s,
                        note="design alternative, patched for the run (see flow_loop)",
                    )
                    res.add(f"{label} overhead per iteration, {vname}", "s", q_over)
                    res.ratio(
                        f"{label} overhead / iteration, {vname}",
                        [o / q for o, q in zip(q_over, q_s)],
                        unit="fraction",
                        note="paired by rollout id",
                    )
                    same_alt = all(_same(bare["metrics"][rid], alt["rows"].get(rid, {})) for rid in range(k - 1))
                    res.notes.append(f"{label} {vname}: metrics identical to the bare loop: {same_alt}")
        samples_arg = _task_argument_cost(sizes[-1][0] * sizes[-1][1], 3 if ctx.quick else 5)
        res.add(
            "no-op task taking the rollout's Samples",
            "s",
            samples_arg["plain"],
            note=f"{sizes[-1][0] * sizes[-1][1]} Samples of a builtin:addition rollout's length",
        )
        res.add("no-op task taking the Samples quote()d", "s", samples_arg["quoted"])
        empty_train, tasks_only = _floor_flows()
        count = 4 if ctx.quick else 8
        floor = empty_train(count)[1:]
        res.add(
            "empty rl_iteration-shaped sub-flow (6 no-op tasks)",
            "s",
            floor,
            note="Prefect's floor per iteration: flow run create/exit + 6 task runs",
        )
        with heartbeats(False):
            floor_quiet = empty_train(count)[1:]
        res.add(
            "empty rl_iteration-shaped sub-flow, heartbeats off",
            "s",
            floor_quiet,
            note="PREFECT_FLOWS_HEARTBEAT_FREQUENCY unset: no 1 s join at exit, but creating the next flow run "
            "then waits on the server",
        )
        tasks = tasks_only(count)[1:]
        res.add("6 no-op task runs without a sub-flow", "s", tasks)
        res.ratio(
            "sub-flow run share of the floor",
            [1 - t / f for t, f in zip(tasks, floor)],
            unit="fraction",
            note="what one flow run per iteration costs beyond its tasks",
        )
        if headline is not None:
            over = res.figure(f"{largest[0]}x{largest[1]} overhead per iteration")
            it = res.figure(f"{largest[0]}x{largest[1]} bare iteration")
            plain = statistics.median(samples_arg["plain"])
            headline.limit = (
                f"~{over.median:.1f} s per iteration against a {it.median:.1f} s CPU iteration: Prefect walks every "
                f"token of the Samples handed to the reward and persist tasks ({plain:.2f} s per call, "
                f"{statistics.median(samples_arg['quoted']):.3f} s quote()d), and the rl_iteration sub-flow run "
                f"costs {statistics.median(floor):.2f} s empty (its 6 tasks alone {statistics.median(tasks):.3f} s; "
                f"the exit joins Prefect's heartbeat thread, which sleeps in 1 s steps)"
            )
    finally:
        torch.set_num_threads(threads_before)
    return res


def _same(bare: dict, flow: dict) -> bool:
    keys = ("rollout/raw_reward", "train/loss", "train/grad_norm")
    return all(k in flow and bare.get(k) == flow.get(k) for k in keys)

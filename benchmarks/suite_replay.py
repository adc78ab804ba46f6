"""Suite 6: `rollflow replay` from process start to its first train step, vs one full iteration.

A source rollout (256 prompts x 8 samples by default) is generated once and committed. Each repeat
launches `python -m rollflow.flows.cli replay --ids 0 --no-cache` as a fresh process against the benchmark's
Prefect server and times, from the launch, the moment its first train step has finished (the replay
state file appears) and the process exit. The reference iteration is rl_train's, from the
orchestration suite when it ran in this command, else a bare-loop iteration measured here.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
import uuid

from benchmarks.core import REPO, BenchContext, SuiteResult

TITLE = "replay: `rollflow replay` start -> first train step vs one iteration"


def run(ctx: BenchContext) -> SuiteResult:
    from benchmarks.suite_orchestration import _config

    res = SuiteResult("replay", TITLE)
    api = ctx.services.prefect()
    prompts, n = (64, 4) if ctx.quick else (256, 8)
    repeats = ctx.n(3, 2)
    cfg = _config(ctx, prompts, n, iterations=2)
    root = str(ctx.workdir / "replay")
    cfg = cfg.model_copy(update={"store": cfg.store.model_copy(update={"root": root})})
    res.params = {
        "size": f"{prompts}x{n}",
        "repeats": repeats,
        "prefect_api": api,
        "command": "python -m rollflow.flows.cli replay --source-run SRC --ids 0 --no-cache",
    }

    # The source rollout, and a bare iteration of the same size as a fallback reference.
    bare = _source_rollout(cfg)
    env = {**os.environ, "PREFECT_API_URL": api, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import rollflow.flows.cli, rollflow.flows.debug, torch, transformers"],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    import_s = time.perf_counter() - t0

    first, total = [], []
    for _i in range(repeats):
        run_name = f"replay-{uuid.uuid4().hex[:6]}"
        cmd = [
            sys.executable,
            "-m",
            "rollflow.flows.cli",
            "replay",
            "--source-run",
            cfg.run,
            "--ids",
            "0",
            "--no-cache",
            "--set",
            f"run={run_name}",
            "--set",
            f"store.root={root}",
            "--set",
            f"data.prompts_per_rollout={prompts}",
            "--set",
            f"rollout.n_samples_per_prompt={n}",
        ]
        pattern = os.path.join(root, run_name, "replay_states", "*", "trainer.pt")
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        seen = None
        while proc.poll() is None:
            if seen is None and glob.glob(pattern):
                seen = time.perf_counter() - start
            time.sleep(0.02)
        done = time.perf_counter() - start
        output = proc.stdout.read().decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"rollflow replay failed (exit {proc.returncode}):\n{output[-3000:]}")
        if seen is None and glob.glob(pattern):
            seen = done
        first.append(seen if seen is not None else done)
        total.append(done)

    orch = ctx.results.get("orchestration")
    ref_fig = orch.figure(f"{prompts}x{n} rl_train iteration") if orch is not None else None
    res.add(
        "replay start -> first train step done",
        "s",
        first,
        note="new process: imports, Prefect flow run, Ray start, trainer actor, artifact load, train",
    )
    res.add("replay process wall time", "s", total)
    res.add("python imports of the CLI (torch, transformers, prefect)", "s", [import_s])
    res.add("bare iteration (same size)", "s", bare)
    if ref_fig is not None and ref_fig.values:
        res.ratio(
            "first train step / rl_train iteration",
            [f / ref_fig.median for f in first],
            note=f"rl_train iteration median {ref_fig.median:.2f} s from the orchestration suite",
        )
    res.ratio("first train step / bare iteration", [f / statistics_median(bare) for f in first])
    return res


def _source_rollout(cfg) -> list[float]:
    """Commit rollout 0 of `cfg.run` (what `rollflow rollout` would write); returns bare iteration times."""
    import torch

    from benchmarks.suite_orchestration import bare_loop
    from rollflow.artifacts.manifest import EngineInfo
    from rollflow.artifacts.store import RolloutStore
    from rollflow.tasks.rollout.rewards import resolve_reward_fn, score_samples
    from rollflow.tasks.rollout.worker import RolloutWorker

    threads = torch.get_num_threads()
    try:
        worker = RolloutWorker(cfg.model.path, cfg.rollout, cfg.data)
        samples = score_samples(
            worker.rollout(0), resolve_reward_fn(cfg.rollout.reward), reward_key=cfg.rollout.reward_key
        )
        RolloutStore(cfg.store.root).write(
            cfg.run,
            "train",
            0,
            samples,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            engine=EngineInfo(backend="hf", model=cfg.model.path, weight_version=0),
            config_hash=cfg.config_hash(),
        )
        return bare_loop(cfg, 2)["iteration_s"][1:]
    finally:
        torch.set_num_threads(threads)


def statistics_median(values: list[float]) -> float:
    import statistics

    return statistics.median(values)

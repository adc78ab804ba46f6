"""Stall detection's cost per iteration on the demo (issue 35, acceptance 6: at most 2% of an iteration).

    python -m benchmarks.watchdog_cost [--quick] [--pairs 8]   # table, JSON + .md in benchmarks/results/
    python -m benchmarks --suite watchdog                    # as one suite of the others

Two measurements, one process, one engine and one trainer (the demo's config: `rollflow train`'s defaults, probe
and mismatch trend off so only the deadline differs):

1. Paired (load-sensitive). Iterations alternate `watchdog.stall_s=600` (on) and `0` (off) on the same actors, in
   pairs ordered on-off, off-on, on-off, ... so that a drift in the box's load hits both sides of a pair alike and
   neither side always runs second. The figure is the median of the per-pair ratios (on / off) and their spread.
   The first pair warms up and is left out. On a shared 2-core box the spread stays wide.
2. Direct (load-robust). What the deadline does, counted per watched iteration: worker progress ticks (read from
   the actors' counters), watched waits (one `ray.wait` more than `ray.get`), lookups of the awaited actors, and
   progress polls (one control-group call per awaited actor per slice: the driver's submit and wait plus the
   actor's own handling). Each count times that operation's CPU cost, measured here on the idle actors in CPU
   seconds (the driver's process time, the actor's /proc stat, less an idle baseline of the same length), over
   that iteration's wall time. CPU time barely moves with other jobs on the box, and polls scale with the wall
   time they sit in, so this fraction is the figure to trust.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks.core import REPO, BenchContext, Goal, SuiteResult

TITLE = "stall detection: watchdog on / off, paired iterations, and its direct CPU cost"
GOAL = Goal("<=", 0.02, "<= 2% of the iteration")
ON_S = 600.0  # the default watchdog.stall_s
UNIT_CALLS = 500  # calls per unit-cost measurement
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _config(root: str, run: str, prompts: int, stall_s: float):
    from rollflow.flows.config import RunConfig

    return RunConfig.model_validate(
        {
            "run": run,
            "iterations": 100_000,  # never the last: no checkpoint and no run end inside the measurement
            "checkpoint_every": 100_000,
            "store": {"root": root},
            "data": {"prompts_per_rollout": prompts},
            "watchdog": {"stall_s": stall_s, "probe_every": 0, "trend_window": 0},
        }
    )


def _proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (an actor on this node) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _run_actors(run: str) -> list[dict[str, Any]]:
    from ray._private import state

    return [
        r
        for r in state.actors().values()
        if r.get("State") == "ALIVE" and str(r.get("Name") or "").startswith(f"{run}:")
    ]


class Counts:
    """What the deadline does in this process, counted by wrapping its functions (product code unchanged)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n: Counter[str] = Counter()

    def add(self, key: str, k: int = 1) -> None:
        with self.lock:
            self.n[key] += k

    def take(self) -> Counter[str]:
        with self.lock:
            out, self.n = self.n, Counter()
        return out


@contextlib.contextmanager
def counting(counts: Counts) -> Iterator[None]:
    from rollflow.infra import deadline

    originals = (deadline.wait, deadline._watched, deadline._Watched.poll)

    def wait(refs, timeout=None):
        watch = deadline.WATCH.get()
        if watch is not None and watch.stall_s > 0:
            counts.add("watched_waits")
        return originals[0](refs, timeout)

    def watched(refs, now):
        out = originals[1](refs, now)
        counts.add("lookups", len(out))
        return out

    def poll(self, now):
        counts.add("polls")
        return originals[2](self, now)

    deadline.wait, deadline._watched, deadline._Watched.poll = wait, watched, poll
    try:
        yield
    finally:
        deadline.wait, deadline._watched, deadline._Watched.poll = originals


def _cpu_of(fn: Callable[[], None], calls: int, pids: list[int]) -> tuple[float, float]:
    """(driver, actors) CPU seconds per call of `fn`, each less an idle baseline of the same wall time."""

    def window(body: Callable[[], None]) -> tuple[float, float, float]:
        wall, own, act = time.perf_counter(), time.process_time(), sum(_proc_cpu_s(p) for p in pids)
        body()
        return (
            time.perf_counter() - wall,
            time.process_time() - own,
            sum(_proc_cpu_s(p) for p in pids) - act,
        )

    def run() -> None:
        for _ in range(calls):
            fn()

    wall, own, act = window(run)
    _, idle_own, idle_act = window(lambda: time.sleep(wall))
    return max(0.0, own - idle_own) / calls, max(0.0, act - idle_act) / calls


def unit_costs(run: str, repeats: int = 3) -> dict[str, float]:
    """CPU seconds of each counted operation, median of `repeats`, on the run's idle actors."""
    import ray

    from rollflow.infra import deadline
    from rollflow.infra.workers import CONTROL, NAMESPACE
    from rollflow.tasks.progress import Progress

    rows = _run_actors(run)
    pids = [int(r["Pid"]) for r in rows]
    handle = ray.get_actor(rows[0]["Name"], namespace=NAMESPACE)
    ready = handle.progress.options(concurrency_group=CONTROL).remote()
    ray.get(ready)
    watched = deadline._Watched(rows[0]["Name"], rows[0]["ActorID"], pids[0], handle, time.monotonic())

    def poll() -> None:  # one slice of the deadline loop: poll (answer of the last probe, a new probe), then wait
        watched.poll(time.monotonic())
        ray.wait([watched.probe], timeout=ON_S)

    counter = Progress()
    samples: dict[str, list[float]] = {k: [] for k in ("tick", "poll_driver", "poll_actor", "lookup", "watched_wait")}
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(100_000):
            counter.tick()
        samples["tick"].append((time.process_time() - start) / 100_000)
        driver, actor = _cpu_of(poll, UNIT_CALLS, pids)
        samples["poll_driver"].append(driver)
        samples["poll_actor"].append(actor)
        samples["lookup"].append(_cpu_of(lambda: deadline._watched([ready], time.monotonic()), UNIT_CALLS, [])[0])
        # what a watched wait adds to a plain ray.get: its first slice's ray.wait on the awaited refs
        samples["watched_wait"].append(
            _cpu_of(lambda: ray.wait([ready], num_returns=1, timeout=1.0), UNIT_CALLS, [])[0]
        )
    return {k: statistics.median(v) for k, v in samples.items()}


def _progress_total(run: str) -> int:
    import ray

    from rollflow.infra.workers import CONTROL, NAMESPACE

    refs = [
        ray.get_actor(r["Name"], namespace=NAMESPACE).progress.options(concurrency_group=CONTROL).remote()
        for r in _run_actors(run)
    ]
    return sum(int(v) for v in ray.get(refs))


def measure(root: str, prompts: int, pairs: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The paired iterations and the unit costs; raw numbers (the suite and the CLI summarise them)."""
    from rollflow.flows.actor_calls import stop_and_wait
    from rollflow.flows.group import WorkerGroup, connect_ray
    from rollflow.flows.iteration import rl_iteration

    run = f"wdcost-{uuid.uuid4().hex[:6]}"
    on, off = _config(root, run, prompts, ON_S), _config(root, run, prompts, 0.0)
    connect_ray(on)
    group = WorkerGroup.for_run(on)
    stop_and_wait(group)
    counts = Counts()
    rows: list[dict[str, Any]] = []
    try:
        group.start_placement()
        group.start_trainer(None)
        group.start_critic(None)
        group.start_engine(None)
        pids = [int(r["Pid"]) for r in _run_actors(run)]
        rollout_id = 0
        with counting(counts):
            for pair in range(pairs + 1):  # pair 0: warm-up
                order = [(True, on), (False, off)] if pair % 2 == 0 else [(False, off), (True, on)]
                for watchdog, cfg in order:
                    ticks0, wall0 = _progress_total(run), time.perf_counter()
                    cpu0 = time.process_time() + sum(_proc_cpu_s(p) for p in pids)
                    counts.take()
                    rl_iteration(cfg, rollout_id)
                    wall = time.perf_counter() - wall0
                    cpu = time.process_time() + sum(_proc_cpu_s(p) for p in pids) - cpu0
                    row = {"pair": pair, "watchdog": watchdog, "rollout_id": rollout_id, "wall": wall, "cpu": cpu}
                    row.update(counts.take(), ticks=_progress_total(run) - ticks0)
                    rows.append(row)
                    log(f"[watchdog] pair {pair} {'on ' if watchdog else 'off'}: {row}")
                    rollout_id += 1
        units = unit_costs(run)
    finally:
        stop_and_wait(group)
    return {"run": run, "prompts": prompts, "pairs": pairs, "iterations": rows, "unit_cpu_s": units}


def direct_fraction(row: dict[str, Any], units: dict[str, float]) -> float:
    """CPU the deadline spends in one watched iteration over the iteration's wall time."""
    cpu = (
        row.get("ticks", 0) * units["tick"]
        + row.get("polls", 0) * (units["poll_driver"] + units["poll_actor"])
        + row.get("lookups", 0) * units["lookup"]
        + row.get("watched_waits", 0) * units["watched_wait"]
    )
    return cpu / row["wall"]


def summarise(raw: dict[str, Any], res: SuiteResult) -> SuiteResult:
    rows = [r for r in raw["iterations"] if r["pair"] > 0]
    units = raw["unit_cpu_s"]
    by_pair: dict[int, dict[bool, dict]] = {}
    for r in rows:
        by_pair.setdefault(r["pair"], {})[r["watchdog"]] = r
    paired = [p[True]["wall"] / p[False]["wall"] for p in by_pair.values() if True in p and False in p]
    watched = [r for r in rows if r["watchdog"]]
    res.params = {
        "config": "the demo (`rollflow train` defaults, builtin:addition), probe and mismatch trend off",
        "prompts_per_rollout": raw["prompts"],
        "pairs": raw["pairs"],
        "stall_s": {"on": ON_S, "off": 0.0},
        "order": "pairs alternate on-off / off-on; pair 0 (warm-up) left out",
        "iterations": raw["iterations"],
        "unit_cpu_s": units,
    }
    res.ratio(
        "direct cost / iteration (watched iterations)",
        [direct_fraction(r, units) for r in watched],
        goal=GOAL,
        unit="fraction",
        note="(ticks x tick + polls x (driver + actor poll) + lookups x lookup + watched waits x one ray.wait) CPU "
        "over the iteration's wall time; unit costs measured on the idle actors, less an idle baseline",
    )
    res.ratio(
        "paired iteration time, on / off",
        paired,
        goal=Goal("<=", 1.02),
        note="median of per-pair ratios, consecutive iterations on the same actors; load on the box widens the spread",
        limit="wall times on a shared box: other jobs' load swings single iterations by more than the effect",
    )
    res.ratio("CPU per iteration, on / off (paired)", [p[True]["cpu"] / p[False]["cpu"] for p in by_pair.values()])
    for key in ("ticks", "polls", "lookups", "watched_waits"):
        res.add(f"{key} per watched iteration", "count", [r.get(key, 0) for r in watched])
    res.notes.append(
        "Quote the ratios; absolute CPU times are from a shared CPU box (the project quotes absolute times from the "
        "GPU only)."
    )
    return res


def run(ctx: BenchContext) -> SuiteResult:
    """The `watchdog` suite of `python -m benchmarks`."""
    ctx.services.prefect()
    ctx.services.ray()
    prompts = 32 if ctx.quick else 256
    pairs = ctx.n(8, 2)
    raw = measure(str(ctx.workdir / "watchdog"), prompts, pairs, log=lambda s: print(s, file=sys.stderr))
    return summarise(raw, SuiteResult("watchdog", TITLE))


def markdown(report: dict[str, Any]) -> str:
    """The suite's figures as a markdown table (kept next to the JSON in benchmarks/results/)."""
    suite = report["suites"]["watchdog"]
    lines = [
        f"# {suite['title']}",
        "",
        f"`{report['command']}` at {report['created_at']}, git {str(report['git_sha'])[:10]}, "
        f"{report['machine']['cpu']} ({report['machine']['cpu_count']} cores, shared)",
        "",
        "| figure | median | min | max | n | goal | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in suite["figures"]:
        fmt = (lambda v: f"{100 * v:.3f}%") if f["unit"] == "fraction" else (lambda v: f"{v:.4g}")
        goal = f.get("goal", {}).get("text", "")
        met = {True: "yes", False: "no"}.get(f.get("meets_goal"), "")
        lines.append(
            f"| {f['name']} | {fmt(f['median'])} | {fmt(f['min'])} | {fmt(f['max'])} | {f['n']} | {goal} | {met} |"
        )
    return "\n".join(lines + ["", *suite.get("notes", [])]) + "\n"


def main(argv: list[str] | None = None) -> int:
    import json

    from benchmarks.cli import main as bench_main

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pairs", type=int, default=None, help="paired iterations after the warm-up pair (default 8)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    stamp = _dt.date.today().isoformat()
    out = args.out or REPO / "benchmarks" / "results" / f"cpu-{stamp}-watchdog-paired.json"
    cli = ["--suite", "watchdog", "--device", "cpu", "--out", str(out)]
    cli += ["--quick"] if args.quick else []
    cli += ["--repeats", str(args.pairs)] if args.pairs else []
    rc = bench_main(cli)
    out.with_suffix(".md").write_text(markdown(json.loads(out.read_text())))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())

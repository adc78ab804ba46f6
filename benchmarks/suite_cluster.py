"""Suite 9: the production topology's costs (issue "The production topology, exercised").

On the cluster of `python -m rollflow.infra.cluster up` (PostgreSQL + Prefect server, a process work pool whose
worker lives on the Ray head, three Ray nodes, S3), or one already up (`--cluster-state DIR`):

- **Prefect's cost per iteration, PostgreSQL vs SQLite**: an rl_iteration-shaped flow run with nothing inside
  (flow run create/exit + 6 task runs, the floor of suite 1) against the cluster's PostgreSQL-backed server and
  against a local SQLite-backed one, in fresh processes alternated PG/SQLite, SQLite/PG, ... so box load hits
  both; quoted as the ratio PG / SQLite per pair.
- **Cold start** of a 1-iteration rl_train created from its pool deployment (the UI's Run call): from the API
  call to the start of the first generate task, split into the worker's pickup + flow process start, the
  run's own start (Ray driver, actors on their nodes) and the rest; quoted as fractions of the cold start and
  as a ratio to one steady iteration of the same run shape.
- **Node loss to resumed iteration**: drill a (tests/test_cluster.py) timed: the raylet of the engine's node
  killed right after checkpoint 1, the run fails, the node is started again, the run is retried from the UI
  (AwaitingRetry) and resumes; the time from the kill to the commit of the first resumed iteration's
  checkpoint, split into detection (kill -> Failed), the node's restart and the resume (Retry -> checkpoint).

Times on a 2-core CPU box are raw data in the JSON; the table quotes ratios (the project's rule: absolute
times only from the GPU). Needs root for the namespaces (loopback addresses otherwise), PostgreSQL and Ray.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.core import BenchContext, SuiteResult

TITLE = "cluster: Prefect on PostgreSQL vs SQLite, cold start, node loss -> resumed iteration"

SMALL = {
    "data": {"prompts_per_rollout": 8},
    "rollout": {"n_samples_per_prompt": 2, "threads": 1},
    "train": {"threads": 1},
}


def _cluster(ctx: BenchContext, res: SuiteResult):
    """(cluster, owned): the one named by --cluster-state / ROLLFLOW_BENCH_CLUSTER, else a new one (owned)."""
    from rollflow.infra import cluster as cl

    state = ctx.options.get("cluster_state") or os.environ.get("ROLLFLOW_BENCH_CLUSTER")
    if state:
        return cl.Cluster.load(state), False
    up = cl.up(ctx.workdir / "cluster")
    res.params["cluster_up_s"] = up.up_s
    return up, True


def _params(cluster, run: str, iterations: int, resources: dict, **extra) -> dict[str, Any]:
    return {
        "params": {
            "run": run,
            "iterations": iterations,
            **cluster.run_params(),
            "placement": "disaggregated",
            "resources": resources,
            **SMALL,
            **extra,
        }
    }


def _resources() -> dict[str, Any]:
    """Disaggregated: the trainer and the engine on one fake GPU each, so on different nodes of the cluster."""
    from rollflow.infra.cluster import GPU_RESOURCE

    return {"num_gpus": 2, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1, "gpu_resource": GPU_RESOURCE}


def _submit(client, parameters: dict) -> Any:
    dep = client.read_deployment_by_name("rl_train/pool")
    return client.create_flow_run_from_deployment(dep.id, parameters=parameters)


def _wait_final(client, flow_run_id, timeout: float = 600) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state is not None and run.state.is_final():
            return run
        if time.monotonic() > deadline:
            raise TimeoutError(f"flow run {run.name} still {run.state.name if run.state else None}")
        time.sleep(0.5)


def _iteration_tasks(client, run: str, rollout_id: int) -> list[Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    children = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"{run}/iter-{rollout_id:04d}"]))
    )
    if not children:
        return []
    return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[c.id for c in children])))


def _task_start(tasks: list[Any], prefix: str) -> float | None:
    starts = [t.start_time.timestamp() for t in tasks if t.name.startswith(prefix) and t.start_time]
    return min(starts) if starts else None


# ----------------------------------------------------------------------------- PostgreSQL vs SQLite


def floor_child(iterations: int) -> None:
    """(In a fresh process whose PREFECT_API_URL is the server to measure.) Prints the per-iteration times of an
    empty rl_iteration-shaped flow as JSON. A process per side: Prefect's events client binds to the first API
    URL of its process, so switching servers inside one process sends task-run events to the wrong one."""
    import json

    from benchmarks.suite_orchestration import _floor_flows

    empty_train, _ = _floor_flows()
    print("FLOOR " + json.dumps(empty_train(iterations)))


def _floor(api: str, iterations: int) -> list[float]:
    import json
    import subprocess
    import sys

    from benchmarks.core import REPO

    code = f"from benchmarks.suite_cluster import floor_child; floor_child({iterations})"
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FLOOR ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"floor run against {api} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return [float(v) for v in json.loads(line[len("FLOOR ") :])]


def prefect_cost(ctx: BenchContext, res: SuiteResult, cluster) -> None:
    sqlite_api = ctx.services.prefect()
    per_iteration = ctx.n(10, 5)
    pairs = ctx.n(4, 2)
    pg: list[float] = []
    sqlite: list[float] = []
    for i in range(pairs):
        # alternate which side goes first, so a drift of the box's load over a pair hits both alike
        order = [("pg", cluster.prefect_api), ("sqlite", sqlite_api)]
        for side, api in order if i % 2 == 0 else order[::-1]:
            value = statistics.median(_floor(api, per_iteration)[1:])  # the first iteration warms the process up
            (pg if side == "pg" else sqlite).append(value)
    res.ratio(
        "prefect_iteration_pg_over_sqlite",
        [a / b for a, b in zip(pg, sqlite)],
        note=f"an empty rl_iteration-shaped flow run (create/exit + 6 task runs), median of {per_iteration - 1} "
        f"iterations per side, {pairs} pairs of fresh processes (PG first, then SQLite first, ...)",
    )
    res.add("prefect_iteration_pg_s", "s", pg, note="2-core CPU box: raw data, not a performance claim")
    res.add("prefect_iteration_sqlite_s", "s", sqlite, note="2-core CPU box: raw data, not a performance claim")


# ----------------------------------------------------------------------------- cold start


def cold_start(ctx: BenchContext, res: SuiteResult, cluster) -> None:
    from prefect.client.orchestration import get_client

    totals, pickup, startup, iteration = [], [], [], []
    with get_client(sync_client=True) as client:
        for _ in range(ctx.n(3, 1)):
            run = f"bench-cold-{uuid.uuid4().hex[:6]}"
            t0 = time.time()
            created = _submit(client, _params(cluster, run, 2, _resources(), checkpoint_every=2))
            final = _wait_final(client, created.id)
            if final.state.name != "Completed":
                raise RuntimeError(f"cold-start run {run} ended {final.state.name}: {final.state.message}")
            first = _task_start(_iteration_tasks(client, run, 0), "generate-train")
            second = _task_start(_iteration_tasks(client, run, 1), "generate-train")
            if first is None or second is None or final.start_time is None:
                raise RuntimeError(f"cold-start run {run}: no generate task runs found")
            totals.append(first - t0)
            pickup.append(final.start_time.timestamp() - t0)
            startup.append(first - final.start_time.timestamp())
            iteration.append(second - first)
    res.add("cold_start_s", "s", totals, note="submit -> first generate starts; 2-core CPU box: raw data")
    res.ratio(
        "cold_start_over_iteration",
        [t / i for t, i in zip(totals, iteration)],
        note="cold start / one steady iteration of the same run (8 prompts x 2 samples, tiny model)",
    )
    res.ratio(
        "cold_start_share_worker_pickup",
        [p / t for p, t in zip(pickup, totals)],
        unit="share",
        note="API call -> flow run Running: the worker's poll + the flow process starting",
    )
    res.ratio(
        "cold_start_share_run_startup",
        [s / t for s, t in zip(startup, totals)],
        unit="share",
        note="flow run Running -> first generate: Ray driver, preflight, actors placed and started on their nodes",
    )


# ----------------------------------------------------------------------------- node loss


def node_loss(ctx: BenchContext, res: SuiteResult, cluster) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry
    from ray.util.state import list_actors

    from rollflow.infra import cluster as cl
    from rollflow.tasks.train.checkpoint import list_checkpoints

    run = f"bench-loss-{uuid.uuid4().hex[:6]}"
    extra = {"watchdog": {"stall_s": 10.0, "probe_every": 0}, "checkpoint_every": 1}
    with get_client(sync_client=True) as client:
        created = _submit(client, _params(cluster, run, 3, _resources(), **extra))
        deadline = time.monotonic() + 300
        while 1 not in list_checkpoints(cluster.store_root, run):
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run} never committed checkpoint 1")
            time.sleep(0.2)
        engine = next(
            a
            for a in list_actors(
                address=cluster.dashboard_url,
                filters=[("name", "=", f"{run}:engine"), ("state", "=", "ALIVE")],
                detail=True,
                raise_on_missing_output=False,
            )
        )
        engine = engine if isinstance(engine, dict) else engine.__dict__
        ip = next(n["node_ip"] for n in cl.ray_nodes(cluster) if n["node_id"] == engine["node_id"])
        host = next(h for h, addr in cluster.hosts.items() if addr == ip)
        killed = time.time()
        os.kill(cl.raylet_pid(cluster, host), signal.SIGKILL)
        first = _wait_final(client, created.id, timeout=300)
        failed = time.time()
        if first.state.name == "Completed":
            res.notes.append("node loss: the run completed without failing (the kill missed every call); no figure")
            return
        cl.start_node(cluster, host)
        restarted = time.time()
        client.set_flow_run_state(created.id, AwaitingRetry(message="Retry from the UI"), force=True)
        resumed_from = max(list_checkpoints(cluster.store_root, run))
        while resumed_from + 1 not in list_checkpoints(cluster.store_root, run):
            if time.monotonic() > deadline + 600:
                raise TimeoutError(f"run {run} never committed checkpoint {resumed_from + 1} after the retry")
            time.sleep(0.2)
        done = time.time()
        final = _wait_final(client, created.id)
    total = done - killed
    res.add("node_loss_to_resumed_iteration_s", "s", [total], note="kill -> first resumed checkpoint; raw data")
    res.ratio("node_loss_share_detection", [(failed - killed) / total], unit="share", note="kill -> run Failed")
    res.ratio("node_loss_share_node_restart", [(restarted - failed) / total], unit="share", note="ray start again")
    res.ratio("node_loss_share_resume", [(done - restarted) / total], unit="share", note="Retry -> checkpoint")
    res.params["node_loss"] = {
        "run": run,
        "host": host,
        "first_attempt": first.state.name,
        "final": final.state.name,
        "resumed_from_checkpoint": resumed_from,
    }


def run(ctx: BenchContext) -> SuiteResult:
    res = SuiteResult("cluster", TITLE)
    from rollflow.infra import cluster as cl

    missing = None
    try:
        for name in ("initdb", "postgres", "pg_isready"):
            cl.pg_bin(name)
    except cl.ClusterError as exc:
        missing = str(exc)
    if missing:
        res.unavailable["cluster"] = missing
        return res
    cluster, owned = _cluster(ctx, res)
    saved = {k: os.environ.get(k) for k in cluster.s3_env()}
    os.environ.update(cluster.s3_env())
    res.params.update({"mode": cluster.mode, "hosts": cluster.hosts, "prefect_db": "postgresql 15 vs sqlite"})
    try:
        prefect_cost(ctx, res, cluster)
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: cluster.prefect_api}):
            cold_start(ctx, res, cluster)
            node_loss(ctx, res, cluster)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if owned:
            cl.down(Path(cluster.state_dir))
    return res

"""The production topology, exercised (`pytest -m cluster`): hosts are network namespaces on a bridge (loopback
addresses without root), every service the real program (`python -m rollflow.infra.cluster up`):

- ctl: PostgreSQL 15 <- Prefect server; the S3 endpoint; head: `ray start --head` + `prefect worker --pool`;
  node1, node2: `ray start --address=head`, one `fake_gpu` each;
- a 3-iteration rl_train created from its pool deployment completes with engine and trainer on different Ray
  nodes (Ray's state API) and nothing written to a local store root; a colocated run puts both on one node;
- a local store.root with the multi-node cluster is refused in one line (exit 2) before any worker starts,
  from the CLI and from a pool run; a placement no node can hold fails in seconds naming what is missing.

Faults at cluster scale (issue 34), last in the module, each a run of 2-3 iterations of the tiny default model:

d. the S3 endpoint frozen ~20 s (SIGSTOP/SIGCONT: moto keeps its objects in memory, as a real store keeps them
   on disk) while a rollout's generate runs, so its persist starts against the frozen endpoint: the persist
   waits it out (botocore's timeouts and retries, then the task's own retries), nothing half visible, nothing
   lost, the run Completed;
c. the link of the node hosting the engine cut ~30 s mid-generate: the stall watchdog fails the call within a
   bounded time naming the engine's node, and the task retry after the link returns completes the run;
b. PostgreSQL restarted (8 s down) mid-run: the server answers 500 meanwhile, the clients (the worker and the flow
   run's process, PREFECT_CLIENT_RETRY_EXTRA_CODES=500 as docs/cluster.md says) retry, the run keeps going and
   ends Completed in its first attempt;
a. the raylet of the node hosting the engine killed (by pid) right after checkpoint 1: the run fails within a
   bound naming the dead node; the node
   is started again, the UI's Retry resumes the same flow run from its last checkpoint, no committed rollout is
   regenerated, and the final weights equal an uninterrupted run's.

All of it shares ONE cluster: `make test` hands whole files to xdist workers (`--dist loadfile`), and a second
module bringing up the same `rf-*` namespaces at the same time would fail. One cluster per module (~2 min to
bring up on 2 cores). `ROLLFLOW_TEST_CLUSTER=<state dir>` reuses a cluster
already up (`python -m rollflow.infra.cluster up --state-dir DIR`) instead.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from rollflow.artifacts.storage import open_fs
from rollflow.infra import cluster as cl
from rollflow.tasks.train.checkpoint import list_checkpoints, load_checkpoint
from tests.test_fault_drills import assert_nothing_half_visible

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

SMALL = {
    "data": {"prompts_per_rollout": 8},
    "rollout": {"n_samples_per_prompt": 2, "threads": 1},
    "train": {"threads": 1},
}
DISAGGREGATED = {
    "num_gpus": 2,
    "trainer_gpus": 1,
    "num_engines": 1,
    "gpus_per_engine": 1,
    "gpu_resource": cl.GPU_RESOURCE,
}
COLOCATED = {"num_gpus": 1, "trainer_gpus": 1, "num_engines": 1, "gpus_per_engine": 1, "gpu_resource": cl.GPU_RESOURCE}


def _missing_prerequisite() -> str | None:
    for name in ("initdb", "postgres", "pg_isready", "psql"):
        try:
            cl.pg_bin(name)
        except cl.ClusterError as exc:
            return str(exc)
    if shutil.which("ray", path=str(Path(sys.executable).parent)) is None and shutil.which("ray") is None:
        return "ray is not installed"
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reuse = os.environ.get("ROLLFLOW_TEST_CLUSTER")
    if reuse:
        yield cl.Cluster.load(reuse)
        return
    missing = _missing_prerequisite()
    if missing:
        pytest.skip(f"the cluster needs PostgreSQL and Ray: {missing}")
    state = tmp_path_factory.mktemp("cluster")
    up = cl.up(state)
    try:
        print(f"cluster up in {up.up_s:.0f}s: {up.timings}")
        yield up
    finally:
        cl.down(state)


@pytest.fixture(scope="module")
def api(cluster):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    saved = {k: os.environ.get(k) for k in cluster.s3_env()}
    os.environ.update(cluster.s3_env())  # this process reads the bucket to check what the run wrote
    try:
        with temporary_settings({PREFECT_API_URL: cluster.prefect_api}):
            yield cluster.prefect_api
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_from_pool(flow_name: str, parameters: dict, timeout: float = 420, queue: str | None = None):
    """Create a run from `<flow>/pool` (the UI's Run call), on work queue `queue` (the deployment's by default),
    and wait until it is final."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(f"{flow_name}/pool")
        run = client.create_flow_run_from_deployment(dep.id, parameters=parameters, work_queue_name=queue)
    return _wait_final(run.id, timeout)


def _logs(flow_run_id) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join(entry.message for entry in logs)


def _logs_with(flow_run_id, *needles: str, timeout: float = 20) -> str:
    """The run's logs once they hold every needle (the last batch reaches the API after the final state), or
    what there is after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        logs = _logs(flow_run_id)
        if all(n in logs for n in needles) or time.monotonic() > deadline:
            return logs
        time.sleep(1)


def _task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _task_names(flow_run_id) -> list[str]:
    return [t.name for t in _task_runs(flow_run_id)]


def _actor_nodes(cluster: cl.Cluster, run: str) -> dict[str, set[str]]:
    """Role -> node ids of the run's actors (alive or dead) through Ray's state API."""
    from ray.util.state import list_actors

    out: dict[str, set[str]] = {}
    for actor in list_actors(
        address=cluster.dashboard_url,
        filters=[("ray_namespace", "=", "rollflow")],
        detail=True,
        limit=10000,
        raise_on_missing_output=False,
    ):
        actor = actor if isinstance(actor, dict) else actor.__dict__
        name = actor.get("name") or ""
        if name.startswith(f"{run}:"):
            out.setdefault(name.split(":", 1)[1], set()).add(actor.get("node_id"))
    return out


def _node_ips(cluster: cl.Cluster) -> dict[str, str]:
    return {n["node_id"]: n["node_ip"] for n in cl.ray_nodes(cluster)}


def _local_files(cluster: cl.Cluster) -> list[str]:
    """Files a flow run could have written on the worker host: its working folder, Prefect's local result
    storage of the worker (and the flow processes it starts)."""
    roots = [Path(cluster.state_dir) / "worker", Path(cluster.state_dir) / "prefect-worker" / "storage"]
    return [str(p) for r in roots if r.exists() for p in r.rglob("*") if p.is_file()]


def _s3_ls(path: str) -> list[str]:
    fs, fs_path = open_fs(path)
    fs.invalidate_cache()
    return fs.ls(fs_path) if fs.exists(fs_path) else []


def _train_params(cluster: cl.Cluster, run: str, resources: dict, placement: str, iterations: int) -> dict:
    return {
        "params": {
            "run": run,
            "iterations": iterations,
            **cluster.run_params(),
            "placement": placement,
            "resources": resources,
            **SMALL,
        }
    }


def test_topology_is_up(cluster, api):
    nodes = cl.ray_nodes(cluster)
    ips = sorted(n["node_ip"] for n in nodes)
    assert ips == sorted(cluster.hosts[h] for h in ("head", *cl.WORKER_NODES))  # 3 nodes, distinct IPs
    assert sum(n["resources_total"].get(cl.GPU_RESOURCE, 0) for n in nodes) == 2
    status = cl.status(cluster.state_dir)
    assert status["prefect_healthy"] and all(status["alive"].values()), status
    assert cluster.database_url.startswith("postgresql+asyncpg://")


def test_disaggregated_rl_train_from_the_pool_spans_nodes_and_writes_only_to_s3(cluster, api):
    before = _local_files(cluster)
    t0 = time.monotonic()
    run = _run_from_pool("rl_train", _train_params(cluster, "cluster-dis", DISAGGREGATED, "disaggregated", 3))
    took = time.monotonic() - t0
    assert run.state.name == "Completed", _logs(run.id)
    print(f"3-iteration rl_train from the pool: {took:.1f}s")
    nodes = _actor_nodes(cluster, "cluster-dis")
    assert len(nodes["engine"]) == 1 and len(nodes["trainer"]) == 1, nodes
    assert nodes["engine"] != nodes["trainer"], nodes  # disaggregated: different Ray nodes
    ips = _node_ips(cluster)
    used = {ips[n] for n in nodes["engine"] | nodes["trainer"]}
    assert used == {cluster.hosts[n] for n in cl.WORKER_NODES}, used  # on the GPU nodes, not the head
    rollouts = _s3_ls(f"{cluster.store_root}/cluster-dis/rollouts/train")
    assert len(rollouts) == 3, rollouts
    assert _local_files(cluster) == before  # nothing under a local store root or local result storage


def test_colocated_run_shares_one_node(cluster, api):
    run = _run_from_pool("rl_train", _train_params(cluster, "cluster-col", COLOCATED, "colocate", 1))
    assert run.state.name == "Completed", _logs(run.id)
    nodes = _actor_nodes(cluster, "cluster-col")
    assert nodes["engine"] == nodes["trainer"] and len(nodes["engine"]) == 1, nodes


def test_local_store_root_refused_from_the_cli_in_one_line(cluster, tmp_path):
    root = tmp_path / "runs"
    ns = cluster.namespace("head")
    argv = (["ip", "netns", "exec", ns] if ns else []) + [
        str(Path(sys.executable).with_name("rollflow")),
        "train",
        "--set",
        f"ray.address={cluster.ray_address}",
        "--set",
        f"store.root={root}",
        "--set",
        "iterations=1",
    ]
    t0 = time.monotonic()
    env = {**os.environ, **cluster.client_env(), "COLUMNS": "400"}
    env.pop("ROLLFLOW_TRACEBACK", None)  # an in-process CLI test with --traceback in this worker may have set it
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "store.root=" in lines[0] and "s3://" in lines[0] and "store.shared_filesystem=true" in lines[0], lines[0]
    assert "3 nodes" in lines[0], lines[0]
    assert not root.exists()  # refused before anything was written
    print(f"refused in {took:.1f}s")


def test_local_store_root_refused_in_a_pool_run_before_any_worker(cluster, api, tmp_path):
    params = _train_params(cluster, "cluster-local", DISAGGREGATED, "disaggregated", 1)
    params["params"]["store"] = {"root": str(tmp_path / "runs")}
    run = _run_from_pool("rl_train", params, timeout=180)
    assert run.state.name == "Failed"
    logs = _logs_with(run.id, "is a local path, but the Ray cluster", "store.shared_filesystem=true")
    assert "is a local path, but the Ray cluster" in logs and "store.shared_filesystem=true" in logs, logs
    assert not any(n.startswith("start-workers") for n in _task_names(run.id))
    assert not _actor_nodes(cluster, "cluster-local")


def test_unsatisfiable_placement_fails_in_seconds_naming_what_is_missing(cluster, api):
    resources = {**DISAGGREGATED, "cpus_per_bundle": 4}  # nodes have 2 CPUs each: the totals suffice, no node does
    run = _run_from_pool("rl_train", _train_params(cluster, "cluster-big", resources, "disaggregated", 1), timeout=180)
    assert run.state.name == "Failed"
    logs = _logs_with(run.id, "cannot be placed", "no node has CPU 4")
    assert "cannot be placed" in logs and "no node has CPU 4" in logs, logs
    seconds = (run.end_time - run.start_time).total_seconds()
    assert seconds < 30, seconds  # not a pending-forever placement group (create_placement_group waits 60 s)


def _flow_params(cluster: cl.Cluster, flow_name: str, run: str, **extra) -> dict:
    """A flow's form pointed at the cluster: only the sections it has (the server validates against the schema)."""
    from rollflow.flows.params import SECTIONS

    sections = {**cluster.run_params(), "resources": DISAGGREGATED, **SMALL}
    return {"run": run, **{k: v for k, v in sections.items() if k in SECTIONS[flow_name]}, **extra}


def _ray_drivers_from(cluster: cl.Cluster, ip: str) -> list[str]:
    """Ray jobs (drivers) that connected from `ip`, by the state API."""
    from ray.util.state import list_jobs

    jobs = [j if isinstance(j, dict) else j.__dict__ for j in list_jobs(address=cluster.dashboard_url, limit=1000)]

    def driver_ip(job: dict) -> str | None:
        info = job.get("driver_info")
        return info.get("node_ip_address") if isinstance(info, dict) else getattr(info, "node_ip_address", None)

    return [str(j.get("job_id")) for j in jobs if driver_ip(j) == ip]


def test_replay_from_a_second_worker_host_is_cached_through_s3_without_ray(cluster, api):
    from prefect.client.orchestration import get_client

    source = "cluster-dis"  # the disaggregated test's 3 committed rollouts; made here when run alone
    if len(_s3_ls(f"{cluster.store_root}/{source}/rollouts/train")) < 2:
        source = _unique("cluster-src")
        made = _run_from_pool("rollout_only", {"params": _flow_params(cluster, "rollout_only", source, iterations=2)})
        assert made.state.name == "Completed", _logs(made.id)
    replay = {"rollout_ids": [0, 1], "source_run": source}
    first = _run_from_pool(
        "replay_train",
        {"params": _flow_params(cluster, "replay_train", _unique("replay-a")), **replay},
        queue=cl.DEFAULT_QUEUE,
    )
    assert first.state.name == "Completed", _logs(first.id)
    head_tasks = _task_runs(first.id)
    # it trained (a trainer on the cluster), or, on a reused cluster (ROLLFLOW_TEST_CLUSTER), hit an earlier cache
    assert any(t.name.startswith("start-workers") for t in head_tasks) or all(
        t.state.name == "Cached" for t in head_tasks if t.name.startswith("replay-train")
    ), [(t.name, t.state.name) for t in head_tasks]

    # a second worker, on another host (node2: no disk in common with the head), polling its own queue
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client, contextlib.suppress(ObjectAlreadyExists):  # a reused cluster has it
        client.create_work_queue(name="node2", work_pool_name=cl.POOL)
    name = cl.start_worker(cluster, "node2", "node2")
    try:
        drivers_before = _ray_drivers_from(cluster, cluster.hosts["node2"])
        again = _run_from_pool(
            "replay_train",
            {"params": _flow_params(cluster, "replay_train", _unique("replay-b")), **replay},
            queue="node2",
        )
        logs = _logs(again.id)
        assert again.state.name == "Completed", logs
        tasks = _task_runs(again.id)
        replays = [t for t in tasks if t.name.startswith("replay-train")]
        assert len(replays) == 2 and all(t.state.name == "Cached" for t in replays), [
            (t.name, t.state.name) for t in tasks
        ]
        assert not any(t.name.startswith("start-workers") for t in tasks)  # no trainer started
        assert _ray_drivers_from(cluster, cluster.hosts["node2"]) == drivers_before  # Ray never joined from node2
        assert "Worker 'node2' submitting flow run" in logs, logs  # the node2 worker is the one that ran it
    finally:
        cl.stop_pid(cluster.pids.pop(name))
        cluster.save()


def test_nightly_on_the_pool_fails_loudly_on_drift_and_its_alert_fires(cluster, api):
    from prefect.client.orchestration import get_client

    from rollflow.flows.alignment import FLOW_NAME, NIGHTLY
    from rollflow.infra.automations import alert_name, automation_events

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(f"{FLOW_NAME}/{NIGHTLY}")
        assert dep.work_pool_name == cl.POOL and dep.schedules, dep
        [alert] = client.read_automations_by_name(alert_name(f"{FLOW_NAME}/{NIGHTLY}"))
        params = dict(dep.parameters)
        # drift beyond any bound: a mean |train - rollout| log-prob limit of 0 (fp32 sits at ~1e-5)
        params["thresholds"] = {
            **(params.get("thresholds") or {}),
            "mismatch_mean_warn": 0.0,
            "mismatch_mean_fail": 0.0,
        }
        params["params"] = {**params["params"], "run": _unique("nightly"), **SMALL}
        run = client.create_flow_run_from_deployment(dep.id, parameters=params)
    final = _wait_final(run.id, timeout=300)
    logs = _logs(run.id)
    assert final.state.name == "Failed", logs[-3000:]
    assert "failed: train_rollout_logprob_diff" in (final.state.message or ""), final.state.message
    deadline = time.monotonic() + 60
    while True:
        fired = [e for e in automation_events(alert.id) if e["event"] == "prefect.automation.triggered"]
        if any(str(run.id) in str(e) for e in fired):
            break
        assert time.monotonic() < deadline, f"no firing of the nightly alert for {run.id}: {fired[:3]}"
        time.sleep(1)


# ============================================================================= faults at this scale
# The destructive drills come last in the module (pytest runs a module's tests in file order): the other
# tests see an untouched cluster, and drill a (a raylet killed) is the last of all.

# a generate long enough (a few seconds of the tiny model) that a fault lands inside it
LONG_GENERATE = {
    "data": {"prompts_per_rollout": 64},
    "rollout": {"n_samples_per_prompt": 4, "threads": 1, "max_new_tokens": 16},
    "train": {"threads": 1},
}


def _unique(stem: str) -> str:
    # a reused cluster (ROLLFLOW_TEST_CLUSTER) keeps its bucket: a finished run of the same name would just resume
    return f"{stem}-{uuid.uuid4().hex[:6]}"


def _submit(cluster: cl.Cluster, run: str, iterations: int, **sections) -> object:
    """Create an rl_train run from `rl_train/pool` (the UI's Run call); returns the flow run id."""
    from prefect.client.orchestration import get_client

    params = _train_params(cluster, run, DISAGGREGATED, "disaggregated", iterations)
    params["params"].update({**LONG_GENERATE, **sections})
    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("rl_train/pool")
        return client.create_flow_run_from_deployment(dep.id, parameters=params).id


def _wait_final(flow_run_id, timeout: float = 420):
    from prefect.client.orchestration import get_client

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.is_final():
                return run
            if time.monotonic() > deadline:
                raise AssertionError(f"flow run {run.name} still {run.state.name if run.state else None}")
            time.sleep(1)


def _iteration_tasks(run: str, rollout_id: int) -> dict[str, list]:
    """Task name prefix -> task runs of every flow run of `rl_iteration` for `rollout_id` (one per attempt of
    the parent run)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"{run}/iter-{rollout_id:04d}"]))
        )
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[c.id for c in children])))
    out: dict[str, list] = {}
    for t in sorted(tasks, key=lambda t: t.start_time or t.expected_start_time):
        out.setdefault(t.name.rsplit("-", 1)[0], []).append(t)
    return out


class S3Requests:
    """Follows the S3 endpoint's request log (one line per request) from now on."""

    def __init__(self, cluster: cl.Cluster):
        self.path = cl.log_path(cluster, "s3")
        self.offset = self.path.stat().st_size

    @staticmethod
    def lines_since(cluster: cl.Cluster, offset: int) -> list[str]:
        """Request lines logged after `offset` (the timestamps cut off, so repeated requests compare equal)."""
        with cl.log_path(cluster, "s3").open("rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
        return [line.split("] ", 1)[-1] for line in text.splitlines() if "] " in line]

    def wait_for(self, pattern: str, timeout: float, stop: threading.Event | None = None) -> str | None:
        deadline = time.monotonic() + timeout
        buffer = ""
        while time.monotonic() < deadline and not (stop and stop.is_set()):
            with self.path.open("rb") as fh:
                fh.seek(self.offset)
                chunk = fh.read().decode(errors="replace")
            self.offset += len(chunk.encode())
            buffer += chunk
            for line in buffer.splitlines():
                if re.search(pattern, line):
                    return line
            buffer = buffer.rsplit("\n", 1)[-1]
            time.sleep(0.02)
        return None


def _wait_actor(cluster: cl.Cluster, run: str, role: str, timeout: float = 180) -> dict:
    """The ALIVE actor `<run>:<role>` through Ray's state API."""
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for actor in list_actors(
            address=cluster.dashboard_url,
            filters=[("name", "=", f"{run}:{role}")],
            detail=True,
            raise_on_missing_output=False,
        ):
            actor = actor if isinstance(actor, dict) else actor.__dict__
            if actor.get("state") == "ALIVE":
                return actor
        time.sleep(0.5)
    raise AssertionError(f"actor {run}:{role} not alive after {timeout:.0f}s")


def _host_of(cluster: cl.Cluster, node_id: str) -> str:
    ip = {n["node_id"]: n["node_ip"] for n in cl.ray_nodes(cluster)}[node_id]
    return next(h for h, addr in cluster.hosts.items() if addr == ip)


def _wait_generating(cluster: cl.Cluster, run: str, rollout_id: int, timeout: float = 240) -> dict:
    """Once rollout `rollout_id - 1` is committed (its manifest PUT on S3), the engine of `run` is alive and
    generating rollout `rollout_id` (sync is a second or two); returns the engine actor."""
    requests = S3Requests(cluster)
    pattern = rf"PUT /{cl.BUCKET}/runs/{run}/rollouts/train/{rollout_id - 1:06d}/manifest"
    assert requests.wait_for(pattern, timeout), f"rollout {rollout_id - 1} of {run} never committed"
    engine = _wait_actor(cluster, run, "engine")
    _wait_task_running(cluster, engine["actor_id"], "rollout", timeout=60)
    return engine


def _wait_task_running(cluster: cl.Cluster, actor_id: str, method: str, timeout: float) -> None:
    from ray.util.state import list_tasks

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in list_tasks(
            address=cluster.dashboard_url, filters=[("actor_id", "=", actor_id)], raise_on_missing_output=False
        ):
            task = task if isinstance(task, dict) else task.__dict__
            if task.get("name", "").endswith(f".{method}") and task.get("state") == "RUNNING":
                return
        time.sleep(0.2)
    raise AssertionError(f"no {method} call running on actor {actor_id} after {timeout:.0f}s")


def _manifests(cluster: cl.Cluster, run: str) -> dict[int, bytes]:
    fs, base = open_fs(cluster.store_root)
    fs.invalidate_cache()
    folder = f"{base.rstrip('/')}/{run}/rollouts/train"
    found = [p for p in fs.find(folder) if p.endswith("/manifest.json")] if fs.exists(folder) else []
    return {int(p.split("/")[-2]): fs.cat_file(p) for p in found}


def _weights(cluster: cl.Cluster, run: str, iteration: int) -> dict:
    import torch

    blob = load_checkpoint(cluster.store_root, run, iteration)
    return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)["model"]


def _assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] == b[name]).all(), name


# ----------------------------------------------------------------------------- drill d: S3 frozen


ANSWER_GRACE_S = 0.3  # far beyond writing one small answer, well inside a generate of DRILL_D_ROLLOUT
# The tiny model answers in ~4 tokens, so LONG_GENERATE's one batch of 256 generates in < 0.3 s; one sample at a
# time it takes ~1.5 s on an idle host.
DRILL_D_ROLLOUT = {**LONG_GENERATE["rollout"], "max_batch_size": 1}


def test_drill_d_s3_endpoint_frozen_during_persist_run_completes_nothing_lost(cluster, api):
    run = _unique("drill-d")
    s3_pid = cluster.pids["s3"]
    requests = S3Requests(cluster)
    flow_run_id = _submit(cluster, run, 2, rollout=DRILL_D_ROLLOUT)
    frozen: dict[str, float] = {}
    persist_seen: str | None = None
    generate_seen = False
    try:
        # rollout 1 is not committed yet (the iteration's one check before generating; its last request: a prefix
        # listing) -> its generate starts (no S3 request) -> the endpoint is frozen -> its persist starts against
        # the frozen endpoint (a persist is over in ~0.1 s: too short to aim at from outside). A loaded box can
        # make the generate outlast any fixed freeze, so the freeze lasts until the persist is seen running (its
        # state goes to the Prefect server, not to S3) and 15 s more
        line = requests.wait_for(
            rf"GET /{cl.BUCKET}\?list-type=2&prefix=runs/{run}/rollouts/train/000001/manifest", 300
        )
        assert line, _logs(flow_run_id)
        # The endpoint logs a request before it writes the answer (http.server's send_response): frozen right after
        # the line, it can hold that answer back, and the check, not the persist, waits the freeze out.
        time.sleep(ANSWER_GRACE_S)
        os.kill(s3_pid, signal.SIGSTOP)
        frozen["at"] = time.monotonic()
        running_at = None
        while time.monotonic() - frozen["at"] < 180:
            tasks = _iteration_tasks(run, 1)
            generate_seen = generate_seen or bool(tasks.get("generate-train"))
            persists = tasks.get("persist", [])
            if persists and running_at is None:
                persist_seen = persists[0].state.name if persists[0].state else None
                if persist_seen == "Running":
                    running_at = time.monotonic()
                elif persist_seen in ("Completed", "Failed", "Crashed"):
                    break  # it ran before the freeze: reported below
            if running_at is not None and time.monotonic() - running_at >= 15:
                break
            time.sleep(0.5)
    finally:
        thaw_offset = cl.log_path(cluster, "s3").stat().st_size
        os.kill(s3_pid, signal.SIGCONT)
    frozen["for"] = time.monotonic() - frozen["at"]
    final = _wait_final(flow_run_id)
    logs = _logs(flow_run_id)
    assert final.state.name == "Completed", logs
    tasks = _iteration_tasks(run, 1)
    (persist,), (generate,) = tasks["persist"], tasks["generate-train"]
    took = (persist.end_time - persist.start_time).total_seconds()
    generate_s = (generate.end_time - generate.start_time).total_seconds()
    print(
        f"endpoint frozen {frozen['for']:.1f}s; generate of rollout 1: {generate_s:.1f}s; "
        f"persist: {took:.1f}s, {persist.run_count} attempt(s)"
    )
    assert persist.state.name == "Completed"
    assert persist_seen == "Running", f"the persist of rollout 1 was {persist_seen} while the endpoint was frozen; " + (
        "its generate ran" if generate_seen else "its generate never started (the check before it was held)"
    )
    assert took >= 10, (took, persist.run_count)  # it waited the freeze out instead of failing or skipping it
    # botocore timed the frozen request out and sent it again: both copies reach the endpoint when it thaws
    after = S3Requests.lines_since(cluster, thaw_offset)
    assert len(after) > len(set(after)), after[:20]
    assert assert_nothing_half_visible(cluster.store_root, run) == [0, 1]
    assert sorted(_manifests(cluster, run)) == [0, 1]
    assert list_checkpoints(cluster.store_root, run) == [1, 2]


# ----------------------------------------------------------------------------- drill c: a node cut off

STALL_S = 10.0  # the drills' stall deadline (watchdog.stall_s); production keeps its 600 s default
LINK_DOWN_S = 30.0


def _run_logs(run: str) -> list:
    """Log records of the run's flow run and its iterations' flow runs, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=run)))
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[r.id for r in runs])))
    return sorted(logs, key=lambda entry: entry.timestamp)


def _first_checkpoint_committed(cluster: cl.Cluster, run: str, requests: S3Requests, timeout: float = 300) -> None:
    # iteration 1 ends with its checkpoint; the next call is rollout 1's generate, a fault now lands inside it
    line = requests.wait_for(rf"PUT /{cl.BUCKET}/runs/{run}/checkpoints/000001/meta.json", timeout)
    assert line, f"run {run} never committed checkpoint 1"


def test_drill_c_node_cut_off_mid_generate_fails_in_bounded_time_naming_the_node_then_completes(cluster, api):
    if cluster.mode != "netns":
        pytest.skip("cutting a host's link needs network namespaces (root)")
    run = _unique("drill-c")
    requests = S3Requests(cluster)
    flow_run_id = _submit(cluster, run, 2, watchdog={"stall_s": STALL_S, "probe_every": 0})
    engine = _wait_actor(cluster, run, "engine")
    host = _host_of(cluster, engine["node_id"])
    _first_checkpoint_committed(cluster, run, requests)
    cl.set_link(host, False)
    cut = time.time()
    try:
        time.sleep(LINK_DOWN_S)
    finally:
        cl.set_link(host, True)
    final = _wait_final(flow_run_id)
    logs = _run_logs(run)
    text = "\n".join(entry.message for entry in logs)
    assert final.state.name == "Completed", text[-4000:]
    stalls = [e for e in logs if "stalled: actor" in e.message]
    assert stalls, text[-4000:]
    first = stalls[0]
    assert f"on node {cluster.hosts[host]}" in first.message and engine["node_id"] in first.message, first.message
    bound = first.timestamp.timestamp() - cut
    print(f"link of {host} down {LINK_DOWN_S:.0f}s: '{first.message[:160]}' after {bound:.1f}s")
    # no silent hang: stall_s, the blame pings (5 s), the stack dump on the cut node (up to 20 s: it is not
    # reachable, its section says so) and the stack file
    assert bound <= STALL_S + 5 + 20 + 10, bound
    generate = _iteration_tasks(run, 1)["generate-train"]
    assert [t.state.name for t in generate] == ["Completed"] and generate[0].run_count == 2, generate
    assert assert_nothing_half_visible(cluster.store_root, run) == [0, 1]


# ----------------------------------------------------------------------------- drill b: PostgreSQL restarted

PG_DOWN_S = 8.0


@pytest.fixture(scope="module")
def uninterrupted() -> dict[int, str]:
    """Iterations -> a run of the drills' config that went straight through (drill b's run: a database restart
    changes nothing the trainer computes), the reference of drill a's weights."""
    return {}


def test_drill_b_postgres_restarted_mid_run_the_run_keeps_going_and_completes(cluster, api, uninterrupted):
    run = _unique("drill-b")
    requests = S3Requests(cluster)
    flow_run_id = _submit(cluster, run, 3)
    _first_checkpoint_committed(cluster, run, requests)
    old = cluster.pids["postgres"]
    server_log = cl.log_path(cluster, "prefect-server")
    offset = server_log.stat().st_size
    t0 = time.monotonic()
    cl.restart_postgres(cluster, down_s=PG_DOWN_S)
    print(f"PostgreSQL restarted (pid {old} -> {cluster.pids['postgres']}) in {time.monotonic() - t0:.1f}s")
    assert cluster.pids["postgres"] != old
    final = _wait_final(flow_run_id)
    text = "\n".join(entry.message for entry in _run_logs(run))
    assert final.state.name == "Completed", text[-4000:]
    assert final.run_count == 1  # kept going: not a retry of the whole run
    with server_log.open("rb") as fh:
        fh.seek(offset)
        outage = fh.read().decode(errors="replace")
    # the server did fail requests while its database was away (the clients' retries absorbed them)
    assert "Connect call failed" in outage or "CannotConnectNow" in outage, outage[-2000:]
    assert sorted(_manifests(cluster, run)) == [0, 1, 2]
    assert list_checkpoints(cluster.store_root, run) == [1, 2, 3]
    uninterrupted[3] = run


# ----------------------------------------------------------------------------- drill a: a raylet killed


def test_drill_a_raylet_of_the_engine_node_killed_then_ui_retry_resumes_with_the_same_weights(
    cluster, api, uninterrupted
):
    from prefect.client.orchestration import get_client
    from prefect.states import AwaitingRetry

    run = _unique("drill-a")
    requests = S3Requests(cluster)
    flow_run_id = _submit(cluster, run, 3, watchdog={"stall_s": STALL_S, "probe_every": 0})
    engine = _wait_actor(cluster, run, "engine")
    host = _host_of(cluster, engine["node_id"])
    raylet = cl.raylet_pid(cluster, host)
    # right after checkpoint 1: the kill lands in the weight sync to the engine or at the start of rollout 1's
    # generate (aiming at generate through the state API is unreliable: it lags, a kill then hit iteration 0's sync)
    _first_checkpoint_committed(cluster, run, requests)
    os.kill(raylet, signal.SIGKILL)
    killed = time.time()
    first = _wait_final(flow_run_id, timeout=240)
    failed_after = time.time() - killed
    named = (engine["node_id"], cluster.hosts[host])
    # the flow run process ships its last log records (the failure among them) in batches, after its final state:
    # read until they are in, a bounded while
    deadline = time.monotonic() + 30
    while True:
        text = "\n".join(entry.message for entry in _run_logs(run))
        if any(name in text for name in named) or time.monotonic() > deadline:
            break
        time.sleep(1)
    print(f"raylet of {host} killed; flow run {first.state.name} after {failed_after:.1f}s")
    # no silent hang: the call fails (actor died), the task retry finds no node with room for the engine's bundle
    # (the other GPU node holds the trainer) and fails naming the lost node, PLACEMENT_WAIT_S after Ray marks it dead
    assert failed_after < 150, failed_after
    # the engine's node is named: Ray's ActorDiedError ("its node has died"), the stall watch, start_actor's
    # unplaceable bundle, or ActorUnavailable (Ray's ActorUnavailableError, "Socket closed", with the node added)
    assert any(name in text for name in named), text[-4000:]
    before = _manifests(cluster, run)

    if first.state.name != "Completed":
        cl.start_node(cluster, host)  # the operator brings the node back (a new node id, same resources)
        with get_client(sync_client=True) as client:  # the UI's Retry button
            client.set_flow_run_state(flow_run_id, AwaitingRetry(message="Retry from the UI"), force=True)
        final = _wait_final(flow_run_id)
        text = "\n".join(entry.message for entry in _run_logs(run))
        assert final.state.name == "Completed", text[-4000:]
        assert final.run_count == 2
        assert "resumes from checkpoint" in text, text[-4000:]
    after = _manifests(cluster, run)
    assert {k: v for k, v in after.items() if k in before} == before  # no committed rollout regenerated
    assert sorted(after) == [0, 1, 2]

    reference = uninterrupted.get(3)
    if reference is None:  # drill a alone (-k): its own straight run
        reference = _unique("drill-a-straight")
        assert _wait_final(_submit(cluster, reference, 3)).state.name == "Completed"
    _assert_same_weights(_weights(cluster, run, 3), _weights(cluster, reference, 3))
